"""Evaluation reports: metric-versus-storage plots, a Markdown table and a JSON dump.

A result record is one measured number: ``method`` (e.g. ``"EOGP"``, ``"LoGra (PCA)"``),
``bytes_per_example`` (per-example payload, shared artifacts excluded), ``metric``
(``"ndcg@20"``, ``"spearman"``, ``"lds"``, ``"pearson_1bit_fp16"``, ...), ``value`` and an
optional confidence interval ``ci_low``/``ci_high``. Records may be plain dicts or
:class:`ResultRecord`. Plots follow the paper's Figures 3-5: one marked line per method
against a log2 storage axis labelled in B/KB/MB (1 KB = 1024 B), interval bars where a CI
is known, and dashed black lines for uncompressed references. Plotting uses matplotlib's
object API with the Agg canvas, so importing this module leaves the global backend alone.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from matplotlib import rcParams
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

from eogp_index.errors import ConfigError, InputError

__all__ = [
    "ResultRecord",
    "format_bytes",
    "load_records",
    "markdown_table",
    "metric_label",
    "plot_metric_vs_bytes",
    "plot_panels",
    "write_report",
]

DEFAULT_METRICS = ("ndcg@20", "spearman", "lds")

_METRIC_LABELS = {
    "ndcg@20": "NDCG@20",
    "spearman": "Spearman correlation",
    "lds": "LDS",
    "pearson_1bit_fp16": "Pearson (1-bit vs FP16)",
}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
_REFERENCE_DASHES = ((0, (5, 3)), (0, (2, 2)), (0, (6, 2, 1, 2)), (0, (1, 1)), (0, (8, 4)))


@dataclass(frozen=True)
class ResultRecord:
    """One measured metric value of one method at one per-example storage budget."""

    method: str
    bytes_per_example: float
    metric: str
    value: float
    ci_low: float | None = None
    ci_high: float | None = None

    @classmethod
    def coerce(cls, record, where: str = "record") -> ResultRecord:
        """Validate a dict or ResultRecord and return a ResultRecord."""
        if isinstance(record, ResultRecord):
            data = asdict(record)
        elif isinstance(record, Mapping):
            data = dict(record)
        else:
            raise InputError(f"{where}: expected a dict or ResultRecord, got {type(record).__name__}")
        missing = [f for f in ("method", "bytes_per_example", "metric", "value") if f not in data]
        if missing:
            raise InputError(f"{where}: missing field(s) {', '.join(missing)}")
        unknown = set(data) - {"method", "bytes_per_example", "metric", "value", "ci_low", "ci_high"}
        if unknown:
            raise InputError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        for name in ("method", "metric"):
            if not isinstance(data[name], str) or not data[name]:
                raise InputError(f"{where}: {name} must be a non-empty string, got {data[name]!r}")
        size = _number(data["bytes_per_example"], where, "bytes_per_example")
        if size is None or not (math.isfinite(size) and size > 0):
            raise InputError(
                f"{where}: bytes_per_example must be a positive finite number, got {data['bytes_per_example']!r}"
            )
        value = _number(data["value"], where, "value")
        # A missing value (None/nan) marks a budget a method cannot reach; it is kept but
        # neither plotted nor tabulated.
        value = float("nan") if value is None else value
        lo = _number(data.get("ci_low"), where, "ci_low")
        hi = _number(data.get("ci_high"), where, "ci_high")
        if (lo is None) != (hi is None):
            raise InputError(f"{where}: give both ci_low and ci_high or neither")
        if lo is not None and lo > hi:
            raise InputError(f"{where}: ci_low {lo} exceeds ci_high {hi}")
        return cls(data["method"], size, data["metric"], value, lo, hi)

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "bytes_per_example": self.bytes_per_example,
            "metric": self.metric,
            "value": self.value if math.isfinite(self.value) else None,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
        }

    @property
    def has_ci(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None


def _number(value, where: str, name: str) -> float | None:
    """Float, or None for a missing (None or nan) value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise InputError(f"{where}: {name} must be a number, got {value!r}")
    out = float(value)
    if math.isnan(out):
        return None
    if math.isinf(out):
        raise InputError(f"{where}: {name} must be finite, got {value!r}")
    return out


def _coerce_all(records: Iterable) -> list[ResultRecord]:
    if isinstance(records, (Mapping, ResultRecord)):
        raise InputError("records must be a list of records, got a single record")
    return [ResultRecord.coerce(r, where=f"record {i}") for i, r in enumerate(records)]


def format_bytes(n: float) -> str:
    """Human label of a byte count with binary units: ``512 B``, ``12 KB``, ``1.5 MB``."""
    for unit, size in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if n >= size:
            return f"{_three_significant(n / size)} {unit}"
    return f"{_three_significant(n)} B"


def _three_significant(x: float) -> str:
    # Round to 3 significant digits without falling into scientific notation (1000 KB).
    return f"{float(f'{x:.3g}'):g}"


def _exact_bytes(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:.6g}"


def metric_label(metric: str) -> str:
    """Axis and column label of a metric name (the name itself when unknown)."""
    recall = re.fullmatch(r"recall@(\d+)", metric)
    if recall:
        return f"Recall of the tier's top 20 in the 1-bit top {recall.group(1)}"
    return _METRIC_LABELS.get(metric, metric)


def _validate_reference_lines(reference_lines, where: str) -> dict[str, float]:
    if reference_lines is None:
        return {}
    if not isinstance(reference_lines, Mapping):
        raise ConfigError(f"{where}: reference_lines must map a reference name to a value")
    out = {}
    for name, value in reference_lines.items():
        v = _number(value, where, f"reference line {name!r}")
        if v is None:
            raise ConfigError(f"{where}: reference line {name!r} has no value")
        out[str(name)] = v
    return out


# --------------------------------------------------------------------------- plot


def plot_metric_vs_bytes(
    records: Sequence,
    metric: str,
    path: str | Path,
    *,
    reference_lines: Mapping[str, float] | None = None,
    title: str | None = None,
    colours: Mapping[str, str] | None = None,
) -> Path:
    """Plot ``metric`` against per-example storage, one line per method; write a PNG.

    records: dicts or ResultRecords (other metrics are ignored; records without a value
    are skipped). reference_lines: ``{name: value}`` drawn as dashed horizontal lines
    (uncompressed references such as EK-FAC, K-FAC, TracIn). colours: ``{method: colour}``;
    a method not in it takes the colour cycle's entry for its position. Returns the PNG path.
    """
    recs = [r for r in _coerce_all(records) if r.metric == metric and math.isfinite(r.value)]
    if not recs:
        raise InputError(f"no records with a value for metric {metric!r}")
    refs = _validate_reference_lines(reference_lines, "plot_metric_vs_bytes")
    path = Path(path)

    fig = Figure(figsize=(6.4, 4.2), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])

    methods = list(dict.fromkeys(r.method for r in recs))
    for i, method in enumerate(methods):
        points = sorted((r for r in recs if r.method == method), key=lambda r: r.bytes_per_example)
        color = (colours or {}).get(method, colors[i % len(colors)])
        xs = [r.bytes_per_example for r in points]
        ax.plot(
            xs,
            [r.value for r in points],
            marker=_MARKERS[i % len(_MARKERS)],
            color=color,
            linewidth=1.6,
            markersize=5.5,
            label=method,
        )
        with_ci = [r for r in points if r.has_ci]
        if with_ci:
            # Drawn as [lo, hi] around the interval midpoint: a percentile bootstrap CI
            # need not contain the point estimate, and errorbar rejects negative extents.
            mids = [(r.ci_low + r.ci_high) / 2 for r in with_ci]
            half = [(r.ci_high - r.ci_low) / 2 for r in with_ci]
            ax.errorbar(
                [r.bytes_per_example for r in with_ci],
                mids,
                yerr=half,
                fmt="none",
                ecolor=color,
                elinewidth=1.0,
                capsize=3,
            )
    for j, (name, value) in enumerate(refs.items()):
        ax.axhline(
            value, color="black", linewidth=1.2, linestyle=_REFERENCE_DASHES[j % len(_REFERENCE_DASHES)], label=name
        )

    ax.set_xscale("log", base=2)
    ticks = sorted({r.bytes_per_example for r in recs})
    if len(ticks) <= 10:
        ax.xaxis.set_major_locator(FixedLocator(ticks))
    else:
        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=10))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_bytes(x)))
    ax.xaxis.set_minor_locator(NullLocator())
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    ax.set_xlabel("Storage per example")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(title if title is not None else metric_label(metric))
    ax.grid(True, which="major", linestyle=":", linewidth=0.7, alpha=0.8)
    n_entries = len(methods) + len(refs)
    if n_entries > 5:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=8)
    else:
        ax.legend(loc="best", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def plot_panels(
    panels: Mapping[str, Sequence[Mapping]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    x_bytes: bool = False,
) -> Path:
    """Side-by-side panels of curves against a log2 x axis; write a PNG.

    panels: ``{title: [curve, ...]}``; a curve is ``{"label", "x": [...], "y": [...]}`` with
    optional ``"low"``/``"high"`` (interval bars), ``"dashed": True`` (a level to reach, such as a
    full scan), ``"colour"`` and ``"linestyle"``. x_bytes: label the x ticks as bytes
    (:func:`format_bytes`), at powers of two.
    Returns the PNG path.
    """
    if not panels or not any(panels.values()):
        raise InputError("plot_panels needs at least one curve")
    path = Path(path)
    fig = Figure(figsize=(5.2 * len(panels), 4.2), dpi=150)
    FigureCanvasAgg(fig)
    colors = rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    axes = [fig.add_subplot(1, len(panels), i + 1) for i in range(len(panels))]
    for ax, (title, curves) in zip(axes, panels.items()):
        ticks = set()
        for i, curve in enumerate(curves):
            color = curve.get("colour", colors[i % len(colors)])
            style = (
                dict(linestyle="--", linewidth=1.0)
                if curve.get("dashed")
                else dict(marker=_MARKERS[i % len(_MARKERS)], linestyle=curve.get("linestyle", "-"))
            )
            ax.plot(curve["x"], curve["y"], color=color, label=curve["label"], markersize=4.5, **style)
            ticks.update(curve["x"])
            if curve.get("low") is not None:
                mids = [(lo + hi) / 2 for lo, hi in zip(curve["low"], curve["high"])]
                half = [(hi - lo) / 2 for lo, hi in zip(curve["low"], curve["high"])]
                ax.errorbar(curve["x"], mids, yerr=half, fmt="none", ecolor=color, elinewidth=0.8, capsize=2)
        ax.set_xscale("log", base=2)
        ticks = sorted(ticks)
        if x_bytes:
            ax.xaxis.set_major_locator(LogLocator(base=2, numticks=10))
        elif len(ticks) <= 8:
            ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_bytes(x) if x_bytes else f"{x:g}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="major", linestyle=":", linewidth=0.7, alpha=0.8)
        ax.legend(loc="best", fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


# --------------------------------------------------------------------------- table


def markdown_table(records: Sequence, metrics: Sequence[str] = DEFAULT_METRICS) -> str:
    """Markdown table: one row per (method, bytes per example), one column per metric.

    Rows keep the methods' first-appearance order, budgets ascending within a method.
    Values have 3 decimals; a missing value is "—". Two records for the same cell raise
    InputError rather than one silently winning.
    """
    recs = _coerce_all(records)
    metrics = list(metrics)
    if not metrics:
        raise ConfigError("markdown_table needs at least one metric")
    cells: dict[tuple[str, float, str], float] = {}
    for r in recs:
        key = (r.method, r.bytes_per_example, r.metric)
        if key in cells:
            raise InputError(f"two records for method {r.method!r}, {r.bytes_per_example:g} bytes, metric {r.metric!r}")
        cells[key] = r.value
    methods = list(dict.fromkeys(r.method for r in recs))
    rows = []
    for method in methods:
        for size in sorted({r.bytes_per_example for r in recs if r.method == method}):
            values = []
            for m in metrics:
                v = cells.get((method, size, m))
                values.append("—" if v is None or not math.isfinite(v) else f"{v:.3f}")
            rows.append([method.replace("|", "\\|"), f"{format_bytes(size)} ({_exact_bytes(size)} B)", *values])
    header = ["Method", "Bytes per example", *(metric_label(m) for m in metrics)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---:", *(["---:"] * len(metrics))]) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- report


def _file_stem(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", metric.replace("@", "_at_"))


def _references_by_metric(reference_lines, metrics: Sequence[str]) -> dict[str, dict[str, float]]:
    if reference_lines is None:
        return {m: {} for m in metrics}
    if not isinstance(reference_lines, Mapping):
        raise ConfigError("reference_lines must be a mapping")
    nested = [isinstance(v, Mapping) for v in reference_lines.values()]
    if nested and all(nested):
        unknown = set(reference_lines) - set(metrics)
        if unknown:
            raise ConfigError(f"reference_lines names metric(s) with no records: {', '.join(sorted(unknown))}")
        return {m: _validate_reference_lines(reference_lines.get(m), f"reference_lines[{m!r}]") for m in metrics}
    if any(nested):
        raise ConfigError("reference_lines must be either {name: value} for every plot or {metric: {name: value}}")
    flat = _validate_reference_lines(reference_lines, "reference_lines")
    return {m: flat for m in metrics}


def write_report(
    records: Sequence, out_dir: str | Path, *, reference_lines=None, colours: Mapping[str, str] | None = None
) -> dict[str, Path]:
    """Write ``results.json``, one ``<metric>.png`` per metric present and ``results.md``.

    reference_lines: ``{name: value}`` drawn on every plot, or ``{metric: {name: value}}``
    per metric (an uncompressed LDS reference makes no sense on a fidelity plot).
    colours: ``{method: colour}`` of the lines (:func:`plot_metric_vs_bytes`).
    Returns ``{"json": ..., "markdown": ..., <metric>: png path, ...}``.
    """
    recs = _coerce_all(records)
    if not recs:
        raise InputError("write_report needs at least one record")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    present = list(dict.fromkeys(r.metric for r in recs))
    # Known metrics first in the paper's order, then any others as they appear.
    metrics = [m for m in DEFAULT_METRICS if m in present] + [m for m in present if m not in DEFAULT_METRICS]
    refs = _references_by_metric(reference_lines, metrics)

    paths: dict[str, Path] = {}
    json_path = out_dir / "results.json"
    payload = {
        "records": [r.to_json() for r in recs],
        "reference_lines": {m: refs[m] for m in metrics if refs[m]},
    }
    json_path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    paths["json"] = json_path

    stems: dict[str, str] = {}
    for m in metrics:
        stem = _file_stem(m)
        if stem in stems.values():
            raise InputError(
                f"metrics {m!r} and {[k for k, v in stems.items() if v == stem][0]!r} map to the same file name"
            )
        stems[m] = stem
        if any(r.metric == m and math.isfinite(r.value) for r in recs):
            paths[m] = plot_metric_vs_bytes(recs, m, out_dir / f"{stem}.png", reference_lines=refs[m], colours=colours)

    md = ["# Evaluation results", "", markdown_table(recs, metrics)]
    with_refs = [m for m in metrics if refs[m]]
    if with_refs:
        md += ["## Uncompressed references", "", "| Metric | Reference | Value |", "|---|---|---:|"]
        md += [f"| {metric_label(m)} | {name} | {v:.3f} |" for m in with_refs for name, v in refs[m].items()]
        md.append("")
    md_path = out_dir / "results.md"
    md_path.write_text("\n".join(md), encoding="utf-8")
    paths["markdown"] = md_path
    return paths


def load_records(path: str | Path) -> list[ResultRecord]:
    """Read the records of a ``results.json`` written by :func:`write_report`."""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc}", location=str(path)) from exc
    if not isinstance(payload, Mapping) or not isinstance(payload.get("records"), list):
        raise InputError("expected an object with a 'records' list", location=str(path))
    return [ResultRecord.coerce(r, where=f"{path}: record {i}") for i, r in enumerate(payload["records"])]
