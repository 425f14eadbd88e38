"""One figure per case: NDCG@20 and Spearman (query mean +- SE) and LDS (bootstrap 95% CI) of
1-bit EOGP, its variant(s) and FP16 EOGP at the same k, from an `eogp eval all` --out folder;
also prints the markdown rows (gap and share of it closed per budget).

usage: python examples/plot_variants.py OUT_DIR PNG TITLE

    python examples/plot_variants.py runs/eval-manpages-variants examples/eval/one_bit_variants_manpages.png manpages
"""

import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ROLES = ("base", "variant", "ceiling")
NAMES = {"base": "EOGP (1 bit)", "variant": "EOGP-rot (1 bit)", "ceiling": "EOGP (FP16, same k, 16x bytes)"}
LABELS = {"base": "EOGP", "variant": "EOGP-rot", "ceiling": "EOGP (FP16, same k)"}
TITLES = {"ndcg@20": "NDCG@20 vs EK-FAC (± SE)", "spearman": "Spearman vs EK-FAC (± SE)", "lds": "LDS (95% CI)"}


def lds_points(records, role):
    """``(budgets, values, (below, above))`` of one method's LDS and its 95% interval."""
    pts = sorted(
        (r["bytes_per_example"], r["value"], r.get("ci_low"), r.get("ci_high"))
        for r in records
        if r["metric"] == "lds" and r["method"] == LABELS[role]
    )
    below = [max(0, p[1] - p[2]) for p in pts]
    above = [max(0, p[3] - p[1]) for p in pts]
    return [p[0] for p in pts], [p[1] for p in pts], (below, above)


def plot(records, gap, png: Path, title: str) -> None:
    fig = Figure(figsize=(13, 3.8), dpi=130)
    FigureCanvasAgg(fig)
    has_lds = any(r["metric"] == "lds" for r in records)
    budgets = [r["budget"] for r in gap]
    for i, metric in enumerate(("ndcg@20", "spearman", "lds")):
        ax = fig.add_subplot(1, 3, i + 1)
        for j, role in enumerate(ROLES):
            if metric == "lds" and not has_lds:
                ax.set_visible(False)
                continue
            if metric == "lds":
                xs, ys, err = lds_points(records, role)
            else:
                xs, ys = budgets, [r[metric][role] for r in gap]
                err = [r[metric]["se"][j] for r in gap]
            # Each method slightly offset along x, so that the error bars do not overlap.
            ax.errorbar(
                [x * (1 + 0.04 * (j - 1)) for x in xs],
                ys,
                yerr=err,
                marker="os^"[j],
                capsize=3,
                label=NAMES[role],
                color=f"C{j}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([f"{b} B" if b < 1024 else f"{b // 1024} KB" for b in budgets], fontsize=7)
        ax.set_title(TITLES[metric], fontsize=9)
        ax.set_xlabel("bytes per example (1-bit budget)", fontsize=8)
        ax.grid(True, linestyle=":")
        if i == 0:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, bbox_inches="tight")


def table(records, gap) -> str:
    lds = {(r["method"], r["bytes_per_example"]): r for r in records if r["metric"] == "lds"}
    lines = [
        "| budget | k_u | NDCG@20: EOGP / rot / FP16 same k | gap, closed by rot | Spearman: EOGP / rot / FP16 "
        "| LDS: EOGP / rot / FP16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in gap:
        b, n, s = r["budget"], r["ndcg@20"], r["spearman"]
        closed = "n/a (no gap)" if n["gap_closed"] is None else f"{100 * n['gap_closed']:+.0f}%"
        L = [lds.get((LABELS[role], b), {}).get("value", float("nan")) for role in ROLES]
        lines.append(
            f"| {b} | {r['k'][0]} | {n['base']:.3f} ± {n['se'][0]:.3f} / {n['variant']:.3f} / "
            f"{n['ceiling']:.3f} | {n['ceiling'] - n['base']:+.3f}, {closed} (rot−EOGP {n['diff']:+.3f} ± "
            f"{n['diff_se']:.3f}) | {s['base']:.3f} / {s['variant']:.3f} / {s['ceiling']:.3f} | "
            f"{L[0]:.3f} / {L[1]:.3f} / {L[2]:.3f} |"
        )
    return "\n".join(lines)


def main(argv) -> None:
    out, png, title = Path(argv[0]), Path(argv[1]), argv[2]
    details = json.loads((out / "details.json").read_text())
    records = json.loads((out / "results.json").read_text())
    records = records["records"] if isinstance(records, dict) else records
    gap = details["fidelity"]["one_bit_gap"]
    plot(records, gap, png, title)
    print(table(records, gap))


if __name__ == "__main__":
    main(sys.argv[1:])
