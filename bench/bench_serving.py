"""Output tokens/s of an OpenAI-compatible server (vLLM, SGLang) on the eval's prompts, at several concurrencies.

    python3 bench/bench_serving.py --endpoint http://127.0.0.1:8000 --prompts sharegpt --limit 80 \\
        --concurrency 1,8 --max-tokens 256 --label eagle3-k3 --out results.json

Each prompt is a conversation's first user turn (the prompts `eyas parity` sends), answered greedily through
/v1/chat/completions with at most --max-tokens new tokens. At concurrency c, c threads take prompts in turn; the
figure is the completion tokens the server reported over the wall time of the whole set (first request sent to
last answer). Run it once against the server with the drafter and once without it, on the same machine and the
same prompts: the ratio is the engine's speedup. Standard-library HTTP; eyas only reads the prompts.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eyas.config import DataConfig  # noqa: E402
from eyas import parity  # noqa: E402
from eyas.data import read_dataset, select_split  # noqa: E402


def first_turns(name: str, limit: int) -> list[list[dict]]:
    """The first user turn (with the system turns before it) of each conversation in the prompt set: ShareGPT's
    held-out test split (as bench_decode.py and `eyas eval` take it), humaneval, or a file."""
    if name == "sharegpt":
        convs = select_split(read_dataset("sharegpt")[0], "test", DataConfig().val_ratio, DataConfig().test_ratio)
    else:
        convs, _ = read_dataset(name)
    return parity.first_turns(convs)[:limit]


def post(url: str, payload: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def served_model(endpoint: str) -> str:
    with urllib.request.urlopen(endpoint + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_level(endpoint: str, model: str, prompts: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    lock = threading.Lock()
    todo = list(enumerate(prompts))
    done: list[dict] = []
    errors: list[str] = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, msgs = todo.pop(0)
            t = time.perf_counter()
            try:
                r = post(endpoint + "/v1/chat/completions",
                         {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0.0})
            except Exception as e:  # noqa: BLE001 - counted and reported, the others go on
                with lock:
                    errors.append(f"prompt {i}: {e}")
                continue
            n = int((r.get("usage") or {}).get("completion_tokens") or 0)
            with lock:
                done.append({"prompt": i, "tokens": n, "seconds": time.perf_counter() - t})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    tokens = sum(d["tokens"] for d in done)
    return {"concurrency": concurrency, "prompts": len(done), "errors": errors[:5], "error_count": len(errors),
            "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
            "per_request_tokens_per_s": round(sum(d["tokens"] for d in done) / max(sum(d["seconds"] for d in done),
                                                                                  1e-9), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default="http://127.0.0.1:8000", help="the server's base URL "
                    "(default http://127.0.0.1:8000)")
    ap.add_argument("--prompts", default="sharegpt", help="sharegpt (the held-out test split eyas evaluates on), "
                    "humaneval, or a data file eyas reads (default sharegpt)")
    ap.add_argument("--limit", type=int, default=80, help="prompts to send (default 80)")
    ap.add_argument("--concurrency", default="1,8", help="comma list of concurrent requests (default 1,8)")
    ap.add_argument("--max-tokens", type=int, default=256, help="new tokens per answer at most (default 256)")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted (default 2)")
    ap.add_argument("--label", default="", help="a name for this server setting, copied into the output")
    ap.add_argument("--out", default=None, help="write the results as JSON here (default: print only)")
    a = ap.parse_args(argv)
    prompts = first_turns(a.prompts, a.limit)
    if not prompts:
        print(f"bench_serving: {a.prompts} gave no prompts", file=sys.stderr)
        return 2
    model = served_model(a.endpoint)
    for msgs in prompts[:a.warmup]:
        post(a.endpoint + "/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 16,
                                                    "temperature": 0.0})
    levels = [run_level(a.endpoint, model, prompts, int(c), a.max_tokens) for c in a.concurrency.split(",")]
    res = {"label": a.label, "endpoint": a.endpoint, "model": model, "prompt_set": a.prompts,
           "max_tokens": a.max_tokens, "levels": levels}
    for lv in levels:
        print(f"{a.label or model}: concurrency {lv['concurrency']}: {lv['tokens_per_s']} tok/s "
              f"({lv['prompts']} prompts, {lv['completion_tokens']} tokens, {lv['wall_s']} s, "
              f"{lv['error_count']} errors)")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0 if all(lv["error_count"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
