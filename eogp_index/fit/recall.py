"""The one-bit code's recall of the rescoring tier's top rows, measured at fit time.

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

The recall at factor ``F`` is the share of the tier's top ``t`` of each side (most positive,
most negative) found in the one-bit top ``F · t`` of that side, averaged over both sides, then
over pseudo-queries (with its standard error over them): :func:`recall_curve`.

**t.** The held-out set is small (0.15 of the PCA set: tens to hundreds of documents), and the
recall of a top ``F · t`` says nothing once ``F · t`` covers the ``h - 1`` candidates. So ``t``
scales with ``h``: ``t = max(1, min(20, h // 20))`` (:func:`recall_t`), about 5% of the candidates,
which lets the largest factor, 20, still be selective (``20 t <= h``; a factor is measured only
when ``F · t < h - 1``), and never more than 20, the top a reader reads (the evaluation's
NDCG@20). The recall of a top ``t`` in a top ``F · t`` is the ratio queries use (``N = F · k``),
measured at the scale the held-out set allows.

**The default factor** (:func:`default_factor`): the smallest measured ``F`` whose recall reaches
:data:`RECALL_TARGET`, else the largest measured (and the fit warns). Queries use it when they do
not give ``rescore`` (``Question.rescore`` None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from eogp_index.config import (
    RECALL_FACTORS,
    RECALL_MAX_T,
    RECALL_T_SHARE,
    RECALL_TARGET,
    TIER_LEVELS,
    quantize_tier_block,
)

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
    sides = []
    for sign in (1.0, -1.0):
        top = torch.argsort(-sign * tier, dim=1, stable=True)[:, :t]  # (q, t)
        places = _ranks(sign * one_bit).gather(1, top)  # (q, t): where the one-bit scan puts them
        sides.append(torch.stack([(places < f * t).double().mean(dim=1) for f in factors], dim=1))
    return (sides[0] + sides[1]) / 2


def mean_se(values: torch.Tensor) -> Tuple[float, float]:
    """The mean of the finite ``values`` ``(q,)`` and its standard error (nan below two)."""
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
    """The recall at each factor (:func:`recall_per_query`'s means over pseudo-queries).

    Attributes:
        t: the tier's top ``t`` per side.
        held_out: pseudo-queries (each ranks the other ``held_out - 1``).
        factors: the factors measured, increasing.
        recall, recall_se: per factor, the mean recall and its standard error.
    """

    t: int
    held_out: int
    factors: Tuple[int, ...]
    recall: Tuple[float, ...]
    recall_se: Tuple[float, ...]

    def to_json(self) -> Dict[str, object]:
        return {
            "t": self.t,
            "held_out": self.held_out,
            "factors": list(self.factors),
            "recall": [_plain(v) for v in self.recall],
            "recall_se": [_plain(v) for v in self.recall_se],
        }

    @classmethod
    def from_json(cls, data: Dict[str, object]) -> "RecallCurve":
        return cls(
            t=int(data["t"]),
            held_out=int(data["held_out"]),
            factors=tuple(int(f) for f in data["factors"]),
            recall=tuple(_number(v) for v in data["recall"]),
            recall_se=tuple(_number(v) for v in data["recall_se"]),
        )


def recall_curve(tier: torch.Tensor, one_bit: torch.Tensor) -> Tuple[RecallCurve, torch.Tensor]:
    """The recall curve of one-bit scores against the tier's, and its per-query values.

    Args:
        tier, one_bit: ``(h, h - 1)`` float64: each held-out document's scores of the others.

    Returns:
        The curve (``t`` = :func:`recall_t` ``(h)``, the factors :func:`measured_factors`
        allows) and the ``(h, len(factors))`` per-query recalls.
    """
    h = int(tier.shape[0])
    t = recall_t(h)
    factors = measured_factors(h, t)
    per_query = recall_per_query(tier.double(), one_bit.double(), t, factors)
    stats = [mean_se(per_query[:, j]) for j in range(len(factors))]
    curve = RecallCurve(t, h, factors, tuple(m for m, _ in stats), tuple(s for _, s in stats))
    return curve, per_query


def default_factor(curve: RecallCurve, target: float = RECALL_TARGET) -> Tuple[Optional[int], bool]:
    """The smallest factor whose recall reaches ``target`` and True; else the largest measured
    and False; ``(None, False)`` when nothing was measured."""
    for factor, recall in zip(curve.factors, curve.recall):
        if recall >= target:
            return factor, True
    return (curve.factors[-1] if curve.factors else None), False


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
    curves, per_query = {}, {}
    for code in CODES:
        curves[code], values = recall_curve(tier, one_bit[code])
        per_query[code] = values.mean(dim=1) if values.shape[1] else torch.full((values.shape[0],), float("nan"))
    diff, diff_se = mean_se(per_query["eogp-rot"] - per_query["eogp"])
    return ModuleRecall(curves, diff, diff_se)


@dataclass(frozen=True)
class IndexRecall:
    """The index's recall curve: the tier's scores and the stored one-bit codes' scores, each
    summed over modules, and the default factor it gives.

    Attributes:
        tier: the tier's code (``int8``, ``int4``, ``fp16``).
        curve: the recall curve of the summed scores.
        target: the recall the default factor must reach (:data:`RECALL_TARGET`).
        factor: the default factor (:func:`default_factor`); None when nothing was measured.
        reached: whether ``factor``'s recall reaches ``target``.
        codes: ``{code: modules storing it}``.
    """

    tier: str
    curve: RecallCurve
    target: float
    factor: Optional[int]
    reached: bool
    codes: Dict[str, int]

    def to_json(self) -> Dict[str, object]:
        return {
            "tier": self.tier,
            **self.curve.to_json(),
            "target": self.target,
            "factor": self.factor,
            "reached": self.reached,
            "codes": dict(self.codes),
        }


def index_recall(
    tier_code: str, tier: torch.Tensor, one_bit: torch.Tensor, codes: Dict[str, int], target: float = RECALL_TARGET
) -> IndexRecall:
    """:class:`IndexRecall` of the summed ``(h, h - 1)`` scores ``tier`` and ``one_bit``."""
    curve, _ = recall_curve(tier, one_bit)
    factor, reached = default_factor(curve, target)
    return IndexRecall(tier_code, curve, target, factor, reached, codes)


def format_recall(record: Dict[str, object]) -> str:
    """One line of an index's recall record (:meth:`IndexRecall.to_json`, as the manifest holds it)."""
    t = record["t"]
    cells = ", ".join(
        f"F={f} {r:.3f}±{se:.3f}" if r is not None and se is not None else f"F={f} n/a"
        for f, r, se in zip(record["factors"], record["recall"], record["recall_se"])
    )
    factor = record["factor"]
    if factor is None:
        chosen = "no factor measured: queries use the default of an index without the record"
    elif record["reached"]:
        chosen = f"default factor {factor}, the smallest reaching {record['target']}"
    else:
        chosen = f"default factor {factor}, the largest measured: none reached {record['target']}"
    return (
        f"recall of the {record['tier']} tier's top-{t} per side in the one-bit top F x {t} "
        f"({record['held_out']} held-out pseudo-queries): {cells or 'no factor fits'}; {chosen}"
    )
