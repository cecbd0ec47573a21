"""Does the GPU hold its speed under minutes of full load? bf16 matrix products back to back for --seconds,
the rate of each --window seconds printed and written to --out, so a fall (a power or heat limit taking the
clock down) shows as windows slower than the first ones. Run with bench/gpu_lib.sh's clock sampler
(gpu_clocks.csv) to see the clock and the reason the driver gives beside each window.

    python3 bench/gpu_hold.py --seconds 150 --out hold.json
"""
import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=150.0, help="how long to keep the GPU busy")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per measured window")
    ap.add_argument("--n", type=int, default=8192, help="side of the square bf16 matrices multiplied")
    ap.add_argument("--out", default=None, help="JSON file for the windows' rates (default: print only)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_hold.py needs a CUDA device")
    x = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    flop = 2 * a.n**3
    for _ in range(3):  # warm-up: the library picks its kernel
        torch.matmul(x, y, out=out)
    torch.cuda.synchronize()
    windows, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        w0, n = time.perf_counter(), 0
        while time.perf_counter() - w0 < a.window:
            for _ in range(20):
                torch.matmul(x, y, out=out)
            torch.cuda.synchronize()
            n += 20
        dt = time.perf_counter() - w0
        windows.append({"start_s": round(w0 - t0, 1), "seconds": round(dt, 2), "tflops": round(n * flop / dt / 1e12, 1)})
        print(f"{windows[-1]['start_s']:7.1f} s  {windows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
    rates = [w["tflops"] for w in windows]
    res = {"n": a.n, "device": torch.cuda.get_device_name(), "windows": windows,
           "first": rates[0], "last": rates[-1], "min": min(rates), "max": max(rates)}
    print(f"first {rates[0]} last {rates[-1]} min {min(rates)} max {max(rates)} TFLOP/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
