"""bench/bench_decode.py: its speedup on the prompts both methods finished (hand-made results), and its timing
drafter."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench" / "bench_decode.py")
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)


def test_speedup_counts_only_the_prompts_both_finished():
    # plain's box ended after 2 prompts (3 s), the speculative method's after 3; its third prompt (9 s) is left out
    plain = {"seconds_by_prompt": [1.0, 2.0]}
    fast = {"seconds_by_prompt": [0.5, 0.5, 9.0]}
    assert bd.same_prompts_speedup(fast, plain) == 3.0
    assert bd.same_prompts_speedup(plain, fast) == 1.0 / 3.0  # and the other way round: 1 s against 3
    assert bd.same_prompts_speedup({}, plain) is None  # a report from before the field has no such ratio


def test_untrained_drafter_spec_takes_a_layer_count(smol):
    """`--draft untrained:N` builds the timing drafter with N decoder layers (bench/profile_round.py times a deeper
    drafter's round with it); a count that is not a whole number >= 1 stops with a message naming the flag."""
    import pytest

    assert len(bd.bench_drafter("untrained", smol).decoder_layers()) == 1
    deep = bd.bench_drafter("untrained:2", smol)
    assert len(deep.decoder_layers()) == 2 and deep.config.draft_vocab_size == 32000
    for bad in ("untrained:0", "untrained:two"):
        with pytest.raises(SystemExit, match=f"--draft {bad}: the layer count"):
            bd.bench_drafter(bad, smol)


def test_run_engine_gives_tau_an_interval_over_the_prompts():
    """A speculative method's τ comes with a bootstrap interval over its prompts (eyas.eval_stats.tau_interval), from
    each prompt's rounds; hand-made generations: two prompts of τ 4 and one of τ 1."""
    from types import SimpleNamespace

    rounds = [[3, 3], [3, 3, 3], [0, 0, 0, 0]]
    it = iter(rounds)

    def generate(ids, max_new, stop, speculative):
        acc = next(it)
        return SimpleNamespace(tokens=[1] * sum(a + 1 for a in acc), accepted=acc, seconds=0.1, draft_seconds=0.0,
                               verify_seconds=0.1, prefill_seconds=0.01, target_forwards=len(acc))

    res = bd.run_engine(SimpleNamespace(k=3, generate=generate), [[1]] * 3, 16, [], True, 1e9)
    assert res["acceptance_length"] == (8 + 12 + 4) / 9
    lo, hi = res["acceptance_length_ci95"]
    assert 1.0 <= lo < res["acceptance_length"] < hi <= 4.0



def test_divergences_give_the_targets_logit_gap_where_a_method_leaves_plain_decoding(smol):
    """Where a method's tokens leave plain decoding's, the report gives the first such position and the target's own
    logit gap there between the two tokens (a near-tie that rounding decides is a spacing or two of the dtype);
    prompts that agree give nothing. Here the method takes the target's second choice at position 3."""
    import torch

    model = smol.model
    prompt = smol.tokenizer("The capital of France is", add_special_tokens=False).input_ids
    with torch.no_grad():
        plain = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + plain[:3]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    method = plain[:3] + [second] + plain[4:]
    got = bd.divergences(model, [prompt, prompt], [method, plain], [plain, plain])
    (row,) = got["divergences"]
    assert (row["prompt"], row["at"], row["plain"], row["method"]) == (0, 3, plain[3], second)
    assert row["gap"] == round(float(logits[plain[3]] - logits[second]), 4) > 0
    assert got["divergence_gap_spacings_max"] == row["gap_spacings"] > 0
    assert bd.divergences(model, [prompt], [plain], [plain]) == {"divergences": [],
                                                                  "divergence_gap_spacings_max": None}


def test_a_sweep_lets_torch_compile_more_shapes():
    """bench_decode and profile_round time many chains and trees in one process, each with drafter calls of its own
    shapes: the sweep raises torch's recompile limit (8 by default) so the methods timed last keep the compiled
    drafter, and never lowers a higher one."""
    from torch import _dynamo

    saved = _dynamo.config.recompile_limit  # set back by hand: monkeypatch would delete the setting on undo
    try:
        _dynamo.config.recompile_limit = 8
        bd.sweep_compile_limit()
        assert _dynamo.config.recompile_limit == 64
        _dynamo.config.recompile_limit = 100
        bd.sweep_compile_limit()
        assert _dynamo.config.recompile_limit == 100
    finally:
        _dynamo.config.recompile_limit = saved


def test_the_best_setting_is_the_fastest_that_decodes_as_plain():
    """The sweep's pick: the fastest default-variant method whose tokens equal plain decoding's on every prompt, with
    the eyas setting that runs it; a faster tree that left plain decoding, a variant and a stepwise round are passed
    over; answers that part only by kernel rounding (each equal to plain decoding with the verify's shapes) count as
    lossless, and are marked so; with no lossless method the fastest is given and marked."""
    chain = {"k": 3, "fused_round": True, "fused_drafter": True, "variant": ""}
    methods = {"eyas_plain": {"tokens_per_s": 700.0, "variant": ""},
               "eyas_spec_k3_fused": {**chain, "tokens_per_s": 1400.0, "same_as_plain": "36/36"},
               "eyas_spec_k5_fused": {**chain, "k": 5, "tokens_per_s": 1380.0, "same_as_plain": "36/36"},
               "eyas_spec_k7": {**chain, "k": 7, "fused_round": False, "tokens_per_s": 1500.0,
                                "same_as_plain": "36/36"},
               "eyas_spec_k3_fused_rw1": {**chain, "variant": "_rw1", "tokens_per_s": 1600.0, "same_as_plain": "36/36"},
               "eyas_tree_8_3_16": {"tree": {"topk": 8, "depth": 3, "tokens": 16}, "variant": "",
                                    "tokens_per_s": 1450.0, "same_as_plain": "35/36"},
               "eyas_tree_4_2_6": {"tree": {"topk": 4, "depth": 2, "tokens": 6}, "variant": "",
                                   "tokens_per_s": 1410.0, "same_as_plain": "36/36"}}
    best = bd.best_setting(methods)
    assert (best["method"], best["set"], best["lossless"]) == ("eyas_tree_4_2_6", "eval.tree=4,2,6", True)
    del methods["eyas_tree_4_2_6"]
    assert bd.best_setting(methods)["set"] == "eval.k=3"
    methods["eyas_spec_k3_fused"]["same_as_plain"] = methods["eyas_spec_k5_fused"]["same_as_plain"] = "30/36"
    best = bd.best_setting(methods)
    assert (best["set"], best["lossless"]) == ("eval.tree=8,3,16", False)
    methods["eyas_spec_k5_fused"]["same_with_verify_shapes"] = "6/6"
    methods["eyas_spec_k3_fused"]["same_with_verify_shapes"] = "5/6"
    best = bd.best_setting(methods)
    assert (best["set"], best["lossless"], best["lossless_up_to_rounding"]) == ("eval.k=5", True, True)
    assert bd.best_setting({"eyas_plain": methods["eyas_plain"]}) is None


def test_a_tree_only_flag_shares_the_plain_decoding_of_its_other_settings():
    """--tree-paths 1,0 times plain decoding and the chains once: a tree verified in one call is compared with the
    plain decoding of the variant that differs from it only in the tree-only flags, whatever the other flags are."""
    from eyas.decode import Decoder
    from eyas.engine.fastlm import FastLM

    variants = bd.target_variants(FastLM, Decoder)
    flags = [flag for flag, _, _ in variants]
    defaults = {"norm": 2, "gqa": 1, "rowwise": 0, "tree_paths": 1, "overlap": 1, "ew": 1, "norms": 1, "prefill": 1,
                "draft_compile": 1}
    assert sorted(flags) == sorted(defaults) and bd.TREES_ONLY <= set(flags)

    def names(**over):  # (the variant's own suffix, the suffix of the plain decoding it shares)
        values = [over.get(f, defaults[f]) for f in flags]
        return "".join(s(v) for (_, _, s), v in zip(variants, values)), bd.shared_plain(variants, values)

    assert names() == ("", "")
    assert names(tree_paths=0) == ("_tp0", "")
    assert names(tree_paths=0, rowwise=1, norm=1) == ("_norm1_rw1_tp0", "_norm1_rw1")
    assert names(rowwise=1) == ("_rw1", "_rw1")  # a flag that changes the target's forward times its own plain
