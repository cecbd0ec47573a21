"""Stage vLLM for a GPU lease that cannot reach the network: its wheel and the dependencies the GPU image lacks,
packed in upload-sized pieces that `bench/gpu_run.sh unpack` (or each piece's unpack.sh) reassembles there.

    python3 bench/stage_vllm.py --out .stage-vllm            # here, once (downloads about 400 MB, keeps ~240)
    bash bench/gpu_run.sh unpack .stage-vllm/00              # there, one call per piece, carry [".stage-vllm/00"]
    bash bench/serve_vllm.sh install                         # there: pip --target /tmp/vllm-site, no network

Which vLLM: the newest release whose torch pin the GPU image meets (torch 2.11.0; vLLM 0.27 and later pin 2.13).
Its dependencies are taken as PyPI held them on the day after that release (`--prior-to`), so a later release of a
dependency cannot break it. Left out, because the image has them (stage_wheels.IMAGE, read off the image) or because
vLLM imports them only for kernels a dense model's EAGLE-3 serving never calls: torch and its CUDA libraries,
transformers (the image's 5.17 imports fine with vLLM 0.26), the kernel packages (flashinfer-cubin, tilelang,
cutlass-dsl, quack, tokenspeed-mla, humming, torchcodec, nvvideocodec, cudnn-frontend, fastsafetensors), and
the optional tracing and tool-server packages (opentelemetry, mcp). The vLLM wheel itself is slimmed: the
FlashAttention-2 kernels (Hopper uses FlashAttention-3; `--attention-backend TRITON_ATTN` is the fallback), the Rust
front end (used only with VLLM_RUST_FRONTEND_PATH) and DeepGEMM builds for other Pythons are dropped.

Needs pip >= 25.1 for `--uploaded-prior-to`: the script makes a throwaway virtualenv with a current pip.
The pieces use the format of ../shared/tools/stage.py (manifest.json, *.piece, unpack.sh), so both kinds of
pieces can go into the same stage folder; bench/stage_wheels.py holds what this script shares with stage_sglang.py.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

from stage_wheels import IMAGE, pack, pip_download, pip_tools, report, requirements, slim, stage_parser

# Kernel, tracing and tool-server packages vLLM imports only on paths a dense model's EAGLE-3 serving does not take.
OPTIONAL = {"flashinfer-cubin", "tilelang", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla",
            "humming-kernels", "torchcodec", "pynvvideocodec", "nvidia-cudnn-frontend", "fastsafetensors", "mcp",
            "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
            "opentelemetry-semantic-conventions-ai", "nvtx"}
# Requirements that depend on torch: fetched without their dependencies, so pip does not fetch a torch build.
NEEDS_TORCH = {"compressed-tensors", "xgrammar", "flashinfer-python", "depyf"}
# Files of the vLLM wheel a Hopper GPU serving a dense model with EAGLE-3 does not need.
SLIM = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")


def drop(name: str) -> bool:
    """Whether the vLLM wheel's file `name` is left out: SLIM's files and DeepGEMM builds for other Pythons."""
    return name in SLIM or ("deep_gemm/_C.cpython-" in name and "cpython-312" not in name)


def main() -> None:
    ap = stage_parser(__doc__, "vLLM", "0.26.0", "2026-07-26T00:00:00Z")
    args = ap.parse_args()

    cache = Path(args.cache) / args.version
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip, tools = pip_tools()

    raw = cache / "raw"
    raw.mkdir(exist_ok=True)
    if not list(raw.glob("vllm-*.whl")):
        pip_download(pip, raw, [f"vllm=={args.version}"], None, deps=False)
    vllm_wheel = next(raw.glob("vllm-*.whl"))
    reqs = requirements(vllm_wheel)
    torch_pin = [str(r.specifier) for r in reqs if canonicalize_name(r.name) == "torch"]
    print(f"{vllm_wheel.name}: {len(reqs)} requirements, torch {torch_pin}")
    keep = [r for r in reqs if canonicalize_name(r.name) not in IMAGE | OPTIONAL]
    with_deps = [str(r).split(";")[0] for r in keep if canonicalize_name(r.name) not in NEEDS_TORCH]
    no_deps = [str(r).split(";")[0] for r in keep if canonicalize_name(r.name) in NEEDS_TORCH]
    pip_download(pip, wheels, with_deps, args.prior_to or None, deps=True)
    pip_download(pip, wheels, no_deps, args.prior_to or None, deps=False)
    files = {}
    for w in sorted(wheels.glob("*.whl")):
        name = canonicalize_name(w.name.split("-")[0])
        if name in IMAGE or name in OPTIONAL or name == "torch":
            continue
        files[f"vllm-wheels/{w.name}"] = w
    slimmed = slim(vllm_wheel, cache, drop)
    files[f"vllm-wheels/{slimmed.name}"] = slimmed
    shutil.rmtree(tools, ignore_errors=True)
    sizes = pack(files, Path(args.out), args.chunk_mib)
    report(files, sizes, args.out)


if __name__ == "__main__":
    sys.exit(main())
