"""What a training reports as it goes: `train/metrics.jsonl`, TensorBoard scalars (when it is installed) and
`train/curves.png`."""
from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from ..util import atomic_path, atomic_write_text, text_lines, writing

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
