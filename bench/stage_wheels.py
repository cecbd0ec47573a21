"""What bench/stage_vllm.py and bench/stage_sglang.py share: the GPU image's packages, pip downloads for its Python
and platform, a wheel's requirements, slimming a wheel, the closure of a package's requirements the image lacks, and
packing files into upload-sized pieces (the format of ../shared/tools/stage.py: manifest.json, *.piece, unpack.sh).
"""
from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import venv
import zipfile
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

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
# The versions KINDS.md's pip list gives for some of them (the others are not known here).
IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
                  "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0"}
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
               "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (39, 35, 34, 31, 28, 27, 26, 24, 17, 5)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]
UNPACK = Path(__file__).with_name("stage_unpack.sh")


def stage_parser(doc: str, engine: str, version: str, prior_to: str) -> argparse.ArgumentParser:
    """The options every engine's stager takes: the release (default `version`, the newest whose torch pin the GPU
    image meets), the PyPI date its dependencies are taken as of (default `prior_to`, the day after that release),
    the pieces' folder and size, and the download cache; the stager adds its own."""
    key = engine.lower()
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=version, help=f"the {engine} release (default {version}, the newest that "
                    f"pins torch 2.11.0)")
    ap.add_argument("--prior-to", default=prior_to, help="take dependencies as PyPI held them before this time (ISO "
                    f"8601; default: the day after {engine} {version}'s release; '' for today)")
    ap.add_argument("--out", default=f".stage-{key}", help=f"folder of the pieces (default .stage-{key}, which "
                    ".gitignore lists)")
    ap.add_argument("--chunk-mib", type=int, default=60, help="largest piece in MiB (default 60: one upload "
                    "carries 64 MiB with the working tree)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / f"eyas-stage-{key}"),
                    help=f"download cache (default ~/.cache/eyas-stage-{key})")
    return ap


def pip_tools() -> tuple[list[str], Path]:
    """A throwaway virtualenv with a current pip (>= 25.1 has --uploaded-prior-to): its pip command and its folder."""
    tools = Path(tempfile.mkdtemp(prefix="stage-pip-"))
    venv.create(tools, with_pip=True)
    pip = [str(tools / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "-U", "pip>=25.1"], check=True, env=pypi_only())
    return pip, tools


def pypi_only() -> dict[str, str]:
    """The environment for pip with PyPI alone: local indexes and wheel folders carry no upload dates."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    env.pop("PIP_FIND_LINKS", None)
    return env


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
    if subprocess.run(cmd + reqs, env=pypi_only()).returncode:
        raise SystemExit(f"pip could not fetch {' '.join(reqs)} (its message is above)")


def requirements(wheel: Path, extras: set[str] | frozenset[str] = frozenset()) -> list[Requirement]:
    """The wheel's requirements that hold on the GPU image's Python, with the named extras asked for."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    wanted = ("", *sorted(extras))
    return [r for r in reqs if r.marker is None or any(r.marker.evaluate({**ENVIRONMENT, "extra": e}) for e in wanted)]


def image_conflicts(reqs: list[Requirement]) -> list[Requirement]:
    """The requirements on image packages whose version, where KINDS.md gives it, does not meet them."""
    return [r for r in reqs if (have := IMAGE_VERSIONS.get(canonicalize_name(r.name))) and r.specifier
            and not r.specifier.contains(have, prereleases=True)]


def describe(r: Requirement) -> str:
    return f"{str(r).split(';')[0]} (the image has {IMAGE_VERSIONS[canonicalize_name(r.name)]})"


def closure(pip: list[str], dest: Path, roots: list[Requirement], skip: set[str], prior_to: str | None):
    """Every wheel `roots` need that is not in `skip`, fetched one level at a time with --no-deps, so a requirement
    of a skipped package (torch, which the image holds) is never fetched. Returns {name: wheel} and the skipped
    requirements as (requiring package, requirement); a version that does not meet every requirement seen on it
    stops the staging with the conflict named."""
    seen: dict[str, list[Requirement]] = {}
    skipped: list[tuple[str, Requirement]] = []
    wheels: dict[str, Path] = {}
    walked: dict[str, set[str]] = {}
    todo = [("(roots)", r) for r in roots]
    while todo:
        fetch: dict[str, list[Requirement]] = {}
        for by, r in todo:
            n = canonicalize_name(r.name)
            if n in skip:
                skipped.append((by, r))
                continue
            seen.setdefault(n, []).append(r)
            if n not in wheels:
                fetch.setdefault(n, []).append(r)
        pip_download(pip, dest, [f"{n}{combined(rs)}" for n, rs in sorted(fetch.items())], prior_to, deps=False)
        for n, rs in fetch.items():
            wheels[n] = best_wheel(dest, n, SpecifierSet(combined(rs)))
        todo = []
        for n, w in wheels.items():
            extras = {e for r in seen[n] for e in r.extras}
            if n not in walked or not extras <= walked[n]:
                todo += [(n, r) for r in requirements(w, extras)]
                walked[n] = walked.get(n, set()) | extras
    bad = [f"{n} {parse_wheel_filename(w.name)[1]} does not meet {r}" for n, w in wheels.items() for r in seen[n]
           if not r.specifier.contains(parse_wheel_filename(w.name)[1], prereleases=True)]
    if bad:
        raise SystemExit("conflicting requirements: " + "; ".join(bad))
    return wheels, skipped


def combined(reqs: list[Requirement]) -> str:
    return ",".join(sorted({str(s) for r in reqs for s in r.specifier}))


def best_wheel(dest: Path, name: str, spec: SpecifierSet) -> Path:
    """The newest wheel of `name` in dest that meets spec (pip has just put it there)."""
    found = []
    for w in dest.glob("*.whl"):
        n, v, _, _ = parse_wheel_filename(w.name)
        if n == name and spec.contains(v, prereleases=True):
            found.append((v, w.name, w))
    if not found:
        raise SystemExit(f"pip fetched no wheel of {name}{spec} into {dest}")
    return max(found)[2]


def slim(wheel: Path, out: Path, drop: Callable[[str], bool]) -> Path:
    """A copy of the wheel without the files `drop` names, RECORD rewritten to match."""
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


def report(files: dict[str, Path], sizes: list[int], out: str) -> None:
    """The pieces and the largest files, with the device call that sends each piece."""
    print(f"{len(sizes)} piece folder(s) under {out}/ ({sum(sizes) / 2**20:.0f} MiB), {len(files)} files; largest:")
    for name, path in sorted(files.items(), key=lambda kv: -kv[1].stat().st_size)[:8]:
        print(f"  {path.stat().st_size / 2**20:6.1f} MiB  {name}")
    for i, s in enumerate(sizes):
        print(f"  {out}/{i:02d}  {s / 2**20:5.1f} MiB   carry [\"{out}/{i:02d}\"], run: "
              f"bash bench/gpu_run.sh unpack {out}/{i:02d}")
