r"""Training throughput of vLLM's `speculators` EAGLE-3 trainer on eyas' data and target, to set
beside bench/bench_train.py (eyas' trainer). Offline: no network, no vLLM.

    # here, once (the wheels are not in git; `/.whl-spec/` is in .git/info/exclude), all pure Python, 2 MiB:
    W="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    $W -d .whl-spec speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 openai==2.54.0 distro==1.9.0 \
       sniffio==1.3.1 pydantic-settings==2.16.3 python-dotenv==1.2.4
    $W -d .whl-spec/if-missing pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    # on the GPU machine (.whl-spec in the call's carry):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/specsite .whl-spec/*.whl
    python3 -c 'import pydantic, annotated_types, typing_inspection' || python3 -m pip install -q --no-index \
        --no-deps --no-compile --target /tmp/specsite .whl-spec/if-missing/*.whl
    PYTHONPATH=$PWD:/tmp/specsite python3 bench/speculators_train.py --out spec.json
    # CPU smoke test: add --target tiny --conversations 60 --steps 4 --batch-tokens 1024 --draft-vocab-size 2048

What runs is speculators' own `speculators train` (speculators.train.cli.main, given a TrainConfig
parsed from an argv: its defaults wherever this script sets nothing): build_draft_model ->
Eagle3DraftModel (its TTT unroll, flex-attention masks, torch.compile'd forward, KL loss in its
"eager" implementation, since the default fused Triton one fails under torch 2.11 (--fused-loss keeps
it); lm_head frozen, from the verifier), its optimizers (Muon + AdamW), linear schedule,
Trainer.run_training and data loader (MultipackDistributedBatchSamplerV2 packing one row of
--batch-tokens, CollateFn, shift_batch, 12 spawn workers). Three names in speculators.train.cli are
wrapped: create_train_val_loaders builds the same loaders over a dataset of eyas' tokenized ShareGPT
(bench_train's conversations, chat template, loss mask, max length) in place of ArrowDataset (a
`datasets` Arrow table; `datasets` with pyarrow is too big to carry, so a stand-in module fills its
import); that dataset reads speculators' offline hidden-state files (hs_<i>.safetensors: token_ids,
[T, 4, H] = 3 aux layers then the last layer's output before the final norm) through its
FileTransfer; the files are written here from eyas' target (`extract_s`, timed apart), where
speculators has vLLM write them. build_draft_model gets timing hooks (and, with --train-lm-head, a
trainable lm_head as eyas has); setup_metric_logger also hands speculators' per-step profile here.
On a CPU (smoke tests only): eager loss, sdpa attention, no workers, the Trainer's device "cpu".

Reports steady-state tokens/s (non-padding tokens over the time from one step's forward to the
next, after warm-up: data wait, forward, backward, optimizers and speculators' own per-step logging
all count; epoch ends with its checkpoint and validation do not), speculators' own step profile,
peak GPU memory of training (the target is freed first) and the resolved speculators settings.
Arguments after `--` go to `speculators train` unchanged (e.g. `-- --optimizer adamw`).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path


def _speculators_data():
    """speculators.train.data imports `datasets` for ArrowDataset only: a stand-in when absent
    (also in the loader's spawned workers, which import this file first)."""
    def missing(*a, **k):
        raise RuntimeError("`datasets` is not installed: bench/speculators_train.py put a stand-in in its place")

    def attr(name):  # any public name: a class that raises when used
        if name.startswith("_"):
            raise AttributeError(name)
        return type(name, (), {"__new__": missing})
    try:
        importlib.import_module("datasets")
    except ImportError:
        sys.modules["datasets"] = types.ModuleType("datasets")
        sys.modules["datasets"].__getattr__ = attr
    import speculators.train.data as data
    return data


try:
    BaseDataset = _speculators_data().BaseDataset
    MISSING = ""
except ImportError as e:  # --help still works; main() says what to install
    BaseDataset, MISSING = object, str(e)


class EyasSplit(BaseDataset):
    """ArrowDataset's `_get_raw_data`, over an eyas TokenSet instead of an Arrow table; file index
    = start + index, as ArrowDataset numbers a split's files."""

    def __init__(self, tokens, transfer, start: int, max_len: int, dtype):
        self.tokens, self.transfer, self.start = tokens, transfer, start
        super().__init__(max_len, dtype)

    def __len__(self):
        return len(self.tokens)

    def _compute_approx_lengths(self):
        return self.tokens.lengths().tolist()

    def _get_raw_data(self, index: int):
        hs = self.transfer.get_cached(self.start + index)
        ids, mask = self.tokens[index]
        if hs is None or not bool((hs["token_ids"] == ids).all()):
            raise RuntimeError(f"hidden states of sample {index} missing or for other tokens")
        return {"hidden_states": hs["hidden_states"][:, :-1].flatten(1), "input_ids": hs["token_ids"],
                "verifier_last_hidden_states": hs["hidden_states"][:, -1], "loss_mask": mask}


def write_features(target, tokens, out: Path, start: int, batch_tokens: int) -> int:
    """speculators' offline format, one file per sequence: the aux states entering layers
    target.aux_layers plus the stream after the last layer, before the final norm (speculators
    applies the verifier's norm and lm_head itself), in bf16."""
    import torch
    from safetensors.torch import save_file

    from eyas.features import plan_batches
    from eyas.features.extract import _pad_batch
    from eyas.target import capture_hidden
    from eyas.util import to_device

    out.mkdir(parents=True, exist_ok=True)
    layers, n, H = list(target.aux_layers) + [target.num_layers], 0, target.hidden_size
    lengths = tokens.lengths().tolist()
    order = sorted(range(len(tokens)), key=lambda i: -lengths[i])  # longest first, batches of similar lengths
    for a, b in plan_batches([lengths[i] for i in order], batch_tokens):  # eyas extraction's batches
        take = order[a:b]
        batch, _ = _pad_batch(tokens, take, pin=False)
        T = batch.shape[1]
        with torch.no_grad():
            hs, _ = capture_hidden(target.model, layers, to_device(batch, target.device))
        hs = hs.view(len(take), T, len(layers), H).to(torch.bfloat16).cpu()
        for r, i in enumerate(take):
            L = lengths[i]
            save_file({"token_ids": batch[r, :L].clone(), "hidden_states": hs[r, :L].contiguous()},
                      str(out / f"hs_{start + i}.safetensors"))
            n += hs[r, :L].numel() * 2
    return n


class Probe:
    """Times training steps and counts their real tokens: a forward pre-hook on the drafter (in
    training mode) syncs and stamps each step's start; a global optimizer hook stamps the end."""

    def __init__(self, device):
        self.device, self.starts, self.tokens, self.end, self.profiles, self.val = device, [], [], 0.0, [], []

    def sync_now(self) -> float:
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def attach(self, model) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def pre(module, args, kwargs):
            if module.training:
                self.starts.append(self.sync_now())
                self.tokens.append((kwargs["document_ids"] != -1).sum())
        model.register_forward_pre_hook(pre, with_kwargs=True)
        register_optimizer_step_post_hook(lambda *a: setattr(self, "end", self.sync_now()))

    def emit(self, record) -> None:  # a logging handler on speculators.metrics
        if isinstance(record.msg, dict) and record.msg.get("profile"):
            self.profiles.append(record.msg["profile"])
        if isinstance(record.msg, dict) and "val" in record.msg:
            self.val.append(record.msg["val"])

    def summary(self, warm: int, epoch_ends: list[int]) -> dict:
        toks = [int(t) for t in self.tokens]
        ends = self.starts[1:] + [self.end]
        # a step's time runs to the next step's start, except across an epoch end (saving, validation)
        steps = [i for i in range(warm, len(toks)) if i + 1 not in epoch_ends or i == len(toks) - 1]
        secs = sum(ends[i] - self.starts[i] for i in steps)
        prof = self.profiles[warm:]
        med = {k: round(statistics.median(p[k] for p in prof), 2)
               for k in ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms", "tokens_per_s")} if prof else None
        return {"steps": len(toks), "tokens_trained": sum(toks), "steady_steps": len(steps),
                "tok_s_steady": sum(toks[i] for i in steps) / secs if secs > 0 else None,
                "tok_s_overall": sum(toks) / (self.end - self.starts[0]) if toks else None,
                "speculators_profile_median": med, "val": self.val[-1:] or None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="speculators_train.json")
    p.add_argument("--target", default="smollm2", help="eyas target (smollm2, tiny, an HF folder)")
    p.add_argument("--conversations", type=int, default=1500)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-tokens", type=int, default=16384, help="speculators --total-seq-len (tokens per step)")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--draft-intermediate-size", type=int, default=6144,
                   help="drafter MLP width (eyas' GPU preset for SmolLM2: 6144; 0 = the target's, speculators' default)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--train-lm-head", action="store_true",
                   help="train the drafter's lm_head as eyas does (speculators keeps it frozen)")
    p.add_argument("--fused-loss", action="store_true",
                   help="keep speculators' default fused Triton loss on a GPU (it failed under torch 2.11; without "
                        "this flag the run passes --loss-implementation eager)")
    p.add_argument("--workdir", default="", help="run directory (default: a temporary one)")
    p.add_argument("--data", default="", help="data set (default: $EYAS_STAGE_DIR/sharegpt.json.gz or the PyPI package)")
    a, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    if MISSING:
        p.exit(2, f"{p.prog}: speculators is not importable ({MISSING}); install its wheels as this file's "
                  f"docstring says and put them on PYTHONPATH\n")

    from importlib.metadata import version

    import numpy as np
    import torch

    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_mod
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from eyas.config import resolve
    from eyas.data.prepare import load_tokens, run_tokenize, tokens_dir
    from eyas.target import load_target
    from eyas.vocab import d2t_t2d, load_vocab, run_vocab, vocab_dir

    stage = os.environ.get("EYAS_STAGE_DIR", "")
    src = str(Path(stage) / "sharegpt.json.gz") if stage and (Path(stage) / "sharegpt.json.gz").exists() else "sharegpt"
    run = Path(a.workdir or tempfile.mkdtemp(prefix="eyas-bench-spec-"))
    cfg = resolve(preset_name="smollm2", overrides={
        "out": str(run), "data.source": a.data or src, "data.limit": a.conversations, "data.max_seq_len": a.max_seq_len,
        "vocab.draft_vocab_size": a.draft_vocab_size, "target.name": a.target})
    t0 = time.perf_counter()
    target = load_target(cfg.target)
    if not (tokens_dir(run) / "meta.json").exists():
        run_tokenize(cfg, target)
    if not (vocab_dir(run) / "vocab.safetensors").exists():
        run_vocab(cfg, target)
    train, val = load_tokens(run, "train"), load_tokens(run, "val")
    d2t, t2d = d2t_t2d(load_vocab(run, target), target.vocab_size)
    (spec := run / "speculators").mkdir(exist_ok=True)
    np.save(spec / "d2t.npy", d2t.numpy())
    np.save(spec / "t2d.npy", t2d.numpy())
    prep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hs_dir = spec / "data" / "hidden_states"
    fresh = not (hs_dir / "done").exists()  # else: the files of an earlier run in --workdir
    if fresh:
        n = write_features(target, train, hs_dir, 0, a.batch_tokens)
        (hs_dir / "done").write_text(str(n + write_features(target, val, hs_dir, len(train), a.batch_tokens)))
    feat_bytes, extract_s = int((hs_dir / "done").read_text()), time.perf_counter() - t0
    extract_tok_s = (train.n_tokens + val.n_tokens) / extract_s if fresh else None
    verifier, aux, device = target.source, list(target.aux_layers), target.device
    del target
    gc.collect()

    argv_spec = ["--verifier-name-or-path", verifier, "--data-path", str(spec / "data"),
                 "--save-path", str(spec / "ckpt"), "--no-resume-from-checkpoint",
                 "--total-seq-len", str(a.batch_tokens), "--ttt-steps", str(a.ttt_steps),
                 "--draft-vocab-size", str(a.draft_vocab_size), "--d2t-path", str(spec / "d2t.npy"),
                 "--t2d-path", str(spec / "t2d.npy"), "--target-layer-ids", *map(str, aux)]
    if device.type != "cuda":  # its fused loss is Triton and flex attention has no backward: GPU only
        argv_spec += ["--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0"]
    elif not any(x.startswith("--loss-implementation") for x in extra) and not a.fused_loss:
        # its default, the fused Triton loss, fails under the GPU image's torch 2.11: dynamo, compiling the
        # forward with the loss inside, stops in the loss's backward kernel ("ListVariable(length=21) is already
        # tracked for mutation"). "eager" is the option speculators offers for
        # compatibility (the same KL divergence in torch ops, compiled with the rest of the forward)
        argv_spec += ["--loss-implementation", "eager"]
    base = TrainConfig.resolve(argv_spec + extra).flatten()
    if a.draft_intermediate_size:  # the way to size the drafter in speculators: --draft-config
        lc = cli.create_transformer_layer_config(verifier, base["num_layers"], base["draft_arch"],
                                                 base["draft_hidden_act"], base["sliding_window"],
                                                 base["full_attention_indices"], base["draft_mrope_full_head_hack"])
        lc.intermediate_size = a.draft_intermediate_size
        lc.save_pretrained(str(spec / "draft_config"))
        argv_spec += ["--draft-config", str(spec / "draft_config")]
    # epochs enough for --steps (each ends with speculators' checkpoint and validation: left out of the rate)
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=a.batch_tokens, lengths=train.lengths().tolist(),
                                                 num_replicas=1, rank=0, seed=base["seed"])
    epoch_ends = []
    while not epoch_ends or epoch_ends[-1] < a.steps:
        sampler.set_epoch(len(epoch_ends))
        epoch_ends.append((epoch_ends or [0])[-1] + len(sampler))
    argv_spec += ["--epochs", str(len(epoch_ends)), "--max-steps", str(a.steps)]
    spec_cfg = TrainConfig.resolve(argv_spec + extra)

    probe = Probe(device)
    sizes = {}

    def loaders(*, total_seq_len, hidden_states_dtype, transfer, hidden_size, num_target_layers, num_workers,
                prefetch_factor, preprocess, seed, **_):
        kw = dict(num_target_layers=num_target_layers, num_workers=num_workers, prefetch_factor=prefetch_factor,
                  preprocess=preprocess)
        tl = _setup_dataloader(EyasSplit(train, transfer, 0, total_seq_len, hidden_states_dtype), total_seq_len,
                               hidden_size, seed=seed, **kw)
        vl = _setup_dataloader(EyasSplit(val, transfer, len(train), total_seq_len, hidden_states_dtype),
                               total_seq_len, hidden_size, **kw)
        sizes["train_batches_per_epoch"], sizes["val_batches"] = len(tl), len(vl)
        return tl, vl

    build, setup_metric_logger = cli.build_draft_model, cli.setup_metric_logger

    def build_and_probe(*args, **kw):
        m = build(*args, **kw)
        if a.train_lm_head:
            m.lm_head.weight.requires_grad_(True)
        sizes["trainable_params"] = sum(x.numel() for x in m.parameters() if x.requires_grad)
        probe.attach(m)
        return m

    def setup_and_listen(*args, **kw):
        setup_metric_logger(*args, **kw)
        (h := logging.Handler()).emit = probe.emit
        logging.getLogger("speculators.metrics").addHandler(h)

    cli.create_train_val_loaders, cli.build_draft_model, cli.setup_metric_logger = \
        loaders, build_and_probe, setup_and_listen
    if device.type != "cuda":  # the Trainer puts the model on local rank 0 = cuda:0; its step timer syncs one
        trainer_mod.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *args, **kw: None
    else:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        sizes["memory_before_train_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)  # target left over, if any
    t0 = time.perf_counter()
    cli.main(spec_cfg)
    train_s, warm, s = time.perf_counter() - t0, min(5, max(0, a.steps // 4)), spec_cfg.flatten()
    keys = ("num_layers draft_arch norm_before_residual norm_before_fc norm_output fc_norm sliding_window "
            "full_attention_indices draft_attn_impl loss_fn loss_implementation ttt_steps ttt_step_loss_decay optimizer "
            "lr muon_lr weight_decay scheduler_type hidden_states_dtype total_seq_len num_workers log_freq seed").split()
    out = {
        "bench": "speculators_train", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "speculators": version("speculators"), "target": a.target, "conversations": a.conversations,
        "train_sequences": len(train), "val_sequences": len(val), "batch_tokens": a.batch_tokens,
        "ttt_steps": a.ttt_steps, "draft_vocab_size": a.draft_vocab_size,
        "draft_intermediate_size": a.draft_intermediate_size or "target's", "train_lm_head": a.train_lm_head,
        **sizes, "warmup_steps": warm, **probe.summary(warm, epoch_ends),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "prep_s": round(prep_s, 1), "extract_s": round(extract_s, 1), "extract_tok_s": extract_tok_s,
        "feature_bytes": feat_bytes, "train_s": round(train_s, 1), "speculators_settings": {k: s.get(k) for k in keys},
        "speculators_argv": argv_spec + extra, "run": str(run),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    Path(a.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
