"""The vocab stage: choose the draft vocabulary and report how much of the training signal it covers.

The draft vocabulary is the `vocab.draft_vocab_size` most frequent target tokens among the
loss-masked (trained-on) tokens of the training split, plus the tokens decoding cannot do without
(end-of-turn/EOS and the special tokens the chat template makes an assistant emit), whatever their
counts. It is stored the way SGLang and vLLM read it:

    d2t  int64 [V_d]   offsets: target_id = i + d2t[i]  (draft ids sorted by target id)
    t2d  bool  [V_t]   True where the target token is in the draft vocabulary
    draft_ids int64 [V_d]  the target ids themselves (sorted), for convenience

in `<run>/vocab/vocab.safetensors`, with `coverage.json` and `coverage.png` beside it. Coverage is
the share of loss-masked target tokens that fall in the draft vocabulary: a drafter can never
propose a token outside it, so 1 - coverage bounds how often its first guess must be wrong.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import Config
from .util import EyasError, atomic_path, atomic_write_json, log

COVERAGE_WARN = 0.95
CURVE_SIZES = [256, 512, 1024, 2048, 4096, 8192, 16384, 24576, 32000, 32768, 49152, 65536, 98304, 131072, 163840]


def vocab_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "vocab"


def count_tokens(tokens, vocab_size: int) -> torch.Tensor:
    """Frequency of every target id among the loss-masked tokens of a TokenSet (int64 [vocab_size])."""
    ids = tokens.input_ids[tokens.loss_mask.bool()].long()
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise EyasError(f"token id {int(ids.max())} is outside the target's vocabulary ({vocab_size}); "
                        f"the tokens were made with another tokenizer: delete <run>/data/tokens and re-tokenize")
    return torch.bincount(ids, minlength=vocab_size)


def required_token_ids(target, counts: torch.Tensor | None = None) -> list[int]:
    """Ids the draft vocabulary must hold: end-of-turn/EOS, the special tokens the chat template
    writes inside an assistant turn, reasoning markers the tokenizer knows as single tokens, and
    any special token the assistant turns of the data actually contain."""
    tok = target.tokenizer
    vocab_size = target.vocab_size
    req: list[int] = list(target.eot_token_ids)
    special = set(getattr(tok, "all_special_ids", []) or [])
    for i, t in (getattr(tok, "added_tokens_decoder", {}) or {}).items():
        if getattr(t, "special", True):
            special.add(int(i))
    if getattr(tok, "chat_template", None):
        marker = "Zq9Xv"
        try:
            msgs = [{"role": "user", "content": "hi"}]
            prefix = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": marker}], tokenize=False)
            if full.startswith(prefix):
                turn = tok(full[len(prefix):], add_special_tokens=False).input_ids
                req += [i for i in turn if i in special]
        except Exception:  # a template that cannot render this pair; EOT ids still hold
            pass
    vocab = tok.get_vocab()
    for name in ("<think>", "</think>"):
        if name in vocab and vocab[name] in special:
            req.append(vocab[name])
    if counts is not None and special:
        sp = torch.tensor(sorted(i for i in special if 0 <= i < vocab_size), dtype=torch.long)
        if sp.numel():
            req += sp[counts[sp] > 0].tolist()
    # a template's turn *start* token (e.g. <|im_start|>) is emitted by the template, not the assistant
    start = vocab.get("<|im_start|>")
    out: list[int] = []
    for i in req:
        i = int(i)
        if 0 <= i < vocab_size and i not in out and (i != start or (counts is not None and counts[i] > 0)):
            out.append(i)
    return out


def choose_vocab(counts: torch.Tensor, size: int, required: list[int]) -> torch.Tensor:
    """The `size` ids to keep (sorted ascending): all of `required`, then the most frequent others
    (ties broken by the smaller id, so the choice is deterministic)."""
    V = counts.numel()
    size = min(size, V)
    if len(required) > size:
        raise EyasError(f"vocab.draft_vocab_size={size} is smaller than the {len(required)} tokens decoding needs")
    # stable sort by count descending keeps ascending id order among equal counts
    order = torch.sort(counts, descending=True, stable=True).indices
    keep = torch.zeros(V, dtype=torch.bool)
    keep[torch.tensor(required, dtype=torch.long)] = True
    rest = order[~keep[order]][: size - int(keep.sum())]
    keep[rest] = True
    return keep.nonzero().flatten()


def coverage_curve(counts: torch.Tensor, sizes: list[int] | None = None) -> list[tuple[int, float]]:
    """(size, coverage) of the top-`size` vocabulary by frequency, for each size up to the vocab."""
    total = int(counts.sum())
    V = counts.numel()
    cum = torch.cumsum(torch.sort(counts, descending=True).values, 0)
    sizes = sorted({s for s in (sizes or CURVE_SIZES) if s < V} | {V})
    return [(s, float(cum[s - 1]) / total if total else 0.0) for s in sizes]


def d2t_t2d(draft_ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    draft_ids = draft_ids.long()
    d2t = draft_ids - torch.arange(draft_ids.numel(), dtype=torch.long)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def plot_coverage(curve: list[tuple[int, float]], chosen: tuple[int, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs, ys = zip(*curve)
    ax.plot(xs, [100 * y for y in ys], marker="o", ms=3)
    ax.scatter([chosen[0]], [100 * chosen[1]], color="C3", zorder=3, label=f"chosen: {chosen[0]:,} -> {100 * chosen[1]:.2f}%")
    ax.axhline(100 * COVERAGE_WARN, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocabulary size")
    ax.set_ylabel("coverage of trained-on tokens (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def run_vocab(cfg: Config, target=None) -> dict:
    """Count loss-masked token frequencies over the training split, choose the draft vocabulary,
    write vocab.safetensors, coverage.json and coverage.png; returns the coverage summary."""
    from safetensors.torch import save_file

    from .data.prepare import ensure_tokens, load_tokens, tokens_dir, tokens_key
    from .target_spec import load_spec

    run = Path(cfg.out)
    if target is None:
        target = load_spec(cfg.target)
    ensure_tokens(cfg, target)
    tokens = load_tokens(run, "train")
    V = target.vocab_size
    counts = count_tokens(tokens, V)
    total = int(counts.sum())
    if total == 0:
        raise EyasError(f"{tokens_dir(run)}: the training split has no loss-masked tokens")
    required = required_token_ids(target, counts)
    size = min(cfg.vocab.draft_vocab_size, V)
    if size < 1:
        raise EyasError(f"vocab.draft_vocab_size must be positive, got {cfg.vocab.draft_vocab_size}")
    draft_ids = choose_vocab(counts, size, required)
    d2t, t2d = d2t_t2d(draft_ids, V)
    covered = int(counts[draft_ids].sum())
    coverage = covered / total
    curve = coverage_curve(counts)
    out = vocab_dir(run)
    meta = {"target": json.dumps(target.identity()), "draft_vocab_size": str(size), "tokens": tokens_key(run) or ""}
    with atomic_path(out / "vocab.safetensors") as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "draft_ids": draft_ids.contiguous()}, str(tmp), metadata=meta)
    report = {
        "target": target.identity(), "draft_vocab_size": size, "target_vocab_size": V,
        "coverage": coverage, "loss_tokens": total, "covered_tokens": covered,
        "distinct_tokens": int((counts > 0).sum()), "sequences": len(tokens),
        "required_ids": required, "required_tokens": target.tokenizer.convert_ids_to_tokens(required),
        "curve": [{"size": s, "coverage": c} for s, c in curve],
    }
    atomic_write_json(out / "coverage.json", report)
    plot_coverage(curve, (size, coverage), out / "coverage.png",
                  f"{target.name}: {total:,} trained-on tokens, vocab {V:,}")
    log(f"vocab: {size:,} of {V:,} target tokens cover {100 * coverage:.2f}% of {total:,} trained-on tokens")
    if coverage < COVERAGE_WARN:
        log(f"warning: draft vocabulary coverage {100 * coverage:.2f}% is under {100 * COVERAGE_WARN:.0f}%; "
            f"the drafter cannot propose the other {100 * (1 - coverage):.2f}% of tokens. Use more training data "
            f"or a larger --draft-vocab-size")
    return {k: v for k, v in report.items() if k not in ("curve", "target", "required_ids")}


def ensure_vocab(cfg: Config, target) -> bool:
    """Choose the run's draft vocabulary (run_vocab) when vocab/ has none, or again when the one there cannot be
    what this command means: of another size than a vocab.draft_vocab_size this command was given explicitly
    (`eyas train --draft-vocab-size`), or chosen from tokens the run no longer has (then at its own size).
    Otherwise it is reused as it is, whatever the size settings say (a standalone command is not given the
    settings it was made with). Returns whether it chose one."""
    import dataclasses

    from safetensors import SafetensorError, safe_open

    from .data.prepare import tokens_key

    path = vocab_dir(cfg.out) / "vocab.safetensors"
    if not path.exists():
        run_vocab(cfg, target)
        return True
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError):
        meta = {}
    had = meta.get("draft_vocab_size")
    want = min(cfg.vocab.draft_vocab_size, target.vocab_size)
    given = "vocab.draft_vocab_size" in getattr(cfg, "explicit", ())
    why = []
    if given and had != str(want):
        why.append(f"vocab.draft_vocab_size {had} -> {want}")
    if meta.get("tokens") not in (None, tokens_key(cfg.out)):
        why.append("made from other tokens")
    if not why:
        return False
    if not given and str(had).isdigit():
        cfg = dataclasses.replace(cfg, vocab=dataclasses.replace(cfg.vocab, draft_vocab_size=int(had)))
    log(f"vocab: choosing {path} again ({', '.join(why)})")
    run_vocab(cfg, target)
    return True


def load_vocab(run_dir: str | Path, target=None) -> torch.Tensor:
    """The sorted target ids of the run's draft vocabulary (int64). With `target`, also checks that
    the vocabulary was made for it."""
    from safetensors import SafetensorError, safe_open

    path = vocab_dir(run_dir) / "vocab.safetensors"
    if not path.exists():
        raise EyasError(f"{path}: no draft vocabulary (run `eyas vocab --out {run_dir}` first)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except (SafetensorError, OSError) as e:
        raise EyasError(f"{path}: unreadable vocabulary file ({e}); run `eyas vocab` again") from None
    ids = d2t + torch.arange(d2t.numel(), dtype=torch.long)
    if (ids.numel() and (bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= t2d.numel())
            or not torch.equal(t2d.nonzero().flatten(), ids)):
        raise EyasError(f"{path}: d2t and t2d disagree (corrupt file); run `eyas vocab` again")
    if target is not None and "target" in meta:
        made_for = json.loads(meta["target"])
        if made_for.get("sha256") != target.sha256 or made_for.get("vocab_size") != target.vocab_size:
            raise EyasError(f"{path}: made for target {made_for.get('name')} ({made_for.get('sha256')}), "
                            f"not {target.name} ({target.sha256}); run `eyas vocab` again")
    return ids
