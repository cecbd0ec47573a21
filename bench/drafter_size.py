"""Parameters and training memory of the eyas EAGLE-3 drafter for a target of a given shape, built on
PyTorch's meta device (no memory is allocated, no weights are needed).

    PYTHONPATH=. python3 bench/drafter_size.py --hidden 8192 --intermediate 28672 --heads 64 --kv-heads 8 \
        --vocab 128256 --layers 80        # a Llama-3-70B-shaped target

Trainable parameters exclude the frozen target embedding. Memory for training with AdamW in fp32:
weights, gradients and two moments, 16 bytes per trainable parameter (activations not counted).
"""
from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    a = p.parse_args(argv)

    import torch

    from eyas.draft import DraftConfig, Eagle3Drafter
    from eyas.target import default_aux_layers

    conf = SimpleNamespace(hidden_size=a.hidden, intermediate_size=a.intermediate, num_attention_heads=a.heads,
                           num_key_value_heads=a.kv_heads, vocab_size=a.vocab, num_hidden_layers=a.layers,
                           rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0)
    target = SimpleNamespace(config=conf, aux_layers=default_aux_layers(a.layers), identity=lambda: {})
    with torch.device("meta"):
        d = Eagle3Drafter(DraftConfig.from_target(target, a.draft_vocab_size))
    trainable = sum(p.numel() for p in d.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in d.parameters() if not p.requires_grad)
    out = {"trainable_params": trainable, "frozen_params": frozen,
           "adamw_fp32_bytes": 16 * trainable, "adamw_fp32_gb": round(16 * trainable / 1e9, 1),
           "by_module": {n: sum(p.numel() for p in m.parameters() if p.requires_grad) for n, m in d.named_children()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
