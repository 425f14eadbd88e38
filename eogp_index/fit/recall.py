"""The one-bit code's recall of the rescoring tier's top rows, and the default rescoring factor,
measured at fit time.

With a rescoring tier (``eogp fit --rescore``) a query keeps the one-bit top ``N = F · k`` rows
of each side and orders them by the tier's scores, so what the one-bit code must do is find the
rows the tier ranks first: the answer is the tier's own top ``k`` whenever those lie in the
one-bit top ``F · k``. That can be measured without any reference, on the held-out part of the
PCA fitting set (:func:`~eogp_index.fit.code_choice.held_out_rows`): each held-out document is a
pseudo-query (its unquantized coordinates, as a query's are) scoring the other ``h - 1``

* by the tier: its coordinates at the tier's precision (:func:`tier_documents`, the rounding of
  ``store.codecs.TierCodec``, reproduced here because the fit sits below the store), and
* by a one-bit code: ``s_i ⟨y, b_i⟩`` (signs and ``‖x‖₁ / k`` scale), each summed over modules
  as the index sums them.

Per pseudo-query, side (most positive, most negative) and factor ``F``, two figures
(:func:`recall_curve`), each averaged over both sides, then over pseudo-queries (with its
standard error over them):

* **the recall**: the share of the tier's top ``t`` found in the one-bit top ``F · t``;
* **the gap**: ``1 -`` the NDCG@``t`` of the rescored top ``t`` (the one-bit top ``F · t``
  ordered by the tier) against the tier's own full-scan top ``t``, relevance being membership in
  it (:mod:`eogp_index.fit.ndcg`, the evaluation's NDCG): what the rescored answer loses against
  the tier alone, a missed row weighed by its place.

**t.** The held-out set is small (0.15 of the PCA set: tens to hundreds of documents), and a
top ``F · t`` says nothing once it covers the ``h - 1`` candidates. So ``t`` scales with ``h``:
``t = max(1, min(20, h // 20))`` (:func:`recall_t`), about 5% of the candidates, and never more
than 20, the top a reader reads (the evaluation's NDCG@20); a factor of
:data:`~eogp_index.config.RECALL_FACTORS` is measured only when ``F · t < h - 1``. The ratio of a
top ``t`` to a top ``F · t`` is the one queries use (``N = F · k``), measured at the scale the
held-out set allows.

**The default factor** (:func:`default_factor`, the one choice the fit, the table's measurement
(:mod:`eogp_index.store.table_recall`) and ``eogp eval fidelity`` make): the smallest measured
``F`` up to :data:`~eogp_index.config.RESCORE_MAX_DEFAULT` whose mean gap is at most
:data:`~eogp_index.config.RESCORE_GAP_TARGET`, else the largest measured up to it (and the fit
warns; the larger factors' gaps are printed for a query to ask for one). Queries use it when they do not give ``rescore``
(``Question.rescore`` None). The smallest ``F`` whose recall reaches
:data:`~eogp_index.config.RECALL_TARGET` is recorded beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import numpy as np

from eogp_index.config import (
    RECALL_FACTORS,
    RECALL_MAX_T,
    RECALL_T_SHARE,
    RECALL_TARGET,
    RESCORE_GAP_TARGET,
    RESCORE_MAX_DEFAULT,
    TIER_LEVELS,
    quantize_tier_block,
)
from eogp_index.fit.ndcg import rescored_ndcg

if TYPE_CHECKING:  # torch is imported by the functions that compute, so that reading a record does not load it
    import torch

#: The rescoring factors measured, when the held-out set allows them (``F · t < h - 1``).
FACTORS = RECALL_FACTORS
#: The largest ``t`` (the top a reader reads: the evaluation's NDCG@20).
MAX_T = RECALL_MAX_T
#: ``t`` is about this share of the held-out candidates (:func:`recall_t`).
T_SHARE = RECALL_T_SHARE
#: Held-out documents kept, projected by the stored projection, as the queries of the recall
#: measured on the stored table (:mod:`eogp_index.store.table_recall`): enough for a standard
#: error of about a percent on the recall, few enough that the file and the scan stay small.
RECALL_QUERIES = 64
#: The candidate one-bit codes, EOGP first: a tie keeps it.
CODES = ("eogp", "eogp-rot")


def recall_t(h: int) -> int:
    """The tier's top ``t`` measured with ``h`` held-out documents: ``max(1, min(20, h // 20))``."""
    return max(1, min(MAX_T, h // T_SHARE))


def measured_factors(h: int, t: int) -> Tuple[int, ...]:
    """The factors of :data:`FACTORS` that ``h`` held-out documents can measure: ``F · t < h - 1``
    (a top ``F · t`` of all ``h - 1`` candidates would find everything)."""
    return tuple(f for f in FACTORS if f * t < h - 1)


def tier_documents(y: torch.Tensor, code: str) -> torch.Tensor:
    """One module's coordinates ``(n, k)`` as the rescoring tier ``code`` stores them, decoded,
    ``(n, k)`` float64: int8/int4 round ``x / s`` to the nearest integer in ``[-q, q]`` with the
    row's scale ``s = max|x| / q`` rounded to FP16 (zero for a zero row), in float32 as
    ``store.codecs.TierCodec`` does; fp16 rounds the coordinates to float16."""
    import torch

    x = y.to(torch.float32)
    if code == "fp16":
        return x.half().double()
    if code not in TIER_LEVELS:
        from eogp_index.errors import ConfigError

        raise ConfigError(f"a rescoring tier's code is int8, int4 or fp16, got {code!r}")
    codes, scale = quantize_tier_block(x.cpu().numpy(), TIER_LEVELS[code])
    return torch.from_numpy(codes.astype(np.float32) * scale.astype(np.float32)[:, None]).double()


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each candidate's place ``(q, n)`` int64 in its row's descending order (ties by position)."""
    import torch

    order = torch.argsort(-scores, dim=1, stable=True)
    places = torch.arange(scores.shape[1]).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, places)


def recall_per_query(tier: torch.Tensor, one_bit: torch.Tensor, t: int, factors: Sequence[int]) -> torch.Tensor:
    """Per pseudo-query and factor, the share of the tier's top ``t`` found in the one-bit top ``F · t``.

    Args:
        tier, one_bit: ``(q, n)`` float64: each pseudo-query's scores of its ``n`` candidates.

    Returns:
        ``(q, len(factors))`` float64: the mean over the two sides (most positive, most negative;
        equal scores in position order).
    """
    import torch

    sides = []
    for sign in (1.0, -1.0):
        top = torch.argsort(-sign * tier, dim=1, stable=True)[:, :t]  # (q, t)
        places = _ranks(sign * one_bit).gather(1, top)  # (q, t): where the one-bit scan puts them
        sides.append(torch.stack([(places < f * t).double().mean(dim=1) for f in factors], dim=1))
    return (sides[0] + sides[1]) / 2


def gap_per_query(tier: torch.Tensor, one_bit: torch.Tensor, t: int, factors: Sequence[int]) -> torch.Tensor:
    """Per pseudo-query and factor, ``1 -`` the NDCG@``t`` of the rescored top ``t`` against the
    tier's own top ``t`` (:func:`~eogp_index.fit.ndcg.rescored_ndcg`).

    Args:
        tier, one_bit: ``(q, n)`` float64: each pseudo-query's scores of its ``n`` candidates;
            every ``F · t <= n``.

    Returns:
        ``(q, len(factors))`` float64 in ``[0, 1]``: the mean over the two sides (equal scores
        in position order, as :func:`recall_per_query`).
    """
    import torch

    if not factors:
        return torch.zeros((tier.shape[0], 0), dtype=torch.float64)
    depth = min(int(max(factors)) * t, int(tier.shape[1]))
    sides = []
    for sign in (1.0, -1.0):
        signed = (sign * tier).double()
        relevant = torch.zeros(signed.shape, dtype=torch.bool)
        relevant.scatter_(1, torch.argsort(-signed, dim=1, stable=True)[:, :t], True)
        kept = torch.argsort(-sign * one_bit, dim=1, stable=True)[:, :depth]  # (q, depth), one-bit order
        ndcg = rescored_ndcg(signed.gather(1, kept).numpy(), relevant.gather(1, kept).numpy(), t, factors)
        sides.append(1.0 - torch.from_numpy(ndcg))
    return (sides[0] + sides[1]) / 2


def mean_se(values: torch.Tensor) -> Tuple[float, float]:
    """The mean of the finite ``values`` ``(q,)`` and its standard error (nan below two)."""
    import torch

    finite = values[torch.isfinite(values)]
    if finite.numel() < 2:
        return float("nan"), float("nan")
    return float(finite.mean()), float(finite.std() / math.sqrt(finite.numel()))


def _plain(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def _number(x) -> float:
    return float("nan") if x is None else float(x)


@dataclass(frozen=True)
class RecallCurve:
    """The recall and the rescoring gap at each factor (means over pseudo-queries).

    Attributes:
        t: the tier's top ``t`` per side.
        held_out: pseudo-queries (each ranks the other ``held_out - 1``).
        factors: the factors measured, increasing.
        recall, recall_se: per factor, the mean recall (:func:`recall_per_query`) and its
            standard error.
        gap, gap_se: per factor, the mean gap (:func:`gap_per_query`) and its standard error;
            empty in a record written before the gap was measured.
    """

    t: int
    held_out: int
    factors: Tuple[int, ...]
    recall: Tuple[float, ...]
    recall_se: Tuple[float, ...]
    gap: Tuple[float, ...] = ()
    gap_se: Tuple[float, ...] = ()

    def to_json(self) -> Dict[str, object]:
        return {
            "t": self.t,
            "held_out": self.held_out,
            "factors": list(self.factors),
            "recall": [_plain(v) for v in self.recall],
            "recall_se": [_plain(v) for v in self.recall_se],
            "gap": [_plain(v) for v in self.gap],
            "gap_se": [_plain(v) for v in self.gap_se],
        }

    @classmethod
    def from_json(cls, data: Dict[str, object]) -> "RecallCurve":
        return cls(
            t=int(data["t"]),
            held_out=int(data["held_out"]),
            factors=tuple(int(f) for f in data["factors"]),
            recall=tuple(_number(v) for v in data["recall"]),
            recall_se=tuple(_number(v) for v in data["recall_se"]),
            gap=tuple(_number(v) for v in data.get("gap", ())),
            gap_se=tuple(_number(v) for v in data.get("gap_se", ())),
        )


def recall_curve(tier: torch.Tensor, one_bit: torch.Tensor) -> Tuple[RecallCurve, torch.Tensor]:
    """The recall curve and the gap curve of one-bit scores against the tier's, and the per-query recalls.

    Args:
        tier, one_bit: ``(h, n)`` float64: each of ``h`` pseudo-queries' scores of its ``n``
            candidates (``n = h - 1`` among held-out documents, each without itself).

    Returns:
        The curve (``t`` = :func:`recall_t` ``(n + 1)``, the factors :func:`measured_factors`
        allows) and the ``(h, len(factors))`` per-query recalls.
    """

    h = int(tier.shape[1]) + 1
    t = recall_t(h)
    factors = measured_factors(h, t)
    tier, one_bit = tier.double(), one_bit.double()
    per_query = recall_per_query(tier, one_bit, t, factors)
    gaps = gap_per_query(tier, one_bit, t, factors)
    stats = [mean_se(per_query[:, j]) for j in range(len(factors))]
    gap_stats = [mean_se(gaps[:, j]) for j in range(len(factors))]
    curve = RecallCurve(
        t,
        int(tier.shape[0]),
        factors,
        tuple(m for m, _ in stats),
        tuple(s for _, s in stats),
        tuple(m for m, _ in gap_stats),
        tuple(s for _, s in gap_stats),
    )
    return curve, per_query


def default_factor(
    curve: RecallCurve, gap_target: float = RESCORE_GAP_TARGET, max_factor: int = RESCORE_MAX_DEFAULT
) -> Tuple[Optional[int], bool]:
    """The default rescoring factor: the smallest measured factor up to ``max_factor`` whose mean
    gap is at most ``gap_target`` and True; else the largest measured up to ``max_factor`` and
    False; ``(None, False)`` when nothing was measured."""
    allowed = [(f, gap) for f, gap in zip(curve.factors, curve.gap) if f <= max_factor]
    for factor, gap in allowed:
        if gap <= gap_target:
            return factor, True
    return (allowed[-1][0] if allowed else None), False


def recall_factor(curve: RecallCurve, target: float = RECALL_TARGET) -> Optional[int]:
    """The smallest measured factor whose recall reaches ``target``, or None (recorded beside
    the default factor, not used)."""
    return next((f for f, r in zip(curve.factors, curve.recall) if r >= target), None)


@dataclass(frozen=True)
class ModuleRecall:
    """One module's recall of its own tier scores by each candidate one-bit code, and the choice.

    Attributes:
        curves: ``{code: RecallCurve}`` for ``eogp`` and ``eogp-rot``.
        diff, diff_se: EOGP-rot minus EOGP in the recall averaged over the factors, paired per
            pseudo-query, and its standard error; EOGP-rot is preferred when ``diff > diff_se``.
    """

    curves: Dict[str, RecallCurve]
    diff: float
    diff_se: float

    @property
    def code(self) -> str:
        return "eogp-rot" if self.diff > self.diff_se else "eogp"  # nan (nothing measured) keeps EOGP

    def to_json(self) -> Dict[str, object]:
        return {
            **{code: curve.to_json() for code, curve in self.curves.items()},
            "diff": _plain(self.diff),
            "diff_se": _plain(self.diff_se),
        }

    @classmethod
    def from_json(cls, data: Dict[str, object]) -> "ModuleRecall":
        return cls(
            curves={code: RecallCurve.from_json(data[code]) for code in CODES if code in data},
            diff=_number(data["diff"]),
            diff_se=_number(data["diff_se"]),
        )


def compare_recall(tier: torch.Tensor, one_bit: Dict[str, torch.Tensor]) -> ModuleRecall:
    """Each code's recall of the tier's top rows, for one module, and the paired comparison.

    Args:
        tier: ``(h, h - 1)`` the module's tier scores of the other held-out documents.
        one_bit: ``{code: (h, h - 1)}`` each code's one-bit scores of them.
    """
    import torch

    curves, per_query = {}, {}
    for code in CODES:
        curves[code], values = recall_curve(tier, one_bit[code])
        per_query[code] = values.mean(dim=1) if values.shape[1] else torch.full((values.shape[0],), float("nan"))
    diff, diff_se = mean_se(per_query["eogp-rot"] - per_query["eogp"])
    return ModuleRecall(curves, diff, diff_se)


@dataclass(frozen=True)
class IndexRecall:
    """The index's recall and gap curves: the tier's scores and the stored one-bit codes' scores,
    each summed over modules, and the default factor they give.

    Attributes:
        tier: the tier's code (``int8``, ``int4``, ``fp16``).
        curve: the recall and gap curves of the summed scores.
        gap_target: the gap the default factor must reach (:data:`RESCORE_GAP_TARGET`).
        factor: the default factor (:func:`default_factor`); None when nothing was measured.
        reached: whether ``factor``'s gap reaches ``gap_target``.
        target: the recall reported beside it (:data:`RECALL_TARGET`);
            recall_factor: the smallest factor reaching it (:func:`recall_factor`), or None.
        codes: ``{code: modules storing it}``.
    """

    tier: str
    curve: RecallCurve
    gap_target: float
    factor: Optional[int]
    reached: bool
    target: float
    recall_factor: Optional[int]
    codes: Dict[str, int]

    def to_json(self) -> Dict[str, object]:
        return {
            "tier": self.tier,
            **self.curve.to_json(),
            "criterion": "ndcg_gap",
            "gap_target": self.gap_target,
            "target": self.target,
            "recall_factor": self.recall_factor,
            "factor": self.factor,
            "reached": self.reached,
            "codes": dict(self.codes),
        }


def index_recall(tier_code: str, tier: torch.Tensor, one_bit: torch.Tensor, codes: Dict[str, int]) -> IndexRecall:
    """:class:`IndexRecall` of the summed ``(h, n)`` scores ``tier`` and ``one_bit``."""

    curve, _ = recall_curve(tier, one_bit)
    factor, reached = default_factor(curve)
    return IndexRecall(
        tier_code, curve, RESCORE_GAP_TARGET, factor, reached, RECALL_TARGET, recall_factor(curve), codes
    )


def format_cells(record: Dict[str, object]) -> str:
    """The curves of a recall record, one cell per factor: ``F=<f> <recall>±<se> gap <gap>`` (a
    record without the gap: the recall only)."""
    gaps = record.get("gap") or [None] * len(record["factors"])
    cells = []
    for f, r, se, gap in zip(record["factors"], record["recall"], record["recall_se"], gaps):
        cell = f"F={f} " + (
            f"{r:.3f}±{se:.3f}" if r is not None and se is not None else "n/a" if r is None else f"{r:.3f}"
        )
        cells.append(cell + (f" gap {gap:.4f}" if gap is not None else ""))
    return ", ".join(cells)


def format_choice(record: Dict[str, object]) -> str:
    """How a recall record's default factor was chosen: by the gap (records with ``criterion``
    ``ndcg_gap``), else by the recall (older records)."""
    factor = record["factor"]
    if factor is None:
        return "no factor measured: queries use the default of an index without the record"
    if record.get("criterion") == "ndcg_gap":
        bound = f"NDCG@{record['t']} gap {record['gap_target']}"
        extra = (
            f"; recall {record['target']} first at F={record['recall_factor']}" if record.get("recall_factor") else ""
        )
    else:
        bound, extra = f"recall {record['target']}", ""
    if record["reached"]:
        return f"default factor {factor}, the smallest within {bound}{extra}"
    return (
        f"default factor {factor}, the largest measured: NONE within {bound}{extra} "
        f"(warning: give --rescore above {factor} for a faithful top)"
    )


def format_recall(record: Dict[str, object]) -> str:
    """One line of an index's recall record (:meth:`IndexRecall.to_json`, as the manifest holds it)."""
    t = record["t"]
    return (
        f"recall of the {record['tier']} tier's top-{t} per side in the one-bit top F x {t}, and the NDCG@{t} "
        f"gap of that top rescored ({record['held_out']} held-out pseudo-queries): "
        f"{format_cells(record) or 'no factor fits'}; {format_choice(record)}"
    )
