"""Feature shards from a serving engine that already runs the target: vLLM's hidden-state extraction.

vLLM (0.23 and 0.26 read; speculators 0.9.0 drives the same path) serves a target with the speculative method
`extract_hidden_states` and the `ExampleHiddenStatesConnector`. For each request it writes one safetensors file:
    hidden_states [T, L, H] in the model's dtype: the residual streams of the configured layer ids
                  (`eagle_aux_hidden_state_layer_ids`) stacked in ascending layer order; id k < N is the stream
                  entering decoder layer k (transformers' hidden_states[k]), id N the last layer's output before
                  the final norm;
    token_ids     [T] int64: the prompt's tokens.
hs_connectors' FP8 connector writes hidden_states as float8_e4m3fn with hidden_states_scales [T, 1, 1] float32
(one scale per token). eyas asks for its aux layers plus N (speculators' launch_vllm.py default), so L = 4 (3 where
N is an aux layer itself, a target of 2-3 layers); it picks them in its aux order.

Turned into eyas' features: aux = the L-1 aux states concatenated, final = the target's own final norm of the last
one, top = argmax lm_head(final). The norm and lm_head come from the target's weight files by name (the head alone,
eyas.target_head): no decoder layer is loaded here. The shards, index and manifest are those `eyas extract` writes
(same plan, same layout), so training reads them as it reads its own; the manifest's plan adds
`source: {"engine": "vllm"}`, so an in-process extraction will not mix its shards with these.

Two ways in: a folder of files the engine already wrote (matched to eyas' sequences by their token ids, whatever
the files are called: `<request id>.safetensors` as vLLM names them, `hs_<i>.safetensors` as speculators renames
them), or the server's URL: eyas sends each of its tokenized sequences to /v1/completions (max_tokens 1), reads
the file the answer names (`kv_transfer_params.hidden_states_path`; the server's storage must be visible here) and
deletes it. EngineOnlineFeatures does the same for training with online features (train.online): OnlineFeatures with
the engine in place of the target's forward.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException
from pathlib import Path

import torch

from .config import Config
from .features.extract import PLAN_DEFAULTS, _check_manifest, plan_shards, tokens_sha256
from .features.online import OnlineFeatures, plan_batches, target_top
from .features.shards import (FORMAT, MAX_SHARD_BYTES, STORE_DTYPES, _entry, _merge_index, _shard_matches, _shard_meta,
                              _shard_name, _token_tensors, bytes_per_token, features_dir, quantize_fp8,
                              write_safetensors)
from .util import EyasError, atomic_write_json, log, progress, read_json, sha256_file, sha256_json

ENGINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
LOCK_TIMEOUT_S = 60.0  # how long a file whose writer still holds its .lock is waited for
APPEAR_TIMEOUT_S = 10.0  # how long a file the server named may take to appear
RETRIES = 3  # further tries of a request the server could not take (429, 5xx) or did not answer


def engine_layer_ids(spec) -> list[int]:
    """The layer ids the engine must capture for eyas, ascending (the order the engine stacks them in), each once: the
    aux layers and the last layer (before the norm), which a target of few layers may have among its aux layers."""
    return sorted(set(spec.aux_layers) | {spec.num_layers})


def eyas_order(spec) -> list[int]:
    """Where each state eyas wants lies among the engine's stacked layers (engine_layer_ids): the aux layers in
    the target's aux order, then the last layer's."""
    ids = engine_layer_ids(spec)
    return [ids.index(a) for a in spec.aux_layers] + [ids.index(spec.num_layers)]


def _launch_hint(spec) -> str:
    ids = engine_layer_ids(spec)
    return (f"start vLLM with --speculative-config '{{\"method\": \"extract_hidden_states\", \"num_speculative_tokens\": "
            f"1, \"draft_model_config\": {{\"hf_config\": {{\"eagle_aux_hidden_state_layer_ids\": {ids}}}}}}}' "
            f"(docs/features.md: engines)")


def tokens_key(ids: torch.Tensor) -> str:
    """What matches an engine file to an eyas sequence: the sha256 of its token ids as int64."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def wait_unlocked(path: Path, timeout: float = LOCK_TIMEOUT_S) -> None:
    """vLLM's connector holds an exclusive flock on `<file>.lock` until the file is written: wait for it."""
    lock = Path(str(path) + ".lock")
    if not lock.exists():
        return
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:  # removed meanwhile: the writer is done
        return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EyasError(f"{lock}: the engine still holds this lock after {timeout:.0f} s, so {path.name} "
                                    f"is not written yet") from None
                time.sleep(0.05)
    finally:
        os.close(fd)


def read_vllm_states(path: Path, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """One file of vLLM's hidden-state connector -> (token_ids int64 [T], states [T, 4, H]: the aux layers' in the
    target's aux order, then the last layer's), checked against the target: the file stacks engine_layer_ids, H is
    its hidden size, the values finite."""
    from safetensors import SafetensorError, safe_open

    wait_unlocked(path)
    try:
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            missing = {"hidden_states", "token_ids"} - names
            if missing:
                raise EyasError(f"{path}: no tensor {sorted(missing)} (it has {sorted(names)}); vLLM's hidden-state "
                                f"connector writes hidden_states [T, layers, H] and token_ids [T]")
            hs = f.get_tensor("hidden_states")
            ids = f.get_tensor("token_ids")
            scales = f.get_tensor("hidden_states_scales") if "hidden_states_scales" in names else None
    except (SafetensorError, OSError) as e:
        raise EyasError(f"{path}: not a readable safetensors file ({e})") from None
    layers = engine_layer_ids(spec)
    want = [len(layers), spec.hidden_size]
    if hs.dim() != 3 or list(hs.shape[1:]) != want:
        extra = (f"; {hs.shape[1]} layers: the last layer ({spec.num_layers}) is missing, so the final state cannot "
                 f"be made" if hs.dim() == 3 and hs.shape[1] == len(layers) - 1 else "")
        raise EyasError(f"{path}: hidden_states is {list(hs.shape)}, expected [tokens, {want[0]}, {want[1]}] (layers "
                        f"{layers} of target {spec.name}){extra}; {_launch_hint(spec)}")
    if hs.dtype not in ENGINE_DTYPES:
        raise EyasError(f"{path}: hidden_states is {hs.dtype}, expected one of bf16, fp16, fp32 or fp8 e4m3")
    if ids.dim() != 1 or ids.shape[0] != hs.shape[0] or ids.dtype.is_floating_point:
        raise EyasError(f"{path}: token_ids is {list(ids.shape)} {ids.dtype}, expected [{hs.shape[0]}] integers (one "
                        f"per row of hidden_states)")
    if hs.dtype == torch.float8_e4m3fn:
        if scales is None or scales.numel() != hs.shape[0]:
            raise EyasError(f"{path}: fp8 hidden_states need hidden_states_scales [{hs.shape[0]}, 1, 1] (hs_connectors' "
                            f"FP8 connector), found {None if scales is None else list(scales.shape)}")
        hs = hs.float() * scales.float().reshape(-1, 1, 1)
    elif scales is not None:
        raise EyasError(f"{path}: hidden_states_scales given but hidden_states is {hs.dtype}, not fp8")
    if not bool(torch.isfinite(hs).all()):
        raise EyasError(f"{path}: hidden_states holds non-finite values")
    return ids.to(torch.int64), hs[:, eyas_order(spec)]


class FolderSource:
    """Files an engine already wrote, found by their token ids: every *.safetensors under `folder`."""

    def __init__(self, folder: Path):
        from safetensors import SafetensorError, safe_open

        if not folder.is_dir():
            raise EyasError(f"features.from_vllm {str(folder)!r}: no such folder (give the folder vLLM's connector "
                            f"wrote to, or the server's http:// URL)")
        self.folder = folder
        self.by_key: dict[str, Path] = {}
        for p in sorted(folder.rglob("*.safetensors")):
            if p.name.startswith("."):
                continue
            try:
                wait_unlocked(p)
                with safe_open(str(p), "pt") as f:
                    if "token_ids" not in f.keys():
                        continue  # not an engine file
                    self.by_key.setdefault(tokens_key(f.get_tensor("token_ids")), p)
            except (SafetensorError, OSError) as e:
                raise EyasError(f"{p}: not a readable safetensors file ({e}); delete it or ask the engine again") from None
        if not self.by_key:
            raise EyasError(f"{folder}: no hidden-state files (safetensors with token_ids and hidden_states) found")

    def describe(self) -> dict:
        return {"engine": "vllm", "folder": str(self.folder), "files": len(self.by_key)}

    def check(self, tokens, split: str) -> None:
        """Every sequence of the split has a file; else one line that says how many do not."""
        missing = [i for i in range(len(tokens)) if tokens_key(tokens[i][0]) not in self.by_key]
        if missing:
            i = missing[0]
            raise EyasError(f"{self.folder}: {len(missing)} of {len(tokens)} {split} sequences have no file with their "
                            f"token ids (the first: sequence {i}, {len(tokens[i][0])} tokens); the engine was given "
                            f"other tokens: have eyas send its own with --from-vllm http://HOST:PORT")

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return read_vllm_states(self.by_key[tokens_key(ids)], self.spec)


def _base_url(url: str) -> str:
    u = url.strip().rstrip("/")
    for tail in ("/v1/completions", "/completions", "/v1"):
        if u.endswith(tail):
            u = u[: -len(tail)]
            break
    return u


class ServerSource:
    """A vLLM server started for hidden-state extraction: one /v1/completions request per sequence (its token ids
    as the prompt, max_tokens 1); the answer's kv_transfer_params.hidden_states_path names the file written."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.base = _base_url(url)
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):  # as regen's server backend reads it by default; never logged
            self.headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        models = self._call("GET", "/v1/models")
        try:
            self.model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise EyasError(f"{self.base}/v1/models: no model listed ({str(models)[:200]})") from None

    def describe(self) -> dict:
        return {"engine": "vllm", "url": self.base, "model": self.model}

    def check(self, tokens, split: str) -> None:
        pass

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """One request, tried again after 1, 2 and 4 s where the server is busy (429, 5xx) or did not answer."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(RETRIES + 1):
            req = urllib.request.Request(self.base + path, data=data, method=method, headers=self.headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    raw = r.read()
                break
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:300]
                if (e.code == 429 or e.code >= 500) and attempt < RETRIES:
                    time.sleep(2 ** attempt)
                    continue
                raise EyasError(f"{self.base}{path}: the server answered {e.code} ({detail})") from None
            except (urllib.error.URLError, HTTPException, OSError) as e:
                if attempt < RETRIES:
                    time.sleep(2 ** attempt)
                    continue
                raise EyasError(f"{self.base}{path}: no answer after {RETRIES + 1} tries ({getattr(e, 'reason', e)}); "
                                f"is the vLLM server up?") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise EyasError(f"{self.base}{path}: the answer is not JSON ({raw[:200]!r})") from None

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = ids.tolist()
        ans = self._call("POST", "/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 1,
                                                       "return_token_ids": True})
        got = (ans.get("choices") or [{}])[0].get("prompt_token_ids")
        if got is not None and got != prompt:
            raise EyasError(f"{self.base}/v1/completions: the server read {len(got)} prompt tokens where eyas sent "
                            f"{len(prompt)} (or other ids); serve the same target and tokenizer")
        path = (ans.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise EyasError(f"{self.base}/v1/completions: the answer has no kv_transfer_params.hidden_states_path; "
                            f"{_launch_hint(self.spec)} and --kv-transfer-config '{{\"kv_connector\": "
                            f"\"ExampleHiddenStatesConnector\", \"kv_role\": \"kv_producer\", ...}}'")
        p = Path(path)
        deadline = time.monotonic() + APPEAR_TIMEOUT_S  # the answer may come before the writer made its lock
        while not p.exists() and not Path(path + ".lock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not p.exists() and not Path(path + ".lock").exists():
            raise EyasError(f"{p}: the server wrote its hidden states here, but this machine cannot see the file; run "
                            f"eyas where the connector's shared_storage_path is mounted")
        out = read_vllm_states(p, self.spec)
        for f in (p, Path(path + ".lock")):  # read: the engine's copy is no longer needed
            f.unlink(missing_ok=True)
        return out


class FinalNorm:
    """The target's final norm, built as its own module class (on the meta device, then given the checkpoint's
    weight), so every family's norm arithmetic is the model's own."""

    def __init__(self, spec, weight: torch.Tensor | None, norm: str = "hf"):
        from transformers import AutoModelForCausalLM

        from .target import norms_one_kernel

        if weight is None:
            raise EyasError(f"target {spec.name}: no final norm weight found, so the engine's last-layer states "
                            f"cannot be normed into the final state")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(spec.config)
        mod = getattr(model.get_decoder(), "norm", None)
        params = dict(mod.named_parameters()) if mod is not None else {}
        if mod is None or set(params) != {"weight"} or tuple(params["weight"].shape) != tuple(weight.shape):
            raise EyasError(f"target {spec.name}: its final norm ({type(mod).__name__}) is not a weight-only norm of "
                            f"the checkpoint's shape {list(weight.shape)}; engine features need one")
        mod = mod.to_empty(device=weight.device).to(weight.dtype)
        with torch.no_grad():
            mod.weight.copy_(weight)
        self.module = mod.eval().requires_grad_(False)
        self.holder = torch.nn.ModuleList([self.module])
        self.one_kernel = norm == "one_kernel"
        self._ctx = norms_one_kernel

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self._ctx(self.holder, self.one_kernel):
            return self.module(x)


def to_features(states: torch.Tensor, final_norm: FinalNorm, lm_head, dtype: torch.dtype,
                chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Engine states [n, L, H] -> (aux [n, (L-1)·H], final [n, H], top [n] int32) in the head's dtype, on its device,
    in row chunks."""
    dev = lm_head.weight.device
    auxs, finals, tops = [], [], []
    for a in range(0, states.shape[0], chunk):
        s = states[a:a + chunk].to(dev, dtype)
        final = final_norm(s[:, -1])
        auxs.append(s[:, :-1].reshape(s.shape[0], -1))
        finals.append(final)
        tops.append(target_top(final, lm_head))
    return torch.cat(auxs), torch.cat(finals), torch.cat(tops)


def _shard_tensors(source, tokens, seqs: list[int], dtype: str, final_norm, lm_head, pool) -> dict[str, torch.Tensor]:
    """One shard's tensors, laid out as `eyas extract` lays them out."""
    got = list(pool.map(lambda i: (i, *source.fetch(tokens[i][0].long())), seqs))
    for i, ids, _ in got:
        if not torch.equal(ids, tokens[i][0].long()):
            raise EyasError(f"engine states for sequence {i} carry other token ids than eyas' tokens")
    states = torch.cat([s for _, _, s in got])
    aux, final, top = to_features(states, final_norm, lm_head, lm_head.weight.dtype)
    out = {}
    if dtype == "fp8":
        aux, aux_s = quantize_fp8(aux, 3)
        final, final_s = quantize_fp8(final, 1)
    sd = STORE_DTYPES[dtype]
    out.update(aux=aux.to(sd).cpu(), final=final.to(sd).cpu(), top=top.cpu())
    if dtype == "fp8":
        out.update(aux_scale=aux_s.cpu(), final_scale=final_s.cpu())
    tok = _token_tensors(tokens, seqs)
    return {"offsets": tok["offsets"], "seq_index": tok["seq_index"], **out, "input_ids": tok["input_ids"],
            "loss_mask": tok["loss_mask"]}


def engine_split(cfg: Config, spec, head, source, split: str) -> dict:
    """Convert one split's engine states into <run>/features/<split>/, resuming finished shards."""
    from .data.prepare import load_tokens

    run = Path(cfg.out)
    dtype = cfg.features.dtype
    tokens = load_tokens(run, split)
    source.check(tokens, split)
    d = features_dir(run, split)
    d.mkdir(parents=True, exist_ok=True)
    H = spec.hidden_size
    bpt = bytes_per_token(H, dtype)
    shard_tokens = max(1, min(cfg.features.shard_tokens, MAX_SHARD_BYTES // bpt))
    lengths = tokens.lengths().tolist()
    my = plan_shards(lengths, 1, shard_tokens)[0]
    plan = {"format": FORMAT, "split": split, "target": spec.identity(), "dtype": dtype, "hidden_size": H,
            "aux_layers": list(spec.aux_layers), "tokens_sha256": tokens_sha256(tokens), "world_size": 1,
            "shard_tokens": shard_tokens,
            **{k: v for k, v in {"norm": cfg.features.norm}.items() if v != PLAN_DEFAULTS[k]},
            "source": {"engine": "vllm"}}
    plan_key = sha256_json(plan)[:16]
    manifest_path = d / "manifest.json"
    if manifest_path.exists():
        _check_manifest(manifest_path, plan)
    else:
        atomic_write_json(manifest_path, {**plan, "complete": False, "sequences": len(tokens),
                                          "tokens": tokens.n_tokens, "bytes_per_token": bpt,
                                          "estimated_bytes": tokens.n_tokens * bpt,
                                          "engine": {**source.describe(), "layer_ids": engine_layer_ids(spec)}})
    prog_path = d / "rank-000.json"
    prog = read_json(prog_path) if prog_path.exists() else {}
    done = {e["file"]: e for e in prog.get("shards", [])} if prog.get("plan") == plan_key else {}
    for stale in d.glob(".shard-000-*.tmp"):
        stale.unlink(missing_ok=True)
    todo = []
    for k, seqs in enumerate(my):
        name, p = _shard_name(0, k), d / _shard_name(0, k)
        e = done.get(name)
        if e and p.exists() and p.stat().st_size == e["bytes"]:
            continue
        if p.exists() and _shard_matches(p, plan_key, seqs):
            done[name] = _entry(0, k, seqs, lengths) | {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            continue
        done.pop(name, None)
        todo.append(k)

    def record():
        atomic_write_json(prog_path, {"plan": plan_key, "rank": 0,
                                      "shards": sorted(done.values(), key=lambda e: e["shard"])})

    record()
    final_norm = FinalNorm(spec, head.final_norm_weight(), cfg.features.norm)
    lm_head = head.lm_head()
    todo_tokens = sum(lengths[i] for k in todo for i in my[k])
    bar = progress(total=todo_tokens, desc=f"engine features {split}", unit="tok", unit_scale=True)
    with ThreadPoolExecutor(max(1, cfg.features.engine_requests)) as pool:
        for k in todo:
            tensors = _shard_tensors(source, tokens, my[k], dtype, final_norm, lm_head, pool)
            size, digest = write_safetensors(d / _shard_name(0, k), tensors, _shard_meta(plan_key, 0, k))
            done[_shard_name(0, k)] = _entry(0, k, my[k], lengths) | {"bytes": size, "sha256": digest}
            record()
            bar.update(sum(lengths[i] for i in my[k]))
    bar.close()
    _merge_index(d, 1, plan_key, 1, manifest_path)
    return {"split": split, "sequences": len(tokens), "tokens": tokens.n_tokens, "extracted_tokens": todo_tokens,
            "reused_shards": len(my) - len(todo), "shards": len(my), "dtype": dtype, "bytes_per_token": bpt,
            "dir": str(d), "engine": source.describe()}


def open_source(where: str, spec):
    """A URL -> ServerSource, else a folder -> FolderSource."""
    src = ServerSource(where) if where.startswith(("http://", "https://")) else FolderSource(Path(where))
    src.spec = spec
    return src


def run_engine_extract(cfg: Config) -> dict:
    """`eyas extract --from-vllm SRC`: the train and val splits' features from vLLM's hidden-state extraction, read
    into eyas' feature shards. Holds the target's head only (norm and lm_head), never its decoder layers."""
    from .data.prepare import ensure_tokens
    from .target_head import load_target_head
    from .target_spec import load_spec

    if cfg.target.tensor_parallel:
        raise EyasError("features.from_vllm reads what the engine computed: drop --tensor-parallel (give the engine "
                        "its own --tensor-parallel-size)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise EyasError("features.from_vllm runs in one process: run it without torchrun")
    spec = load_spec(cfg.target)
    ensure_tokens(cfg, spec)
    source = open_source(cfg.features.from_vllm, spec)
    head = load_target_head(cfg.target, spec)
    t0 = time.perf_counter()
    splits = [engine_split(cfg, spec, head, source, s) for s in ("train", "val")]
    dt = time.perf_counter() - t0
    extracted = sum(s["extracted_tokens"] for s in splits)
    res = {"rank": 0, "world_size": 1, "dtype": cfg.features.dtype, "splits": splits, "seconds": round(dt, 2),
           "tokens_per_s": round(extracted / dt, 1) if dt > 0 else None, "engine": source.describe()}
    log(f"extract: {sum(s['tokens'] for s in splits):,} tokens from vLLM ({extracted:,} read now) at "
        f"{res['tokens_per_s']} tok/s into {Path(cfg.out) / 'features'}")
    return res


class EngineOnlineFeatures(OnlineFeatures):
    """Online features for training whose target runs in an engine: OnlineFeatures (same samples, caches, warm-up)
    with the engine's states, normed and ranked by the head the trainer holds, in place of the target's forward.
    Each group of sequences a forward would have taken is asked of the engine at once (`requests` in parallel)."""

    def __init__(self, head, tokens, source, final_norm: FinalNorm, requests: int = 16, **kw):
        super().__init__(head, tokens, **kw)
        self.source = source
        self.final_norm = final_norm
        self.lm_head = head.lm_head()
        self.pool = ThreadPoolExecutor(max(1, requests))

    def _forwards(self, seqs: list[torch.Tensor], batch_tokens: int):
        order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k]))
        for a, b in plan_batches([len(seqs[k]) for k in order], batch_tokens):
            group = order[a:b]
            got = list(self.pool.map(lambda k: self.source.fetch(seqs[k].long()), group))
            feats = []
            for k, (ids, states) in zip(group, got):
                if not torch.equal(ids, seqs[k].long().cpu()):
                    raise EyasError("the engine's states carry other token ids than the sequence asked for")
                feats.append(to_features(states, self.final_norm, self.lm_head, self.lm_head.weight.dtype))
            yield group, feats


def engine_online_features(cfg: Config, head, tokens, cache_bytes: int = 0, host_bytes: int = 0):
    """train.online with features.from_vllm: the trainer's features come from the engine as training asks for them."""
    source = open_source(cfg.features.from_vllm, head.spec if hasattr(head, "spec") else head)
    return EngineOnlineFeatures(head, tokens, source, FinalNorm(source.spec, head.final_norm_weight(),
                                                                cfg.features.norm),
                                requests=cfg.features.engine_requests,
                                max_batch_tokens=max(cfg.features.batch_tokens, cfg.train.batch_tokens),
                                cache_bytes=cache_bytes, host_bytes=host_bytes, norm=cfg.features.norm)
