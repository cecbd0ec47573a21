"""What a training reports as it goes: each step's bookkeeping (rates, the progress bar), `train/metrics.jsonl`,
TensorBoard scalars (when it is installed) and `train/curves.png`."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from matplotlib.figure import Figure

from ..util import EyasError, PhaseClock, atomic_path, atomic_write_text, text_lines, writing
from .checkpoint import DIVERGED

try:  # TensorBoard is optional
    from torch.utils.tensorboard import SummaryWriter
except Exception:  # noqa: BLE001
    SummaryWriter = None


class Metrics:
    """metrics.jsonl (rank 0), TensorBoard scalars when available, curves.png at the end."""

    def __init__(self, run: Path, main: bool, resume_step: int):
        self.path = run / "train" / "metrics.jsonl"
        self.main = main
        self.rows: list[dict] = []
        self.tb = None
        if not main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # keep what the checkpoint covers; drop rows a killed run wrote after it
            for line in text_lines(self.path.read_text()):
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r.get("step", 0) <= resume_step:
                    self.rows.append(r)
        atomic_write_text_lines(self.path, self.rows)
        try:
            self.tb = SummaryWriter(str(run / "train" / "tb"), purge_step=resume_step + 1) if SummaryWriter else None
        except Exception:  # noqa: BLE001 - TensorBoard is optional
            self.tb = None

    def add(self, row: dict) -> None:
        if not self.main:
            return
        self.rows.append(row)
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k == "step":
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i}", x, row["step"])
                elif isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self, png: Path) -> None:
        if not self.main:
            return
        if self.tb is not None:
            self.tb.close()
        plot_curves(self.rows, png)


def atomic_write_text_lines(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def plot_curves(rows: list[dict], png: Path) -> None:
    tr = [r for r in rows if "loss" in r]
    ev = [r for r in rows if "val_al" in r]
    fig = Figure(figsize=(15, 4))  # no pyplot: nothing global, no backend to choose
    ax = fig.subplots(1, 3)
    if tr:
        ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=0.8)
        for j in range(len(tr[0]["acc"])):
            ax[1].plot([r["step"] for r in tr], [r["acc"][j] for r in tr], lw=0.8, label=f"train step {j}")
    for j in range(len(ev[0]["val_acc"]) if ev else 0):
        ax[1].plot([r["step"] for r in ev], [r["val_acc"][j] for r in ev], "o-", label=f"val step {j}")
    for key, label in (("val_al", "val_al (sum of step accuracies' products)"), ("val_tau", "val_tau (sampled answers)"),
                       ("greedy_tau", "greedy_tau (the target's greedy answers)")):
        pts = [r for r in ev if key in r]
        if pts:
            ax[2].plot([r["step"] for r in pts], [r[key] for r in pts], "o-", label=label)
    ax[0].set_title("training loss (TTT, weighted)")
    ax[1].set_title("accuracy per TTT step")
    ax[2].set_title("validation: simulated acceptance, tau forecasts")
    for a in ax:
        a.set_xlabel("optimizer step")
        a.grid(alpha=0.3)
    ax[1].legend(fontsize=7)
    if ev:
        ax[2].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def time_shares(totals: dict[str, float]) -> dict:
    """Seconds per phase of the training step and each one's share of their sum."""
    s = sum(totals.values()) or 1.0
    return {k: {"s": round(v, 4), "share": round(v / s, 3)} for k, v in totals.items()}


class StepLog:
    """Each step's bookkeeping once its statistics are on the host: the rate (overall, steady, per epoch), where the
    steady steps' time went, the metrics row and the progress bar; a loss or gradient norm that stopped being a finite
    number stops the training there."""

    def __init__(self, metrics: Metrics, bar, clock: PhaseClock, ttt_steps: int):
        self.metrics, self.bar, self.clock, self.ttt_steps = metrics, bar, clock, ttt_steps
        self.tok_done = 0
        self.tok_window, self.t_window = 0, time.perf_counter()
        self.steady = [0.0, 0]  # seconds and tokens of the steady steps (compilation and warm-up left out)
        self.per_epoch: dict[int, list] = {}  # epoch -> [seconds, tokens] of its steady steps
        self.last_done = time.perf_counter()  # when the last step's statistics were read (or the last eval/save ended)

    def finish(self, rec: tuple) -> None:
        """rec: (step, epoch, lr, statistics on the host, the event of their copy or None, the step's loss-masked
        positions per TTT step, the step's phase marks, whether it is a warm-up step)."""
        s_, ep, lr_, host, ev, den, marks, warm = rec
        if ev is not None:
            ev.synchronize()  # waits for that step only, not for the one queued behind it
        vals = host.tolist()
        acc = [float(c) / dn for c, dn in zip(vals[1:1 + self.ttt_steps], den)]
        ntok = int(vals[-2])
        self.tok_done += ntok
        now = time.perf_counter()
        dt, self.last_done = now - self.last_done, now  # steps end one after another: the time between two ends
        if not warm:  # compilation and warm-up are not a step's usual time
            self.clock.fold(marks)  # the step's events are done: its statistics came after them
            self.steady[0] += dt
            self.steady[1] += ntok
            e_rate = self.per_epoch.setdefault(ep, [0.0, 0])
            e_rate[0] += dt
            e_rate[1] += ntok
        self.tok_window += ntok
        tps = self.tok_window / max(now - self.t_window, 1e-9)
        if now - self.t_window > 10:
            self.tok_window, self.t_window = 0, now
        row = {"step": s_, "epoch": ep, "loss": vals[0], "acc": acc, "lr": lr_, "grad_norm": vals[-1],
               "tokens": ntok, "tok_s": tps}
        self.metrics.add(row)
        # read here anyway (no wait of its own), and always before a validation or checkpoint writes anything
        for what, v in (("training loss", vals[0]), ("gradient norm", vals[-1])):
            if not math.isfinite(v):
                self.bar.close()
                raise EyasError(f"train: the {what} is {v} at step {s_} (lr {lr_:.3g}): the training diverged and "
                                f"stops here, writing nothing of it; {DIVERGED}")
        # the postfix without a refresh of its own: update() redraws at most every mininterval, where a refresh per
        # step would write every step into a captured log
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", acc="/".join(f"{a:.2f}" for a in acc), tok_s=f"{tps:,.0f}",
                             refresh=False)
        self.bar.update(1)

    def rates(self, wall: float) -> dict:
        """The summary's rates over a training of `wall` seconds."""
        return {"tokens_trained": self.tok_done, "tok_s": self.tok_done / wall if self.tok_done else 0.0,
                "tok_s_steady": self.steady[1] / self.steady[0] if self.steady[1] else None,
                "epoch_tok_s": {str(e): round(n / t, 1) for e, (t, n) in sorted(self.per_epoch.items()) if t > 0}}
