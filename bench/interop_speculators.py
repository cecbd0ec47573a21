"""Does eyas' vLLM export load into the speculators library's own EAGLE-3 model and compute the
same thing? CPU, fp32, a few seconds (tiny) or ~30 s (smollm2); no GPU, no network.

speculators' full dependency set is heavy, so it goes into a separate virtualenv that sees the
main environment's packages (torch, transformers, pydantic, eyas itself):

    python -m venv --system-site-packages /tmp/specvenv
    /tmp/specvenv/bin/pip install --no-deps speculators==0.9.0     # or the wheel file
    /tmp/specvenv/bin/pip install loguru            # its model code also needs pydantic(-settings)
    /tmp/specvenv/bin/python bench/interop_speculators.py --target tiny --out /tmp/interop

What it does: builds a drafter for the target with random, non-trivial weights (norms included, a
random draft vocabulary), exports it twice with eyas.export.export_drafter (the default folder,
and one with the target's embedding included), loads each with
`Eagle3SpeculatorConfig.from_pretrained` + `Eagle3DraftModel.from_pretrained`, then checks:

* config: every field speculators reads (layer shapes, head_dim, eps, rope, aux-layer ids, draft
  vocabulary, norm flags) against eyas' DraftConfig, plus the RoPE cos/sin tables it builds;
* weights: no unexpected tensor, only speculators' ignorable ones missing, every tensor bit-equal,
  d2t/t2d equal and consistent with how speculators and vLLM use them;
* forward: a 3-step training-time-test unroll on the target's real aux states (speculators'
  `forward`, per-step logits and fed-back hidden state taken by hooks) against eyas'
  Eagle3Drafter with eyas' TTT attention, same token ids and positions, under speculators' default
  flex attention and under eager attention.

Input conventions (read from the code): speculators' shift_batch pairs token x_{t+1} with the aux
state of position t and gives it rope position t+1; vLLM's proposer and eyas use position t. Later
TTT steps take the ground-truth tokens shifted by one more (zeros past the end) and positions + 1.
The fed-back state is the decoder layer's output before the final norm in all three (norm_output
false). RoPE only sees position differences, so the offset is harmless; a row checks that too.

The speculators loader resolves `speculators_config.verifier.name_or_path` (aux-id validation,
embedding and verifier lm_head); eyas writes the hub id there, so this script points it at the
local copy of the target. vLLM itself takes the target from the command line.
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

RTOL = 2e-5  # per position: max |a-b| <= RTOL * max(1, max|reference|) (fp32, same math twice)


# ----------------------------------------------------------------------------------- imports

def import_speculators():
    """speculators.models.eagle3 imports its training-data module (openai, datasets, hs_connectors)
    only for a type alias; without those packages a one-line stand-in is used for that module."""
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ModuleNotFoundError as e:
        if e.name in (None, "speculators"):
            sys.exit("speculators is not importable: run this with the virtualenv's python (see the docstring)")
        stub = types.ModuleType("speculators.train.data")
        stub.BatchType = dict
        sys.modules["speculators.train.data"] = stub
        print(f"note: {e.name!r} is not installed; speculators.train.data replaced by a stand-in (BatchType only)")
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    try:
        from loguru import logger
        logger.remove()
        logger.add(sys.stderr, level="ERROR")
    except ImportError:
        pass
    from importlib.metadata import version
    return Eagle3DraftModel, Eagle3SpeculatorConfig, version("speculators")


# ----------------------------------------------------------------------------------- report

class Report:
    def __init__(self, other: str = "speculators"):
        self.other = other  # the implementation compared with, as the summary names it
        self.rows: list[dict] = []
        self.forward_known = ""  # why speculators' forward cannot equal the engines' (and eyas') for this rope

    def add(self, section, check, ok, detail="", status=None):
        if not ok and status is None and self.forward_known and section.startswith("forward"):
            status, detail = "KNOWN", f"{detail}; {self.forward_known}"
        self.rows.append({"section": section, "check": check,
                          "status": status or ("PASS" if ok else "FAIL"), "detail": str(detail)})

    def same(self, section, check, eyas_value, other_value, other="speculators"):
        self.add(section, check, eyas_value == other_value, f"eyas={eyas_value!r} {other}={other_value!r}")

    def close(self, section, check, got, ref, extra=""):
        """Per position (last dim = features), so a large outlier elsewhere cannot hide an error."""
        diff = (got - ref).abs().amax(-1)
        scale = ref.abs().amax(-1).clamp(min=1.0)
        ok = bool((diff <= RTOL * scale).all())
        self.add(section, check, ok, f"max|diff|={diff.max().item():.3g} (max|ref|={ref.abs().max().item():.3g}, "
                                     f"worst diff/scale={(diff / scale).max().item():.2g}){extra}")

    def print(self):
        w = [max(len(r[k]) for r in self.rows) for k in ("section", "check")]
        for r in self.rows:
            print(f"{r['status']:<5} {r['section']:<{w[0]}}  {r['check']:<{w[1]}}  {r['detail']}")
        n_fail = sum(r["status"] == "FAIL" for r in self.rows)
        n_known = sum(r["status"] == "KNOWN" for r in self.rows)
        print(f"\n{len(self.rows)} checks: {len(self.rows) - n_fail - n_known} pass, {n_fail} fail, "
              f"{n_known} known {self.other}-side issue(s)")
        return n_fail


# ----------------------------------------------------------------------------------- pieces

# rope settings --rope gives the drafter (the target keeps its own): each kind the engines serve, scaled over an
# original length of 64 so that the compared positions reach past it
ROPES = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0},
         "dynamic": {"rope_type": "dynamic", "factor": 2.0},
         "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64},
         "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                  "beta_slow": 1.0},
         "longrope": "longrope"}  # its factors per frequency, made for the head_dim in make_drafter
VARIANT_NAMES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "qwen3")


def make_drafter(target, draft_vocab: int, seed: int, rope: str = "default", variants=()):
    """A drafter whose every tensor is non-trivial (norm weights near 1, not 1), so a swapped or
    dropped tensor changes the output; with `rope` and `variants` (VARIANT_NAMES) as eyas builds them."""
    import dataclasses

    import torch

    from eyas.draft import Eagle3Drafter, build_drafter

    torch.manual_seed(seed)
    ids = torch.randperm(target.vocab_size)[:draft_vocab].sort().values
    v = {("layer_type" if n == "qwen3" else n): ("qwen3" if n == "qwen3" else True) for n in variants}
    d = build_drafter(target, draft_vocab, draft_ids=ids, variants=v)
    if rope != "default":
        scaling = ROPES[rope]
        if scaling == "longrope":
            half = d.config.head_dim // 2
            scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
                       "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 64}
        c = dataclasses.replace(d.config, rope_scaling=scaling, max_position_embeddings=256)
        d2 = Eagle3Drafter(c, target.embed_tokens().weight.detach().float())
        d2.load_state_dict(d.state_dict())
        d = d2
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return d.eval()


def conversation_ids(target):
    import torch

    msgs = [{"role": "user", "content": "Write a haiku about a young hawk, then explain it in one sentence."},
            {"role": "assistant", "content": "Young hawk leaves the nest, wind under untested wings, the sky "
                                             "teaches it.\nIt is about learning by doing: the bird only learns "
                                             "to fly once it is in the air."}]
    out = target.tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)
    return torch.tensor(out["input_ids"])[None]


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The options every interop script takes: the target, the output folder, the drafter's draft vocabulary, seed
    and rope kind, and the TTT steps to unroll."""
    ap.add_argument("--target", choices=["tiny", "smollm2"], default="tiny", help="eyas target preset")
    ap.add_argument("--out", required=True, help="folder for the exported drafters and interop.json")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft vocabulary size (default 2048 tiny, 8192 smollm2)")
    ap.add_argument("--steps", type=int, default=3, help="TTT steps to unroll")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drafter's random weights and vocabulary")
    ap.add_argument("--rope", choices=list(ROPES), default="default",
                    help="rope kind of the drafter (its settings in interop_speculators.ROPES; "
                         "max_position_embeddings 256)")


def setup(args, fmt: str, other: str, variants=None):
    """The start every interop script shares: torch on at most 2 threads, the target (`args.target`, fp32 on the
    CPU), a drafter for it (make_drafter) exported for `fmt` twice, to out/<fmt> and, with the target's embedding,
    out/<fmt>-emb; a line naming `other` (the implementation and its version), the versions, the target and the
    drafter (and `variants` when given) -> (target, drafter, {folder name: path}, the config.json of out/<fmt>)."""
    import torch
    import transformers

    from eyas.config import TargetConfig
    from eyas.export import export_drafter
    from eyas.serve_target import verifier_name
    from eyas.target import load_target

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    # flex attention runs uncompiled on the CPU and says so once per call
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    tcfg = TargetConfig(name=args.target, dtype="float32", device="cpu")
    target = load_target(tcfg)
    drafter = make_drafter(target, args.draft_vocab or (2048 if args.target == "tiny" else 8192), args.seed,
                           args.rope, variants or ())
    c = drafter.config
    print(f"{other}, transformers {transformers.__version__}, torch {torch.__version__}; target {args.target} "
          f"({target.num_layers} layers, H {c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}, "
          f"head_dim {c.head_dim}, theta {c.rope_theta}), draft vocab {c.draft_vocab_size}, aux {c.aux_layers}, "
          f"rope {c.rope_scaling or 'default'}" + ("" if variants is None else f", variants {variants or 'none'}")
          + "\n")
    out = Path(args.out)
    folders = {name: export_drafter(drafter, out / name, fmt, verifier_name(tcfg), include_embeddings=emb,
                                    num_speculative_tokens=args.steps)
               for name, emb in ((fmt, False), (f"{fmt}-emb", True))}
    exported = json.loads((folders[fmt] / "config.json").read_text())
    return target, drafter, folders, exported


def chat_inputs(target):
    """The drafter's inputs for a chat (conversation_ids) -> (ids [1, T], x = ids[:, 1:], g = the target's aux states
    at positions 0..T-2): x_{t+1} paired with the aux state of t."""
    ids = conversation_ids(target)
    aux, _ = target.capture(ids)
    print(f"inputs: {ids.shape[1]} tokens of a chat, aux states from the target ({aux.shape[-1]} wide)")
    return ids, ids[:, 1:], aux[:, :-1]


def write_report(rep, out: Path, record: dict, summary: str) -> int:
    """Print the report's rows, write them after `record` to out/interop.json, and end with PASS or FAIL and
    `summary` -> the exit code: 1 where a check failed."""
    print()
    n_fail = rep.print()
    out.mkdir(parents=True, exist_ok=True)
    (out / "interop.json").write_text(json.dumps({**record, "rows": rep.rows}, indent=2) + "\n")
    print(f"{'FAIL' if n_fail else 'PASS'}: {summary}  ({out / 'interop.json'})")
    return 1 if n_fail else 0


def load_speculators(classes, folder: Path, verifier_path: str, attn: str | None):
    Eagle3DraftModel, Eagle3SpeculatorConfig = classes
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    written_verifier = cfg.speculators_config.verifier.name_or_path
    cfg.speculators_config.verifier.name_or_path = verifier_path
    if attn:
        cfg.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel.from_pretrained(str(folder), config=cfg).eval()
    return cfg, model, written_verifier


def unroll_speculators(model, x, g, pos, steps: int, pad_to: int = 0):
    """speculators' own forward (ttt_steps unroll); per-step fed-back hidden state and draft-vocab
    logits taken by hooks. With pad_to, the row is padded (document id -1) as its flex path needs."""
    import torch

    T = x.shape[1]
    doc = torch.zeros(1, T, dtype=torch.long)
    if pad_to:
        pad = -(-T // pad_to) * pad_to - T
        x = torch.cat([x, x.new_zeros(1, pad)], 1)
        g = torch.cat([g, g.new_zeros(1, pad, g.shape[-1])], 1)
        pos = None if pos is None else torch.cat([pos, pos.new_zeros(1, pad)], 1)
        doc = torch.cat([doc, torch.full((1, pad), -1, dtype=torch.long)], 1)
    hs, lg = [], []
    hooks = [model.layers[-1].register_forward_hook(
                 lambda m, a, out: hs.append(out[0] if isinstance(out, tuple) else out)),
             model.lm_head.register_forward_hook(lambda m, a, out: lg.append(out))]
    try:
        with torch.no_grad():
            toks = model(hidden_states=g, input_ids=x, document_ids=doc, position_ids=pos, ttt_steps=steps)
    finally:
        for h in hooks:
            h.remove()
    return [h[:, :T] for h in hs], [z[:, :T] for z in lg], [t[:, :T] for t in toks]


def unroll_eyas(drafter, x, g, pos, steps: int):
    """The same unroll with eyas' drafter and TTT attention: step j sees x shifted by j (zeros
    past the end), the previous step's hidden state, positions + j."""
    import torch

    from eyas.train.attention import TTTAttend

    T = x.shape[1]
    attend = TTTAttend(torch.zeros(T, dtype=torch.int32), "auto", steps)
    hidden, hs, lg = g, [], []
    with torch.no_grad():
        for j in range(steps):
            xj = torch.cat([x[:, j:], x.new_zeros(1, j)], 1)
            hidden, logits = drafter(xj, hidden, pos + j, attend)
            hs.append(hidden)
            lg.append(logits)
    return hs, lg


def compare_unroll(rep, section, eh, el, sh, sl, stoks, model=None):
    if model is not None and model.config.norm_output:  # the hooks took the layer's output; the normed one is fed back
        import torch

        with torch.no_grad():
            sh = [model.norm(h) for h in sh]
    for j in range(len(eh)):
        rep.close(section, f"step {j} logits (draft vocab)", sl[j], el[j])
        rep.close(section, f"step {j} fed-back hidden", sh[j], eh[j])
        # a token whose eyas logit ties the maximum within the tolerance is an argmax either side could pick
        top = el[j].amax(-1)
        picked = el[j].gather(-1, stoks[j].long().unsqueeze(-1)).squeeze(-1)
        tie = (top - picked) <= RTOL * top.abs().clamp(min=1.0)
        agree = ((stoks[j] == el[j].argmax(-1)) | tie).float().mean().item()
        rep.add(section, f"step {j} speculators' draft tokens = eyas argmax (ties within tolerance allowed)",
                agree == 1.0, f"{agree:.1%} of positions")


# ----------------------------------------------------------------------------------- checks

def rope_windows(c):
    """Positions to compare the cos/sin tables at: all the config allows; dynamic at the engines' one length
    (max_position_embeddings x factor, where transformers' per-call table is the engines'); longrope wholly below
    and wholly above original_max_position_embeddings (transformers picks short or long factors by a call's last
    position, eyas and the engines per position)."""
    import torch

    kind = (c.rope_scaling or {}).get("rope_type", "default")
    if kind == "dynamic":
        return [torch.arange(int(c.max_position_embeddings * c.rope_scaling["factor"]))[None]]
    if kind == "longrope":
        o = c.rope_scaling["original_max_position_embeddings"]
        return [torch.arange(o)[None], torch.arange(o, c.max_position_embeddings)[None]]
    return [torch.arange(c.max_position_embeddings)[None]]


def check_config(rep, c, cfg, model, exported: dict, drafter):
    import torch

    S = "config"
    lc = cfg.transformer_layer_config
    rep.same(S, "speculators_model_type / config class", "eagle3",
             f"{cfg.speculators_model_type}" if type(cfg).__name__ == "Eagle3SpeculatorConfig" else type(cfg).__name__)
    rep.same(S, "layer config model_type (decoder-layer family)", c.layer_type, lc.model_type)
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "max_position_embeddings"):
        rep.same(S, name, getattr(c, name), getattr(lc, name))
    rep.same(S, "num_hidden_layers (1 = EAGLE-3 layer only)", 1, lc.num_hidden_layers)
    rep.same(S, "vocab_size (target's, for embed_tokens)", c.target_vocab_size, lc.vocab_size)
    rep.same(S, "draft_vocab_size", c.draft_vocab_size, cfg.draft_vocab_size)
    rep.same(S, "target_hidden_size", c.target_hidden_size, cfg.target_hidden_size)
    rep.same(S, "hidden_act / attention_bias / mlp_bias", ("silu", False, False),
             (lc.hidden_act, lc.attention_bias, lc.mlp_bias))
    rope = dict(getattr(lc, "rope_parameters", None) or {})
    want = dict(c.rope_scaling or {"rope_type": "default"})
    rep.same(S, "rope type", want["rope_type"], rope.get("rope_type"))
    rep.same(S, "rope_theta", c.rope_theta, rope.get("rope_theta"))
    rep.same(S, "rope settings", want, {k: v for k, v in rope.items() if k != "rope_theta" and
                                        (k in want or k == "rope_type")})
    # the cos/sin tables both sides rotate q and k with
    for p in rope_windows(c):
        ecos, esin = drafter.rope(p, torch.float32)
        with torch.no_grad():
            scos, ssin = model.rotary_emb(torch.zeros(1, 1, 2 * c.hidden_size), p)
        same_shape = tuple(scos.shape) == tuple(ecos[:, 0].shape)
        diff = (max((scos - ecos[:, 0]).abs().max().item(), (ssin - esin[:, 0]).abs().max().item())
                if same_shape else None)
        rep.add(S, f"instantiated RoPE cos/sin, positions {int(p[0, 0])}..{int(p[0, -1])}",
                same_shape and diff <= 1e-4,
                f"max|diff|={diff:.3g}" if same_shape else f"shape {tuple(scos.shape)} vs {tuple(ecos[:, 0].shape)}")
    attn = model.layers[0].self_attn
    rep.same(S, "attention scale 1/sqrt(head_dim)", round(c.head_dim ** -0.5, 9), round(float(attn.scaling), 9))
    rep.same(S, "eagle_aux_hidden_state_layer_ids (as written)", list(c.aux_layers),
             exported["eagle_aux_hidden_state_layer_ids"])
    rep.same(S, "aux ids after speculators resolves them", list(c.aux_layers), list(model.target_layer_ids))
    rep.same(S, "fc input width (aux count x hidden)", len(c.aux_layers) * c.target_hidden_size, model.fc.in_features)
    flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    rep.same(S, "norm flags " + "/".join(flags), tuple(getattr(c, f) for f in flags),
             tuple(bool(getattr(cfg, f)) for f in flags))
    rep.same(S, "built: first layer's residual normed", c.norm_before_residual, model.layers[0].norm_before_residual)
    rep.same(S, "built: input_norm / fc_norm modules", (c.norm_before_fc, c.fc_norm),
             (model.input_norm is not None, model.fc_norm is not None))
    # what vLLM's speculators adapter (update_eagle3) takes from the same file; it defaults
    # norm_before_residual to True when the key is absent
    rep.same(S, "vLLM reads norm_before_residual", c.norm_before_residual,
             exported.get("norm_before_residual", True), "vLLM")
    rep.same(S, "vLLM reads aux ids (used as-is)", list(c.aux_layers), exported.get("eagle_aux_hidden_state_layer_ids"),
             "vLLM")
    spt = exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    rep.same(S, "speculative_tokens (vLLM num_speculative_tokens)", spt,
             cfg.speculators_config.proposal_methods[0].speculative_tokens)


def check_weights(rep, section, folder: Path, drafter, model, target, include_embeddings: bool):
    import torch
    from safetensors.torch import load_file

    ck = load_file(str(folder / "model.safetensors"))
    msd = model.state_dict()
    unexpected = sorted(set(ck) - set(msd))
    missing = sorted(set(msd) - set(ck))
    ignorable = set(type(model)._keys_to_ignore_on_load_missing)
    rep.add(section, "no unexpected tensors", not unexpected, unexpected or f"{len(ck)} tensors, all used")
    bad_missing = [k for k in missing if k not in ignorable]
    rep.add(section, "missing only speculators' ignorable keys", not bad_missing,
            f"missing {missing}" + (f"; NOT ignorable: {bad_missing}" if bad_missing else ""))
    diffs = [k for k in ck if k in msd and not torch.equal(ck[k].to(msd[k].dtype), msd[k])]
    rep.add(section, "every checkpoint tensor loaded bit-exact", not diffs, diffs or f"{len(ck)} equal")
    esd = {k.replace("midlayer.", "layers.0.", 1): v for k, v in drafter.state_dict().items()}
    both = [k for k in ck if k in msd and k in esd]
    wrong = [k for k in both if not torch.equal(esd[k].to(msd[k].dtype), msd[k])]
    rep.add(section, "loaded tensors = eyas drafter's (layers.0 <-> midlayer)", not wrong and len(both) == len(ck),
            wrong or f"{len(both)} of {len(ck)} compared")
    nan = [k for k, v in msd.items() if v.is_floating_point() and bool(v.isnan().any())]
    rep.add(section, "no NaN (speculators' not-loaded marker) left", not nan, nan or "none")
    emb = target.embed_tokens().weight.detach().float()
    got = model.embed_tokens.weight.detach().float()
    ok = torch.equal(got, emb)
    if include_embeddings:
        rep.add(section, "embed_tokens = target's (from the checkpoint)", ok, "equal" if ok else "differs")
    else:
        # vLLM shares the target's embedding when the checkpoint has none; speculators is meant to
        # load it from the verifier, but only does so when the weight still holds its NaN marker
        rep.add(section, "embed_tokens = target's after from_pretrained", ok,
                "equal" if ok else f"not loaded (abs sum {got.abs().sum().item():.3g}): transformers builds the "
                "model on the meta device and fills missing weights with torch.empty, so the NaN marker "
                "load_verifier_weights looks for is gone; vLLM is unaffected (shares the target's)",
                status=None if ok else "KNOWN")
    return ok


def check_vocab(rep, drafter, model, target):
    import torch

    S = "d2t/t2d"
    rep.add(S, "d2t equal", torch.equal(model.d2t, drafter.d2t), f"{model.d2t.dtype} {tuple(model.d2t.shape)}")
    rep.add(S, "t2d equal", torch.equal(model.t2d, drafter.t2d), f"{model.t2d.dtype} {tuple(model.t2d.shape)}")
    ids = torch.arange(model.d2t.numel()) + model.d2t
    ok = torch.equal(model.t2d.nonzero().flatten(), ids)
    rep.add(S, "arange + d2t (vLLM's target ids) = ascending t2d ids", ok, f"{int(model.t2d.sum())} draft ids")
    lm = target.model.get_output_embeddings().weight.detach().float()
    ok = torch.equal(model.verifier_lm_head.weight.float(), lm[ids])
    rep.add(S, "speculators' verifier_lm_head = target lm_head[t2d] rows of d2t ids", ok,
            "equal" if ok else "differs: draft index order disagrees")


# ----------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--variant", default="", help="comma-separated drafter variants: " + ", ".join(VARIANT_NAMES)
                    + " (norm_before_fc and fc_norm exclude each other)")
    args = ap.parse_args(argv)
    variants = [v for v in args.variant.split(",") if v]
    for v in variants:
        if v not in VARIANT_NAMES:
            ap.error(f"--variant {v!r} is not one of {', '.join(VARIANT_NAMES)}")

    import torch
    Eagle3DraftModel, Eagle3SpeculatorConfig, spec_version = import_speculators()
    import transformers

    target, drafter, folders, exported = setup(args, "vllm", f"speculators {spec_version}", variants)
    c = drafter.config
    rep = Report()
    if args.rope in ("dynamic", "longrope"):
        rep.forward_known = {
            "dynamic": "speculators trains with transformers' dynamic rope, plain rope below "
                       "max_position_embeddings, where SGLang and vLLM serve one static table (eyas' too)",
            "longrope": "speculators trains with transformers' longrope, long factors for a whole sequence that "
                        "reaches original_max_position_embeddings, where eyas picks them per position"}[args.rope]
    classes = (Eagle3DraftModel, Eagle3SpeculatorConfig)

    # the default export, speculators' default (flex) attention
    cfg, model, written = load_speculators(classes, folders["vllm"], target.source, None)
    rep.add("load", "Eagle3SpeculatorConfig + Eagle3DraftModel.from_pretrained", True,
            f"verifier written {written!r}, resolved from {target.source}")
    check_config(rep, c, cfg, model, exported, drafter)
    embed_ok = check_weights(rep, "weights vllm/", folders["vllm"], drafter, model, target, False)
    check_vocab(rep, drafter, model, target)
    if not embed_ok:  # speculators' own loader, told to take the verifier's embedding
        model._load_verifier_weights(overwrite_embed_tokens=True)

    ids, x, g = chat_inputs(target)
    pos = torch.arange(1, ids.shape[1])[None]     # speculators' shift_batch positions
    eh, el = unroll_eyas(drafter, x, g, pos, args.steps)

    sec = "forward vllm/ flex" + ("" if embed_ok else " (embed from verifier)")
    compare_unroll(rep, sec, eh, el, *unroll_speculators(model, x, g, pos, args.steps, pad_to=128), model=model)
    # positions left to each side's default: speculators 1 + arange, eyas (= vLLM) arange
    _, el0 = unroll_eyas(drafter, x, g, pos - 1, 1)
    _, sl0, _ = unroll_speculators(model, x, g, None, 1, pad_to=128)
    rep.close("forward conventions", "step 0 logits, default positions (t+1 vs t)", sl0[0], el0[0],
              "; RoPE is relative")

    # the same folder with eager attention (no block padding), and the folder with the embedding
    for name, attn in (("vllm", "eager"), ("vllm-emb", "eager")):
        _, m2, _ = load_speculators(classes, folders[name], target.source, attn)
        if name == "vllm-emb":
            check_weights(rep, "weights vllm-emb/", folders[name], drafter, m2, target, True)
        elif not embed_ok:
            m2._load_verifier_weights(overwrite_embed_tokens=True)
        compare_unroll(rep, f"forward {name}/ {attn}", eh, el, *unroll_speculators(m2, x, g, pos, args.steps),
                       model=m2)

    return write_report(rep, Path(args.out), {"target": args.target, "rope": args.rope, "variants": variants,
                                               "speculators": spec_version, "transformers": transformers.__version__,
                                               "rtol": RTOL}, f"eyas vLLM export vs speculators {spec_version}")


if __name__ == "__main__":
    sys.exit(main())
