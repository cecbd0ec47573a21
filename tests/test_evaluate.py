"""`eyas eval` end to end on the tiny target: report files and keys, multi-turn prompts, errors."""
import json

import pytest
import torch

from eyas.config import resolve
from eyas.draft import build_drafter, save_drafter
from eyas.eval_stats import round_sums, tau_difference, tau_interval
from eyas.evaluate import measure_acceptance, run_eval
from eyas.util import EyasError

DESIGN_KEYS = ["target", "k", "temperature", "prompts", "acceptance_length", "per_position_acceptance",
               "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless", "device"]


@pytest.fixture(scope="module")
def tiny_drafter(tiny, tmp_path_factory):
    torch.manual_seed(0)
    d = build_drafter(tiny, 1024)
    return save_drafter(d, tmp_path_factory.mktemp("draft") / "draft")


def test_run_eval_writes_report(tiny, tiny_drafter, tmp_path, capsys, two_conversations):
    prompts = two_conversations
    cfg = resolve(None, "tiny", {"out": str(tmp_path / "run"), "eval.prompts": str(prompts), "eval.k": 2,
                                 "eval.max_new_tokens": 6, "eval.draft": str(tiny_drafter), "target.device": "cpu",
                                 "target.dtype": "bfloat16", "eval.dtype": "float32"})
    res = run_eval(cfg)
    rep = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert res["report"].endswith("report.json")
    for k in DESIGN_KEYS:
        assert k in rep, k
    assert rep["prompts"] == {"set": "p.jsonl", "count": 3, "conversations": 2}  # each user turn answered
    assert rep["dtype"] == "float32"  # eval.dtype overrides target.dtype while evaluating
    assert rep["fused_round"] is False  # eval.round=auto runs stepwise on a CPU
    assert rep["overlap"] is False  # and reads each plain step before the next (Decoder.overlap: GPU only)
    assert rep["k"] == 2 and len(rep["per_position_acceptance"]) == 2
    assert len(rep["accepted_length_histogram"]) == 3 and sum(rep["accepted_length_histogram"]) == rep["verify_rounds"]
    bt = rep["by_turn"]  # a's two answers and b's one: first answers 2, second 1, and they add up to the whole
    assert {b: v["answers"] for b, v in bt.items()} == {"1": 2, "2": 1}
    assert sum(v["new_tokens"] for v in bt.values()) == rep["new_tokens"]
    assert sum(v["verify_rounds"] for v in bt.values()) == rep["verify_rounds"]
    assert sum(v["acceptance_length"] * v["verify_rounds"] for v in bt.values()) == pytest.approx(
        rep["acceptance_length"] * rep["verify_rounds"])
    br = rep["by_repetition"]  # every answer in one bucket by its own tokens' repetition; they add up as well
    assert set(br) <= {"<0.1", "0.1-0.5", ">=0.5"} and sum(v["answers"] for v in br.values()) == 3
    assert sum(v["new_tokens"] for v in br.values()) == rep["new_tokens"]
    assert sum(v["acceptance_length"] * v["verify_rounds"] for v in br.values()) == pytest.approx(
        rep["acceptance_length"] * rep["verify_rounds"])
    assert 1.0 <= rep["acceptance_length"] <= 3.0
    lo, hi = rep["acceptance_length_ci95"]  # over the two conversations
    assert 1.0 <= lo <= rep["acceptance_length"] <= hi <= 3.0
    convs = rep["rounds_by_conversation"]  # what compare_tau pairs: each conversation's tokens and rounds
    assert len(convs) == 2 and sum(r for _, r in convs) == rep["verify_rounds"]
    assert sum(t for t, _ in convs) == pytest.approx(rep["acceptance_length"] * rep["verify_rounds"])
    first = rep["first_answer_ids"]  # each conversation's first answer, which parity holds the engine's against
    assert len(first) == 2 and all(isinstance(x, int) for a in first for x in a)
    assert sum(len(a) for a in first) == bt["1"]["new_tokens"] and all(1 <= len(a) <= 6 for a in first)
    assert "95% interval" in (tmp_path / "run" / "eval" / "report.md").read_text()
    assert rep["lossless"] is True and rep["lossless_checked"] == rep["lossless_matched"] == 3
    assert rep["tokens_per_s"] > 0 and rep["baseline_tokens_per_s"] > 0 and rep["speedup"] > 0
    assert rep["peak_memory_bytes"] > 0 and set(rep["time_split"]) >= {"draft_s", "verify_s", "prefill_s"}
    ts = rep["time_split"]  # the phases are parts of each method's wall time
    assert 0 < ts["prefill_s"] and ts["draft_s"] + ts["verify_s"] + ts["prefill_s"] <= ts["speculative_total_s"]
    assert 0 < ts["plain_prefill_s"] < ts["plain_total_s"]
    for f in ("report.md", "per_position_acceptance.png", "accepted_length_histogram.png"):
        assert (tmp_path / "run" / "eval" / f).stat().st_size > 100, f
    assert "acceptance length" in (tmp_path / "run" / "eval" / "report.md").read_text()
    said = capsys.readouterr().err  # and one line for people, with the figures of the report
    assert (f"eval: τ {rep['acceptance_length']:.3f} (95% interval {lo:.3f}-{hi:.3f}) at K=2 over 3 answers; "
            in said and f"({rep['speedup']:.2f}x); lossless: yes; {tmp_path / 'run' / 'eval' / 'report.md'}" in said)


@pytest.mark.parametrize("both", [False, True], ids=["one_token_steps", "every_step"])
def test_lossless_check_tells_rounding_from_a_wrong_token(tiny, tiny_drafter, tmp_path, capsys, two_conversations,
                                                          monkeypatch, both):
    """An answer that parts from plain decoding is decoded plainly again with the steps shaped as the verify: equal
    there, the eval calls it kernel rounding (lossless_exact); still apart, a wrong token. Here plain decoding's
    first step after the first conversation's prefill is made to pick another token: in its one-token steps alone
    (what a kernel rounding by the call's shape does), or with the verify's shapes too (what a fault does)."""
    from eyas.decode import Decoder

    launch, generate, plain_calls = Decoder._launch, Decoder.generate, []

    def counted(self, prompt_ids, max_new_tokens=256, stop_ids=(), speculative=True):
        if not speculative:  # the eval's warm-up, then the first conversation's, then (where it parts) its rerun
            plain_calls.append({"skew": len(plain_calls) == 1 or (both and len(plain_calls) == 2)})
        return generate(self, prompt_ids, max_new_tokens, stop_ids, speculative)

    def skewed(self, state, speculative, bound):
        new_state, res = launch(self, state, speculative, bound)
        if not speculative and plain_calls[-1].pop("skew", False):
            res = (res + 1) % self.target.vocab_size
            new_state = (res, new_state[1])
        return new_state, res

    monkeypatch.setattr(Decoder, "generate", counted)
    monkeypatch.setattr(Decoder, "_launch", skewed)
    cfg = resolve(None, "tiny", {"out": str(tmp_path / "run"), "eval.prompts": str(two_conversations), "eval.k": 2,
                                 "eval.max_new_tokens": 6, "eval.draft": str(tiny_drafter), "target.device": "cpu",
                                 "eval.turns": 1})
    run_eval(cfg)
    rep = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    said = capsys.readouterr().err
    assert rep["lossless"] is False and rep["lossless_checked"] == 2 and rep["lossless_matched"] == 1
    if both:
        assert rep["lossless_rounding"] == 0 and rep["lossless_exact"] is False
        assert "(a wrong token)" in rep["lossless_mismatches"][0] and "NOT lossless" in said
    else:
        assert rep["lossless_rounding"] == 1 and rep["lossless_exact"] is True
        assert "(rounding: equal with the verify's shapes)" in rep["lossless_mismatches"][0]
        assert "1 of 2 answers equal plain decoding's; the other 1 equal it with its steps shaped as the verify" in said
        assert "kernel rounding" in (tmp_path / "run" / "eval" / "report.md").read_text()


def test_eval_turns_answers_only_the_first_turns(tiny, tiny_drafter, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": "ignored"},
                                     {"role": "user", "content": "And again?"}]},
            {"id": "b", "messages": [{"role": "user", "content": "Name a fruit."}]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    over = {"out": str(tmp_path / "run"), "eval.prompts": str(prompts), "eval.k": 2, "eval.max_new_tokens": 6,
            "eval.draft": str(tiny_drafter), "target.device": "cpu", "eval.turns": 1}
    run_eval(resolve(None, "tiny", over))
    rep = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert rep["prompts"] == {"set": "p.jsonl", "count": 2, "conversations": 2}  # a's second turn left out
    assert {b: v["answers"] for b, v in rep["by_turn"].items()} == {"1": 2}
    with pytest.raises(EyasError, match="eval.turns"):
        run_eval(resolve(None, "tiny", {**over, "eval.turns": -1}))


def test_repeat_bucket_reads_the_answers_own_ngrams():
    from eyas.eval_stats import Tally, by_repetition, repeat_bucket

    assert repeat_bucket(list(range(40))) == "<0.1"  # 33 distinct 8-grams, none repeated
    assert repeat_bucket([1, 2, 3, 4] * 10) == ">=0.5"  # a loop: 4 distinct of 33
    assert repeat_bucket(list(range(12)) * 2) == "0.1-0.5"  # 17 8-grams, the last 5 seen before
    assert repeat_bucket([5, 6]) == "<0.1"  # shorter than an 8-gram
    t = Tally(2)
    t.add_rounds([2, 0])
    t.answers, t.tokens = 1, 4
    assert list(by_repetition({">=0.5": t, "<0.1": t})) == ["<0.1", ">=0.5"]  # fresh text first


def test_run_eval_fused_round_is_lossless(tiny, tiny_drafter, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\nName a fruit.\nCount to five.\n")
    cfg = resolve(None, "tiny", {"out": str(tmp_path / "run"), "eval.prompts": str(prompts), "eval.k": 3,
                                 "eval.max_new_tokens": 12, "eval.draft": str(tiny_drafter), "target.device": "cpu",
                                 "eval.round": "fused", "eval.limit": 0})
    run_eval(cfg)
    rep = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert rep["fused_round"] is True and rep["lossless"] is True and rep["lossless_checked"] == 3
    assert rep["time_split"]["draft_s"] == 0.0  # the whole round is timed as verify
    assert sum(rep["accepted_length_histogram"]) == rep["verify_rounds"] > 0


def test_run_eval_missing_drafter_is_a_user_error(tmp_path):
    cfg = resolve(None, "tiny", {"out": str(tmp_path / "run"), "target.device": "cpu"})
    with pytest.raises(EyasError, match="draft"):
        run_eval(cfg)


def test_measure_acceptance_counts(tiny, tiny_drafter):
    from eyas.draft import load_drafter

    d = load_drafter(tiny_drafter, tiny)
    res = measure_acceptance(tiny, d, ["hi", [{"role": "user", "content": "yo"}]], k=3, max_new_tokens=8)
    assert res["prompts"] == 2 and len(res["outputs"]) == 2
    assert res["rounds"] == sum(res["accepted_length_histogram"])
    emitted = sum((a + 1) * c for a, c in enumerate(res["accepted_length_histogram"]))
    assert res["acceptance_length"] == pytest.approx(emitted / res["rounds"])
    # every verify round emits at least one token; the first token comes from the prefill
    assert emitted + 2 >= res["new_tokens"]
    lo, hi = res["acceptance_length_ci95"]  # over the two prompts
    assert lo <= res["acceptance_length"] <= hi
    assert len(res["rounds_by_prompt"]) == 2 and sum(r for _, r in res["rounds_by_prompt"]) == res["rounds"]
    assert sum(t for t, _ in res["rounds_by_prompt"]) == emitted


def test_tau_interval_bootstraps_the_groups():
    assert round_sums([0, 2, 1]) == (6, 3)
    assert tau_interval([(9, 3)]) is None  # one group: no spread to draw from
    assert tau_interval([(9, 3), (4, 0)]) is None  # a group without rounds is no group
    assert tau_interval([(9, 3)] * 5) == pytest.approx([3.0, 3.0])  # equal groups: no spread at all
    groups = [(3 * r, r) for r in (10, 20, 5)] + [(r, r) for r in (10, 15)]  # τ 3 in three, 1 in two
    lo, hi = tau_interval(groups)
    point = sum(g[0] for g in groups) / sum(g[1] for g in groups)
    assert 1.0 < lo < point < hi <= 3.0  # all five drawn from the τ-3 groups: 7.8% of the draws
    assert tau_interval(groups) == [lo, hi]  # the same seed, the same draws
    lo4, hi4 = tau_interval(groups * 4)  # four times the groups, same spread: a narrower interval
    assert lo < lo4 < point < hi4 < hi
    lo80, hi80 = tau_interval(groups * 4, level=0.8)
    assert lo4 < lo80 < hi80 < hi4


def test_tau_difference_pairs_the_groups():
    easy, hard = [(40, 10)] * 6, [(12, 10)] * 6  # τ 4 and 1.2: prompts that differ far more than the drafters do
    a = [(s + 2, r) for s, r in easy + hard]  # drafter A: two tokens more than B on every prompt
    b = easy + hard
    d = tau_difference(a, b)
    assert d["pairs"] == 12 and d["difference"] == pytest.approx(0.2)
    lo, hi = d["interval"]
    assert d["level"] == 0.95 and 0 < lo <= 0.2 <= hi  # the same prompts drawn for both sides: the prompts' spread cancels
    # drawn apart, each side's interval spans the prompts' spread, far wider than the difference
    la, ha = tau_interval(a)
    lb, hb = tau_interval(b)
    assert la < hb and ha - la > 5 * (hi - lo)
    assert tau_difference(b, b)["interval"] == [0.0, 0.0]
    assert tau_difference([(3, 1)], [(2, 1)]) is None
    assert tau_difference(a + [(5, 0)], b + [(5, 2)])["pairs"] == 12  # a pair with no rounds on one side is left out


def test_eyas_compare_pairs_two_reports_by_prompt(tmp_path, capsys):
    """`eyas compare`: two bench_decode reports of the same prompts (τ 4 and 1 on alternate prompts; A writes the hard
    ones' 3 tokens in 2 rounds, B in 3), compared on the prompts both reached, with the texts' agreement; eval
    reports (or their run directories) pair by conversation; a report of neither kind, a missing file or a method
    not in the report is one line naming the file, exit 2."""
    from eyas.cli import main

    def report(path, accepted, texts):
        path.write_text(json.dumps({"methods": {
            "eyas_plain": {"outputs": texts},
            "eyas_spec_k3_fused": {"accepted_by_prompt": accepted, "same_as_plain": f"{len(texts)}/{len(texts)}"}}}))
        return str(path)

    a = report(tmp_path / "a.json", [[3, 3], [1, 0], [3, 3], [1, 0], [3]], [[1], [2], [3], [4], [5]])  # a prompt more
    b = report(tmp_path / "b.json", [[3, 3], [0, 0, 0], [3, 3], [0, 0, 0]], [[1], [2], [3], [9]])
    assert main(["compare", a, b, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["pairs"] == 4 and res["prompts_a"] == 5 and res["same_text"] == "3/4"
    assert res["tau_a"] == pytest.approx(22 / 8) and res["tau_b"] == pytest.approx(22 / 10)
    assert res["interval"][0] <= res["difference"] <= res["interval"][1]
    assert main(["compare", a, b, "--level", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "A - B: +0.550 (80% paired interval" in out and "over 4 prompts both reached, paired by position; same text 3/4" in out
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "report.json").write_text(json.dumps({"rounds_by_conversation": [[8, 2], [3, 3], [8, 2]]}))
    assert main(["compare", str(run), str(run / "eval" / "report.json"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["read"] == ["eval conversations", "eval conversations"] and res["interval"] == [0.0, 0.0]
    (tmp_path / "bad.json").write_text("{}")
    for args, msg in (([str(tmp_path / "bad.json"), a], "bad.json: neither"),
                      ([str(tmp_path / "none.json"), a], "none.json: no such report"),
                      ([a, b, "--method", "eyas_spec_k7_fused"], "no method 'eyas_spec_k7_fused'"),
                      ([a, b, "--level", "95"], "--level must be between 0 and 1")):
        assert main(["compare", *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.count("\n") == 1, err


def test_eval_counts_turns_too_long_and_refuses_when_none_is_decoded(tiny, tiny_drafter, tmp_path, capsys):
    """A turn whose prompt + max_new_tokens + K + 2 is over the context is left out with its conversation's later
    turns, and the eval says how many and why; with every first turn too long nothing is decoded, and the eval
    stops saying what to lower instead of writing a τ of 0 over the run's own eval."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
            {"id": "b", "messages": [{"role": "user", "content": "word " * 4085},  # 4,116 tokens: over 4,096
                                     {"role": "assistant", "content": "ignored"},
                                     {"role": "user", "content": "And again?"}]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    over = {"out": str(tmp_path / "run"), "eval.prompts": str(prompts), "eval.k": 2, "eval.max_new_tokens": 6,
            "eval.draft": str(tiny_drafter), "target.device": "cpu"}
    run_eval(resolve(None, "tiny", over))
    report = tmp_path / "run" / "eval" / "report.json"
    rep = json.loads(report.read_text())
    assert rep["prompts"] == {"set": "p.jsonl", "count": 1, "conversations": 2}
    assert rep["turns_skipped_too_long"] == 2 and rep["context"] == 4096  # b's first turn and its second
    said = capsys.readouterr().err
    assert ("eval: 2 user turns of 1 conversations left out: a prompt of 4116 tokens + max_new_tokens 6 + 4 (K + 2) "
            "is over the 4096-token context" in said)
    assert "| user turns left out, too long for the 4096-token context | 2 |" in report.with_suffix(".md").read_text()
    kept = report.read_bytes()
    with pytest.raises(EyasError, match=r"no answer decoded: every conversation's first turn is too long \(a prompt "
                       r"of 32 to 4116 tokens \+ max_new_tokens 100000 \+ 4 \(K \+ 2\) is over the 4096-token "
                       r"context .*\); lower eval.max_new_tokens \(--max-new-tokens\) to 4060 or less"):
        run_eval(resolve(None, "tiny", {**over, "eval.max_new_tokens": 100000}))  # a: 32 tokens + 4060 + 4 = 4096
    assert report.read_bytes() == kept  # the eval before it is left as it was


def test_eval_refuses_another_test_ratio_than_the_runs_data(tiny, tiny_drafter, tmp_path):
    """The held-out split is a hash of each record's id below data.test_ratio: at another ratio than the run's
    training data were split at it is not the conversations the run held out (at 0.6 it takes in c0, c5, ..., which
    the run trained on at 0.3)."""
    import shutil

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Say {i}."}]}) + "\n"
                            for i in range(20)))
    run = tmp_path / "run"
    (run / "data" / "tokens").mkdir(parents=True)
    (run / "data" / "tokens" / "meta.json").write_text(json.dumps(  # what the run's tokenize stage recorded
        {"inputs": {"data": {"source": str(data), "val_ratio": 0.02, "test_ratio": 0.3}}}))
    shutil.copytree(tiny_drafter, run / "draft")
    over = {"out": str(run), "eval.prompts": "sharegpt", "data.source": str(data), "data.test_ratio": 0.6,
            "eval.k": 2, "eval.max_new_tokens": 4, "eval.limit": 1, "target.device": "cpu"}
    with pytest.raises(EyasError, match=r"data.test_ratio is 0.6, but the training data of .*run were split at 0.3 "
                       r"\(.*meta.json\).*held-out test split of .*chats.jsonl.*Leave data.test_ratio at 0.3"):
        run_eval(resolve(None, "tiny", over))
    assert not (run / "eval").exists()
    # the run's own ratio is evaluated; data.val_ratio does not move the test split, so another one is not refused
    run_eval(resolve(None, "tiny", {**over, "data.test_ratio": 0.3, "data.val_ratio": 0.1}))
    assert json.loads((run / "eval" / "report.json").read_text())["conversation_ids"] == ["c3"]


@pytest.mark.parametrize("key,value,msg", [
    ("eval.limit", -1, "eval.limit must be 0 (every conversation) or more, got -1"),
    ("data.test_ratio", 0.99, "data.val_ratio and data.test_ratio must be 0 or above with a sum below 1 (the rest is the train split), got 0.02 and 0.99"),
    ("data.val_ratio", -0.1, "data.val_ratio and data.test_ratio must be 0 or above with a sum below 1 (the rest is the train split), got -0.1 and 0.02"),
])
def test_eval_refuses_prompt_settings_out_of_range(tmp_path, key, value, msg):
    """`eval.limit -1` took every conversation but the last (convs[:-1]); the split ratios are checked as the
    pipeline's preflight checks them, before the target loads."""
    cfg = resolve(None, "tiny", {"out": str(tmp_path / "run"), "target.device": "cpu", key: value})
    with pytest.raises(EyasError) as e:
        run_eval(cfg)
    assert str(e.value) == msg


def test_eval_refuses_a_run_directory_that_cannot_hold_its_report(tiny_drafter, tmp_path):
    """A file where the run directory or its eval/ folder would be is refused before the target loads, not after
    every answer is decoded."""
    (tmp_path / "F").write_text("")
    (tmp_path / "G").mkdir()
    (tmp_path / "G" / "eval").write_text("")
    for out, where in (("F", "F"), ("F/run", "F"), ("G", "G/eval")):
        cfg = resolve(None, "tiny", {"out": str(tmp_path / out), "eval.draft": str(tiny_drafter),
                                     "target.device": "cpu"})
        with pytest.raises(EyasError, match=f"--out .*{out}: .*{where} is a file, not a folder"):
            run_eval(cfg)


def test_eval_removes_the_parity_check_of_the_eval_it_replaces(tiny, tiny_drafter, tmp_path):
    """eval/parity.json compares an engine with the eval beside it: a new eval makes it stale."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\n")
    (tmp_path / "run" / "eval").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "parity.json").write_text(json.dumps({"eyas_acceptance_length": 2.5}))
    run_eval(resolve(None, "tiny", {"out": str(tmp_path / "run"), "eval.prompts": str(prompts), "eval.k": 2,
                                    "eval.max_new_tokens": 4, "eval.draft": str(tiny_drafter),
                                    "target.device": "cpu"}))
    assert (tmp_path / "run" / "eval" / "report.json").exists()
    assert not (tmp_path / "run" / "eval" / "parity.json").exists()


def test_eyas_compare_pairs_evals_by_id_and_refuses_what_does_not_pair(tmp_path, capsys):
    """Two evals pair conversation by conversation only when decoded alike: other prompts, K, max_new_tokens,
    target or temperature are refused, naming the setting and both values; conversations pair by id (B holds A's
    three in another order, and one more), not by position; reports that are no report, or whose rounds are not
    numbers, and --method on an eval report are one line each, exit 2."""
    from eyas.cli import main

    def report(name, ids, rounds, **settings):
        rep = {"target": "tiny", "target_identity": {"sha256": "tiny-llama-v1"}, "dtype": "float32", "k": 3,
               "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 16, "turns": 0,
               "prompts": {"set": "p.jsonl", "count": 9, "conversations": len(ids)},
               "rounds_by_conversation": rounds, "conversation_ids": ids}
        for key, v in settings.items():
            rep[key] = {**rep[key], **v} if isinstance(v, dict) else v
        (tmp_path / name).write_text(json.dumps(rep))
        return str(tmp_path / name)

    a = report("a.json", ["x", "y", "z"], [[8, 2], [3, 3], [8, 2]])
    b = report("b.json", ["z", "w", "x", "y"], [[8, 2], [1, 1], [8, 2], [3, 3]], target="/models/tiny.gguf")
    assert main(["compare", a, b, "--json"]) == 0  # the same model under another name
    res = json.loads(capsys.readouterr().out)
    assert res["paired_by"] == "conversation id" and res["unit"] == "conversations"
    assert res["pairs"] == 3 and res["conversations_a"] == 3 and res["conversations_b"] == 4
    assert res["difference"] == 0.0 and res["interval"] == [0.0, 0.0]  # by position it would pair y with w
    for name, settings, msg in (
            ("c.json", {"prompts": {"set": "sharegpt-test"}}, 'prompts: A "p.jsonl", B "sharegpt-test"'),
            ("c.json", {"k": 5}, "k: A 3, B 5"),
            ("c.json", {"max_new_tokens": 64, "temperature": 0.8}, "max_new_tokens: A 16, B 64; temperature: A 0.0, B 0.8"),
            ("c.json", {"target": "smollm2", "target_identity": {"sha256": "abc"}},
             "target: A tiny (tiny-llama-v1), B smollm2 (abc)")):
        c = report(name, ["x", "y", "z"], [[8, 2], [3, 3], [8, 2]], **settings)
        assert main(["compare", a, c]) == 2
        err = capsys.readouterr().err
        assert "were not decoded alike, so their conversations do not pair: " + msg in err, err
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"methods": {"eyas_spec_k3": {"accepted_by_prompt": [[3], [1]]}}}))
    (tmp_path / "array.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text(json.dumps({"rounds_by_conversation": [[1, 2], ["a"]]}))
    (tmp_path / "neither.json").write_text("{}")
    one = report("one.json", ["q", "x"], [[8, 2], [3, 3]])
    for args, msg in (([str(tmp_path / "array.json"), a], "array.json: holds [1, 2] (a JSON array), not a report"),
                      ([a, str(tmp_path / "bad.json")], 'bad.json: rounds_by_conversation[1] is ["a"], not a pair of '
                                                         'whole numbers'),
                      ([a, b, "--method", "foo"], "a.json: an eval report, which holds one decoder's rounds; --method"),
                      ([a, str(bench)], "a.json is an eval report (τ by conversation), " + str(bench) + " a bench_decode"),
                      ([a, one], "fewer than two conversations with rounds in both reports (3 and 2 conversations, 1 "
                                 "of them in both by id)"),
                      ([str(tmp_path / "neither.json"), a], "neither.json: neither an eval report")):
        assert main(["compare", *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and err.count("\n") == 1, err
        assert "session" not in err  # what the report lacks, not when eyas began to write it


def test_eval_refuses_a_drafter_trained_on_its_held_out_split(tmp_path):
    """A run whose answers were regenerated from the test split (regen.split test or all) trained on the eval's
    held-out prompts: the eval of that split is refused (τ would be measured on training conversations); another
    prompt set, or the train split, passes."""
    from eyas.evaluate import check_heldout_split

    run = tmp_path / "run"
    (run / "data" / "regen").mkdir(parents=True)
    for split, refused in (("all", True), ("test", True), ("train", False)):
        (run / "data" / "regen" / "plan.json").write_text(json.dumps({"split": split, "source": "sharegpt"}))
        cfg = resolve(None, "tiny", {"out": str(run)})
        if refused:
            with pytest.raises(EyasError, match=f"regen.split={split} .*measured on conversations the drafter "
                                                "trained on"):
                check_heldout_split(cfg, run)
        else:
            check_heldout_split(cfg, run)
        check_heldout_split(resolve(None, "tiny", {"out": str(run), "eval.prompts": "humaneval"}), run)
