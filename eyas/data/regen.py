"""`eyas regen`: regenerate every assistant turn of a data set with the target, so the drafter learns
the target's own answers.

For each conversation the system and user turns are kept, the original assistant turns dropped, and
each assistant turn generated in order, conditioned on the regenerated history. Backends:

* embedded (default): the target in-process, on one of the engines of eyas.engine.generate (`static`, eyas' own
  decode loop; `continuous`; `generate`; `auto`).
* server: any OpenAI-compatible endpoint (see server.py).

Output: `<run>/data/regen/shard-NNNNN.jsonl`, one `Conversation.to_dict()` per line with `meta`
holding the source id, sampling settings and per-turn finish reason and token counts. `plan.json`
fixes which conversations go to which shard, so a killed run resumes: shards are written whole
(atomic rename) once all their conversations are done, existing shards are never touched, and the
rest is generated again. Until its shard is written, each finished conversation is appended to the shard's
journal (`shard-NNNNN.partial`), which a resumed run reads back instead of asking again: a kill loses only the
conversations in flight (a multi-turn conversation can hold its shard open for minutes while the window moves on,
so without it a kill lost whole shards' worth of finished work). Conversations that failed are listed in
`shard-NNNNN.errors.json`.
Beside the first sample, `regen.samples` writes sample S as `shard-sS-*.jsonl` (record ids `<id>~sampleS`), and
`regen.later_turns` the later answers of every conversation that has a later user turn as `shard-later-*.jsonl`
(record ids `<id>~later`): its first answer as the data set has it, each later one generated with the data set's
own earlier answers before it rather than the target's (which loop more with every turn).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config, RegenConfig, check_settings
from ..engine.generate import EmbeddedEngine, embedded_engine, make_embedded
from ..target import load_target
from ..util import (EyasError, atomic_write_json, atomic_write_text, dist_barrier, dist_env, log, progress,
                    stable_hash)
from .conversation import Conversation
from .prepare import check_data_settings, regen_dir
from .readers import read_dataset, select_split
from .regen_conv import ConvState, answer_slots, later_copy, sample_copy
from .regen_failed import CallOutcomes, failure_error, folder_failures
from .regen_plan import (LATER, check_no_extra_sets, errors_path, journal_path, sampling_settings, settle_plan,
                         shard_path)
from .regen_report import left_out_words, validation_report
from .reasoning import capture_words
from .server import ServerBackend


class _Deferred:
    """An embedded engine built when a shard is left to write: a run whose every shard is on disk (carried, or
    finished before) builds none. The static engine's KV cache can take tens of GB, which torch's allocator
    would keep from the features that `eyas run` trains on next."""

    def __init__(self, target, rc: RegenConfig, reasoning: str, ctx_limit: int):
        self._args, self._engine = (target, rc, reasoning, ctx_limit), None
        self._ident = embedded_engine(target, rc).identity(target)

    def describe(self) -> dict:
        return self._ident

    def __getattr__(self, name):  # anything else is the engine's: built on first use
        if self._engine is None:
            self._engine = make_embedded(*self._args)
        return getattr(self._engine, name)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def engine_rows(backend) -> int | None:
    """The most sequences an embedded engine decoded together (regen.batch_size, or the engine's own choice at 0:
    512 rows on a GPU with the static engine, fewer where its cache would not fit; the generate engine's largest
    batch, each sized to the free memory), once it was built; None for a server (it batches as it likes) or an
    engine never built (every shard already on disk)."""
    engine = backend._engine if isinstance(backend, _Deferred) else backend
    rows = engine.rows_together() if isinstance(engine, EmbeddedEngine) else None
    return rows if isinstance(rows, int) else None


def _check_cfg(cfg: Config) -> None:
    """Refuse the settings regen reads out of range, naming the key, before the data set and the target are read."""
    rc = cfg.regen
    if not rc.enabled:  # a setting of `eyas run`, which then leaves this stage out: a call of the stage is not
        where = "this command was given" if "regen.enabled" in getattr(cfg, "explicit", ()) else "the run's settings say"
        raise EyasError(f"{where} regen.enabled=false, which makes `eyas run` leave regeneration out; `eyas regen` "
                        f"stops here and regenerates nothing. To regenerate, give --enabled")
    check_data_settings(cfg)
    check_settings(cfg, (("regen.limit", rc.limit >= 0, "0 (all) or more"),
                         ("regen.turns", rc.turns >= 0, "0 (all) or more"),
                         ("regen.samples", rc.samples >= 1, "at least 1"),
                         ("regen.max_new_tokens", rc.max_new_tokens >= 1, "at least 1"),
                         ("regen.temperature", rc.temperature >= 0, "0 (greedy) or more"),
                         ("regen.top_p", 0 < rc.top_p <= 1, "above 0 and at most 1"),
                         ("regen.batch_size", rc.batch_size >= 0, "0 (auto) or more"),
                         ("regen.concurrency", rc.concurrency >= 1, "at least 1"),
                         ("regen.timeout", rc.timeout > 0, "above 0"),
                         ("regen.retries", rc.retries >= 0, "0 or more"),
                         ("regen.backoff", rc.backoff >= 0, "0 or more"),
                         ("regen.shard_size", rc.shard_size >= 1, "at least 1")))
    if rc.chat_template_kwargs and rc.backend != "server":  # the embedded engines render with the template's defaults
        raise EyasError("regen.chat_template_kwargs is sent to a server: it needs regen.backend=server (--endpoint)")
    if rc.samples > 1 and rc.temperature == 0:
        raise EyasError(f"regen.samples={rc.samples} with regen.temperature=0: greedy answers are the same every "
                        f"time; sample at a temperature above 0 or keep one sample")
    if rc.later_turns and rc.turns != 1:
        raise EyasError(f"regen.later_turns answers the later turns from the source's own history; with "
                        f"regen.turns={rc.turns} the samples would answer them as well: set regen.turns=1")


def _conversations(cfg: Config) -> list[Conversation]:
    """The conversations to regenerate: regen.split of the data set, the first regen.limit of them, ids unique."""
    rc = cfg.regen
    convs, rep = read_dataset(cfg.data.source, strict=cfg.data.strict, limit=cfg.data.limit)
    if rep.n_skipped:
        log(rep.summary())
    convs = select_split(convs, rc.split, cfg.data.val_ratio, cfg.data.test_ratio)
    if rc.limit:
        convs = convs[: rc.limit]
    seen: set[str] = set()
    dup = [c.id for c in convs if c.id in seen or seen.add(c.id)]
    if dup:
        raise EyasError(f"{cfg.data.source}: record id {dup[0]!r} occurs more than once ({len(dup)} duplicates); "
                        f"regeneration needs unique ids to resume safely")
    if not convs:
        raise EyasError(f"no conversations to regenerate in split '{rc.split}' of {cfg.data.source}")
    return convs


@contextlib.contextmanager
def _process_group(world: int):
    """Under torchrun (world > 1), a gloo process group for the barriers between ranks unless one is set up (destroyed
    at the end): each process regenerates the shards k with k % world == rank, and a rank may wait long for the
    slowest."""
    own = world > 1 and not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=2))
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


def _backend(cfg: Config, target, world: int, local: int):
    """The server backend, or an embedded engine on the target (loaded here unless given, under torchrun on this
    rank's GPU), built when a shard is left to write."""
    if cfg.regen.backend == "server":
        return ServerBackend(cfg.regen, cfg.target)
    if target is None:
        tcfg = cfg.target
        if world > 1 and tcfg.device in ("auto", "cuda") and torch.cuda.is_available():
            torch.cuda.set_device(local)
            tcfg = dataclasses.replace(tcfg, device=f"cuda:{local}")
        target = load_target(tcfg)
    if not target.has_chat_template:
        raise EyasError(f"target '{target.name}' has no chat template; regeneration needs one")
    return _Deferred(target, cfg.regen, cfg.data.reasoning, cfg.data.max_seq_len)


def _regenerate(backend, convs: list[Conversation], d: Path, cfg: Config, ident: dict, rank: int,
                world: int) -> tuple[int, float]:
    """Every set of answers the settings ask for (each sample, then the later turns) under its plan -> the answer
    tokens this call generated and the seconds spent generating them."""
    rc = cfg.regen
    identity = {k: v for k, v in ident.items() if k not in ("engine", "endpoints")}
    sets: list[int | str] = [*range(1, rc.samples + 1), *([LATER] if rc.later_turns else [])]
    tokens, seconds = 0, 0.0
    for sample in sets:
        if sample == LATER:  # conversations with a later answer to ask for
            these = [later_copy(c) for c in convs if answer_slots(c) > 1]
        else:
            these = convs if sample == 1 else [sample_copy(c, sample) for c in convs]
        if rank == 0:  # rank 0 writes the plan (or checks the one there); the others then check it
            plan = settle_plan(d, cfg, [c.id for c in these], identity, sample)
        dist_barrier()
        if rank != 0:
            plan = settle_plan(d, cfg, [c.id for c in these], identity, sample)
        if sample == LATER:
            log(f"regen: later turns: {len(these)} of {len(convs)} conversations have a later answer")
        n, secs = _drive(backend, these, plan, d, rc, sampling_settings(cfg, sample), ident, rank, world, sample,
                         rc.samples)
        tokens += n
        seconds += secs
    return tokens, seconds


def _finish(d: Path, backend, ident: dict, tokens: int, seconds: float, rank: int, world: int) -> dict:
    """Once every rank's shards are written: rank 0's validation report (written as report.json, with what this call
    generated), refused where it holds no record; the other ranks' pointer to it."""
    rate = tokens / max(seconds, 1e-9)
    if tokens and world > 1:
        print(f"regen: rank {rank} generated {tokens:,} answer tokens in {seconds:.1f} s ({rate:,.0f} tok/s)",
              file=sys.stderr, flush=True)
    dist_barrier()  # every rank's shards written
    if rank != 0:  # rank 0 reads every shard for the report; the others need not read them again
        return {"rank": rank, "world_size": world, "report": str(d / "report.json")}
    report = validation_report(d)
    if not report["records"]:  # nothing to train on: not a finished stage, and a rerun asks again
        raise failure_error(d, folder_failures(d), ident["backend"], report["planned"])
    made_words = ""
    if tokens and world == 1:  # what this call generated (a resumed run generates only what was left)
        report["this_call"] = {"generated_tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(rate, 1)}
        rows = engine_rows(backend)
        if rows:  # the sequences the embedded engine decoded together (regen.batch_size, or its choice)
            report["this_call"]["rows"] = rows
        report["tokens_per_s"] = report["this_call"]["tokens_per_s"]
        made_words = (f"; this call generated {tokens:,} answer tokens in {seconds:.1f} s "
                      f"({report['tokens_per_s']:,.0f} tok/s" + (f", up to {rows} rows at a time" if rows else "") + ")")
    atomic_write_json(d / "report.json", report)
    left = f"{report['errors_total']} left out ({left_out_words(report['errors'])}), " if report["errors"] else ""
    log(f"regen: {report['records']} conversations in {d} ({left}"
        f"{report['truncated_turns']} truncated turns, reasoning in "
        f"{report['reasoning_capture_rate']:.0%} of turns "
        f"({capture_words(report['reasoning_capture_by_turn'], 4)}), "
        f"{report['looping_answer_rate']:.0%} of answers looping)"
        + made_words)
    return report


def run_regen(cfg: Config, target=None) -> dict:
    """Regenerate the assistant turns of cfg.data.source's cfg.regen.split; returns the validation report
    (under torchrun, on rank 0; the other ranks return where rank 0 wrote it)."""
    _check_cfg(cfg)
    convs = _conversations(cfg)
    d = regen_dir(cfg.out)
    check_no_extra_sets(d, cfg.regen.samples, cfg.regen.later_turns)
    d.mkdir(parents=True, exist_ok=True)
    rank, world, local = dist_env()
    with _process_group(world):
        backend = _backend(cfg, target, world, local)
        ident = backend.describe()
        try:
            tokens, seconds = _regenerate(backend, convs, d, cfg, ident, rank, world)
        finally:
            backend.close()
        return _finish(d, backend, ident, tokens, seconds, rank, world)


def _drive(backend, convs: list[Conversation], plan: dict, d: Path, rc: RegenConfig, settings: dict,
           ident: dict, rank: int = 0, world: int = 1, sample: int | str = 1, samples: int = 1) -> tuple[int, float]:
    """Set `sample`'s unfinished shards of this rank (their conversations read back from their journals left out),
    each written whole once its conversations are done -> the answer tokens generated and the seconds it took."""
    size = plan["shard_size"]
    n_shards = math.ceil(len(convs) / size)
    mine = [k for k in range(n_shards) if k % world == rank]
    todo = [k for k in mine if not shard_path(d, k, sample).exists()]
    for k in set(mine) - set(todo):  # a kill between a shard's write and its journal's removal
        journal_path(d, k, sample).unlink(missing_ok=True)
    later = sample == LATER
    of = "later turns: " if later else f"sample {sample} of {samples}: " if samples > 1 else ""
    def span(k: int) -> range:  # the plan's conversations in shard k
        return range(k * size, min(len(convs), (k + 1) * size))

    work = [(k, i) for k in todo for i in span(k)]
    backend_meta = {k: v for k, v in ident.items() if k != "endpoints"}
    if world > 1:  # every process says what it takes (log() speaks for rank 0 only)
        print(f"regen: {of}rank {rank} of {world} regenerates {len(todo)} of its {len(mine)} shards "
              f"({len(work)} conversations)", file=sys.stderr, flush=True)
    if not work:
        return 0, 0.0
    if sample != 1 and hasattr(backend, "reseed"):  # (a server gets each request's own seed, from its record id)
        backend.reseed((rc.seed * 1_000_003 + (stable_hash(LATER) if later else sample)) % (1 << 31))
    if len(todo) < len(mine):
        log(f"regen: {of}resuming, {len(mine) - len(todo)} of {len(mine)} shards already done"
            + (f" (rank {rank} of {world})" if world > 1 else ""))
    # each unfinished shard's outcomes so far (index -> outcome), read back from its journal
    done_by_shard = {k: _read_journal(journal_path(d, k, sample), convs, span(k)) for k in todo}
    kept = sum(len(v) for v in done_by_shard.values())
    if kept:
        log(f"regen: {of}{kept} finished conversations of unfinished shards read back from their journals"
            + (f" (rank {rank} of {world})" if world > 1 else ""))
    work = [(k, i) for k, i in work if i not in done_by_shard[k]]
    active: dict[str, ConvState] = {}
    outcomes = CallOutcomes()  # this call's failures in a row: a server failing request after request stops it
    nxt = 0
    t0, toks = time.time(), 0
    bar = progress(total=len(work) + kept, initial=kept,
                   desc="regen" + (" later turns" if later else f" sample {sample}/{samples}" if samples > 1 else "")
                   + (f" rank {rank}" if world > 1 else ""), unit="conv",
                   **({} if rank == 0 else {"disable": True}))

    def shard_done(k: int) -> None:
        if len(done_by_shard[k]) == len(span(k)):
            _write_shard(d, k, [done_by_shard[k][i] for i in sorted(done_by_shard[k])], sample)
            journal_path(d, k, sample).unlink(missing_ok=True)
            del done_by_shard[k]

    def finish(st: ConvState) -> None:
        k = st.index // size
        o = _outcome(st, settings, backend_meta)
        with open(journal_path(d, k, sample), "a", encoding="utf-8") as f:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")
        done_by_shard[k][st.index] = o
        bar.update(1)
        shard_done(k)
        outcomes.add(o)
        if outcomes.hopeless() and ident["backend"] == "server":
            raise failure_error(d, outcomes, ident["backend"])

    def ask(st: ConvState) -> None:
        msgs = st.next_messages()
        if msgs is None:
            finish(st)
            return
        rid = f"{st.index}:{st.n_answers}"
        active[rid] = st
        seed = (rc.seed * 1_000_003 + stable_hash(f"{st.conv.id}:{st.n_answers}")) % (1 << 31)
        backend.submit(rid, msgs, seed)

    try:
        for k in list(done_by_shard):  # a kill between a journal's last line and its shard
            shard_done(k)
        while nxt < len(work) or active:
            while nxt < len(work) and len(active) < backend.window:
                _, i = work[nxt]
                nxt += 1
                # the later turns: every answer after the first, each asked with the source's history before it
                ask(ConvState(i, convs[i], history="original", keep=1) if later else ConvState(i, convs[i], rc.turns))
            for r in backend.poll(timeout=0.5):
                st = active.pop(r.rid, None)
                if st is None:
                    continue
                if r.fatal:
                    raise EyasError(f"{ident['backend']} backend: {r.message}. Finished shards are kept in {d}; "
                                    f"run the same command again to resume")
                st.accept(r)
                toks += r.completion_tokens
                ask(st)
            dt = max(time.time() - t0, 1e-6)
            bar.set_postfix_str(f"{toks / dt:,.0f} tok/s", refresh=False)
    finally:
        bar.close()
    return toks, time.time() - t0


def _outcome(st: ConvState, settings: dict, backend_meta: dict) -> dict:
    """What a finished conversation leaves in its shard: its record's line, or its entry in the errors file
    (`i` and `id` say which conversation of the plan it is)."""
    if st.error or st.n_answers == 0:
        if st.error:
            kind, msg = st.error
        elif st.stopped == "context":
            kind = "context"
            msg = (f"its first prompt ({(st.dropped or {}).get('prompt_tokens', '?')} tokens) leaves no room for an "
                   f"answer within the context (data.max_seq_len, or the model's own)")
        elif st.stopped == "empty_answer":
            kind, msg = "empty_answer", "the target's first answer was empty"
        else:
            kind, msg = "no_answer", "no assistant turn could be generated"
        return {"i": st.index, "id": st.conv.id,
                "error": {"id": st.conv.id, "kind": kind, "message": msg,
                          "retries": dict(sum((Counter(t.get("retries", {})) for t in st.turn_meta),
                                              Counter(getattr(st, "failed_retries", {}))))}}
    return {"i": st.index, "id": st.conv.id, "line": json.dumps(st.record(settings, backend_meta), ensure_ascii=False)}


def _read_journal(path: Path, convs: list[Conversation], span: range) -> dict[int, dict]:
    """The outcomes a shard's journal holds for its conversations `span` of the plan. A line cut short by a kill
    (or not this plan's) is left out, and the journal rewritten without it, so that lines appended later are
    whole."""
    if not path.exists():
        return {}
    got: dict[int, dict] = {}
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for line in lines:
        try:
            o = json.loads(line)
        except ValueError:
            continue
        i = o.get("i") if isinstance(o, dict) else None
        if (isinstance(i, int) and i in span and o.get("id") == convs[i].id
                and isinstance(o.get("line") or o.get("error"), (str, dict))):
            got[i] = o
    if len(got) != len(lines):
        atomic_write_text(path, "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in got.values()))
    return got


def _write_shard(d: Path, k: int, outcomes: list[dict], sample: int | str = 1) -> None:
    errors = [o["error"] for o in outcomes if "error" in o]
    lines = [o["line"] for o in outcomes if "error" not in o]
    # errors first: a shard file present means its errors file is complete too
    atomic_write_json(errors_path(d, k, sample), {"shard": k, "errors": errors})
    atomic_write_text(shard_path(d, k, sample), "".join(line + "\n" for line in lines))


