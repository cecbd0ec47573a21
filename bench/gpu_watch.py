"""What the GPU's clocks, temperature and power did while a benchmark method ran, so a slow run can be told
apart from a slow method: `nvidia-smi` samples in its own process (its query loop, `-lms`), nothing is
asked of the benchmark's process but starting and stopping it.

    w = GpuWatch(device).start(); ...; summary = w.stop()   # None where there is no nvidia-smi or no CUDA device

The summary: samples, SM clock min / median / max (MHz) against the card's maximum, temperature at the start and
the maximum (C), mean and maximum power (W), and the clock-event reasons seen in any sample other than idle
(nvidia-smi's bit mask, e.g. 0x20 software thermal slowdown, 0x40 hardware thermal slowdown, 0x4 power cap).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile

FIELDS = ["clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw", "clocks_event_reasons.active"]
OLD_REASONS = "clocks_throttle_reasons.active"  # the same field's name before driver 535


def gpu_index(device) -> str | None:
    """nvidia-smi's index of a torch CUDA device (through CUDA_VISIBLE_DEVICES), or None for other devices."""
    if getattr(device, "type", None) != "cuda":
        return None
    i = device.index or 0
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        parts = [p.strip() for p in vis.split(",") if p.strip()]
        return parts[i] if i < len(parts) else None
    return str(i)


def _num(s: str) -> float | None:
    try:
        return float(s.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def summarize(lines: list[str]) -> dict | None:
    """Summary of nvidia-smi csv lines (noheader, nounits) in FIELDS' order; None when there are none."""
    rows = [[c.strip() for c in ln.split(",")] for ln in lines if ln.count(",") >= len(FIELDS) - 1]
    if not rows:
        return None
    sm = [v for v in (_num(r[0]) for r in rows) if v is not None]
    temp = [v for v in (_num(r[2]) for r in rows) if v is not None]
    power = [v for v in (_num(r[3]) for r in rows) if v is not None]
    reasons = 0
    for r in rows:
        try:
            reasons |= int(r[4], 16) & ~0x1  # 0x1: idle, not a slowdown
        except ValueError:
            pass
    out = {"samples": len(rows)}
    if sm:
        out.update(sm_mhz_min=min(sm), sm_mhz_median=statistics.median(sm), sm_mhz_max=max(sm))
    mx = _num(rows[0][1])
    if mx is not None:
        out["sm_mhz_card_max"] = mx
    if temp:
        out.update(temp_c_first=temp[0], temp_c_max=max(temp))
    if power:
        out.update(power_w_mean=round(sum(power) / len(power), 1), power_w_max=max(power))
    out["clock_event_reasons"] = hex(reasons)
    return out


class GpuWatch:
    def __init__(self, device, interval_ms: int = 500):
        self.index = gpu_index(device)
        self.interval_ms = interval_ms
        self.proc = None
        self.file = None

    def _cmd(self, fields: list[str]) -> list[str]:
        return ["nvidia-smi", "-i", self.index, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits",
                "-lms", str(self.interval_ms)]

    def start(self) -> "GpuWatch":
        if self.index is None or shutil.which("nvidia-smi") is None:
            return self
        fields = FIELDS
        probe = subprocess.run(self._cmd(fields)[:-2], capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:  # an older driver names the reasons field differently
            fields = FIELDS[:-1] + [OLD_REASONS]
        self.file = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self._cmd(fields), stdout=self.file, stderr=subprocess.DEVNULL)
        return self

    def stop(self) -> dict | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.file.seek(0)
        lines = self.file.read().splitlines()
        self.file.close()
        self.proc = None
        return summarize(lines)
