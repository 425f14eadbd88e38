"""Variant auto: which 1-bit code each module stores, EOGP's signs or EOGP-rot's, measured at fit time.

Whether the rotation helps is a property of a module's coordinates, and it can be measured
without any reference. A module's EK-FAC score restricted to its ``m_u`` kept coordinates is the
first-stage inner product ``<z_q, z_i>`` of the half-whitened eigen-coordinates, and the index
approximates that, not the FP16 score of the ``k``-dimensional projection: the truncation to ``k``
drops part of it, and the signs, which give every coordinate one magnitude, change which part the
codes keep. So the target is the first-stage Gram matrix ``G = Z Zᵀ`` of the held-out documents,
which the PCA fit computes anyway.

A seeded part of the PCA fitting set is held out; ``P`` is fitted on the rest; each held-out
document is a pseudo-query (projected in full precision, as a query is) ranking the other held-out
documents by each code's 1-bit scores, and that ranking is compared with the one ``G`` gives. The
code whose ranking agrees better wins, a tie within one standard error keeping EOGP. The same
comparison for the FP16 coordinates at the same ``k`` says how much the signs cost.

With a rescoring tier the one-bit code's job is another: to find the rows the tier ranks first,
which the query then orders by the tier's scores. :func:`measure_module` then also measures each
code's recall of the module's own tier scores (:mod:`eogp_index.fit.recall`), and that recall
decides the module's code under variant auto (a tie within one standard error keeping EOGP); the
fit sums the stored codes' scores over modules for the index's recall curve and default factor.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from time import perf_counter as time_counter
from typing import Dict, Optional, Tuple

import torch

from eogp_index.fit.ndcg import ndcg_of_hits
from eogp_index.fit.projection import HadamardRotation, _top_eigen, fit_pca
from eogp_index.fit.recall import CODES, IndexRecall, ModuleRecall, compare_recall, mean_se, tier_documents

#: Fewer held-out documents than this are too few to rank against each other: nothing is
#: measured and variant auto keeps EOGP.
MIN_HELD_OUT = 8
#: The cut-off of the held-out NDCG (the evaluation's NDCG@20).
FIDELITY_NDCG_AT = 20
#: The key of the FP16 coordinates at the same ``k`` in :attr:`CodeChoice.fidelity`: what the
#: same target gives without the signs (reported, never chosen).
FP16 = "fp16"


def held_out_rows(n: int, fraction: float, seed: int) -> torch.Tensor:
    """Positions, sorted ``(h,)`` int64, of the held-out part of a fitting set of ``n``:
    ``round(fraction · n)`` of them, a seeded sample; empty when that is below :data:`MIN_HELD_OUT`."""
    count = int(round(fraction * n))
    if count < MIN_HELD_OUT or count >= n:
        return torch.zeros(0, dtype=torch.int64)
    generator = torch.Generator().manual_seed(int(seed) + 0x5EED)
    return torch.randperm(n, generator=generator)[:count].sort().values


def one_bit_documents(y: torch.Tensor) -> torch.Tensor:
    """What the 1-bit codec stores of ``(n, k)`` coordinates, decoded: signs (``+1`` for ``>= 0``)
    times the FP16 scale ``‖y‖₁ / k`` of each row (``store.codecs``'s codes for one module)."""
    scale = (y.abs().sum(dim=1, keepdim=True) / y.shape[1]).to(torch.float16).to(y.dtype)
    return torch.where(y >= 0, 1.0, -1.0).to(y.dtype) * scale


def _off_diagonal(scores: torch.Tensor) -> torch.Tensor:
    """``(n, n)`` → ``(n, n - 1)``: each row without its own column (a pseudo-query is not ranked
    against itself)."""
    n = scores.shape[0]
    return scores.flatten()[1:].view(n - 1, n + 1)[:, :-1].reshape(n, n - 1)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Row-wise ranks 0..n-1 (ties by position): scores from continuous coordinates rarely tie."""
    return torch.argsort(torch.argsort(x, dim=1, stable=True), dim=1).to(torch.float64)


def ranking_agreement(a: torch.Tensor, e: torch.Tensor, ndcg_at: int = FIDELITY_NDCG_AT) -> Dict[str, torch.Tensor]:
    """Per query, how well scores ``a`` rank the candidates that reference scores ``e`` rank.

    Args:
        a, e: ``(q, n)`` float64.

    Returns:
        ``{"ndcg@K": (q,), "spearman": (q,)}`` float64: NDCG@K with binary relevance (membership
        in ``e``'s top K; the evaluation's definition), and Spearman's correlation of the ranks.
    """
    kk = min(ndcg_at, a.shape[1])
    relevant = torch.zeros_like(e, dtype=torch.bool).scatter_(1, torch.argsort(-e, dim=1, stable=True)[:, :kk], True)
    hits = relevant.gather(1, torch.argsort(-a, dim=1, stable=True)[:, :kk])
    ra, re = _ranks(a), _ranks(e)
    ra, re = ra - ra.mean(dim=1, keepdim=True), re - re.mean(dim=1, keepdim=True)
    spearman = (ra * re).sum(dim=1) / ((ra * ra).sum(dim=1) * (re * re).sum(dim=1)).sqrt()
    return {f"ndcg@{ndcg_at}": torch.from_numpy(ndcg_of_hits(hits.numpy())), "spearman": spearman}


def ranking_fidelity(
    y: torch.Tensor, documents: torch.Tensor, target: torch.Tensor, ndcg_at: int = FIDELITY_NDCG_AT
) -> Dict[str, torch.Tensor]:
    """How well held-out documents, stored as ``documents``, keep the target's ranking.

    Each of the ``h`` held-out documents is a pseudo-query (its coordinates ``y`` in full
    precision, as a query's are) ranking the other ``h - 1`` by ``y_q · documents_i``, against the
    ranking by ``target[q, i]``.

    Args:
        y: ``(h, k)`` held-out coordinates ``z P`` (float64).
        documents: ``(h, k)`` the same documents as the index stores them, decoded
            (:func:`one_bit_documents`, or FP16).
        target: ``(h, h)`` float64, the first-stage inner products ``z_held z_heldᵀ``.

    Returns:
        :func:`ranking_agreement`'s ``(h,)`` per-pseudo-query values.
    """
    scores = _off_diagonal(y.to(torch.float64) @ documents.to(torch.float64).T)
    return ranking_agreement(scores, _off_diagonal(target.to(torch.float64)), ndcg_at)


@dataclass(frozen=True)
class CodeChoice:
    """Which 1-bit code a module stores, and the held-out measurement behind it.

    Attributes:
        code: ``"eogp"`` or ``"eogp-rot"``.
        held_out: held-out documents measured (0: none, nothing measured).
        fidelity: per code, and for the FP16 coordinates at the same ``k`` (:data:`FP16`),
            ``{"ndcg@20", "ndcg@20_se", "spearman", "spearman_se"}``: query means and their
            standard errors, each against the first-stage inner products.
        diff, diff_se: EOGP-rot minus EOGP in the mean of the two metrics, paired per pseudo-query,
            and its standard error. Without a tier, EOGP-rot is chosen when ``diff > diff_se``.
        seconds: the measurement's time (its PCA fit included).
        recall: with a rescoring tier, each code's recall of the module's tier scores; it
            decides ``code`` (:attr:`ModuleRecall.code`). None without a tier.
    """

    code: str
    held_out: int
    fidelity: Dict[str, Dict[str, float]]
    diff: float
    diff_se: float
    seconds: float
    recall: Optional[ModuleRecall] = None

    def to_json(self) -> Dict[str, object]:
        """JSON-able, an undefined value (nan) as None."""

        def plain(x: float) -> Optional[float]:
            return x if math.isfinite(x) else None

        fidelity = {code: {metric: plain(v) for metric, v in values.items()} for code, values in self.fidelity.items()}
        record = {
            "code": self.code,
            "held_out": self.held_out,
            **fidelity,
            "diff": plain(self.diff),
            "diff_se": plain(self.diff_se),
            "seconds": self.seconds,
        }
        if self.recall is not None:
            record["recall"] = self.recall.to_json()
        return record

    @classmethod
    def from_json(cls, data: Dict[str, object]) -> "CodeChoice":
        def number(x) -> float:
            return float("nan") if x is None else float(x)

        return cls(
            code=str(data["code"]),
            held_out=int(data["held_out"]),
            fidelity={
                code: {metric: number(v) for metric, v in data[code].items()} for code in (*CODES, FP16) if code in data
            },
            diff=number(data["diff"]),
            diff_se=number(data["diff_se"]),
            seconds=float(data.get("seconds", 0.0)),
            recall=ModuleRecall.from_json(data["recall"]) if data.get("recall") else None,
        )


def held_out_directions(z: torch.Tensor, k: int, held_out: torch.Tensor) -> torch.Tensor:
    """``P`` fitted without the held-out rows: the top-``k`` PCA directions (:func:`fit_pca`) of
    ``z`` ``(n, m)`` minus rows ``held_out``, ``(m, k)`` float64. Nested in ``k``, as :func:`fit_pca` is."""
    keep = torch.ones(z.shape[0], dtype=torch.bool)
    keep[held_out] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a rank-deficient fit warns once, when the stored P is fitted
        return fit_pca(z[keep], k).double()


def held_out_coordinates(
    z: torch.Tensor, k: int, held_out: torch.Tensor, gram: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``z_held P`` ``(h, k)`` float64, with ``P`` fitted without the held-out rows.

    With the whole set's Gram matrix ``G = Z Zᵀ`` (the stored P's fit needs it anyway) and a fit
    of full rank this needs nothing of width ``m``: ``P = Z_fitᵀ U W^{-1/2}`` gives
    ``z_held P = G[held, fit] U W^{-1/2}``, with ``U, W`` from ``G[fit, fit]``. Otherwise (PCA
    completed with EK-FAC axes, or more rows than columns) ``P`` itself is fitted.
    """
    keep = torch.ones(z.shape[0], dtype=torch.bool)
    keep[held_out] = False
    if gram is not None:
        weights, vectors, rank = _top_eigen(gram[keep][:, keep], k)
        if rank == k:
            return gram[held_out][:, keep] @ (vectors / weights.sqrt())
    return z[held_out].double() @ held_out_directions(z, k, held_out)


def compare_codes(
    y: torch.Tensor,
    target: torch.Tensor,
    rotation: HadamardRotation,
    ndcg_at: int = FIDELITY_NDCG_AT,
    seconds: float = 0.0,
) -> CodeChoice:
    """Both codes' fidelity, and the FP16 coordinates', to the first-stage inner products, and the choice.

    Args:
        y: ``(h, k)`` held-out coordinates ``z_held P``.
        target: ``(h, h)`` their first-stage inner products ``z_held z_heldᵀ``.
        rotation: the module's rotation (what ``eogp-rot`` folds into ``P``).
    """
    start = time_counter()
    y = y.to(torch.float64)
    rotated = rotation.apply(y)
    per_code = {
        "eogp": ranking_fidelity(y, one_bit_documents(y), target, ndcg_at),
        "eogp-rot": ranking_fidelity(rotated, one_bit_documents(rotated), target, ndcg_at),
    }
    fp16 = ranking_fidelity(y, y.to(torch.float16), target, ndcg_at)
    fidelity: Dict[str, Dict[str, float]] = {}
    for code, values in {**per_code, FP16: fp16}.items():
        fidelity[code] = {}
        for metric, per_query in values.items():
            fidelity[code][metric], fidelity[code][f"{metric}_se"] = mean_se(per_query)
    combined = {code: torch.stack(list(values.values())).mean(dim=0) for code, values in per_code.items()}
    diff, diff_se = mean_se(combined["eogp-rot"] - combined["eogp"])
    code = "eogp-rot" if diff > diff_se else "eogp"  # nan (constant rankings) keeps EOGP
    return CodeChoice(code, int(y.shape[0]), fidelity, diff, diff_se, seconds + time_counter() - start)


def held_out_target(z: torch.Tensor, held_out: torch.Tensor, gram: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The first-stage inner products of the held-out rows, ``(h, h)`` float64: ``G[held, held]``
    of the whole set's Gram matrix when given, else computed from ``z`` ``(n, m)``'s held-out rows."""
    if gram is not None:
        return gram[held_out][:, held_out].to(torch.float64)
    rows = z[held_out].to(torch.float64)
    return rows @ rows.T


def choose_code(
    z: torch.Tensor,
    k: int,
    rotation: HadamardRotation,
    held_out: torch.Tensor,
    ndcg_at: int = FIDELITY_NDCG_AT,
    *,
    gram: Optional[torch.Tensor] = None,
) -> CodeChoice:
    """Measure both codes of one module on its held-out documents and pick one (no tier:
    :func:`measure_module` without its scores)."""
    return measure_module(z, k, rotation, held_out, ndcg_at, gram=gram)[0]


def measure_module(
    z: torch.Tensor,
    k: int,
    rotation: HadamardRotation,
    held_out: torch.Tensor,
    ndcg_at: int = FIDELITY_NDCG_AT,
    *,
    gram: Optional[torch.Tensor] = None,
    tier: Optional[str] = None,
    tier_k: Optional[int] = None,
) -> Tuple[CodeChoice, Optional[Dict[str, torch.Tensor]]]:
    """Measure both codes of one module on its held-out documents and pick one.

    Args:
        z: ``(n, m)`` first-stage coordinates of the module's whole PCA fitting set (any float dtype).
        rotation: the module's rotation of ``R^k`` (what ``eogp-rot`` folds into ``P``).
        held_out: ``(h,)`` rows of ``z`` held out (:func:`held_out_rows`); ``P`` is fitted on the others.
        gram: ``z``'s Gram matrix, when the caller has it (see :func:`held_out_coordinates`); the
            target is then its held-out block.
        tier: the rescoring tier's code (``int8``, ``int4``, ``fp16``) or None: without one the
            code is chosen by fidelity to the first-stage inner products, with one by recall
            of the tier's top rows (:func:`tier_scores`).
        tier_k: the tier's coordinates (default ``k``; at least ``k``: the one-bit code keeps
            their first ``k``).

    Returns:
        The choice, and with a tier the scores behind its recall (:func:`tier_scores`), else None.
    """
    if held_out.numel() < MIN_HELD_OUT:
        return CodeChoice("eogp", 0, {}, float("nan"), float("nan"), 0.0), None
    start = time_counter()
    width = k if tier is None else max(k, int(tier_k or k))
    wide = held_out_coordinates(z, width, held_out, gram)  # (h, width), as ingest would project them
    target = held_out_target(z, held_out, gram)  # (h, h): what the index's scores approximate
    choice = compare_codes(wide[:, :k], target, rotation, ndcg_at, seconds=time_counter() - start)
    if tier is None:
        return choice, None
    start = time_counter()
    scores = tier_scores(wide, k, rotation, tier)
    recall = compare_recall(scores["tier"], {code: scores[code] for code in CODES})
    seconds = choice.seconds + time_counter() - start
    return dataclasses.replace(choice, code=recall.code, recall=recall, seconds=seconds), scores


def tier_scores(y: torch.Tensor, k: int, rotation: HadamardRotation, tier: str) -> Dict[str, torch.Tensor]:
    """Each held-out document's scores of the others, by the tier and by each one-bit code.

    Each pseudo-query uses its unquantized coordinates (as a query does): the tier scores
    ``⟨y_q, tier_i⟩`` over all the tier's coordinates; ``eogp`` scores ``s_i ⟨y_q, b_i⟩`` over
    the first ``k`` (:func:`one_bit_documents`), ``eogp-rot`` the same of their rotation. Every
    code is measured against one tier, that of the unrotated coordinates: inner products do not
    change under the rotation, and one target keeps the comparison paired.

    Args:
        y: ``(h, k_tier)`` the held-out documents' coordinates, ``k_tier >= k``.

    Returns:
        ``{"tier", "eogp", "eogp-rot"}``: ``(h, h - 1)`` float64, without each document's own column.
    """
    y = y.to(torch.float64)
    first = y[:, :k]
    rotated = rotation.apply(first)
    return {
        "tier": _off_diagonal(y @ tier_documents(y, tier).T),
        "eogp": _off_diagonal(first @ one_bit_documents(first).T),
        "eogp-rot": _off_diagonal(rotated @ one_bit_documents(rotated).T),
    }


def fidelity_record(
    choices: Dict[str, CodeChoice], recall: Optional[IndexRecall] = None
) -> Optional[Dict[str, object]]:
    """What the manifest records of the held-out measurement (``projection.fidelity``), or None
    when nothing was measured: ``{"ndcg_at", "seconds", "modules": {name: CodeChoice.to_json()}}``,
    and with a rescoring tier ``"recall"``: the index's recall curve and default factor
    (:meth:`IndexRecall.to_json`)."""
    if not choices:
        return None
    record: Dict[str, object] = {
        "ndcg_at": FIDELITY_NDCG_AT,
        "seconds": sum(c.seconds for c in choices.values()),
        "modules": {name: choice.to_json() for name, choice in choices.items()},
    }
    if recall is not None:
        record["recall"] = recall.to_json()
    return record
