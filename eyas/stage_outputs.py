"""A changed stage's old outputs, kept until its new ones are complete.

When a stage's key changes, `eyas run` moves its outputs into `<run>/.replaced/<stage>/` (a rename, no copy)
beside the record that described them, instead of deleting them before the new ones exist. Then:

* the stage finishes: the old outputs are removed;
* it fails having written nothing: they are moved back, with their record, at once;
* it fails after writing some work, or the run is killed: both stay, the new work where the stage resumes it. The
  next `eyas run` with the old settings moves the old outputs back (dropping the unfinished new ones); with the new
  settings it resumes the stage and removes the old ones once it is done; with yet other settings the unfinished
  outputs are cleared and the old ones, the last complete ones, stay aside.

Every step is a rename or a removal of what is already elsewhere, so a kill between any two leaves each output in
one of the two places and the next start finishes the move (settle).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .util import atomic_write_json, log, read_json

ASIDE = ".replaced"  # hidden: no stage output listing (pipeline._files_under) takes it for one of its files


def aside_dir(run: Path, name: str) -> Path:
    return run / ASIDE / name


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def _holds_files(run: Path, outputs: list[str]) -> bool:
    return any((run / o).is_file() or (run / o).is_dir() and any(f.is_file() for f in (run / o).rglob("*"))
               for o in outputs)


def move_aside(run: Path, name: str, outputs: list[str], record: dict) -> None:
    """The stage `name`'s key changed: keep its outputs, described by `record`, aside. Where complete outputs of it are
    already aside (a change made while an earlier change's stage was unfinished), the outputs in place are that
    unfinished work of other settings, and are removed instead."""
    a = aside_dir(run, name)
    if (a / "record.json").exists():
        for o in outputs:
            _remove(run / o)
        log(f"[{name}] config or inputs changed: clearing its unfinished outputs (the last complete ones stay in {a})")
        return
    if not any((run / o).exists() for o in outputs):
        return
    a.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a / "record.json", record)
    for o in outputs:
        if (run / o).exists():
            (a / o).parent.mkdir(parents=True, exist_ok=True)
            os.replace(run / o, a / o)
    log(f"[{name}] config or inputs changed: its old outputs moved to {a} until the new ones are complete")


def drop_aside(run: Path, name: str) -> None:
    """The stage's new outputs are complete: the old ones go."""
    a = aside_dir(run, name)
    if a.exists():
        shutil.rmtree(a)
    if (run / ASIDE).is_dir() and not any((run / ASIDE).iterdir()):
        (run / ASIDE).rmdir()


def restore(run: Path, name: str, outputs: list[str], manifest: dict, mpath: Path) -> None:
    """Put the stage's old outputs and record back in place of whatever it has written since."""
    a = aside_dir(run, name)
    record = read_json(a / "record.json")
    for o in outputs:
        if (a / o).exists():  # not moved back yet (a kill may have come between two of these)
            _remove(run / o)
            (run / o).parent.mkdir(parents=True, exist_ok=True)
            os.replace(a / o, run / o)
    manifest["stages"][name] = record
    atomic_write_json(mpath, manifest)
    drop_aside(run, name)


def settle(run: Path, manifest: dict, mpath: Path, keys: dict[str, str], outputs: dict[str, list[str]]) -> None:
    """At the start of a run: put back the old outputs of a stage whose settings went back to theirs (or whose move
    aside a kill cut short, its record still theirs), remove those of a stage finished since, leave the others."""
    for name, outs in outputs.items():
        a = aside_dir(run, name)
        if not (a / "record.json").exists():
            continue
        old = read_json(a / "record.json").get("key")
        rec = manifest.get("stages", {}).get(name, {})
        if keys.get(name) == old or rec.get("key") == old:
            restore(run, name, outs, manifest, mpath)
            log(f"[{name}] its outputs of these settings, kept aside while other settings ran unfinished, are back "
                f"in place")
        elif rec.get("status") == "done":
            drop_aside(run, name)
        else:
            log(f"[{name}] the outputs of its last complete run, with other settings, wait in {a} until this one "
                f"is complete")


def after_failure(run: Path, name: str, outputs: list[str], manifest: dict, mpath: Path) -> None:
    """The stage stopped (an error, Ctrl-C): where it wrote nothing to resume, its old outputs come back at once;
    else both stay (the next run settles them)."""
    a = aside_dir(run, name)
    if not (a / "record.json").exists():
        return
    if _holds_files(run, outputs):
        log(f"[{name}] stopped: its unfinished outputs stay for the same settings to resume; those of its last "
            f"complete run are kept in {a}, and put back by a run with their settings")
        return
    restore(run, name, outputs, manifest, mpath)
    log(f"[{name}] stopped before writing anything: its outputs from before the change are back in place")
