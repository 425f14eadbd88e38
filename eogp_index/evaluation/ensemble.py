"""Checkpoint ensembles in ``eogp eval lds``: each checkpoint alone against their weighted sum.

An index fitted on checkpoints ``c = 0 .. C-1`` scores ``Σ_c w_c · score_c``, where ``score_c``
is the EOGP score of checkpoint ``c``'s own curvature, projection and codes. The evaluation
measures the same thing: every checkpoint is scored as the attributed model is (its own EK-FAC
and PCA, fitted on the same documents; :func:`eogp_index.evaluation.run.run_lds` caches each
under ``out/checkpoints/<c>/``), and for each method whose family is
:attr:`~eogp_index.evaluation.methods.MethodFamily.ensembled` (the codes the index stores) and
for uncompressed EK-FAC, the LDS of each checkpoint alone, of the weighted sum, and the paired
differences (:func:`~eogp_index.evaluation.metrics.lds_difference`).

The ground truth does not change: LDS correlates predicted subset scores with the query losses
of ``--base`` retrained on each subset, the retraining that made the attributed model (checkpoint
0). The checkpoints only change which scores predict those losses.

Checkpoint weights are those ``eogp fit`` takes (:func:`read_weights`): ``uniform`` (``1/C``
each, the mean as TRAK takes it), or a JSON file. LDS is a rank correlation per query, so only
the weights' ratios matter to it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from eogp_index.errors import ConfigError
from eogp_index.evaluation import metrics, report
from eogp_index.evaluation.fidelity import REF_EKFAC, Documents, MethodConfig, ScoreSet
from eogp_index.fit.fitting import checkpoint_weights_from

__all__ = [
    "CHECKPOINTS_DIR",
    "ENSEMBLE_FILE",
    "Checkpoint",
    "check_compatible",
    "checkpoint_names",
    "ensemble_lds",
    "ensemble_markdown",
    "ensemble_scores",
    "read_weights",
    "save_scores",
]

#: Where the extra checkpoints' scores and curvature are cached: ``out/checkpoints/<c>/``.
CHECKPOINTS_DIR = "checkpoints"
#: The ensembles' score matrices: one array per ensembled config id, and ``reference``.
ENSEMBLE_FILE = "ensemble.npz"

_REFERENCE = f"{REF_EKFAC.split(' (')[0]} (uncompressed)"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of the ensemble: its name in tables, model directory, weight and scores."""

    name: str
    path: str
    weight: float
    scoreset: ScoreSet


# --------------------------------------------------------------------------- inputs


def checkpoint_names(paths: Sequence[str]) -> Tuple[str, ...]:
    """Each checkpoint's name in tables: its directory's name, ``-<c>`` appended when two share one."""
    names = [Path(str(p).rstrip("/")).name or str(p) for p in paths]
    return tuple(f"{name}-{c}" if names.count(name) > 1 else name for c, name in enumerate(names))


def read_weights(spec: str, paths: Sequence[str]) -> Tuple[float, ...]:
    """One weight per checkpoint in ``paths`` (the attributed model first), as ``eogp fit`` reads
    ``--checkpoint-weights`` (:func:`~eogp_index.fit.fitting.checkpoint_weights_from`): ``uniform``
    is ``1/C`` each."""
    weights = checkpoint_weights_from(spec, paths)
    return (1.0 / len(paths),) * len(paths) if weights is None else tuple(weights)


def check_compatible(
    first: Checkpoint, other: Checkpoint, docs: Tuple[Documents, Documents], own: Tuple[Documents, Documents]
) -> None:
    """Refuse a checkpoint that is not of the attributed model's architecture and tokenizer.

    ``docs`` and ``own``: the ``(train, queries)`` documents as the first and the other
    checkpoint tokenized them.

    Raises:
        ConfigError: other attributed modules or shapes, or the documents tokenized differently.
    """
    ours = [(m.name, m.d_out, m.d_in) for m in first.scoreset.modules]
    theirs = [(m.name, m.d_out, m.d_in) for m in other.scoreset.modules]
    if ours != theirs:
        raise ConfigError(
            f"checkpoint {other.path}: its attributed modules {theirs} differ from those of --model "
            f"{first.path} ({ours}); ensemble checkpoints of one architecture"
        )
    if any(a.fingerprint() != b.fingerprint() for a, b in zip(docs, own)):
        raise ConfigError(
            f"checkpoint {other.path}: its tokenizer turns the documents into other tokens than that of "
            f"--model {first.path}; ensemble checkpoints that share one tokenizer"
        )


# --------------------------------------------------------------------------- scores and LDS


def _ensembled(members: Sequence[Checkpoint]) -> List[MethodConfig]:
    """The configs of checkpoint 0 whose family is ensembled and that every checkpoint scored."""
    return [
        cfg
        for cfg in members[0].scoreset.configs
        if cfg.spec.ensembled and all(cfg.id in m.scoreset.scores for m in members)
    ]


def ensemble_scores(members: Sequence[Checkpoint]) -> Dict[str, np.ndarray]:
    """``{config id: Σ_c w_c · scores_c}`` ``(n_seeds, nq, n)`` float64 of every ensembled config,
    and ``"reference"``: the same sum of each checkpoint's uncompressed EK-FAC, ``(1, nq, n)``."""
    out = {
        cfg.id: sum(m.weight * np.asarray(m.scoreset.scores[cfg.id], dtype=np.float64) for m in members)
        for cfg in _ensembled(members)
    }
    out["reference"] = sum(m.weight * np.asarray(m.scoreset.reference, dtype=np.float64) for m in members)[None]
    return out


def _summary(results: Sequence[metrics.LDSResult], key: str = "lds") -> Dict[str, float]:
    """Seeds' mean LDS (or difference) and mean interval bounds (as
    :func:`~eogp_index.evaluation.lds.lds_records`)."""
    return {
        key: metrics.nanmean([r.mean for r in results]),
        "ci_low": metrics.nanmean([r.ci_low for r in results]),
        "ci_high": metrics.nanmean([r.ci_high for r in results]),
    }


def ensemble_lds(
    members: Sequence[Checkpoint], retraining: Any, *, n_bootstrap: int = 1000, seed: int = 0
) -> Tuple[List[Dict[str, Any]], Dict[str, Any], Dict[str, np.ndarray]]:
    """LDS of each checkpoint alone and of the ensemble, per ensembled config and for EK-FAC.

    Returns ``(records, details, scores)``: records (for :func:`report.write_report`) of the
    checkpoints after the first (the first is the config's own row) and of the ensemble;
    ``details`` with per row each checkpoint's and the ensemble's LDS and the paired difference
    ensemble − each checkpoint, the reference lines of EK-FAC; ``scores``: :func:`ensemble_scores`.
    """
    scores = ensemble_scores(members)
    masks, losses = retraining.masks, retraining.losses

    def row(parts: Sequence[np.ndarray], summed: np.ndarray) -> Dict[str, Any]:
        def lds(s):
            return metrics.lds(s, masks, losses, n_bootstrap=n_bootstrap, seed=seed)

        alone = {m.name: _summary([lds(s) for s in part]) for m, part in zip(members, parts)}
        minus = {
            m.name: _summary(
                [
                    metrics.lds_difference(e, s, masks, losses, n_bootstrap=n_bootstrap, seed=seed)
                    for e, s in zip(summed, part)
                ],
                "diff",
            )
            for m, part in zip(members, parts)
        }
        return {"alone": alone, "ensemble": _summary([lds(e) for e in summed]), "ensemble_minus": minus}

    records: List[Dict[str, Any]] = []
    rows: List[Dict[str, Any]] = []
    label = f"ensemble of {len(members)}"
    for cfg in _ensembled(members):
        entry = row([m.scoreset.scores[cfg.id] for m in members], scores[cfg.id])
        rows.append({"id": cfg.id, "method": cfg.method, "label": cfg.label, "budget": cfg.budget, **entry})
        named = [(f"{cfg.label} @ {m.name}", entry["alone"][m.name]) for m in members[1:]]
        for name, value in named + [(f"{cfg.label} ({label})", entry["ensemble"])]:
            rec = {"method": name, "bytes_per_example": cfg.budget, "metric": "lds", "value": value["lds"]}
            if math.isfinite(value["ci_low"]) and math.isfinite(value["ci_high"]):
                rec.update(ci_low=value["ci_low"], ci_high=value["ci_high"])
            records.append(rec)
    reference = row([m.scoreset.reference[None] for m in members], scores["reference"])
    rows.append({"id": "reference", "method": None, "label": _REFERENCE, "budget": None, **reference})
    lines = {f"{_REFERENCE} @ {m.name}": reference["alone"][m.name]["lds"] for m in members[1:]}
    lines[f"{_REFERENCE} ({label})"] = reference["ensemble"]["lds"]
    details = {
        "checkpoints": [
            {
                "name": m.name,
                "path": m.path,
                "weight": m.weight,
                "score_timings_s": m.scoreset.timings,
                "index_vs_kronfluence_rel_err": m.scoreset.reference_error(),
            }
            for m in members
        ],
        "rows": rows,
        "reference_lines": lines,
    }
    return records, details, scores


def save_scores(scores: Dict[str, np.ndarray], members: Sequence[Checkpoint], path: Path) -> Path:
    """Write :func:`ensemble_scores` to ``path`` (``.npz``; ``meta``: the checkpoints and weights)."""
    meta = {"checkpoints": [{"name": m.name, "path": m.path, "weight": m.weight} for m in members]}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **scores)
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------- report


def _cell(value: Dict[str, float], spec: str = ".3f", key: str = "lds") -> str:
    def fmt(x: float) -> str:
        return format(x, spec) if x is not None and math.isfinite(x) else "—"

    return f"{fmt(value[key])} [{fmt(value['ci_low'])}, {fmt(value['ci_high'])}]"


def ensemble_markdown(details: Dict[str, Any]) -> List[str]:
    """The ``results.md`` section of a checkpoint ensemble: LDS of each checkpoint alone and of the
    ensemble, and the paired differences, with their 95% bootstrap intervals."""
    members = details["checkpoints"]
    names = [m["name"] for m in members]
    weights = ", ".join(f"`{m['name']}` = {m['weight']:.4g} (`{m['path']}`)" for m in members)
    lines = [
        "",
        "## Checkpoint ensemble",
        "",
        f"Weights: {weights}. Each checkpoint scored with its own EK-FAC and PCA on the same documents; "
        "LDS against the same retraining of --base. Δ: ensemble − that checkpoint alone, paired over "
        "the same subset resamples; [95% bootstrap interval].",
        "",
        "| Method | bytes / example | "
        + " | ".join(f"LDS {n}" for n in names)
        + " | LDS ensemble | "
        + " | ".join(f"Δ vs {n}" for n in names)
        + " |",
        "|---|---:|" + "---:|" * (2 * len(names) + 1),
    ]
    for row in details["rows"]:
        budget = report.format_bytes(row["budget"]) if row["budget"] is not None else "—"
        cells = [_cell(row["alone"][n]) for n in names] + [_cell(row["ensemble"])]
        cells += [_cell(row["ensemble_minus"][n], "+.3f", "diff") for n in names]
        lines.append(f"| {row['label']} | {budget} | " + " | ".join(cells) + " |")
    return lines
