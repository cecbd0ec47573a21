"""eyas regen: conversation walking, the server backend against a real local HTTP server, the
embedded backend with the tiny and the real SmolLM2 target, kill -9 and resume for both."""
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eyas.config import Config
from eyas.data import Conversation, Turn, read_dataset
from eyas.data.conversation import split_reasoning
from eyas.data.prepare import regen_dir
from eyas.data.regen import run_regen
from eyas.data.regen_conv import ConvState
from eyas.data.regen_report import validation_report
from eyas.data.server import chat_url
from eyas.engine.turn import TurnResult
from eyas.util import EyasError, read_json

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- pieces


def test_conversation_walk_keeps_prompts_and_limits_turns():
    conv = Conversation("a", [Turn("assistant", "greeting before any user"), Turn("system", "S"), Turn("user", "u1"),
                              Turn("assistant", "old1"), Turn("user", "u2"), Turn("assistant", "old2"),
                              Turn("user", "u3")])
    st = ConvState(0, conv)
    seen = []
    while (msgs := st.next_messages()) is not None:
        seen.append([m["content"] for m in msgs])
        st.accept(TurnResult("x", content=f"new{len(seen)}", completion_tokens=1))
    # leading assistant dropped; originals replaced; a final unanswered user turn gets an answer
    assert seen == [["S", "u1"], ["S", "u1", "new1", "u2"], ["S", "u1", "new1", "u2", "new2", "u3"]]
    rec = st.record({}, {})
    assert [m["content"] for m in rec["messages"]] == ["S", "u1", "new1", "u2", "new2", "u3", "new3"]

    st = ConvState(0, conv, max_turns=1)
    assert st.next_messages() is not None
    st.accept(TurnResult("x", content="only", completion_tokens=1))
    assert st.next_messages() is None
    assert [m["content"] for m in st.record({}, {})["messages"]] == ["S", "u1", "only"]

    st = ConvState(0, conv)  # an empty second answer: the conversation ends at the last good answer
    st.next_messages(); st.accept(TurnResult("x", content="good"))
    st.next_messages(); st.accept(TurnResult("x", content="  "))
    assert st.next_messages() is None and st.stopped == "empty_answer"
    assert [m["content"] for m in st.record({}, {})["messages"]] == ["S", "u1", "good"]


def test_conversation_walk_with_the_source_history():
    """regen.later_turns' walk: the first answer kept as the source has it, every later one asked with the source's
    own answers before it, while the record holds the target's; a context stop ends the record at the last answer."""
    conv = Conversation("a", [Turn("system", "S"), Turn("user", "u1"), Turn("assistant", "old1"), Turn("user", "u2"),
                              Turn("assistant", "old2"), Turn("user", "u3"), Turn("assistant", "old3")])
    st = ConvState(0, conv, 0, "original", 1)
    seen = []
    while (msgs := st.next_messages()) is not None:
        seen.append([m["content"] for m in msgs])
        st.accept(TurnResult("x", content=f"new{len(seen) + 1}", completion_tokens=1))
    assert seen == [["S", "u1", "old1", "u2"], ["S", "u1", "old1", "u2", "old2", "u3"]]
    rec = st.record({}, {})
    assert [m["content"] for m in rec["messages"]] == ["S", "u1", "old1", "u2", "new2", "u3", "new3"]
    assert rec["meta"]["source_answers_kept"] == 1 and len(rec["meta"]["turns"]) == 2

    st = ConvState(0, conv, 0, "original")  # nothing kept: the first answer is asked for too
    first = st.next_messages()
    st.accept(TurnResult("x", content="new1"))
    assert [m["content"] for m in first] == ["S", "u1"]
    assert [m["content"] for m in st.next_messages()] == ["S", "u1", "old1", "u2"]

    st = ConvState(0, conv, 1, "original", 1)  # max_turns counts the answers asked for
    st.next_messages(); st.accept(TurnResult("x", content="new2"))
    assert st.next_messages() is None
    assert [m["content"] for m in st.record({}, {})["messages"]] == ["S", "u1", "old1", "u2", "new2"]

    st = ConvState(0, conv, 0, "original", 1)  # the third answer's prompt no longer fits
    st.next_messages(); st.accept(TurnResult("x", content="new2"))
    st.next_messages(); st.accept(TurnResult("x", finish_reason="context"))
    assert st.next_messages() is None and st.stopped == "context"
    assert [m["content"] for m in st.record({}, {})["messages"]] == ["S", "u1", "old1", "u2", "new2"]


def test_split_reasoning_and_urls():
    assert split_reasoning("<think>\nhmm\n</think>\n\nAnswer") == ("Answer", "hmm")
    assert split_reasoning("hmm</think>Answer") == ("Answer", "hmm")  # opening tag in the prompt
    assert split_reasoning("<think>cut short") == ("", "cut short")
    assert split_reasoning(" plain ") == ("plain", None)
    assert chat_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("https://h/x/chat/completions") == "https://h/x/chat/completions"
    with pytest.raises(EyasError):
        chat_url("h:1")


# --------------------------------------------------------------------------- a real local OpenAI-style server


class FakeOpenAI:
    """A chat-completions server on 127.0.0.1. The last user message picks the behaviour:
    [429xN]/[500xN]/[badjsonxN]/[slowxN] fail the first N attempts that way, [badjson-always],
    [400], [reasoning_content], [reasoning], [think]. Every answer says which turn it is."""

    def __init__(self, delay: float = 0.0, hang: float = 0.0):
        self.hang = hang  # [hangxN]: the first N attempts wait this long before answering
        self.broken = ""  # every request answered the same wrong way: a key of BROKEN
        self.attempts: Counter = Counter()
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.delay = delay
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.handle(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    BROKEN = {"400": (400, b'{"error": "unknown model"}'), "no_choices": (200, b'{"object": "chat.completion"}'),
              "null": (200, b'{"choices": [{"message": {"role": "assistant", "content": null}}]}'),
              "html": (200, b"<html><body>Bad Gateway</body></html>")}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def send(self, h, code, payload: bytes, headers=()):
        h.send_response(code)
        for k, v in headers:
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        try:
            h.wfile.write(payload)
        except OSError:
            pass

    def handle(self, h, body):
        msgs = body["messages"]
        user = [m["content"] for m in msgs if m["role"] == "user"][-1]
        turn = sum(m["role"] == "assistant" for m in msgs)
        key = (user, turn)
        with self.lock:
            self.attempts[key] += 1
            n = self.attempts[key]
            self.requests.append(body)
        if self.delay:
            time.sleep(self.delay)
        if self.broken:
            code, payload = self.BROKEN[self.broken]
            return self.send(h, code, payload)

        def first(tag):
            for part in user.split("["):
                if part.startswith(tag + "x"):
                    return n <= int(part[len(tag) + 1:].split("]")[0])
            return False

        if first("429"):
            return self.send(h, 429, b'{"error": "slow down"}', [("Retry-After", "0")])
        if first("500"):
            return self.send(h, 500, b'{"error": "boom"}')
        if first("badjson") or "[badjson-always]" in user:
            return self.send(h, 200, b'{"choices": [{"message": ')
        if first("slow"):
            time.sleep(1.5)
        if first("hang"):
            time.sleep(self.hang)
        if "[400]" in user:
            return self.send(h, 400, b'{"error": "prompt too long"}')
        content = f"answer {turn} to {user}"
        if "[huge" in user:  # a server that ignores max_tokens, saying so in its usage or not
            content = "many words " * 20000
        msg = {"role": "assistant", "content": content}
        if "[reasoning_content]" in user:
            msg["reasoning_content"] = f"thinking {turn}"
        elif "[reasoning]" in user:
            msg["reasoning"] = f"pondering {turn}"
        elif "[think]" in user:
            msg["content"] = f"<think>\ninline {turn}\n</think>\n\n{content}"
        out = {"id": "x", "object": "chat.completion", "model": body["model"],
               "choices": [{"index": 0, "message": msg, "finish_reason": "length" if "[long]" in user else "stop"}],
               "usage": {"prompt_tokens": 10 + turn, "completion_tokens": 40000 if "[huge]" in user else 5}}
        return self.send(h, 200, json.dumps(out).encode())


@pytest.fixture
def server():
    s = FakeOpenAI()
    yield s
    s.close()


def write_jsonl(path: Path, users: list[list[str]], system: str | None = None) -> Path:
    lines = []
    for i, us in enumerate(users):
        msgs = [{"role": "system", "content": system}] if system else []
        for u in us:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "original answer"}]
        lines.append(json.dumps({"id": f"c{i}", "messages": msgs}))
    path.write_text("\n".join(lines) + "\n")
    return path


def server_cfg(tmp_path, source, url, **regen) -> Config:
    cfg = Config(out=str(tmp_path / "run"))
    cfg.data.source = str(source)
    r = cfg.regen
    r.backend, r.endpoint, r.model, r.split = "server", [url], "m", "all"
    r.backoff, r.timeout, r.retries, r.concurrency, r.shard_size = 0.01, 0.5, 3, 4, 3
    for k, v in regen.items():
        setattr(r, k, v)
    return cfg


def test_server_backend_retries_reasoning_and_records(tmp_path, server):
    users = [["plain", "second"], ["[429x2] busy"], ["[500x1] flaky"], ["[badjsonx1] garbled"], ["[slowx1] slow"],
             ["[reasoning_content] a", "[reasoning_content] b"], ["[reasoning] c"], ["[think] d"], ["[400] too long"],
             ["[badjson-always] broken"], ["[long] cut"]]
    src = write_jsonl(tmp_path / "d.jsonl", users, system="be nice")
    rep = run_regen(server_cfg(tmp_path, src, server.url))
    assert rep["complete"] and rep["planned"] == 11 and rep["records"] == 9 and rep["duplicates"] == 0
    assert rep["errors"] == {"http_400": 1, "bad_response": 1}
    assert rep["retries"] == {"http_429": 2, "http_500": 1, "bad_response": 1 + 3, "timeout": 1}
    assert rep["truncated_turns"] == 1 and rep["assistant_turns"] == 11
    assert rep["turns_with_reasoning"] == 4 and rep["reasoning_capture_rate"] == pytest.approx(4 / 11)
    assert rep["completion_tokens"]["total"] == 55
    convs, rr = read_dataset(str(regen_dir(tmp_path / "run")))
    assert rr.n_skipped == 0
    by_id = {c.id: c for c in convs}
    assert set(by_id) == {f"c{i}" for i in range(11)} - {"c8", "c9"}
    c0 = by_id["c0"]
    assert [(t.role, t.content) for t in c0.turns] == [
        ("system", "be nice"), ("user", "plain"), ("assistant", "answer 0 to plain"),
        ("user", "second"), ("assistant", "answer 1 to second")]
    assert c0.meta["source_id"] == "c0" and c0.meta["sampling"]["temperature"] == 0.8
    assert [t["finish_reason"] for t in c0.meta["turns"]] == ["stop", "stop"]
    # the second request carried the regenerated first answer, not the original
    second = next(b for b in server.requests if b["messages"][-1]["content"] == "second")
    assert second["messages"][2] == {"role": "assistant", "content": "answer 0 to plain"}
    assert all("original answer" not in m["content"] for b in server.requests for m in b["messages"])
    r5 = [t for t in by_id["c5"].turns if t.role == "assistant"]
    assert [t.reasoning for t in r5] == ["thinking 0", "thinking 1"]
    assert by_id["c6"].turns[-1].reasoning == "pondering 0"
    assert by_id["c7"].turns[-1].reasoning == "inline 0" and by_id["c7"].turns[-1].content == "answer 0 to [think] d"
    assert by_id["c1"].meta["turns"][0]["retries"] == {"http_429": 2}
    made_now = ("this_call", "tokens_per_s")  # what the call itself did, beside the report of the data
    assert validation_report(tmp_path / "run") == {k: v for k, v in rep.items() if k not in made_now}
    assert rep["this_call"]["generated_tokens"] == rep["completion_tokens"]["total"]


def test_chat_template_kwargs_reach_the_server_and_capture_is_reported_per_turn(tmp_path, server, capsys):
    from eyas.data.inspect import inspect_data

    src = write_jsonl(tmp_path / "d.jsonl", [["[reasoning_content] a", "b"], ["[reasoning_content] c",
                                                                               "[reasoning_content] d"]])
    cfg = server_cfg(tmp_path, src, server.url, chat_template_kwargs='{"enable_thinking": true}')
    rep = run_regen(cfg)
    assert len(server.requests) == 4
    assert all(b["chat_template_kwargs"] == {"enable_thinking": True} for b in server.requests)
    assert rep["settings"]["chat_template_kwargs"] == {"enable_thinking": True}  # a change is a change of plan
    assert rep["reasoning_capture_by_turn"] == [{"turn": 1, "answers": 2, "with_reasoning": 2, "rate": 1.0},
                                                {"turn": 2, "answers": 2, "with_reasoning": 1, "rate": 0.5}]
    assert "(turn 1 100% of 2, turn 2 50% of 2)" in capsys.readouterr().err  # the regen's summary line
    assert inspect_data(cfg, report_dir=str(tmp_path / "run")) == 0
    assert "reasoning by answer turn: turn 1 100% of 2, turn 2 50% of 2" in capsys.readouterr().out
    # not set: the request carries no such field
    run_regen(server_cfg(tmp_path / "plain", src, server.url))
    assert "chat_template_kwargs" not in server.requests[-1]
    with pytest.raises(EyasError, match=r"regen.chat_template_kwargs must be a JSON object"):
        run_regen(server_cfg(tmp_path / "bad", src, server.url, chat_template_kwargs="[true]"))


def test_answers_are_cut_at_max_new_tokens_whatever_the_server_sends(tmp_path, server):
    """A server that ignores max_tokens (its usage saying so, or not): each answer is cut to regen.max_new_tokens
    tokens of the target's tokenizer and counted as cut at the length limit; a short answer is kept whole."""
    from eyas.config import TargetConfig
    from eyas.target import load_tokenizer

    src = write_jsonl(tmp_path / "d.jsonl", [["[huge] talk"], ["[huge-quiet] talk"], ["short"]])
    rep = run_regen(server_cfg(tmp_path, src, server.url, max_new_tokens=16))
    assert rep["records"] == 3 and rep["truncated_turns"] == 2 and rep["completion_tokens"]["max"] == 16
    tok = load_tokenizer(TargetConfig(name="smollm2"))
    by_id = {c.id: c for c in read_dataset(str(regen_dir(tmp_path / "run")))[0]}
    for cid in ("c0", "c1"):
        answer = by_id[cid].turns[-1].content
        assert answer.startswith("many words many") and len(tok(answer, add_special_tokens=False).input_ids) <= 16
        assert by_id[cid].meta["turns"][0]["finish_reason"] == "length"
    assert by_id["c2"].turns[-1].content == "answer 0 to short"
    assert by_id["c2"].meta["turns"][0] == {"finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 5}


def test_server_samples_ask_with_seeds_of_their_own(tmp_path, server):
    """regen.samples=3 through the server backend: every conversation is asked three times, each sample with a seed
    of its own (the server samples; its requests differ only by seed), and the records of samples 2 and 3 carry
    their suffixed ids beside the first's."""
    src = write_jsonl(tmp_path / "d.jsonl", [["alpha"], ["beta"]])
    rep = run_regen(server_cfg(tmp_path, src, server.url, samples=3))
    assert rep["complete"] and rep["planned"] == rep["records"] == 6 and rep["samples"] == 3
    ids = sorted(c.id for c in read_dataset(str(regen_dir(tmp_path / "run")))[0])
    assert ids == ["c0", "c0~sample2", "c0~sample3", "c1", "c1~sample2", "c1~sample3"]
    seeds = {}
    for b in server.requests:
        seeds.setdefault(b["messages"][-1]["content"], []).append(b["seed"])
    assert {k: len(set(v)) for k, v in seeds.items()} == {"alpha": 3, "beta": 3}


def test_a_regen_asking_for_fewer_sets_than_its_folder_holds_is_refused(tmp_path, server):
    """A standalone regen over a folder holding more samples (or later turns) than it asks for stops before any work,
    naming the sets, the setting that goes on with them and the files to delete: tokenize reads every shard there, so
    they would be trained on unasked. Going on with them, or deleting the files it names, then works."""
    src = write_jsonl(tmp_path / "d.jsonl", [["a1", "a2"], ["b1"]])
    assert run_regen(server_cfg(tmp_path, src, server.url, samples=3, turns=1, later_turns=True))["complete"]
    d = regen_dir(tmp_path / "run")
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    asked = len(server.requests)
    with pytest.raises(EyasError) as e:
        run_regen(server_cfg(tmp_path, src, server.url, samples=2, turns=1, later_turns=True))
    msg = str(e.value)
    assert "sample 3;" in msg and "--samples 3" in msg and "shard-s3-*, plan-s3.json" in msg and "later" not in msg
    with pytest.raises(EyasError) as e:
        run_regen(server_cfg(tmp_path, src, server.url, samples=1, turns=1))
    msg = str(e.value)
    assert "sample 2, sample 3, the later turns" in msg and "--samples 3 --later-turns" in msg
    assert "shard-later-*, plan-later.json" in msg and "regen.later_turns off" in msg
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before and len(server.requests) == asked  # untouched
    rep = run_regen(server_cfg(tmp_path, src, server.url, samples=3, turns=1, later_turns=True))  # goes on: all done
    assert rep["complete"] and rep["samples"] == 3 and len(server.requests) == asked
    for f in [*d.glob("shard-s3-*"), d / "plan-s3.json", *d.glob("shard-later-*"), d / "plan-later.json"]:
        f.unlink()  # as the message says
    rep = run_regen(server_cfg(tmp_path, src, server.url, samples=2, turns=1))
    assert rep["complete"] and rep["samples"] == 2 and rep["records"] == 4 and len(server.requests) == asked
    assert sorted(c.id for c in read_dataset(str(d))[0]) == ["c0", "c0~sample2", "c1", "c1~sample2"]


def test_training_on_an_unfinished_regen_says_so(tmp_path, server, capsys):
    """A standalone stage that trains on a regen folder whose run was cut (a shard of its plan missing) says how much
    is there and how to finish it, and goes on; a finished one, or shards put there by hand, say nothing."""
    from eyas.data.prepare import shard_progress, training_conversations

    src = write_jsonl(tmp_path / "d.jsonl", [["a1"], ["b1"], ["c1"], ["d1"]])
    cfg = server_cfg(tmp_path, src, server.url, samples=2, turns=1)
    run_regen(cfg)
    d = regen_dir(tmp_path / "run")
    assert shard_progress(d) == (4, 4)
    capsys.readouterr()
    assert len(training_conversations(cfg)[0]) == 8 and "unfinished" not in capsys.readouterr().err
    (d / "shard-s2-00001.jsonl").unlink()  # as a run cut before its last shard
    assert shard_progress(d) == (3, 4)
    convs = training_conversations(cfg)[0]
    err = capsys.readouterr().err
    assert len(convs) == 7 and f"regeneration in {d} is unfinished (3 of 4 shards written)" in err
    assert f"eyas regen --out {cfg.out}" in err
    for f in d.glob("plan*.json"):
        f.unlink()
    assert shard_progress(d) is None and len(training_conversations(cfg)[0]) == 7
    assert "unfinished" not in capsys.readouterr().err


def test_server_later_turns_ask_with_the_source_history(tmp_path, server):
    """regen.later_turns beside two samples: the conversations with a later user turn get a `~later` record whose
    later answers were each asked with the source's original answers before them (what the server was sent), its
    first answer the source's; the split and data.original_rest treat it as the source's copy; a rerun finds it
    done; regen.turns other than 1 is refused."""
    from eyas.data.prepare import training_conversations
    from eyas.data.readers import split_of

    src = write_jsonl(tmp_path / "d.jsonl", [["a1", "a2", "a3"], ["b1"], ["c1", "c2"]])
    cfg = server_cfg(tmp_path, src, server.url, turns=1, samples=2, later_turns=True)
    rep = run_regen(cfg)
    assert rep["complete"] and rep["planned"] == rep["records"] == 3 + 3 + 2
    assert rep["samples"] == 2 and rep["later_turns"] == 2 and rep["shards_total"] == 1 + 1 + 1
    assert rep["assistant_turns"] == 3 + 3 + 3  # the target's: the first answers twice, the later ones (2 + 1)
    d = regen_dir(tmp_path / "run")
    assert sorted(f.name for f in d.glob("*.jsonl")) == ["shard-00000.jsonl", "shard-later-00000.jsonl",
                                                          "shard-s2-00000.jsonl"]
    convs = {c.id: c for c in read_dataset(str(d))[0]}
    assert [t.content for t in convs["c0~later"].turns] == ["a1", "original answer", "a2", "answer 1 to a2", "a3",
                                                           "answer 2 to a3"]
    assert [t.content for t in convs["c2~later"].turns] == ["c1", "original answer", "c2", "answer 1 to c2"]
    assert "b1~later" not in convs and convs["c0~later"].meta["sampling"]["later_turns"] == "original history"
    asked = [b["messages"] for b in server.requests if b["messages"][-1]["content"] == "a3"]
    assert len(asked) == 1 and [m["content"] for m in asked[0]] == ["a1", "original answer", "a2", "original answer",
                                                                    "a3"]
    assert len({b["seed"] for b in server.requests if b["messages"][-1]["content"] == "a1"}) == 2  # the 2 samples
    assert split_of("x7_2~later", 0.3, 0.2) == split_of("x7_2", 0.3, 0.2)
    cfg.data.original_rest = True  # the first sample continues with the original later turns; ~later as it is
    train = {c.id: c for c in training_conversations(cfg)[0]}
    assert train["c0"].n_assistant() == 3 and train["c0~later"].n_assistant() == 3 and train["c0~sample2"].n_assistant() == 1
    n = len(server.requests)
    assert run_regen(cfg)["records"] == 8 and len(server.requests) == n
    with pytest.raises(EyasError, match="regen.turns=1"):
        run_regen(server_cfg(tmp_path, src, server.url, turns=0, later_turns=True))


def test_report_counts_looping_answers(tmp_path):
    """The regen report counts answers that loop (at least half of their word 6-grams seen earlier in them), per
    answer, over every shard: here 2 of 4."""
    from eyas.util import repeated_share

    loop = "again and again " * 12
    prose = "the hawk is taken from the nest and trained to hunt with its falconer over many patient weeks"
    assert repeated_share(loop.split(), 6) > 0.9 and repeated_share(prose.split(), 6) == 0
    half = " ".join(["w%d" % i for i in range(10)] * 2)  # 20 words, 15 6-grams, 5 of them seen before: 1/3
    recs = [{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": loop},
                                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": prose}]},
            {"id": "b", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": half}]},
            {"id": "c", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": loop}]}]
    (tmp_path / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))
    (tmp_path / "shard-s2-00000.jsonl").write_text(json.dumps(recs[2]) + "\n")
    rep = validation_report(tmp_path)
    assert rep["assistant_turns"] == 4 and rep["looping_answers"] == 2 and rep["looping_answer_rate"] == 0.5


def test_server_down_stops_with_progress_kept(tmp_path, server):
    src = write_jsonl(tmp_path / "d.jsonl", [["a"], ["b"], ["c"], ["d"]])
    cfg = server_cfg(tmp_path, src, server.url, shard_size=2, concurrency=1)
    run_regen(cfg)
    cfg2 = server_cfg(tmp_path, write_jsonl(tmp_path / "d2.jsonl", [["a"], ["b"]]), "http://127.0.0.1:9/v1",
                      retries=1)
    cfg2.out = str(tmp_path / "down")
    with pytest.raises(EyasError, match="cannot connect.*resume"):
        run_regen(cfg2)
    cfg2.regen.model = ""  # nothing there to name the model either: said as such, not as a missing model
    with pytest.raises(EyasError, match=r"cannot reach the server at http://127.0.0.1:9/v1/models .*is it running"):
        run_regen(cfg2)
    cfg.regen.temperature = 0.1  # a finished folder refuses other settings instead of mixing them
    with pytest.raises(EyasError, match="different 'settings'"):
        run_regen(cfg)


@pytest.mark.parametrize("broken,said", [("400", r"http_400: 5\), e\.g\. http://\S+: HTTP 400 .*unknown model"),
                                          ("no_choices", r"the server's answers unreadable: 5\).*KeyError"),
                                          ("null", r"the server's answers unreadable: 5\).*content is null"),
                                          ("html", r"the server's answers unreadable: 5\).*<html>")],
                         ids=["http_400", "no_choices", "null_content", "html"])
def test_a_server_failing_every_request_fails_the_call_and_a_rerun_asks_again(tmp_path, server, broken, said):
    """A server answering every request wrongly (HTTP 400; a 200 without `choices`, with null content, or HTML) makes
    regen stop with the server's error and how many conversations failed, leaving nothing a rerun takes for finished
    work: once the server is fixed, the same call regenerates every conversation."""
    src = write_jsonl(tmp_path / "d.jsonl", [[f"q{i}"] for i in range(5)])
    cfg = server_cfg(tmp_path, src, server.url, retries=1)
    server.broken = broken
    with pytest.raises(EyasError, match=r"regen stopped, no usable answer: all 5 conversations failed \(" + said):
        run_regen(cfg)
    d = regen_dir(tmp_path / "run")
    assert not list(d.glob("shard-*.jsonl")) and not list(d.glob("*.errors.json"))
    server.broken = ""
    rep = run_regen(cfg)
    assert rep["records"] == 5 and rep["complete"] and not rep["errors"]


def test_a_server_failing_every_request_stops_early(tmp_path, server):
    """With many conversations, the call stops once FAIL_FAST of them failed in a row, instead of asking the broken
    server for every one and recording them all as left out; answers made by an earlier call stay (a shard holding
    some of them and failures is reopened, its answers kept in its journal) and the failed ones are asked again."""
    from eyas.data.regen_failed import FAIL_FAST

    src = write_jsonl(tmp_path / "d.jsonl", [[f"q{i}"] for i in range(8 * FAIL_FAST)])
    cfg = server_cfg(tmp_path, src, server.url, concurrency=2, limit=4)
    assert run_regen(cfg)["records"] == 4
    server.broken, cfg.regen.limit = "400", 8 * FAIL_FAST
    n = len(server.requests)
    with pytest.raises(EyasError, match=rf"stopped, {FAIL_FAST} conversations in a row failed \(http_400: {FAIL_FAST}\)"
                                        r".*HTTP 400.*Nothing was recorded as done"):
        run_regen(cfg)
    assert len(server.requests) - n < 2 * FAIL_FAST
    d = regen_dir(tmp_path / "run")
    assert [f.name for f in sorted(d.glob("shard-*.jsonl"))] == ["shard-00000.jsonl"]
    assert [json.loads(x)["id"] for x in (d / "shard-00001.partial").read_text().splitlines()] == ["c3"]
    server.broken = ""
    n = len(server.requests)
    rep = run_regen(cfg)
    assert len(server.requests) - n == 8 * FAIL_FAST - 4
    assert rep["records"] == 8 * FAIL_FAST and rep["complete"] and not rep["errors"]


def _kill_and_resume(tmp_path, args: list[str], out: Path, n_shards: int, env=None) -> dict:
    """Start `python -m eyas regen ARGS`, kill -9 it once a shard is written, check the shards then
    present stay byte-identical after resuming."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.Popen([sys.executable, "-m", "eyas", "regen", *args, "--out", str(out)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    d = regen_dir(out)
    deadline = time.time() + 120
    while time.time() < deadline and not list(d.glob("shard-*.jsonl")) and p.poll() is None:
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    kept = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.glob("shard-*.jsonl")}
    assert 1 <= len(kept) < n_shards, f"the kill must land mid-run ({len(kept)} of {n_shards} shards done)"
    r = subprocess.run([sys.executable, "-m", "eyas", "regen", *args, "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming" in r.stderr
    for name, h in kept.items():
        assert hashlib.sha256((d / name).read_bytes()).hexdigest() == h
    return json.loads(r.stdout)


def test_server_kill9_resume(tmp_path):
    srv = FakeOpenAI(delay=0.05)
    try:
        src = write_jsonl(tmp_path / "d.jsonl", [[f"q{i}", f"r{i}"] for i in range(40)])
        ref = run_regen(server_cfg(tmp_path, src, srv.url, shard_size=4, concurrency=2))
        args = ["--backend", "server", "--endpoint", srv.url, "--model", "m", "--source", str(src), "--split",
                "all", "--shard-size", "4", "--concurrency", "2", "--backoff", "0.01"]
        rep = _kill_and_resume(tmp_path, args, tmp_path / "killed", 10)
    finally:
        srv.close()
    assert rep["records"] == ref["records"] == 40 and rep["duplicates"] == 0 and rep["complete"]
    ids = [c.id for c in read_dataset(str(regen_dir(tmp_path / "killed")))[0]]
    assert sorted(ids) == sorted(c.id for c in read_dataset(str(regen_dir(tmp_path / "run")))[0])
    assert len(ids) == len(set(ids))


def test_kill9_keeps_the_finished_conversations_of_an_open_shard(tmp_path):
    """A conversation that hangs keeps its shard open; the others' records are journaled as they finish, so a
    kill -9 loses only the hanging one: the resumed run asks for it alone (a torn last journal line is asked again)
    and writes the shard an uninterrupted run writes, byte for byte."""
    users = [[f"q{i}" + (" [hangx1]" if i == 3 else ""), f"r{i}"] for i in range(4)]
    src = write_jsonl(tmp_path / "d.jsonl", users)
    ref_srv = FakeOpenAI()
    try:
        run_regen(server_cfg(tmp_path, src, ref_srv.url, shard_size=4, timeout=120.0))
    finally:
        ref_srv.close()
    out = tmp_path / "killed"
    d = regen_dir(out)
    journal = d / "shard-00000.partial"
    args = ["--backend", "server", "--model", "m", "--source", str(src), "--split", "all", "--shard-size", "4",
            "--concurrency", "4", "--timeout", "120", "--backoff", "0.01", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hanging = FakeOpenAI(hang=60)
    try:
        p = subprocess.Popen([sys.executable, "-m", "eyas", "regen", *args, "--endpoint", hanging.url], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None and not (
                journal.exists() and journal.read_text().count("\n") == 3):
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        hanging.close()
    assert not (d / "shard-00000.jsonl").exists()
    lines = journal.read_text().splitlines()
    assert sorted(json.loads(x)["id"] for x in lines) == ["c0", "c1", "c2"]
    with journal.open("a") as f:  # a line cut short by the kill: not a finished conversation
        f.write(lines[0][: len(lines[0]) // 2])

    def resume():  # the same command against a fresh server: (the run, the server's requests)
        srv = FakeOpenAI()
        try:
            return subprocess.run([sys.executable, "-m", "eyas", "regen", *args, "--endpoint", srv.url], env=env,
                                  capture_output=True, text=True, timeout=120), srv
        finally:
            srv.close()

    r, srv = resume()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 finished conversations of unfinished shards read back" in r.stderr
    asked = {m["content"] for body in srv.requests for m in body["messages"] if m["role"] == "user"}
    assert asked == {"q3 [hangx1]", "r3"}  # the journaled conversations were not asked again
    assert (d / "shard-00000.jsonl").read_bytes() == (regen_dir(tmp_path / "run") / "shard-00000.jsonl").read_bytes()
    assert not journal.exists()
    journal.write_text(lines[0] + "\n")  # left by a kill after the shard was written: removed, the shard kept
    r, srv = resume()
    assert r.returncode == 0 and not srv.requests and not journal.exists(), r.stderr[-2000:]


def test_journal_read_back_drops_torn_and_foreign_lines(tmp_path):
    """A journal's torn last line and lines of another plan (index out of the shard, another id) are left out and
    the file rewritten without them, so the next appended line is read back whole."""
    from eyas.data.regen import _read_journal

    convs = [Conversation(f"c{i}", [Turn("user", "q"), Turn("assistant", "a")]) for i in range(6)]
    good = [{"i": 3, "id": "c3", "line": "{}"}, {"i": 4, "id": "c4", "error": {"id": "c4", "kind": "http"}}]
    j = tmp_path / "shard-00001.partial"
    j.write_text("".join(json.dumps(o) + "\n" for o in good) + json.dumps({"i": 5, "id": "other", "line": "{}"})
                 + "\n" + json.dumps({"i": 0, "id": "c0", "line": "{}"}) + "\n" + '{"i": 5, "id": "c5", "li')
    assert _read_journal(j, convs, range(3, 6)) == {3: good[0], 4: good[1]}
    with j.open("a") as f:
        f.write(json.dumps({"i": 5, "id": "c5", "line": "{}"}) + "\n")
    assert sorted(_read_journal(j, convs, range(3, 6))) == [3, 4, 5]
    assert _read_journal(tmp_path / "none.partial", convs, range(0, 3)) == {}


# --------------------------------------------------------------------------- embedded backend


def tiny_cfg(tmp_path, source, **regen) -> Config:
    cfg = Config(out=str(tmp_path / "run"))
    cfg.target.name, cfg.target.dtype, cfg.target.device = "tiny", "float32", "cpu"
    cfg.data.source = str(source)
    r = cfg.regen
    r.split, r.max_new_tokens, r.temperature, r.batch_size, r.shard_size = "all", 12, 0.0, 4, 3
    for k, v in regen.items():
        setattr(r, k, v)
    return cfg


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_embedded_tiny_kill9_resume(tmp_path, tiny, engine):
    src = write_jsonl(tmp_path / "d.jsonl", [[f"question {i}", "and then?"] for i in range(24)], system="S")
    ref = run_regen(tiny_cfg(tmp_path, src, max_new_tokens=16, engine=engine), target=tiny)
    assert ref["records"] == 24 and ref["assistant_turns"] == 48 and ref["generator"]["backend"] == "embedded"
    args = ["--target", "tiny", "--device", "cpu", "--source", str(src), "--split", "all", "--engine", engine,
            "--max-new-tokens", "16", "--temperature", "0", "--batch-size", "4", "--shard-size", "3"]
    rep = _kill_and_resume(tmp_path, args, tmp_path / "killed", 8)
    assert rep["records"] == 24 and rep["duplicates"] == 0 and rep["complete"]
    a = {c.id: c for c in read_dataset(str(regen_dir(tmp_path / "killed")))[0]}
    b = {c.id: c for c in read_dataset(str(regen_dir(tmp_path / "run")))[0]}
    assert sorted(a) == sorted(b)


def test_sampled_regen_killed_and_resumed_equals_an_uninterrupted_one(tmp_path, tiny):
    """At temperature 0.8 (two samples of each conversation), a regen killed in the middle and resumed writes, for
    every conversation, the answers an uninterrupted regen writes: each answer is drawn from the conversation's own
    seed, not from a stream shared by whatever was decoded before it in the process."""
    src = write_jsonl(tmp_path / "d.jsonl", [[f"question {i}"] for i in range(12)], system="S")
    ref = run_regen(tiny_cfg(tmp_path, src, max_new_tokens=10, temperature=0.8, samples=2), target=tiny)
    assert ref["records"] == 24
    args = ["--target", "tiny", "--device", "cpu", "--source", str(src), "--split", "all", "--max-new-tokens", "10",
            "--temperature", "0.8", "--samples", "2", "--batch-size", "4", "--shard-size", "3"]
    rep = _kill_and_resume(tmp_path, args, tmp_path / "killed", 8)
    assert rep["records"] == 24 and rep["complete"]

    def answers(out):
        return {c.id: [(t.role, t.content) for t in c.turns] for c in read_dataset(str(regen_dir(out)))[0]}

    a, b = answers(tmp_path / "killed"), answers(tmp_path / "run")
    assert a == b and len(set(map(str, a.values()))) == 24


def test_a_conversation_left_out_says_why(tmp_path, tiny, capsys):
    """A first prompt too long for the context leaves its conversation out, and the errors file, the log and the
    report say so in words; the report also gives what this call generated and how fast."""
    src = write_jsonl(tmp_path / "d.jsonl", [["short question"], [" ".join(["word"] * 300)]])
    cfg = tiny_cfg(tmp_path, src, max_new_tokens=8)
    cfg.data.max_seq_len = 64
    rep = run_regen(cfg, target=tiny)
    assert rep["records"] == 1 and rep["errors"] == {"context": 1}
    (err,) = read_json(next(regen_dir(cfg.out).glob("*.errors.json")))["errors"]
    assert err["kind"] == "context" and "leaves no room for an answer" in err["message"]
    assert int(err["message"].split("(")[1].split()[0]) >= 300  # the prompt's own length
    out = capsys.readouterr().err
    assert "1 left out (first prompt too long for the context: 1)" in out
    made = rep["this_call"]
    assert made["generated_tokens"] == rep["completion_tokens"]["total"]
    assert 0 < made["generated_tokens"] <= 8 and made["tokens_per_s"] > 0 and rep["tokens_per_s"] > 0
    assert made["rows"] == cfg.regen.batch_size == 4 and "4 rows at a time" in out  # the rows decoded together
    from eyas.cli import main

    assert main(["data", "--report", str(cfg.out)]) == 0  # the run directory's regen report, for people
    shown = capsys.readouterr().out
    assert "1 of 2 planned conversations" in shown and "left out: 1 (first prompt too long for the context: 1)" \
        in shown and f"answer tokens: mean {rep['completion_tokens']['mean']}" in shown
    assert main(["data", "--report", str(cfg.out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["errors"] == {"context": 1}
    again = run_regen(cfg, target=tiny)  # all done: nothing generated, so no rate
    assert again["records"] == 1 and "this_call" not in again and "tokens_per_s" not in again


def test_torchrun_two_processes_split_the_shards(tmp_path, tiny):
    """Two gloo processes with torchrun's environment each regenerate every other shard; together they give
    the single-process run's records (greedy), and the report counts all of them."""
    src = write_jsonl(tmp_path / "d.jsonl", [[f"question {i}", "and then?"] for i in range(10)])
    ref = run_regen(tiny_cfg(tmp_path, src, max_new_tokens=8, engine="static"), target=tiny)
    out = tmp_path / "two"
    args = ["--target", "tiny", "--device", "cpu", "--dtype", "float32", "--source", str(src), "--split", "all",
            "--engine", "static", "--max-new-tokens", "8", "--temperature", "0", "--batch-size", "4",
            "--shard-size", "3", "--out", str(out)]
    procs = []
    for r in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(31500 + os.getpid() % 1000))
        procs.append(subprocess.Popen([sys.executable, "-m", "eyas", "regen", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    for r, (_, err) in enumerate(outs):
        assert f"rank {r} of 2 regenerates 2 of its 2 shards" in err
    rep = json.loads(outs[0][0])
    assert rep["records"] == ref["records"] == 10 and rep["complete"] and rep["duplicates"] == 0
    shards = sorted(f.name for f in regen_dir(out).glob("shard-*.jsonl"))
    assert len(shards) == 4  # 10 conversations, 3 per shard: rank 0 wrote 0 and 2, rank 1 wrote 1 and 3
    a = {c.id: [t.content for t in c.turns] for c in read_dataset(str(regen_dir(out)))[0]}
    b = {c.id: [t.content for t in c.turns] for c in read_dataset(str(regen_dir(tmp_path / "run")))[0]}
    assert a == b


@pytest.mark.parametrize("engine", ["static", "continuous", "generate"])
def test_samples_add_answers_beside_a_finished_run(tmp_path, tiny, engine):
    """regen.samples=2 over a finished one-sample run: the first sample's shards are kept as they are (the same plan),
    the second gets its own shards, ids and seeds; the split and data.original_rest treat it as its first's copy."""
    _samples_beside_a_finished_run(tmp_path, tiny, engine)


@pytest.mark.gpu
def test_samples_add_answers_beside_a_finished_run_on_cuda(tmp_path):
    """The same on a GPU, where the static engine samples inside CUDA graphs from the CUDA generator."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    _samples_beside_a_finished_run(tmp_path, load_target(TargetConfig(name="tiny", dtype="float32", device="cuda")),
                                   "static")


def _samples_beside_a_finished_run(tmp_path, tiny, engine):
    from eyas.data.prepare import training_conversations
    from eyas.data.readers import split_of

    src = write_jsonl(tmp_path / "d.jsonl", [[f"question {i}", "and then?"] for i in range(7)])
    one = run_regen(tiny_cfg(tmp_path, src, engine=engine, temperature=0.8, turns=1), target=tiny)
    d = regen_dir(tmp_path / "run")
    first = {f.name: f.read_bytes() for f in d.glob("shard-*.jsonl")}
    assert one["records"] == 7 and one["samples"] == 1 and len(first) == 3
    cfg = tiny_cfg(tmp_path, src, engine=engine, temperature=0.8, turns=1, samples=2)
    two = run_regen(cfg, target=tiny)
    assert {f.name: f.read_bytes() for f in d.glob("shard-0*.jsonl")} == first  # untouched
    assert sorted(f.name for f in d.glob("shard-s2-*.jsonl")) == [f"shard-s2-0000{k}.jsonl" for k in range(3)]
    assert two["records"] == two["planned"] == 14 and two["complete"] and two["duplicates"] == 0
    assert two["samples"] == 2 and two["shards_total"] == 6
    convs = {c.id: c for c in read_dataset(str(d))[0]}
    assert sorted(convs) == sorted([f"c{i}" for i in range(7)] + [f"c{i}~sample2" for i in range(7)])
    copy = convs["c0~sample2"]
    assert copy.meta["sampling"]["sample"] == 2 and "sample" not in convs["c0"].meta["sampling"]
    assert copy.turns[0].content == convs["c0"].turns[0].content  # the same prompt ...
    differ = sum(convs[f"c{i}~sample2"].turns[-1].content != convs[f"c{i}"].turns[-1].content for i in range(7))
    assert differ >= 6  # ... answered with its own seeds (random weights at 0.8 repeat a 12-token answer rarely)
    # every sample of a conversation on the same side of a split
    for i in range(200):
        assert split_of(f"x{i}_3~sample2", 0.3, 0.2) == split_of(f"x{i}_3", 0.3, 0.2) == split_of(f"x{i}", 0.3, 0.2)
    # data.original_rest continues the first sample only: its later turn once, not once per sample
    cfg.data.original_rest = True
    train, _ = training_conversations(cfg)
    n = {c.id: c.n_assistant() for c in train}
    assert n["c0"] == 2 and n["c0~sample2"] == 1
    from eyas.engine import generate

    def no_engine(*a, **k):
        raise AssertionError("an engine was built with every shard on disk")

    with pytest.MonkeyPatch.context() as mp:  # a rerun finds both samples done, and builds no engine to find it
        for cls in (generate.StaticEngine, generate.ContinuousEngine, generate.GenerateEngine):
            mp.setattr(cls, "__init__", no_engine)
        again = run_regen(cfg, target=tiny)
    assert again["records"] == 14 and again["generator"] == two["generator"]
    with pytest.raises(EyasError, match="greedy answers are the same"):
        run_regen(tiny_cfg(tmp_path, src, temperature=0.0, samples=2), target=tiny)


def test_a_larger_limit_keeps_the_answers_made(tmp_path, tiny, capsys):
    """regen.limit raised over a finished run: the plan grows instead of being refused, the full shards stay as they
    are, the last shard's finished answers go back to its journal and are read from there rather than asked again, and
    the result is what one run with the larger limit makes (greedy). A smaller limit, which would leave shards of
    conversations no longer planned, is still refused."""
    src = write_jsonl(tmp_path / "d.jsonl", [[f"question {i}", "and then?"] for i in range(9)])
    run_regen(tiny_cfg(tmp_path, src, limit=5, turns=1), target=tiny)  # shards of 3: 0 full, 1 holding 2 of 3
    d = regen_dir(tmp_path / "run")
    shard0 = (d / "shard-00000.jsonl").read_bytes()
    two = (d / "shard-00001.jsonl").read_text().splitlines()
    capsys.readouterr()
    rep = run_regen(tiny_cfg(tmp_path, src, limit=8, turns=1), target=tiny)
    err = capsys.readouterr().err
    assert "regen: the plan grows from 5 to 8 conversations: the answers to the first 5 are kept" in err
    assert "resuming, 1 of 3 shards already done" in err
    assert "2 finished conversations of unfinished shards read back from their journals" in err
    assert (d / "shard-00000.jsonl").read_bytes() == shard0
    assert (d / "shard-00001.jsonl").read_text().splitlines()[:2] == two  # the same lines, one more after them
    assert rep["records"] == rep["planned"] == 8 and rep["complete"] and not list(d.glob("*.partial"))
    fresh = run_regen(dataclasses.replace(tiny_cfg(tmp_path, src, limit=8, turns=1), out=str(tmp_path / "fresh")),
                      target=tiny)
    a = {c.id: [t.content for t in c.turns] for c in read_dataset(str(d))[0]}
    b = {c.id: [t.content for t in c.turns] for c in read_dataset(fresh["dir"])[0]}
    assert a == b and len(a) == 8
    with pytest.raises(EyasError, match=r"different 'ids' \(8 conversations before, 6 now\)"):
        run_regen(tiny_cfg(tmp_path, src, limit=6, turns=1), target=tiny)


def test_embedded_engines_agree(tmp_path, tiny):
    src = write_jsonl(tmp_path / "d.jsonl", [["hi"], ["a much longer question about many things"], ["x"]])
    runs = {}
    for engine in ("continuous", "generate", "static"):
        cfg = tiny_cfg(tmp_path, src, engine=engine, max_new_tokens=8)
        cfg.out = str(tmp_path / engine)
        rep = run_regen(cfg, target=tiny)
        assert rep["records"] == 3 and rep["truncated_turns"] == 3  # random weights never stop early
        runs[engine] = {c.id: c.turns[-1].content for c in read_dataset(str(regen_dir(cfg.out)))[0]}
    assert runs["continuous"] == runs["generate"] == runs["static"]  # greedy: each gives the target's own answer


def test_smollm2_regenerates_sharegpt(tmp_path, smol):
    import torch

    from eyas.data.tokenize import render, to_messages

    convs, _ = read_dataset("sharegpt", limit=200)
    # short conversations of 3 or more answers: the later turns' prompts hold the whole original history, and two
    # of 9.7k and 8.7k characters took this test 82 of its 110 s on a 2-core CPU (prefills)
    multi = [c for c in convs if c.n_assistant() >= 3 and sum(len(t.content) for t in c.turns) < 2500
             and len(c.turns[0].content) < 300 and len([t for t in c.turns if t.role == "user"][1].content) < 300][:2]
    single = [c for c in convs if c.n_assistant() == 1 and len(c.turns[0].content) < 200][:1]
    src = tmp_path / "sg.jsonl"
    src.write_text("".join(json.dumps(c.to_dict()) + "\n" for c in multi + single))
    outs = []
    for run in ("a", "b"):
        cfg = Config(out=str(tmp_path / run))
        cfg.data.source = str(src)
        r = cfg.regen
        r.split, r.turns, r.max_new_tokens, r.temperature, r.batch_size = "all", 2, 8, 0.0, 4
        rep = run_regen(cfg, target=smol)
        assert rep["records"] == 3 and rep["errors_total"] == 0
        got, rr = read_dataset(str(regen_dir(cfg.out)))
        assert rr.n_skipped == 0
        outs.append({c.id: c for c in got})
    a, b = outs
    assert {k: [t.content for t in c.turns] for k, c in a.items()} == {k: [t.content for t in c.turns]
                                                                       for k, c in b.items()}  # greedy reproducible
    for c in multi:
        out = a[c.id]
        assert [t.role for t in out.turns][-1] == "assistant" and out.n_assistant() == 2
        originals = [t.content for t in c.turns if t.role == "assistant"]
        assert all(t.content not in originals for t in out.turns if t.role == "assistant")
        # turn 2 was conditioned on the regenerated turn 1: its prompt is exactly that history
        second_user = max(i for i, t in enumerate(out.turns) if t.role == "user")
        hist = Conversation("h", out.turns[:second_user + 1])
        text = render(smol.tokenizer, to_messages(hist, smol.tokenizer), add_generation_prompt=True)
        assert out.meta["turns"][1]["prompt_tokens"] == len(smol.tokenizer(text, add_special_tokens=False).input_ids)
    # the later turns (regen.later_turns): the second answer asked with the original first answer before it; on the
    # shorter conversation only, as each later prompt holds the whole original history (a 2-core CPU prefills about
    # 100-150 tokens a second)
    short = min(multi, key=lambda c: sum(len(t.content) for t in c.turns))
    src_later = tmp_path / "later.jsonl"
    src_later.write_text(json.dumps(short.to_dict()) + "\n")
    cfg = Config(out=str(tmp_path / "later"))
    cfg.data.source = str(src_later)
    r = cfg.regen
    r.split, r.turns, r.max_new_tokens, r.temperature, r.batch_size, r.later_turns = "all", 1, 8, 0.0, 4, True
    rep = run_regen(cfg, target=smol)
    assert rep["records"] == 1 + 1 and rep["later_turns"] == 1 and rep["errors_total"] == 0
    later = {c.id: c for c in read_dataset(str(regen_dir(cfg.out)))[0]}
    for c in [short]:
        out, originals = later[c.id + "~later"], [t.content for t in c.turns if t.role == "assistant"]
        answers = [i for i, t in enumerate(out.turns) if t.role == "assistant"]
        assert len(answers) == len(originals) > 2 and out.turns[answers[0]].content == originals[0]  # kept
        assert all(out.turns[i].content not in originals for i in answers[1:])  # SmolLM2's
        # each later answer's prompt was exactly the source's history before it (its original answers)
        source_answers = [i for i, t in enumerate(c.turns) if t.role == "assistant"]
        for k in range(1, len(answers)):
            text = render(smol.tokenizer, to_messages(Conversation("h", c.turns[:source_answers[k]]), smol.tokenizer),
                          add_generation_prompt=True)
            n = len(smol.tokenizer(text, add_special_tokens=False).input_ids)
            assert out.meta["turns"][k - 1]["prompt_tokens"] == n
    # and the first answer is SmolLM2's own greedy answer
    c = a[single[0].id]
    text = render(smol.tokenizer, to_messages(Conversation("h", c.turns[:-1]), smol.tokenizer),
                  add_generation_prompt=True)
    ids = torch.tensor([smol.tokenizer(text, add_special_tokens=False).input_ids])
    ref = smol.model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=smol.eot_token_ids,
                              pad_token_id=smol.eot_token_ids[0])[0, ids.shape[1]:]
    ref = [x for x in ref.tolist() if x not in smol.eot_token_ids]
    assert c.turns[-1].content == smol.tokenizer.decode(ref, skip_special_tokens=True).strip()


# --------------------------------------------------------------------------- the static engine (eyas.engine.fastlm)


def drain(engine, prompts: list[str]) -> tuple[dict, dict]:
    """Submit one user prompt per request, poll until all are answered: ({rid: TurnResult}, {rid: tokens})."""
    tokens, result = {}, engine.result

    def keep(rid, plen, toks):
        tokens[rid] = list(toks)
        return result(rid, plen, toks)

    engine.result = keep
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", [{"role": "user", "content": p}], 0)
    got = {}
    while len(got) < len(prompts):
        got.update({r.rid: r for r in engine.poll(0.1)})
    engine.close()
    return got, tokens


def test_static_engine_equals_generate_alone(smol):
    """Greedy, 2 rows for 5 prompts (rows are refilled): each answer is SmolLM2's own greedy answer to that
    prompt alone, token for token; two stop at the end-of-turn token, three at the length limit."""
    import torch

    from eyas.config import RegenConfig
    from eyas.engine.generate import StaticEngine, _render_prompt

    prompts = ["Hi!", "What is 2+2? Answer with one number.", "Write a long essay about the history of Rome.",
               "Explain how a compiler works, step by step.", "Hello, who are you?"]
    rc = RegenConfig(temperature=0.0, max_new_tokens=12, batch_size=2)
    got, tokens = drain(StaticEngine(smol, rc, "keep", 2048), prompts)
    assert [got[f"r{i}"].finish_reason for i in range(5)] == ["stop", "stop", "length", "length", "length"]
    for i, p in enumerate(prompts):
        ids = torch.tensor([_render_prompt(smol.tokenizer, [{"role": "user", "content": p}], "keep")])
        ref = smol.model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=smol.eot_token_ids,
                                  pad_token_id=smol.eot_token_ids[0])[0, ids.shape[1]:].tolist()
        assert tokens[f"r{i}"] == ref, p
        assert got[f"r{i}"].prompt_tokens == ids.shape[1]


def test_static_engine_limits_and_sampling(tiny, monkeypatch):
    """Against the generate engine on the tiny target: a prompt at the context limit is refused, a prompt
    near the model's maximum length gets fewer new tokens, the others max_new_tokens; sampling is
    reproducible from the seed."""
    from eyas.config import RegenConfig
    from eyas.engine.generate import GenerateEngine, StaticEngine, _render_prompt

    prompts = ["hi", "a somewhat longer question about a few things", "x", "a question " * 30, "why?"]
    lens = [len(_render_prompt(tiny.tokenizer, [{"role": "user", "content": p}], "keep")) for p in prompts]
    monkeypatch.setattr(tiny.model.config, "max_position_embeddings", lens[1] + 5)  # r1 may add 5 tokens
    rc = RegenConfig(temperature=0.0, max_new_tokens=9, batch_size=2)
    ref, ref_tokens = drain(GenerateEngine(tiny, rc, "keep", 0), prompts)
    got, tokens = drain(StaticEngine(tiny, rc, "keep", 0), prompts)
    assert got == ref and tokens == ref_tokens
    assert got["r3"].finish_reason == "context" and got["r1"].completion_tokens == 5
    assert [len(tokens[f"r{i}"]) for i in (0, 2, 4)] == [9, 9, 9]  # random weights never stop early

    rc.temperature = 1.0
    runs = [drain(StaticEngine(tiny, rc, "keep", 0), prompts)[1] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0] != tokens
    assert all(len(runs[0][r]) <= len(tokens[r]) for r in tokens)


def test_sampling_is_seeded_per_request_whatever_the_batch(tiny):
    """At a temperature above 0, each answer depends on its request's seed alone: the static engine (2 rows, refilled)
    and the generate engine (batches of 2, and each prompt alone) draw the same tokens for the same seeds, and another
    seed draws others."""
    from eyas.config import RegenConfig
    from eyas.engine.generate import GenerateEngine, StaticEngine

    prompts = ["hi", "a somewhat longer question about a few things", "x", "why?", "tell me more"]

    def answers(engine, seeds, only=None):
        got = {}
        for i in only if only is not None else range(len(prompts)):
            engine.submit(f"r{i}", [{"role": "user", "content": prompts[i]}], seeds[i])
        want = 1 if only is not None else len(prompts)
        while len(got) < want:
            got.update({r.rid: (r.content, r.completion_tokens) for r in engine.poll(0.1)})
        return got

    rc = RegenConfig(temperature=1.0, max_new_tokens=8, batch_size=2)
    seeds = [11, 22, 33, 44, 55]
    static = answers(StaticEngine(tiny, rc, "keep", 0), seeds)
    gen = GenerateEngine(tiny, rc, "keep", 0)
    assert answers(gen, seeds) == static
    alone = {}
    for i in reversed(range(len(prompts))):  # other batches, another order
        alone.update(answers(gen, seeds, only=[i]))
    assert alone == static
    other = answers(StaticEngine(tiny, rc, "keep", 0), [s + 1 for s in seeds])
    assert all(other[r] != static[r] for r in static)


@pytest.mark.parametrize("overlap", [True, False])
def test_static_engine_overlapped_checks(tiny, monkeypatch, overlap):
    """With the next steps queued before the finished rows are read (from a host copy of the row state taken
    after the previous steps; the default), every answer still equals the generate engine's, with rows
    refilled, and a refilled row is never read from a copy taken before its prefill; and so without overlap."""
    from eyas.config import RegenConfig
    from eyas.engine.generate import GenerateEngine, StaticEngine

    monkeypatch.setattr(StaticEngine, "overlap", overlap)
    monkeypatch.setattr(StaticEngine, "check_every", 3)  # answers of 2-9 tokens end between checks
    prompts = [f"question number {i} " * (1 + i % 3) for i in range(9)]
    for max_new in (2, 9):
        rc = RegenConfig(temperature=0.0, max_new_tokens=max_new, batch_size=3)
        got, tokens = drain(StaticEngine(tiny, rc, "keep", 0), prompts)
        ref, ref_tokens = drain(GenerateEngine(tiny, rc, "keep", 0), prompts)
        assert got == ref and tokens == ref_tokens
        assert all(len(t) == max_new for t in tokens.values())  # random weights never stop early


@pytest.mark.gpu
def test_static_engine_overlapped_checks_on_cuda(monkeypatch):
    """On a GPU (CUDA graphs, pinned host copies, events): overlapped checks give the plain engine's tokens."""
    from eyas.config import RegenConfig, TargetConfig
    from eyas.engine.generate import StaticEngine
    from eyas.target import load_target

    t = load_target(TargetConfig(name="tiny", dtype="float32", device="cuda"))
    prompts = [f"question number {i} " * (1 + i % 3) for i in range(40)]
    rc = RegenConfig(temperature=0.0, max_new_tokens=11, batch_size=8)
    runs = []
    for overlap in (False, True):
        monkeypatch.setattr(StaticEngine, "overlap", overlap)
        runs.append(drain(StaticEngine(t, rc, "keep", 0), prompts)[1])
    assert runs[0] == runs[1] and len(runs[0]) == 40


def test_static_engine_row_groups(tiny, monkeypatch):
    """8 rows in two groups (rows 0-1 for long prompts): long prompts land in the long rows while they
    have room, and every answer equals the generate engine's, greedy, with rows refilled."""
    from eyas.config import RegenConfig
    from eyas.engine.generate import GenerateEngine, StaticEngine, _render_prompt

    monkeypatch.setattr(StaticEngine, "row_groups", True)
    monkeypatch.setattr(StaticEngine, "long_prompt", 36)  # the short prompts render to 32-33 tokens
    prompts = [("a long question " * (3 + i % 4)) if i % 3 == 0 else f"q{i}" for i in range(14)]
    lens = [len(_render_prompt(tiny.tokenizer, [{"role": "user", "content": p}], "keep")) for p in prompts]
    assert sum(n > 36 for n in lens) == 5
    rc = RegenConfig(temperature=0.0, max_new_tokens=6, batch_size=8)
    eng = StaticEngine(tiny, rc, "keep", 0)
    assert eng.lm.groups == [(0, 2), (2, 8)]
    placed = {}
    admit = eng._prefill

    def spy(rows, items):
        placed.update({rid: row for row, (rid, _, _) in zip(rows, items)})
        return admit(rows, items)

    eng._prefill = spy
    got, tokens = drain(eng, prompts)
    ref, ref_tokens = drain(GenerateEngine(tiny, rc, "keep", 0), prompts)
    assert got == ref and tokens == ref_tokens
    first = sorted(range(8), key=lambda i: -lens[i])[:2]  # of the first 8 admitted, the two longest
    assert {placed[f"r{i}"] for i in first} == {0, 1}
    assert all(placed[f"r{i}"] >= 2 for i in range(8) if lens[i] <= 36)


def test_engine_choice(tiny, monkeypatch):
    import eyas.engine.fastlm
    import eyas.engine.generate
    from eyas.config import RegenConfig
    from eyas.engine.generate import GenerateEngine, StaticEngine, make_embedded

    # auto: static for the architectures it runs, generate for the others
    assert isinstance(make_embedded(tiny, RegenConfig(batch_size=2), "keep", 64), StaticEngine)
    for module in (eyas.engine.fastlm, eyas.engine.generate):  # auto's choice, and the static engine's own check
        monkeypatch.setattr(module, "supported", lambda model: (False, "NewArch: not implemented"))
    assert isinstance(make_embedded(tiny, RegenConfig(batch_size=2), "keep", 64), GenerateEngine)
    with pytest.raises(EyasError, match="static regen engine cannot run this target: NewArch.*--engine generate"):
        make_embedded(tiny, RegenConfig(batch_size=2, engine="static"), "keep", 64)


@pytest.mark.parametrize("flags,said", [
    (["--batch-size", "-1"], "regen.batch_size must be 0 (auto) or more, got -1"),
    (["--limit", "-1"], "regen.limit must be 0 (all) or more, got -1"),
    (["--turns", "-1"], "regen.turns must be 0 (all) or more, got -1"),
    (["--data-limit", "-1"], "data.limit must be 0 (all records) or more, got -1"),
    (["--val-ratio", "1"], "data.val_ratio must be at least 0 and below 1, got 1.0"),
    (["--no-enabled"], "this command was given regen.enabled=false, which makes `eyas run` leave regeneration out; "
                       "`eyas regen` stops here and regenerates nothing. To regenerate, give --enabled"),
    (["--chat-template-kwargs", '{"enable_thinking": true}'],
     "regen.chat_template_kwargs is sent to a server: it needs regen.backend=server (--endpoint)")])
def test_regen_refuses_settings_naming_the_key(tmp_path, capsys, flags, said):
    """Each setting out of range is refused by its key and value before anything is read or generated (a negative
    batch size said the KV cache did not fit); regen.enabled=false stops `eyas regen` instead of being ignored."""
    from eyas.cli import main

    src = write_jsonl(tmp_path / "d.jsonl", [["question"]])
    out = tmp_path / "run"
    assert main(["regen", "--target", "tiny", "--device", "cpu", "--source", str(src), "--split", "all",
                 "--max-new-tokens", "4", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and not regen_dir(out).exists()


def test_plan_records_the_data_settings_that_chose_its_conversations(tmp_path, tiny):
    """plan.json records data.limit, data.val_ratio and data.test_ratio (the ratios where a split is taken),
    following settings that choose the same conversations on a resume, so that tokenizing the answers refuses
    other values given to it."""
    from eyas import config as C
    from eyas.data.prepare import training_conversations

    src = write_jsonl(tmp_path / "d.jsonl", [[f"question {i}"] for i in range(3)])
    cfg = tiny_cfg(tmp_path, src, max_new_tokens=4, split="train")  # all three are in the train split
    run_regen(cfg, target=tiny)
    plan = regen_dir(cfg.out) / "plan.json"
    assert len(read_json(plan)["ids"]) == 3
    assert read_json(plan)["data"] == {"limit": 0, "val_ratio": 0.02, "test_ratio": 0.02}
    cfg.data.limit = 10  # the same three conversations
    run_regen(cfg, target=tiny)
    assert read_json(plan)["data"]["limit"] == 10
    with pytest.raises(EyasError, match="chosen at data.limit=10: training on them would ignore data.limit=2"):
        training_conversations(C.resolve(None, "tiny", {"out": cfg.out, "data.source": str(src), "data.limit": 2}))
    cfg = tiny_cfg(tmp_path, src, max_new_tokens=4)
    cfg.out = str(tmp_path / "every")
    run_regen(cfg, target=tiny)
    assert read_json(regen_dir(cfg.out) / "plan.json")["data"] == {"limit": 0}  # regen.split all: no ratio chose
