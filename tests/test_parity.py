"""`eyas parity` against local HTTP servers that speak each engine's format:

* vLLM: /v1/models, /v1/chat/completions and Prometheus counters on /metrics named as in
  vllm/v1/spec_decode/metrics.py (SpecDecodingProm: vllm:spec_decode_num_drafts,
  _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos{position}; the Prometheus
  client exposes counters with a `_total` suffix).
* SGLang: native /generate answering `meta_info` with `completion_tokens` and `spec_verify_ct`
  (tokenizer_manager sets spec_verify_ct on finished requests when speculative decoding is on).
"""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eyas.config import Config
from eyas.parity import compare, eval_prompts, parse_prometheus, run_parity, vllm_counters
from eyas.util import EyasError

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly."]


class FakeEngine:
    """Counts requests and answers as the engine would, with a chosen acceptance per request:
    `drafts` verify steps, `accepted` tokens accepted at each draft position (k = len(accepted))."""

    def __init__(self, engine, drafts, accepted, answers=None):
        self.engine, self.drafts, self.accepted = engine, drafts, accepted
        self.answers = list(answers or [])  # token ids to answer with, in order (none: text alone)
        self.counters = {"d": 7.0, "dt": 21.0, "a": 9.0, "pos": [5.0, 3.0, 1.0]}  # earlier traffic
        self.requests = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, body: bytes, ctype="application/json"):
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics" and outer.engine == "vllm":
                    self._send(outer.metrics().encode(), "text/plain; version=0.0.4")
                elif self.path == "/v1/models":
                    self._send(json.dumps({"data": [{"id": "served-model"}]}).encode())
                else:
                    self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if self.path == "/v1/chat/completions" and outer.engine == "vllm":
                    c = outer.counters
                    k = len(outer.accepted)
                    c["d"] += outer.drafts
                    c["dt"] += outer.drafts * k
                    c["a"] += sum(outer.accepted)
                    c["pos"] = [p + a for p, a in zip(c["pos"], outer.accepted)]
                    n = outer.drafts + sum(outer.accepted)
                    choice = {"message": {"content": "x"}}
                    if outer.answers and body.get("return_token_ids"):
                        choice["token_ids"] = outer.answers.pop(0)
                    self._send(json.dumps({"choices": [choice], "usage": {"completion_tokens": n}}).encode())
                elif self.path == "/generate" and outer.engine == "sglang":
                    n = outer.drafts + sum(outer.accepted)
                    # rounds by drafts accepted: accepted[i] rounds took position i, so rounds that took exactly i
                    # are reached(i) - reached(i+1)
                    reach = [outer.drafts] + list(outer.accepted) + [0]
                    hist = [reach[i] - reach[i + 1] for i in range(len(outer.accepted) + 1)]
                    out = {"text": "x", "meta_info": {
                        "completion_tokens": n, "spec_verify_ct": outer.drafts, "e2e_latency": 0.1,
                        "spec_correct_drafts_histogram": hist}}
                    if outer.answers:
                        out["output_ids"] = outer.answers.pop(0)
                    self._send(json.dumps(out).encode())
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def metrics(self) -> str:
        c = self.counters
        lab = 'engine="0",model_name="served-model"'
        lines = []
        for name, v in (("vllm:spec_decode_num_drafts", c["d"]), ("vllm:spec_decode_num_draft_tokens", c["dt"]),
                        ("vllm:spec_decode_num_accepted_tokens", c["a"])):
            lines += [f"# HELP {name}_total x", f"# TYPE {name}_total counter", f"{name}_total{{{lab}}} {v}",
                      f"{name}_created{{{lab}}} 1.7e9"]
        for i, v in enumerate(c["pos"]):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {v}')
        lines.append('vllm:num_requests_running{engine="0",model_name="served-model"} 0.0')
        return "\n".join(lines) + "\n"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.server.shutdown()
        self.server.server_close()


def _cfg(tmp_path, tau=None):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = Config()
    cfg.out, cfg.target.name = str(tmp_path / "run"), "tiny"
    cfg.eval.prompts, cfg.eval.limit, cfg.eval.max_new_tokens, cfg.eval.k = str(prompts), 0, 16, 3
    if tau is not None:  # as `eyas eval` writes it: one answer to each of the three one-turn conversations
        (tmp_path / "run" / "eval").mkdir(parents=True)
        (tmp_path / "run" / "eval" / "report.json").write_text(json.dumps({
            "target": "tiny", "k": 3, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16,
            "prompts": {"set": prompts.name, "count": 3, "conversations": 3},
            "acceptance_length": tau, "per_position_acceptance": [0.8, 0.5, 0.2],
            "by_turn": {"1": {"answers": 3, "acceptance_length": tau, "per_position_acceptance": [0.8, 0.5, 0.2]}}}))
    return cfg


# 10 drafts per request with [8, 5, 2] accepted at positions 0..2: tau = 1 + 15/10 = 2.5
GOOD = (10, [8, 5, 2])
BAD = (10, [3, 0, 0])  # tau = 1.3: the drafter loads but the engine accepts a fraction


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_parity_matches(tmp_path, tiny, engine):
    cfg = _cfg(tmp_path, tau=2.4)
    with FakeEngine(engine, *GOOD) as srv:
        res = run_parity(cfg, endpoint=srv.url + ("/v1" if engine == "vllm" else ""), engine=engine,
                         tokenizer=tiny.tokenizer)
    assert res["engine_acceptance_length"] == pytest.approx(2.5)
    assert res["flagged"] is False and res["verdict"].startswith("ok")
    assert res["gap"] == pytest.approx((2.4 - 2.5) / 2.4)
    assert res["prompts"]["count"] == 3
    saved = json.loads((tmp_path / "run" / "eval" / "parity.json").read_text())
    assert saved["engine_acceptance_length"] == pytest.approx(2.5) and saved["eyas_acceptance_length"] == 2.4
    posts = [b for p, b in srv.requests]
    assert len(posts) == 3
    if engine == "vllm":
        # only the traffic of this run counts, not the counters' earlier totals
        # vLLM counts the drafts whose first i+1 tokens were accepted; eyas' report, each position given the ones
        # before it: both are given both ways, so they compare position by position
        assert res["engine_per_position_reached"] == pytest.approx([0.8, 0.5, 0.2])
        assert res["engine_per_position_acceptance"] == pytest.approx([0.8, 0.5 / 0.8, 0.2 / 0.5])
        assert res["eyas_per_position_reached"] == pytest.approx([0.8, 0.8 * 0.5, 0.8 * 0.5 * 0.2])
        assert res["engine_k"] == 3 and not res["notes"]
        assert all(b["max_tokens"] == 16 and b["temperature"] == 0.0 and b["model"] == "served-model" for b in posts)
        assert [b["messages"] for b in posts] == [[{"role": "user", "content": p}] for p in PROMPTS]
    else:
        assert all(b["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0} for b in posts)
        assert PROMPTS[0] in posts[0]["text"] and posts[0]["text"].rstrip().endswith("assistant")
        # SGLang's acceptance histograms give the same per-position figures as vLLM's counters
        assert res["engine_per_position_reached"] == pytest.approx([0.8, 0.5, 0.2])
        assert res["engine_counters"]["accepted_histogram"] == [6, 9, 9, 6]
    # each prompt's own rounds, (Σ (accepted + 1), rounds): 10 rounds that took 15 drafts
    assert res["engine_by_prompt"] == [[25, 10]] * 3
    assert "pairs" not in res["paired"] and "rounds per conversation" in res["paired"]["why"]
    assert "no token ids" in res["answers"]["why"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_parity_compares_each_answer_with_eyas_and_pairs_the_same_ones(tmp_path, tiny, engine):
    """With token ids from the engine and eyas' first answers in its report, parity says which answers are the same
    token for token (one side's extra end-of-turn token allowed), where the others part, and the paired τ over the
    same answers alone."""
    cfg = _cfg(tmp_path, tau=2.4)
    ids = []
    eval_prompts(cfg, ids)
    path = tmp_path / "run" / "eval" / "report.json"
    rep = json.loads(path.read_text())
    mine = {ids[0]: [20, 10], ids[1]: [24, 10], ids[2]: [28, 10]}
    answers = {ids[0]: [5, 6, 7, 2], ids[1]: [8, 9, 10], ids[2]: [11, 12, 13, 14]}
    order = [ids[1], ids[2], ids[0]]
    rep.update(turns=1, conversation_ids=order, rounds_by_conversation=[mine[i] for i in order],
               first_answer_ids=[answers[i] for i in order])
    path.write_text(json.dumps(rep))
    # in the order sent: the same; the same with the end-of-turn token 2 counted; parted at new token 2
    served = [[5, 6, 7, 2], [8, 9, 10, 2], [11, 12, 99, 14]]
    with FakeEngine(engine, *GOOD, answers=served) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine=engine, tokenizer=tiny.tokenizer)
    a = res["answers"]
    assert a["compared"] == 3 and a["same"] == 2 and a["first_difference"] == [None, None, 2]
    same = a["paired_same"]  # the engine's 2.5 against eyas' 2.0 and 2.4 on the first two
    assert same["pairs"] == 2 and same["tau_eyas"] == pytest.approx(2.2) and same["difference"] == pytest.approx(0.3)
    assert res["paired"]["pairs"] == 3 and "Answers the same token for token: 2 of 3; over those" in res["verdict"]
    saved = json.loads(path.with_name("parity.json").read_text())
    assert saved["answers"]["same"] == 2 and saved["answers"]["paired_same"]["pairs"] == 2
    # an older report without the answers says what to rerun
    del rep["first_answer_ids"]
    path.write_text(json.dumps(rep))
    with FakeEngine(engine, *GOOD, answers=served) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine=engine, tokenizer=tiny.tokenizer)
    assert "rerun `eyas eval`" in res["answers"]["why"] and "Answers the same" not in res["verdict"]


def test_parity_pairs_each_prompt_with_eyas_rounds_of_its_conversation(tmp_path, tiny):
    """With eyas' rounds per conversation in its report (one answer each), the engine's τ and eyas' pair prompt by
    prompt, matched by conversation id (the report lists them in another order here), with a paired interval."""
    cfg = _cfg(tmp_path, tau=2.4)
    ids = []
    eval_prompts(cfg, ids)
    assert len(ids) == 3
    path = tmp_path / "run" / "eval" / "report.json"
    rep = json.loads(path.read_text())
    mine = {ids[0]: [20, 10], ids[1]: [24, 10], ids[2]: [28, 10]}  # τ 2.0, 2.4, 2.8 against the engine's 2.5
    order = [ids[2], ids[0], ids[1]]
    rep.update(turns=1, conversation_ids=order, rounds_by_conversation=[mine[i] for i in order])
    path.write_text(json.dumps(rep))
    with FakeEngine("sglang", *GOOD) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine="sglang", tokenizer=tiny.tokenizer)
    p = res["paired"]
    assert p["pairs"] == 3 and p["tau_engine"] == pytest.approx(2.5) and p["tau_eyas"] == pytest.approx(2.4)
    assert p["difference"] == pytest.approx(0.1)
    lo, hi = p["interval"]
    assert -0.3 - 1e-9 <= lo <= 0.1 <= hi <= 0.5 + 1e-9 and lo < 0 < hi  # the per-prompt differences: +0.5, +0.1, -0.3
    assert "sglang minus eyas +0.100" in res["verdict"] and "no difference beyond" in res["verdict"]
    # a report that answered later turns too does not pair: its rounds are not those of the first answers
    rep["turns"] = 2
    path.write_text(json.dumps(rep))
    with FakeEngine("sglang", *GOOD) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine="sglang", tokenizer=tiny.tokenizer)
    assert "difference" not in res["paired"] and "eval.turns is not 1" in res["paired"]["why"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_parity_flags_degraded_acceptance(tmp_path, tiny, engine):
    cfg = _cfg(tmp_path, tau=2.5)
    with FakeEngine(engine, *BAD) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine=engine, tokenizer=tiny.tokenizer)
    assert res["engine_acceptance_length"] == pytest.approx(1.3)
    assert res["flagged"] is True and res["gap"] == pytest.approx(0.48)
    assert "FLAGGED" in res["verdict"] and "integration fault" in res["verdict"]
    assert json.loads((tmp_path / "run" / "eval" / "parity.json").read_text())["flagged"] is True


def test_parity_without_eyas_report_says_so(tmp_path, tiny):
    cfg = _cfg(tmp_path)
    with FakeEngine("vllm", *GOOD) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine="vllm")
    assert res["eyas_acceptance_length"] is None and res["flagged"] is None
    assert res["verdict"].startswith("incomplete") and "run `eyas eval`" in res["notes"][0]


def test_parity_errors_are_clear(tmp_path, tiny):
    cfg = _cfg(tmp_path, tau=2.0)
    with pytest.raises(EyasError, match="--endpoint is required"):
        run_parity(cfg, endpoint=None, engine="vllm")
    with FakeEngine("vllm", *GOOD) as srv:
        url = srv.url
        with pytest.raises(EyasError, match="HTTP 404"):  # a vLLM server asked the SGLang way
            run_parity(cfg, endpoint=url, engine="sglang", tokenizer=tiny.tokenizer)
    with pytest.raises(EyasError, match="cannot reach"):
        run_parity(cfg, endpoint=url, engine="vllm")
    with FakeEngine("sglang", *GOOD) as srv:  # SGLang has no vLLM spec counters on /metrics
        with pytest.raises(EyasError, match="HTTP 404"):
            run_parity(cfg, endpoint=srv.url, engine="vllm")


def test_prometheus_parsing():
    text = ('# TYPE vllm:spec_decode_num_drafts_total counter\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 4.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="a"} 6.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a"} 9\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 2\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 7\n'
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="a"} 1.7e9\n')
    c = vllm_counters(text)
    assert c["num_drafts"] == 10.0 and c["num_accepted_tokens"] == 9.0 and c["num_draft_tokens"] is None
    assert c["per_position"] == [7.0, 2.0]
    assert parse_prometheus('m{a="x,y",b="q\\"z"} 3')[0][1] == {"a": "x,y", "b": 'q\\"z'}
    assert compare(2.0, 2.5)["flagged"] is True and compare(2.2, 2.5)["flagged"] is False
    assert compare(3.0, 2.5)["flagged"] is True  # far above is as suspicious as far below


def test_parity_compares_eyas_first_answers(tmp_path, tiny, two_conversations):
    """Parity sends each conversation's first user turn (with the system turns before it), the prompt of its first
    answer in `eyas eval`, so the engine's τ is compared with eyas' over those answers (by_turn["1"]), not with its
    τ over every answer (later turns, which parity does not send, repeat more and accept more here)."""
    prompts = two_conversations
    cfg = _cfg(tmp_path)
    cfg.eval.prompts = str(prompts)
    (tmp_path / "run" / "eval").mkdir(parents=True)
    rep = {"target": "tiny", "k": 3, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16,
           "prompts": {"set": "p.jsonl", "count": 3, "conversations": 2}, "acceptance_length": 3.2,
           "per_position_acceptance": [0.9, 0.8, 0.7],
           "by_turn": {"1": {"answers": 2, "acceptance_length": 2.4, "per_position_acceptance": [0.8, 0.5, 0.2]},
                       "2": {"answers": 1, "acceptance_length": 3.9, "per_position_acceptance": [1.0, 1.0, 0.9]}}}
    (tmp_path / "run" / "eval" / "report.json").write_text(json.dumps(rep))
    with FakeEngine("vllm", *GOOD) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine="vllm")
    assert [b["messages"] for _, b in srv.requests] == [[{"role": "user", "content": "Hello there"}],
                                                        [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Name a fruit."}]]
    assert res["eyas_acceptance_length"] == 2.4 and res["flagged"] is False and not res["notes"]
    assert res["eyas_per_position_acceptance"] == [0.8, 0.5, 0.2]
    assert res["eyas_compared"].startswith('by_turn["1"]: eyas\' τ over the first answers') and "2 answers" in \
        res["eyas_compared"]
    assert "(by_turn[\"1\"]" in res["verdict"]
    # a report without by_turn: its τ over every answer, said to be so
    (tmp_path / "run" / "eval" / "report.json").write_text(json.dumps({k: v for k, v in rep.items() if k != "by_turn"}))
    with FakeEngine("vllm", *GOOD) as srv:
        res = run_parity(cfg, endpoint=srv.url, engine="vllm")
    assert res["eyas_acceptance_length"] == 3.2 and res["eyas_compared"].startswith("acceptance_length")
    assert any("has no by_turn" in n for n in res["notes"])


def test_parity_first_contact_times_out(tmp_path, monkeypatch):
    """A port that accepts connections but never answers is reported after a short wait (CONTACT_TIMEOUT), not the
    generations' long timeout."""
    import socket

    import eyas.parity as parity

    monkeypatch.setattr(parity, "CONTACT_TIMEOUT", 0.5)
    cfg = _cfg(tmp_path, tau=2.0)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel completes connections; nothing ever reads them
    url = f"http://127.0.0.1:{mute.getsockname()[1]}"
    got = []

    def call():
        try:
            run_parity(cfg, endpoint=url, engine="vllm")
        except EyasError as e:
            got.append(str(e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    mute.close()  # lets a call still waiting fail, so the test ends either way
    assert not t.is_alive() and got, "parity waited on the mute port"
    assert got[0] == (f"{url}: the server accepted the connection but did not answer GET /v1/models within 0.5 s: "
                      f"is the engine still loading, or is another program listening on that port?")


def test_parity_refuses_bad_endpoints_engines_and_run_directories(tmp_path):
    cfg = _cfg(tmp_path, tau=2.0)
    for endpoint, engine, msg in (
            ("127.0.0.1:9", "vllm", "--endpoint '127.0.0.1:9' is not an http:// or https:// URL with a host: give "
                                    "http://127.0.0.1:9"),
            ("http://[bad", "vllm", "--endpoint 'http://[bad' is not a valid URL"),
            ("http://127.0.0.1:9", None, "--engine is required: which engine serves the drafter (vllm or sglang)"),
            ("http://127.0.0.1:9", "tgi", "--engine must be vllm or sglang, got 'tgi'")):
        with pytest.raises(EyasError) as e:
            run_parity(cfg, endpoint=endpoint, engine=engine)
        assert str(e.value).startswith(msg), str(e.value)
    (tmp_path / "F").write_text("")
    cfg.out = str(tmp_path / "F")
    with FakeEngine("vllm", *GOOD) as srv:  # refused before any prompt is sent
        with pytest.raises(EyasError, match="--out .*F: .*F is a file, not a folder"):
            run_parity(cfg, endpoint=srv.url, engine="vllm")
    assert srv.requests == []


def test_sglang_acceptance_counts_a_request_without_verify_steps():
    """SGLang omits spec_verify_ct from a request answered at its prefill: it counts as 0 verify steps, while a
    server that never reports the key (not drafting) is refused."""
    from eyas.parity import sglang_acceptance
    from eyas.util import EyasError

    got = sglang_acceptance([{"completion_tokens": 9, "spec_verify_ct": 3}, {"completion_tokens": 1}])
    assert got["acceptance_length"] == pytest.approx(10 / 3)
    assert got["counters"] == {"completion_tokens": 10, "spec_verify_ct": 3}
    # without histograms: no per-position figures, and each request's rounds are its tokens over its verify steps
    assert got["per_position_acceptance"] is None and got["by_prompt"] == [(9, 3), (1, 0)]
    # histograms of unequal lengths (a request that never accepted 2) add up; the older key name reads too
    got = sglang_acceptance([{"completion_tokens": 9, "spec_verify_ct": 4, "spec_correct_drafts_histogram": [1, 2, 1]},
                             {"completion_tokens": 3, "spec_verify_ct": 2, "spec_accept_histogram": [1, 1]}])
    assert got["counters"]["accepted_histogram"] == [2, 3, 1]
    assert got["per_position_acceptance"] == pytest.approx([4 / 6, 1 / 6])
    assert got["by_prompt"] == [(1 + 4 + 3, 4), (1 + 2, 2)]
    with pytest.raises(EyasError, match="spec_verify_ct"):
        sglang_acceptance([{"completion_tokens": 4}, {"completion_tokens": 2}])
