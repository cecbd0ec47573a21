"""Stage vLLM for a GPU lease that cannot reach the network: its wheel and the dependencies the GPU image lacks,
packed in upload-sized pieces that `bench/gpu_run.sh unpack` (or each piece's unpack.sh) reassembles there.

    python3 bench/stage_vllm.py --out .stage-vllm            # here, once (downloads about 400 MB, keeps ~240)
    bash bench/gpu_run.sh unpack .stage-vllm/00              # there, one call per piece, carry [".stage-vllm/00"]
    bash bench/serve_vllm.sh install                         # there: pip --target /tmp/vllm-site, no network

Which vLLM: the newest release whose torch pin the GPU image meets (torch 2.11.0; vLLM 0.27 and later pin 2.13).
Its dependencies are taken as PyPI held them on the day after that release (`--prior-to`), so a later release of a
dependency cannot break it. Left out, because the image has them (the list below, read off the image) or because
vLLM imports them only for kernels a dense model's EAGLE-3 serving never calls: torch and its CUDA libraries,
transformers (the image's 5.17 imports fine with vLLM 0.26), the kernel packages (flashinfer-cubin, tilelang,
cutlass-dsl, quack, tokenspeed-mla, humming, torchcodec, nvvideocodec, cudnn-frontend, fastsafetensors), and
the optional tracing and tool-server packages (opentelemetry, mcp). The vLLM wheel itself is slimmed: the
FlashAttention-2 kernels (Hopper uses FlashAttention-3; `--attention-backend TRITON_ATTN` is the fallback), the Rust
front end (used only with VLLM_RUST_FRONTEND_PATH) and DeepGEMM builds for other Pythons are dropped.

Needs pip >= 25.1 for `--uploaded-prior-to`: the script makes a throwaway virtualenv with a current pip.
The pieces use the format of ../shared/tools/stage.py (manifest.json, *.piece, unpack.sh), so both kinds of
pieces can go into the same stage folder.
"""
from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The GPU image's Python packages (python3.12, torch 2.11.0 CUDA 13, transformers 5.17.0), as the device tool's
# KINDS.md lists them.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp""".split())
# Kernel, tracing and tool-server packages vLLM imports only on paths a dense model's EAGLE-3 serving does not take.
OPTIONAL = {"flashinfer-cubin", "tilelang", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla",
            "humming-kernels", "torchcodec", "pynvvideocodec", "nvidia-cudnn-frontend", "fastsafetensors", "mcp",
            "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
            "opentelemetry-semantic-conventions-ai", "nvtx"}
# Requirements that depend on torch: fetched without their dependencies, so pip does not fetch a torch build.
NEEDS_TORCH = {"compressed-tensors", "xgrammar", "flashinfer-python", "depyf"}
# Files of the vLLM wheel a Hopper GPU serving a dense model with EAGLE-3 does not need.
SLIM = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
               "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (39, 35, 34, 31, 28, 27, 26, 24, 17, 5)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]
UNPACK = Path(__file__).with_name("stage_unpack.sh")


def pip_download(pip: list[str], dest: Path, reqs: list[str], prior_to: str | None, deps: bool) -> None:
    if not reqs:
        return
    cmd = [*pip, "download", "-q", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if prior_to:
        cmd += ["--uploaded-prior-to", prior_to]
    if not deps:
        cmd.append("--no-deps")
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # PyPI alone: local indexes carry no upload dates
    env.pop("PIP_FIND_LINKS", None)
    subprocess.run(cmd + reqs, check=True, env=env)


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENVIRONMENT)]


def slim(wheel: Path, out: Path) -> Path:
    """A copy of the wheel without SLIM's files (and DeepGEMM builds for other Pythons), RECORD rewritten."""
    drop = lambda n: n in SLIM or ("deep_gemm/_C.cpython-" in n and "cpython-312" not in n)  # noqa: E731
    dst = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as w:
        for info in src.infolist():
            if drop(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if not drop(ln.split(",")[0])]
                data = ("\n".join(lines) + "\n").encode()
            w.writestr(info, data, compress_type=info.compress_type)
    return dst


def pack(files: dict[str, Path], out: Path, chunk_mib: int) -> list[int]:
    """Pieces of at most chunk_mib MiB in out/00, out/01, ... with stage.py's manifest format."""
    shutil.rmtree(out, ignore_errors=True)
    limit = chunk_mib << 20
    chunks: list[list[tuple[str, Path, int, int]]] = [[]]
    sizes = [0]
    manifest = {}
    for name, path in sorted(files.items(), key=lambda kv: kv[1].stat().st_size):
        size = path.stat().st_size
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        manifest[name] = {"size": size, "sha256": h.hexdigest(), "pieces": []}
        offset = 0
        while offset < size or not manifest[name]["pieces"]:
            if sizes[-1] >= limit:
                chunks.append([])
                sizes.append(0)
            take = min(limit - sizes[-1], size - offset)
            piece = f"{name.replace('/', '__')}.{len(manifest[name]['pieces']):03d}.piece"
            manifest[name]["pieces"].append(piece)
            chunks[-1].append((piece, path, offset, take))
            sizes[-1] += take
            offset += take
    for i, chunk in enumerate(chunks):
        d = out / f"{i:02d}"
        d.mkdir(parents=True)
        for piece, path, offset, take in chunk:
            with open(path, "rb") as f:
                f.seek(offset)
                (d / piece).write_bytes(f.read(take))
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
        shutil.copy(UNPACK, d / "unpack.sh")
        os.chmod(d / "unpack.sh", 0o755)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.26.0", help="the vLLM release (default 0.26.0, the newest that pins "
                    "torch 2.11.0)")
    ap.add_argument("--prior-to", default="2026-07-26T00:00:00Z", help="take dependencies as PyPI held them "
                    "before this time (ISO 8601; default: the day after vLLM 0.26.0's release; '' for today)")
    ap.add_argument("--out", default=".stage-vllm", help="folder of the pieces (default .stage-vllm; add it to "
                    ".git/info/exclude)")
    ap.add_argument("--chunk-mib", type=int, default=60, help="largest piece in MiB (default 60: one upload "
                    "carries 64 MiB with the working tree)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "eyas-stage-vllm"),
                    help="download cache (default ~/.cache/eyas-stage-vllm)")
    args = ap.parse_args()

    cache = Path(args.cache) / args.version
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    tools = Path(tempfile.mkdtemp(prefix="stage-vllm-pip-"))
    venv.create(tools, with_pip=True)
    pip = [str(tools / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "-U", "pip>=25.1"], check=True)

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
    slimmed = slim(vllm_wheel, cache)
    files[f"vllm-wheels/{slimmed.name}"] = slimmed
    shutil.rmtree(tools, ignore_errors=True)
    sizes = pack(files, Path(args.out), args.chunk_mib)
    print(f"{len(sizes)} piece folder(s) under {args.out}/ ({sum(sizes) / 2**20:.0f} MiB), {len(files)} wheels")
    for i, s in enumerate(sizes):
        print(f"  {args.out}/{i:02d}  {s / 2**20:5.1f} MiB   carry [\"{args.out}/{i:02d}\"], run: "
              f"bash bench/gpu_run.sh unpack {args.out}/{i:02d}")


if __name__ == "__main__":
    sys.exit(main())
