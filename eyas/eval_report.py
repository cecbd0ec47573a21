"""The eval's report: report.json (docs/design.md lists its keys), report.md and the PNG plots beside them."""
from __future__ import annotations

from pathlib import Path

from .eval_stats import REPEAT_NGRAM
from .util import atomic_path, atomic_write_json, atomic_write_text, log


def write_plots(report: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bar_png(name, x, y, color, xlabel, ylabel, title, ylim=None):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(x, y, color=color)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_title(title)
        fig.tight_layout()
        with atomic_path(out_dir / name) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        return name

    k = report["k"]
    hist = report["accepted_length_histogram"]
    total = max(1, sum(hist))
    return [
        bar_png("per_position_acceptance.png", range(1, k + 1), report["per_position_acceptance"], "#3b6ea8",
                "draft position", "acceptance (given earlier accepted)",
                f"per-position acceptance, K={k}, T={report['temperature']}", (0, 1)),
        bar_png("accepted_length_histogram.png", range(len(hist)), [h / total for h in hist], "#a8583b",
                "drafts accepted per verify step", "share of verify steps",
                f"accepted lengths, tau = {report['acceptance_length']:.2f}"),
    ]


def ci_text(r: dict) -> str:
    """The τ interval as report pages print it after τ, or nothing where the report has none."""
    ci = r.get("acceptance_length_ci95")
    if not ci:
        return ""
    return f" (95% interval {ci[0]:.2f}-{ci[1]:.2f}, bootstrap over the {r.get('conversations')} conversations)"


def report_markdown(r: dict) -> str:
    def f(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    ts = r["time_split"]
    lines = [
        f"# eyas eval: {r['target']}", "",
        f"Drafter `{r.get('draft', '')}`, "
        + (f"dynamic tree topk {r['tree']['topk']}, depth {r['tree']['depth']}, {r['tree']['tokens']} tokens "
           f"verified (SGLang: `{r['serving_flags']['sglang']}`)" if r.get("tree") else f"K = {r['k']}")
        + f", temperature = {r['temperature']}, top-p = {r['top_p']}, "
        f"{r['prompts']['count']} prompts from `{r['prompts']['set']}`, up to {r['max_new_tokens']} new tokens, "
        f"device {r['device']}.", "",
        "| metric | value |", "| --- | --- |",
        f"| acceptance length τ (tokens per target forward) | {f(r['acceptance_length'])}{ci_text(r)} |",
        f"| speculative tokens/s | {f(r['tokens_per_s'], '{:.1f}')} |",
        f"| plain decoding tokens/s (same engine) | {f(r['baseline_tokens_per_s'], '{:.1f}')} |",
        f"| speedup | {f(r['speedup'])}× |",
        f"| lossless (greedy output = plain greedy) | {r['lossless']} ("
        + (f"{r['lossless_matched']} of " if r.get("lossless_matched") is not None else "")
        + f"{r['lossless_checked']} {'equal' if r.get('lossless_matched') is not None else 'checked'}"
        + (f"; the other {r['lossless_rounding']} equal plain decoding with its steps shaped as the verify: kernel "
           f"rounding" if r.get("lossless_rounding") else "") + ") |",
        *([f"| user turns left out, too long for the {r.get('context')}-token context | "
           f"{r['turns_skipped_too_long']} |"] if r.get("turns_skipped_too_long") else []),
        f"| draft / verify / prefill / other time (s) | {ts['draft_s']:.2f} / {ts['verify_s']:.2f} / {ts['prefill_s']:.2f} / {ts['other_s']:.2f} |",
        f"| peak memory | {r['peak_memory_bytes'] / 1e6:.0f} MB |", "",
        ("Per-level acceptance (a node of level i accepted given one of each level before was): " if r.get("tree")
         else "Per-position acceptance (draft i accepted given drafts 1..i-1 were): ") +
        ", ".join(f"{i + 1}: {a:.3f}" for i, a in enumerate(r["per_position_acceptance"])), "",
        "Accepted drafts per verify step: " +
        ", ".join(f"{i}: {c}" for i, c in enumerate(r["accepted_length_histogram"])), "",
        *(["τ by the answer's place in its conversation: " + ", ".join(
            f"answer {b}: {v['acceptance_length']:.2f} ({v['answers']} answers, {v['new_tokens']} tokens)"
            for b, v in r["by_turn"].items()), ""] if r.get("by_turn") else []),
        *([f"τ by how much the answer repeats itself (the share of its {REPEAT_NGRAM}-grams seen earlier in it): " +
           ", ".join(f"{b}: {v['acceptance_length']:.2f} ({v['answers']} answers, {v['new_tokens']} tokens)"
                     for b, v in r["by_repetition"].items()), ""] if r.get("by_repetition") else []),
        "![per-position acceptance](per_position_acceptance.png)",
        "![accepted lengths](accepted_length_histogram.png)", "",
    ]
    if r.get("lossless_mismatches"):
        lines += ["Mismatches:", *[f"- {m}" for m in r["lossless_mismatches"]], ""]
    return "\n".join(lines)


def write_report(report: dict, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out_dir)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_text(out_dir / "report.md", report_markdown(report))
    stale = out_dir / "parity.json"  # `eyas parity`'s comparison with the report just replaced
    if stale.exists():
        stale.unlink()
        log(f"eval: removed {stale}, an engine's parity check against the eval this one replaces (run `eyas "
            f"parity` again to check against this one)")
    return out_dir / "report.json"
