"""bench/accept_by_confidence.py on the tiny target: its greedy answers teacher-forced, the drafter's chain counted
at every answer position and binned by the target's confidence."""
import importlib.util
import json
from pathlib import Path

import torch

from eyas.decode import Decoder
from eyas.draft import build_drafter, save_drafter
from eyas.evaluate import prompt_ids

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("accept_by_confidence", ROOT / "bench" / "accept_by_confidence.py")
abc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(abc)


def test_counts_every_answer_position_once(tiny, tmp_path):
    questions = ["Name a fruit.", "Count to five.", "What is a hawk?"]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                           for i, q in enumerate(questions)))
    torch.manual_seed(0)
    draft = save_drafter(build_drafter(tiny, 1024), tmp_path / "draft")
    dec = Decoder(tiny, None, k=1, max_len=256)
    ids = [prompt_ids(tiny.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    outs = [dec.generate(p, 24, tiny.eot_token_ids, speculative=False).tokens for p in ids]
    report = tmp_path / "decode.json"
    report.write_text(json.dumps({"methods": {"eyas_plain": {"outputs": outs}}}))
    res_path = tmp_path / "out.json"
    assert abc.main(["--report", str(report), "--draft", str(draft), "--target", "tiny", "--prompts", str(src),
                     "--limit", "3", "--steps", "2", "--bins", "0,0.5,1.01", "--out", str(res_path)]) == 0
    res = json.loads(res_path.read_text())
    stop = set(tiny.eot_token_ids)
    answer_tokens = sum(len([x for x in o if x not in stop]) for o in outs)
    assert sum(res["answers"].values()) == 3
    kinds = res["by_kind"].values()
    # step 0 drafts every answer token once (from the position two before it); later steps only where accepted
    assert sum(k["0"]["positions"] for k in kinds) == answer_tokens
    for k in kinds:
        assert k["1"]["positions"] <= k["0"]["positions"]
        for step in k.values():
            if step["positions"]:  # every position in one bin
                assert abs(sum(b["share"] for b in step["bins"].values()) - 1.0) < 1e-9
