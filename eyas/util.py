"""Small helpers every stage shares: user-facing errors, atomic writes, hashing, progress bars."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable


class EyasError(Exception):
    """A problem the user can fix (bad input, missing file, wrong flag). The CLI prints the message
    and exits with status 2 instead of showing a traceback."""


class NotBuiltError(EyasError):
    """A stage that this version of eyas does not provide yet."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's notice, `kill`): stops the command as Ctrl-C does, so it says so and what was kept,
    where the default handler ended the process without a word (training keeps its own handler: it saves a
    checkpoint at the step under way first, then raises this). The CLI exits 143 for it, 130 for Ctrl-C."""


# errno values of a write that failed for want of space, and of one refused by the file system
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_REFUSED = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied"}


def write_error(path: str | os.PathLike, e: BaseException, needed: int | None = None) -> EyasError | None:
    """The one-line EyasError for a write of `path` that failed with `e` for a reason the user fixes (the disk is
    full or over quota: with the space the file needed and what is free; read-only; not ours to write; a file
    where a folder should be), or None for any other failure. `e` is an OSError or a safetensors error, which
    carries the OS error only in its text ("... (os error 28)")."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and type(e).__name__ == "SafetensorError":
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else None
    path = Path(path)
    if code in _NO_SPACE:
        where = next((p for p in (path.parent, *path.parents) if p.is_dir()), Path("."))
        try:
            free = f"{human_bytes(shutil.disk_usage(where).free)} free"
        except OSError:
            free = "free space unknown"
        need = f"about {human_bytes(needed)} needed, " if needed else ""
        what = "the disk is full" if code == errno.ENOSPC else "the disk quota is used up"
        return EyasError(f"{path}: not written, {what} ({need}{free} on {where}); nothing half-written is left and "
                         f"finished work is kept: free some space (or give another --out) and run the same command "
                         f"again")
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            return EyasError(f"{path}: cannot be written: {blocker} is a file, not a folder; give an --out whose "
                             f"folders are folders (made where missing)")
    if code in _REFUSED:
        return EyasError(f"{path}: cannot be written: {_REFUSED[code]}"
                         + (f" ({e.filename})" if isinstance(e, OSError) and e.filename
                            and str(e.filename) != str(path) else "")
                         + "; give an --out you can write to")
    return None


@contextlib.contextmanager
def writing(path: str | os.PathLike, needed: int | None = None):
    """Turn a failed write of `path` inside the block into write_error's one line (other failures pass as they
    are)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - safetensors' errors are plain Exceptions, not OSErrors
        err = write_error(path, e, needed) if not isinstance(e, EyasError) else None
        if err is None:
            raise
        raise err from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# the permissions a plain open() gives a new file. mkstemp and safetensors' writer create files readable by their
# owner alone (0600), which kept a serving engine run as another user from reading an exported drafter
FILE_MODE = 0o666 & ~_umask()


def share(path: str | os.PathLike) -> None:
    """Give a file written through a private temporary the permissions a plain open() would have."""
    with contextlib.suppress(OSError):
        os.chmod(path, FILE_MODE)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees either the old file or the whole new one."""
    path = Path(path)
    with writing(path, len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            share(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, needed: int | None = None):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.
    For writers that want a file name (safetensors, matplotlib). A write that fails for want of space (or is
    refused) ends in write_error's one line naming `path` (`needed`: the bytes it takes, when known)."""
    path = Path(path)
    with writing(path, needed):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name("." + path.name + f".{os.getpid()}.tmp")
        try:
            yield tmp
            if tmp.is_file():
                share(tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike):
    """Hold an exclusive lock on `path` (created if missing) for the block: processes that build the same
    cached thing (torchrun ranks loading one target) take turns, so the first builds it and the others
    find it done. Advisory (fcntl); where fcntl is missing the block runs unlocked."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def installed_file(package: str, rel: str) -> Path | None:
    """A file shipped inside an installed package (model and data packages), or None."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / rel
    return p if p.exists() else None


def first_non_finite(tensors: dict) -> tuple[str, int, int] | None:
    """The first floating-point tensor of `tensors` (name -> tensor) that holds NaN or Inf, as (name, how many, of
    how many values); None when every one is finite."""
    import torch

    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            ok = torch.isfinite(t if t.element_size() > 1 else t.float())  # (fp8 has no isfinite of its own)
            if not bool(ok.all()):
                return name, int(ok.numel() - ok.sum()), t.numel()
    return None


def refuse_non_finite(tensors: dict, where: str, hint: str) -> None:
    """An EyasError naming `where` (the file) and the first tensor holding NaN or Inf, with `hint` (what to do)."""
    bad = first_non_finite(tensors)
    if bad is not None:
        name, n, total = bad
        raise EyasError(f"{where}: tensor '{name}' holds {n:,} non-finite values (NaN or Inf) of {total:,}; {hint}")


def text_lines(text: str) -> list[str]:
    """The lines of a JSONL or line-per-record text: split at "\n" only (a "\r" before it dropped). str.splitlines
    would also split at U+2028, U+2029, U+0085 and other separators that JSON strings may hold unescaped (json.dumps
    with ensure_ascii=False writes them as they are), cutting such a record in two."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def repeated_share(seq, n: int) -> float:
    """Share of a sequence's n-grams that occurred earlier in it (0 for one shorter than n): how much a text
    repeats itself, a loop near 1."""
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EyasError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise EyasError(f"{path}: line {e.lineno}: invalid JSON ({e.msg})") from None


# what to do about a drafter file eyas cannot read: it was damaged or edited by hand after eyas wrote it
DAMAGED = ("restore it from a copy, or make the folder again (`eyas train` writes a run's draft/, `eyas export` "
           "its export/)")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is no layer count


def json_kind(v) -> str:
    """A config value as a message shows it: the value, with its JSON type where that may be the mistake."""
    if isinstance(v, str):
        return f"{v!r} (a string)"
    if isinstance(v, (list, dict)):
        kind = "a JSON array" if isinstance(v, list) else "a JSON object"
        return kind if len(json.dumps(v, default=str)) > 60 else f"{json.dumps(v, default=str)} ({kind})"
    return json.dumps(v, default=str)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


RUN_LOCK = ".eyas.lock"


@contextlib.contextmanager
def run_lock(run: str | os.PathLike, command: str):
    """Hold the run directory for one command: a second eyas command on the same --out while this one works stops at
    once, naming the one at work (two trainings in one folder interleaved their checkpoints and metrics, two
    `eyas run`s regenerated the same answers into one journal). Only the first process of a torchrun job takes it;
    its other ranks work in the folder with it. The lock goes with the process (fcntl), so a killed command leaves
    nothing to clear. A folder the command made and left empty is removed again."""
    run = Path(run)
    if dist_env()[0] != 0:
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: unlocked
        yield
        return
    made = not run.exists()
    with writing(run):  # (--out under a file: said in one line)
        run.mkdir(parents=True, exist_ok=True)
    path = run / RUN_LOCK
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            who = f.read().strip() or "another eyas command"
            raise EyasError(f"{run} is in use by {who}; wait for it to finish, or use another --out") from None
        f.seek(0)
        f.truncate()
        f.write(f"`eyas {command}` (process {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            if made and [q.name for q in run.iterdir()] == [RUN_LOCK]:
                path.unlink()
                run.rmdir()
    finally:
        f.close()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def stable_hash(text: str) -> int:
    """A hash of a string that is the same on every machine and Python run (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment (0, 1, 0 without it)."""
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
            int(os.environ.get("LOCAL_RANK", "0")))


def dist_barrier() -> None:
    """torch.distributed's barrier when a process group is up (torchrun); nothing otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# where stderr is not a terminal (a log file, CI), a progress bar writes one plain line this often, from the first
# time it has run this long: short work writes nothing, long work shows it is alive and how far it got
PROGRESS_LINE_S = 60.0


class _Lines:
    """A stream for tqdm that turns each redraw ("\r" + state) into a line of its own."""

    def __init__(self, stream):
        self.stream, self.last = stream, ""

    def write(self, s: str) -> None:
        s = s.replace("\r", "").replace("\x1b[A", "").strip()
        if s and s != self.last:  # the closing redraw repeats the last refresh
            self.stream.write(s + "\n")
            self.stream.flush()
            self.last = s

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable: Iterable | None = None, **kw):
    """A tqdm progress bar on stderr. Where stderr is not a terminal and EYAS_PROGRESS is not set, the bar is a
    plain line every PROGRESS_LINE_S seconds once the work has run that long (so logs and CI output stay
    readable and a long stage still reports how far it is)."""
    from tqdm.auto import tqdm

    if sys.stderr.isatty() or os.environ.get("EYAS_PROGRESS"):
        kw.setdefault("dynamic_ncols", True)
        kw.setdefault("mininterval", 0.5)
    else:
        kw.setdefault("file", _Lines(sys.stderr))
        kw.setdefault("ncols", 100)
        kw.setdefault("mininterval", PROGRESS_LINE_S)
        # tqdm's monitor thread redraws a bar that has not drawn for maxinterval (10 s by default): in a log that
        # added a line 10-12 s after each minute's (seen in a CPU run's training, after an evaluation's pause)
        kw.setdefault("maxinterval", PROGRESS_LINE_S)
        kw.setdefault("delay", PROGRESS_LINE_S)
    return tqdm(iterable, **kw)


def log(msg: str) -> None:
    """One line to stderr, from rank 0 only when running under torchrun."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, file=sys.stderr, flush=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated
    and slower than fp32. Reads the Linux flags; False where they cannot be read."""
    try:
        flags = Path(cpuinfo).read_text(errors="replace").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def to_device(t, device):
    """Tensor `t` on `device`. A CPU tensor bound for a GPU goes through pinned memory without blocking:
    a copy from pageable memory waits for all the work queued on the GPU, so the host could never run
    ahead of it (the training step once made one such copy per sequence)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def release_memory() -> bool:
    """Give back what torch's caches still hold for tensors already freed: the GPU allocator's unused blocks and the
    pinned host blocks. The training's host tier of features pins up to 80% of the host's memory, and torch's
    pinned-memory allocator keeps those blocks for the rest of the process once they are freed, so `eyas run`
    calls this between stages (eval and export then run without them). Whether pinned memory was given back: False
    without CUDA in use, or with a torch that has no hook for it."""
    import gc

    import torch

    gc.collect()  # tensors held only by reference cycles first
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    torch.cuda.empty_cache()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # torch before torch.accelerator had it
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    empty()
    return True


def mem_available(cgroup_root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup") -> int:
    """The host's available memory in bytes: psutil's (installed with accelerate), else /proc/meminfo's
    MemAvailable (the GPU image runs eyas from source), else 0; no more than this process's memory cgroup may still
    take (`cgroup_room`), since both of those count the whole machine's memory inside a container with a limit of
    its own, where taking more gets the process killed."""
    free = 0
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            pass
    room = cgroup_room(cgroup_root, proc_cgroup)
    return free if room is None else min(free, room) if free else room


def cgroup_room(root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup") -> int | None:
    """Bytes the memory cgroup of this process may still take: its limit less what it holds, where the file pages
    it could drop (inactive_file) count as room; None without a limit or where none can be read. cgroup v2
    (memory.max, memory.current) or v1 (memory.limit_in_bytes, memory.usage_in_bytes), in this process's own group
    (/proc/self/cgroup) or at the mount's root, which is the own group inside most containers."""
    root = Path(root)
    own = {"v2": "", "v1": ""}
    try:
        for line in Path(proc_cgroup).read_text().splitlines():
            _, ctrl, path = line.split(":", 2)
            if ctrl == "":
                own["v2"] = path.strip("/")
            elif "memory" in ctrl.split(","):
                own["v1"] = path.strip("/")
    except (OSError, ValueError):
        pass

    def number(f: Path) -> int | None:
        try:
            text = f.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def stat(f: Path, *keys: str) -> int:
        try:
            rows = dict(line.split()[:2] for line in f.read_text().splitlines() if len(line.split()) >= 2)
        except (OSError, ValueError):
            return 0
        for k in keys:
            if rows.get(k, "").isdigit():
                return int(rows[k])
        return 0

    for base, limit_f, used_f, keys in (
            (root / own["v2"], "memory.max", "memory.current", ("inactive_file",)),
            (root, "memory.max", "memory.current", ("inactive_file",)),
            (root / "memory" / own["v1"], "memory.limit_in_bytes", "memory.usage_in_bytes",
             ("total_inactive_file", "inactive_file")),
            (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file"))):
        if not (base / limit_f).is_file():
            continue
        limit, used = number(base / limit_f), number(base / used_f)
        if limit is None or limit >= 1 << 60 or used is None:  # "max", or v1's page-rounded 2**63 - 1: no limit
            continue
        return max(0, limit - used + stat(base / "memory.stat", *keys))
    return None


def compile_failure(e: BaseException, where: bool = False) -> str:
    """A compiler or graph-capture failure in one line: the exception's type and the first line of its message (at
    most 200 characters), for the logs and states of the compiled and graphed paths that fall back to eager; with
    `where`, also the innermost eyas line it passed through (a graph capture's: the eyas code being captured) and the
    eyas line that called it, as a small helper (FastLM's _norm) hides which call failed."""
    msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    if not where:
        return msg
    lines, tb, package = [], e.__traceback__, str(Path(__file__).parent) + os.sep
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if f.startswith(package):
            lines.append(f"{Path(f).name}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}")
        tb = tb.tb_next
    return f"{msg} (at {', from '.join(lines[:-3:-1])})" if lines else msg


class PhaseClock:
    """Phase timer that never syncs the device while it runs: CUDA events on GPU (read later, by `fold`
    or `totals`), perf_counter on CPU (where work is synchronous anyway). Used by the decoder
    (draft/verify time) and by training (where each step's time goes)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object, object]] = []
        self._sum: dict[str, float] = {}

    def _now(self):
        if self.cuda:
            import torch

            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self):
        return self._now()

    def stop(self, name: str, t0) -> None:
        self.marks.append((name, t0, self._now()))

    def take(self) -> list:
        """The phases timed so far, handed over (to `fold` once their events are done) and forgotten here."""
        marks, self.marks = self.marks, []
        return marks

    def fold(self, marks: list) -> None:
        """Add `marks` (from `take`) into the totals and let their events go; call it where the device has passed
        them (a long run would otherwise hold every step's events)."""
        for name, a, b in marks:
            dt = a.elapsed_time(b) / 1000.0 if self.cuda else b - a
            self._sum[name] = self._sum.get(name, 0.0) + dt

    def totals(self) -> dict[str, float]:
        """Seconds per phase name."""
        self.fold(self.take())
        return dict(self._sum)
