"""Draft vocabulary: d2t/t2d round trip, required tokens present, coverage equals a direct count."""
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.config import preset
from eyas.data import read_dataset
from eyas.data.prepare import TokenSet, load_tokens, tokens_dir
from eyas.data.tokenize import tokenize_conversation
from eyas.draft import build_drafter
from eyas.util import EyasError, atomic_write_json
from eyas.vocab import choose_vocab, load_vocab, run_vocab


def write_tokens(run: Path, target, n: int, max_len: int) -> None:
    convs, _ = read_dataset("sharegpt", limit=400)
    items = []
    for c in convs:
        if c.turns[0].role == "user":
            t = tokenize_conversation(target.tokenizer, c, max_len, "keep", target.eot_token_ids)
            if sum(t.loss_mask):
                items.append(t)
        if len(items) == n + 1:
            break
    d = tokens_dir(run)
    TokenSet.from_tokenized(items[:n]).save(d / "train.safetensors")
    TokenSet.from_tokenized(items[n:]).save(d / "val.safetensors")
    atomic_write_json(d / "meta.json", {"train_ids": [t.id for t in items[:n]], "val_ids": [t.id for t in items[n:]]})


@pytest.fixture(scope="module")
def vocab_run(tiny, tmp_path_factory):
    run = tmp_path_factory.mktemp("vocab")
    write_tokens(run, tiny, 40, 512)
    cfg = preset("tiny")
    cfg.out = str(run)
    cfg.vocab.draft_vocab_size = 1500
    return run, run_vocab(cfg, tiny)


def test_round_trip_and_required_tokens(tiny, vocab_run):
    run, res = vocab_run
    ids = load_vocab(run, target=tiny)
    t = load_file(str(run / "vocab" / "vocab.safetensors"))
    assert ids.dtype == torch.int64 and ids.numel() == 1500 == res["draft_vocab_size"]
    assert bool((ids[1:] > ids[:-1]).all())
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and t["t2d"].numel() == tiny.vocab_size
    # target_id = i + d2t[i], and t2d marks exactly those ids
    assert torch.equal(torch.arange(1500) + t["d2t"], ids) and torch.equal(t["draft_ids"], ids)
    assert torch.equal(t["t2d"].nonzero().flatten(), ids)
    im_end = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in res["required_tokens"] or "<|im_end|>" in res["required_tokens"]
    for i in set(tiny.eot_token_ids) | {im_end}:
        assert bool(t["t2d"][i])
    # the drafter builds the same buffers from the ids
    drafter = build_drafter(tiny, 1500, ids)
    assert torch.equal(drafter.d2t.cpu(), t["d2t"]) and torch.equal(drafter.t2d.cpu(), t["t2d"])


def test_coverage_matches_direct_count(tiny, vocab_run):
    run, res = vocab_run
    tokens = load_tokens(run, "train")
    counts = Counter()
    for i in range(len(tokens)):
        ids, mask = tokens[i]
        counts.update(ids[mask].tolist())
    total = sum(counts.values())
    keep = set(load_vocab(run).tolist())
    direct = sum(c for tok, c in counts.items() if tok in keep) / total
    report = json.loads((run / "vocab" / "coverage.json").read_text())
    assert report["loss_tokens"] == total and report["coverage"] == pytest.approx(direct, abs=1e-12)
    assert report["distinct_tokens"] == len(counts)
    # every kept token that is not required is at least as frequent as every dropped token
    required = set(report["required_ids"])
    kept_min = min(counts.get(i, 0) for i in keep - required)
    dropped_max = max([c for tok, c in counts.items() if tok not in keep] or [0])
    assert kept_min >= dropped_max
    curve = {p["size"]: p["coverage"] for p in report["curve"]}
    assert curve[tiny.vocab_size] == 1.0 and curve[1024] <= curve[2048]
    top = sum(c for _, c in counts.most_common(1024)) / total
    assert curve[1024] == pytest.approx(top, abs=1e-12)
    assert (run / "vocab" / "coverage.png").stat().st_size > 1000


def test_choose_vocab_edge_cases():
    counts = torch.tensor([5, 0, 9, 9, 1, 0])
    assert choose_vocab(counts, 3, [5]).tolist() == [2, 3, 5]
    assert choose_vocab(counts, 100, []).tolist() == list(range(6))  # capped at the target vocab
    with pytest.raises(EyasError, match="smaller than the 2 tokens"):
        choose_vocab(counts, 1, [0, 1])


def test_load_vocab_missing(tmp_path):
    with pytest.raises(EyasError, match=r"vocab/vocab.safetensors: no draft vocabulary"):
        load_vocab(tmp_path)
