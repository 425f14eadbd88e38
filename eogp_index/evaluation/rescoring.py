"""Rescoring from a higher-precision tier: what the one-bit scan's top rows lose, and what
rescoring them wins back (issue: faithful at the top).

An index with a rescoring tier (``eogp fit --rescore``) keeps, besides the one-bit code, the same
coordinates at int8, int4 or FP16 (:class:`~eogp_index.store.codecs.TierCodec`); a query scans the
one-bit code, keeps the top ``N = F · 20`` rows of each side and orders them by the tier
(:mod:`eogp_index.search.rescore`). Here the same is done to the evaluation's score matrices, all
from the one shared gradient pass (:meth:`~eogp_index.evaluation.fidelity.SharedPass.score_pca`):

* :func:`rescored_order`: the ranking a rescoring query gives, over every row (for Spearman): the
  one-bit top ``N`` rows in the tier's order, then the rows neither side kept in one-bit order,
  then the one-bit bottom ``N`` (the negative side) in the tier's order;
* :func:`recall_curve`: the share of the tier's top 20 found among the one-bit top ``F · 20``;
* :func:`index_factor`: **the index's F**, the default rescoring factor an index of these
  documents would choose, by the one function the fit and the table's measurement use
  (:func:`eogp_index.fit.recall.index_recall`: the smallest ``F`` whose rescored top keeps within
  :data:`~eogp_index.config.RESCORE_GAP_TARGET` of the tier's own NDCG), measured as the table's
  measurement does: the fit's held-out documents as queries scoring the training rows;
* :func:`rescoring_details` and :func:`rescoring_records`: per 1-bit PCA method and budget, the
  one-bit scan, each tier alone (a full scan of the tier), the rescored ranking at each ``F`` and
  at the index's ``F``, and the recall curve, against kronfluence's uncompressed EK-FAC; and the
  tier's ``k`` curve (tiers of 1, 2 and 4 times the one-bit ``k``) with the bytes per example on
  disk (one-bit + tier).

Score matrices are ``(n_queries, n_rows)``, signed. Ties are broken by ascending row index, as
:mod:`~eogp_index.evaluation.metrics` and the index's rescoring break them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from eogp_index.config import tier_bytes_per_module
from eogp_index.errors import ConfigError
from eogp_index.evaluation import metrics

__all__ = [
    "TARGET_GAP",
    "index_factor",
    "recall_curve",
    "rescored_order",
    "rescored_scores",
    "rescoring_details",
    "rescoring_records",
]

#: How close the rescored NDCG@20 must come to the tier's own full scan.
TARGET_GAP = 0.005
#: The z-value of the 95% normal intervals of the report's rescoring records.
_Z95 = 1.959964


def _descending(scores: np.ndarray) -> np.ndarray:
    """``(nq, n)`` → row indices best first, ties by ascending index."""
    return np.argsort(-scores, axis=1, kind="stable")


def _by_tier(rows: np.ndarray, tier: np.ndarray) -> np.ndarray:
    """``rows`` ``(nq, r)`` reordered by ``tier`` ``(nq, n)``, largest first, ties by ascending row."""
    if rows.shape[1] == 0:
        return rows
    rows = np.sort(rows, axis=1)
    order = np.argsort(-np.take_along_axis(tier, rows, axis=1), axis=1, kind="stable")
    return np.take_along_axis(rows, order, axis=1)


def rescored_order(one_bit: np.ndarray, tier: np.ndarray, n: int) -> np.ndarray:
    """The ranking of every row when the one-bit top ``n`` of each side is rescored by the tier.

    Args:
        one_bit, tier: ``(nq, rows)`` scores of the one-bit scan and of the tier.
        n: rows kept per side (``F · 20``).

    Returns:
        ``(nq, rows)`` int64 row indices, best first: the one-bit top ``n`` in the tier's order,
        then the rows in neither side in one-bit order, then the one-bit bottom ``n`` (the
        negative side; fewer when the sides would overlap) in the tier's order. With ``n`` at
        least ``rows`` this is the tier's own ranking.
    """
    one_bit, tier = np.asarray(one_bit, np.float64), np.asarray(tier, np.float64)
    if one_bit.shape != tier.shape or one_bit.ndim != 2:
        raise ConfigError(f"one-bit and tier scores must be (nq, rows) of one shape, got {one_bit.shape}, {tier.shape}")
    if n < 1:
        raise ConfigError(f"rows rescored per side must be at least 1, got {n}")
    rows = one_bit.shape[1]
    top = min(int(n), rows)
    bottom = min(int(n), rows - top)
    order = _descending(one_bit)
    return np.concatenate(
        [_by_tier(order[:, :top], tier), order[:, top : rows - bottom], _by_tier(order[:, rows - bottom :], tier)],
        axis=1,
    ).astype(np.int64)


def rescored_scores(one_bit: np.ndarray, tier: np.ndarray, n: int) -> np.ndarray:
    """:func:`rescored_order` as ``(nq, rows)`` float64 scores (``rows`` for the first row down to
    1 for the last), which the fidelity metrics rank exactly as the order."""
    order = rescored_order(one_bit, tier, n)
    out = np.empty(order.shape, np.float64)
    np.put_along_axis(out, order, np.arange(order.shape[1], 0, -1, dtype=np.float64)[None, :], axis=1)
    return out


def recall_curve(one_bit: np.ndarray, tier: np.ndarray, sizes: Sequence[int], top: int = 20) -> np.ndarray:
    """Per query, the share of the tier's top ``top`` rows among the one-bit top ``N``.

    Args:
        one_bit, tier: ``(nq, rows)`` scores.
        sizes: the ``N`` (``F · top``), each ``>= 1``.

    Returns:
        ``(len(sizes), nq)`` float64 shares in ``[0, 1]``, non-decreasing in ``N``.
    """
    one_bit, tier = np.asarray(one_bit, np.float64), np.asarray(tier, np.float64)
    rows = one_bit.shape[1]
    top = min(int(top), rows)
    wanted = np.zeros(tier.shape, dtype=bool)
    np.put_along_axis(wanted, _descending(tier)[:, :top], True, axis=1)
    found = np.cumsum(np.take_along_axis(wanted, _descending(one_bit), axis=1), axis=1)  # (nq, rows)
    return np.stack([found[:, min(int(n), rows) - 1] / top for n in sizes])


def _summary(values: np.ndarray) -> Dict[str, float]:
    """Query mean and standard error of ``values`` ``(nq,)``."""
    values = np.asarray(values, np.float64)
    return {"mean": metrics.nanmean(values), "se": metrics.standard_error(values)}


def _fidelity(scores: np.ndarray, reference: np.ndarray, ndcg_k: int) -> Dict[str, np.ndarray]:
    return {
        f"ndcg@{ndcg_k}": metrics.ndcg_at_k_per_query(scores, reference, ndcg_k),
        "spearman": metrics.spearman_per_query(scores, reference),
    }


def _rescored_at(
    one_bit: np.ndarray, tier: np.ndarray, reference: np.ndarray, alone: Dict[str, np.ndarray], factor: int, ndcg_k: int
) -> Dict[str, Any]:
    """The one-bit top ``factor · ndcg_k`` of each side rescored by the tier: its metrics, the gap
    to the tier alone (paired per query) and the recall of the tier's top ``ndcg_k``."""
    ndcg = f"ndcg@{ndcg_k}"
    size = int(factor) * ndcg_k
    values = _fidelity(rescored_scores(one_bit, tier, size), reference, ndcg_k)
    return {
        "factor": int(factor),
        "n": size,
        **{metric: _summary(v) for metric, v in values.items()},
        "gap": _summary(alone[ndcg] - values[ndcg]),
        "recall": _summary(recall_curve(one_bit, tier, [size], ndcg_k)[0]),
    }


def _tier_entry(
    one_bit: np.ndarray,
    tier: np.ndarray,
    reference: np.ndarray,
    *,
    ndcg_k: int,
    factors: Sequence[int],
    index: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """One tier's full scan, its rescored ranking at each factor and at the index's (``index``,
    :func:`index_factor`), and the recall curve."""
    alone = _fidelity(tier, reference, ndcg_k)
    rescored = [_rescored_at(one_bit, tier, reference, alone, f, ndcg_k) for f in factors]
    within = [r["factor"] for r in rescored if r["gap"]["mean"] <= TARGET_GAP]
    entry = {
        "alone": {metric: _summary(v) for metric, v in alone.items()},
        "rescored": rescored,
        "first_factor_within": min(within) if within else None,
        "index": index,
    }
    if index is not None and index.get("factor") is not None:
        entry["at_index_factor"] = _rescored_at(one_bit, tier, reference, alone, index["factor"], ndcg_k)
    return entry


def index_factor(scoreset: Any, cfg: Any, code: str, multiple: int) -> Optional[Dict[str, Any]]:
    """The default rescoring factor an index of ``cfg`` with tier ``code`` at ``multiple`` times
    its ``k`` would choose: :func:`eogp_index.fit.recall.index_recall` (the fit's and the
    table's one choice) of the recall queries' scores of the training rows
    (:meth:`~eogp_index.evaluation.fidelity.ScoreSet.held_out_scores`), as
    :meth:`~eogp_index.fit.recall.IndexRecall.to_json`; None when they were not measured."""
    import torch

    from eogp_index.fit.recall import index_recall

    scores = scoreset.held_out_scores(cfg, code, multiple)
    if scores is None:
        return None
    tier, one_bit = (torch.from_numpy(np.ascontiguousarray(x, np.float64)) for x in scores)
    return index_recall(code, tier, one_bit, {}).to_json()


def rescoring_details(
    scoreset: Any, *, ndcg_k: int = 20, factors: Sequence[int] = (1, 2, 3, 5, 10, 20)
) -> List[Dict[str, Any]]:
    """Per 1-bit PCA config with tiers (:attr:`~eogp_index.evaluation.fidelity.ScoreSet.tiers`):
    the one-bit scan and, per tier code and ``k`` multiple, the tier alone and rescored, against
    the reference. First seed (PCA configs have one).

    Each entry: ``method``, ``label``, ``budget``, ``k`` (per module), ``one_bit`` (``{metric:
    {mean, se}}``), ``bytes_one_bit``; ``tiers``: per ``(code, multiple)``, ``code``,
    ``multiple``, ``k_tier``, ``bytes_tier``, ``bytes_on_disk`` (one-bit + tier), ``alone``,
    ``rescored`` (per factor: ``factor``, ``n`` = rows rescored per side, the metrics, ``gap`` =
    tier alone − rescored NDCG (± paired SE), ``recall`` = share of the tier's top
    ``ndcg_k`` in the one-bit top ``n``), ``first_factor_within`` (the smallest factor whose
    mean gap is at most :data:`TARGET_GAP`; None if none), ``index`` (:func:`index_factor`: the
    index's recall record, its ``factor`` the index's F; None when not measured) and
    ``at_index_factor`` (as one ``rescored`` entry, at the index's F).
    """
    factors = sorted({int(f) for f in factors})
    if not factors or factors[0] < 1:
        raise ConfigError(f"rescoring factors must be positive integers, got {factors}")
    out: List[Dict[str, Any]] = []
    for cfg in scoreset.configs:
        keys = scoreset.tier_keys(cfg)
        if not keys:
            continue
        one_bit = scoreset.scores[cfg.id][0]
        entry: Dict[str, Any] = {
            "method": cfg.method,
            "label": cfg.label,
            "budget": cfg.budget,
            "k": list(cfg.k),
            "one_bit": {metric: _summary(v) for metric, v in _fidelity(one_bit, scoreset.reference, ndcg_k).items()},
            "bytes_one_bit": cfg.bytes_per_example,
            "tiers": [],
        }
        for code, multiple in keys:
            k_tier = [multiple * k for k in cfg.k]
            tier_bytes = int(sum(tier_bytes_per_module(k, code) for k in k_tier))
            tier = _tier_entry(
                one_bit,
                scoreset.tier(cfg, code, multiple),
                scoreset.reference,
                ndcg_k=ndcg_k,
                factors=factors,
                index=index_factor(scoreset, cfg, code, multiple),
            )
            entry["tiers"].append(
                {
                    "code": code,
                    "multiple": multiple,
                    "k_tier": k_tier,
                    "bytes_tier": tier_bytes,
                    "bytes_on_disk": cfg.bytes_per_example + tier_bytes,
                    **tier,
                }
            )
        out.append(entry)
    return out


def _interval(summary: Dict[str, float]) -> Optional[Tuple[float, float]]:
    mean, se = summary["mean"], summary["se"]
    if not (math.isfinite(mean) and math.isfinite(se)):
        return None
    return mean - _Z95 * se, mean + _Z95 * se


def rescoring_records(details: List[Dict[str, Any]], *, ndcg_k: int = 20, factor: int = 5) -> List[Dict[str, Any]]:
    """The report's records of the rescoring (:func:`~eogp_index.evaluation.report.write_report`):
    per 1-bit PCA method and budget, each tier alone at the one-bit ``k`` and the one-bit top
    ``factor · ndcg_k`` rescored by it, NDCG@``ndcg_k`` and Spearman with 95% normal intervals over
    the queries; and the recall of the tier's top ``ndcg_k`` (metric ``recall@<n>``)."""
    records: List[Dict[str, Any]] = []
    metric_names = (f"ndcg@{ndcg_k}", "spearman")
    for entry in details:
        for tier in entry["tiers"]:
            if tier["multiple"] != 1:
                continue
            code = tier["code"]
            rows = [(f"{entry['label']} + {code} tier (full scan)", tier["alone"])]
            chosen = _at(tier, factor)
            if chosen is not None:
                rows.append((f"{entry['label']}, top {factor}×{ndcg_k} rescored by {code}", chosen))
            for label, values in rows:
                records += [_row(label, entry["budget"], metric, values[metric]) for metric in metric_names]
            if chosen is not None:
                records.append(_row(rows[-1][0], entry["budget"], f"recall@{factor * ndcg_k}", chosen["recall"]))
    return records


def _row(method: str, budget: int, metric: str, summary: Dict[str, float]) -> Dict[str, Any]:
    record = {"method": method, "bytes_per_example": budget, "metric": metric, "value": summary["mean"]}
    interval = _interval(summary)
    if interval is not None:
        record["ci_low"], record["ci_high"] = interval
    return record


# --------------------------------------------------------------------------- report


def _pm(summary: Dict[str, float], spec: str = ".3f") -> str:
    mean, se = summary["mean"], summary["se"]
    if not math.isfinite(mean):
        return "—"
    return f"{mean:{spec}}" + (f" ± {se:.3f}" if math.isfinite(se) else "")


def _at(tier: Dict[str, Any], factor: int) -> Optional[Dict[str, Any]]:
    return next((r for r in tier["rescored"] if r["factor"] == factor), None)


def rescoring_markdown(details: List[Dict[str, Any]], *, ndcg_k: int = 20, factor: int = 5) -> List[str]:
    """The ``results.md`` sections of :func:`rescoring_details`: the tiers at the one-bit ``k``
    (alone and rescored at ``factor``), rescored NDCG and recall at every factor, and the tier's
    ``k`` curve."""
    from eogp_index.evaluation.report import format_bytes

    if not details:
        return []
    ndcg = f"ndcg@{ndcg_k}"
    factors = [r["factor"] for r in details[0]["tiers"][0]["rescored"]]
    lines = [
        "",
        "## Rescoring from the tier",
        "",
        f"The 1-bit top N = F × {ndcg_k} rows of each side rescored by the tier (the same coordinates in "
        "int8 or int4 with a scale per module, or FP16). The rescored ranking: the positive side's N rows "
        "in the tier's order, then the rows neither side kept in 1-bit order, then the negative side's N "
        f"rows in the tier's order. Query means ± standard error; gap = tier alone − rescored "
        f"NDCG@{ndcg_k} (± SE of the paired differences); within {TARGET_GAP}: the smallest F whose "
        "mean gap is at most that.",
        "",
        f"| method | budget | k | 1-bit NDCG@{ndcg_k} | tier | tier alone NDCG@{ndcg_k} | Spearman | "
        f"rescored F = {factor} NDCG@{ndcg_k} | Spearman | gap | within {TARGET_GAP} at F |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in details:
        for tier in (t for t in entry["tiers"] if t["multiple"] == 1):
            chosen = _at(tier, factor)
            cells = [_pm(chosen[ndcg]), _pm(chosen["spearman"]), _pm(chosen["gap"], "+.4f")] if chosen else ["—"] * 3
            lines.append(
                f"| {entry['label']} | {format_bytes(entry['budget'])} | {entry['k'][0]} | {_pm(entry['one_bit'][ndcg])} | "
                f"{tier['code']} | {_pm(tier['alone'][ndcg])} | {_pm(tier['alone']['spearman'])} | "
                + " | ".join(cells)
                + f" | {tier['first_factor_within'] or 'none'} |"
            )
    for title, key in ((f"Rescored NDCG@{ndcg_k} at each F", ndcg), ("Rescored Spearman at each F", "spearman")):
        lines += ["", f"### {title}", ""]
        lines += [
            "| method | budget | tier | alone | " + " | ".join(f"F = {f}" for f in factors) + " |",
            "|---|---|---|---:|" + "---:|" * len(factors),
        ]
        for entry in details:
            for tier in (t for t in entry["tiers"] if t["multiple"] == 1):
                lines.append(
                    f"| {entry['label']} | {format_bytes(entry['budget'])} | {tier['code']} | "
                    f"{tier['alone'][key]['mean']:.3f} | "
                    + " | ".join(f"{r[key]['mean']:.3f}" for r in tier["rescored"])
                    + " |"
                )
    lines += [
        "",
        f"### Recall: share of the tier's top {ndcg_k} in the 1-bit top F × {ndcg_k}",
        "",
        "| method | budget | tier | " + " | ".join(f"F = {f}" for f in factors) + " |",
        "|---|---|---|" + "---:|" * len(factors),
    ]
    for entry in details:
        for tier in (t for t in entry["tiers"] if t["multiple"] == 1):
            lines.append(
                f"| {entry['label']} | {format_bytes(entry['budget'])} | {tier['code']} | "
                + " | ".join(f"{r['recall']['mean']:.3f}" for r in tier["rescored"])
                + " |"
            )
    lines += _index_factor_markdown(details, ndcg)
    lines += [
        "",
        "### The tier's k",
        "",
        "Tiers of a multiple of the 1-bit k: the PCA fitted to k_tier directions, the 1-bit code the signs "
        f"of its first k. Bytes on disk per example: 1-bit code + tier. Rescored at F = {factor}.",
        "",
        f"| method | budget | tier | k_tier | bytes on disk | tier alone NDCG@{ndcg_k} | rescored NDCG@{ndcg_k} | "
        "gap | rescored Spearman |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in details:
        for tier in entry["tiers"]:
            chosen = _at(tier, factor)
            if chosen is None:
                continue
            lines.append(
                f"| {entry['label']} | {format_bytes(entry['budget'])} | {tier['code']} | {tier['k_tier'][0]} "
                f"({tier['multiple']}×) | {tier['bytes_on_disk']} | {_pm(tier['alone'][ndcg])} | "
                f"{_pm(chosen[ndcg])} | {_pm(chosen['gap'], '+.4f')} | {_pm(chosen['spearman'])} |"
            )
    lines.append("")
    return lines


def _index_factor_markdown(details: List[Dict[str, Any]], ndcg: str) -> List[str]:
    """The table of the index's F (:func:`index_factor`): per method, budget, tier code and
    ``k`` multiple, the factor an index would choose, its own measurement there (the gap of its
    recall queries, and whether it met the target), and against the reference the tier alone and
    the top rescored at that F."""
    from eogp_index.evaluation.report import format_bytes

    lines = [
        "",
        "### At the index's F",
        "",
        "The default rescoring factor an index of these documents would choose (eogp_index.fit.recall.index_recall, "
        "as the fit and the table's measurement choose it): the fit's held-out documents (up to 64) as queries "
        "scoring the training rows, the smallest F whose rescored top-t keeps within the gap target of the tier's "
        "own top-t (NDCG@t, t = min(20, rows // 20)); else the largest measured (\\*). Against the reference: "
        "the tier alone and the top rescored at that F.",
        "",
        f"| method | budget | tier | k_tier | index's F | its held-out gap | recall | tier alone {ndcg} | "
        f"rescored {ndcg} | gap | within {TARGET_GAP} |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for entry in details:
        for tier in entry["tiers"]:
            index, chosen = tier.get("index"), tier.get("at_index_factor")
            if not index or chosen is None:
                continue
            own = index["gap"][index["factors"].index(index["factor"])]
            mark = "" if index["reached"] else "\\*"
            own_gap = "—" if own is None else f"{own:.4f}"
            lines.append(
                f"| {entry['label']} | {format_bytes(entry['budget'])} | {tier['code']} | {tier['k_tier'][0]} "
                f"({tier['multiple']}×) | {index['factor']}{mark} | {own_gap} |"
                f" {_pm(chosen['recall'])} | {_pm(tier['alone'][ndcg])} | "
                f"{_pm(chosen[ndcg])} | {_pm(chosen['gap'], '+.4f')} | "
                f"{'yes' if chosen['gap']['mean'] <= TARGET_GAP else 'no'} |"
            )
    return lines


def rescoring_plots(details: List[Dict[str, Any]], out: Any, *, ndcg_k: int = 20, factor: int = 5) -> Dict[str, Any]:
    """``rescoring.png`` (rescored NDCG@``ndcg_k`` against the rows rescored per side, the int8
    tier at the one-bit ``k``, its full scan dashed) and ``tier_k.png`` (rescored NDCG at
    ``factor`` against the bytes on disk, per tier code), one panel per method."""
    from pathlib import Path

    from eogp_index.evaluation.report import format_bytes, plot_panels

    if not details:
        return {}
    ndcg = f"ndcg@{ndcg_k}"
    methods = list(dict.fromkeys(entry["label"] for entry in details))
    colours = [f"C{i}" for i in range(10)]
    by_n: Dict[str, List[Dict[str, Any]]] = {m: [] for m in methods}
    by_bytes: Dict[str, List[Dict[str, Any]]] = {m: [] for m in methods}
    for entry in details:
        panel = entry["label"]
        colour = colours[len(by_n[panel]) // 2 % len(colours)]
        code = "int8" if any(t["code"] == "int8" for t in entry["tiers"]) else entry["tiers"][0]["code"]
        tier = next(t for t in entry["tiers"] if t["code"] == code and t["multiple"] == 1)
        xs = [r["n"] for r in tier["rescored"]]
        intervals = [_interval(r[ndcg]) or (r[ndcg]["mean"],) * 2 for r in tier["rescored"]]
        name = f"{format_bytes(entry['budget'])}, {code}"
        by_n[panel].append(
            {
                "label": f"{name} rescored",
                "x": xs,
                "y": [r[ndcg]["mean"] for r in tier["rescored"]],
                "low": [lo for lo, _ in intervals],
                "high": [hi for _, hi in intervals],
                "colour": colour,
            }
        )
        by_n[panel].append(
            {
                "label": f"{name} full scan",
                "x": xs,
                "y": [tier["alone"][ndcg]["mean"]] * len(xs),
                "dashed": True,
                "colour": colour,
            }
        )
        for i, code in enumerate(dict.fromkeys(t["code"] for t in entry["tiers"])):
            points = [(t["bytes_on_disk"], _at(t, factor)) for t in entry["tiers"] if t["code"] == code]
            points = [(x, r[ndcg]["mean"]) for x, r in points if r is not None]
            if points:
                by_bytes[panel].append(
                    {
                        "label": f"{format_bytes(entry['budget'])} 1-bit + {code}",
                        "x": [x for x, _ in points],
                        "y": [y for _, y in points],
                        "colour": colour,  # one per budget; the line style tells the code
                        "linestyle": ("-", ":", "--")[i % 3],
                    }
                )
    out = Path(out)
    return {
        "rescoring": plot_panels(
            by_n, out / "rescoring.png", xlabel="1-bit rows rescored per side (N = F x 20)", ylabel=f"NDCG@{ndcg_k}"
        ),
        "tier_k": plot_panels(
            by_bytes,
            out / "tier_k.png",
            xlabel=f"bytes per example on disk, 1-bit + tier (rescored at F = {factor})",
            ylabel=f"NDCG@{ndcg_k}",
            x_bytes=True,
        ),
    }
