"""`eyas eval` end to end on the tiny target: report files and keys, multi-turn prompts, errors."""
import json

import pytest
import torch

from eyas.config import resolve
from eyas.draft import build_drafter, save_drafter
from eyas.evaluate import measure_acceptance, round_sums, run_eval, tau_difference, tau_interval
from eyas.util import EyasError

DESIGN_KEYS = ["target", "k", "temperature", "prompts", "acceptance_length", "per_position_acceptance",
               "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless", "device"]


@pytest.fixture(scope="module")
def tiny_drafter(tiny, tmp_path_factory):
    torch.manual_seed(0)
    d = build_drafter(tiny, 1024)
    return save_drafter(d, tmp_path_factory.mktemp("draft") / "draft")


def test_run_eval_writes_report(tiny, tiny_drafter, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": "ignored"},
                                     {"role": "user", "content": "And again?"}]},
            {"id": "b", "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Name a fruit."}]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
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
    assert "95% interval" in (tmp_path / "run" / "eval" / "report.md").read_text()
    assert rep["lossless"] is True and rep["lossless_checked"] == 3
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
    from eyas.evaluate import Tally, by_repetition, repeat_bucket

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
    assert "A - B: +0.550 (80% paired interval" in out and "over 4 prompts both reached; same text 3/4" in out
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
