"""Hidden-state features: capture equals transformers' own hidden states, fp8 round trip, offline
shards equal the online provider, kill -9 + resume, corrupt/foreign shards rejected, torchrun ranks."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eyas.config import preset
from eyas.data import read_dataset
from eyas.data.prepare import TokenSet, load_tokens, tokens_dir
from eyas.data.tokenize import tokenize_conversation
from eyas.features import (OfflineFeatures, OnlineFeatures, bytes_per_token, dequantize_fp8, plan_batches,
                           plan_shards, quantize_fp8, run_extract)
from eyas.util import EyasError, atomic_write_json, sha256_file

REPO = Path(__file__).resolve().parents[1]


def write_tokens(run: Path, target, n: int, max_len: int, n_val: int = 2) -> None:
    """A run directory holding tokenized ShareGPT conversations (what the tokenize stage writes)."""
    convs, _ = read_dataset("sharegpt", limit=400)
    items = []
    for c in convs:
        if c.turns[0].role != "user":
            continue
        t = tokenize_conversation(target.tokenizer, c, max_len, "keep", target.eot_token_ids)
        if sum(t.loss_mask):
            items.append(t)
        if len(items) == n + n_val:
            break
    assert len(items) == n + n_val
    d = tokens_dir(run)
    TokenSet.from_tokenized(items[:n]).save(d / "train.safetensors")
    TokenSet.from_tokenized(items[n:]).save(d / "val.safetensors")
    atomic_write_json(d / "meta.json", {"train_ids": [t.id for t in items[:n]], "val_ids": [t.id for t in items[n:]]})


def tiny_cfg(run: Path, **features):
    cfg = preset("tiny")
    cfg.out = str(run)
    cfg.target.device = "cpu"
    for k, v in features.items():
        setattr(cfg.features, k, v)
    return cfg


def shard_hashes(run: Path) -> dict[str, str]:
    d = run / "features"
    return {str(p.relative_to(d)): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file() and p.name[0] != "."}


def test_capture_equals_output_hidden_states_exactly(smol):
    """Aux ids [2, N//2, N-3] are HF hidden_states indices 2, N//2, N-3; final = last normed state."""
    n = smol.num_layers
    assert smol.aux_layers == [2, n // 2, n - 3]
    ids = smol.tokenizer("The hawk circled twice over the valley before it dove.", return_tensors="pt").input_ids
    aux, final = smol.capture(ids)
    out = smol.model(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    H = smol.hidden_size
    for j, layer in enumerate([2, n // 2, n - 3]):
        assert torch.equal(aux[..., j * H:(j + 1) * H], hs[layer])
    assert torch.equal(final, hs[-1])
    # and the final state is what lm_head reads: it reproduces the model's logits
    torch.testing.assert_close(smol.model.lm_head(final), out.logits, rtol=0, atol=1e-4)


def test_online_feature_cache_returns_first_computation(tiny):
    """Cached sequences come back as the tensors of their first computation (not recomputed in another
    padded group), as copies that do not hold the padded batch; sequences past the budget are computed
    each time; hits and misses are counted."""
    torch.manual_seed(0)
    lens = [30, 7, 19, 12]
    tokens = TokenSet.from_tokenized([SimpleNamespace(id=f"s{i}", input_ids=torch.randint(3, 200, (n,)).tolist(),
                                                      loss_mask=[1] * n) for i, n in enumerate(lens)])
    plain = OnlineFeatures(tiny, tokens, max_batch_tokens=64)
    cached = OnlineFeatures(tiny, tokens, max_batch_tokens=64, cache_bytes=1 << 30)
    first = cached.get([0, 1, 2, 3])
    assert cached.cache_stats()["sequences"] == 4 and cached.misses == 4 and cached.hits == 0
    for i, s in enumerate(first):  # each cached copy owns its storage: no padded neighbour kept alive
        aux, final, top = cached.cache[i]
        assert aux.untyped_storage().nbytes() == aux.numel() * aux.element_size()
        assert torch.equal(aux, s.aux) and torch.equal(final, s.final) and torch.equal(top, s.top)
    again = cached.get([3, 1, 0])
    assert cached.hits == 3 and cached.misses == 4
    for k, i in enumerate([3, 1, 0]):
        assert again[k].aux is cached.cache[i][0] and torch.equal(again[k].input_ids, first[i].input_ids)
    for o, n in zip(again, plain.get([3, 1, 0])):  # and they are the target's features
        torch.testing.assert_close(o.aux, n.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o.final, n.final, rtol=1e-5, atol=1e-5)
    # a budget for about one long sequence: the first (longest) fits, the rest are recomputed
    per_token = sum(t.numel() * t.element_size() for t in cached.cache[0]) // lens[0]
    small = OnlineFeatures(tiny, tokens, max_batch_tokens=64, cache_bytes=per_token * 31)
    small.get([0, 1, 2, 3])
    assert list(small.cache) == [0] and small.cached_bytes <= per_token * 31
    small.get([0, 1])
    assert small.hits == 1 and small.misses == 5
    # computed ahead in extraction-sized forwards: longest first, up to the budget, the same features
    ahead = OnlineFeatures(tiny, tokens, max_batch_tokens=64, cache_bytes=per_token * (30 + 19))
    assert ahead.warm([3, 2, 1, 0, 2], batch_tokens=128, keep="longest") == 2 and sorted(ahead.cache) == [0, 2]
    for i in (0, 2):
        torch.testing.assert_close(ahead.cache[i][0], cached.cache[i][0], rtol=1e-5, atol=1e-5)
    assert OnlineFeatures(tiny, tokens, cache_bytes=1 << 30).warm([0, 1, 2, 3], 64) == 4


def test_host_tier_holds_what_the_device_cache_cannot(tiny):
    _host_tier(tiny)


@pytest.mark.gpu
def test_host_tier_pinned_on_cuda():
    """The same with the target on a GPU: pinned chunks, copies in both directions on the stream."""
    from eyas.config import TargetConfig
    from eyas.target import load_target

    _host_tier(load_target(TargetConfig(name="tiny", dtype="float32", device="cuda")))


def test_release_memory_without_cuda_gives_nothing_back():
    """On a machine where CUDA is not in use there is no pinned memory to give back, and asking is harmless."""
    from eyas.util import release_memory

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    assert release_memory() is False


@pytest.mark.gpu
def test_release_memory_gives_a_freed_host_tier_back():
    """Pinned chunks of a host tier that was dropped stay with torch's host allocator until `release_memory`
    (called by `eyas run` after every stage) gives them back to the system."""
    from eyas.features import HostSlab
    from eyas.util import release_memory

    def pinned():
        return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)

    torch.cuda.init()
    release_memory()
    before = pinned()
    slab = HostSlab(1 << 26, pin=True)
    kept = slab.put((torch.ones(1 << 24),))  # 64 MiB
    assert kept is not None and kept[0].is_pinned()
    held = pinned()
    assert held - before >= 1 << 26
    del slab, kept
    assert pinned() == held  # freed, but cached by the allocator
    assert release_memory() is True
    assert pinned() <= before


def _host_tier(target):
    """Sequences past the device cache's budget are kept in the host tier (train.feature_cache_host_gb) and come
    back on the target's device as the tensors of their first computation; past both budgets they are recomputed."""
    torch.manual_seed(0)
    lens = [30, 7, 19, 12]
    tokens = TokenSet.from_tokenized([SimpleNamespace(id=f"s{i}", input_ids=torch.randint(3, 200, (n,)).tolist(),
                                                      loss_mask=[1] * n) for i, n in enumerate(lens)])
    ref = OnlineFeatures(target, tokens, cache_bytes=1 << 30)
    assert ref.warm([0, 1, 2, 3], 128) == 4
    per_token = sum(t.numel() * t.element_size() for t in ref.cache[0]) // lens[0]
    tiers = OnlineFeatures(target, tokens, cache_bytes=per_token * 31, host_bytes=per_token * (19 + 12) + 1024)
    assert tiers.host.pin == (torch.device(target.device).type == "cuda")
    assert tiers.warm([0, 1, 2, 3], 128, keep="longest") == 3  # 0 on the device, 2 and 3 on the host, 1 in neither
    assert list(tiers.cache) == [0] and sorted(tiers.host_cache) == [2, 3]
    assert all(t.device.type == "cpu" and t.is_pinned() == tiers.host.pin for t in tiers.host_cache[2])
    got = tiers.get([3, 1, 0, 2])
    junk = [torch.full((1 << 20,), 7.0, device=target.device) for _ in range(8)]  # reuse freed device memory
    for k, i in enumerate([3, 1, 0, 2]):
        assert got[k].aux.device == torch.device(ref.cache[i][0].device)
        if i == 1:  # recomputed, in another group
            torch.testing.assert_close(got[k].aux, ref.cache[i][0], rtol=1e-5, atol=1e-5)
        else:
            for a, b in zip((got[k].aux, got[k].final, got[k].top), ref.cache[i]):
                assert torch.equal(a, b)
    del junk
    st = tiers.cache_stats()
    assert st["host_sequences"] == 2 and st["host_hits"] == 2 and st["hits"] == 3 and st["misses"] == 4 + 1
    assert st["host_bytes"] <= st["host_limit_bytes"]


def test_warm_keeps_the_shortest_sequences_when_asked(tiny):
    """train.feature_cache_keep=shortest (the default): with room for some sequences only, the warm-up keeps the
    shortest that fit both budgets (the long ones left over fill whole batches in training), where `longest` keeps
    the longest first; either way the features handed out equal the target's, and `warm_tokens` counts what was
    computed."""
    torch.manual_seed(0)
    lens = [30, 7, 19, 12]
    tokens = TokenSet.from_tokenized([SimpleNamespace(id=f"s{i}", input_ids=torch.randint(3, 200, (n,)).tolist(),
                                                      loss_mask=[1] * n) for i, n in enumerate(lens)])
    ref = OnlineFeatures(tiny, tokens, cache_bytes=1 << 30)
    assert ref.warm([0, 1, 2, 3], 128) == 4 and ref.warm_tokens == sum(lens)
    per_token = sum(t.numel() * t.element_size() for t in ref.cache[0]) // lens[0]
    room = dict(cache_bytes=per_token * 38 + 512)  # 38 tokens: 7 + 12 + 19, or 30 + 7
    short = OnlineFeatures(tiny, tokens, **room)
    assert short.warm([0, 1, 2, 3], 128) == 3  # the default
    assert sorted(short.cache) == [1, 2, 3] and short.warm_tokens == 38  # 30 never computed
    longest = OnlineFeatures(tiny, tokens, **room)
    assert longest.warm([0, 1, 2, 3], 128, keep="longest") == 2  # 30 first, then 7: 19 and 12 no longer fit
    assert sorted(longest.cache) == [0, 1] and longest.warm_tokens == sum(lens)
    tiers = OnlineFeatures(tiny, tokens, cache_bytes=per_token * 26, host_bytes=per_token * 12 + 1024)
    assert tiers.warm([0, 1, 2, 3], 128, keep="shortest") == 3  # the room of both budgets together
    assert sorted([*tiers.cache, *tiers.host_cache]) == [1, 2, 3] and tiers.host_cache
    for feats in (short, longest, tiers):
        for k, s in zip([2, 0, 3, 1], feats.get([2, 0, 3, 1])):
            for a, b in zip((s.aux, s.final, s.top), ref.cache[k]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="longest or shortest"):
        OnlineFeatures(tiny, tokens, **room).warm([0], 128, keep="random")


def test_feature_cache_budget_leaves_room_for_training():
    from eyas.features import feature_cache_budget, train_step_bytes

    step = train_step_bytes(8192, 3, 32000)
    assert 9.5e9 < step < 10.5e9  # 10.4 GB measured on an H200 (BENCHMARKS.md)
    assert feature_cache_budget(-1, "cuda", step, free=int(138e9)) == int(138e9 * 0.85)  # an H200: 85% of it
    small = feature_cache_budget(-1, "cuda", step, free=int(23e9))  # a 24 GB card: the step's peak still fits
    assert 0 < small and small + step * 1.25 + 4e9 <= 23e9
    assert feature_cache_budget(-1, "cuda", train_step_bytes(32768, 3, 32000), free=int(30e9)) == 0
    assert feature_cache_budget(-1, "cpu", step) == 0 and feature_cache_budget(2.5, "cpu") == int(2.5e9)


@pytest.mark.gpu
def test_feature_cache_budget_counts_what_the_allocator_holds_unused():
    """A stage before training (regen's KV cache) frees its tensors, but torch's allocator keeps their memory,
    which the driver reports as used: the auto budget must count it as free, so it gives the allocator's unused
    blocks back before it reads the driver's free memory. (The driver's figure itself moves with whatever else
    the process or the machine allocates meanwhile, so it is not compared.)"""
    from eyas.features import feature_cache_budget

    held = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    del held  # 4 GiB now free for torch, used for the driver
    reserved = torch.cuda.memory_reserved()
    assert reserved >= 4 << 30
    assert feature_cache_budget(-1, "cuda") > 0
    assert torch.cuda.memory_reserved() <= reserved - (4 << 30)


def test_fp8_round_trip_bound():
    """Per token and layer: |x - deq(q(x))| <= 2^-4·|x| + 2^-10·scale (3 mantissa bits; half the
    subnormal step), so the relative error of a whole state stays near 2-3%."""
    torch.manual_seed(0)
    x = torch.randn(257, 3 * 96) * torch.logspace(-2, 2, 257).unsqueeze(1)
    x[5, 7] = 300.0  # an outlier dimension, as real residual streams have
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (257, 3)
    y = dequantize_fp8(q, scale, torch.float32)
    bound = 2 ** -4 * x.abs() + 2 ** -10 * scale.repeat_interleave(96, dim=1)
    assert ((x - y).abs() <= bound).all()
    rel = (x - y).norm(dim=1) / x.norm(dim=1)
    assert rel.max() < 0.05
    assert bytes_per_token(576, "fp8") < 0.51 * bytes_per_token(576, "bf16")  # about half


def test_shard_buffers_made_in_the_background_are_distinct_and_recycled():
    from eyas.features.shards import _ShardBuffers

    bufs = _ShardBuffers(8, 4, "bf16", pin=False, count=3)
    got = [bufs.get() for _ in range(3)]
    assert len({b["aux"].data_ptr() for b in got}) == 3  # three buffers, none handed out twice
    assert got[0]["aux"].shape == (8, 12) and got[0]["final"].shape == (8, 4) and got[0]["top"].shape == (8,)
    threading.Timer(0.3, bufs.put, args=(got[1],)).start()  # a writer returning its buffer later
    assert bufs.get() is got[1]  # waits for it: no fourth buffer is made
    bufs.join()
    assert bufs.background_s > 0


def test_shard_buffers_raise_a_failed_background_allocation(monkeypatch):
    from eyas.features.shards import _ShardBuffers

    made = []
    real = _ShardBuffers._new

    def new(self):
        made.append(1)
        if len(made) > 1:
            raise RuntimeError("cannot pin 266 MB")
        return real(self)

    monkeypatch.setattr(_ShardBuffers, "_new", new)
    bufs = _ShardBuffers(8, 4, "fp8", pin=False, count=3)
    first = bufs.get()
    assert set(first) == {"aux", "final", "top", "aux_scale", "final_scale"}
    with pytest.raises(RuntimeError, match="cannot pin"):
        bufs.get()  # no buffer left and none coming: the main thread hears why instead of waiting forever


def test_plans_cover_every_sequence_once():
    lengths = [5, 300, 17, 17, 120, 9, 64, 1, 250, 33]
    for world in (1, 2, 3):
        plans = plan_shards(lengths, world, 200)
        flat = [i for r in plans for s in r for i in s]
        assert sorted(flat) == list(range(len(lengths)))
        for r in plans:
            for s in r:
                assert len(s) == 1 or sum(lengths[i] for i in s) <= 200
                ls = [lengths[i] for i in s]
                assert ls == sorted(ls, reverse=True)
                for a, b in plan_batches(ls, 128):
                    assert b - a == 1 or (b - a) * ls[a] <= 128


def test_offline_equals_online_smol(smol, tmp_path):
    """Real SmolLM2, fp32 features: each stored extraction batch is exactly what the online provider
    gives for the same batch; other groupings agree to float rounding (padding changes kernel
    blocking, not the math)."""
    run = tmp_path / "run"
    write_tokens(run, smol, 4, 40, n_val=1)
    cfg = preset("smollm2")
    cfg.out = str(run)
    cfg.features.dtype = "fp32"
    cfg.features.batch_tokens = 80
    run_extract(cfg, smol)
    off = OfflineFeatures(run, "train", target=smol)
    tokens = load_tokens(run, "train")
    on = OnlineFeatures(smol, tokens, max_batch_tokens=80)
    assert len(off) == len(on) == 4
    lengths = tokens.lengths().tolist()
    (shard,) = plan_shards(lengths, 1, cfg.features.shard_tokens)[0]
    batches = [shard[a:b] for a, b in plan_batches([lengths[i] for i in shard], 80)]
    assert len(batches) == 2
    for batch in batches:
        for o, n in zip(off.get(batch), on.get(batch)):
            assert torch.equal(o.input_ids, n.input_ids) and torch.equal(o.loss_mask, n.loss_mask)
            assert o.aux.dtype == torch.float32
            assert torch.equal(o.aux, n.aux) and torch.equal(o.final, n.final)
            # the stored top ids are the target's own argmax, from an independent plain forward
            assert o.top.dtype == torch.int32 and torch.equal(o.top, n.top)
            with torch.no_grad():
                ref = smol.model(input_ids=o.input_ids[None]).logits[0].argmax(-1)
            assert torch.equal(o.top.long(), ref)
    on.max_batch_tokens = 1000
    for o, n in zip(off.get([3, 0, 1]), on.get([3, 0, 1])):
        torch.testing.assert_close(o.aux, n.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o.final, n.final, rtol=1e-5, atol=1e-5)
    assert len(OfflineFeatures(run, "val")) == 1


def test_fp8_features_and_disk_refusal(tiny, tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_tokens(run, tiny, 5, 64)
    run_extract(tiny_cfg(run, dtype="fp32"), tiny)
    ref = OfflineFeatures(run)
    (tmp_path / "r8" / "data").mkdir(parents=True)
    os.symlink(run / "data" / "tokens", tmp_path / "r8" / "data" / "tokens")
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(EyasError, match=r"needs about .* but only 1.0 KB is free"):
        run_extract(tiny_cfg(tmp_path / "r8", dtype="fp8"), tiny)
    monkeypatch.setattr(shutil, "disk_usage", real)
    res = run_extract(tiny_cfg(tmp_path / "r8", dtype="fp8"), tiny)
    timing = res["splits"][0]["timing"]  # where the time went, for the extraction benchmark
    assert timing["writer_threads"] >= 2 and timing["write_s"] > 0 and timing["hash_s"] > 0
    f8 = OfflineFeatures(tmp_path / "r8", dtype=torch.float32)
    for a, b in zip(ref.get(range(5)), f8.get(range(5))):
        for x, y in ((a.aux, b.aux), (a.final, b.final)):
            assert ((x - y).norm(dim=1) / x.norm(dim=1)).max() < 0.05
    assert f8.manifest["bytes_per_token"] == bytes_per_token(64, "fp8")
    # bf16: every value is the fp32 one rounded once
    (tmp_path / "rb" / "data").mkdir(parents=True)
    os.symlink(run / "data" / "tokens", tmp_path / "rb" / "data" / "tokens")
    run_extract(tiny_cfg(tmp_path / "rb", dtype="bf16"), tiny)
    fb = OfflineFeatures(tmp_path / "rb")
    for a, b in zip(ref.get(range(5)), fb.get(range(5))):
        assert b.aux.dtype == torch.bfloat16
        assert torch.equal(a.aux.to(torch.bfloat16), b.aux) and torch.equal(a.final.to(torch.bfloat16), b.final)


def test_truncated_shard_and_wrong_target_rejected(tiny, smol, tmp_path):
    run = tmp_path / "run"
    write_tokens(run, tiny, 6, 64)
    cfg = tiny_cfg(run, shard_tokens=128)
    run_extract(cfg, tiny)
    feats = OfflineFeatures(run, target=tiny)
    assert len(feats) == 6
    with pytest.raises(EyasError, match=r"manifest.json: features were extracted from target tiny"):
        OfflineFeatures(run, target=smol)
    # extracting into the same folder with another target is refused, naming the manifest
    with pytest.raises(EyasError, match=r"features/train/manifest.json: these features belong to target tiny"):
        run_extract(cfg, smol)
    shard = sorted((run / "features" / "train").glob("shard-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(EyasError, match=rf"{shard.name}: shard is truncated"):
        OfflineFeatures(run)
    # same size but flipped bytes: caught by verify=True
    shard.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    OfflineFeatures(run)
    with pytest.raises(EyasError, match=rf"{shard.name}: shard is corrupt"):
        OfflineFeatures(run, verify=True)
    # a rerun notices the damaged shard only by size/record; rewrite it and everything verifies again
    shard.unlink()
    res = run_extract(cfg, tiny)
    assert res["splits"][0]["reused_shards"] == res["splits"][0]["shards"] - 1
    OfflineFeatures(run, verify=True)


def _extract_cmd(run: Path) -> list[str]:
    return [sys.executable, "-m", "eyas", "extract", "--preset", "tiny", "--out", str(run), "--set",
            "target.device=cpu", "--shard-tokens", "256", "--batch-tokens", "256"]


def test_kill9_then_resume_gives_identical_shards(tiny, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    write_tokens(ref, tiny, 16, 64)
    (run / "data").mkdir(parents=True)
    os.symlink(ref / "data" / "tokens", run / "data" / "tokens")
    plain = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(_extract_cmd(ref), env=plain, capture_output=True, text=True)  # the uninterrupted run
    assert out.returncode == 0, out.stderr
    env = dict(plain, EYAS_DEBUG_SHARD_SLEEP="0.5")
    p = subprocess.Popen(_extract_cmd(run), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    d = run / "features" / "train"
    deadline = time.time() + 120
    while len(list(d.glob("shard-*.safetensors"))) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, p.stderr.read().decode()
    n_before = len(list(d.glob("shard-*.safetensors")))
    assert 2 <= n_before < len(list((ref / "features" / "train").glob("shard-*.safetensors")))
    with pytest.raises(EyasError, match="did not finish"):
        OfflineFeatures(run)
    out = subprocess.run(_extract_cmd(run), env=plain, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"reused_shards": ' + str(n_before) in out.stdout or f'"reused_shards": {n_before - 1}' in out.stdout
    assert shard_hashes(run) == shard_hashes(ref)
    assert not list(d.glob(".*.tmp"))


def _two_process_extraction(tiny, tmp_path, port: int, *flags: str):
    """A single-process fp32 extraction (ref) and one by two gloo processes with torchrun's environment
    over the same tokens (run), passing `flags`; returns (ref, run)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    write_tokens(ref, tiny, 8, 64)
    (run / "data").mkdir(parents=True)
    os.symlink(ref / "data" / "tokens", run / "data" / "tokens")
    run_extract(tiny_cfg(ref, dtype="fp32"), tiny)
    procs = []
    for r in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + os.getpid() % 1000))
        procs.append(subprocess.Popen(_extract_cmd(run) + ["--dtype", "fp32", *flags], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
    return ref, run


def _assert_same_features(ref: Path, run: Path, n: int = 8) -> OfflineFeatures:
    a, b = OfflineFeatures(ref), OfflineFeatures(run)
    assert len(b) == n
    for x, y in zip(a.get(range(n)), b.get(range(n))):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.top, y.top)
        torch.testing.assert_close(x.aux, y.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.final, y.final, rtol=1e-5, atol=1e-5)
    return b


def test_torchrun_two_ranks(tiny, tmp_path):
    """Two gloo processes with torchrun's environment: each writes its own shards, rank 0 merges
    the index, and every sequence matches the single-process extraction."""
    ref, run = _two_process_extraction(tiny, tmp_path, 29500)
    d = run / "features" / "train"
    assert {s.name[:10] for s in d.glob("shard-*")} == {"shard-000-", "shard-001-"}
    assert _assert_same_features(ref, run).manifest["world_size"] == 2


def test_tensor_parallel_extraction_equals_one_process(tiny, tmp_path):
    """Two gloo processes holding half of each layer (transformers' tensor-parallel plan) write one set of
    shards, from rank 0, equal to the single-process extraction up to float32 reduction order."""
    ref, run = _two_process_extraction(tiny, tmp_path, 30500, "--tensor-parallel")
    d = run / "features" / "train"
    assert {s.name[:10] for s in d.glob("shard-*")} == {"shard-000-"}  # one writer
    b = _assert_same_features(ref, run)
    assert b.manifest["world_size"] == 1 and b.manifest["tensor_parallel"] == 2


def test_tensor_parallel_is_refused_where_it_cannot_run(tiny):
    from eyas.config import TargetConfig
    from eyas.target import load_target

    cfg = TargetConfig(name="tiny", device="cpu", tensor_parallel=True)
    with pytest.raises(EyasError, match="for `eyas extract` only"):
        load_target(cfg)
    with pytest.raises(EyasError, match="needs several processes"):
        load_target(cfg, allow_tp=True)


def test_capture_with_the_decoders_norm_rounding():
    """features.norm=one_kernel: in bf16 the captured states follow eyas' decoder (FastLM with its norms as one
    kernel) more closely than HF's rounding does, and HF's rounding follows FastLM's HF-rounding norm more closely;
    the modules are HF's again afterwards; OnlineFeatures passes the setting through."""
    from eyas.config import TargetConfig
    from eyas.engine.fastlm import FastLM
    from eyas.features import OnlineFeatures
    from eyas.target import load_target

    t = load_target(TargetConfig(name="smollm2", dtype="bfloat16", device="cpu"))
    ids = t.tokenizer("The hawk circled twice over the valley before it dove, and the mice below scattered "
                      "into the tall grass while the farmer watched from the porch.", return_tensors="pt").input_ids
    hf0, _ = t.capture(ids)
    one, _ = t.capture(ids, norm="one_kernel")
    hf1, _ = t.capture(ids)
    assert torch.equal(hf0, hf1)  # the norms' own forward is back
    assert not torch.equal(one, hf0)

    def fast(one_kernel: bool) -> torch.Tensor:
        saved = FastLM.fused_norm, FastLM.norm_one_kernel
        FastLM.fused_norm, FastLM.norm_one_kernel = True, one_kernel
        try:
            lm = FastLM(t.model, 1, ids.shape[1], t.aux_layers)
            with torch.no_grad():
                return lm.forward(ids, torch.tensor([0]), want_aux=True)[1]
        finally:
            FastLM.fused_norm, FastLM.norm_one_kernel = saved

    def dist(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    f1, f2 = fast(False), fast(True)
    assert dist(one, f2) < dist(hf0, f2)
    assert dist(hf0, f1) < dist(one, f1)

    class Toks:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return ids[0], torch.ones_like(ids[0], dtype=torch.bool)

    for norm, want in (("hf", hf0), ("one_kernel", one)):
        s = OnlineFeatures(t, Toks(), norm=norm).get([0])[0]
        assert torch.equal(s.aux, want[0])


def test_extraction_with_the_decoders_norm_is_its_own_plan(tiny, tmp_path):
    """features.norm=one_kernel: the shards hold what Target.capture(norm="one_kernel") gives, the manifest says
    which norm made them, and finishing them with the other norm is refused, naming the setting."""
    run = tmp_path / "run"
    write_tokens(run, tiny, 3, 48)
    run_extract(tiny_cfg(run, dtype="fp32", norm="one_kernel"), tiny)
    feats = OfflineFeatures(run)
    assert feats.manifest["norm"] == "one_kernel"
    s = feats.get([0])[0]
    aux, final = tiny.capture(s.input_ids[None], norm="one_kernel")
    assert torch.equal(s.aux, aux[0]) and torch.equal(s.final, final[0])
    with pytest.raises(EyasError, match=r"other settings \(norm: 'one_kernel' -> 'hf'"):
        run_extract(tiny_cfg(run, dtype="fp32"), tiny)


def test_a_flipped_byte_in_a_shard_is_refused_when_read(tiny_run_features):
    """Each shard's sha256 is in index.json: the first read of a shard in a process compares it (once: a second
    reader of the same shard does not hash it again), so a byte flipped inside a tensor's data stops the training
    naming the shard and how to remake it, where it trained on the damaged values before."""
    import eyas.features.offline as F
    from eyas.config import resolve
    from eyas.train import run_train

    run, tiny = tiny_run_features
    d = run / "features" / "train"
    shard = sorted(d.glob("shard-*.safetensors"))[0]
    orig = shard.read_bytes()
    data = bytearray(orig)
    data[len(data) // 2] ^= 0x01  # inside the aux tensor's data: header and size unchanged
    shard.write_bytes(bytes(data))
    feats = OfflineFeatures(run)  # the header and size still read as they should
    seq = int(feats._loc[:, 0].eq(0).nonzero()[0])  # a sequence of that shard
    msg = (rf"{shard}: shard is corrupt \(its sha256 is not the one .*index.json records\); delete it and run the "
           rf"same `eyas extract` again")
    with pytest.raises(EyasError, match=msg):
        feats.get([seq])
    cfg = resolve(preset_name="tiny", overrides={"out": str(run), "train.online": False, "train.max_steps": 1,
                                                 "train.batch_tokens": 256, "train.greedy_val": 0,
                                                 "target.device": "cpu"})
    with pytest.raises(EyasError, match=msg):
        run_train(cfg, tiny)
    # undamaged, each shard is hashed once per process, whoever reads it
    shard.write_bytes(orig)
    hashed = []
    real = F.sha256_file
    F.sha256_file = lambda p: hashed.append(Path(p).name) or real(p)
    try:
        F._VERIFIED.clear()
        a, b = OfflineFeatures(run), OfflineFeatures(run)
        a.get([seq]), a.get([seq]), b.get([seq])
    finally:
        F.sha256_file = real
    assert hashed == [shard.name]


@pytest.fixture
def tiny_run_features(tiny, tmp_path):
    """A tiny run with stored features of 6 training sequences in several shards, and the tiny target."""
    run = tmp_path / "run"
    write_tokens(run, tiny, 6, 64)
    run_extract(tiny_cfg(run, shard_tokens=128), tiny)
    from eyas.vocab import run_vocab

    run_vocab(tiny_cfg(run), tiny)
    return run, tiny
