"""Does eyas' SGLang export load into SpecForge's own EAGLE-3 draft model (`LlamaForCausalLMEagle3`, the model
SpecForge trains for SGLang) and compute the same thing? CPU, fp32, seconds (tiny) or ~30 s (smollm2); no GPU, no
network.

SpecForge pins sglang, a CUDA torch and other heavy packages, so it goes into a separate virtualenv that sees the
main environment's packages (torch, transformers, eyas itself), installed without its dependencies:

    python -m venv --system-site-packages /tmp/sfvenv
    /tmp/sfvenv/bin/pip install --no-deps specforge==0.2.0
    /tmp/sfvenv/bin/python bench/interop_specforge.py --target tiny --out /tmp/interop-sf [--rope yarn]

Its draft-model code needs nothing else. One module of the training loop is replaced: `specforge.core.loss` imports
Triton for its CUDA loss kernel; this script never computes a loss (the TTT loop's loss step is replaced, see
`specforge_unroll`), so that module is a stand-in without Triton. The functions SpecForge decorates with
`torch.compile` (rotary table, RMSNorm, apply_rotary_pos_emb, the teacher's softmax) are called undecorated: the
same code, without minutes of CPU compilation (flex attention keeps its own eager path).

What it does: builds a drafter for the target with random, non-trivial weights (norms near 1, a random draft
vocabulary) and the `--rope` kind, exports it with eyas.export.export_drafter for SGLang (the default folder, and one
with the target's embedding included), reads each the way SpecForge's trainer starts from a pretrained draft
(`AutoDraftModelConfig.from_file`, `AutoDraftModel.from_config`, `warm_start_draft_model`, the embedding from the
target folder by `load_embedding`), then checks:

* config: every field SpecForge's LlamaForCausalLMEagle3 reads (layer shapes, head_dim, eps, vocabularies, target
  hidden size, rope, the fc_norm / norm_output switches it has and SGLang does not), the aux-layer ids as SpecForge
  resolves them (`resolve_eagle_capture_layers`, SGLang's numbering: eyas id - 1) and its RoPE cos/sin table;
* weights: no unexpected tensor, only the embedding missing, every tensor bit-equal to eyas' (eyas and SGLang use
  the same names), d2t/t2d equal and read the way SpecForge's accuracy and SGLang's hot_token_id read them;
* forward: a 3-step training-time-test unroll through SpecForge's own `OnlineEagle3Model.forward` (its input shift,
  positions, KV cache; per-step fed-back hidden state and draft logits taken by hooks) on the target's real aux
  states, against eyas' Eagle3Drafter with eyas' TTT attention, under SpecForge's sdpa and flex_attention backends;
* the other direction: the SpecForge model written as SpecForge's SGLang exporter writes it (its serving state,
  save_pretrained, the legacy rope fields) and read back by eyas' import_drafter: the same tensors and unroll.

Input conventions (read from the code): SpecForge's step j takes the token ids shifted left by j (zeros past the
end), positions arange(T) + j (its attention adds the cache depth), the previous step's decoder-layer output before
the final norm, and logits lm_head(norm(h)) (`norm_output`, true by default). eyas and SGLang's draft forward do the
same. Its flex backend masks the last j rows of step j (their token is padding), so those are not compared there.

Rope kinds SpecForge 0.2.0 does not train as SGLang serves them are rows of status KNOWN, saying why (yarn without
`mscale`/`mscale_all_dim` fails to build, longrope has no class, dynamic builds another table); the exit code is 1
only for a FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interop_speculators import Report, add_common_args, chat_inputs, setup, unroll_eyas, write_report  # noqa: E402

# what SGLang's Llama draft layer computes for yarn (its get_rope reads no mscale): written into the config that
# SpecForge reads, where the export alone does not build (see the KNOWN row)
SGLANG_YARN_MSCALE = {"mscale": 1.0, "mscale_all_dim": 0.0}
KNOWN_ROPE = {
    "dynamic": "SpecForge 0.2.0 builds its dynamic-NTK table once for max_position_embeddings + 20 positions "
               "(LlamaDynamicNTKScalingRotaryEmbedding's first cache), where SGLang and vLLM serve the table for "
               "max_position_embeddings x factor (eyas too): a SpecForge-trained dynamic drafter is served with "
               "other frequencies than it trained with",
    "yarn": "SpecForge 0.2.0's yarn needs mscale and mscale_all_dim in the rope settings (it multiplies by them, "
            "None without them: TypeError), which SGLang's Llama draft layer does not read; with the values that "
            "give SGLang's scale (mscale 1, mscale_all_dim 0) it computes what eyas and SGLang do",
    "longrope": "SpecForge 0.2.0 has no longrope rotary embedding (`Unknown RoPE scaling type longrope`), while "
                "SGLang's get_rope serves it (Phi3LongRoPEScaledRotaryEmbedding): a longrope drafter cannot be "
                "trained or fine-tuned with SpecForge; eyas trains and exports it",
}


# ----------------------------------------------------------------------------------- imports

def import_specforge():
    """SpecForge's draft model, config reader, TTT training model and aux-layer resolver."""
    try:
        import specforge  # noqa: F401
    except ModuleNotFoundError:
        sys.exit("specforge is not importable: run this with the virtualenv's python (see the docstring)")
    stub = types.ModuleType("specforge.core.loss")  # imports Triton for a CUDA loss kernel never called here

    class LogSoftmaxLoss:
        @staticmethod
        def apply(*args):
            raise RuntimeError("the loss is not computed by interop_specforge.py")

    stub.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules.setdefault("specforge.core.loss", stub)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flash_attn is not found, falling back to flex_attention"
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.algorithms.model_providers import resolve_eagle_capture_layers
        from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
        from specforge.modeling.draft.registry import DRAFT_REGISTRY
        from specforge.training.model_loading import warm_start_draft_model
    uncompile()
    from importlib.metadata import version
    return types.SimpleNamespace(OnlineEagle3Model=OnlineEagle3Model, resolve=resolve_eagle_capture_layers,
                                 AutoDraftModel=AutoDraftModel, AutoDraftModelConfig=AutoDraftModelConfig,
                                 registry=DRAFT_REGISTRY, warm_start=warm_start_draft_model,
                                 version=version("specforge"))


def uncompile():
    """SpecForge's @torch.compile functions replaced by the functions they wrap (see the docstring)."""
    import specforge.algorithms.eagle3.model as ttt
    import specforge.modeling.draft.llama3_eagle as llama

    for owner, name in ((llama, "apply_rotary_pos_emb"), (llama.LlamaRotaryEmbedding, "forward"),
                        (llama.LlamaRMSNorm, "forward"), (ttt, "_compute_target_p")):
        fn = getattr(owner, name)
        setattr(owner, name, getattr(fn, "_torchdynamo_orig_callable", fn))


# a rope SpecForge cannot build, left out so that the rest of the export can still be checked
NO_ROPE = {"rope_type": "default"}


def read_config(sf, folder: Path, extra_rope: dict | None = None):
    """The config as SpecForge's trainer reads a draft config file; `extra_rope` added to its rope settings
    (NO_ROPE: the settings replaced by plain rope)."""
    path = folder / "config.json"
    if extra_rope:
        raw = json.loads(path.read_text())
        raw["rope_scaling"] = None if extra_rope is NO_ROPE else {**raw["rope_scaling"], **extra_rope}
        path = folder.parent / f"{folder.name}-specforge-config.json"
        path.write_text(json.dumps(raw, indent=2))
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # "Set draft model tie_word_embeddings to False"
        return sf.AutoDraftModelConfig.from_file(str(path))


def load_model(sf, folder: Path, cfg, backend: str, target_folder: str, include_embeddings: bool):
    """The draft model as SpecForge's trainer starts from a pretrained draft folder: built from the config (its
    rotary tables made there), the folder's tensors loaded by `warm_start_draft_model`, the embedding, where the
    folder has none, by `load_embedding` from the target's files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sf.AutoDraftModel.from_config(cfg, attention_backend=backend)
        report = sf.warm_start(model, str(folder), draft_config=cfg, strategy="eagle3",
                               allow_missing_embedding=not include_embeddings)
    if not include_embeddings:
        model.load_embedding(target_folder, embedding_key="model.embed_tokens.weight")
    return model.eval(), report


# ----------------------------------------------------------------------------------- checks

def check_config(rep, sf, c, cfg, model, exported: dict, rope_known: str = ""):
    """`rope_known`: why SpecForge's rope settings cannot be the drafter's (its rope rows are KNOWN then)."""
    S = "config"
    archs = exported.get("architectures") or []
    rep.same(S, "architectures -> SpecForge's draft class", "LlamaForCausalLMEagle3",
             sf.registry[archs[0]].__name__ if len(archs) == 1 and archs[0] in sf.registry else archs, "SpecForge")
    rep.same(S, "built class", "LlamaForCausalLMEagle3", type(model).__name__, "SpecForge")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "max_position_embeddings", "draft_vocab_size", "target_hidden_size"):
        rep.same(S, name, getattr(c, name), getattr(cfg, name, None), "SpecForge")
    rep.same(S, "vocab_size (target's, for embed_tokens)", c.target_vocab_size, cfg.vocab_size, "SpecForge")
    rep.same(S, "hidden_act / pretraining_tp", ("silu", 1), (cfg.hidden_act, cfg.pretraining_tp), "SpecForge")
    # SGLang ties lm_head to the (target-vocabulary) embedding when true; SpecForge forces false on read
    rep.same(S, "tie_word_embeddings as written (SGLang reads it)", False, exported.get("tie_word_embeddings"),
             "file")
    rep.same(S, "one decoder layer (SGLang's layout; SpecForge builds midlayer only)", 1,
             exported.get("num_hidden_layers"), "file")
    rep.same(S, "fc input width (3 x target hidden)", 3 * c.target_hidden_size, model.fc.in_features, "SpecForge")
    # SpecForge's switches, both absent in SGLang: fc_norm (per-aux RMSNorm) must be off, norm_output (logits from
    # norm(h)) on, which is what SGLang's draft computes
    rep.same(S, "fc_norm off / logits from norm(h) (norm_output)", (False, True),
             (model.fc_norm is not None, bool(model.norm_output)), "SpecForge")
    attn = model.midlayer.self_attn
    rep.same(S, "attention head_dim (scale 1/sqrt(head_dim))", c.head_dim, attn.head_dim, "SpecForge")
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    want = dict(c.rope_scaling or {"rope_type": "default"})
    rep.same(S, "rope_theta", c.rope_theta, rope.get("rope_theta"), "SpecForge")
    for check, got in (("rope type", rope.get("rope_type")), ("rope settings", {k: v for k, v in rope.items()
                                                                                if k in want})):
        wanted = want["rope_type"] if check == "rope type" else want
        rep.add(S, check, wanted == got, f"eyas={wanted!r} SpecForge={got!r}" + (f"; {rope_known}" if rope_known
                                                                                 and wanted != got else ""),
                status="KNOWN" if rope_known and wanted != got else None)
    ids = exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    resolved = sf.resolve(types.SimpleNamespace(model=types.SimpleNamespace(aux_hidden_state_layer_ids=None)),
                          exported, None)
    rep.same(S, "aux ids SpecForge captures (SGLang numbering)", [a - 1 for a in c.aux_layers], list(resolved),
             "SpecForge")
    rep.same(S, "aux ids SGLang captures (+1: stream entering layer id+1)", list(c.aux_layers),
             [i + 1 for i in ids], "SGLang")


def check_rope_table(rep, c, model, drafter, known: str = ""):
    """SpecForge's cos/sin table, as its first cache holds it (the training forward slices it), against eyas';
    `known`: why it differs for this rope kind (a KNOWN row then)."""
    import torch

    emb = model.midlayer.self_attn.rotary_emb
    n = min(int(emb.max_seq_len_cached), c.max_position_embeddings)
    p = torch.arange(n)[None]
    ecos, esin = drafter.rope(p, torch.float32)
    scos, ssin = emb.cos_cached[0, 0, :n].float(), emb.sin_cached[0, 0, :n].float()
    diff = max((scos - ecos[0, 0]).abs().max().item(), (ssin - esin[0, 0]).abs().max().item())
    ok = diff <= 1e-4
    rep.add("config", f"RoPE cos/sin table, positions 0..{n - 1}", ok,
            f"max|diff|={diff:.3g}" + ("" if ok or not known else f"; {known}"), status="KNOWN" if known and not ok
            else None)


def check_weights(rep, section, folder: Path, drafter, model, report, target, include_embeddings: bool):
    import torch
    from safetensors.torch import load_file

    ck = load_file(str(folder / "model.safetensors"))
    msd = model.state_dict()
    unexpected = sorted(set(ck) - set(msd))
    missing = sorted(set(msd) - set(ck))
    rep.add(section, "no unexpected tensors", not unexpected, unexpected or f"{len(ck)} tensors, all used")
    allowed = set() if include_embeddings else {"embed_tokens.weight"}
    rep.add(section, "missing only the embedding (taken from the target)", set(missing) <= allowed,
            f"missing {missing}")
    rep.add(section, "warm_start_draft_model: every tensor loaded, none missing but the embedding",
            report.loaded_keys == len(ck) and set(report.missing_keys) <= allowed,
            f"loaded {report.loaded_keys}, missing {list(report.missing_keys)}")
    diffs = [k for k in ck if k in msd and not torch.equal(ck[k].to(msd[k].dtype), msd[k])]
    rep.add(section, "every checkpoint tensor loaded bit-exact", not diffs, diffs or f"{len(ck)} equal")
    esd = drafter.state_dict()
    wrong = [k for k in ck if k in msd and (k not in esd or not torch.equal(esd[k].to(msd[k].dtype), msd[k]))]
    rep.add(section, "loaded tensors = eyas drafter's (same names)", not wrong, wrong or f"{len(ck)} compared")
    emb = target.embed_tokens().weight.detach().float()
    ok = torch.equal(model.embed_tokens.weight.detach().float(), emb)
    how = "from the checkpoint" if include_embeddings else "by SpecForge's load_embedding from the target folder"
    rep.add(section, f"embed_tokens = target's ({how})", ok, "equal" if ok else "differs")


def check_vocab(rep, drafter, model, target):
    import torch

    S = "d2t/t2d"
    rep.add(S, "d2t equal", torch.equal(model.d2t, drafter.d2t), f"{model.d2t.dtype} {tuple(model.d2t.shape)}")
    rep.add(S, "t2d equal", torch.equal(model.t2d, drafter.t2d), f"{model.t2d.dtype} {tuple(model.t2d.shape)}")
    ids = torch.arange(model.d2t.numel()) + model.d2t  # SGLang's hot_token_id; SpecForge's pred + d2t[pred]
    rep.add(S, "arange + d2t (SGLang's hot_token_id) = ascending t2d ids",
            torch.equal(model.t2d.nonzero().flatten(), ids), f"{int(model.t2d.sum())} draft ids")


# ----------------------------------------------------------------------------------- forward

def specforge_unroll(sf, model, x, g, steps: int, backend: str, target_logits):
    """SpecForge's own TTT loop (OnlineEagle3Model.forward) with its loss step replaced (Triton, CUDA-only); the
    fed-back hidden state and the draft logits of each step taken by hooks."""
    import torch

    ttt = sf.OnlineEagle3Model(model, length=steps, attention_backend=backend)

    def no_loss(**kw):
        z = torch.zeros(())
        return z, z, z, z, z, z, z

    ttt._acc_and_loss = no_loss
    hs, lg = [], []
    hooks = [model.midlayer.register_forward_hook(lambda m, a, out: hs.append(out)),
             model.lm_head.register_forward_hook(lambda m, a, out: lg.append(out))]
    T = x.shape[1]
    try:
        with torch.no_grad():
            ttt(input_ids=x, attention_mask=torch.ones(1, T, dtype=torch.bool), target=target_logits,
                loss_mask=torch.ones(1, T, 1), hidden_states=g)
    finally:
        for h in hooks:
            h.remove()
    return hs, lg


def compare_unroll(rep, section, eh, el, sh, sl, flex: bool):
    for j in range(len(eh)):
        n = eh[j].shape[1] - (j if flex else 0)  # flex masks the rows whose token is padding
        rows = f" (positions 0..{n - 1})" if flex and j else ""
        rep.close(section, f"step {j} logits (draft vocab){rows}", sl[j][:, :n], el[j][:, :n])
        rep.close(section, f"step {j} fed-back hidden{rows}", sh[j][:, :n], eh[j][:, :n])
        agree = (sl[j][:, :n].argmax(-1) == el[j][:, :n].argmax(-1)).float().mean().item()
        rep.add(section, f"step {j} argmax draft token equal", agree == 1.0, f"{agree:.1%} of positions")


# ----------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    args = ap.parse_args(argv)

    import torch
    sf = import_specforge()
    import transformers

    target, drafter, folders, exported = setup(args, "sglang", f"specforge {sf.version}")
    c = drafter.config
    out = Path(args.out)
    rep = Report("SpecForge")
    if args.rope == "dynamic":  # the table row says why in full
        rep.forward_known = "SpecForge's dynamic table differs from SGLang's (see the RoPE table row)"

    extra = None
    try:
        cfg = read_config(sf, folders["sglang"])
        model, report = load_model(sf, folders["sglang"], cfg, "sdpa", target.source, False)
        rep.add("load", "AutoDraftModelConfig.from_file + warm_start_draft_model", True,
                f"embedding from {target.source}")
    except (TypeError, ValueError) as e:
        known = KNOWN_ROPE.get(args.rope)
        rep.add("load", "AutoDraftModelConfig.from_file + warm_start_draft_model", False,
                f"{type(e).__name__}: {e}" + (f"; {known}" if known else ""), status="KNOWN" if known else None)
        if not known:
            return finish(rep, out, args, sf, transformers)
        # yarn: the values that make SpecForge's yarn scale SGLang's; else the rope left out, the rest checked
        extra = SGLANG_YARN_MSCALE if args.rope == "yarn" else NO_ROPE
        cfg = read_config(sf, folders["sglang"], extra)
        model, report = load_model(sf, folders["sglang"], cfg, "sdpa", target.source, False)
        rep.add("load", "the same with " + ("rope_scaling left out: the rows below check the rest" if extra is NO_ROPE
                                            else f"{extra} added to rope_scaling"), True, "loads")
    rope_known = KNOWN_ROPE[args.rope] if extra is NO_ROPE else ""
    check_config(rep, sf, c, cfg, model, exported, rope_known)
    if extra is not NO_ROPE:
        check_rope_table(rep, c, model, drafter, KNOWN_ROPE["dynamic"] if args.rope == "dynamic" else "")
    check_weights(rep, "weights sglang/", folders["sglang"], drafter, model, report, target, False)
    check_vocab(rep, drafter, model, target)
    if extra is NO_ROPE:  # another rope than the drafter's: no forward to compare
        return finish(rep, out, args, sf, transformers)

    ids, x, g = chat_inputs(target)  # positions from 0 (SGLang's, eyas')
    with torch.no_grad():
        target_logits = target.model(ids).logits[:, :-1].float()
    eh, el = unroll_eyas(drafter, x, g, torch.arange(x.shape[1])[None], args.steps)
    for name, backend in (("sglang", "sdpa"), ("sglang", "flex_attention"), ("sglang-emb", "sdpa")):
        cfg_n = read_config(sf, folders[name], extra)
        m, report = load_model(sf, folders[name], cfg_n, backend, target.source, name.endswith("-emb"))
        if name.endswith("-emb"):
            check_weights(rep, "weights sglang-emb/", folders[name], drafter, m, report, target, True)
        sh, sl = specforge_unroll(sf, m, x, g, args.steps, backend, target_logits)
        compare_unroll(rep, f"forward {name}/ {backend}", eh, el, sh, sl, flex=backend == "flex_attention")
    check_reimport(rep, model, out / "specforge-export", drafter, target, x, g, args.steps)
    return finish(rep, out, args, sf, transformers)


def check_reimport(rep, model, folder: Path, drafter, target, x, g, steps: int):
    """The other direction: the SpecForge model written the way its SGLang exporter writes one (export/to_sglang.py:
    its serving state, save_pretrained, the legacy rope fields), read back by eyas' import_drafter."""
    import shutil

    import torch
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.export.to_sglang import WEIGHT_MAPS, _serving_state

    from eyas.formats import import_drafter
    from eyas.util import EyasError

    S = "import specforge-export/"
    shutil.rmtree(folder, ignore_errors=True)
    full = {k: v for k, v in model.state_dict().items() if "embed" not in k.lower()}
    model.save_pretrained(str(folder), state_dict=_serving_state(full, WEIGHT_MAPS["LlamaForCausalLMEagle3"]))
    apply_legacy_rope_scaling(str(folder))
    written = json.loads((folder / "config.json").read_text())
    try:
        back = import_drafter(folder, target=target).eval()
    except EyasError as e:
        rep.add(S, "eyas import_drafter reads SpecForge's SGLang export", False, str(e))
        return
    rep.add(S, "eyas import_drafter reads SpecForge's SGLang export", True,
            f"rope_scaling as written: {written.get('rope_scaling')}")
    rep.same(S, "aux layers (eagle_config ids + 1)", list(drafter.config.aux_layers), list(back.config.aux_layers),
             "eyas import")
    rep.same(S, "rope settings", drafter.config.rope_scaling, back.config.rope_scaling, "eyas import")
    esd, bsd = drafter.state_dict(), back.state_dict()
    wrong = [k for k in esd if k not in bsd or not torch.equal(esd[k], bsd[k])]
    rep.add(S, "every tensor equal to the drafter exported", not wrong, wrong or f"{len(esd)} equal")
    pos = torch.arange(x.shape[1])[None]
    eh, el = unroll_eyas(drafter, x, g, pos, steps)
    bh, bl = unroll_eyas(back, x, g, pos, steps)
    rep.add(S, f"{steps}-step unroll equal", all(torch.equal(a, b) for a, b in zip(el + eh, bl + bh)), "bit-equal")


def finish(rep, out: Path, args, sf, transformers) -> int:
    return write_report(rep, out, {"target": args.target, "rope": args.rope, "specforge": sf.version,
                                   "transformers": transformers.__version__},
                        f"eyas SGLang export vs SpecForge {sf.version}")


if __name__ == "__main__":
    sys.exit(main())
