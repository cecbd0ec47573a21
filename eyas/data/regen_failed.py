"""What `eyas regen` does when it produced nothing usable, or its server fails request after request: a server that
answers with an error (HTTP 400, a body without `choices`, null content, an HTML page), or prompts that all fail. Such a call stops with one line
naming the error and how many conversations failed, and forgets the failures it wrote (shards with failures go back
to open shards whose journals hold their records), so the stage is not recorded as done and the same command, once the
server is fixed, asks for those conversations again instead of skipping them as finished."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from ..util import EyasError, atomic_write_text, read_json
from .regen_plan import planned_lines
from .regen_report import left_out_words

# a call stops once FAIL_FAST conversations in a row failed (a prompt too long for the context aside): a server that
# refuses every request, or broke mid-run, would otherwise be asked for every conversation left, each after its
# retries, and the stage recorded as finished with all of them left out
FAIL_FAST = 16


class CallOutcomes:
    """The failures of a regen call's conversations by kind, and the first one's message: since the last success
    (`streak`, what the call stops on) or over a whole folder (folder_failures)."""

    def __init__(self):
        self.kinds: Counter = Counter()
        self.first = ""

    def add(self, outcome: dict) -> None:
        err = outcome.get("error")
        if not err:
            self.kinds.clear()
            self.first = ""
            return
        if err.get("kind") == "context":  # the data's, not the server's
            return
        self.fail(err)

    def fail(self, err: dict) -> None:
        self.kinds[err.get("kind", "unknown")] += 1
        self.first = self.first or str(err.get("message", ""))

    def hopeless(self) -> bool:
        return sum(self.kinds.values()) >= FAIL_FAST


def folder_failures(d: Path) -> CallOutcomes:
    """Every failure the error lists of regen folder d record."""
    out = CallOutcomes()
    for f in sorted(d.glob("shard-*.errors.json")):
        for e in (read_json(f).get("errors") or []):
            if isinstance(e, dict):
                out.fail(e)
    return out


def _plan_of(shard: Path) -> Path | None:
    """The plan of the set a shard belongs to: shard-NNNNN -> plan.json, shard-s2-NNNNN -> plan-s2.json."""
    m = re.fullmatch(r"shard-(?:(\w+)-)?\d+\.jsonl", shard.name)
    return None if m is None else shard.with_name(f"plan-{m[1]}.json" if m[1] else "plan.json")


def forget_failures(d: Path) -> int:
    """Remove from regen folder d what says a conversation failed, so that a rerun asks for it again: a shard with
    failures goes back to being an open shard (its records into its journal, as regen_plan._extend does, the shard and
    its error list removed), and the failed lines of open shards' journals are dropped. -> shards reopened."""
    reopened = 0
    for shard in sorted(d.glob("shard-*.jsonl")):
        errors = shard.with_name(shard.name.removesuffix(".jsonl") + ".errors.json")
        plan = _plan_of(shard)
        if not errors.exists() or not (read_json(errors).get("errors") or []) or plan is None or not plan.exists():
            continue
        index = {cid: i for i, cid in enumerate(read_json(plan).get("ids") or [])}
        kept = [json.dumps({"i": i, "id": cid, "line": line}, ensure_ascii=False) + "\n"
                for i, cid, line in planned_lines(shard, index)]
        # the journal before the shard goes: a kill between them loses nothing
        atomic_write_text(shard.with_name(shard.name.removesuffix(".jsonl") + ".partial"), "".join(kept))
        shard.unlink()
        errors.unlink(missing_ok=True)
        reopened += 1
    for journal in sorted(d.glob("shard-*.partial")):
        kept = []
        for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if isinstance(o, dict) and "line" in o:
                kept.append(line + "\n")
        atomic_write_text(journal, "".join(kept))
    return reopened


def failure_error(d: Path, outcomes: CallOutcomes, backend: str, planned: int | None = None) -> EyasError:
    """The error a call that produced nothing usable stops with, after forgetting its failures (forget_failures)."""
    n = sum(outcomes.kinds.values())
    forget_failures(d)
    what = (f"{n} conversations in a row failed" if planned is None else
            f"no usable answer: all {n} conversations failed" if n == planned else
            f"no usable answer: {n} of {planned} conversations failed")
    who = "the server" if backend == "server" else "the target"
    return EyasError(f"regen stopped, {what} ({left_out_words(outcomes.kinds)})"
                     + (f", e.g. {outcomes.first}" if outcomes.first else "")
                     + f". Nothing was recorded as done; fix {who} or the settings it refuses and run the same command "
                       f"again: the failed conversations will be asked again")
