"""How long the tokenize stage's worker pool takes to start: the pool built with the tokenizer pickled into each
worker's start-up arguments (eyas before this script), against the workers loading it from a folder the parent
saved it in (`eyas.data.prepare._init_worker`, now). Times the `Pool(...)` call and until every worker has answered.

    PYTHONPATH=. python3 bench/pool_startup.py --workers 4 --repeat 2

With a pickled tokenizer of a few megabytes, each worker's start waits until the one before has started Python,
imported its modules and read the arguments from the pipe, so the workers start one after another."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _init_pickled(tokenizer, args) -> None:
    """The earlier initializer: the tokenizer arrives pickled in the pool's initargs."""
    from eyas.data import prepare

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    prepare._worker = (tokenizer, *args)


def start(way: str, tok, n: int) -> dict:
    from eyas.data.prepare import _init_worker

    args = (2048, "keep", [])
    d = None
    t0 = time.perf_counter()
    if way == "pickled":
        pool = mp.get_context("spawn").Pool(n, initializer=_init_pickled, initargs=(tok, args))
    else:
        d = tempfile.mkdtemp(prefix="eyas-tokenizer-")
        tok.save_pretrained(d)
        cls = (type(tok).__module__, type(tok).__qualname__)
        pool = mp.get_context("spawn").Pool(n, initializer=_init_worker, initargs=(d, cls, args))
    t1 = time.perf_counter()
    pool.map(abs, range(4 * n), chunksize=1)  # answered once every worker has run its initializer
    t2 = time.perf_counter()
    pool.terminate()
    if d:
        shutil.rmtree(d, ignore_errors=True)
    return {"way": way, "workers": n, "pool_call_s": round(t1 - t0, 2), "all_answering_s": round(t2 - t0, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="worker processes")
    p.add_argument("--repeat", type=int, default=2, help="alternating rounds of both ways")
    a = p.parse_args()
    from eyas.config import TargetConfig
    from eyas.target import load_tokenizer

    tok = load_tokenizer(TargetConfig(name="smollm2"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for _ in range(a.repeat):
        for way in ("pickled", "files"):
            print(json.dumps({**start(way, tok, a.workers), "cores": cores}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
