"""The files of a regen folder and its plans: which conversations go to which shard of each set of answers (the
first sample, samples after it, the later turns), file names, and the checks that a folder holds what a call asks
for (eyas.data.regen drives the regeneration)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import Config
from ..util import EyasError, atomic_write_json, atomic_write_text, log, read_json, text_lines
from .server import template_kwargs

PLAN_VERSION = 1
LATER = "later"  # the set regen.later_turns writes, beside the samples (1, 2, ...)


def planned_lines(shard: Path, index: dict) -> list[tuple[int, str, str]]:
    """(place in the plan, id, line) of each line of a regen shard, in file order, whose conversation id `index`
    (id -> place) holds; a line that does not parse, or names no planned id, is left out."""
    out = []
    for line in text_lines(shard.read_text(encoding="utf-8")):
        try:
            cid = json.loads(line).get("id")
        except (ValueError, AttributeError):
            continue
        if cid in index:
            out.append((index[cid], cid, line))
    return out


def _tag(sample: int | str) -> str:
    """A set's name in its files: none for the first sample, sS for sample S, `later` for the later turns."""
    return "" if sample == 1 else f"s{sample}" if isinstance(sample, int) else sample


def _shard_prefix(sample: int | str) -> str:
    """What every file name of a set's shards starts with, before the shard's number."""
    return f"shard-{_tag(sample)}-" if _tag(sample) else "shard-"


def _shard_stem(k: int, sample: int | str) -> str:
    return f"{_shard_prefix(sample)}{k:05d}"


def shard_path(d: Path, k: int, sample: int | str = 1) -> Path:
    return d / f"{_shard_stem(k, sample)}.jsonl"


def errors_path(d: Path, k: int, sample: int | str = 1) -> Path:
    return d / f"{_shard_stem(k, sample)}.errors.json"


def journal_path(d: Path, k: int, sample: int | str = 1) -> Path:
    """Shard k's finished conversations so far, a JSON line each, until the shard is written (not *.jsonl, so no
    reader of shards takes it for one)."""
    return d / f"{_shard_stem(k, sample)}.partial"


def plan_path(d: Path, sample: int | str = 1) -> Path:
    return d / (f"plan-{_tag(sample)}.json" if _tag(sample) else "plan.json")


def _samples_after(d: Path, n: int) -> list[int]:
    """The samples after the first n that regen folder d holds files of (shards, journals, error lists or plans)."""
    found = (re.match(r"(?:shard|plan)-s(\d+)[-.]", f.name) for f in d.iterdir()) if d.is_dir() else ()
    return sorted({int(m[1]) for m in found if m and int(m[1]) > n})


def drop_samples_after(d: Path, n: int) -> list[int]:
    """Remove the sets of samples after the first n from the regen folder d (their shards, journals, error lists and
    plans) and its report, which no longer describes the folder; the first sample and the later turns stay. Returns
    the samples removed. For `eyas run` when only regen.samples changed: the samples kept are what a run with the new
    count makes of them (a sample's plan, seeds and shards do not depend on the count)."""
    gone = _samples_after(d, n)
    for s in gone:
        for f in [*d.glob(f"{_shard_prefix(s)}*"), plan_path(d, s)]:
            f.unlink(missing_ok=True)
    (d / "report.json").unlink(missing_ok=True)
    return gone


def check_no_extra_sets(d: Path, samples: int, later_turns: bool) -> None:
    """Refuse a regen folder d that holds sets of answers a call with these settings does not ask for: samples after
    the first `samples`, or later turns where regen.later_turns is off. Every command that trains on the folder reads
    all its shards, so they would be trained on as well. `eyas run` removes them itself when only the sample count
    went down (drop_samples_after) and starts over on any other change; a standalone `eyas regen` leaves the choice
    to its user: go on with them, or remove them."""
    if not d.is_dir():
        return
    extra: list[int | str] = list(_samples_after(d, samples))
    if not later_turns and (plan_path(d, LATER).exists() or any(d.glob(f"{_shard_prefix(LATER)}*"))):
        extra.append(LATER)
    if not extra:
        return
    nums = [x for x in extra if x != LATER]
    what = ", ".join([*(f"sample {x}" for x in nums), *(["the later turns"] if LATER in extra else [])])
    asks = f"regen.samples={samples}" + ("" if later_turns or LATER not in extra else ", regen.later_turns off")
    keep = ([f"--samples {max(nums)}"] if nums else []) + (["--later-turns"] if LATER in extra else [])
    files = ", ".join(f"{_shard_prefix(x)}*, {plan_path(d, x).name}" for x in extra)
    raise EyasError(f"{d} holds answers this call does not ask for ({what}; it asks for {asks}). Every command "
                    f"that trains on this folder reads all of them. To go on with them, give {' '.join(keep)}; to "
                    f"keep only what this call asks for, delete their files in {d} ({files}) first")


def sampling_settings(cfg: Config, sample: int | str = 1) -> dict:
    """What a record says it was sampled with; a sample after the first also says which it is (the first's
    settings are the same as a run with regen.samples=1, so such a run's shards count as the first sample), and
    the later turns' set says what it is."""
    rc = cfg.regen
    which = {"later_turns": "original history"} if sample == LATER else {"sample": sample} if sample > 1 else {}
    return {"max_new_tokens": rc.max_new_tokens, "temperature": rc.temperature, "top_p": rc.top_p, "seed": rc.seed,
            "turns": 0 if sample == LATER else rc.turns, "reasoning": cfg.data.reasoning, **which,
            **({"chat_template_kwargs": template_kwargs(rc)} if rc.chat_template_kwargs else {})}


def settle_plan(d: Path, cfg: Config, ids: list[str], identity: dict, sample: int | str = 1) -> dict:
    """The plan of set `sample` in regen folder d: written where there is none, grown where `ids` only adds
    conversations after the plan's own (_grows), else the plan there, refused where it was made otherwise."""
    # "data": the data settings that chose the conversations (the split's ratios only where a split is taken), so
    # that a command training on the answers can refuse other values it is given (prepare.check_regen_matches). Not
    # compared below, since the ids say which conversations were chosen: settings that choose the same ones replace
    # the record (a plan written before it gains one)
    chose = {"limit": cfg.data.limit}
    if cfg.regen.split != "all":
        chose.update(val_ratio=cfg.data.val_ratio, test_ratio=cfg.data.test_ratio)
    plan = {"version": PLAN_VERSION, "source": cfg.data.source, "split": cfg.regen.split,
            "settings": sampling_settings(cfg, sample), "generator": identity, "shard_size": cfg.regen.shard_size,
            "ids": ids, "data": chose}
    path = plan_path(d, sample)
    if path.exists():
        old = read_json(path)
        if _grows(old, plan):
            _extend(d, old, plan, sample)
            return plan
        for k in ("source", "split", "settings", "generator", "shard_size", "ids"):
            if old.get(k) != plan[k]:
                what = (f"{len(old.get('ids', []))} conversations before, {len(ids)} now" if k == "ids"
                        else f"{old.get(k)!r} before, {plan[k]!r} now")
                raise EyasError(f"{d} holds regenerated data made with different '{k}' ({what}); use another "
                                f"--out, or delete {d} to start over")
        if old.get("data") != plan["data"]:
            old["data"] = plan["data"]
            atomic_write_json(path, old)
        return old
    # a new plan: journals left from an earlier one (its plan deleted by hand) are not this plan's work
    for stale in d.glob(f"{_shard_prefix(sample)}[0-9]*.partial"):
        stale.unlink()
    atomic_write_json(path, plan)
    return plan


def _grows(old: dict, new: dict) -> bool:
    """Whether plan `new` only adds conversations after those of plan `old` (a larger regen.limit over the same data
    and settings): the old shards then hold the first conversations of the new plan's shards of the same numbers."""
    same = all(old.get(k) == new[k] for k in ("source", "split", "settings", "generator", "shard_size"))
    ids = old.get("ids")
    return same and isinstance(ids, list) and len(ids) < len(new["ids"]) and new["ids"][:len(ids)] == ids


def _extend(d: Path, old: dict, new: dict, sample: int | str) -> None:
    """Replace plan `old` by `new`, which adds conversations after its own (`_grows`). Every old shard stays but the
    last one when it was not full: the new plan gives that shard more conversations, so its finished ones go back to
    its journal, where the run reads them instead of asking again, and the shard is written whole once the new ones
    are done. Safe to cut anywhere: the journal is written before the shard is removed, and the plan replaced last."""
    size, n = new["shard_size"], len(old["ids"])
    of = "later turns: " if sample == LATER else f"sample {sample}: " if sample != 1 else ""
    k = n // size  # the old plan's last shard, unless its conversations filled whole shards
    shard = shard_path(d, k, sample)
    if n % size and shard.exists():
        index = {cid: i for i, cid in enumerate(new["ids"][k * size:(k + 1) * size], k * size)}
        # what a line does not say clearly is asked again
        got = {i: {"i": i, "id": cid, "line": line} for i, cid, line in planned_lines(shard, index)}
        ef = errors_path(d, k, sample)
        for e in (read_json(ef).get("errors", []) if ef.exists() else []):
            if isinstance(e, dict) and e.get("id") in index:
                got[index[e["id"]]] = {"i": index[e["id"]], "id": e["id"], "error": e}
        atomic_write_text(journal_path(d, k, sample),
                          "".join(json.dumps(got[i], ensure_ascii=False) + "\n" for i in sorted(got)))
        shard.unlink()
        ef.unlink(missing_ok=True)
    atomic_write_json(plan_path(d, sample), new)
    log(f"regen: {of}the plan grows from {n:,} to {len(new['ids']):,} conversations: the answers to the first {n:,} "
        f"are kept")
