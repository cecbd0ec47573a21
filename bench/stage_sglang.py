"""Stage SGLang for a GPU lease that cannot reach the network: its wheel and the dependencies the GPU image lacks,
packed in upload-sized pieces that `bench/gpu_run.sh unpack` (or each piece's unpack.sh) reassembles there.

    python3 bench/stage_sglang.py --out .stage-sglang --chunk-mib 61   # here, once (3 pieces, 139 MiB)
    bash bench/gpu_run.sh unpack .stage-sglang/00                      # there, one call per piece,
                                                                       #   carry [".stage-sglang/00"]
    bash bench/serve_sglang.sh install                                 # there: pip --target, no network

Which SGLang: the newest release whose torch pin the GPU image meets (torch 2.11.0: SGLang 0.5.17; 0.5.18 to 0.5.21
pin torch 2.13.0, 0.5.22 and 0.5.23 pin 2.14.1). It pins transformers 5.12.1, which goes to sglang-transformers/,
installed in a folder of its own that only the SGLang server puts in front of the image's packages (eyas keeps the
image's 5.17), together with the tokenizers it needs (5.12.1 refuses the image's tokenizers 0.23.2 at import).

Dependencies are taken as PyPI held them on the day after the release (`--prior-to`), so a later release of a
dependency cannot break it, and are fetched one level at a time without pip's resolver, so that the image's packages
(torch, which sglang-kernel, flashinfer and xgrammar require, with its CUDA libraries) are never downloaded. Left out,
besides the image's packages, because SGLang imports them only on paths a dense model's EAGLE-3 serving on Hopper does
not take: the CuTe-DSL kernel stack (nvidia-cutlass-dsl, flash-attn-4, quack, humming, cuda-tile), tilelang,
tokenspeed-mla (MLA models), helion and nvidia-mathdx, flashinfer's prebuilt cubins and its cuDNN and NCCL bindings
(flashinfer imports without them), the grammar back ends other than the default xgrammar (outlines, llguidance),
modelscope (SGLANG_USE_MODELSCOPE only), torchcodec (video input) and mistral-common (Mistral's tekken tokenizer files
and Voxtral's audio). DeepGEMM (sgl-deep-gemm, 5 MB) is staged although a dense bf16 model never calls it: the EAGLE
worker's CUDA-graph capture imports DeepSeek's sparse-attention backend, which imports deep_gemm unguarded on CUDA, so
without it a drafter's server stops after loading (plain serving does not). jsonschema is staged although SGLang's
metadata asks for it only through the grammar back ends left out: its OpenAI chat endpoint imports it.

Slimmed: sglang-kernel keeps its Hopper build (sm90/) and drops the Blackwell one (sm100/), FlashMLA and InfLLM; its
FlashAttention-3 kernels (flash_ops, about 330 MiB of the 365) are dropped too unless --fa3 is given, and then
bench/serve_sglang.sh serves with `--attention-backend triton` (SGLang's own Triton kernels) instead of FA3, SGLang's
default on Hopper. The sglang wheel drops its Rust extensions (the SGLANG_RUST_SERVER front end, the native gRPC
server and a multimodal preprocessor).

Needs pip >= 25.1 for `--uploaded-prior-to`: the script makes a throwaway virtualenv with a current pip.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stage_wheels import (IMAGE, closure, describe, image_conflicts, pack, pip_download, pip_tools, report,
                          requirements, slim, stage_parser)

# Packages SGLang imports only on paths a dense model's EAGLE-3 serving on Hopper does not take (see above).
OPTIONAL = {"nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13", "flash-attn-4",
            "quack-kernels", "humming-kernels", "cuda-tile", "tilelang", "tokenspeed-mla", "helion",
            "nvidia-mathdx", "flashinfer-cubin", "flashinfer-jit-cache", "nvidia-cudnn-frontend", "nccl4py",
            "outlines", "llguidance", "modelscope", "torchcodec", "fastsafetensors", "mistral-common"}
# Imported at module level on the server's path (sglang/srt/entrypoints/openai/serving_chat.py imports jsonschema)
# but required only through packages left out above (outlines, llguidance), so asked for here.
UNDECLARED = ("jsonschema",)
# The package whose pinned version goes to a folder of its own, and that folder in the stage.
OWN_FOLDER = "transformers"
KERNEL_DROP = ("sgl_kernel/sm100/", "sgl_kernel/flashmla_ops.", "sgl_kernel/infllm_ops.")
FA3 = "sgl_kernel/flash_ops."
SGLANG_DROP = ("sglang/srt/server/_core.", "sglang/srt/grpc/_core.", "sglang/srt/multimodal/_core.")


def kernel_drop(fa3: bool):
    """Which files of the sglang-kernel wheel are left out: other GPUs' and other models' kernels, and FA3 unless
    it is kept."""
    drops = KERNEL_DROP if fa3 else (*KERNEL_DROP, FA3)
    return lambda name: name.startswith(drops)


def sglang_drop(name: str) -> bool:
    return name.startswith(SGLANG_DROP)


def main() -> None:
    ap = stage_parser(__doc__, "SGLang", "0.5.17", "2026-08-09T00:00:00Z")
    ap.add_argument("--fa3", action="store_true", help="keep sglang-kernel's FlashAttention-3 kernels (about 330 "
                    "MiB more, six more pieces) so that SGLang serves with its Hopper default instead of Triton")
    args = ap.parse_args()

    cache = Path(args.cache) / args.version
    raw, deps, own = cache / "raw", cache / "wheels", cache / OWN_FOLDER
    for d in (raw, deps, own):
        d.mkdir(parents=True, exist_ok=True)
    prior_to = args.prior_to or None
    pip, tools = pip_tools()

    if not list(raw.glob("sglang-*.whl")):
        pip_download(pip, raw, [f"sglang=={args.version}"], None, deps=False)
    sglang_wheel = next(raw.glob("sglang-*.whl"))
    reqs = requirements(sglang_wheel)
    pins = {canonicalize_name(r.name): str(r.specifier) for r in reqs
            if canonicalize_name(r.name) in ("torch", OWN_FOLDER, "sglang-kernel", "flashinfer-python")}
    print(f"{sglang_wheel.name}: {len(reqs)} requirements; pins {pins}")
    got, on_image = closure(pip, deps, reqs + [Requirement(r) for r in UNDECLARED], IMAGE | OPTIONAL, prior_to)

    # transformers at SGLang's pin, with the packages of the image whose version it refuses
    own_req = next(r for r in reqs if canonicalize_name(r.name) == OWN_FOLDER)
    pip_download(pip, own, [str(own_req).split(";")[0]], prior_to, deps=False)
    refused = image_conflicts(requirements(next(own.glob(f"{OWN_FOLDER}-*.whl"))))
    beside = {canonicalize_name(r.name) for r in refused}
    got_own, _ = closure(pip, own, [own_req], (IMAGE - beside - {OWN_FOLDER}) | OPTIONAL, prior_to)
    print(f"{OWN_FOLDER} for SGLang: {', '.join(w.name for w in got_own.values())}"
          + (f" (beside it because it requires {'; '.join(map(describe, refused))})" if refused else ""))

    files = {}
    for name, w in got.items():
        if name == "sglang-kernel":
            w = slim(w, cache, kernel_drop(args.fa3))
        files[f"sglang-wheels/{w.name}"] = w
    slimmed = slim(sglang_wheel, cache, sglang_drop)
    files[f"sglang-wheels/{slimmed.name}"] = slimmed
    for w in got_own.values():
        files[f"sglang-{OWN_FOLDER}/{w.name}"] = w
    shutil.rmtree(tools, ignore_errors=True)
    sizes = pack(files, Path(args.out), args.chunk_mib)
    report(files, sizes, args.out)
    unmet = sorted({f"{by} requires {describe(r)}" for by, r in on_image for r in image_conflicts([r])
                    if canonicalize_name(r.name) not in beside | {OWN_FOLDER}})
    if unmet:
        print("requirements the image's known versions do not meet (check they import): " + "; ".join(unmet))


if __name__ == "__main__":
    sys.exit(main())
