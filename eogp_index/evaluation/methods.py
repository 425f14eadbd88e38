"""The methods ``eogp eval`` compares: one class per family, each registered once.

A *family* is one way to compress a module's gradient to ``k_u`` coordinates: EOGP's PCA second
stage, an SRHT, the top EK-FAC axes, LoGra's or a Gaussian projection's factors, GraSS. Its
*variants* are the names ``--methods`` takes: the family stored at one precision (``eogp``,
``eogp-fp16``, ...). A family subclasses :class:`MethodFamily` with the ``family=`` and
``seed_index=`` keywords, which register it (as kronfluence registers each factor strategy
through ``FactorConfig.__init_subclass__``), and says:

* its variants (:class:`Variant`): name, label in tables and plots, storage precision, place in
  listings, whether a run without ``--methods`` includes it;
* what it needs of the shared pass (:attr:`MethodFamily.uses_pca`, :attr:`~MethodFamily.streamed`,
  :attr:`~MethodFamily.factored`) and its dimensions at a budget (:meth:`~MethodFamily.dimensions`);
* how it builds its scores: a projector per module (:meth:`~MethodFamily.projector`), the
  coordinates it takes from each gradient batch (:meth:`~MethodFamily.coordinates`), the ``P`` a
  PCA family stores (:meth:`~MethodFamily.directions`), its scores after the passes
  (:meth:`~MethodFamily.score`), and any analysis of its own for ``details.json``
  (:meth:`~MethodFamily.fidelity_details`).

The budget planning and the shared pass (:mod:`~eogp_index.evaluation.fidelity`), the configs and
the command line ask this registry (:func:`variant`, :func:`family_of`, :func:`label`,
:data:`METHODS`); none of them compares a method's name.

Importing this module loads neither torch nor numpy, because the command line reads the names and
labels from it for ``--help``; each hook imports what it computes with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

from eogp_index.config import first_stage_width
from eogp_index.errors import ConfigError

__all__ = [
    "DEFAULT_METHODS",
    "K_FROM_PRECISION",
    "METHODS",
    "PCA_FAMILIES",
    "MethodFamily",
    "Variant",
    "check_methods",
    "colours",
    "families",
    "family_of",
    "label",
    "variant",
]


@dataclass(frozen=True)
class Variant:
    """One name ``--methods`` takes.

    Attributes:
        name: the key (``"eogp-fp16"``).
        label: its name in tables and plots (``"EOGP (FP16)"``).
        precision: how its coordinates are stored: ``"1bit"``, ``"fp16"`` or ``"fp32"``.
        order: its place in listings (``--help``, :data:`METHODS`, :data:`DEFAULT_METHODS`, and
            so the rows of a default run's tables).
        colour: its line in every plot (a matplotlib colour), whichever methods a run compares.
        default: run when ``--methods`` is not given.
        sized_as: the precision whose bytes set ``k``, when not its own (FP16 at the ``k`` of
            1-bit at the same nominal budget).
    """

    name: str
    label: str
    precision: str
    order: int
    colour: str
    default: bool = False
    sized_as: Optional[str] = None

    @property
    def sizing(self) -> str:
        """The precision whose bytes per module set ``k``."""
        return self.sized_as or self.precision


_FAMILIES: Dict[str, "MethodFamily"] = {}
_VARIANTS: Dict[str, Tuple[Variant, "MethodFamily"]] = {}


class MethodFamily:
    """Base class of the method families; a subclass given ``family=`` is registered.

    Attributes:
        family: the family's key (:data:`METHODS` maps each of its names to it).
        seed_index: separates the family's random draws from every other family's.
        variants: the names this family answers to; a subclass lists its own (it does not
            inherit its parent's).
        uses_pca: its ``P`` is a PCA of the fitting documents' first-stage coordinates, fitted
            after the passes (:meth:`directions` turns it into what is stored).
        streamed: its training coordinates need nothing fitted afterwards, so they are scored
            batch by batch against the stored query coordinates and not kept.
        factored: its projector has factors ``P_a`` ``(d_in, rank)`` and ``P_g``
            ``(d_out, rank)``, applied with every other factored projector's in one product.
        ensembled: the index stores this code per checkpoint, so ``eogp eval lds --checkpoints``
            measures its checkpoint ensemble (:mod:`~eogp_index.evaluation.ensemble`).

    A family that is neither ``uses_pca`` nor ``streamed`` keeps its training coordinates and is
    scored with a curvature fitted after projection (LoGra, GraSS).
    """

    family: ClassVar[str]
    seed_index: ClassVar[int]
    variants: ClassVar[Tuple[Variant, ...]] = ()
    uses_pca: ClassVar[bool] = False
    streamed: ClassVar[bool] = False
    factored: ClassVar[bool] = False
    ensembled: ClassVar[bool] = False

    def __init_subclass__(cls, family: Optional[str] = None, seed_index: Optional[int] = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if family is None:
            return
        own = cls.__dict__.get("variants", ())  # not the parent's: each name belongs to one family
        if family in _FAMILIES or seed_index is None or seed_index in (f.seed_index for f in _FAMILIES.values()):
            raise ConfigError(
                f"method family {cls.__name__}: family {family!r} or seed_index {seed_index} is "
                "missing or already registered; give each family its own"
            )
        taken = [v.name for v in own if v.name in _VARIANTS]
        if not own or taken or len({v.name for v in own}) < len(own):
            raise ConfigError(
                f"method family {cls.__name__}: its variants {[v.name for v in own]} must be new, "
                f"distinct names ({taken} already registered); rename them"
            )
        cls.family, cls.seed_index = family, seed_index
        instance = cls()
        _FAMILIES[family] = instance
        _VARIANTS.update((v.name, (v, instance)) for v in own)

    # -- planning ---------------------------------------------------------------------------
    def dimensions(
        self, k: int, modules: Sequence[Any], *, m: Optional[int], gaussian_seeds: int, seed: int
    ) -> Dict[str, Any]:
        """The :class:`~eogp_index.evaluation.fidelity.MethodConfig` fields ``k``, ``m``, ``rank``
        and ``seeds`` when each module's bytes hold ``k`` coordinates.

        Args:
            modules: the :class:`~eogp_index.fit.plan.ModuleShape` of every attributed module.
            m: the first-stage width asked for (None: the index's default rule).

        Raises:
            ConfigError: a module cannot support these dimensions (the method's curve ends).
        """
        _check_k(k, modules)
        return {"k": (k,) * len(modules), "seeds": (seed,)}

    # -- the shared pass --------------------------------------------------------------------
    def projector(self, shared: Any, cfg: Any, u: int, name: str, seed: int) -> Any:
        """Module ``name``'s (the ``u``-th) projector for one seed of ``cfg``; None: none needed.

        ``shared`` is the :class:`~eogp_index.evaluation.fidelity.SharedPass` (its curvature and
        K-FAC eigenvalues); ``seed`` is already distinct per family, seed and module.
        """
        return None

    def coordinates(self, cfg: Any, u: int, batch: Any, projector: Any, key: str) -> Any:
        """``(B, k_u)`` coordinates of module ``u`` in one gradient batch; None: taken after the passes.

        ``batch`` is a :class:`~eogp_index.evaluation.fidelity.ModuleBatch`; ``key`` names this
        config and seed in ``batch.factored``.
        """
        return None

    def directions(self, shared: Any, cfg: Any, name: str, basis: Any, query_first: Any, train_first: Any) -> Any:
        """A PCA family's stored ``P`` ``(m, k)`` for module ``name``, from its PCA ``basis``.

        ``query_first``, ``train_first``: the module's first ``m`` first-stage coordinates
        ``(nq, m)`` and ``(n, m)``.
        """
        return basis

    def score(self, shared: Any, cfg: Any, key: str) -> Tuple[Any, Any]:
        """After the passes: ``(scores, FP16 scores at the same k or None)``, each ``(nq, n)``, of
        the config and seed ``key``."""
        if self.uses_pca:
            return shared.score_pca(cfg)
        if self.streamed:
            return shared.streamed_scores(key)
        return shared.score_projected_curvature(cfg, key)

    # -- analyses ---------------------------------------------------------------------------
    def fidelity_details(self, scoreset: Any, ndcg_k: int) -> Dict[str, Any]:
        """This family's own entries of ``details.json``'s ``fidelity`` section (present, if
        empty, whichever methods ran)."""
        return {}


def _check_k(k: int, modules: Sequence[Any]) -> None:
    for mod in modules:
        if k > mod.d:
            raise ConfigError(f"k={k} exceeds the {mod.d} parameters of {mod.name}")


def _first_stage_dimensions(k: int, modules: Sequence[Any], m: Optional[int], seed: int) -> Dict[str, Any]:
    """``k`` after a first stage of width ``m_u`` (:func:`~eogp_index.config.first_stage_width`)."""
    _check_k(k, modules)
    widths = tuple(first_stage_width(mod.d, k, m) for mod in modules)  # ConfigError: m < k
    return {"k": (k,) * len(modules), "m": widths, "seeds": (seed,)}


def _rank_dimensions(k: int, modules: Sequence[Any], seeds: Tuple[int, ...], *, within_factors: bool) -> Dict[str, Any]:
    """Factors of the largest rank with ``rank**2 <= k``; ``within_factors``: the rank may not
    exceed ``min(d_in, d_out)`` (a PCA or random factor of a module has at most that many columns)."""
    rank = math.isqrt(k)
    for mod in modules:
        if within_factors and rank > min(mod.d_in, mod.d_out):
            raise ConfigError(f"rank {rank} exceeds min(d_in, d_out) = {min(mod.d_in, mod.d_out)} of {mod.name}")
        if rank * rank > mod.d:
            raise ConfigError(f"{rank * rank} coordinates exceed the {mod.d} parameters of {mod.name}")
    return {"k": (rank * rank,) * len(modules), "rank": (rank,) * len(modules), "seeds": seeds}


def _per_query(reference: Any, ndcg_k: int) -> Dict[str, Any]:
    """``{metric: scores -> (nq,) values against reference}`` of the two fidelity metrics."""
    from eogp_index.evaluation import metrics

    return {
        f"ndcg@{ndcg_k}": lambda s: metrics.ndcg_at_k_per_query(s, reference, ndcg_k),
        "spearman": lambda s: metrics.spearman_per_query(s, reference),
    }


# --------------------------------------------------------------------------- EOGP and its codes


class EOGP(MethodFamily, family="eogp", seed_index=0):
    """EOGP: the top ``m_u`` half-whitened EK-FAC axes, then ``P`` = the top ``k_u`` uncentered
    PCA directions of the fitting documents' first-stage coordinates."""

    variants = (
        Variant("eogp", "EOGP", "1bit", order=0, colour="tab:blue", default=True),
        Variant(
            "eogp-fp16-same-k",
            "EOGP (FP16, same k)",
            "fp16",
            order=3,
            colour="tab:green",
            default=True,
            sized_as="1bit",
        ),
        Variant("eogp-fp16", "EOGP (FP16)", "fp16", order=4, colour="tab:red", default=True),
        Variant("eogp-fp32", "EOGP (FP32)", "fp32", order=11, colour="midnightblue"),
    )
    uses_pca = True
    ensembled = True

    def dimensions(self, k, modules, *, m, gaussian_seeds, seed):
        return _first_stage_dimensions(k, modules, m, seed)


class EOGPRot(EOGP, family="eogp-rot", seed_index=7):
    """EOGP with each module's ``k`` PCA coordinates rotated by the index's randomized Hadamard
    transform before the signs, folded into ``P`` (the index's variant ``eogp-rot``)."""

    variants = (Variant("eogp-rot", "EOGP-rot", "1bit", order=1, colour="tab:orange", default=True),)

    def directions(self, shared, cfg, name, basis, query_first, train_first):
        from eogp_index.fit.projection import module_rotation, rotate_directions

        return rotate_directions(basis, module_rotation(cfg.seeds[0], name, basis.shape[1]))

    def fidelity_details(self, scoreset, ndcg_k):
        return {"one_bit_gap": self.one_bit_gap(scoreset, ndcg_k=ndcg_k)}

    @staticmethod
    def one_bit_gap(
        scoreset: Any,
        *,
        ndcg_k: int = 20,
        base: str = "eogp",
        variant: str = "eogp-rot",
        ceiling: str = "eogp-fp16-same-k",
    ) -> List[Dict[str, Any]]:
        """How much of the gap between 1-bit ``base`` and FP16 at the same ``k`` (``ceiling``) the
        1-bit ``variant`` closes, per budget where all three ran.

        Per budget and metric (``ndcg@k``, ``spearman``): the three query means with their
        standard errors (``std / sqrt(n_queries)``), ``diff`` = variant - base with the standard
        error of the paired per-query differences, and ``gap_closed`` = (variant - base) /
        (ceiling - base), None when the ceiling is not above the base. First seed only (these
        methods have one).
        """
        import numpy as np

        from eogp_index.evaluation.metrics import standard_error

        rows: List[Dict[str, Any]] = []
        per_query = _per_query(scoreset.reference, ndcg_k)
        for budget in sorted({c.budget for c in scoreset.configs}):
            cfgs = [scoreset.config(method, budget) for method in (base, variant, ceiling)]
            if any(c is None for c in cfgs):
                continue
            row: Dict[str, Any] = {"budget": budget, "k": list(cfgs[0].k), "m": list(cfgs[0].m or ())}
            for metric, fn in per_query.items():
                b, v, c = (np.asarray(fn(scoreset.scores[cfg.id][0]), dtype=np.float64) for cfg in cfgs)
                means = [float(np.nanmean(x)) for x in (b, v, c)]
                diff = v - b
                gap = means[2] - means[0]
                row[metric] = {
                    "base": means[0],
                    "variant": means[1],
                    "ceiling": means[2],
                    "se": [standard_error(x) for x in (b, v, c)],
                    "diff": float(np.nanmean(diff)),
                    "diff_se": standard_error(diff),
                    "gap_closed": (means[1] - means[0]) / gap if gap > 0 else None,
                }
            rows.append(row)
        return rows


class Auto(EOGP, family="auto", seed_index=8):
    """Per module, EOGP's or EOGP-rot's ``P``, whichever the index's fit-time measurement chooses
    (variant ``auto``): a seeded part of the fitting documents is held out, ``P`` fitted on the
    rest, and each code scored by how well its 1-bit ranking of the held-out documents keeps the
    ranking by their first-stage inner products.

    Its per-pass state lives on the :class:`~eogp_index.evaluation.fidelity.SharedPass`:
    ``held_out_bases`` (the held-out fits), ``choices`` (per config id and module, the
    measurement) and ``module_scores`` (per config id and module, both codes' share of the
    scores, for :meth:`code_choices`).
    """

    variants = (Variant("auto", "EOGP auto (per module)", "1bit", order=2, colour="goldenrod"),)
    #: The codes a module can store: the index's own names for them.
    PLAIN, ROTATED = "eogp", "eogp-rot"

    def directions(self, shared, cfg, name, basis, query_first, train_first):
        from eogp_index.fit.projection import module_rotation, rotate_directions

        k = basis.shape[1]
        choice = self.choose(shared, cfg, name, cfg.m[shared.names.index(name)], k)
        shared.choices.setdefault(cfg.id, {})[name] = choice
        codes = {self.PLAIN: basis, self.ROTATED: rotate_directions(basis, module_rotation(cfg.seeds[0], name, k))}
        shared.module_scores.setdefault(cfg.id, {})[name] = {
            code: shared.one_bit_share(query_first, train_first, b) for code, b in codes.items()
        }
        return codes[choice.code]

    def choose(self, shared: Any, cfg: Any, name: str, m: int, k: int) -> Any:
        """Module ``name``'s code at this config, measured as the index's fit measures it.

        The one call into the fit-side measurement. Its held-out ``P`` is fitted once per
        ``(module, m)`` at the largest ``k`` any ``auto`` config asks, and sliced (PCA directions
        are nested), as :meth:`~eogp_index.evaluation.fidelity.SharedPass.pca_basis` does for the stored ``P``.
        """
        from eogp_index.config import HELD_OUT_FRACTION
        from eogp_index.fit.code_choice import (
            CodeChoice,
            compare_codes,
            held_out_directions,
            held_out_rows,
            held_out_target,
        )
        from eogp_index.fit.projection import module_rotation

        seed = cfg.seeds[0]
        z = shared.fit_coordinates(name)[:, :m]
        held_out = held_out_rows(z.shape[0], HELD_OUT_FRACTION, seed)
        key = (name, m)
        if key not in shared.held_out_bases:
            # Configs come budget by budget with the same m: a fit of another m is not asked for again.
            shared.held_out_bases = {other: b for other, b in shared.held_out_bases.items() if other[0] != name}
            u = shared.names.index(name)
            k_max = max(c.k[u] for c in shared.configs if c.spec is self and c.m[u] == m)
            shared.held_out_bases[key] = held_out_directions(z, max(k, k_max), held_out) if held_out.numel() else None
        basis = shared.held_out_bases[key]
        if basis is None:
            return CodeChoice(self.PLAIN, 0, {}, float("nan"), float("nan"), 0.0)
        y = z[held_out].double() @ basis[:, :k]
        return compare_codes(y, held_out_target(z, held_out), module_rotation(seed, name, k))

    @classmethod
    def code_choices(cls, shared: Any, reference: Any, *, ndcg_k: int = 20) -> List[Dict[str, Any]]:
        """Per ``auto`` config and module: the held-out measurement that chose the module's code,
        and what rotating that one module gains against the reference.

        The gain of module ``u`` is the fidelity (query means of NDCG@``ndcg_k`` and Spearman
        against ``reference``) of EOGP with only module ``u`` rotated, minus all-EOGP's, with the
        standard error of the paired per-query differences: the reference's view of the choice
        the proxy (``proxy_diff``: EOGP-rot minus EOGP in the held-out measurement) makes.
        """
        import numpy as np

        from eogp_index.evaluation.metrics import standard_error

        per_query = _per_query(reference, ndcg_k)
        rows: List[Dict[str, Any]] = []
        for cfg in shared.configs:
            parts = shared.module_scores.get(cfg.id)
            if not parts:
                continue
            plain = sum(part[cls.PLAIN] for part in parts.values())
            base = {metric: fn(plain) for metric, fn in per_query.items()}
            for name, part in parts.items():
                swapped = plain - part[cls.PLAIN] + part[cls.ROTATED]
                choice = shared.choices[cfg.id][name]
                gain = {}
                for metric, fn in per_query.items():
                    diff = np.asarray(fn(swapped), dtype=np.float64) - base[metric]
                    gain[metric], gain[f"{metric}_se"] = float(np.nanmean(diff)), standard_error(diff)
                rows.append(
                    {
                        "budget": cfg.budget,
                        "k": cfg.k[shared.names.index(name)],
                        "module": name,
                        "code": choice.code,
                        "held_out": choice.held_out,
                        "proxy_diff": choice.diff,
                        "proxy_diff_se": choice.diff_se,
                        "proxy": choice.fidelity,
                        "reference_gain": gain,
                    }
                )
        return rows

    def fidelity_details(self, scoreset, ndcg_k):
        return {"auto_vs_best": self.against_best(scoreset, ndcg_k=ndcg_k), "auto_choice": scoreset.choices}

    def against_best(self, scoreset: Any, *, ndcg_k: int = 20) -> List[Dict[str, Any]]:
        """Per budget where ``eogp``, ``eogp-rot`` and ``auto`` all ran, and per metric: the three
        query means, the better fixed code (``best``), ``diff`` = auto - best with the standard
        error of the paired per-query differences, and ``never_worse`` = ``diff >= -diff_se``.
        First seed only."""
        import numpy as np

        from eogp_index.evaluation.metrics import standard_error

        per_query = _per_query(scoreset.reference, ndcg_k)
        rows: List[Dict[str, Any]] = []
        for budget in sorted({c.budget for c in scoreset.configs}):
            cfgs = {method: scoreset.config(method, budget) for method in (self.PLAIN, self.ROTATED, "auto")}
            if any(c is None for c in cfgs.values()):
                continue
            row: Dict[str, Any] = {"budget": budget, "k": list(cfgs["auto"].k)}
            for metric, fn in per_query.items():
                values = {
                    method: np.asarray(fn(scoreset.scores[cfg.id][0]), dtype=np.float64) for method, cfg in cfgs.items()
                }
                means = {method: float(np.nanmean(v)) for method, v in values.items()}
                best = self.ROTATED if means[self.ROTATED] > means[self.PLAIN] else self.PLAIN
                diff = values["auto"] - values[best]
                entry = {**means, "best": best, "diff": float(np.nanmean(diff)), "diff_se": standard_error(diff)}
                entry["never_worse"] = (
                    bool(entry["diff"] >= -entry["diff_se"])
                    if math.isfinite(entry["diff_se"])
                    else bool(entry["diff"] >= 0)
                )
                row[metric] = entry
            rows.append(row)
        return rows


# --------------------------------------------------------------------------- other first-stage methods


class EOGPR(MethodFamily, family="eogp-r", seed_index=1):
    """EOGP-R: the same first stage, then a subsampled randomized Hadamard transform (SRHT)."""

    variants = (Variant("eogp-r", "EOGP-R", "1bit", order=5, colour="tab:purple", default=True),)
    streamed = True

    def dimensions(self, k, modules, *, m, gaussian_seeds, seed):
        return _first_stage_dimensions(k, modules, m, seed)

    def projector(self, shared, cfg, u, name, seed):
        import torch

        from eogp_index.fit.projection import make_srht

        return make_srht(cfg.m[u], cfg.k[u], torch.Generator().manual_seed(seed))

    def coordinates(self, cfg, u, batch, projector, key):
        from eogp_index.fit.projection import srht_apply

        signs, rows = projector
        return srht_apply(batch.first[:, : cfg.m[u]], signs, rows)


class EKFACTopK(MethodFamily, family="ekfac-topk", seed_index=2):
    """The ablation: the top ``k_u`` half-whitened EK-FAC axes, no PCA (at ``k = d`` in FP32: EK-FAC)."""

    variants = (
        Variant("ekfac-topk", "EK-FAC top-k (1-bit)", "1bit", order=6, colour="tab:brown", default=True),
        Variant("ekfac-topk-fp32", "EK-FAC top-k (FP32)", "fp32", order=12, colour="teal"),
    )
    streamed = True

    def coordinates(self, cfg, u, batch, projector, key):
        return batch.first[:, : cfg.k[u]]


# --------------------------------------------------------------------------- baselines (Appendix C.3)


class LoGraRandom(MethodFamily, family="logra-random", seed_index=3):
    """LoGra, random factors: ``vec(P_g^T G P_a)``, ``rank**2`` coordinates, scored with the
    curvature fitted after projection (``q^T H^{-1} t``)."""

    variants = (
        Variant("logra-random", "LoGra (random)", "fp16", order=7, colour="tab:pink", default=True),
        Variant("logra-random-1bit", "LoGra (random, 1-bit)", "1bit", order=13, colour="salmon"),
    )
    factored = True

    def dimensions(self, k, modules, *, m, gaussian_seeds, seed):
        return _rank_dimensions(k, modules, (seed,), within_factors=True)

    def projector(self, shared, cfg, u, name, seed):
        from eogp_index.evaluation.baselines import LoGraProjector

        d_out, d_in = shared.curvature[name].shape
        return LoGraProjector(d_in, d_out, cfg.rank[u], init="random", seed=seed)

    def coordinates(self, cfg, u, batch, projector, key):
        return batch.factored[key]  # = projector.project(a, g)


class LoGraPCA(LoGraRandom, family="logra-pca", seed_index=4):
    """LoGra with factors initialized from the K-FAC eigenvectors of largest eigenvalue."""

    variants = (
        Variant("logra-pca", "LoGra (PCA)", "fp16", order=8, colour="tab:gray", default=True),
        Variant("logra-pca-1bit", "LoGra (PCA, 1-bit)", "1bit", order=14, colour="slategray"),
    )

    def projector(self, shared, cfg, u, name, seed):
        from eogp_index.evaluation.baselines import LoGraProjector

        c = shared.curvature[name]
        d_out, d_in = c.shape
        eva, evg = shared.kfac_eigenvalues(name)
        return LoGraProjector(
            d_in,
            d_out,
            cfg.rank[u],
            init="pca",
            activation_eigenvectors=c.activation_eigenvectors,
            gradient_eigenvectors=c.gradient_eigenvectors,
            activation_eigenvalues=eva,
            gradient_eigenvalues=evg,
        )


class GraSS(MethodFamily, family="grass", seed_index=5):
    """FactGraSS: factor-wise random masking, then a CountSketch to ``k_u`` coordinates; scored
    with the curvature fitted after projection, as LoGra."""

    variants = (
        Variant("grass", "GraSS", "fp16", order=9, colour="tab:olive", default=True),
        Variant("grass-1bit", "GraSS (1-bit)", "1bit", order=15, colour="yellowgreen"),
    )

    def projector(self, shared, cfg, u, name, seed):
        from eogp_index.evaluation.baselines import GraSSProjector

        d_out, d_in = shared.curvature[name].shape
        return GraSSProjector(d_in, d_out, cfg.k[u], seed=seed)

    def coordinates(self, cfg, u, batch, projector, key):
        return projector.project(batch.a, batch.g)


class Gaussian(MethodFamily, family="gaussian", seed_index=6):
    """The Gaussian control: Gaussian factors; query gradients preconditioned by the full-space
    damped EK-FAC inverse before projection, inner products scaled by ``rank**-2``; averaged over
    ``gaussian_seeds`` draws."""

    variants = (Variant("gaussian", "Gaussian", "fp16", order=10, colour="tab:cyan", default=True),)
    factored = True
    streamed = True

    def dimensions(self, k, modules, *, m, gaussian_seeds, seed):
        return _rank_dimensions(k, modules, tuple(seed + s for s in range(gaussian_seeds)), within_factors=False)

    def projector(self, shared, cfg, u, name, seed):
        from eogp_index.evaluation.baselines import GaussianProjector

        d_out, d_in = shared.curvature[name].shape
        return GaussianProjector(d_in, d_out, cfg.rank[u], seed=seed)

    def coordinates(self, cfg, u, batch, projector, key):
        if batch.side == "query":
            return projector.project_dense(batch.preconditioned()) * projector.inner_product_scale
        return batch.factored[key]  # = projector.project(a, g)


# --------------------------------------------------------------------------- the registry


def variant(name: str) -> Variant:
    """The :class:`Variant` registered as ``name``; ConfigError naming the choices if none is."""
    check_methods((name,))
    return _VARIANTS[name][0]


def family_of(name: str) -> MethodFamily:
    """The family object of method ``name``."""
    check_methods((name,))
    return _VARIANTS[name][1]


def families() -> Tuple[MethodFamily, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def label(name: str) -> str:
    """Display name of a method (``"eogp-fp16"`` → ``"EOGP (FP16)"``); the name itself when unknown."""
    entry = _VARIANTS.get(name)
    return entry[0].label if entry else name


def colours() -> Dict[str, str]:
    """``{label: colour}`` of every method, for :func:`~eogp_index.evaluation.report.write_report`."""
    return {v.label: v.colour for v, _ in _VARIANTS.values()}


def check_methods(names: Iterable[str], where: str = "methods") -> None:
    """Raise ConfigError naming the unknown methods among ``names`` and every choice."""
    unknown = [name for name in names if name not in _VARIANTS]
    if unknown:
        raise ConfigError(
            f"{where}: unknown method(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(METHODS)} (comma-separated, e.g. --methods eogp,logra-pca)"
        )


_LISTED = sorted(_VARIANTS.values(), key=lambda entry: entry[0].order)
#: ``{name: (family, precision)}`` of every method, in listing order.
METHODS: Dict[str, Tuple[str, str]] = {v.name: (f.family, v.precision) for v, f in _LISTED}
#: What ``eogp eval`` runs without ``--methods``, in listing order.
DEFAULT_METHODS: Tuple[str, ...] = tuple(v.name for v, _ in _LISTED if v.default)
#: Families whose second stage is a PCA fitted on the fitting documents.
PCA_FAMILIES: Tuple[str, ...] = tuple(f.family for f in _FAMILIES.values() if f.uses_pca)
#: Methods whose ``k`` is set by another precision's bytes than their own (their actual bytes are
#: in ``details.json``).
K_FROM_PRECISION: Dict[str, str] = {v.name: v.sized_as for v, _ in _LISTED if v.sized_as}
