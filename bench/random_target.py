"""Write an HF folder of random weights in a named target shape, with an eyas preset's tokenizer, for timing a
large architecture on a machine its checkpoint cannot reach (accuracies from it are meaningless).

    PYTHONPATH=. python3 bench/random_target.py --shape llama-3.1-8b --out /tmp/llama8b

The weights are drawn on the GPU (seed 0) in bf16 and saved as safetensors shards with an index, as a hub
checkpoint is laid out, so the stages that read only the head or the config see what they would see there.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# public config.json fields of the shapes (no weights); the vocabulary stays the model's, the tokenizer is a preset's
SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # Qwen3-30B-A3B: 128 routed experts (8 a token) in every layer, about 61 GB in bf16
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # Kimi-K2's text model (Kimi-K2.5's is the same shape), under a multimodal wrapper's text_config as K2.5 ships it:
    # MLA, 384 routed experts (8 a token) and a shared one, yarn. --layers and --experts cut it to fit one GPU.
    "kimi-k2.5": dict(model_type="llava", vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                                             intermediate_size=64, num_hidden_layers=1,
                                                             num_attention_heads=2, image_size=28, patch_size=14),
                      text_config=dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                                       moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
                                       num_key_value_heads=64, n_routed_experts=384, num_experts_per_tok=8,
                                       n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                       routed_scaling_factor=2.827, q_lora_rank=1536, kv_lora_rank=512,
                                       qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                       vocab_size=163840, max_position_embeddings=131072, rms_norm_eps=1e-6,
                                       tie_word_embeddings=False,
                                       rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0,
                                                            original_max_position_embeddings=4096, beta_fast=1.0,
                                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the architecture to imitate")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's own)")
    p.add_argument("--experts", type=int, default=0, help="routed experts of a MoE shape (default: the shape's own; "
                   "at most the experts a token picks are kept)")
    p.add_argument("--tokenizer", default="smollm2", help="the eyas preset (or HF folder) whose tokenizer to copy")
    p.add_argument("--out", required=True, help="the folder to write (left as it is when it holds a config.json)")
    p.add_argument("--shape-only", action="store_true",
                   help="write the config and tokenizer alone (bench_train.py --random-target draws its own weights)")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from eyas.config import TargetConfig, preset
    from eyas.target import load_tokenizer

    out = Path(a.out)
    if (out / "config.json").exists():
        print(f"{out} exists; kept")
        return 0
    fields = json.loads(json.dumps(SHAPES[a.shape]))
    text = fields.get("text_config", fields)
    if a.layers:
        text["num_hidden_layers"] = a.layers
    experts_key = next((k for k in ("n_routed_experts", "num_experts") if k in text), None)
    if a.experts and experts_key:
        text[experts_key] = a.experts
        text["num_experts_per_tok"] = min(text["num_experts_per_tok"], a.experts)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    auto = AutoModelForImageTextToText if "text_config" in fields else AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = None
    if not a.shape_only:
        with torch.device(dev):
            model = auto.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if a.shape_only:
        cfg.save_pretrained(str(tmp))
    else:
        model.save_pretrained(str(tmp), max_shard_size="5GB")
    tok_cfg = preset(a.tokenizer).target if not Path(a.tokenizer).exists() else TargetConfig(name=a.tokenizer)
    load_tokenizer(tok_cfg).save_pretrained(str(tmp))
    tmp.rename(out)
    n = sum(x.numel() for x in model.parameters()) if model is not None else 0
    print(json.dumps({"out": str(out), "parameters": n, "bytes": n * 2}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
