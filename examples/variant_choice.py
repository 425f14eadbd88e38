"""How variant auto chose, from `eogp eval fidelity --methods eogp,eogp-rot,auto` --out folders.

Prints, per case: auto against the better fixed code at every budget (NDCG@20 and Spearman,
paired standard errors), how many modules chose EOGP-rot per budget; the held-out measurement
itself (each code's and the FP16 coordinates' fidelity to the first-stage inner products, means
over modules); and, across every case,
budget and module, the correlation between the held-out proxy (EOGP-rot - EOGP on held-out
fitting documents, against their first-stage inner products) and the reference gain of rotating that module (fidelity to
kronfluence's EK-FAC with only that module rotated, minus all-EOGP). Writes one PNG of the latter.

usage: python examples/variant_choice.py PNG NAME=OUT_DIR [NAME=OUT_DIR ...]

    python examples/variant_choice.py examples/eval/variant_choice.png default=runs/eval-default-auto
"""

import json
import sys
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy import stats

METRICS = ("ndcg@20", "spearman")


def load(folder: Path) -> dict:
    return json.loads((folder / "details.json").read_text())["fidelity"]


def best_rows(name: str, fidelity: dict) -> list:
    """Markdown rows: auto against the better fixed code, per budget."""
    rows = []
    for row in fidelity["auto_vs_best"]:
        cells = []
        for metric in METRICS:
            v = row[metric]
            flag = "" if v["never_worse"] else " (worse)"
            cells.append(
                f"{v['eogp']:.3f} | {v['eogp-rot']:.3f} | {v['auto']:.3f} | {v['diff']:+.3f} ± {v['diff_se']:.3f}{flag}"
            )
        picked = [c for c in fidelity["auto_choice"] if c["budget"] == row["budget"]]
        rotated = sum(c["code"] == "eogp-rot" for c in picked)
        head = f"| {name} | {row['budget']} ({row['k'][0]}) | {rotated}/{len(picked)} | "
        rows.append(head + " | ".join(cells) + " |")
    return rows


def held_out_rows(name: str, fidelity: dict) -> list:
    """Markdown rows: per budget, the held-out fidelity to the first-stage inner products of each
    code and of the FP16 coordinates at the same k, averaged over modules (what the signs cost)."""
    rows = []
    for budget in sorted({c["budget"] for c in fidelity["auto_choice"]}):
        picked = [c for c in fidelity["auto_choice"] if c["budget"] == budget and c["held_out"]]
        if not picked or "fp16" not in picked[0]["proxy"]:
            continue
        cells = []
        for metric in METRICS:
            cells += [
                f"{np.mean([c['proxy'][code][metric] for c in picked]):.3f}" for code in ("eogp", "eogp-rot", "fp16")
            ]
        rows.append(f"| {name} | {budget} ({picked[0]['k']}) | {picked[0]['held_out']} | " + " | ".join(cells) + " |")
    return rows


def correlations(points: list) -> list:
    """Pearson and Spearman of the proxy against each reference gain, over the points given."""
    proxy = np.array([p["proxy_diff"] for p in points], dtype=float)
    lines = []
    for metric in METRICS + ("mean",):
        if metric == "mean":
            gain = np.array([(p["reference_gain"]["ndcg@20"] + p["reference_gain"]["spearman"]) / 2 for p in points])
        else:
            gain = np.array([p["reference_gain"][metric] for p in points])
        ok = np.isfinite(proxy) & np.isfinite(gain)
        pearson = stats.pearsonr(proxy[ok], gain[ok]).statistic
        spearman = stats.spearmanr(proxy[ok], gain[ok]).statistic
        agree = np.mean(np.sign(proxy[ok]) == np.sign(gain[ok]))
        lines.append(f"| {metric} gain | {ok.sum()} | {pearson:+.3f} | {spearman:+.3f} | {agree:.2f} |")
    return lines


def plot(points_by_case: dict, png: Path) -> None:
    fig = Figure(figsize=(6.5, 4.2), dpi=130)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, points) in enumerate(points_by_case.items()):
        proxy = [p["proxy_diff"] for p in points]
        gain = [(p["reference_gain"]["ndcg@20"] + p["reference_gain"]["spearman"]) / 2 for p in points]
        ax.scatter(proxy, gain, s=14, marker="os^D"[i % 4], label=name, alpha=0.75)
    ax.axhline(0, color="0.6", linewidth=0.8)
    ax.axvline(0, color="0.6", linewidth=0.8)
    ax.set_xlabel("held-out proxy: EOGP-rot − EOGP vs first stage (mean of NDCG@20, Spearman)")
    ax.set_ylabel("reference gain of rotating the module")
    ax.set_title("Per module and budget: proxy against reference gain", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)


def main(argv: list) -> None:
    png, cases = Path(argv[0]), dict(arg.split("=", 1) for arg in argv[1:])
    points_by_case = {}
    print(
        "| case | budget (k_u) | modules rotated | NDCG@20 EOGP | EOGP-rot | auto | auto − best | "
        "Spearman EOGP | EOGP-rot | auto | auto − best |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, folder in cases.items():
        fidelity = load(Path(folder))
        print("\n".join(best_rows(name, fidelity)))
        points_by_case[name] = [c for c in fidelity["auto_choice"] if c["held_out"]]
    print(
        "\n| case | budget (k_u) | held out | NDCG@20 EOGP | EOGP-rot | FP16 at k | Spearman EOGP | EOGP-rot "
        "| FP16 at k |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, folder in cases.items():
        print("\n".join(held_out_rows(name, load(Path(folder)))))
    everything = [p for points in points_by_case.values() for p in points]
    print("\n| proxy against | points | Pearson | Spearman | same sign |\n|---|---:|---:|---:|---:|")
    print("\n".join(correlations(everything)))
    for name, points in points_by_case.items():
        print(f"\n{name}:")
        print("\n".join(correlations(points)))
    plot(points_by_case, png)
    print(f"\n{png}")


if __name__ == "__main__":
    main(sys.argv[1:])
