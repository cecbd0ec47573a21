"""`eyas data`: what a data set holds, what was skipped and why, splits and token lengths."""
from __future__ import annotations

import json
import statistics
from collections import Counter

from ..config import Config
from ..util import EyasError
from .prepare import check_data_settings
from .readers import read_dataset, split_of
from .regen_report import report_lines, validation_report
from .reasoning import tokenize_sequences


def _stats(xs: list[int]) -> str:
    if not xs:
        return "none"
    xs = sorted(xs)
    return (f"mean {statistics.fmean(xs):.0f}, median {xs[len(xs) // 2]}, p90 {xs[int(len(xs) * 0.9)]}, "
            f"max {xs[-1]}")


def inspect_data(cfg: Config, report_dir: str | None = None, show: int = 0, tokens: bool = False,
                 as_json: bool = False) -> int:
    if report_dir:
        rep = validation_report(report_dir)
        print(json.dumps(rep, indent=2) if as_json else "\n".join(report_lines(rep)))
        return 0
    check_data_settings(cfg)
    if show < 0:
        raise EyasError(f"--show must be 0 (none) or a number of conversations to print, got {show}")
    convs, rep = read_dataset(cfg.data.source, strict=cfg.data.strict, limit=cfg.data.limit)
    print(rep.summary())
    for e in rep.examples[5:20]:
        print(f"  {e}")
    splits = {"train": 0, "val": 0, "test": 0}
    for c in convs:
        splits[split_of(c.id, cfg.data.val_ratio, cfg.data.test_ratio)] += 1
    print("splits:", ", ".join(f"{k} {v}" for k, v in splits.items()))
    counts = Counter(c.id for c in convs)
    dup = {i: n for i, n in counts.items() if n > 1}
    if dup:  # regen refuses them (it resumes by id), and records of one id share a split
        shown = ", ".join(f"{i!r} ({n}x)" for i, n in list(dup.items())[:5]) + (" ..." if len(dup) > 5 else "")
        print(f"  duplicate record ids: {len(dup)} ids occur more than once ({sum(dup.values()) - len(dup)} extra "
              f"records): {shown}; `eyas regen` refuses such a data set (it needs unique ids to resume safely)")
    if convs and not splits["test"]:
        print(f"  no conversation falls in the test split at data.test_ratio {cfg.data.test_ratio}: the eval, which "
              f"takes its prompts from it, would have none (raise --test-ratio, or give the eval prompts of its own "
              f"with --set eval.prompts=FILE)")
    print("turns per conversation:", _stats([len(c.turns) for c in convs]))
    print("assistant turns with reasoning:", sum(1 for c in convs for t in c.turns if t.reasoning))
    if tokens or show:
        from ..target_spec import load_spec

        target = load_spec(cfg.target)
        tok = target.tokenizer
        if tokens:
            lens, masked, trunc = [], [], 0
            for c in convs:
                for t in tokenize_sequences(tok, c, cfg.data.max_seq_len, cfg.data.reasoning, target.eot_token_ids):
                    lens.append(len(t.input_ids))
                    masked.append(sum(t.loss_mask))
                    trunc += t.truncated
            # a template that drops earlier reasoning makes one sequence per answer (eyas.data.reasoning)
            each = "sequence" if len(lens) != len(convs) else "conversation"
            print(f"tokens per {each}:", _stats(lens))
            print(f"trained-on tokens per {each}:", _stats(masked))
            print(f"truncated to {cfg.data.max_seq_len}: {trunc}")
        shown = (t for c in convs[:show]
                 for t in tokenize_sequences(tok, c, cfg.data.max_seq_len, cfg.data.reasoning, target.eot_token_ids))
        for t in shown:
            out, cur = [], None
            for i, m in zip(t.input_ids, t.loss_mask):
                if m != cur:
                    out.append("[[" if m else ("]]" if cur else ""))
                    cur = m
                out.append(tok.decode([i]))
            if cur:
                out.append("]]")
            print(f"--- {t.id} ({len(t.input_ids)} tokens, {sum(t.loss_mask)} trained on)")
            print("".join(out))
    return 0
