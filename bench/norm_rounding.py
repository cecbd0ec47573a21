"""How much the target's RMSNorm rounding changes what a drafter sees: SmolLM2 in bf16 through FastLM with the norm
as one kernel (FastLM.norm_one_kernel, the decoder's default) against torch's fused kernel with HF's rounding steps
(what training's features use), on the first exchange of held-out ShareGPT conversations. Prints, per
conversation, the relative difference of the aux-layer states and the share of positions where the target's top
token is the same; then how far training's captured states (Target.capture, features.norm hf or one_kernel) are
from each of the two decoder forwards.

    PYTHONPATH=. python3 bench/norm_rounding.py [--conversations 6] [--tokens 400] [--device cpu]
"""
from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6, help="held-out conversations to compare")
    ap.add_argument("--tokens", type=int, default=400, help="tokens of each (its first user turn and answer)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    a = ap.parse_args()

    from eyas.config import TargetConfig
    from eyas.data.prepare import select_split
    from eyas.data.readers import read_dataset
    from eyas.fastlm import FastLM
    from eyas.target import load_target

    t = load_target(TargetConfig(name="smollm2", dtype="bfloat16", device=a.device))
    convs, _ = read_dataset("sharegpt")
    texts = []
    for c in select_split(convs, "test", 0.02, 0.02)[: a.conversations]:
        ids = t.tokenizer.apply_chat_template([{"role": x.role, "content": x.content} for x in c.turns[:2]],
                                              tokenize=True)
        texts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids)[: a.tokens])
    saved = FastLM.fused_norm, FastLM.norm_one_kernel
    runs = {}
    try:
        for one in (False, True):
            FastLM.fused_norm, FastLM.norm_one_kernel = True, one
            runs[one] = []
            for ids in texts:
                lm = FastLM(t.model, 1, len(ids), t.aux_layers)
                with torch.no_grad():
                    logits, aux = lm.forward(torch.tensor([ids], device=t.device), torch.tensor([0], device=t.device),
                                             want_aux=True)
                runs[one].append((logits.float(), aux.float()))
        caps = {n: [t.capture(torch.tensor([ids], device=t.device), norm=n)[0].float() for ids in texts]
                for n in ("hf", "one_kernel")}
    finally:
        FastLM.fused_norm, FastLM.norm_one_kernel = saved
    H = t.model.config.hidden_size

    def rel(a, b):
        """The relative difference of a from b."""
        return float((a - b).norm() / b.norm())

    print(f"aux layers {t.aux_layers}; one kernel against HF's rounding")
    for ids, (l0, a0), (l1, a1) in zip(texts, runs[False], runs[True]):
        per = [rel(a1[..., j * H:(j + 1) * H], a0[..., j * H:(j + 1) * H]) for j in range(len(t.aux_layers))]
        same = float((l0.argmax(-1) == l1.argmax(-1)).float().mean())
        print(f"{len(ids):4d} tokens: aux relative difference {[round(r, 4) for r in per]}, same top token {same:.4f}")

    print("captured states (all aux layers) against the decoder's forward, relative difference:")
    for n, cs in caps.items():
        d1 = [rel(c, r[1]) for c, r in zip(cs, runs[False])]
        d2 = [rel(c, r[1]) for c, r in zip(cs, runs[True])]
        print(f"  features.norm={n:10s} vs HF-rounding decoder {[round(x, 4) for x in d1]}, "
              f"vs one-kernel decoder {[round(x, 4) for x in d2]}")


if __name__ == "__main__":
    main()
