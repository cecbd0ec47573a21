"""Export an eyas drafter for SGLang and vLLM, and import drafters from those formats and from
the original EAGLE layout.

What each engine reads (names, config keys, aux-layer id semantics) is written up, with the
engine file and version it was read from, in docs/serving.md. In short:

* SGLang (`LlamaForCausalLMEagle3`): HF-Llama-style config.json plus `draft_vocab_size`,
  `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; SGLang adds 1 to each
  configured id and captures the stream *entering* that decoder layer, so it gets eyas id - 1.
  Weights keep eyas' own names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
* vLLM (speculators `eagle3` config): `transformer_layer_config` + top-level `draft_vocab_size`,
  `target_hidden_size`, norm flags, `eagle_aux_hidden_state_layer_ids` (used as-is: the stream
  entering that layer, = eyas' convention) and `speculators_config` (proposal method, verifier).
  Weights name the decoder layer `layers.0.*` instead of `midlayer.*`; a multi-layer drafter's later layers are
  `layers.<i>.*` in both eyas and vLLM (SGLang runs its later layers differently, so it gets one-layer drafters only).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from .draft import (DAMAGED, NON_FINITE, DraftConfig, Eagle3Drafter, check_drafter_aux_layers, check_fits,
                    is_eyas_config, is_int, json_kind, load_drafter, read_config, read_safetensors, safetensors_shapes)
from .rope import check_rope_scaling, without_served_mscale
from .serve_target import serve_target
from .variants import LAYER_ARCHS, from_speculators, sglang_refusal, speculators_fields, variant_tensors
from .util import EyasError, atomic_path, atomic_write_json, log, read_json, refuse_non_finite, writing

FORMATS = ("sglang", "vllm")
# SGLang's later draft layers (BasicDecoderLayer in llama_eagle3.py, commit 03d5a77) restart the residual from the
# previous layer's MLP output and norm with hidden_norm: another network than vLLM's (and eyas') plain Llama layers
SGLANG_MULTI_LAYER = ("a drafter of {n} decoder layers cannot be served by SGLang: its LlamaForCausalLMEagle3 runs "
                      "the layers after the first differently (they drop the residual stream), so it would not "
                      "compute what was trained; export it for vLLM (export.formats=[\"vllm\"])")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
VLLM_MODEL_TYPE = "eagle3"
# hub ids of the presets, written as the verifier a served drafter belongs to
PRESET_HUB_IDS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "qwen-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
PRESET_ARCHS = {"smollm2": "LlamaForCausalLM", "qwen-coder-0.5b": "Qwen2ForCausalLM", "tiny": "LlamaForCausalLM"}


# ----------------------------------------------------------------------------- tensors

def expected_tensors(c: DraftConfig, include_embeddings: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor an eyas drafter checkpoint holds (eyas/SGLang names) -> (shape, kind), where
    kind is 'float', 'int64' or 'bool'."""
    H, q = c.hidden_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    t = {
        "fc.weight": ((H, len(c.aux_layers) * c.target_hidden_size), "float"),
        "midlayer.input_layernorm.weight": ((H,), "float"),
        "midlayer.hidden_norm.weight": ((H,), "float"),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), "float"),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), "float"),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), "float"),
        "midlayer.self_attn.o_proj.weight": ((H, q), "float"),
        "midlayer.post_attention_layernorm.weight": ((H,), "float"),
        "midlayer.mlp.gate_proj.weight": ((c.intermediate_size, H), "float"),
        "midlayer.mlp.up_proj.weight": ((c.intermediate_size, H), "float"),
        "midlayer.mlp.down_proj.weight": ((H, c.intermediate_size), "float"),
        "norm.weight": ((H,), "float"),
        "lm_head.weight": ((c.draft_vocab_size, H), "float"),
        "d2t": ((c.draft_vocab_size,), "int64"),
        "t2d": ((c.target_vocab_size,), "bool"),
    }
    for i in range(1, c.num_hidden_layers):  # a multi-layer drafter's plain layers (vLLM's layers.<i>)
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": ((H,), "float"),
                  p + "self_attn.q_proj.weight": ((q, H), "float"), p + "self_attn.k_proj.weight": ((kv, H), "float"),
                  p + "self_attn.v_proj.weight": ((kv, H), "float"), p + "self_attn.o_proj.weight": ((H, q), "float"),
                  p + "post_attention_layernorm.weight": ((H,), "float"),
                  p + "mlp.gate_proj.weight": ((c.intermediate_size, H), "float"),
                  p + "mlp.up_proj.weight": ((c.intermediate_size, H), "float"),
                  p + "mlp.down_proj.weight": ((H, c.intermediate_size), "float")})
    t.update(variant_tensors(c))  # input_norm, fc_norm.<i>, q_norm/k_norm (eyas.variants)
    if include_embeddings:
        t["embed_tokens.weight"] = ((c.target_vocab_size, H), "float")
    return t


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype == torch.int64:
        return "int64"
    return "float" if dtype.is_floating_point else str(dtype).replace("torch.", "")


def check_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], c: DraftConfig, where: str,
                  include_embeddings: bool = False, hint: str = "") -> None:
    """Refuse a checkpoint with a missing, misshapen or mistyped tensor, naming it (and `hint`: what to do)."""
    problems = []
    for name, (shape, kind) in expected_tensors(c, include_embeddings).items():
        if name not in shapes:
            problems.append(f"tensor '{name}' is missing")
            continue
        got_shape, got_dtype = shapes[name]
        if tuple(got_shape) != shape:
            problems.append(f"tensor '{name}' has shape {list(got_shape)}, expected {list(shape)}")
        elif _kind(got_dtype) != kind:
            problems.append(f"tensor '{name}' has dtype {str(got_dtype).replace('torch.', '')}, expected {kind}")
    if problems:
        raise EyasError(f"{where}: " + "; ".join(problems) + (f"; {hint}" if hint else ""))


def _shapes_of(sd: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def check_checkpoint(path: str | Path) -> DraftConfig:
    """Check an eyas drafter folder's tensors against its config without building the model."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise EyasError(f"{f}: not found (is {path} a trained eyas drafter folder? run `eyas train` first)")
    raw = read_config(cfg_file)
    if not is_eyas_config(raw, cfg_file):
        raise EyasError(f"{cfg_file}: not an eyas drafter's config (no eyas_format); {DAMAGED}")
    c = DraftConfig.from_dict(raw, str(cfg_file))
    check_tensors(safetensors_shapes(weights), c, f"{weights} (against {cfg_file.name})", hint=DAMAGED)
    return c


# ----------------------------------------------------------------------------- aux-layer ids

def engine_aux_ids(aux_layers: list[int], fmt: str, num_layers: int = 0) -> list[int]:
    """The ids to write into an engine's config so that it captures the same residual streams the
    drafter was trained on (eyas id i = the stream entering decoder layer i = HF hidden_states[i])."""
    _check_format(fmt)
    for a in aux_layers:
        # both engines capture inside their decoder loop, before layer i runs, and add the
        # residual there: the embedding output (i=0) and the final pre-norm state (i=N) are not reachable
        if a < 1 or (num_layers and a >= num_layers):
            raise EyasError(f"aux layer {a} cannot be served: SGLang and vLLM capture the stream entering "
                            f"decoder layers 1..{num_layers - 1 if num_layers else 'N-1'}; "
                            f"retrain with target.aux_layers inside that range")
    return [a - 1 for a in aux_layers] if fmt == "sglang" else list(aux_layers)


def eyas_aux_ids(ids: list[int], fmt: str) -> list[int]:
    """Inverse of engine_aux_ids."""
    _check_format(fmt)
    return [int(i) + 1 for i in ids] if fmt == "sglang" else [int(i) for i in ids]


def config_aux_ids(raw: dict) -> list[int] | None:
    """The aux layers (eyas ids) an engine-format drafter config records: SGLang's nested
    `eagle_config["eagle_aux_hidden_state_layer_ids"]`, else a top-level `eagle_aux_hidden_state_layer_ids`, read as
    vLLM reads it (as-is); None where it records none, or ids that are not a list of whole numbers (import_drafter
    refuses those, naming the field)."""
    nested = raw.get("eagle_config")
    nested = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    if nested:
        return eyas_aux_ids(nested, "sglang") if _int_list(nested) else None
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    return eyas_aux_ids(top, "vllm") if top and _int_list(top) else None


def _int_list(v) -> bool:
    return isinstance(v, list) and all(is_int(i) for i in v)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise EyasError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")


# ----------------------------------------------------------------------------- export

def _llama_fields(c: DraftConfig, dtype: torch.dtype) -> dict:
    """The decoder-layer fields both engines build the draft layer from, written explicitly."""
    return {
        "model_type": c.layer_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        # rope_type and that kind's settings as both engines' get_rope reads them (and transformers 4 and 5)
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.target_vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def export_drafter(drafter: Eagle3Drafter, out_dir: str | Path, fmt: str, target_name_or_path: str,
                   include_embeddings: bool = False, num_speculative_tokens: int = 3,
                   verifier_architectures: list[str] | None = None) -> Path:
    """Write `drafter` in an engine's format: out_dir/config.json + out_dir/model.safetensors, and nothing else
    (the folder is written anew and swapped in whole: see _fresh_folder)."""
    from safetensors.torch import save_file

    _check_format(fmt)
    if num_speculative_tokens < 1:
        raise EyasError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    c = drafter.config
    if fmt == "sglang" and c.num_hidden_layers > 1:
        raise EyasError(SGLANG_MULTI_LAYER.format(n=c.num_hidden_layers))
    if fmt == "sglang" and sglang_refusal(c):
        raise EyasError(f"this drafter cannot be served by SGLang: {sglang_refusal(c)}")
    sd = drafter.trainable_state_dict(include_embeddings=include_embeddings)
    check_tensors(_shapes_of(sd), c, "drafter", include_embeddings)
    n_layers = c.target_num_layers or int(c.target.get("num_layers", 0) or 0)
    ids = engine_aux_ids(list(c.aux_layers), fmt, n_layers)
    dtype = sd["fc.weight"].dtype
    # serve_target: the target to serve the drafter with (a hub id, or the folder of the weights it trained on)
    eyas_meta = {"format": fmt, "aux_layers": list(c.aux_layers), "target": c.target,
                 "target_num_layers": n_layers, "serve_target": target_name_or_path}
    if fmt == "sglang":
        tensors = dict(sd)
        config = {"architectures": [SGLANG_ARCH], **_llama_fields(c, dtype),
                  "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
                  "eyas": eyas_meta}
    else:
        tensors = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in sd.items()}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": VLLM_MODEL_TYPE,
            "transformer_layer_config": {**_llama_fields(c, dtype), "architectures": [LAYER_ARCHS[c.layer_type]]},
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            # the variants' flags, each written: vLLM's speculators adapter reads an absent norm_before_residual
            # as true (eyas.variants)
            **speculators_fields(c),
            "embed_requires_grad": False,
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name_or_path,
                             "architectures": list(verifier_architectures or ["LlamaForCausalLM"])},
            },
            "eyas": eyas_meta,
        }
    out = Path(out_dir)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    refuse_non_finite(tensors, f"{out / 'model.safetensors'}: not written", NON_FINITE)
    needed = sum(v.numel() * v.element_size() for v in tensors.values())
    with _fresh_folder(out) as folder:
        # (atomic_path also gives it a plain file's mode; a full disk is named as the export's file)
        with atomic_path(folder / "model.safetensors", needed) as tmp, writing(out / "model.safetensors", needed):
            save_file(tensors, str(tmp), metadata={"format": "pt", "eyas_export": fmt})
        atomic_write_json(folder / "config.json", config)
    return out


# ----------------------------------------------------------------------------- writing a folder whole

@contextlib.contextmanager
def _fresh_folder(out: Path, check=None):
    """Yield an empty temporary folder beside `out`; when the block succeeds, it takes out's place in one step. So
    `out` holds exactly what the block wrote: no file of an earlier export survives there to be read with the new
    ones (a reader loads every weights file a folder holds when it has no index), and a reader, or an export killed
    midway, finds the old folder whole or the new one whole (`check` refuses an `out` it may not replace: by default
    anything but a drafter export). What a killed export leaves beside `out` (a hidden
    `.<name>.<pid>.tmp` folder) is deleted by the next one."""
    (check or _check_replaceable)(out)
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
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28 and later
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove_leftovers(out: Path) -> None:
    """Delete the temporary folders exports killed midway left beside `out`, unless their process still runs."""
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


def _check_replaceable(out: Path) -> None:
    """Refuse to write over something that is not a drafter export: the export replaces the whole folder."""
    if not out.exists():
        return
    if not out.is_dir():
        raise EyasError(f"{out}: exists and is not a folder; the export writes a folder there: move it away, or "
                        f"export elsewhere")
    try:
        raw = read_config(out / "config.json") if (out / "config.json").is_file() else {}
    except EyasError:  # a damaged earlier export: judged by its files below
        raw = {}
    if isinstance(raw.get("eyas"), dict) and raw["eyas"].get("format") in FORMATS:
        return
    foreign = sorted(p.name for p in out.iterdir() if not (p.is_file() and p.suffix in (".json", ".safetensors")))
    if foreign:
        raise EyasError(f"{out}: holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}, which is not a "
                        f"drafter export, and the export replaces the whole folder: move them away, or export "
                        f"elsewhere")


def verifier_name(target_cfg) -> str:
    return PRESET_HUB_IDS.get(target_cfg.name, target_cfg.name)


def verifier_architectures(target_cfg) -> list[str] | None:
    """The target's transformers architecture for the export's verifier metadata: known for the
    presets, read from config.json for an HF folder, else unknown (None)."""
    if target_cfg.name in PRESET_ARCHS:
        return [PRESET_ARCHS[target_cfg.name]]
    cfg_file = Path(target_cfg.name).expanduser() / "config.json"
    if cfg_file.is_file():
        raw = read_json(cfg_file)
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        if isinstance(archs, list) and archs:
            return [str(a) for a in archs]
    return None


def check_export_settings(cfg) -> None:
    """Refuse export formats eyas does not write, and a draft length the vLLM config cannot propose (the pipeline
    checks this before its first stage)."""
    from .config import check_settings

    if not cfg.export.formats:
        raise EyasError("export.formats is empty: name at least one of sglang, vllm")
    for f in cfg.export.formats:
        _check_format(f)
    # eval.k is written as the vLLM config's speculative_tokens (vLLM's num_speculative_tokens)
    check_settings(cfg, (("eval.k", cfg.eval.k >= 1, "at least 1 (the exported vLLM config proposes that many "
                                                       "draft tokens per target forward)"),))


def export_target(tcfg, c: DraftConfig, cfg_file: Path) -> SimpleNamespace:
    """The target named by `tcfg` as check_fits reads it (name, hidden size, vocabulary, layers, aux layers), from
    its config alone: the export needs no weights of it (a large target would take minutes to load). Its aux layers
    are the user's target.aux_layers where given, else the drafter's own (`c`, from `cfg_file`), which the export
    writes for the engines to capture."""
    from .target import check_aux_layers
    from .target_spec import load_spec

    spec = load_spec(replace(tcfg, aux_layers=[]))  # the aux layers are checked below, against the drafter's too
    t = SimpleNamespace(name=tcfg.name, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                        num_layers=spec.num_layers, aux_layers=[])
    if tcfg.aux_layers:
        t.aux_layers = check_aux_layers(list(tcfg.aux_layers), t.num_layers)
    else:
        t.aux_layers = check_drafter_aux_layers(list(c.aux_layers), cfg_file, t, field="aux_layers")
    return t


def run_export(cfg) -> dict:
    """`eyas export`: <run>/draft -> <run>/export/{sglang,vllm}/."""
    run = Path(cfg.out)
    check_export_settings(cfg)
    draft_dir = run / "draft"
    c = check_checkpoint(draft_dir)
    # the drafter must fit the target it is exported for, which the engines will feed it: the export names that
    # target as the verifier, and a drafter of another width or vocabulary would load there and fail, or run wrong
    fit = export_target(cfg.target, c, draft_dir / "config.json")
    check_fits(c, fit, str(draft_dir))
    trained_for = c.target.get("name")
    if trained_for and trained_for != cfg.target.name:
        log(f"export: the drafter in {draft_dir} was trained with target '{trained_for}'; exporting it for "
            f"'{cfg.target.name}', whose shapes it fits")
    formats = list(cfg.export.formats)
    if c.num_hidden_layers > 1 and "sglang" in formats:  # the run's default asks for both formats
        log("export: skipping sglang, " + SGLANG_MULTI_LAYER.format(n=c.num_hidden_layers))
        formats = [f for f in formats if f != "sglang"]
    if sglang_refusal(c) and "sglang" in formats:
        log("export: skipping sglang, " + sglang_refusal(c))
        formats = [f for f in formats if f != "sglang"]
    for f in formats:  # every layer the engines would capture exists in this target, before anything is written
        engine_aux_ids(list(c.aux_layers), f, fit.num_layers)
    target = None
    if cfg.export.include_embeddings:  # the embedding read from the target's files, no decoder layer
        from .target_head import load_target_head

        target = load_target_head(replace(cfg.target, aux_layers=list(fit.aux_layers)))
    drafter = load_drafter(draft_dir, target=target)
    serve = serve_target(cfg, run)  # <run>/export/target for a target eyas dequantized, else the target's name
    archs = verifier_architectures(replace(cfg.target, name=serve) if Path(serve).is_dir() else cfg.target)
    out = {}
    for f in formats:
        p = export_drafter(drafter, run / "export" / f, f, serve,
                           include_embeddings=cfg.export.include_embeddings, num_speculative_tokens=cfg.eval.k,
                           verifier_architectures=archs)
        log(f"exported the drafter for {f}: {p}")
        out[f] = str(p)
    for f in FORMATS:  # an export this call did not rewrite may hold an earlier drafter: said, not removed
        if f not in out and (run / "export" / f / "config.json").exists():
            why = "not in export.formats" if f not in cfg.export.formats else f"{f} does not serve this drafter"
            log(f"export: {run / 'export' / f} is an earlier export, not written this time ({why}); it may hold an "
                f"earlier drafter than {draft_dir}")
    return {"formats": list(out), "export": out, "serve_target": serve, "aux_layers": list(drafter.config.aux_layers),
            "engine_aux_ids": {f: engine_aux_ids(list(drafter.config.aux_layers), f,
                                                 drafter.config.target_num_layers) for f in formats}}


# ----------------------------------------------------------------------------- import

def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A drafter folder's weights: the files its index (model.safetensors.index.json) names, else
    model.safetensors, else (only where it has neither) every *.safetensors file; the same for pytorch_model*.bin
    where it has no safetensors. A stray weights file beside the ones a folder names (an earlier export's, say) is
    not read: merged in, it could replace a tensor. A tensor found in two files is refused."""
    for main, pattern, reader in (("model.safetensors", "*.safetensors", read_safetensors),
                                  ("pytorch_model.bin", "pytorch_model*.bin", _read_bin)):
        files, index = _weight_files(path, main, pattern)
        if not files:
            continue
        sd: dict[str, torch.Tensor] = {}
        source: dict[str, Path] = {}
        for f in files:
            part = reader(f)
            refuse_non_finite(part, str(f), NON_FINITE)
            for k, v in part.items():
                if k in sd:
                    raise EyasError(f"{path}: tensor '{k}' is in both {source[k].name} and {f.name}, so which one the "
                                    f"drafter holds is not known: remove the file that does not belong to it")
                sd[k], source[k] = v, f
        for k, name in (index or {}).items():
            if k not in sd or source[k].name != name:
                raise EyasError(f"{path / (main + '.index.json')}: names {name} as the file of tensor '{k}', which "
                                f"that file does not hold; {DAMAGED}")
        return sd
    raise EyasError(f"{path}: no weights found (*.safetensors or pytorch_model.bin)")


def _weight_files(path: Path, main: str, pattern: str) -> tuple[list[Path], dict | None]:
    """The weights files of one kind a folder names, and its index's tensor -> file map where it has an index."""
    index_file = path / (main + ".index.json")
    if index_file.is_file():
        raw = read_json(index_file)
        wm = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) and v and Path(v).name == v for v in wm.values()):
            raise EyasError(f"{index_file}: expected a 'weight_map' object of tensor name -> file name in this "
                            f"folder; {DAMAGED}")
        files = [path / n for n in sorted(set(wm.values()))]
        for f in files:
            if not f.is_file():
                raise EyasError(f"{index_file}: names {f.name}, which is not in {path}; {DAMAGED}")
        return files, wm
    if (path / main).is_file():
        return [path / main], None
    return sorted(p for p in path.glob(pattern) if p.is_file()), None


def _read_bin(f: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # pickles with code in them are refused here
        raise EyasError(f"{f}: cannot be read as plain tensors ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise EyasError(f"{f}: expected a dict of tensors, got {type(obj).__name__}")
    return obj


def detect_format(raw: dict, sd_keys) -> str:
    """'eyas', 'vllm' (speculators), 'sglang' (SGLang/SpecForge) or 'eagle' (original EAGLE)."""
    if raw.get("eyas_format") == 1:
        return "eyas"
    if "speculators_model_type" in raw:
        return "vllm"
    archs = raw.get("architectures") or []
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if any("Eagle3" in a for a in archs) or any(k.startswith("midlayer.") for k in sd_keys):
        return "sglang"
    return "unknown"


def _refuse_unsupported(lc: dict, raw: dict, where: str, layers: int) -> None:
    problems = []
    if layers != 1 and "speculators_model_type" not in raw:
        problems.append(f"{layers} decoder layers in SGLang's layout (its later layers are not the plain Llama layers "
                        f"eyas runs; eyas reads multi-layer drafters in vLLM's speculators format)")
    if lc.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {lc['hidden_act']!r} (eyas uses silu)")
    if lc.get("attention_bias") or lc.get("mlp_bias") or raw.get("bias"):
        problems.append("biases in attention/MLP/fc (eyas drafters have none)")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(flag) and "speculators_model_type" not in raw:  # the speculators format's variants are read
            problems.append(f"{flag}=true outside the speculators format (SGLang's layout has no such setting)")
    if problems:
        raise EyasError(f"{where}: this drafter uses features eyas cannot run: " + "; ".join(problems))


def _with_defaults(lc: dict, layer_type: str) -> dict:
    """A speculators transformer_layer_config with the defaults of its model type filled in: speculators writes it
    as transformers' to_diff_dict, which leaves out every value equal to the config class's default (Qwen3's
    head_dim 128, rms_norm_eps 1e-6, ...)."""
    from transformers import AutoConfig

    if layer_type == "llama":  # eyas writes every Llama field; older files relied on the defaults import used
        return lc
    full = AutoConfig.for_model(layer_type).to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias")
    out = {k: full[k] for k in keep if full.get(k) is not None}
    if "rope_scaling" not in lc and "rope_parameters" not in lc and "rope_theta" not in lc:
        out["rope_parameters"] = full.get("rope_parameters")
    return {**out, **lc}


def _engine_rope(f: "_Fields", cfg_file: Path) -> tuple[float, dict | None]:
    """The rope_theta and rope settings of an engine-format drafter config: `rope_scaling` (transformers 4's and the
    engines' spelling) or `rope_parameters` (transformers 5's, with rope_theta inside), checked by
    eyas.rope.check_rope_scaling: a kind or setting the eyas drafter does not run is refused naming it."""
    params = f.obj("rope_parameters")
    theta = f.number("rope_theta") or _Fields(params, cfg_file, f.prefix + "rope_parameters.").number(
        "rope_theta", 10000.0)
    key = "rope_scaling" if f.d.get("rope_scaling") is not None else "rope_parameters"
    scaling = f.obj(key)
    mrope = "mrope_section" in scaling
    if scaling.get("rope_type", scaling.get("type", "default")) == "default" and not mrope:
        return theta, None
    scaling = without_served_mscale(scaling, str(cfg_file), f"{f.prefix}{key}.")  # SpecForge's yarn writes them
    return theta, check_rope_scaling(scaling, str(cfg_file), f"{f.prefix}{key}.")


class _Fields:
    """An engine config's fields, each read with its type checked: a damaged or hand-edited value is refused naming
    the file and the field (as `prefix` + key: `transformer_layer_config.hidden_size`), not turned into a number
    that is not what the file says ("64" read as 64) or left to fail inside torch."""

    def __init__(self, d: dict, cfg_file: Path, prefix: str = ""):
        self.d, self.cfg_file, self.prefix = d, cfg_file, prefix

    def _bad(self, key: str, want: str, v) -> EyasError:
        return EyasError(f"{self.cfg_file}: field '{self.prefix}{key}' must be {want}, got {json_kind(v)}; {DAMAGED}")

    def whole(self, key: str, default=None, minimum: int = 1) -> int:
        """A whole number >= minimum, or `default` where the field is absent or null (an EyasError without one)."""
        v = self.d.get(key)
        if v is None:
            if default is None:
                raise EyasError(f"{self.cfg_file}: field '{self.prefix}{key}' is missing; {DAMAGED}")
            return default
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise self._bad(key, "a positive whole number" if minimum == 1 else f"a whole number >= {minimum}", v)
        return v

    def number(self, key: str, default=None) -> float | None:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise self._bad(key, "a positive number", v)
        return float(v)

    def obj(self, key: str) -> dict:
        """An object field (absent or null: empty)."""
        v = self.d.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self._bad(key, "an object", v)
        return v

    def ids(self, key: str) -> list[int] | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not _int_list(v):
            raise self._bad(key, "a list of layer ids", v)
        return v


def import_drafter(path: str | Path, target=None) -> Eagle3Drafter:
    """Load a drafter from an eyas folder, an SGLang/SpecForge EAGLE-3 folder, a vLLM speculators
    folder or an original EAGLE-3 folder (config.json + safetensors or pytorch_model.bin). With
    `target`, the target's embedding is attached and the drafter is refused if it does not fit."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.exists():
        raise EyasError(f"{path}: not a drafter folder (no config.json)")
    raw = read_config(cfg_file)
    if is_eyas_config(raw, cfg_file):  # a format number this eyas does not know is refused there
        return load_drafter(path, target=target)
    sd = _load_weights(path)
    fmt = detect_format(raw, sd.keys())
    if fmt == "unknown":
        raise EyasError(f"{path}: not a recognised EAGLE-3 drafter layout (no speculators_model_type, no "
                        f"Eagle3 architecture, no midlayer.* weights)")
    where = str(path)
    top = _Fields(raw, cfg_file)
    if fmt == "vllm":
        if raw.get("speculators_model_type") != VLLM_MODEL_TYPE:
            raise EyasError(f"{cfg_file}: speculators_model_type is {raw.get('speculators_model_type')!r}; "
                            f"eyas imports only 'eagle3'")
        lc = raw.get("transformer_layer_config")
        if not isinstance(lc, dict):
            raise EyasError(f"{cfg_file}: field 'transformer_layer_config' is missing")
        variants = from_speculators(raw, lc, cfg_file)
        lc = _with_defaults(lc, variants["layer_type"])
        f = _Fields(lc, cfg_file, "transformer_layer_config.")
        ids = top.ids("eagle_aux_hidden_state_layer_ids")
        aux = eyas_aux_ids(ids, "vllm") if ids else None
        aux_field = "eagle_aux_hidden_state_layer_ids"
    else:
        lc, f, variants = raw, top, {}
        nested = _Fields(top.obj("eagle_config"), cfg_file, "eagle_config.").ids("eagle_aux_hidden_state_layer_ids")
        top.ids("eagle_aux_hidden_state_layer_ids")
        aux = config_aux_ids(raw)  # the ids checked above
        aux_field = ("eagle_config.eagle_aux_hidden_state_layer_ids, each + 1 as SGLang reads them" if nested
                     else "eagle_aux_hidden_state_layer_ids")
    layers = f.whole("num_hidden_layers", default=1)
    _refuse_unsupported(lc, raw, where, layers)

    # normalise weight names to eyas' own
    norm: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        if k.startswith("verifier_"):
            continue
        norm[k] = v

    hidden = f.whole("hidden_size")
    heads = f.whole("num_attention_heads")
    vocab = f.whole("vocab_size", default=0) or (norm["t2d"].numel() if "t2d" in norm else None)
    draft_vocab = (top.whole("draft_vocab_size", default=0) or f.whole("draft_vocab_size", default=0)
                   or (norm["lm_head.weight"].shape[0] if "lm_head.weight" in norm else None))
    if vocab is None or draft_vocab is None:
        raise EyasError(f"{cfg_file}: cannot tell the vocabulary sizes (vocab_size / draft_vocab_size)")
    target_hidden = top.whole("target_hidden_size", default=0) or f.whole("target_hidden_size", default=hidden)
    if aux is not None:
        check_drafter_aux_layers(aux, cfg_file, target, field=aux_field)
    elif target is None:
        raise EyasError(f"{cfg_file}: the aux-layer ids are not recorded; pass the target so its default "
                        f"[2, N//2, N-3] can be used")
    else:
        aux = list(target.aux_layers)  # engines and EAGLE then use [2, N//2, N-3] of the target
    theta, rope_scaling = _engine_rope(f, cfg_file)
    meta = _Fields(top.obj("eyas"), cfg_file, "eyas.")
    c = DraftConfig(hidden_size=hidden, intermediate_size=f.whole("intermediate_size"),
                    num_attention_heads=heads, num_key_value_heads=f.whole("num_key_value_heads", default=heads),
                    head_dim=f.whole("head_dim", default=max(1, hidden // heads)), target_hidden_size=target_hidden,
                    target_vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layers=list(aux),
                    rms_norm_eps=f.number("rms_norm_eps", 1e-6), rope_theta=theta,
                    max_position_embeddings=f.whole("max_position_embeddings", default=8192),
                    target_num_layers=meta.whole("target_num_layers", default=0, minimum=0),
                    target=dict(meta.obj("target")),
                    num_hidden_layers=layers, rope_scaling=rope_scaling, **variants)
    if target is not None:
        check_fits(c, target, where)
        c.target, c.target_num_layers = target.identity(), target.num_layers
    elif c.hidden_size != c.target_hidden_size:
        raise EyasError(f"{where}: drafter hidden size {c.hidden_size} differs from its target's "
                        f"{c.target_hidden_size}; eyas drafters share the target's embedding width")
    if "d2t" not in norm:
        if c.draft_vocab_size != c.target_vocab_size:
            raise EyasError(f"{where}: tensor 'd2t' is missing and the draft vocabulary ({c.draft_vocab_size}) "
                            f"is smaller than the target's ({c.target_vocab_size})")
        norm["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
    norm["d2t"] = norm["d2t"].long()
    if "t2d" not in norm and tuple(norm["d2t"].shape) == (c.draft_vocab_size,):  # rebuilt from d2t
        ids = norm["d2t"] + torch.arange(c.draft_vocab_size)
        if c.draft_vocab_size and not (0 <= int(ids.min()) and int(ids.max()) < c.target_vocab_size):
            raise EyasError(f"{where}: tensor 'd2t' maps draft ids outside the target's vocabulary of "
                            f"{c.target_vocab_size}; {DAMAGED}")
        norm["t2d"] = torch.zeros(c.target_vocab_size, dtype=torch.bool)
        norm["t2d"][ids] = True
    if "t2d" in norm:
        norm["t2d"] = norm["t2d"].bool()
    has_embed = "embed_tokens.weight" in norm
    check_tensors(_shapes_of(norm), c, where, include_embeddings=has_embed)
    d = Eagle3Drafter(c, target.embed_tokens().weight.detach().float() if target is not None else None)
    if target is not None:
        norm.pop("embed_tokens.weight", None)
    missing, unexpected = d.load_state_dict(norm, strict=False)
    missing = [m for m in missing if m != "embed_tokens.weight"]
    if missing or unexpected:
        raise EyasError(f"{where}: missing tensors {missing}, unexpected {unexpected}")
    return d
