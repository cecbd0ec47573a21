"""A folder written whole: its new content is made in a temporary folder beside it and swapped in in one step, so a
reader never finds it half-written (the drafter exports, the target folder the exports name).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from .util import writing


@contextlib.contextmanager
def fresh_folder(out: Path, check) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; when the block succeeds, it takes out's place in one step. So
    `out` holds exactly what the block wrote: no file of an earlier write survives there to be read with the new
    ones (a reader loads every weights file a folder holds when it has no index), and a reader, or a writer killed
    midway, finds the old folder whole or the new one whole (`check(out)` refuses an `out` it may not replace).
    What a killed writer leaves beside `out` (a hidden `.<name>.<pid>.tmp` folder) is deleted by the next one."""
    check(out)
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(out):
        tmp.mkdir()
    try:
        yield tmp
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the unfinished folder, or after a swap the old one


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` at `out`; the old `out`, if any, ends up at `tmp`."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if _exchange(tmp, out):
        return
    # a system that cannot swap two folders in one step: the old one is moved aside first, so for that instant `out`
    # is missing (never half-written)
    old = out.with_name(f".{out.name}.{os.getpid()}.old.tmp")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step: Linux's renameat2 with RENAME_EXCHANGE. False where the C library, the kernel or
    the file system does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28 and later
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove_leftovers(out: Path) -> None:
    """Delete the temporary folders writers killed midway left beside `out`, unless their process still runs."""
    if not out.parent.is_dir():
        return
    prefix = f".{out.name}."
    for p in out.parent.iterdir():
        if p.name.startswith(prefix) and p.name.endswith(".tmp") and p.is_dir():
            pid = p.name[len(prefix):].split(".")[0]
            if pid.isdigit() and (int(pid) == os.getpid() or not _running(int(pid))):
                shutil.rmtree(p, ignore_errors=True)


def _running(pid: int) -> bool:
    if os.name != "posix":  # elsewhere os.kill(pid, 0) is no harmless probe: keep the folder
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
