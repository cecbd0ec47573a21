"""The `eyas` command: one subcommand per stage, each a thin wrapper over one stage function.

Every subcommand takes an optional CONFIG.toml, --preset, --out (the run directory), --set KEY=VALUE
(any config field) and flags made from the config fields of the sections it uses, so every flag
has the field's help text and type. User mistakes print one clear line and exit 2.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import sys
import typing
from pathlib import Path
from typing import Any

from . import config as C
from . import pipeline
from .util import RUN_LOCK, EyasError, NotBuiltError, Terminated, log, run_lock

# a section, or "section:field,field" for the fields of it a command reads (the eval reads the data settings that
# find its held-out prompts, not those of tokenizing; no stage but extract runs the target tensor-parallel)
EVAL_DATA = "data:source,val_ratio,test_ratio,strict"
EVAL_TARGET = "target:name,gguf_file,dtype,device,device_map,aux_layers,cache_dir,trust_remote_code"
# subcommand -> (help, config sections whose fields become flags, "module:function" of the stage)
COMMANDS: dict[str, tuple[str, list[str], str]] = {
    "run": ("run the whole pipeline over one run directory (regen, tokenize, vocab, features, train, eval, export)",
            ["target", "data", "regen", "vocab", "features", "train", "eval", "export"], "eyas.pipeline:run_pipeline"),
    "regen": ("regenerate the assistant turns of a data set with the target", ["regen", "target", "data"],
              "eyas.data.regen:run_regen"),
    "tokenize": ("tokenize training conversations with the chat template and an assistant-only loss mask",
                 ["data", "target"], "eyas.data.prepare:run_tokenize"),
    "vocab": ("choose the draft vocabulary (d2t/t2d) and report its coverage", ["vocab", "data", "target"],
              "eyas.vocab:run_vocab"),
    "extract": ("capture the target's aux and final hidden states into feature shards", ["features", "target", "data"],
                "eyas.features:run_extract"),
    "train": ("train the EAGLE-3 drafter with training-time test", ["train", "vocab", "features", "target"],
              "eyas.train:run_train"),
    "eval": ("speculative decoding with the drafter: acceptance length, speedup, lossless check",
             ["eval", EVAL_TARGET, EVAL_DATA], "eyas.evaluate:run_eval"),
    "export": ("export the drafter for SGLang and vLLM", ["export", "target"], "eyas.export:run_export"),
    "report": ("rebuild the run report (DIR/report.md) from a run directory", [], "eyas.pipeline:run_report"),
}


def add_config_flags(p: argparse.ArgumentParser, sections: list[str], own: str | None = None) -> dict[str, str]:
    """Add one flag per config field; returns dest -> dotted key. A field name found in more than one of the
    sections keeps the plain flag only in the command's `own` section (`eyas train --seed` is train.seed); the
    others, and all of them where there is no own section (`eyas run`: --regen-seed, --train-seed), carry their
    section's name, and the plain flag there stops with the choice instead of picking one silently."""
    mapping: dict[str, str] = {}
    taken = {"preset", "out", "set", "config", "help", "target"}
    owners: dict[str, list[str]] = {}
    fields = {}
    for spec in sections:
        sec, _, only = spec.partition(":")
        fields[sec] = [f for f in C.section_fields(sec) if not only or f[0] in only.split(",")]
    sections = list(fields)
    for sec in sections:
        for name, *_ in fields[sec]:
            if not (sec == "target" and name == "name"):
                owners.setdefault(name, []).append(sec)
    for sec in sections:
        g = p.add_argument_group(f"[{sec}] settings")
        for name, tp, default, help_, choices in fields[sec]:
            flag = name.replace("_", "-")
            if sec == "target" and name == "name":
                continue  # --target
            if flag in taken or (len(owners[name]) > 1 and sec != own):
                flag = f"{sec}-{flag}"
            taken.add(flag)
            dest = f"cfg__{sec}__{name}"
            # argparse %-formats help texts: a literal % must be doubled
            shown = help_ if "(default:" in help_ else f"{help_} (default: {default!r})"  # the help says it in words
            kw: dict[str, Any] = {"dest": dest, "default": None, "help": shown.replace("%", "%%")}
            if choices:
                kw["choices"] = choices
            if tp is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(tp) is list:
                kw["action"] = "append"
                kw["metavar"] = "VALUE"
                kw["help"] += "; repeat the flag or give a comma list"
            elif choices:  # the usage line and help show them
                kw["metavar"] = "{" + ",".join(c if c else "''" for c in choices) + "}"
            else:
                kw["metavar"] = getattr(tp, "__name__", "VALUE").upper()
            g.add_argument(f"--{flag}", **kw)
            p.set_defaults(**{f"flag__{dest}": f"--{flag}"})  # what config_from_args calls it in an error
            mapping[dest] = f"{sec}.{name}"
    for name, secs in owners.items():  # a plain flag no section owns here: say which ones there are
        flag = name.replace("_", "-")
        if len(secs) > 1 and own not in secs and flag not in taken:
            p.add_argument(f"--{flag}", action=_Ambiguous, nargs="?", help=argparse.SUPPRESS,
                           choices_of=[f"--{sec}-{flag}" for sec in secs])
    return mapping


class _Ambiguous(argparse.Action):
    """A flag that several sections' settings share in this command: stops, naming the section-prefixed ones."""

    def __init__(self, *args, choices_of: list[str], **kw):
        super().__init__(*args, **kw)
        self.choices_of = choices_of

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is ambiguous here: say which setting, {' or '.join(self.choices_of)}")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, dict[str, str]]]:
    p = argparse.ArgumentParser(prog="eyas", description="Train EAGLE-3 speculative-decoding drafters and prove "
                                "what they are worth.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"eyas {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    maps = {}
    for name, (help_, sections, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name == "report":  # reads a run directory and nothing else: no settings to take
            sp.add_argument("run_dir", nargs="?", default=None, metavar="DIR", help="the run directory (as --out)")
            sp.add_argument("--out", "--run", dest="out", default=None, help="the run directory (default: runs/default)")
            continue
        common(sp)
        maps[name] = add_config_flags(sp, sections, own=sections[0] if name != "run" and sections else None)
    sp = sub.add_parser("target", help="show what eyas sees in a target", description="show what eyas sees in a target")
    common(sp)
    maps["target"] = add_config_flags(sp, ["target"], own="target")
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sp = sub.add_parser("data", help="show and check a data set (records, skips, splits, token lengths)",
                        description="show and check a data set, or report on regenerated output (--report)")
    common(sp)
    maps["data"] = add_config_flags(sp, ["data", "target"], own="data")
    sp.add_argument("--report", metavar="DIR", default=None, help="validation report of regenerated output in DIR")
    sp.add_argument("--show", type=int, default=0, metavar="N", help="print the first N conversations rendered with "
                    "the chat template, trained-on text marked [[like this]]")
    sp.add_argument("--tokens", action="store_true", help="also tokenize every record and print length statistics")
    sp.add_argument("--json", action="store_true", help="with --report: print the report as JSON")
    sp = sub.add_parser("parity", help="compare a serving engine's acceptance with eyas' own on the same prompts",
                        description="compare a serving engine's acceptance with eyas' own on the same prompts")
    common(sp)
    maps["parity"] = add_config_flags(sp, ["eval", EVAL_TARGET, EVAL_DATA], own="eval")
    sp.add_argument("--endpoint", required=True, help="base URL of the running server, e.g. http://127.0.0.1:8000 "
                    "(required)")
    sp.add_argument("--engine", choices=("vllm", "sglang"), required=True,
                    help="which engine serves the drafter (required)")
    sp = sub.add_parser("compare", help="two drafters' τ on the same prompts, with a paired bootstrap interval",
                        description="τ of report A minus τ of report B on the same prompts (greedy decoding writes "
                        "the same text whatever the drafter, so each prompt pairs with itself), with a paired "
                        "bootstrap interval over the prompts or conversations")
    sp.add_argument("a", help="report A: a run directory, an eval report.json or a bench/bench_decode.py JSON")
    sp.add_argument("b", help="report B, of the same prompts")
    sp.add_argument("--method", default=None, help="bench_decode method to read in both (default: each report's "
                    "first speculative method)")
    sp.add_argument("--level", type=float, default=0.95, help="the interval's level (default: 0.95)")
    sp.add_argument("--json", action="store_true", help="print JSON instead of two lines")
    return p, maps


def common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", nargs="?", default=None, help="TOML config file (optional)")
    sp.add_argument("--preset", default=None, help="start from a preset: " + ", ".join(C.PRESETS))
    sp.add_argument("--out", "--run", dest="out", default=None, help="run directory (default: runs/default)")
    sp.add_argument("--target", dest="target_name", default=None,
                    help="target: preset name, HF folder, .gguf file or hub id")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="set any config field, e.g. --set train.lr=1e-4 (repeatable)")


def _typed(key: str, value: Any) -> Any:
    """A setting's value as its field's type (a --set string, a flag's parsed value), to compare two of them."""
    scratch = C.Config()
    C.set_key(scratch, key, value)
    return C.get_key(scratch, key)


def config_from_args(args: argparse.Namespace, mapping: dict[str, str]) -> C.Config:
    overrides: dict[str, Any] = {}
    for item in args.overrides:
        if "=" not in item:
            raise EyasError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v.strip()
    for dest, key in mapping.items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        if isinstance(v, list):
            v = [x for item in v for x in str(item).split(",") if x]
        if key in overrides and _typed(key, overrides[key]) != _typed(key, v):  # neither silently wins
            flag = getattr(args, f"flag__{dest}", "its flag")
            shown = ",".join(map(str, v)) if isinstance(v, list) else v
            raise EyasError(f"{key} is given twice with different values, {flag} {shown} and --set "
                            f"{key}={overrides[key]}: give one")
        overrides[key] = v
    if args.out is not None and not args.out.strip():
        raise EyasError("--out is empty: give a run directory (leave --out out for runs/default)")
    if "out" in overrides and not str(overrides["out"]).strip():
        raise EyasError("--set out= is empty: give a run directory (leave it out for runs/default)")
    for key, flag, v in (("target.name", "--target", args.target_name), ("out", "--out", args.out)):
        if v and key in overrides and str(overrides[key]) != v:
            raise EyasError(f"{key} is given twice with different values, {flag} {v} and --set {key}={overrides[key]}: "
                            f"give one")
        if v:
            overrides[key] = v
    saved = Path(args.out or C.Config().out) / "eyas.toml"
    if args.config or args.preset or not saved.is_file():
        return C.resolve(args.config, args.preset, overrides)
    command = getattr(args, "command", None)
    log(f"settings: the run's own, from {saved}" + (" (its preset and what it was given; the rest sized to this "
        "machine)" if command == "run" else "") + ", under this command's flags; a CONFIG file or --preset starts "
        "afresh")
    return C.resolve(None, None, overrides, run_config=saved, whole=command != "run")


def stage_function(spec: str, command: str):
    mod_name, fn_name = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("eyas"):
            raise NotBuiltError(f"`eyas {command}` is not built yet in this version of eyas") from None
        raise
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise NotBuiltError(f"`eyas {command}` is not built yet in this version of eyas")
    return fn


def cmd_target(cfg: C.Config, args) -> int:
    from .target_spec import load_spec

    info = load_spec(cfg.target).describe()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        w = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{w}}  {v}")
    return 0


def cmd_data(cfg: C.Config, args) -> int:
    from .data.inspect import inspect_data

    return inspect_data(cfg, report_dir=args.report, show=args.show, tokens=args.tokens, as_json=args.json)


def cmd_parity(cfg: C.Config, args) -> int:
    fn = stage_function("eyas.parity:run_parity", "parity")
    return _print_result(fn(cfg, endpoint=args.endpoint, engine=args.engine))


def cmd_compare(args) -> int:
    from .eval_stats import compare_reports

    r = compare_reports(args.a, args.b, args.method, args.level)
    if args.json:
        return _print_result(r)
    lo, hi = r["interval"]
    print(f"τ A {r['tau_a']:.3f} ({r['read'][0]}), τ B {r['tau_b']:.3f} ({r['read'][1]})")
    print(f"A - B: {r['difference']:+.3f} ({r['level']:.0%} paired interval {lo:+.3f} to {hi:+.3f}) over "
          f"{r['pairs']} {r.get('unit', 'prompts')} both reached" + (f", paired by {r['paired_by']}" if r.get("paired_by")
                                                                      else "")
          + (f"; same text {r['same_text']}" if "same_text" in r else ""))
    return 0


def _print_result(res) -> int:
    if isinstance(res, dict):
        print(json.dumps(res, indent=2, default=str))
    return 0


def _terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    parser, maps = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    old = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        old = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _main(args, maps)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _main(args, maps) -> int:
    try:
        if args.command == "compare":  # reads two reports, no config
            return cmd_compare(args)
        if args.command == "report":
            if args.out is not None and not args.out.strip():
                raise EyasError("--out is empty: give a run directory (leave --out out for runs/default)")
            if args.run_dir and args.out and Path(args.run_dir) != Path(args.out):
                raise EyasError(f"two run directories given, {args.run_dir} and --out {args.out}: give one")
            return _print_result(pipeline.run_report(C.Config(out=args.run_dir or args.out or C.Config().out)))
        cfg = config_from_args(args, maps.get(args.command, {}))
        out = Path(cfg.out)
        if args.command not in ("target", "data") and out.exists() and not out.is_dir():  # before any work
            raise EyasError(f"--out {out} is a file, not a run directory; give a folder (made if missing)")
        if args.command == "target":
            return cmd_target(cfg, args)
        if args.command == "data":
            return cmd_data(cfg, args)
        with run_lock(out, args.command):
            if args.command == "parity":
                return cmd_parity(cfg, args)
            fn = stage_function(pipeline.stage_spec(args.command, cfg, COMMANDS[args.command][2]), args.command)
            if args.command == "run":
                return _print_result(fn(cfg))
            pipeline.settle_pending(out)  # an earlier stage command killed on this run
            snapshot = pipeline.output_snapshot(out, args.command)
            before = pipeline.mark_replaced(out, args.command, snapshot)
            # a run a stage command starts remembers its settings, as one `eyas run` starts does: the next command
            # on it (`eyas tokenize --out R` after `eyas regen --preset tiny --out R`) starts from them
            saved = out / "eyas.toml"
            new = not saved.exists()
            if new:
                C.save(cfg, out)
            try:
                result = fn(cfg)
                pipeline.end_pending(out)
                return _print_result(result)
            except BaseException:
                pipeline.unmark_if_untouched(out, args.command, before, snapshot)
                pipeline.end_pending(out)
                if new and not any(p.name not in ("eyas.toml", RUN_LOCK) for p in out.iterdir()):
                    saved.unlink(missing_ok=True)  # refused before it made anything: the folder is not a run yet
                raise
    except NotBuiltError as e:
        print(f"eyas: {e}", file=sys.stderr)
        return 3
    except EyasError as e:
        print(f"eyas: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`eyas data --report R | head`): nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        # the disk, not eyas: read-only, full, or not ours to write. Said in one line; work finished is kept (every
        # file is written whole or not at all)
        if e.errno not in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM):
            raise
        where = e.filename or "a file of the run directory"
        print(f"eyas: error: {e.strerror}: {where}" + (" (free some space, or give another --out)"
              if e.errno in (errno.ENOSPC, errno.EDQUOT) else " (give an --out you can write to)")
              + "; finished work is kept, run the same command again to go on", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        by = " by SIGTERM" if isinstance(e, Terminated) else ""
        print(f"eyas: interrupted{by}; finished work is kept, run the same command again to resume", file=sys.stderr)
        return 143 if by else 130


if __name__ == "__main__":
    sys.exit(main())
