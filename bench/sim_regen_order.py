"""A model of the static regen engine's decode time for two prompt orders, from measured inputs.

    PYTHONPATH=. python3 bench/sim_regen_order.py --regen RUN/data/regen --profile profile_regen.json

Inputs, both measured: the prompt and answer token counts of a finished regeneration (each record's
`meta.turns`), and the decode step times by attended span of `bench/profile_regen.py` (its `step_ms`).
The model replays the engine's schedule (rows refilled every `check_every` steps, a window of
2 x batch conversations in flight, the step's span rounded up to 256 slots as its CUDA graphs are) and
adds up the step times, for the data set's order and for the shortest-first-prompt order that
`eyas regen` uses. It is a model: prefill and host time are left out, and answers keep the lengths
they had in the measured run. The figures it prints are modelled, not measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from pathlib import Path

from eyas.data.conversation import Conversation
from eyas.data.regen import first_prompt_chars


def load(regen: Path) -> list[tuple[int, int, int]]:
    """(first prompt characters, prompt tokens, answer tokens) of each first turn, in the shards' order."""
    out = []
    for f in sorted(regen.glob("shard-*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            conv = Conversation.from_dict(json.loads(line))
            t = conv.meta["turns"][0]
            out.append((first_prompt_chars(conv), int(t["prompt_tokens"]), int(t["completion_tokens"])))
    return out


def step_time(table: list[tuple[int, float]], span: int) -> float:
    """Milliseconds of one decode step attending `span` slots: linear in the span between measured points."""
    if span <= table[0][0]:
        return table[0][1]
    pairs = list(zip(table, table[1:]))
    for (a, x), (b, y) in pairs:
        if span <= b:
            return x + (y - x) * (span - a) / (b - a)
    (a, x), (b, y) = pairs[-1]
    return y + (y - x) * (span - b) / (b - a)


def model(rows: list[tuple[int, int]], table, batch: int, max_new: int, check: int = 8) -> dict:
    """Seconds of decoding for prompts (prompt tokens, answer tokens) admitted in the given order."""
    work, pending = deque(rows), deque()
    slots: list[list[int] | None] = [None] * batch  # [position bound, last position, steps left]
    in_flight, ms, steps, busy = 0, 0.0, 0, 0
    while work or pending or any(slots):
        for k, s in enumerate(slots):  # collect finished rows
            if s is not None and s[2] <= 0:
                slots[k], in_flight = None, in_flight - 1
        while work and in_flight < 2 * batch:
            pending.append(work.popleft())
            in_flight += 1
        live = [s for s in slots if s is not None]
        if live:  # `check` steps at the span of the furthest row
            hi = max(s[0] for s in live)
            for j in range(check):
                ms += step_time(table, -(-(hi + j + 1) // 256) * 256)
                steps += 1
                for s in live:
                    if s[2] > 0:
                        s[2] -= 1
                        busy += 1
            for s in live:
                s[0] = min(s[0] + check, s[1])
        for k in range(batch):  # refill free rows in order (the engine admits after queuing the steps)
            if slots[k] is None and pending:
                p, a = pending.popleft()
                slots[k] = [p, p + max_new - 1, a - 1]
    return {"decode_s": round(ms / 1000, 2), "steps": steps, "row_utilisation": round(busy / max(1, steps * batch), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regen", required=True, help="a finished regeneration's folder (RUN/data/regen)")
    ap.add_argument("--profile", required=True, help="bench/profile_regen.py's JSON (its step_ms table)")
    ap.add_argument("--sampling", default="top_p", choices=("greedy", "top_p"), help="which step time table")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="default: the run's own setting")
    ap.add_argument("--limit", type=int, default=0, help="only the first N records")
    ap.add_argument("--max-prompt-tokens", type=int, default=0, help="only records with shorter prompts")
    ap.add_argument("--out", default="", help="also write the result as JSON here")
    a = ap.parse_args(argv)
    regen = Path(a.regen)
    plan = json.loads((regen / "plan.json").read_text())
    max_new = a.max_new_tokens or plan["settings"]["max_new_tokens"]
    recs = load(regen)
    if a.max_prompt_tokens:
        recs = [r for r in recs if r[1] < a.max_prompt_tokens]
    if a.limit:
        recs = recs[: a.limit]
    recs = [(c, p, min(n, max_new)) for c, p, n in recs]
    table = sorted((int(k), float(v)) for k, v in json.loads(Path(a.profile).read_text())["step_ms"][a.sampling].items())
    tokens = sum(n for _, _, n in recs)
    res = {"records": len(recs), "answer_tokens": tokens, "max_new_tokens": max_new, "sampling": a.sampling,
           "command": " ".join([sys.executable, *sys.argv])}
    for name, order in (("data_set_order", recs), ("shortest_prompt_first", sorted(recs, key=lambda r: r[0]))):
        m = model([(p, n) for _, p, n in order], table, a.batch, max_new)
        m["modelled_tok_s"] = round(tokens / m["decode_s"]) if m["decode_s"] else None
        res[name] = m
        print(f"{name:24s} decode {m['decode_s']:7.2f} s (modelled)  {m['steps']} steps  "
              f"rows busy {m['row_utilisation']:.0%}  {m['modelled_tok_s']:,} tok/s")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
