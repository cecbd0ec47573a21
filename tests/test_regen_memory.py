"""The generate engine's memory plan (eyas.engine.memory): the estimate against the bytes transformers' forward really
allocates (tiny MoE targets on the CPU, a Kimi-K2.5-wide one on the meta device), the plan under a budget, and a regen
whose generate calls run out of memory halving its batch and finishing with an unconstrained run's answers."""
import json
import re
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig

import eyas.engine.generate
from eyas.config import Config, RegenConfig
from eyas.data import read_dataset
from eyas.data.prepare import regen_dir
from eyas.data.regen import run_regen
from eyas.engine.generate import GenerateEngine, oom_detail, oom_summary
from eyas.engine.memory import ForwardCost, plan_batch
from eyas.target import Target
from eyas.util import EyasError

GB = 1e9
# Kimi-K2.5's text model at its real width (bench/random_target.py's shape, under a multimodal wrapper's text_config),
# cut to 4 decoder layers and 16 routed experts as in the H100 run that ran out of memory in regen
KIMI = {"model_type": "kimi_k25", "text_config": {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 16,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "vocab_size": 163840, "tie_word_embeddings": False}}
TINY = {  # tiny random targets of each MoE family (SmolLM2's vocabulary, so its tokenizer and chat template serve)
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=4),
    "mixtral": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}


class PeakBytes(TorchDispatchMode):
    """The most bytes held at once by the tensors the ops under this mode create (views of a storage counted once,
    the model's weights not at all), and the largest single one."""

    def __init__(self, model):
        super().__init__()
        self.known = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self.live = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.known:
                s = t.untyped_storage()
                self.known.add(s._cdata)
                self.live += s.nbytes()
                self.peak, self.largest = max(self.peak, self.live), max(self.largest, s.nbytes())
                weakref.finalize(s, self._freed, s._cdata, s.nbytes())
        return out

    def _freed(self, key: int, n: int) -> None:
        self.known.discard(key)
        self.live -= n


def _output_only(module, q, k, v, mask, **kw):
    """Attention as a fused kernel holds it (the output alone): the meta device would otherwise take sdpa's math path
    and count its full score matrix, which the GPU's memory-efficient kernel never makes."""
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]), None


def tiny_moe(family: str, vocab: int = 49152):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, vocab_size=vocab, **TINY[family])).eval()


@pytest.mark.parametrize("family", list(TINY))
def test_the_estimate_covers_what_generate_allocates(family):
    """On the CPU (fp32, sdpa, grouped_mm experts), padded batches with and without a chunked prefill: the estimate is
    at least the peak of the tensors `generate` makes, and less than twice it (a term left out fails the first, a
    grossly inflated one the second)."""
    model = tiny_moe(family, vocab=512)
    cost = ForwardCost.from_config(model.config, 4, cpu=True)
    for rows, width, new, chunk in ((8, 96, 6, None), (4, 160, 4, 48)):
        ids = torch.randint(1, 512, (rows, width))
        mask = torch.ones_like(ids)
        mask[0, : width // 2] = 0  # one row padded: the attention mask is built
        gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                               prefill_chunk_size=chunk)
        meter = PeakBytes(model)
        with torch.no_grad(), meter:
            model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        est = cost.generate(rows, width, new, chunk)
        assert meter.peak <= est < 2 * meter.peak, (rows, width, chunk, meter.peak, est)


def test_the_estimate_covers_a_kimi_wide_prefill_on_the_meta_device():
    """The H100 run's failing call (64 prompts padded to 1,793 tokens, bf16) replayed on the meta device: its largest
    tensor is the 24.51 GiB the GPU could not give (the experts' outputs weighted in fp32, tokens x top_k x hidden x 4
    bytes), and the estimate covers the whole peak, within 1.5x."""
    AttentionInterface.register("eyas_output_only", _output_only)
    config = AutoConfig.for_model(**KIMI["text_config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config._attn_implementation = "eyas_output_only"
    cost = ForwardCost.from_config(KIMI, 2)
    rows, width = 64, 1793
    meter = PeakBytes(model)
    with torch.no_grad(), meter:
        model(input_ids=torch.zeros(rows, width, dtype=torch.long, device="meta"), logits_to_keep=1,
              use_cache=True, past_key_values=DynamicCache(config=config))
    assert meter.largest == rows * width * 8 * 7168 * 4
    est = rows * width * cost.kv_token + cost.forward(rows, width, width)
    assert meter.peak <= est < 1.5 * meter.peak
    assert est > 70 * GB  # so that call could not fit beside the weights on an 80 GB card


def test_kimi_wide_plan_stays_under_an_80_gb_budget():
    cost = ForwardCost.from_config(KIMI, 2)
    widths = sorted([40 + 8 * i for i in range(200)] + [2047] * 56)
    plan = plan_batch(cost, 80 * GB, widths, [64] * 256, cap=256)
    assert plan.peak == cost.generate(plan.rows, widths[plan.rows - 1], 64, plan.chunk) <= 80 * GB
    assert plan.limited
    long = plan_batch(cost, 80 * GB, [2047] * 256, [64] * 256, cap=256)  # the longest prompts: a chunked prefill
    assert long.chunk and long.chunk < 2047 and long.peak <= 80 * GB
    assert cost.generate(long.rows, 2047, 64, None) > 80 * GB  # ... because their whole prefill would not fit
    assert plan_batch(cost, 0.1 * GB, [2047], [64], cap=8) is None  # not even one prompt fits 100 MB


def _rows(shape: dict) -> int:
    """The rows planned under 2 GB for prompts of 64 tokens (too short to prefill in chunks) and 64 new tokens."""
    return plan_batch(ForwardCost.from_config(shape, 2), 2 * GB, [64] * 1024, [64] * 1024, cap=1024).rows


def test_bigger_moe_and_vocab_shapes_get_smaller_batches():
    """Under one budget, widening what a token costs (experts per token, hidden size, the experts' width where it
    rules, the vocabulary) never adds rows and, where it rules, takes some away."""
    base = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 4,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 64,
            "num_experts_per_tok": 2, "vocab_size": 32000}
    dense = _rows({k: v for k, v in base.items() if k != "num_experts_per_tok"})
    two = _rows(base)
    eight = _rows({**base, "num_experts_per_tok": 8})
    wide = _rows({**base, "num_experts_per_tok": 8, "hidden_size": 7168})
    assert dense >= two > eight > wide >= 1
    assert _rows({**base, "num_experts_per_tok": 8, "vocab_size": 163840}) < eight
    narrow = {**base, "hidden_size": 512, "num_experts_per_tok": 8}  # the experts' width rules at a small hidden size
    assert _rows(narrow) > _rows({**narrow, "moe_intermediate_size": 4096})
    assert _rows(KIMI) < wide



def test_a_setting_given_per_layer_reads_as_its_largest():
    one = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}
    assert (ForwardCost.from_config({**one, "intermediate_size": [512, 2048]}, 2)
            == ForwardCost.from_config({**one, "intermediate_size": 2048}, 2))


# --------------------------------------------------------------------------- the generate engine in a regen


@pytest.fixture(scope="module")
def moe_target(tiny):
    model = tiny_moe("deepseek_v3")
    return Target(model=model, tokenizer=tiny.tokenizer, name="tiny-moe", source="random", sha256="0" * 64,
                  aux_layers=[0, 1, 1], eot_token_ids=tiny.eot_token_ids)


def _regen(tmp_path, target, name: str, **regen) -> dict:
    src = tmp_path / "d.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
            {"role": "user", "content": f"question {i} " + "and more " * (8 * (i % 5))},
            {"role": "assistant", "content": "original answer"}]}) + "\n" for i in range(8)))
    cfg = Config(out=str(tmp_path / name))
    cfg.data.source = str(src)
    for k, v in {**dict(split="all", engine="generate", max_new_tokens=8, temperature=0.0, batch_size=8,
                        shard_size=4), **regen}.items():
        setattr(cfg.regen, k, v)
    run_regen(cfg, target=target)
    return {c.id: [t.content for t in c.turns] for c in read_dataset(str(regen_dir(cfg.out)))[0]}


# a CUDA out-of-memory error in torch's wording (2.11)
OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 24.51 GiB. GPU 0 has a total capacity of 79.19 GiB of which 7.40 "
               "GiB is free. Including non-PyTorch memory, this process has 71.78 GiB memory in use. Of the allocated "
               "memory 65.02 GiB is allocated by PyTorch, and 6.11 GiB is reserved by PyTorch but unallocated.")


def _failing_generate(model, monkeypatch, fails) -> list[tuple[int, int | None]]:
    """Make model.generate raise torch.OutOfMemoryError where fails(rows, chunk) says, once per shape; returns the
    (rows, chunk) of every call."""
    calls, failed, real = [], set(), model.generate

    def generate(*a, input_ids, generation_config, **kw):
        shape = (input_ids.shape[0], generation_config.prefill_chunk_size)
        calls.append(shape)
        if fails(*shape) and shape not in failed:
            failed.add(shape)
            raise torch.OutOfMemoryError(OOM_MESSAGE)
        return real(*a, input_ids=input_ids, generation_config=generation_config, **kw)

    monkeypatch.setattr(model, "generate", generate)
    return calls


def test_a_regen_out_of_memory_halves_its_batch_and_matches_an_unconstrained_run(tmp_path, moe_target, monkeypatch,
                                                                                    capsys):
    ref = _regen(tmp_path, moe_target, "ref")
    calls = _failing_generate(moe_target.model, monkeypatch, lambda rows, chunk: rows > 2)
    got = _regen(tmp_path, moe_target, "oom")
    assert got == ref and len(got) == 8
    assert calls[:3] == [(8, None), (4, None), (2, None)]  # halved until it fit
    assert max(rows for rows, _ in calls[3:]) <= 2  # later batches take no more than the call that fitted
    err = capsys.readouterr().err
    assert "regen: generate engine: 8 prompts a batch" in err
    assert "out of memory generating 8 prompts" in err and "retrying 4 of them, and later batches take at most 4" in err
    # the line says what the call was planned to take and what torch held, so a log tells a low estimate from a
    # fragmented allocator
    line = next(x for x in err.splitlines() if "out of memory generating 8 prompts" in x)
    assert "estimated " in line and "torch: it asked for 24.51 GiB, 6.11 GiB reserved but unallocated" in line


def test_an_out_of_memory_summary_keeps_what_the_message_has():
    assert oom_summary(OOM_MESSAGE) == "it asked for 24.51 GiB, 6.11 GiB reserved but unallocated"
    assert oom_summary("CUDA out of memory. Tried to allocate 512.00 MiB") == "it asked for 512.00 MiB"
    assert oom_summary("out of memory") == ""
    assert oom_detail(None, None, "") == ""
    detail = oom_detail(291, 2 * 10**9, "it asked for 1 GiB")
    assert detail == " (prefill chunk 291; estimated 2.0 GB; torch: it asked for 1 GiB)"


def test_the_report_gives_the_largest_batch_that_ran_not_the_cap(tmp_path, moe_target, capsys):
    """regen.batch_size is the generate engine's cap; each batch is sized to the memory and to what waits, so the
    report and the log give the most prompts one call generated (8 conversations here, under a cap of 64)."""
    _regen(tmp_path, moe_target, "capped", batch_size=64)
    rows = json.loads((regen_dir(str(tmp_path / "capped")) / "report.json").read_text())["this_call"]["rows"]
    assert 1 <= rows <= 8 and f"up to {rows} rows at a time" in capsys.readouterr().err


def test_a_single_prompt_out_of_memory_is_prefilled_in_chunks_then_refused_in_one_line(tmp_path, moe_target,
                                                                                        monkeypatch, capsys):
    ref = _regen(tmp_path, moe_target, "ref", batch_size=1)
    calls = _failing_generate(moe_target.model, monkeypatch, lambda rows, chunk: chunk is None)
    assert _regen(tmp_path, moe_target, "chunked", batch_size=1) == ref  # a chunked prefill gives the same answers
    assert calls[:2] == [(1, None), (1, calls[1][1])] and calls[1][1] > 1
    assert "retrying in chunks of" in capsys.readouterr().err
    monkeypatch.undo()
    _failing_generate(moe_target.model, monkeypatch, lambda rows, chunk: True)
    with pytest.raises(EyasError, match="out of memory on a single prompt of .* lower data.max_seq_len"):
        _regen(tmp_path, moe_target, "never", batch_size=1)


def test_a_plan_under_a_small_budget_chunks_the_prefill_and_keeps_the_answers(tmp_path, moe_target, monkeypatch):
    """With the free memory made small, the engine plans fewer rows and chunked prefills, and answers as before."""
    ref = _regen(tmp_path, moe_target, "ref")
    cost = ForwardCost.from_config(moe_target.config, 4, cpu=True)
    budget = cost.generate(2, 100, 8, 64)  # two prompts of 100 tokens, prefilled 64 at a time
    monkeypatch.setattr(eyas.engine.generate, "free_bytes", lambda device: budget / GenerateEngine.budget_share)
    calls = _failing_generate(moe_target.model, monkeypatch, lambda rows, chunk: False)
    assert _regen(tmp_path, moe_target, "small") == ref
    assert max(rows for rows, _ in calls) < 8 and any(chunk for _, chunk in calls)


def test_the_engine_logs_its_batch_and_why(tiny, monkeypatch, capsys):
    """The one line the engine logs on a Kimi-wide target (weights on the meta device: building the engine runs no
    forward) with an 80 GB card's room beside its 10.9 GB of weights: the batch prompts at the context limit get, the
    prefill chunk that makes it fit, and what takes the memory."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**KIMI["text_config"]), dtype=torch.bfloat16)
    target = Target(model=model, tokenizer=tiny.tokenizer, name="kimi-wide", source="random", sha256="0" * 64,
                    aux_layers=[1, 2, 3], eot_token_ids=tiny.eot_token_ids)
    monkeypatch.setattr(eyas.engine.generate, "free_bytes", lambda device: 69e9)
    GenerateEngine(target, RegenConfig(batch_size=256, max_new_tokens=64), "keep", 2048)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    said = re.fullmatch(r"regen: generate engine: prompts of 2,047 tokens go 256 at a time, prefilled in chunks of "
                        r"(\d+) tokens, to fit the 69.0 GB free on the meta device: the MoE experts' activations take "
                        r"[\d.]+ GB a layer \(743.6 KB a token\), the KV cache 4.6 KB a token \(shorter prompts go "
                        r"more at a time\)", line)
    assert said and 64 <= int(said[1]) < 2047, line


def test_a_target_split_over_devices_is_planned_on_its_tightest_device(tiny, monkeypatch, capsys):
    """A target split by target.device_map (what transformers records in hf_device_map) keeps each layer's KV cache
    on that layer's device and runs every layer's transients there: the batch is what the tightest device takes,
    counting only its own layers' cache, and the log names that device. A device holding only the head still
    counts the transients and the logits."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**KIMI["text_config"]), dtype=torch.bfloat16)
    target = Target(model=model, tokenizer=tiny.tokenizer, name="kimi-wide", source="random", sha256="0" * 64,
                    aux_layers=[1, 2, 3], eot_token_ids=tiny.eot_token_ids)
    rc = RegenConfig(batch_size=256, max_new_tokens=64)
    layers = model.config.num_hidden_layers

    def engine(device_map, free):
        monkeypatch.setattr(model, "hf_device_map", device_map, raising=False)
        monkeypatch.setattr(eyas.engine.generate, "free_bytes", lambda device: free[str(device)])
        eng = GenerateEngine(target, rc, "keep", 2048)
        return eng._plan([("", [0] * 2047, 64, 0)] * 256), capsys.readouterr().err.strip().splitlines()[-1]

    whole, _ = engine({}, {"meta": 20 * GB})
    half = {"model.embed_tokens": 0, "lm_head": 1,
            **{f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)}}
    even, _ = engine(half, {"cuda:0": 20 * GB, "cuda:1": 20 * GB})
    assert (even.rows, even.chunk or 2047) > (whole.rows, whole.chunk or 2047)  # half the cache each: more fits
    tight, line = engine(half, {"cuda:0": 60 * GB, "cuda:1": 4 * GB})
    assert "free on cuda:1, the tightest of the 2 devices the target is split over" in line, line
    alone, _ = engine({}, {"meta": 4 * GB})  # cuda:1 holds half the layers: it fits at least what a whole card
    assert (tight.rows, tight.chunk or 2047) >= (alone.rows, alone.chunk or 2047)  # of its room would
    head = {**{f"model.layers.{i}": 0 for i in range(layers)}, "model.embed_tokens": 0, "model.norm": 0,
            "lm_head": 2}
    starved, line = engine(head, {"cuda:0": 60 * GB, "cuda:2": 1e6})
    assert starved is None and "not even one prompt" in line and "cuda:2" in line
