"""The tokenize stage: training conversations -> token ids + loss masks, stored in the run directory.

Layout of `<run>/data/tokens/` (safetensors, so files are data):
  train.safetensors, val.safetensors   input_ids (int32, all sequences concatenated),
                                       loss_mask (uint8), offsets (int64, len n+1)
  meta.json                            ids per split, truncation count, source, and `inputs`: what the
                                       tokens were made from (tokens_inputs), so that a later command
                                       refuses tokens it cannot use (ensure_tokens)
"""
from __future__ import annotations

import importlib
import json
import math
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import Config, check_settings, get_key, to_dict
from ..target_spec import load_spec
from ..util import EyasError, PhaseClock, atomic_path, atomic_write_json, log, progress, read_json, sha256_json
from .conversation import Conversation
from .readers import read_dataset, select_split, split_of
from .reasoning import tokenize_sequences
from .tokenize import Tokenized, check_mask


@dataclass
class TokenSet:
    """Tokenized sequences of one split, stored flat."""
    ids: list[str]
    input_ids: torch.Tensor  # int32 [N]
    loss_mask: torch.Tensor  # uint8 [N]
    offsets: torch.Tensor    # int64 [n+1]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b].long(), self.loss_mask[a:b].bool()

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @classmethod
    def from_tokenized(cls, items: list[Tokenized]) -> "TokenSet":
        lens = torch.tensor([len(t.input_ids) for t in items], dtype=torch.long)
        offsets = torch.zeros(len(items) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lens, 0)

        def flat(parts, dtype):  # (tokenize_all's arrays through the buffer protocol, lists element by element)
            return torch.from_numpy(np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts
                                    else np.zeros(0, dtype))

        return cls([t.id for t in items], flat([t.input_ids for t in items], np.int32),
                   flat([t.loss_mask for t in items], np.uint8), offsets)

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            save_file({"input_ids": self.input_ids.contiguous(), "loss_mask": self.loss_mask.contiguous(),
                       "offsets": self.offsets.contiguous()}, str(tmp))

    @classmethod
    def load(cls, path: Path, ids: list[str], remedy: str = "delete it to make it again") -> "TokenSet":
        """`remedy`: what the user does to have the file again, said when it is missing or unreadable."""
        try:
            t = load_file(str(path))
        except FileNotFoundError:
            raise EyasError(f"{path}: token file missing; {remedy}") from None
        except (SafetensorError, OSError) as e:
            raise EyasError(f"{path}: unreadable token file ({e}); {remedy}") from None
        return cls(ids, t["input_ids"], t["loss_mask"], t["offsets"])


def regen_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "data" / "regen"


def tokens_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "data" / "tokens"


def planned_shards(plans: list[dict]) -> int:
    """The shards regen plans (plan.json and the others of a regen folder) divide their conversations into."""
    return sum(math.ceil(len(p["ids"]) / p["shard_size"]) for p in plans)


def shard_progress(d: Path) -> tuple[int, int] | None:
    """(shards written, shards planned) over every set of answers in regen folder d, from the file names and plans
    alone (validation_report reads the shards too); None where d has no plan (shards copied in by hand) or one that
    does not say its conversations and shard size."""
    plans = [read_json(f) for f in sorted(d.glob("plan*.json"))] if (d / "plan.json").exists() else []
    if not plans or not all(isinstance(p, dict) and isinstance(p.get("ids"), list)
                            and isinstance(p.get("shard_size"), int) and p["shard_size"] > 0 for p in plans):
        return None
    return len(list(d.glob("shard-*.jsonl"))), planned_shards(plans)


# the regenerated answers as the tokens' meta.json names them: relative to the run, so that the tokens (and through
# tokens_key the vocabulary and checkpoints made from them) do not depend on how --out was spelled or where the run
# directory has been copied or moved to
REGEN_SOURCE = f"regenerated ({regen_dir('').as_posix()})"


def training_conversations(cfg: Config) -> tuple[list[Conversation], str]:
    """Regenerated conversations of the run if there are any, else the data set's train split
    (cfg.data.limit records at most). Returns (conversations, source description)."""
    rdir = regen_dir(Path(cfg.out))
    if rdir.exists() and any(rdir.glob("*.jsonl")):
        check_regen_matches(cfg, rdir)
        done = shard_progress(rdir)
        if done and done[0] < done[1]:  # a standalone stage after a regen that was cut: said, not refused
            log(f"WARNING: the regeneration in {rdir} is unfinished ({done[0]} of {done[1]} shards written): these "
                f"answers are what there is to train on. To train on all of them, run the same `eyas regen --out "
                f"{cfg.out}` again first (it resumes)")
        convs, rep = read_dataset(str(rdir), strict=cfg.data.strict)
        source = REGEN_SOURCE
        originals = _original_train(cfg) if (cfg.data.extra_original or cfg.data.original_rest) else []
        if cfg.data.original_rest:
            by_id = {c.id: c for c in originals}
            convs = [with_original_rest(c, by_id.get(c.id)) for c in convs]
            n = sum(bool(c.meta.get("original_rest_turns")) for c in convs)
            source += f", {n} continued with their original later turns"
        if cfg.data.extra_original:
            done = {c.id for c in convs}
            extra = [c for c in originals if c.id not in done][: cfg.data.extra_original]
            convs += extra
            source += f" + {len(extra)} original from {cfg.data.source}"
        return convs, source
    convs = _original_train(cfg)
    if cfg.data.limit:
        convs = convs[: cfg.data.limit]
    return convs, cfg.data.source


# the data settings that chose which conversations the regen answered (recorded in its plan.json, "data"): given
# explicitly to a command that trains on the regenerated answers, they must be the regen's, since they do not
# choose anything there
REGEN_CHOSE = ("data.limit", "data.val_ratio", "data.test_ratio")


def same_source(a: str, b: str) -> bool:
    """Whether two data.source values name the same data: equal, or paths to the same file or folder."""
    if a == b:
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve() and Path(a).expanduser().exists()
    except (OSError, RuntimeError):
        return False


def check_regen_matches(cfg: Config, rdir: Path) -> None:
    """Refuse a data.source, data.limit, data.val_ratio or data.test_ratio this command was given explicitly that the
    run's regenerated answers were not made with: training on them would ignore it, while the tokens recorded it as
    their inputs. Answers whose plan.json does not record a setting (a regen before the record) are not checked for it."""
    given = getattr(cfg, "explicit", ())
    plan_file = rdir / "plan.json"
    if not plan_file.exists() or not any(k in given for k in ("data.source", *REGEN_CHOSE)):
        return
    plan = read_json(plan_file)
    out = shlex.quote(str(cfg.out))
    made_from = plan.get("source")
    if "data.source" in given and made_from is not None and not same_source(cfg.data.source, made_from):
        given_src = cfg.data.source
        raise EyasError(f"{rdir} holds answers regenerated from {made_from}: training on them would ignore data.source "
                        f"{given_src} that this command was given. To train on those answers, leave data.source out; "
                        f"to train on {given_src}, use another --out, or delete {rdir} and run `eyas regen --out {out} "
                        f"--source {shlex.quote(given_src)}` to have the target answer its prompts (if it is "
                        f"{made_from} under another name, give it as the regen did: {made_from})")
    chose = plan.get("data", {})
    for key in REGEN_CHOSE:
        field = key.partition(".")[2]
        if key in given and field in chose and get_key(cfg, key) != chose[field]:
            was, now = chose[field], get_key(cfg, key)
            raise EyasError(f"{rdir} holds answers regenerated from the conversations chosen at {key}={was}: "
                            f"training on them would ignore {key}={now} that this command was given. To train on those "
                            f"answers, leave {key} out; for the conversations {key}={now} chooses, use another --out, "
                            f"or delete {rdir} and run `eyas regen --out {out} --set {key}={now}`")


def with_original_rest(regen: Conversation, original: Conversation | None) -> Conversation:
    """`regen` followed by the turns of `original` that come after as many answers as `regen` has (its
    later user turns and original answers), up to its last answer. `regen` unchanged when there is none."""
    n = regen.n_assistant()
    answers = [i for i, t in enumerate(original.turns) if t.role == "assistant"] if original is not None else []
    if n == 0 or len(answers) <= n:  # nothing answered after regen's last answer
        return regen
    rest = original.turns[answers[n - 1] + 1:answers[-1] + 1]  # a training conversation ends with an answer
    return Conversation(regen.id, list(regen.turns) + rest, {**regen.meta, "original_rest_turns": len(rest)})


def _original_train(cfg: Config) -> list[Conversation]:
    convs, rep = read_dataset(cfg.data.source, strict=cfg.data.strict)
    if rep.n_skipped:
        log(rep.summary())
    return select_split(convs, "train", cfg.data.val_ratio, cfg.data.test_ratio)


POOL_FROM = 2000  # conversations from which data.tokenize_workers=0 starts worker processes (each costs a start-up)

_worker: tuple | None = None  # in a worker process: (tokenizer, max_seq_len, reasoning, eot_ids)


def _init_worker(tokenizer_dir: str, tokenizer_class: tuple[str, str], args) -> None:
    """A worker loads the tokenizer from the folder the parent saved it in, with the parent tokenizer's own class
    (importing the class's own module is much quicker than transformers' AutoTokenizer). A pickled tokenizer
    sent as the pool's initargs would make each worker's start wait until the one before had started Python,
    imported its modules and read it from the pipe: the workers would start one after another."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread each: the workers are the parallelism
    module, name = tokenizer_class
    cls = getattr(importlib.import_module(module), name)
    _worker = (cls.from_pretrained(tokenizer_dir), *args)


def _tokenize_one(conv: Conversation) -> list[Tokenized]:
    tokenizer, max_seq_len, reasoning, eot_ids = _worker
    return [_compact(t) for t in tokenize_sequences(tokenizer, conv, max_seq_len, reasoning, eot_ids)]


def _compact(t: Tokenized) -> Tokenized:
    """Tokens and mask as machine arrays: a worker's result crosses to the parent as bytes instead of a pickled
    Python int per token, and TokenSet.from_tokenized joins them without a Python loop (far quicker for tens of
    millions of tokens)."""
    return Tokenized(t.id, array("i", t.input_ids), array("B", t.loss_mask), t.truncated)


def tokenize_workers(requested: int, n_convs: int) -> int:
    """How many processes tokenize: `requested` (data.tokenize_workers) if set, else one per core (at most 16)
    for POOL_FROM conversations or more, else 1 (this process)."""
    if requested < 0:
        raise EyasError(f"data.tokenize_workers must be 0 (auto) or a number of processes, got {requested}")
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 16) if n_convs >= POOL_FROM else 1


def tokenize_all(convs: list[Conversation], tokenizer, cfg: Config, eot_ids: list[int],
                 workers: int | None = None) -> tuple[list[Tokenized], dict]:
    """Every conversation tokenized with its loss mask, in order (a conversation of a template that drops earlier
    reasoning as one sequence per answer: eyas.data.reasoning); with several workers in spawned processes
    (a template's rendering and the tokenizer's call, a few ms a conversation on one core, are the stage's time).
    The result does not depend on the number of workers."""
    kept, stats = [], {"conversations": len(convs), "sequences": 0, "truncated": 0, "empty_mask": 0}
    args = (cfg.data.max_seq_len, cfg.data.reasoning, eot_ids)
    n = tokenize_workers(cfg.data.tokenize_workers if workers is None else workers, len(convs))
    pool, tok_dir = None, None
    if n > 1:
        # spawned, not forked: the parent may hold a CUDA context and the tokenizer's threads
        try:
            tok_dir = tempfile.mkdtemp(prefix="eyas-tokenizer-")
            tokenizer.save_pretrained(tok_dir)
            cls = (type(tokenizer).__module__, type(tokenizer).__qualname__)
            pool = mp.get_context("spawn").Pool(n, initializer=_init_worker, initargs=(tok_dir, cls, args))
        except OSError as e:  # no processes to be had here (limits, sandbox): the same work in this one
            log(f"tokenize: could not start {n} worker processes ({e}); tokenizing in this process")
    if pool is not None:
        results = pool.imap(_tokenize_one, convs, chunksize=max(1, min(64, len(convs) // (8 * n))))
    else:
        results = ([_compact(t) for t in tokenize_sequences(tokenizer, c, *args)] for c in convs)
    try:
        for seqs in progress(results, total=len(convs), desc="tokenize", unit="conv"):
            for t in seqs:
                stats["sequences"] += 1
                stats["truncated"] += t.truncated
                if sum(t.loss_mask) == 0:  # e.g. an answer that starts after max_seq_len: nothing to learn
                    stats["empty_mask"] += 1
                    continue
                check_mask(t)
                kept.append(t)
    finally:
        if pool is not None:
            pool.terminate()
        if tok_dir is not None:
            shutil.rmtree(tok_dir, ignore_errors=True)
    return kept, stats


TRAIN_VAL_SALT = "train.val:"


def tokens_inputs(cfg: Config, target) -> dict:
    """What the run's tokens are made from: the tokenizer (the target's identity less its aux layers, which the
    tokens do not depend on), the data settings (less how many workers tokenize), train.val_ratio, and the
    regenerated answers' files (name and size) when the run has any. JSON-normal, so it compares equal to
    what meta.json recorded."""
    ident = {k: v for k, v in target.identity().items() if k != "aux_layers"}
    data = {k: v for k, v in to_dict(cfg)["data"].items() if k != "tokenize_workers"}
    rdir = regen_dir(Path(cfg.out))
    files = sorted(rdir.glob("*.jsonl")) if rdir.exists() else []
    regen = {f.name: f.stat().st_size for f in files}
    return json.loads(json.dumps({"tokenizer": ident, "data": data, "train.val_ratio": cfg.train.val_ratio,
                                  "regen_files": regen}))


def ensure_tokens(cfg: Config, target) -> bool:
    """Tokenize the run's training data when data/tokens has none; returns whether it tokenized. Tokens there
    are reused as they are (a standalone command such as `eyas train` is not given the data settings they were
    made with), but refused when they cannot be what this command means: made for another target, before the
    regenerated answers last changed, or with another value of a setting this command was given explicitly
    (e.g. `eyas train --val-ratio 0.1` on tokens split at 0.02): the message gives the `eyas tokenize` command that
    makes the tokens meant. A data setting the run's regenerated answers ignore is refused as such first
    (check_regen_matches). Tokens an eyas before this record wrote are reused unchecked."""
    d = tokens_dir(Path(cfg.out))
    if not (d / "meta.json").exists():
        run_tokenize(cfg, target)
        return True
    rdir = regen_dir(cfg.out)
    if rdir.exists() and any(rdir.glob("*.jsonl")):  # a setting the answers ignore: said as such, before the tokens
        check_regen_matches(cfg, rdir)
    made = read_json(d / "meta.json").get("inputs")
    if made is None:
        return False
    now = tokens_inputs(cfg, target)
    explicit = getattr(cfg, "explicit", ())  # the settings this command was given
    why = []
    same = ("sha256", "vocab_size")  # as load_vocab: the same model under another name (a preset, its GGUF path) is fine
    tok_differs = any(made.get("tokenizer", {}).get(k) != now["tokenizer"].get(k) for k in same)
    if tok_differs:
        was, cur = made.get("tokenizer", {}), now["tokenizer"]
        why.append(f"they are for target {was.get('name')} ({str(was.get('sha256'))[:12]}), not {cur.get('name')} "
                   f"({str(cur.get('sha256'))[:12]})")
    if made.get("regen_files") != now["regen_files"]:
        why.append(f"the regenerated answers in {regen_dir(cfg.out)} changed since")
    # the tokenize command that makes the tokens this one means: the run's settings (which `eyas tokenize --out R`
    # starts from, as this command did) with the ones this command was given that differ. Each as --set, since the
    # tokenize command's own flags are the data section's (its --val-ratio is data.val_ratio, not train.val_ratio)
    fix = [f"--target {shlex.quote(cfg.target.name)}"] if tok_differs and "target.name" in explicit else []
    for key in sorted(explicit):
        sec, _, field = key.partition(".")
        if sec == "data" and field in made.get("data", {}):
            was, given = made["data"][field], now["data"][field]
        elif key == "train.val_ratio" and key in made:
            was, given = made[key], now[key]
        else:
            continue
        if was != given:
            why.append(f"{key} was {was!r}, this command gives {given!r}")
            fix.append(f"--set {shlex.quote(f'{key}={_set_value(given)}')}")
    if why:
        cmd = " ".join(["eyas tokenize --out", shlex.quote(str(cfg.out)), *fix])
        raise EyasError(f"{d} holds tokens this command cannot use: {'; '.join(why)}. `{cmd}` makes them again with "
                        f"this command's settings (it replaces them), or use another --out")
    return False


def _set_value(v) -> str:
    """A setting's value as --set takes it."""
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def tokens_key(run_dir: str | Path) -> str | None:
    """A short hash of the run's tokens (their meta.json less its timings): what the vocabulary and a training
    checkpoint were made from. None when the run has no tokens."""
    meta_path = tokens_dir(Path(run_dir)) / "meta.json"
    if not meta_path.exists():
        return None
    meta = read_json(meta_path)
    return sha256_json({k: v for k, v in meta.items() if k != "seconds"})[:16]


def check_data_settings(cfg: Config) -> None:
    """Refuse the data settings out of range, naming the key: the commands that read a data set (regen, tokenize,
    data) check them before they read it."""
    d = cfg.data
    check_settings(cfg, (("data.limit", d.limit >= 0, "0 (all records) or more"),
                         ("data.val_ratio", 0 <= d.val_ratio < 1, "at least 0 and below 1"),
                         ("data.test_ratio", 0 <= d.test_ratio < 1, "at least 0 and below 1"),
                         ("data.max_seq_len", d.max_seq_len >= 0, "0 (no limit) or more"),
                         ("data.extra_original", d.extra_original >= 0, "0 (none) or more"),
                         ("data.tokenize_workers", d.tokenize_workers >= 0, "0 (auto) or a number of processes")))
    check_split_ratios(d)


def check_split_ratios(d) -> None:
    """Refuse data.val_ratio and data.test_ratio (of the data settings `d`) that leave no train split; the eval and
    `eyas parity`, which choose their prompts by the same split, check them here too."""
    if not (d.val_ratio >= 0 and d.test_ratio >= 0 and d.val_ratio + d.test_ratio < 1):
        raise EyasError(f"data.val_ratio and data.test_ratio must be 0 or above with a sum below 1 (the rest is the "
                        f"train split), got {d.val_ratio} and {d.test_ratio}")


def check_tokenize_settings(cfg: Config) -> None:
    """Refuse the settings the tokenize stage reads out of range, naming the key."""
    check_data_settings(cfg)
    check_settings(cfg, (("train.val_ratio", 0 <= cfg.train.val_ratio < 1, "at least 0 and below 1"),))


def run_tokenize(cfg: Config, target=None) -> dict:
    """Tokenize the training conversations and split off a validation set (train.val_ratio)."""
    check_tokenize_settings(cfg)
    target = target or load_spec(cfg.target)
    clock = PhaseClock(torch.device("cpu"))
    t0 = clock.start()
    convs, source = training_conversations(cfg)
    # the messages name the run's regenerated answers by their path (meta.json, relative to the run)
    shown = source.replace(REGEN_SOURCE, f"regenerated ({regen_dir(cfg.out)})", 1)
    if not convs:
        raise EyasError(f"no training conversations found in {shown}")
    clock.stop("read", t0)
    t0 = clock.start()
    items, stats = tokenize_all(convs, target.tokenizer, cfg, target.eot_token_ids)
    clock.stop("tokenize", t0)
    t0 = clock.start()
    if not items:
        answered = sum(1 for c in convs if any(t.role == "assistant" for t in c.turns))
        if not answered:
            raise EyasError(f"none of the {len(convs)} conversations of {shown} has an assistant answer to train on"
                            + (": regeneration is off (regen.enabled=false), so prompts alone are left; turn it on "
                               "to have the target answer them" if not cfg.regen.enabled else ""))
        raise EyasError(f"every conversation of {shown} lost its assistant tokens: {stats['truncated']} of "
                        f"{len(convs)} were cut at data.max_seq_len {cfg.data.max_seq_len} before their first answer; "
                        f"raise it")
    # the training records are the data set's 'train' split already: the validation cut is salted
    is_val = [split_of(t.id, cfg.train.val_ratio, 0.0, salt=TRAIN_VAL_SALT) == "val" for t in items]
    val = [t for t, v in zip(items, is_val) if v]
    train = [t for t, v in zip(items, is_val) if not v]
    if not val and len(train) > 1:
        val = [train.pop()]
    d = tokens_dir(Path(cfg.out))
    TokenSet.from_tokenized(train).save(d / "train.safetensors")
    TokenSet.from_tokenized(val).save(d / "val.safetensors")
    n_tok = sum(len(t.input_ids) for t in items)
    n_masked = sum(sum(t.loss_mask) for t in items)
    clock.stop("write", t0)
    seconds = {k: round(v, 2) for k, v in clock.totals().items()}
    # where the stage's time goes (reading, tokenizing, writing), so a slow stage shows which part to look at
    meta = {"source": source, "target": target.identity(), "inputs": tokens_inputs(cfg, target), **stats,
            "train_ids": [t.id for t in train],
            "val_ids": [t.id for t in val], "tokens": n_tok, "loss_tokens": n_masked, "seconds": seconds}
    atomic_write_json(d / "meta.json", meta)
    log(f"tokenize: {len(train)} train + {len(val)} val sequences, {n_tok:,} tokens ({n_masked:,} trained on), "
        f"{stats['truncated']} truncated to {cfg.data.max_seq_len}; reading {seconds['read']} s, tokenizing "
        f"{seconds['tokenize']} s, writing {seconds['write']} s")
    return {k: v for k, v in meta.items() if not k.endswith("_ids")}


def load_tokens(run_dir: str | Path, split: str = "train") -> TokenSet:
    d = tokens_dir(Path(run_dir))
    meta_path = d / "meta.json"
    if not meta_path.exists():
        raise EyasError(f"{d}: no tokenized data (run `eyas run` or the tokenize stage first)")
    meta = read_json(meta_path)
    run = shlex.quote(str(run_dir))
    return TokenSet.load(d / f"{split}.safetensors", meta[f"{split}_ids"],
                         f"`eyas tokenize --out {run}` makes the run's tokens again (or delete {d}, and `eyas run --out "
                         f"{run}` makes them again)")
