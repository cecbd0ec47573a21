"""The run report: one markdown page (`<run>/report.md`) with the numbers of every stage and
links to the plots the stages drew (`eval/report.md` stays the evaluation's own page). Built from the files in the run directory alone, so
`eyas report DIR` can rebuild it at any time."""
from __future__ import annotations

import json
from pathlib import Path

from .data.regen_report import left_out_words
from .util import EyasError, atomic_write_text, human_bytes, log


def _load(path: Path, unread: list | None = None):
    """A run file's JSON; None when it is not there. One that is there but unreadable (cut short, edited) is also
    None, and is named in `unread`, so the page says which section is missing and why instead of leaving it out."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        if unread is not None:
            unread.append(f"{path}: {e}")
        return None


def _lossless(ev: dict) -> str:
    """The lossless cell: True, or False with how many answers were plain decoding's bit for bit and whether the
    others were with plain decoding's steps shaped as the verify (kernel rounding)."""
    loss = ev.get("lossless")
    if loss is not False or ev.get("lossless_matched") is None:
        return str(loss)
    cell = f"False ({ev['lossless_matched']}/{ev.get('lossless_checked')} equal"
    if ev.get("lossless_exact"):
        return cell + "; the rest kernel rounding)"
    return cell + ")"


def _prompts(p) -> str:
    """The eval's prompts record ({"set", "count", "conversations"}) as words."""
    if not isinstance(p, dict):
        return str(p)
    s = f"{p.get('set')}: {_fmt(p.get('count'))} prompts"
    return s + (f" in {_fmt(p['conversations'])} conversations" if p.get("conversations") else "")


STATUS_WORDS = {"running": "running, or cut short (`eyas run` again resumes it)",
                "replaced": "replaced by a standalone `eyas {by}` (the next `eyas run` makes the run's own again)"}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _img(lines: list[str], run: Path, rel: str, alt: str) -> None:
    if (run / rel).exists():
        lines.append(f"![{alt}]({rel})")


def write_report(run: Path) -> dict:
    run = Path(run)
    if not run.is_dir():
        raise EyasError(f"{run} is not a run directory" + (" (it is a file)" if run.exists() else " (there is none)")
                        + "; give the --out of an `eyas run`")
    if not (run / "manifest.json").exists():
        raise EyasError(f"{run} holds no manifest.json, so it is not a run directory of `eyas run`; give the --out of "
                        f"one")
    unread: list[str] = []
    man = _load(run / "manifest.json", unread) or {}
    ev = _load(run / "eval" / "report.json", unread)
    tok = _load(run / "data" / "tokens" / "meta.json", unread)
    voc = _load(run / "vocab" / "coverage.json", unread)
    feats = _load(run / "features" / "manifest.json", unread)
    stages = man.get("stages", {})
    lines = [f"# eyas run report: `{run}`", ""]
    if unread:
        lines += ["Files that could not be read, whose sections are missing below: " + "; ".join(unread), ""]
        for u in unread:
            log(f"report: could not read {u}")
    tgt = man.get("target", {})
    if tgt:
        lines += [f"Target **{tgt.get('name')}** ({tgt.get('num_layers')} layers, hidden {tgt.get('hidden_size')}, "
                  f"vocabulary {tgt.get('vocab_size'):,}), aux layers {tgt.get('aux_layers')}.", ""]
    if ev:
        lines += _result(run, ev, stages)
    if stages:
        lines += _stage_table(stages)
    regen = (stages.get("regen") or {}).get("result") or {}
    if regen or tok:
        lines += _data(regen, tok)
    if voc:
        lines += ["## Vocabulary", ""]
        for k, v in voc.items():
            if not isinstance(v, (dict, list)):
                lines.append(f"- {k.replace('_', ' ')}: {_fmt(v)}")
        _img(lines, run, "vocab/coverage.png", "coverage")
        lines.append("")
    if feats:
        lines += ["## Features", "", f"- stored: {human_bytes(feats.get('bytes', 0))}, dtype {feats.get('dtype')}, "
                  f"{_fmt(feats.get('tokens', 0))} tokens", ""]
    tr = (stages.get("train") or {}).get("result") or {}
    if tr:
        lines += _training(run, tr)
    if ev:
        lines += ["## Evaluation details", "", "```json", json.dumps({k: v for k, v in ev.items()
                                                                      if k not in ("samples", "outputs")}, indent=1)[:6000],
                  "```", ""]
    text = "\n".join(lines) + "\n"
    out = run / "report.md"
    atomic_write_text(out, text)
    return {"report": str(out)}


def _result(run: Path, ev: dict, stages: dict) -> list[str]:
    """The eval's numbers: τ, K, speedup, lossless, by position, turn and repetition, and its plots."""
    ci = ev.get("acceptance_length_ci95")  # a bootstrap over the eval's conversations (eyas.eval_stats.tau_interval)
    ci = f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
    lines = ["## Result", ""]
    by = (stages.get("eval") or {}).get("by")
    if (stages.get("eval") or {}).get("status") == "replaced":
        lines += [f"This eval was written by a standalone `eyas {by or 'eval'}` after the run, perhaps with other "
                  "settings than the run's (the stage table below keeps the run's own figures); the next `eyas run` "
                  "makes the run's own eval again.", ""]
    lines += [
              f"| acceptance length τ{' (95% interval)' if ci else ''} | K | temperature | speedup vs plain decoding "
              "| lossless | prompts | device |",
              "| --- | --- | --- | --- | --- | --- | --- |",
              f"| **{_fmt(ev.get('acceptance_length'))}**{ci} | {ev.get('k')} | {ev.get('temperature')} | "
              f"{_fmt(ev.get('speedup'))}× ({_fmt(ev.get('tokens_per_s'))} vs {_fmt(ev.get('baseline_tokens_per_s'))} tok/s) | "
              f"{_lossless(ev)} | {_prompts(ev.get('prompts'))} | {ev.get('device')} |", ""]
    ppa = ev.get("per_position_acceptance")
    if ppa:
        lines += ["Per-position acceptance (draft token 1..K): " + ", ".join(f"{x:.2f}" for x in ppa), ""]
    for key, what, name in (("by_turn", "the answer's place in its conversation", "answer {}"),
                            ("by_repetition", "how much the answer repeats itself (the share of its 8-grams "
                                              "seen earlier in it)", "{}")):
        if ev.get(key):
            lines += [f"τ by {what}: " + ", ".join(
                f"{name.format(b)}: {v['acceptance_length']:.2f} ({v['answers']} answers)"
                for b, v in ev[key].items()), ""]
    for png in sorted((run / "eval").glob("*.png")):
        lines.append(f"![{png.stem}](eval/{png.name})")
    lines.append("")
    return lines


def _stage_table(stages: dict) -> list[str]:
    lines = ["## Stages", "", "| stage | status | seconds | summary |", "| --- | --- | --- | --- |"]
    total = 0.0
    for name, rec in stages.items():
        total += rec.get("seconds", 0) or 0
        status = STATUS_WORDS.get(rec.get("status"), rec.get("status")).format(by=rec.get("by", name))
        lines.append(f"| {name} | {status} | {_fmt(rec.get('seconds', ''))} | "
                     f"{rec.get('summary', rec.get('reason', ''))} |")
    return lines + [f"| **total** | | {_fmt(total)} | |", ""]


def _data(regen: dict, tok: dict | None) -> list[str]:
    """What regen made and what the tokens hold."""
    lines = ["## Data", ""]
    for k, v in regen.items():
        if not isinstance(v, (dict, list)):
            lines.append(f"- regen {k.replace('_', ' ')}: {_fmt(v)}")
        elif k == "errors" and isinstance(v, dict) and v:
            lines.append(f"- regen conversations left out: {left_out_words(v)}")
        elif k == "this_call" and isinstance(v, dict):
            lines.append(f"- regen this call: {_fmt(v.get('generated_tokens'))} answer tokens generated in "
                         f"{_fmt(v.get('seconds'))} s" + (f", {_fmt(v['rows'])} rows at a time" if v.get("rows")
                                                          else ""))
        elif isinstance(v, dict) and k in ("token_stats", "lengths", "answer_tokens"):
            lines.append(f"- regen {k.replace('_', ' ')}: {json.dumps(v)}")
    if tok:
        lines += [f"- tokenized from {tok.get('source')}: {tok.get('conversations')} conversations, "
                  f"{_fmt(tok.get('tokens'))} tokens ({_fmt(tok.get('loss_tokens'))} trained on), "
                  f"{tok.get('truncated')} truncated, {len(tok.get('train_ids', []))} train / "
                  f"{len(tok.get('val_ids', []))} validation"
                  + ("; seconds " + ", ".join(f"{k} {v}" for k, v in tok["seconds"].items())
                     if isinstance(tok.get("seconds"), dict) else "")]
    lines.append("")
    return lines


def _training(run: Path, tr: dict) -> list[str]:
    """The training's summary, its best checkpoint's validation τ forecasts, and its curves."""
    lines = ["## Training", ""]
    for k, v in tr.items():
        if not isinstance(v, (dict, list)):
            lines.append(f"- {k.replace('_', ' ')}: {_fmt(v)}")
        elif k in ("val_per_position_accuracy", "per_position_accuracy"):
            lines.append(f"- {k.replace('_', ' ')}: " + ", ".join(f"{x:.3f}" for x in v))
        elif k == "best" and isinstance(v, dict) and "val_tau" in v:
            lines.append(f"- best checkpoint: step {v.get('step')} (picked by {v.get('by', 'val_al')}), "
                         f"validation τ forecast {v['val_tau']:.2f} at "
                         f"K={len(v['val_accept'])} (greedy chain acceptance by position "
                         + ", ".join(f"{x:.3f}" for x in v["val_accept"]) + ")")
            if "greedy_tau" in v:
                lines.append(f"- on the target's greedy answers to validation prompts (what the decoder verifies): "
                             f"τ forecast {v['greedy_tau']:.2f}"
                             + (f" over {v['greedy_rounds']} decoding rounds ({v['greedy_tau_all']:.2f} averaged over "
                                f"every position)" if "greedy_rounds" in v else "")
                             + ", acceptance by position " + ", ".join(f"{x:.3f}" for x in v["greedy_accept"]))
    _img(lines, run, "train/curves.png", "training curves")
    lines.append("")
    return lines
