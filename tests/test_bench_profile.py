"""bench/profile_round.py's reading of a torch.profiler run, which bench/bench_train.py's step profile shares: the
spans that annotations leave on the device's timeline are not kernels (hand-made events in the profiler's
shape), and a real CPU profile of a scheduled loop reads as no device work."""
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench_train imports profile_round from its own folder
spec = importlib.util.spec_from_file_location("profile_round", ROOT / "bench" / "profile_round.py")
pr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pr)

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def ev(name, device, us, annotation=False):
    return SimpleNamespace(name=name, device_type=device, device_time=us, is_user_annotation=annotation)


class Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_step_marks_and_annotations_are_not_kernels():
    # two steps of 50 ms on the device's timeline, each with 10 + 5 ms of kernels inside, one record_function span
    events = [ev("ProfilerStep#1", CUDA, 50_000, True), ev("ProfilerStep#2", CUDA, 50_000, True),
              ev("my_region", CUDA, 12_000, True), ev("ProfilerStep#1", CPU, 51_000),
              ev("gemm", CUDA, 10_000), ev("gemm", CUDA, 10_000), ev("softmax", CUDA, 5_000), ev("softmax", CUDA, 5_000),
              ev("aten::mm", CPU, 300)]
    dev = pr.device_events(Prof(events))
    assert sorted(e.name for e in dev) == ["gemm", "gemm", "softmax", "softmax"]
    assert pr.by_kernel(dev) == {"gemm": [2, 20.0], "softmax": [2, 10.0]}
    assert pr.step_spans_ms(Prof(events)) == [50.0, 50.0]
    # a step mark the profiler did not flag as an annotation is still left out, by its name
    unflagged = [ev("ProfilerStep*", CUDA, 50_000), ev("gemm", CUDA, 10_000)]
    assert [e.name for e in pr.device_events(Prof(unflagged))] == ["gemm"]


def test_step_profile_of_a_real_cpu_profile():
    """bench_train.step_profile over a real scheduled profile on the CPU: op times from the CPU, no device spans."""
    from torch.profiler import ProfilerActivity, profile, schedule

    bt_spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "bench_train.py")
    bt = importlib.util.module_from_spec(bt_spec)
    bt_spec.loader.exec_module(bt)
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as p:
        for _ in range(4):
            a = torch.tanh(a @ a)
            p.step()
    out = bt.step_profile(p, 2)
    assert out["op_time"] == "cpu" and out["kernels_per_step"] == 0 and out["device_ms_per_step"] == 0
    assert out["step_span_ms"] is None and out["device_busy"] is None
    ops = {r[0]: r for r in out["by_op"]}
    assert ops["aten::mm"][1] == 1.0 and ops["aten::tanh"][1] == 1.0  # one of each per profiled step
    host = {r[0]: r for r in out["host_by_op"]}
    assert host["aten::mm"][1] == 1.0 and host["aten::mm"][2] > 0 and not any(k.startswith("ProfilerStep") for k in host)
    assert out["host_ms_per_step"] >= host["aten::mm"][2] + host["aten::tanh"][2]


def test_profile_round_times_trees_beside_chains(tmp_path):
    """profile_round.py --trees: each tree's round by the wall clock, and with --parts its growth, verify and whole
    round captured alone, beside the chains' (the tiny target on the CPU: eager calls)."""
    import json

    out = tmp_path / "round.json"
    pr.main(["--target", "tiny", "--tokens", "8", "--replays", "1", "--trees", "2,2,4", "--gqa", "1", "--norm", "2",
             "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["round_tree_2_2_4_wall_ms"] > 0 and res["round_tree_2_2_4_tau"] >= 1
    assert {"grow_tree_2_2_4", "verify_tree_2_2_4", "round_tree_2_2_4", "verify_k3", "round_k7"} <= set(res["parts_ms"])


def test_verify_rounding_compares_verifies_with_steps(tmp_path):
    """verify_rounding.py on the tiny target in fp32: every backend that runs gives a T-token forward within fp32
    rounding of T one-token steps, and the tree path over a chain's mask the plain forward bit for bit; a branching
    tree's nodes pick what steps over their own paths pick, in both tree layouts; each projection is checked row by
    row."""
    import json

    spec = importlib.util.spec_from_file_location("verify_rounding", ROOT / "bench" / "verify_rounding.py")
    vr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vr)
    out = tmp_path / "rounding.json"
    vr.main(["--target", "tiny", "--dtype", "float32", "--lengths", "2,9,16", "--out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["linear_rows"]) == {"q", "k", "o", "gate", "down", "lm_head"}
    ran = {k: v for k, v in res["forwards"].items() if "error" not in v}
    assert {"default_gqa16", "default_gqa1", "default_rowwise", "math_rowwise"} <= set(ran)
    for key, by_t in ran.items():
        for T, r in by_t.items():
            assert r["tree_equals_forward"] and r["max_diff"] < 1e-3 and r["argmax_equal"] == 1.0, (key, T, r)
            assert r["branching_argmax_equal"] == 1.0, (key, T, r)  # each node's pick as over its own path
            assert r["paths_argmax_equal"] == 1.0, (key, T, r)
