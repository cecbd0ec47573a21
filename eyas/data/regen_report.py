"""What a regeneration produced (validation_report, written as the regen folder's report.json) and its summary for
people (report_lines)."""
from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from ..util import EyasError, read_json, repeated_share, text_lines
from .conversation import Conversation
from .prepare import planned_shards, regen_dir
from .reasoning import capture_by_turn, capture_words
from .regen_plan import LATER, plan_path

# what each kind of left-out conversation means, for the log (http_NNN and others are shown as they are)
ERROR_WORDS = {"context": "first prompt too long for the context", "empty_answer": "empty first answer",
               "bad_response": "the server's answers unreadable", "unreadable_record": "unreadable shard lines"}


def left_out_words(errors: dict) -> str:
    """A report's `errors` (kind -> count) in words: "first prompt too long for the context: 6, http_400: 1"."""
    return ", ".join(f"{ERROR_WORDS.get(k, k)}: {n}" for k, n in sorted(errors.items()))


def _stats(xs: list[int]) -> dict:
    if not xs:
        return {"count": 0}
    xs = sorted(xs)
    return {"count": len(xs), "total": sum(xs), "mean": round(statistics.fmean(xs), 1), "median": xs[len(xs) // 2],
            "p90": xs[min(len(xs) - 1, int(len(xs) * 0.9))], "max": xs[-1]}


# an answer "loops" when at least LOOP_SHARE of its word LOOP_NGRAM-grams occurred earlier in it. A small target's own
# answers loop often (SmolLM2's: a fifth of its first answers' tokens, a third to a half of its later ones', against
# about 1% of ShareGPT's original answers), and a drafter learns little from loops, so the report counts them
LOOP_NGRAM, LOOP_SHARE = 6, 0.5


def validation_report(path: str | Path) -> dict:
    """What a regeneration produced: a run directory or its data/regen folder (or any folder of shards)."""
    p = Path(path)
    d = regen_dir(p) if (regen_dir(p)).is_dir() else p
    if not d.is_dir():
        raise EyasError(f"{p}: no regenerated data here (expected {regen_dir(p)} or a folder of shard-*.jsonl)")
    shards = sorted(d.glob("shard-*.jsonl"))  # every sample's
    plan = read_json(d / "plan.json") if (d / "plan.json").exists() else None
    plans = [plan] + [read_json(f) for f in sorted(d.glob("plan-s*.json"))] if plan else []
    later = read_json(plan_path(d, LATER)) if plan and plan_path(d, LATER).exists() else None
    records, bad_lines, turns, truncated, empty, with_reasoning, looping = 0, 0, 0, 0, 0, 0, 0
    errors: Counter = Counter()
    retries: Counter = Counter()
    stopped: Counter = Counter()
    prompt_toks, completion_toks, turns_per, thought = [], [], [], []  # thought: each record's answers with reasoning
    ids: list[str] = []
    for f in shards:
        for lineno, line in enumerate(text_lines(f.read_text(encoding="utf-8")), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                conv = Conversation.from_dict(rec)
            except (ValueError, KeyError, TypeError):
                bad_lines += 1
                continue
            records += 1
            ids.append(conv.id)
            meta = conv.meta or {}
            tmeta = meta.get("turns", [])
            # the target's answers (a later-turns record starts with answers kept as the data set has them)
            answers = [t for t in conv.turns if t.role == "assistant"][int(meta.get("source_answers_kept", 0)):]
            turns += len(answers)
            turns_per.append(len(answers))
            thought.append([bool(t.reasoning) for t in answers])
            for t in answers:
                with_reasoning += bool(t.reasoning)
                empty += not t.content.strip()
                looping += repeated_share(t.content.split(), LOOP_NGRAM) >= LOOP_SHARE
            for tm in tmeta:
                truncated += tm.get("finish_reason") == "length"
                prompt_toks.append(int(tm.get("prompt_tokens", 0)))
                completion_toks.append(int(tm.get("completion_tokens", 0)))
                retries.update(tm.get("retries", {}))
            if meta.get("stopped"):
                stopped[meta["stopped"]] += 1
                empty += meta["stopped"] == "empty_answer"
        ef = f.with_name(f.name.removesuffix(".jsonl") + ".errors.json")
        if ef.exists():
            for e in read_json(ef).get("errors", []):
                errors[e.get("kind", "unknown")] += 1
                retries.update(e.get("retries", {}))
                empty += e.get("kind") == "empty_answer"
    if bad_lines:
        errors["unreadable_record"] += bad_lines
    samples = len(plans) or None
    plans += [later] if later else []
    planned = sum(len(p["ids"]) for p in plans) if plans else None
    n_shards = planned_shards(plans) if plans else len(shards)
    dup = len(ids) - len(set(ids))
    return {
        "dir": str(d), "planned": planned, "records": records, "shards_done": len(shards), "shards_total": n_shards,
        "complete": len(shards) == n_shards, "duplicates": dup,
        "errors": dict(errors), "errors_total": sum(errors.values()), "retries": dict(retries),
        "assistant_turns": turns, "truncated_turns": truncated, "empty_answers": empty,
        "stopped_early": dict(stopped), "turns_with_reasoning": with_reasoning,
        "reasoning_capture_rate": (with_reasoning / turns) if turns else 0.0,
        "reasoning_capture_by_turn": capture_by_turn(thought),
        "looping_answers": looping, "looping_answer_rate": (looping / turns) if turns else 0.0,
        "turns_per_conversation": _stats(turns_per), "prompt_tokens": _stats(prompt_toks),
        "completion_tokens": _stats(completion_toks),
        "settings": plan.get("settings") if plan else None, "generator": plan.get("generator") if plan else None,
        "samples": samples, **({"later_turns": len(later["ids"])} if later else {}),
    }


def report_lines(r: dict) -> list[str]:
    """A regen report (`validation_report`) for people: what was made, what was left out and why, the answers."""
    def pct(x) -> str:
        return f"{x:.0%}" if isinstance(x, (int, float)) else "?"

    def stats(d) -> str:
        return (f"mean {d.get('mean')}, median {d.get('median')}, p90 {d.get('p90')}, max {d.get('max')}"
                if isinstance(d, dict) and d.get("count") else "none")

    st = r.get("settings") or {}
    gen = r.get("generator") or {}
    left = left_out_words(r.get("errors") or {})
    lines = [
        f"regenerated data in {r.get('dir')}: {r.get('records')} of {r.get('planned')} planned conversations, "
        f"{r.get('shards_done')} of {r.get('shards_total')} shards done"
        + ("" if r.get("complete") else " (unfinished: run the same regen again to resume)")
        + (f", {r.get('samples')} samples per conversation" if (r.get("samples") or 1) > 1 else ""),
        f"left out: {r.get('errors_total', 0)}" + (f" ({left})" if left else ""),
        f"answers: {r.get('assistant_turns')}, {r.get('truncated_turns')} cut at max_new_tokens "
        f"({st.get('max_new_tokens', '?')}), {r.get('empty_answers')} empty, {r.get('looping_answers')} looping "
        f"({pct(r.get('looping_answer_rate'))}), reasoning in {pct(r.get('reasoning_capture_rate'))}",
        f"reasoning by answer turn: {capture_words(r.get('reasoning_capture_by_turn'))}",
        f"answer tokens: {stats(r.get('completion_tokens'))}",
        f"prompt tokens: {stats(r.get('prompt_tokens'))}",
        "sampled with " + ", ".join(f"{k} {v}" for k, v in st.items()),
        f"generator: {gen.get('backend', '?')}, {gen.get('model', '?')}",
    ]
    if r.get("duplicates"):
        lines.append(f"duplicates: {r['duplicates']} records written twice")
    if r.get("retries"):
        lines.append("retries: " + ", ".join(f"{k} {v}" for k, v in sorted(r["retries"].items())))
    return lines
