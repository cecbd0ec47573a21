"""Features from a live vLLM against eyas' own extraction, on the same conversations, in one run (GPU machine).

    PYTHONPATH=. python3 bench/vllm_features.py --target /models/q8b --limit 400 --tp 1 --out vllm_features.json
    PYTHONPATH=. python3 bench/vllm_features.py --compare RUN_A RUN_B     # the comparison alone (any machine)

Tokenizes --limit ShareGPT conversations for the target into <work>/inproc, extracts them in this process (`eyas
extract`, the reference, timed), starts `vllm serve TARGET` with the speculative method extract_hidden_states and the
ExampleHiddenStatesConnector writing to --storage (the layer ids eyas needs: its aux layers and the last), waits for
it, reads the same sequences through it into <work>/vllm (`eyas extract --from-vllm URL`, timed) and compares the two
runs' features: the largest relative error per token of aux and final, and how often their `top` ids agree (in bf16
the engine's kernels round differently from transformers', so expect small differences, not equality). Then it stops
the server. The timings include loading what each holds (the whole target here; the head for the engine's
run, whose server starts before its clock). vLLM must be importable by --vllm-python (a separate environment is fine: only the server runs there).
The result JSON holds both tok/s, the comparison and the server's command line; the server's log is
<work>/vllm_server.log.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from eyas.config import preset
from eyas.data.prepare import run_tokenize
from eyas.engine_features import engine_layer_ids
from eyas.features import OfflineFeatures, run_extract
from eyas.target_spec import load_spec
from eyas.util import atomic_write_json


def compare(a: Path, b: Path) -> dict:
    """Run b's features against run a's, split by split."""
    out = {}
    for split in ("train", "val"):
        fa, fb = OfflineFeatures(a, split, dtype=torch.float32), OfflineFeatures(b, split, dtype=torch.float32)
        if len(fa) != len(fb):
            raise SystemExit(f"{split}: {len(fa)} sequences in {a}, {len(fb)} in {b}")
        worst = {"aux": 0.0, "final": 0.0}
        agree = total = 0
        for i in range(len(fa)):
            x, y = fa.get([i])[0], fb.get([i])[0]
            if not torch.equal(x.input_ids, y.input_ids):
                raise SystemExit(f"{split}: sequence {i} has other tokens in {b}")
            for k in worst:
                u, v = getattr(x, k), getattr(y, k)
                rel = ((v - u).norm(dim=-1) / u.norm(dim=-1).clamp_min(1e-6)).max()
                worst[k] = max(worst[k], float(rel))
            if x.top is not None and y.top is not None:
                agree += int((x.top == y.top).sum())
                total += x.top.numel()
        out[split] = {"sequences": len(fa), "max_rel_error_aux": worst["aux"], "max_rel_error_final": worst["final"],
                      "top_agreement": agree / total if total else None}
    return out


def wait_up(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode} before serving (see its log)")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"vLLM did not answer {url}/v1/models within {timeout:.0f} s")


def serve_command(args, spec, max_tokens: int) -> list[str]:
    spec_cfg = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(spec)}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(args.storage)}}
    return [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", args.target, "--port", str(args.port),
            "--tensor-parallel-size", str(args.tp), "--max-model-len", str(max_tokens),
            "--max-num-batched-tokens", str(max(max_tokens, 8192)), "--no-enable-prefix-caching",
            "--gpu-memory-utilization", str(args.gpu_memory), "--speculative-config", json.dumps(spec_cfg),
            "--kv-transfer-config", json.dumps(kv)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="the target: an HF folder vLLM can serve (required unless --compare)")
    ap.add_argument("--limit", type=int, default=400, help="ShareGPT conversations to tokenize (default 400)")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="tokens per conversation at most (default 2048)")
    ap.add_argument("--tp", type=int, default=1, help="vLLM's --tensor-parallel-size (default 1)")
    ap.add_argument("--port", type=int, default=8123, help="port for vLLM on 127.0.0.1 (default 8123)")
    ap.add_argument("--storage", type=Path, default=Path("/dev/shm/eyas-hs"),
                    help="the connector's shared_storage_path (default /dev/shm/eyas-hs)")
    ap.add_argument("--gpu-memory", type=float, default=0.6,
                    help="vLLM's --gpu-memory-utilization, leaving room for eyas' head on the same GPU (default 0.6)")
    ap.add_argument("--vllm-python", default=sys.executable, help="the python that has vLLM (default: this one)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/eyas-vllm-features"), help="where the two runs go")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for vLLM to serve (default 900)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"),
                    help="only compare run B's features against run A's")
    ap.add_argument("--out", type=Path, help="result JSON")
    args = ap.parse_args()
    if args.compare:
        res = compare(*args.compare)
        print(json.dumps(res, indent=1))
        if args.out:
            atomic_write_json(args.out, res)
        return
    if not args.target:
        ap.error("--target is required")
    shutil.rmtree(args.work, ignore_errors=True)
    cfg = preset("smollm2")
    cfg.target.name, cfg.data.limit, cfg.data.max_seq_len = args.target, args.limit, args.max_seq_len
    cfg.out = str(args.work / "inproc")
    spec = load_spec(cfg.target)
    run_tokenize(cfg, spec)  # outside the timings, which include loading the target (or its head)
    t0 = time.perf_counter()
    ref = run_extract(cfg)
    t_ref = time.perf_counter() - t0
    gc.collect()
    torch.cuda.empty_cache()
    args.storage.mkdir(parents=True, exist_ok=True)
    cmd = serve_command(args, spec, args.max_seq_len + 16)
    log = open(args.work / "vllm_server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_up(url, proc, args.timeout)
        shutil.copytree(args.work / "inproc" / "data", args.work / "vllm" / "data")
        cfg.out, cfg.features.from_vllm = str(args.work / "vllm"), url
        t0 = time.perf_counter()
        eng = run_extract(cfg)
        t_eng = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    tokens = sum(s["tokens"] for s in ref["splits"])
    res = {"target": args.target, "tokens": tokens, "inproc_tok_s": round(tokens / t_ref, 1),
           "vllm_tok_s": round(tokens / t_eng, 1), "inproc": ref, "vllm": eng,
           "compare": compare(args.work / "inproc", args.work / "vllm"), "vllm_command": cmd,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(json.dumps({k: v for k, v in res.items() if k not in ("inproc", "vllm")}, indent=1))
    if args.out:
        atomic_write_json(args.out, res)


if __name__ == "__main__":
    main()
