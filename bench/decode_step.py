"""Time one FastLM decode step (the regen engine's and the decoder's target step) graphed and eager, at
batch 1 and batch 256, and print the torch profiler's top CUDA kernels of 5 eager steps. GPU only.

    PYTHONPATH=. python3 bench/decode_step.py

Each configuration: 3 warm-up calls, then the mean of 50 (device-synchronised). The cache is filled to
position 300; a graphed step attends to all slots of the cache (the shape it is captured at).
"""
import time, torch
from eyas.config import TargetConfig
from eyas.target import load_target
from eyas.fastlm import FastLM, DecodeGraph
t = load_target(TargetConfig(name="smollm2", device="cuda"))
for B, L in [(1, 2048), (256, 1280), (256, 2048)]:
    lm = FastLM(t.model, B, L)
    g = DecodeGraph(lm, lambda x: x.argmax(-1))
    g.pos.fill_(300)
    for mode in ("graph", "eager"):
        f = (lambda g=g: g()) if mode == "graph" else (lambda g=g: g._step(None))  # bound: g is deleted below
        for _ in range(3): f()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(50): f()
        torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / 50
        print(f"B={B} L={L} {mode}: {dt*1e3:.2f} ms/step, {B/dt:.0f} tok/s", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5): g._step(None)
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
    del lm, g; torch.cuda.empty_cache()
