"""bench/tau_by_text.py: tau of a bench_decode report split by the kind of text and by where in the answer each
round starts, on a hand-made report whose figures are worked out below."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tau_by_text", ROOT / "bench" / "tau_by_text.py")
tbt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tbt)


def _report():
    # prompt 0: runs to the cap of 10 tokens; token 0 from the prefill, then rounds accepting 3, 0, 3 drafts emit
    # 4 + 1 + 4 tokens and start at tokens 1, 5, 6. prompt 1: stops at 8 tokens, a loop; rounds accepting 1, 1, 3
    # start at tokens 1, 3, 5 (the last one cut at the stop token)
    plain = {"outputs": [list(range(10)), [7, 8] * 4]}
    spec_ = {"per_prompt": [[10, 3, 6], [8, 3, 5]], "accepted_by_prompt": [[3, 0, 3], [1, 1, 3]], "variant": ""}
    return {"max_new_tokens": 10, "methods": {"eyas_plain": plain, "eyas_spec_k3_fused": spec_}}


def test_splits_by_text_and_by_position():
    res = tbt.split(_report(), ngram=2, repeated=0.3, bands=[0, 0.5, 1.01], positions=[0, 2, 6, 100])
    r = res["eyas_spec_k3_fused"]
    assert r["all"] == {"prompts": 2, "new_tokens": 18, "tau": (11 + 6) / 6}
    assert r["ran_to_cap"]["tau"] == (6 + 3) / 3 and r["stopped"]["tau"] == (5 + 3) / 3
    # [7, 8] * 4: 7 bigrams, 2 distinct -> 5/7 repeated; range(10): none
    assert r["repetitive"]["new_tokens"] == 8 and r["not_repetitive"]["new_tokens"] == 10
    assert r["share [0,0.5)"]["new_tokens"] == 10 and r["share [0.5,1.01)"]["new_tokens"] == 8
    # rounds by start: [0,2) prompt 0's first (3) and prompt 1's first (1); [2,6) prompt 0's second (0) and prompt
    # 1's second and third (1, 3); [6,100) prompt 0's third (3)
    assert r["tokens [0,2)"] == {"rounds": 2, "tau": (3 + 1 + 2) / 2}
    assert r["tokens [2,6)"] == {"rounds": 3, "tau": (0 + 1 + 3 + 3) / 3}
    assert r["tokens [6,100)"] == {"rounds": 1, "tau": 4.0}


def test_command_line_says_when_a_report_cannot_be_split_by_position(tmp_path, capsys):
    rep = _report()
    del rep["methods"]["eyas_spec_k3_fused"]["accepted_by_prompt"]
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rep))
    assert tbt.main([str(p), "--positions", "0,16"]) == 0
    out = capsys.readouterr()
    assert "no accepted_by_prompt" in out.err and "tokens [" not in out.out
