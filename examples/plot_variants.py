"""One figure per case: NDCG@20 and Spearman (query mean +- SE) and LDS (bootstrap 95% CI) of
1-bit EOGP, its variant(s) and FP16 EOGP at the same k, from an `eogp eval all` --out folder;
also prints the markdown rows (gap and share of it closed per budget).

usage: python examples/plot_variants.py OUT_DIR PNG TITLE

    python examples/plot_variants.py runs/eval-manpages-variants examples/eval/one_bit_variants_manpages.png manpages
"""
import json, math, sys
from pathlib import Path
from matplotlib.figure import Figure
from matplotlib.backends.backend_agg import FigureCanvasAgg

out, png, title = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
details = json.loads((out / "details.json").read_text())
records = json.loads((out / "results.json").read_text())
records = records["records"] if isinstance(records, dict) else records
gap = details["fidelity"]["one_bit_gap"]
names = {"base": "EOGP (1 bit)", "variant": "EOGP-rot (1 bit)", "ceiling": "EOGP (FP16, same k, 16x bytes)"}
labels = {"base": "EOGP", "variant": "EOGP-rot", "ceiling": "EOGP (FP16, same k)"}
fig = Figure(figsize=(13, 3.8), dpi=130); FigureCanvasAgg(fig)
for i, metric in enumerate(("ndcg@20", "spearman", "lds")):
    ax = fig.add_subplot(1, 3, i + 1)
    for j, role in enumerate(("base", "variant", "ceiling")):
        if metric == "lds" and not any(r["metric"] == "lds" for r in records):
            ax.set_visible(False); continue
        if metric == "lds":
            pts = sorted((r["bytes_per_example"], r["value"], r.get("ci_low"), r.get("ci_high")) for r in records
                         if r["metric"] == "lds" and r["method"] == labels[role])
            xs = [p[0] for p in pts]; ys = [p[1] for p in pts]
            lo = [p[1] - p[2] for p in pts]; hi = [p[3] - p[1] for p in pts]
            lo = [max(0, v) for v in lo]; hi = [max(0, v) for v in hi]
            ax.errorbar([x * (1 + 0.04 * (j - 1)) for x in xs], ys, yerr=[lo, hi], marker="os^"[j], capsize=3,
                        label=names[role], color=f"C{j}")
        else:
            xs = [r["budget"] for r in gap]; ys = [r[metric][role] for r in gap]
            se = [r[metric]["se"][("base", "variant", "ceiling").index(role)] for r in gap]
            ax.errorbar([x * (1 + 0.04 * (j - 1)) for x in xs], ys, yerr=se, marker="os^"[j], capsize=3,
                        label=names[role], color=f"C{j}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["budget"] for r in gap]); ax.set_xticklabels([f"{b} B" if b < 1024 else f"{b // 1024} KB" for b in (r["budget"] for r in gap)], fontsize=7)
    ax.set_title({"ndcg@20": "NDCG@20 vs EK-FAC (± SE)", "spearman": "Spearman vs EK-FAC (± SE)", "lds": "LDS (95% CI)"}[metric], fontsize=9)
    ax.set_xlabel("bytes per example (1-bit budget)", fontsize=8); ax.grid(True, linestyle=":")
    if i == 0:
        ax.legend(fontsize=7)
fig.suptitle(title, fontsize=10)
png.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(png, bbox_inches="tight")
lds = {(r["method"], r["bytes_per_example"]): r for r in records if r["metric"] == "lds"}
print("| budget | k_u | NDCG@20: EOGP / rot / FP16 same k | gap, closed by rot | Spearman: EOGP / rot / FP16 | LDS: EOGP / rot / FP16 |")
print("|---|---|---|---|---|---|")
for r in gap:
    b = r["budget"]; n, s = r["ndcg@20"], r["spearman"]
    g = n["ceiling"] - n["base"]
    closed = "n/a (no gap)" if n["gap_closed"] is None else f"{100 * n['gap_closed']:+.0f}%"
    L = [lds.get((labels[x], b), {}).get("value", float("nan")) for x in ("base", "variant", "ceiling")]
    print(f"| {b} | {r['k'][0]} | {n['base']:.3f} ± {n['se'][0]:.3f} / {n['variant']:.3f} / {n['ceiling']:.3f} | "
          f"{g:+.3f}, {closed} (rot−EOGP {n['diff']:+.3f} ± {n['diff_se']:.3f}) | {s['base']:.3f} / {s['variant']:.3f} / {s['ceiling']:.3f} | "
          f"{L[0]:.3f} / {L[1]:.3f} / {L[2]:.3f} |")
