"""`eyas run`: every stage over one run directory, skipping what is already done.

Each stage has a key: the hash of the config sections it reads and of the keys of the stages
before it, and of the content of the files a setting names (a data file, a prompts file, a drafter to
fine-tune from), so that a file edited in place counts as changed. `manifest.json` records, per stage, its
key, status, counts, timing and versions.
A stage whose key matches a finished record is skipped; one that was cut short runs again (each
stage resumes its own partial work); one whose key changed reruns, its old outputs kept aside until the new ones are
complete (eyas.stage_outputs), and so, through the keys, does every stage after it. One exception: when regen.samples is the only change
to regen's key, the samples both counts share keep their answers (the others are regenerated or removed), and
so do the conversations already answered when regen.limit grows.
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import os
import platform
import time
from pathlib import Path

from . import __version__
from . import config as C
from . import stage_outputs
from .util import is_int
from .util import (EyasError, NotBuiltError, atomic_write_json, cpu_has_bf16, human_bytes, log, read_json,
                   release_memory, sha256_file, sha256_json)

# name, "module:function", config keys it reads, output paths under the run dir (the first one is
# what later stages read: a finished stage whose first output is gone runs again)
STAGES = [
    ("regen", "eyas.data.regen:run_regen", ["target", "data.source", "data.limit", "data.val_ratio", "data.test_ratio",
                                            "data.max_seq_len", "data.reasoning", "data.strict", "regen"], ["data/regen"]),
    ("tokenize", "eyas.data.prepare:run_tokenize", ["target", "data", "train.val_ratio"], ["data/tokens"]),
    ("vocab", "eyas.vocab:run_vocab", ["vocab"], ["vocab"]),
    ("extract", "eyas.features:run_extract", ["features", "train.online"], ["features"]),
    ("train", "eyas.train:run_train", ["train", "features", "vocab"], ["draft", "ckpt", "train"]),
    ("eval", "eyas.evaluate:run_eval", ["eval"], ["eval"]),
    ("export", "eyas.export:run_export", ["export"], ["export"]),
]
# stages another function does where a setting is given: stage -> (config key, "module:function"). Extraction from
# vLLM reads the engine's states instead of running the target (eyas.engine_features builds on eyas.features)
STAGE_VARIANTS = {"extract": ("features.from_vllm", "eyas.engine_features:run_engine_extract")}

# settings left at their defaults are sized to the machine for the embedded default run
AUTO_CPU = {"regen.limit": 32, "regen.turns": 1, "regen.max_new_tokens": 128, "data.max_seq_len": 384,
            "data.extra_original": 120, "vocab.draft_vocab_size": 4096, "train.online": False, "train.epochs": 5,
            "train.batch_tokens": 1024, "train.val_ratio": 0.05, "eval.limit": 3,
            "eval.max_new_tokens": 64}
# on a CPU that multiplies bf16 natively: the target in bf16 for regen and extraction and the drafter under
# bf16 autocast, both markedly faster there than fp32. Evaluation stays fp32 (the lossless check)
AUTO_CPU_BF16 = {"target.dtype": "bfloat16", "eval.dtype": "float32", "train.precision": "bf16"}
# every first turn of the ShareGPT package (its training split holds about 16,500; the PyPI file is cut short):
# more data raises τ more than more epochs do, for a run that still takes minutes (docs/defaults.md)
AUTO_GPU = {"regen.limit": 20000, "regen.turns": 1, "train.epochs": 8}
# per preset, over AUTO_GPU: the 0.5B preset keeps 10,000 first turns (its run at every first turn is not measured
# yet). The 1.5B preset takes every first turn: at 10,000 its drafter still overfit (held-out accuracy flat over the
# last epochs while the training batches' passed 0.8), and τ rose with each step up in answers. SmolLM2's drafter
# gets an MLP 4x the target's (6,144): a higher τ, training about as fast, since the drafter's head dominates its
# cost. It also keeps each
# conversation's later turns with their original answers after its regenerated first one (the labels stay the
# target's own distribution; regenerated later turns loop far more, and cost much more regen) and trains 5
# epochs. And it samples each first answer twice (regen.samples): a higher τ at every K for more of the
# pipeline's time. The figures are in docs/defaults.md
AUTO_GPU_PRESET = {"qwen-coder-0.5b": {"regen.limit": 10000},
                   "smollm2": {"train.draft_intermediate_size": 6144, "data.original_rest": True, "train.epochs": 5,
                               "regen.samples": 2}}
# sized settings that only apply where another setting allows them: a second sample of a greedy answer is the same
# answer (regen refuses it), so a user's regen.temperature=0 keeps one sample
SIZED_ONLY_IF = {"regen.samples": lambda cfg: cfg.regen.temperature > 0}
# the presets sized this way (their own target on the ShareGPT package); left unsized, the Qwen preset would
# regenerate every turn of all of ShareGPT
SIZED_PRESETS = ("smollm2", "qwen-coder-0.5b", "qwen-coder-1.5b")


def _default(key):
    return C.get_key(C.Config(), key)


def autosize(cfg: C.Config, device_type: str, cpu_bf16: bool | None = None) -> dict:
    """Apply the machine-sized defaults to the settings the user left at their defaults."""
    if cfg.preset not in SIZED_PRESETS or cfg.target.name != cfg.preset or cfg.data.source != "sharegpt":
        return {}
    if device_type == "cuda":
        table = {**AUTO_GPU, **AUTO_GPU_PRESET.get(cfg.preset, {})}
    else:
        table = {**AUTO_CPU, **(AUTO_CPU_BF16 if (cpu_has_bf16() if cpu_bf16 is None else cpu_bf16) else {})}
    changed = {}
    explicit = getattr(cfg, "explicit", set())
    for key, value in table.items():
        if key in SIZED_ONLY_IF and not SIZED_ONLY_IF[key](cfg):
            continue
        if key not in explicit and C.get_key(cfg, key) == _default(key):
            C.set_key(cfg, key, value)
            changed[key] = value
    return changed


# settings that change how a stage runs, not what it writes: left out of the stage keys, so changing them
# (or a new eyas adding one) does not rerun finished stages
EXECUTION_ONLY = {"target.device", "target.cache_dir", "target.tensor_parallel", "target.device_map",
                  "features.from_vllm", "features.engine_requests", "regen.concurrency",
                  "regen.timeout", "regen.retries", "regen.backoff", "train.num_workers",
                  "train.feature_cache_gb", "train.feature_cache_host_gb", "train.feature_cache_keep",
                  "train.parallel", "train.cuda_graph", "train.compile_loss", "train.compile_drafter",
                  "data.tokenize_workers",
                  # a measurement beside the training, not part of it: the drafter is the same with any value
                  "train.greedy_val"}


# target.aux_layers: which hidden states the drafter is fed. The answers and tokens do not depend on them, so regen
# and tokenize hash them at the default (trying other layers keeps the regenerated data), and the stages that
# capture or train on the states (extract, train: train also covers the online features) key them while changed
AUX_KEY = "target.aux_layers"
AUX_READERS = ("extract", "train")


# settings that name files or folders: the stages that read them key the files' content, not only their names, so an
# edited data file reruns regen and what follows. Named sets (sharegpt, humaneval) are keyed by name, as before
FILE_INPUTS = ("data.source", "eval.prompts", "train.finetune_from")


def _input_files(value: str) -> list[Path] | None:
    """The files a setting's value names: the file, or every file directly in the folder; None when it names none."""
    if not value:
        return None
    p = Path(value).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file())
    return None


def input_fingerprints(cfg: C.Config, known: dict | None = None) -> tuple[dict[str, str], dict[str, list]]:
    """A hash of the content of the files each FILE_INPUTS setting names -> ({setting: hash}, {file: [size,
    mtime_ns, sha256]}). `known` is the last run's file table: a file whose size and mtime are unchanged keeps its
    recorded sha256 (not read again), so a large data set is hashed once, and a copied or touched file that kept its
    content keeps its key."""
    known = known or {}
    fps, files = {}, {}
    for key in FILE_INPUTS:
        paths = _input_files(str(C.get_key(cfg, key) or ""))
        if paths is None:
            continue
        h = hashlib.sha256()
        for f in paths:
            st = f.stat()
            name = str(f.resolve())
            rec = known.get(name)
            if not (isinstance(rec, list) and rec[:2] == [st.st_size, st.st_mtime_ns]):
                if st.st_size > 1 << 30:
                    log(f"{key}: reading {f} ({human_bytes(st.st_size)}) to tell whether it changed since the last run")
                rec = [st.st_size, st.st_mtime_ns, sha256_file(f)]
            files[name] = rec
            h.update(f"{f.name}\0{rec[2]}\0".encode())
        fps[key] = h.hexdigest()[:16]
    return fps, files


def _reads(reads: list[str], key: str) -> bool:
    return key in reads or key.partition(".")[0] in reads


def stage_keys(cfg: C.Config, inputs: dict[str, str] | None = None) -> dict[str, str]:
    """A key per stage: a hash of the settings it reads (less EXECUTION_ONLY), of the content of the files those
    settings name (`inputs`, from input_fingerprints) and of the stage before it."""
    d = C.to_dict(cfg)
    for key in EXECUTION_ONLY:
        sec, _, field = key.partition(".")
        d[sec].pop(field, None)
    for key, old in C.KEYED_WHEN_CHANGED.items():
        sec, _, field = key.partition(".")
        if d[sec].get(field) == old:
            d[sec].pop(field)
    aux_sec, _, aux_field = AUX_KEY.partition(".")
    aux, aux_default = d[aux_sec][aux_field], _default(AUX_KEY)
    d[aux_sec][aux_field] = aux_default
    keys, prev = {}, ""
    for name, _, reads, _ in STAGES:
        part = {}
        for r in reads:
            sec, _, field = r.partition(".")
            part[r] = d[sec][field] if field else d[sec]
        if name in AUX_READERS and aux != aux_default:
            part[AUX_KEY] = aux
        for key, fp in (inputs or {}).items():
            if _reads(reads, key):
                part[key + " content"] = fp
        if name == "extract" and cfg.train.online:
            part = {"skipped": "online"}
        prev = sha256_json({"stage": name, "config": part, "prev": prev})[:16]
        keys[name] = prev
    return keys


# regen settings whose change keeps some of the answers made: regen.samples (each sample's answers are its own:
# eyas.data.regen_conv.sample_copy) and a larger regen.limit (the plan grows: eyas.data.regen_plan._grows)
REGEN_KEEPS = ("regen.samples", "regen.limit")


def _regen_kept(cfg: C.Config, inputs: dict[str, str], rec: dict) -> dict | None:
    """{setting: value before} for the REGEN_KEEPS settings that changed since the regen stage recorded in `rec`, when
    they are the only change to its key (the run's other settings would give the recorded key with the values before)
    and each keeps some answers (regen.limit only upward, 0 being all); else None."""
    if not rec.get("key"):
        return None
    before = dict(rec.get("settings") or {})
    before.setdefault("regen.samples", (rec.get("result") or {}).get("samples"))  # a record made before "settings"
    changed = {k: v for k, v in before.items() if k in REGEN_KEEPS and is_int(v) and C.get_key(cfg, k) != v}
    lim = changed.get("regen.limit")
    if not changed or lim is not None and (lim == 0 or 0 < cfg.regen.limit < lim):
        return None
    then = copy.deepcopy(cfg)
    for k, v in changed.items():
        C.set_key(then, k, v)
    return changed if stage_keys(then, inputs)["regen"] == rec["key"] else None


def _keep_regen(cfg: C.Config, d: Path, kept: dict) -> None:
    """Keep the regen folder d's answers that still hold after the changes `kept` (`_regen_kept`), and say so."""
    from .data.regen_plan import drop_samples_after

    def samples(a, z):
        return f"sample {a}" if a == z else f"samples {a}-{z}"

    what = []
    if "regen.samples" in kept:
        was, now = kept["regen.samples"], cfg.regen.samples
        drop_samples_after(d, now)
        what.append(f"keeping the answers of {samples(1, min(was, now))}, " + (
            f"regenerating {samples(was + 1, now)}" if now > was else f"removing {samples(now + 1, was)}"))
    if "regen.limit" in kept:
        what.append("keeping the answers made, asking only for the conversations added")
    log(f"[regen] only {' and '.join(kept)} changed ("
        + ", ".join(f"{v or 'all'} -> {C.get_key(cfg, k) or 'all'}" for k, v in kept.items()) + "): " + "; ".join(what))


def versions() -> dict:
    import torch
    import transformers

    return {"eyas": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def stage_spec(name: str, cfg: C.Config, spec: str) -> str:
    """The "module:function" that does stage `name` under `cfg`: `spec` (its entry in STAGES or the CLI's commands),
    or the variant STAGE_VARIANTS names where its setting is given."""
    key, variant = STAGE_VARIANTS.get(name, ("", spec))
    return variant if key and C.get_key(cfg, key) else spec


def _stage_fn(spec: str):
    mod, fn = spec.split(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ModuleNotFoundError, AttributeError):
        return None


def stage_runs_target(name: str, cfg: C.Config) -> bool:
    """Whether stage `name` runs the target's decoder layers (needs the whole model loaded); the others read its
    description (eyas.target_spec), the trainer on stored features its head (eyas.target_head)."""
    from .target_head import needs_whole_target

    return (name == "regen" and cfg.regen.backend == "embedded" or name == "extract" and not cfg.features.from_vllm
            or name == "train" and bool(needs_whole_target(cfg)))


def preflight(cfg: C.Config, run: Path, manifest: dict):
    """Stop on bad inputs before any expensive stage."""
    from .data import read_dataset
    from .rope import target_rope
    from .target_spec import load_spec

    from .evaluate import check_eval_settings, load_prompt_set
    from .export import check_export_settings
    from .train import check_train_settings

    # the stages' own checks (the train stage's include the tokenize stage's, the eval's data.val_ratio and
    # data.test_ratio), which would refuse these settings only after regen, the eval's after the whole training
    check_train_settings(cfg)
    check_eval_settings(cfg)
    check_export_settings(cfg)
    if cfg.regen.enabled and cfg.eval.prompts == "sharegpt":
        from .evaluate import check_regen_split

        check_regen_split(cfg.regen.split, f"regen.split={cfg.regen.split} regenerates answers to train on from "
                                           f"{cfg.data.source}")
    if cfg.regen.backend == "embedded" or not cfg.regen.enabled:  # before the target, which takes longer to load
        convs, rep = read_dataset(cfg.data.source, strict=cfg.data.strict, limit=max(cfg.regen.limit, cfg.data.limit, 1))
        if not convs:
            raise EyasError(f"data set {cfg.data.source} holds no usable conversations: {rep.summary()}")
    if cfg.eval.prompts != "humaneval" and (cfg.eval.prompts, cfg.data.source) != ("sharegpt", "sharegpt"):
        # the eval's prompts, a held-out split of the user's data or a file, exist (the ShareGPT package's
        # test split holds thousands; reading it would take longer than the other checks together)
        load_prompt_set(cfg)
    target = load_spec(cfg.target)  # config and tokenizer: no weights are read before a stage runs the target
    if not target.has_chat_template:
        raise EyasError(f"target '{cfg.target.name}' has no chat template; eyas needs one to build training data")
    if cfg.vocab.draft_vocab_size > target.vocab_size:
        raise EyasError(f"vocab.draft_vocab_size {cfg.vocab.draft_vocab_size} is larger than the target's "
                        f"vocabulary ({target.vocab_size})")
    unserved = [a for a in target.aux_layers if not 1 <= a < target.num_layers]
    if unserved:  # the export stage would refuse them, after the whole training
        raise EyasError(f"target.aux_layers {target.aux_layers}: layer(s) {unserved} cannot be served (SGLang and vLLM "
                        f"capture the streams entering decoder layers 1..{target.num_layers - 1}), so the run's export "
                        f"would refuse the drafter after training; choose layers in that range (`eyas train` alone "
                        f"trains on any layers, for a drafter eyas' own decoder can evaluate but no engine serves)")
    if cfg.train.finetune_from:  # the drafter to start from is there and fits the target, before hours of regen
        from .target_head import load_target_head
        from .train import finetune_source

        finetune_source(cfg, load_target_head(cfg.target, target))
    else:  # the target's rope is one the drafter can have (eyas.rope), before hours of regen
        target_rope(target.config, f"target '{cfg.target.name}'")
    old = manifest.get("target")
    if old and (old.get("name"), old.get("sha256")) != (target.name, target.sha256):
        raise EyasError(f"run directory {run} was made with target '{old.get('name')}' ({str(old.get('sha256'))[:12]}), "
                        f"not '{target.name}' ({target.sha256[:12]}); use another --out")
    return target


def _files_under(path: Path) -> dict[str, os.stat_result]:
    """Every file at or under `path` but hidden ones (temporaries, locks), by its path relative to `path` (a file:
    its name), with its stat."""
    if path.is_file():
        return {path.name: path.stat()}
    if not path.is_dir():
        return {}
    out = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if not any(part.startswith(".") for part in rel.parts) and f.is_file():
            out[rel.as_posix()] = f.stat()
    return out


def _output_files(path: Path) -> dict[str, int]:
    """A stage's first output (what later stages read) as {file: size}."""
    return {rel: st.st_size for rel, st in _files_under(path).items()}


def _changed_output(path: Path, recorded: dict | None) -> str | None:
    """What is wrong with a finished stage's first output, in words, or None when it is as the stage left it: there,
    and (for a stage that recorded its files) every file it wrote still there at its size. A file removed from a
    run (to free disk, by mistake) makes the stage run again instead of failing, or worse, later."""
    if not path.exists():
        return f"{path} is gone"
    for rel, size in (recorded or {}).items():
        f = path / rel if path.is_dir() else path
        if not f.is_file():
            return f"{f} is gone"
        if f.stat().st_size != size:
            return f"{f} changed since (its size {f.stat().st_size:,} bytes, written as {size:,})"
    return None


def run_pipeline(cfg: C.Config) -> dict:
    import torch

    run = Path(cfg.out)
    run.mkdir(parents=True, exist_ok=True)
    mpath = run / "manifest.json"
    settle_pending(run)  # a standalone stage command killed on this run
    manifest = read_json(mpath) if mpath.exists() else {"stages": {}}
    want_cuda = cfg.target.device.startswith("cuda") or (cfg.target.device == "auto" and torch.cuda.is_available())
    auto = autosize(cfg, "cuda" if want_cuda else "cpu")
    if auto:
        log("sized for this machine (settings left at their defaults): " + ", ".join(f"{k}={v}" for k, v in auto.items()))
    target = preflight(cfg, run, manifest)
    C.save(cfg, run)
    inputs, files = input_fingerprints(cfg, manifest.get("input_files"))
    for key, fp in inputs.items():
        old = manifest.get("inputs", {}).get(key)
        if old and old["value"] == C.get_key(cfg, key) and old["sha256"] != fp:
            log(f"{key} {old['value']}: its content changed since the last run")
    manifest.update({"target": target.identity(), "versions": versions(), "config_preset": cfg.preset,
                     "inputs": {k: {"value": C.get_key(cfg, k), "sha256": fp} for k, fp in inputs.items()},
                     "input_files": files})
    keys = stage_keys(cfg, inputs)
    stage_outputs.settle(run, manifest, mpath, keys, {n: o for n, _, _, o in STAGES})
    summary = {}
    missing = []
    for name, spec, _, outputs in STAGES:
        rec = manifest["stages"].get(name, {})
        if name == "regen" and not cfg.regen.enabled or name == "extract" and cfg.train.online:
            manifest["stages"][name] = {"key": keys[name], "status": "skipped", "reason":
                                        "regen disabled" if name == "regen" else "features computed online"}
            continue
        if rec.get("key") == keys[name] and rec.get("status") == "done":
            gone = _changed_output(run / outputs[0], rec.get("files"))
            if gone is None:
                log(f"[{name}] unchanged, skipped ({rec.get('summary', '')})")
                summary[name] = "skipped"
                continue
            log(f"[{name}] finished before, but {gone}: running it again")
        elif rec.get("key") == keys[name] and rec.get("status") == "replaced":
            by = rec.get("by", name)
            log(f"[{name}] " + (f"a standalone `eyas {by}` wrote over its outputs since" if by == name else
                                f"a standalone `eyas {by}` remade what it reads since") + ": running it again")
        fn = _stage_fn(stage_spec(name, cfg, spec))
        if fn is None:
            missing.append(name)
            log(f"[{name}] not built yet in this version of eyas; stopping here")
            break
        kept = _regen_kept(cfg, inputs, rec) if name == "regen" else None
        if kept:
            _keep_regen(cfg, run / outputs[0], kept)
        elif rec.get("key") and rec.get("key") != keys[name]:  # kept until the new ones are complete
            stage_outputs.move_aside(run, name, outputs, rec)
        manifest["stages"][name] = {"key": keys[name], "status": "running", "started": time.time()}
        atomic_write_json(mpath, manifest)
        t0 = time.perf_counter()
        try:
            if "target" in inspect.signature(fn).parameters:
                if stage_runs_target(name, cfg) and not hasattr(target, "model"):  # loaded once, kept for later stages
                    from .target import load_target

                    target = load_target(cfg.target)
                result = fn(cfg, target=target)
            else:
                result = fn(cfg)
        except BaseException:
            stage_outputs.after_failure(run, name, outputs, manifest, mpath)
            raise
        dt = time.perf_counter() - t0
        release_memory()  # the stage's freed buffers (regen's KV cache, training's pinned feature tier) back
        line = one_line(name, result or {})
        manifest["stages"][name] = {"key": keys[name], "status": "done", "seconds": round(dt, 2),
                                    "summary": line, "result": _jsonable(result or {}),
                                    "files": _output_files(run / outputs[0]),
                                    **({"settings": {k: C.get_key(cfg, k) for k in REGEN_KEEPS}} if name == "regen"
                                       else {})}
        atomic_write_json(mpath, manifest)
        stage_outputs.drop_aside(run, name)
        log(f"[{name}] done in {dt:.0f}s: {line}")
        summary[name] = line
    manifest["missing"] = missing
    atomic_write_json(mpath, manifest)
    if not missing:
        try:
            run_report(cfg)
        except Exception as e:  # the report must never lose a finished run
            log(f"report: could not be written ({e})")
    if missing:
        raise NotBuiltError(f"eyas run stopped before: {', '.join(missing)} (not built yet); "
                            f"finished stages are kept in {run}")
    log(closing_line(run))
    return {"run": str(run), "stages": summary, "report": str(run / "report.md")}


def closing_line(run: Path) -> str:
    """The run's result in one line: τ, speed against plain decoding, the lossless check, and where the report and
    the exported drafter are (from the eval's report, so a run whose stages were all skipped says it too)."""
    ev = read_json(run / "eval" / "report.json") if (run / "eval" / "report.json").exists() else {}
    parts = [f"eyas run: {run}"]
    if ev.get("acceptance_length") is not None:
        loss = ev.get("lossless")
        parts.append(f"τ {ev['acceptance_length']:.3f} at K={ev.get('k')}"
                     + (f", {ev['speedup']:.2f}x plain decoding" if ev.get("speedup") else "")
                     + (", lossless" if loss else
                        f", lossless up to kernel rounding ({ev.get('lossless_matched')} of {ev.get('lossless_checked')}"
                        f" answers bit for bit)" if loss is False and ev.get("lossless_exact") else
                        ", NOT lossless" if loss is False else ""))
    exports = sorted(p.name for p in (run / "export").iterdir() if (p / "config.json").exists() and not p.name.startswith(".")) \
        if (run / "export").is_dir() else []
    served = "target" in exports  # the target eyas trained with, as a folder to serve (eyas.serve_target)
    exports = [e for e in exports if e != "target"]
    if exports:
        parts.append(f"drafter for {' and '.join(exports)} in {run / 'export'}"
                     + (f", its target in {run / 'export' / 'target'}" if served else ""))
    parts.append(f"report {run / 'report.md'}")
    return "; ".join(parts)


def mark_replaced(run: Path, command: str, snapshot: dict | None = None) -> dict:
    """A stage command (`eyas eval --out R`, ...) is about to write over the outputs of run R's stage of the same
    name, perhaps with other settings: that stage and the ones after it, which read its outputs, no longer hold
    what the run made, so the next `eyas run` makes them again instead of skipping them (and the run report does
    not show another command's eval as the run's). -> the marked stages' records as they were.
    With `snapshot` (output_snapshot before the command), the manifest also keeps them under "pending" until the
    command ends (end_pending): a command killed before it wrote any output is then undone by the next command on
    the run (settle_pending)."""
    mpath = run / "manifest.json"
    names = [n for n, *_ in STAGES]
    if command not in names or not mpath.exists():
        return {}
    manifest = read_json(mpath)
    stages = manifest.get("stages", {})
    if stages.get(command, {}).get("status") != "done":  # not part of what the run made (online features: extract)
        return {}
    before = {}
    # the stage and the ones after it, which read its outputs (the export reads the drafter, not the eval)
    for n in [command] if command == "eval" else names[names.index(command):]:
        if stages.get(n, {}).get("status") == "done":
            before[n] = dict(stages[n])
            stages[n]["status"], stages[n]["by"] = "replaced", command
    if before:
        if snapshot is not None:
            manifest["pending"] = {"command": command, "before": before, "snapshot": snapshot}
        atomic_write_json(mpath, manifest)
    return before


def _same_snapshot(a: dict, b: dict) -> bool:
    """Two output_snapshots, one of them perhaps read back from JSON (lists for tuples), are the same."""
    return {k: list(v) for k, v in a.items()} == {k: list(v) for k, v in b.items()}


def end_pending(run: Path) -> None:
    """The stage command mark_replaced marked for has ended (done, or failed and unmark_if_untouched has run)."""
    mpath = run / "manifest.json"
    if mpath.exists():
        manifest = read_json(mpath)
        if manifest.pop("pending", None) is not None:
            atomic_write_json(mpath, manifest)


def settle_pending(run: Path) -> None:
    """A stage command marked the run's stages replaced and never ended (killed): where it wrote none of its
    stage's outputs, their records come back (else the next `eyas run` would remake them, and the report call the
    run's own eval another command's). Called under the run's lock, so no such command is running now."""
    mpath = run / "manifest.json"
    if not mpath.exists():
        return
    manifest = read_json(mpath)
    pending = manifest.get("pending")
    if not isinstance(pending, dict):
        return
    command = pending.get("command")
    if _same_snapshot(output_snapshot(run, command), pending.get("snapshot") or {}):
        stages = manifest.get("stages", {})
        for n, rec in (pending.get("before") or {}).items():
            if stages.get(n, {}).get("status") == "replaced" and stages[n].get("by") == command:
                stages[n] = rec
        log(f"a standalone `eyas {command}` on {run} stopped before writing anything: the run's own records are back")
    manifest.pop("pending")
    atomic_write_json(mpath, manifest)


def output_snapshot(run: Path, command: str) -> dict[str, tuple[int, int]]:
    """Every file under the outputs of `command`'s stage, with its size and mtime: what unmark_if_untouched compares
    with after the command, to tell whether it wrote any of them."""
    outputs = next((o for n, _, _, o in STAGES if n == command), [])
    return {f"{o}/{rel}": (st.st_size, st.st_mtime_ns) for o in outputs
            for rel, st in _files_under(run / o).items()}


def unmark_if_untouched(run: Path, command: str, before: dict, snapshot: dict) -> None:
    """`command` stopped (its settings refused, a checkpoint of other data, an error) before it wrote any of its
    stage's outputs (they are as output_snapshot saw them before it ran): the stages mark_replaced marked hold what
    the run made after all, so their records come back (else the next `eyas run` would say a standalone command
    wrote over them, and remake them)."""
    mpath = run / "manifest.json"
    if not before or not mpath.exists() or not _same_snapshot(output_snapshot(run, command), snapshot):
        return
    manifest = read_json(mpath)
    stages = manifest.get("stages", {})
    for n, rec in before.items():
        if stages.get(n, {}).get("status") == "replaced" and stages[n].get("by") == command:
            stages[n] = rec
    atomic_write_json(mpath, manifest)


def _jsonable(obj):
    import json

    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return json.loads(json.dumps(obj, default=str))


def one_line(name: str, r: dict) -> str:
    pick = {
        "regen": ["records", "assistant_turns", "errors_total", "tokens_per_s"],
        "tokenize": ["conversations", "tokens", "loss_tokens", "truncated"],
        "vocab": ["draft_vocab_size", "coverage"],
        "extract": ["tokens", "bytes", "tokens_per_s"],
        "train": ["steps", "best_sim_acceptance_length", "tokens_per_s"],
        "eval": ["acceptance_length", "acceptance_length_ci95", "speedup", "lossless"],
        "export": ["formats", "serve_target"],
    }.get(name, [])
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        if isinstance(v, list) and len(v) == 2 and all(isinstance(x, float) for x in v):  # an interval
            return f"{v[0]:.3g}-{v[1]:.3g}"
        return str(v)

    label = {"errors_total": "left_out"}  # regen's count of prompts it could not answer, named as its log names it
    parts = [f"{label.get(k, k)}={fmt(r[k])}" for k in pick if k in r]
    return ", ".join(parts) or ", ".join(f"{k}={v}" for k, v in list(r.items())[:3] if not isinstance(v, (dict, list)))


def run_report(cfg: C.Config) -> dict:
    from .report import write_report

    return write_report(Path(cfg.out))


