"""bench/gpu_watch.py: the GPU-state sampler the decoding benchmark records beside each method, run here against a
stand-in `nvidia-smi` (a shell script on PATH) that prints the csv lines the real one prints."""
import importlib.util
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_watch", ROOT / "bench" / "gpu_watch.py")
gw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gw)


def test_summarize_reads_nvidia_smi_lines():
    lines = ["1980, 1980, 41, 250.5, 0x0000000000000000",
             "1755, 1980, 44, 310.0, 0x0000000000000020",
             "1830, 1980, 43, [N/A], 0x0000000000000001",
             "garbage"]
    s = gw.summarize(lines)
    assert s["samples"] == 3
    assert (s["sm_mhz_min"], s["sm_mhz_median"], s["sm_mhz_max"]) == (1755, 1830, 1980)
    assert s["sm_mhz_card_max"] == 1980
    assert (s["temp_c_first"], s["temp_c_max"]) == (41, 44)
    assert s["power_w_mean"] == 280.2 and s["power_w_max"] == 310.0  # the [N/A] sample left out
    assert s["clock_event_reasons"] == "0x20"  # idle (0x1) is not a slowdown
    assert gw.summarize([]) is None


def test_gpu_index_maps_through_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gw.gpu_index(SimpleNamespace(type="cpu", index=None)) is None
    assert gw.gpu_index(SimpleNamespace(type="cuda", index=None)) == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gw.gpu_index(SimpleNamespace(type="cuda", index=1)) == "5"
    assert gw.gpu_index(SimpleNamespace(type="cuda", index=2)) is None


def _fake_smi(tmp_path, old_driver: bool):
    """A stand-in nvidia-smi: one line per query, a line every 50 ms under -lms; with old_driver it refuses the
    field name that drivers before 535 did not know."""
    script = tmp_path / "nvidia-smi"
    refuse = 'case "$*" in *clocks_event_reasons*) echo "Field is not a valid field" >&2; exit 2;; esac' if old_driver else ""
    script.write_text(f"""#!/bin/sh
{refuse}
echo "$*" >> {tmp_path}/calls
case "$*" in *-lms*) n=0; while true; do echo "1900, 1980, $((40 + n)), 300.0, 0x4"; n=$((n + 1)); sleep 0.05; done;;
  *) echo "1900, 1980, 40, 300.0, 0x0";; esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_watch_samples_while_running_and_stops(tmp_path, monkeypatch):
    for old in (False, True):
        d = tmp_path / str(old)
        d.mkdir()
        _fake_smi(d, old)
        monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        w = gw.GpuWatch(SimpleNamespace(type="cuda", index=0), interval_ms=50).start()
        time.sleep(0.5)
        s = w.stop()
        assert s is not None and s["samples"] >= 3
        assert s["temp_c_first"] == 40 and s["temp_c_max"] >= 42  # sampled over time, not once
        assert s["clock_event_reasons"] == "0x4"
        calls = (d / "calls").read_text()
        assert ("clocks_throttle_reasons.active" in calls) == old
        assert w.proc is None


def test_watch_is_a_no_op_without_a_cuda_device():
    assert gw.GpuWatch(SimpleNamespace(type="cpu", index=None)).start().stop() is None
