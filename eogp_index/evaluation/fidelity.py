"""Every compression method's scores from one shared gradient pass, and their fidelity to EK-FAC.

This is the measuring half of ``eogp eval`` (paper Appendix C.3 and D.2). EK-FAC is fitted
once, by kronfluence; then one gradient pass over the queries and one over the training
documents feed a single :class:`~eogp_index.gradients.GradientCapture` transform that hands
each module's ``(a, g)`` to *every* method at once. All methods therefore see the same
gradients, the same loss and the same curvature: only the compression differs.

Methods are the families of :mod:`~eogp_index.evaluation.methods`, one class each (EOGP and
its FP16, SRHT and rotated variants, ``auto``, the EK-FAC top-k ablation, LoGra, GraSS, a
Gaussian control), at matched per-example storage budgets (bytes per example, summed over
modules, split evenly over the ``U`` modules). This module plans their dimensions
(:func:`plan_methods`) and runs the pass; each family says what it needs of the pass and how it
turns the pass's tensors into scores.

A (method, budget) pair is *unsupported*, and its curve ends, when the dimension it needs
exceeds what a module supports (``k_u > d_u``; a LoGra rank above ``min(d_in, d_out)``). A PCA
asked for more components than its fitting documents span is completed with the leading
first-stage axes orthogonal to the span, as the index's fit does (:func:`fit_pca`; the run's
``notes`` say where).

References, computed in the same pass: uncompressed EK-FAC from kronfluence's own
``compute_pairwise_scores`` (``damping_factor=None``, the heuristic damping) on the same
factors -- the score every fidelity metric compares against --, the index-side full-width
EK-FAC (must equal kronfluence's), K-FAC (kronfluence's eigenvalues) and TracIn (plain
gradient inner products).

Scores are ``(n_queries, n_train)``, signed, kronfluence's convention: positive means that
training on the example lowers the query's loss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation import methods as registry
from eogp_index.evaluation import metrics
from eogp_index.evaluation.baselines import ProjectedCurvature, bytes_for_coordinates, k_for_bytes
from eogp_index.evaluation.config import (  # noqa: F401  (re-exported: the budgets and the registry's tables)
    DEFAULT_BUDGETS,
    DEFAULT_METHODS,
    K_FROM_PRECISION,
    METHODS,
    PCA_FAMILIES,
    TIER_CODES,
)
from eogp_index.fit.code_choice import CodeChoice
from eogp_index.fit.curvature import ModuleCurvature, factors_dir
from eogp_index.fit.plan import ModuleShape
from eogp_index.fit.projection import first_stage_from_curvature, fit_pca
from eogp_index.gradients.capture import GradientCapture
from eogp_index.gradients.loss import IGNORE_INDEX, collate
from eogp_index.store.codecs import SignLayout, TierCodec, decode, encode

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_METHODS",
    "Documents",
    "METHODS",
    "MethodConfig",
    "ModuleBatch",
    "ModuleShape",
    "ScoreSet",
    "SharedPass",
    "compute_scores",
    "fidelity_records",
    "kronfluence_scores",
    "plan_methods",
]

#: Names of the uncompressed references.
REF_EKFAC = "EK-FAC (kronfluence)"
REF_KFAC = "K-FAC"
REF_TRACIN = "TracIn"


# --------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Documents:
    """Tokenized documents: ``ids`` ``(n,)``, ``input_ids`` and ``labels`` (``n`` token lists).

    ``labels[t]`` is predicted from ``input_ids[:t]`` (``-100`` = not counted), as in
    :func:`eogp_index.fit.task.collate`; plain documents have ``labels == input_ids``.
    """

    ids: Tuple[str, ...]
    input_ids: Tuple[Tuple[int, ...], ...]
    labels: Tuple[Tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.input_ids) == len(self.labels)):
            raise InputError("Documents: ids, input_ids and labels differ in length")
        for i, (ids, labels) in enumerate(zip(self.input_ids, self.labels)):
            if len(ids) != len(labels):
                raise InputError(f"document {self.ids[i]!r}: {len(labels)} labels for {len(ids)} tokens")
            if not any(label != IGNORE_INDEX for label in labels[1:]):
                raise InputError(f"document {self.ids[i]!r} has no token that counts in the loss")

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, n: Optional[int]) -> "Documents":
        """The first ``n`` documents (all when ``n`` is None)."""
        if n is None or n >= len(self):
            return self
        if n < 1:
            raise ConfigError(f"a document limit must be at least 1, got {n}")
        return Documents(self.ids[:n], self.input_ids[:n], self.labels[:n])

    def sample(self, n: Optional[int], seed: int = 0) -> "Documents":
        """A seeded random sample of ``n`` documents, in their original order (all when ``n`` is
        None or at least ``len(self)``)."""
        if n is None or n >= len(self):
            return self
        if n < 1:
            raise ConfigError(f"a sample needs at least 1 document, got {n}")
        import random

        keep = sorted(random.Random(seed).sample(range(len(self)), n))
        return Documents(
            tuple(self.ids[i] for i in keep),
            tuple(self.input_ids[i] for i in keep),
            tuple(self.labels[i] for i in keep),
        )

    def pairs(self) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        return list(zip(self.input_ids, self.labels))

    def num_loss_tokens(self) -> np.ndarray:
        """``(n,)`` int64: positions that count in each document's loss."""
        return np.array([sum(1 for x in labels[1:] if x != IGNORE_INDEX) for labels in self.labels], np.int64)

    def fingerprint(self) -> str:
        """SHA-256 of ids, tokens and labels: identifies the documents in caches."""
        digest = hashlib.sha256()
        for ident, ids, labels in zip(self.ids, self.input_ids, self.labels):
            digest.update(json.dumps([ident, ids, labels if labels != ids else None]).encode())
        return digest.hexdigest()


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class MethodConfig:
    """One method at one budget.

    Attributes:
        method: a key of :data:`METHODS`.
        budget: nominal per-example bytes (the x-axis of the plots).
        k: stored coordinates per module (``rank**2`` for LoGra and Gaussian).
        m: first-stage width per module (``eogp``, ``eogp-r``), else None.
        rank: factor rank per module (LoGra, Gaussian), else None.
        seeds: one score matrix per seed; metrics are averaged over them.
    """

    method: str
    budget: int
    k: Tuple[int, ...]
    m: Optional[Tuple[int, ...]] = None
    rank: Optional[Tuple[int, ...]] = None
    seeds: Tuple[int, ...] = (0,)

    @property
    def spec(self) -> registry.MethodFamily:
        """The registered family this method belongs to (what it needs, how it scores)."""
        return registry.family_of(self.method)

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def precision(self) -> str:
        return registry.variant(self.method).precision

    @property
    def label(self) -> str:
        return registry.label(self.method)

    @property
    def id(self) -> str:
        return f"{self.method}@{self.budget}"

    @property
    def bytes_per_example(self) -> int:
        """Actual payload: ``Σ_u`` bytes of ``k_u`` coordinates at this precision."""
        return int(sum(bytes_for_coordinates(k, self.precision) for k in self.k))

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data.update(label=self.label, precision=self.precision, bytes_per_example=self.bytes_per_example)
        return data


def plan_methods(
    modules: Sequence[ModuleShape],
    budgets: Sequence[int],
    methods: Sequence[str] = DEFAULT_METHODS,
    *,
    m: Optional[int] = None,
    gaussian_seeds: int = 3,
    seed: int = 0,
) -> Tuple[List[MethodConfig], List[Dict[str, Any]]]:
    """Dimensions of every (method, budget) pair; returns ``(configs, skipped)``.

    Each module gets ``budget // U`` bytes; ``k`` is the largest coordinate count that fits
    (1-bit: ``8 (b - 2)``; FP16: ``b // 2``; a variant ``sized_as`` another precision: that
    precision's ``k``), and the method's family turns it into its dimensions
    (:meth:`~eogp_index.evaluation.methods.MethodFamily.dimensions`: LoGra and Gaussian use the
    largest rank with ``rank**2 <= k``). ``skipped`` lists the pairs a module cannot support,
    with the reason.

    Args:
        m: first-stage width of ``eogp``/``eogp-r`` (capped at ``d_u``; a ``k_u`` above it is
            skipped); None: the index's default rule.
    """
    registry.check_methods(methods, "plan_methods")
    if not modules:
        raise ConfigError("no attributed modules")
    configs, skipped = [], []
    for budget in sorted(set(int(b) for b in budgets)):
        per_module = budget // len(modules)
        for method in methods:
            try:
                if per_module < 1:
                    raise ConfigError(f"{budget} B over {len(modules)} modules leaves no byte per module")
                k = k_for_bytes(per_module, registry.variant(method).sizing)
                dims = registry.family_of(method).dimensions(k, modules, m=m, gaussian_seeds=gaussian_seeds, seed=seed)
            except ConfigError as exc:
                skipped.append({"method": method, "budget": budget, "reason": str(exc)})
                continue
            configs.append(MethodConfig(method, budget, **dims))
    return configs, skipped


# --------------------------------------------------------------------------- the shared pass


def _stack(parts: List[torch.Tensor]) -> np.ndarray:
    return torch.cat(parts, dim=0).numpy() if parts else np.zeros((0, 0), np.float32)


def stored_coordinates(x: np.ndarray, precision: str, k: Sequence[int]) -> np.ndarray:
    """What is stored for ``(n, K)`` coordinates, decoded back to float32."""
    if precision == "1bit":
        layout = SignLayout(tuple(int(v) for v in k))
        return decode(encode(x, layout, "1bit"), layout)
    if precision == "fp16":
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32)


class ModuleBatch:
    """One module's tensors in one gradient batch, as the families' ``coordinates`` hook sees them.

    Attributes:
        name: the module; side: ``"query"`` or ``"train"``.
        a: ``(B, T, d_in)`` inputs; g: ``(B, T, d_out)`` output gradients.
        first: ``(B, d_u)`` half-whitened EK-FAC coordinates sorted by decreasing eigenvalue (every
            first stage of width ``m`` is its prefix).
        factored: ``{"<config id>#<seed>": (B, rank**2)}`` of every factored projector, computed
            together.
    """

    def __init__(
        self,
        shared: "SharedPass",
        name: str,
        side: str,
        a: torch.Tensor,
        g: torch.Tensor,
        first: torch.Tensor,
        factored: Dict[str, torch.Tensor],
    ):
        self.shared, self.name, self.side = shared, name, side
        self.a, self.g, self.first, self.factored = a, g, first, factored
        self._preconditioned: Optional[torch.Tensor] = None

    def preconditioned(self) -> torch.Tensor:
        """The dense gradient ``(B, d_out, d_in)`` under the full-space damped EK-FAC inverse,
        computed once per batch for every config that asks."""
        if self._preconditioned is None:
            dense = torch.einsum("bto,bti->boi", self.g, self.a)
            self._preconditioned = self.shared.precondition(self.name, dense)
        return self._preconditioned


class SharedPass:
    """The one :data:`~eogp_index.gradients.Transform` that feeds every method and reference.

    Per module it computes the half-whitened EK-FAC coordinates of the gradient once, sorted
    by decreasing corrected eigenvalue (``W``, ``(B, d_u)``: the first-stage coordinates for
    ``m = d_u``, so every first stage is a prefix of it), the dense gradient (TracIn) and the
    factored projections; every method's per-module coordinates come from these, through its
    family's hooks (:mod:`~eogp_index.evaluation.methods`).

    Streamed families' training coordinates are scored batch by batch against the stored query
    coordinates: run the queries first (:meth:`run` with ``side="query"``), then the training
    documents. PCA and post-projection curvature need all training coordinates, so those are
    kept and scored in :meth:`finish`.
    """

    def __init__(
        self,
        model: nn.Module,
        curvature: Dict[str, ModuleCurvature],
        configs: Sequence[MethodConfig],
        *,
        damping_ratio: float = 0.1,
        kfac_eigenvalues: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = None,
        references: bool = True,
        tier_codes: Sequence[str] = TIER_CODES,
        tier_k: Sequence[int] = (1, 2, 4),
        tier_k_max: int = 4096,
    ):
        self.model = model
        self.tier_codes, self.tier_multiples, self.tier_k_max = tuple(tier_codes), tuple(tier_k), int(tier_k_max)
        #: Per 1-bit PCA config id, ``{"<code>@<multiple>": (nq, n)}``: the scores of its rescoring
        #: tiers (:meth:`tier_widths`).
        self.tier_scores: Dict[str, Dict[str, np.ndarray]] = {}
        #: Per 1-bit PCA config id, ``{"<code>@<multiple>|tier" or "|one_bit": (h, n')}``: the fit's
        #: held-out documents as the index's recall queries, scoring the training rows by the tier
        #: and by the 1-bit code (each without its own row): what chooses the index's default
        #: rescoring factor (:func:`~eogp_index.evaluation.rescoring.index_factor`).
        self.held_out_scores: Dict[str, Dict[str, np.ndarray]] = {}
        self.names = list(curvature)
        self.curvature = curvature
        self.configs = list(configs)
        self.damping_ratio = damping_ratio
        self.references = references
        self._side = "query"
        self._kfac_values = kfac_eigenvalues
        self.first = {n: first_stage_from_curvature(c, c.num_params, damping_ratio) for n, c in curvature.items()}
        self.damping = {n: c.damping(damping_ratio) for n, c in curvature.items()}
        # K-FAC: same eigenbasis, eigenvalues λ_S[o]·λ_A[i], kronfluence's heuristic damping.
        self.kfac_ratio: Dict[str, torch.Tensor] = {}
        if references and kfac_eigenvalues is not None:
            for n, c in curvature.items():
                eva, evg = kfac_eigenvalues[n]
                lam = torch.outer(evg.double(), eva.double()).reshape(-1)
                order = torch.sort(c.eigenvalues.reshape(-1), descending=True, stable=True).indices
                lam = lam[order]
                kfac_whiten = (lam + damping_ratio * lam.mean()).rsqrt()
                self.kfac_ratio[n] = (kfac_whiten / self.first[n].whiten.double()).float()
        self.notes: List[str] = []
        # Widest first-stage prefix the PCA methods need, per module.
        self.pca_width = {n: 0 for n in self.names}
        for cfg in self.configs:
            if cfg.spec.uses_pca:
                for n, m in zip(self.names, cfg.m):
                    self.pca_width[n] = max(self.pca_width[n], m)
        self._build_projectors()
        self._build_factor_banks()
        self.query_parts: Dict[str, Dict[str, List[torch.Tensor]]] = {}
        self.train_parts: Dict[str, Dict[str, List[torch.Tensor]]] = {}
        self.fit_parts: Dict[str, List[torch.Tensor]] = {n: [] for n in self.names}
        self._bases: Dict[Tuple[str, int], torch.Tensor] = {}
        #: The ``auto`` family's state (:class:`~eogp_index.evaluation.methods.Auto`): its held-out
        #: fits per ``(module, m)``; per config id and module, the held-out measurement and both
        #: codes' share ``(nq, n)`` of the scores.
        self.held_out_bases: Dict[Tuple[str, int], Optional[torch.Tensor]] = {}
        self.choices: Dict[str, Dict[str, CodeChoice]] = {}
        self.module_scores: Dict[str, Dict[str, Dict[str, np.ndarray]]] = {}
        self.query: Dict[str, np.ndarray] = {}
        self.skipped: List[Dict[str, Any]] = []
        self.stream_scores: Dict[str, List[np.ndarray]] = {}
        self._streamed: Dict[str, np.ndarray] = {}

    # -- setup ------------------------------------------------------------------------------
    def _build_projectors(self) -> None:
        self.projectors: Dict[Tuple[str, int, str], Any] = {}
        for cfg in self.configs:
            for s in cfg.seeds:
                for u, n in enumerate(self.names):
                    # Independent draws per (family, seed, module): LoGra (random) and the
                    # Gaussian control must not share factors.
                    module_seed = 1_000_003 * s + 7919 * u + 104_729 * cfg.spec.seed_index + 17
                    projector = cfg.spec.projector(self, cfg, u, n, module_seed)
                    if projector is not None:
                        self.projectors[(cfg.id, s, n)] = projector

    def _build_factor_banks(self) -> None:
        """Concatenate every factored projector's factors of a module, so that one matmul per side
        projects ``a`` and ``g`` for all of them (the per-config products are then tiny)."""
        self.banks: Dict[str, Tuple[torch.Tensor, torch.Tensor, Dict[str, slice]]] = {}
        for n in self.names:
            p_a, p_g, slices, start = [], [], {}, 0
            for cfg in self.configs:
                if not cfg.spec.factored:
                    continue
                for s in cfg.seeds:
                    proj = self.projectors[(cfg.id, s, n)]
                    p_a.append(proj.P_a.float())
                    p_g.append(proj.P_g.float())
                    slices[f"{cfg.id}#{s}"] = slice(start, start + proj.rank)
                    start += proj.rank
            if p_a:
                self.banks[n] = (torch.cat(p_a, 1), torch.cat(p_g, 1), slices)

    def kfac_eigenvalues(self, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """kronfluence's K-FAC eigenvalues of module ``name``: ``(activation (d_in,), gradient (d_out,))``."""
        if self._kfac_values is None:
            raise ConfigError(
                "logra-pca needs the K-FAC eigenvalues: pass SharedPass(kfac_eigenvalues=...) "
                "(compute_scores reads them from kronfluence's factors)"
            )
        return self._kfac_values[name]

    def precondition(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """Full-space damped EK-FAC inverse ``Q_S [(Q_S^T G Q_A) / (Λ + λ)] Q_A^T``, ``(B, d_out, d_in)``."""
        c = self.curvature[name]
        q_a, q_s = c.activation_eigenvectors.to(dense), c.gradient_eigenvectors.to(dense)
        rotated = q_s.T @ dense @ q_a
        rotated = rotated / (c.eigenvalues.to(dense) + self.damping[name])
        return q_s @ rotated @ q_a.T

    # -- the transform ----------------------------------------------------------------------
    def transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``(a (B, T, d_in), g (B, T, d_out))`` → ``{key: (B, k_u) coordinates}`` of one module."""
        side = self._side
        w = self.first[name].first_stage(a, g)  # (B, d): half-whitened EK-FAC coords, sorted
        out: Dict[str, torch.Tensor] = {}
        if side == "fit":
            # A copy, not a view: the passes keep these, and a view would keep all d_u columns of w.
            out["pca"] = w[:, : self.pca_width[name]].clone()
            return out
        if self.references:
            out["ref:ekfac"] = w
            if name in self.kfac_ratio:
                out["ref:kfac"] = w * self.kfac_ratio[name]
            out["ref:tracin"] = torch.einsum("bto,bti->boi", g, a).reshape(a.shape[0], -1)
        if self.pca_width[name]:
            out["pca"] = w[:, : self.pca_width[name]].clone()
        u = self.names.index(name)
        factored: Dict[str, torch.Tensor] = {}
        if name in self.banks:
            p_a, p_g, slices = self.banks[name]
            pa, pg = a @ p_a.to(a), g @ p_g.to(g)  # (B, T, Σ rank): every factor at once
            blocks = torch.bmm(pg.transpose(1, 2), pa)  # (B, Σ rank, Σ rank); config j is block (j, j)
            for key, sl in slices.items():
                factored[key] = blocks[:, sl, sl].reshape(a.shape[0], -1)
        batch = ModuleBatch(self, name, side, a, g, w, factored)
        for cfg in self.configs:
            for s in cfg.seeds:
                key = f"{cfg.id}#{s}"
                coordinates = cfg.spec.coordinates(cfg, u, batch, self.projectors.get((cfg.id, s, name)), key)
                if coordinates is not None:
                    out[key] = coordinates
        return out

    # -- passes -----------------------------------------------------------------------------
    def run(
        self,
        docs: Documents,
        side: str,
        *,
        batch_size: int = 8,
        pad_token_id: int = 0,
        device: str = "cpu",
        progress: bool = False,
    ) -> None:
        """One gradient pass: ``side`` is ``"query"`` (first), ``"train"`` or ``"fit"`` (PCA only)."""
        if side not in ("query", "train", "fit"):
            raise ConfigError(f"side must be 'query', 'train' or 'fit', got {side!r}")
        if side == "train" and not self.query:
            raise ConfigError("run the query pass before the training pass")
        self._side = side
        capture = GradientCapture(self.model, self.names, self.transform)
        pairs = docs.pairs()
        batches = range(0, len(pairs), batch_size)
        if progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc=f"{side} gradients", unit="batch")
        parts: Dict[str, Dict[str, List[torch.Tensor]]] = {}
        for start in batches:
            batch = collate(pairs[start : start + batch_size], pad_token_id)
            outputs, _ = capture.run({k: v.to(device) for k, v in batch.items()})
            if side == "fit":
                for n in self.names:
                    self.fit_parts[n].append(outputs[n]["pca"].cpu())
                continue
            if side == "query":
                for n in self.names:
                    for key, value in outputs[n].items():
                        parts.setdefault(key, {}).setdefault(n, []).append(value.detach().cpu())
                continue
            self._score_batch(outputs)
        if side == "query":
            self.query_parts = parts
            self.query = {
                key: np.concatenate([_stack(per[n]) for n in self.names if n in per], axis=1)
                for key, per in parts.items()
            }

    def _streamed_as(self, key: str) -> Optional[Tuple[str, Sequence[int]]]:
        """(precision, k) of a key scored batch by batch; None for keys kept for later."""
        if key.startswith("ref:"):
            return "fp32", ()
        if key == "pca":
            return None
        cfg = self._config(key)
        if cfg.spec.streamed:
            return cfg.precision, cfg.k
        return None

    def _config(self, key: str) -> MethodConfig:
        ident = key.split("#", 1)[0]
        for cfg in self.configs:
            if cfg.id == ident:
                return cfg
        raise KeyError(key)

    def _score_batch(self, outputs: Dict[str, Dict[str, torch.Tensor]]) -> None:
        keys = outputs[self.names[0]].keys()
        for key in keys:
            streamed = self._streamed_as(key)
            if streamed is None:
                for n in self.names:
                    if key in outputs[n]:
                        self.train_parts.setdefault(key, {}).setdefault(n, []).append(outputs[n][key].detach().cpu())
                continue
            x = np.concatenate(
                [outputs[n][key].detach().cpu().numpy() for n in self.names if key in outputs[n]], axis=1
            )
            precision, k = streamed
            y = self.query[key].astype(np.float64)
            stored = stored_coordinates(x, precision, k).astype(np.float64)
            self.stream_scores.setdefault(key, []).append(y @ stored.T)
            if precision == "1bit":
                unq = stored_coordinates(x, "fp16", k).astype(np.float64)
                self.stream_scores.setdefault(key + "|fp16", []).append(y @ unq.T)

    # -- post-hoc fitting -------------------------------------------------------------------
    def finish(self) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray], Dict[str, np.ndarray]]:
        """Scores of every config and reference.

        Returns ``(scores, unquantized, references)``: ``scores[config.id]`` is
        ``(n_seeds, n_queries, n_train)`` float64 (what the stored representation gives);
        ``unquantized[config.id]`` the same coordinates stored in FP16 (1-bit configs only,
        for Table 2); ``references`` maps ``"ekfac"``, ``"kfac"``, ``"tracin"`` to
        ``(n_queries, n_train)``.
        """
        self._streamed = {key: np.concatenate(parts, axis=1) for key, parts in self.stream_scores.items()}
        references = {key[4:]: value for key, value in self._streamed.items() if key.startswith("ref:")}
        scores: Dict[str, np.ndarray] = {}
        unquantized: Dict[str, np.ndarray] = {}
        kept = []
        for cfg in self.configs:
            per_seed, per_seed_unq = [], []
            try:
                for s in cfg.seeds:
                    s1, s2 = cfg.spec.score(self, cfg, f"{cfg.id}#{s}")
                    per_seed.append(s1)
                    if s2 is not None:
                        per_seed_unq.append(s2)
            except ConfigError as exc:  # e.g. a PCA fitting set of too low rank
                self.skipped.append({"method": cfg.method, "budget": cfg.budget, "reason": str(exc)})
                continue
            kept.append(cfg)
            scores[cfg.id] = np.stack(per_seed)
            if per_seed_unq:
                unquantized[cfg.id] = np.stack(per_seed_unq)
        self.configs = kept
        return scores, unquantized, references

    def kept_tier_scores(self) -> Dict[str, np.ndarray]:
        """``{"<config id>|<code>@<multiple>": (nq, n)}`` of the configs :meth:`finish` kept."""
        return {f"{c.id}|{key}": v for c in self.configs for key, v in self.tier_scores.get(c.id, {}).items()}

    def kept_held_out_scores(self) -> Dict[str, np.ndarray]:
        """``{"<config id>|<code>@<multiple>|tier" or "|one_bit": (h, n')}`` of the kept configs
        (:attr:`held_out_scores`)."""
        return {f"{c.id}|{key}": v for c in self.configs for key, v in self.held_out_scores.get(c.id, {}).items()}

    def streamed_scores(self, key: str) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """A streamed config's scores and, for 1 bit, its FP16 scores at the same ``k``."""
        return self._streamed[key], self._streamed.get(key + "|fp16")

    def fit_coordinates(self, name: str) -> torch.Tensor:
        """``(n_fit, pca_width)`` first-stage coordinates of the PCA fitting documents of module ``name``."""
        if self.fit_parts[name]:
            return torch.cat(self.fit_parts[name], dim=0)
        return torch.cat(self.train_parts["pca"][name], dim=0)

    def pca_basis(self, name: str, m: int, k: int) -> torch.Tensor:
        """Module ``name``'s top-``k`` PCA directions of its first ``m`` first-stage coordinates,
        ``(m, k)``, shared by every method that uses them (EOGP, EOGP-rot, FP16 at the same k).

        PCA directions are nested (the top ``k`` of a fit at a larger ``k`` are the fit at
        ``k``, completion axes included, as they come in EK-FAC order), so each ``(module, m)``
        is fitted once, at the largest ``k`` any config asks of it, and sliced: one ``n × n``
        eigendecomposition per module instead of one per budget.
        """
        key = (name, m)
        if key not in self._bases:
            # Configs come budget by budget with the same m: a basis of another m is not asked for again.
            self._bases = {other: basis for other, basis in self._bases.items() if other[0] != name}
            u = self.names.index(name)
            k_max = max(self.pca_k(c, u) for c in self.configs if c.spec.uses_pca and c.m[u] == m)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._bases[key] = fit_pca(self.fit_coordinates(name)[:, :m], max(k, k_max))
            for w in caught:
                self.notes.append(f"PCA of {name} at m={m}, fitted at k={max(k, k_max)} for every k: {w.message}")
        return self._bases[key][:, :k]

    def one_bit_share(self, query_first: torch.Tensor, train_first: torch.Tensor, basis: torch.Tensor) -> np.ndarray:
        """One module's share ``(nq, n)`` of the 1-bit scores with ``P = basis`` ``(m, k)``."""
        x = (train_first.double() @ basis.double()).float().numpy()
        y = (query_first.double() @ basis.double()).numpy()
        return y @ stored_coordinates(x, "1bit", (basis.shape[1],)).astype(np.float64).T

    def tier_widths(self, cfg: MethodConfig) -> Dict[int, Tuple[int, ...]]:
        """``{multiple: k_tier per module}`` of the rescoring tiers of a 1-bit PCA config (empty
        for any other): ``k_tier = multiple · k``, kept when every module's is at most its ``m``
        and ``tier_k_max`` (multiple 1 always)."""
        if not (cfg.spec.uses_pca and cfg.precision == "1bit" and self.tier_codes):
            return {}
        out = {}
        for multiple in self.tier_multiples:
            ks = tuple(multiple * k for k in cfg.k)
            if multiple == 1 or all(kt <= min(m, self.tier_k_max) for kt, m in zip(ks, cfg.m)):
                out[multiple] = ks
        return out

    def pca_k(self, cfg: MethodConfig, u: int) -> int:
        """The PCA directions config ``cfg`` needs of module ``u``: its ``k``, or its widest tier's."""
        return max([cfg.k[u]] + [ks[u] for ks in self.tier_widths(cfg).values()])

    def score_pca(self, cfg: MethodConfig) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Scores of a PCA family's config: each module's ``P`` is its family's
        :meth:`~eogp_index.evaluation.methods.MethodFamily.directions` of the shared PCA basis.

        A 1-bit config also scores its rescoring tiers (:meth:`tier_widths`, kept in
        :attr:`tier_scores`): each module's tier holds the 1-bit code's ``k`` coordinates (rotated
        as its ``P`` rotates them), then the next ``k_tier - k`` PCA coordinates.
        """
        xs, ys, extra, held = [], [], [], []
        rows = self._recall_queries(cfg) if self.tier_widths(cfg) else None
        for u, n in enumerate(self.names):
            m, k = cfg.m[u], cfg.k[u]
            train_first = torch.cat(self.train_parts["pca"][n], dim=0)[:, :m]
            query_first = torch.cat(self.query_parts["pca"][n], dim=0)[:, :m]
            basis = cfg.spec.directions(self, cfg, n, self.pca_basis(n, m, k), query_first, train_first)  # (m, k)
            xs.append((train_first.double() @ basis.double()).float().numpy())
            ys.append((query_first.double() @ basis.double()).numpy())
            held_first = self.fit_coordinates(n)[rows, :m].double() if rows is not None else None
            held.append(None if held_first is None else (held_first @ basis.double()).numpy())
            wider = self.pca_k(cfg, u)
            if wider > k:  # PCA directions are nested: the tier's further ones follow the first k
                more = self.pca_basis(n, m, wider)[:, k:].double()
                extra.append(((train_first.double() @ more).float().numpy(), (query_first.double() @ more).numpy()))
                if held_first is not None:
                    held[-1] = np.concatenate([held[-1], (held_first @ more).numpy()], axis=1)
            else:
                extra.append(None)
        if self.tier_widths(cfg):
            self._score_tiers(cfg, xs, ys, extra)
            if rows is not None and rows.numel():
                self._score_held_out(cfg, xs, extra, held, rows)
        x, y = np.concatenate(xs, axis=1), np.concatenate(ys, axis=1)
        stored = stored_coordinates(x, cfg.precision, cfg.k).astype(np.float64)
        unq = stored_coordinates(x, "fp16", cfg.k).astype(np.float64) if cfg.precision == "1bit" else None
        return y @ stored.T, (y @ unq.T if unq is not None else None)

    def _score_tiers(
        self,
        cfg: MethodConfig,
        xs: List[np.ndarray],
        ys: List[np.ndarray],
        extra: List[Optional[Tuple[np.ndarray, np.ndarray]]],
    ) -> None:
        """The scores ``(nq, n)`` of each tier code and multiple of a 1-bit config, stored as
        :class:`~eogp_index.store.codecs.TierCodec` stores them (a scale per module for int8/int4)
        and scored in float64 against the queries' unquantized coordinates."""
        widths = self.tier_widths(cfg)
        left_out = [multiple for multiple in self.tier_multiples if multiple not in widths]
        if left_out:
            self.notes.append(
                f"{cfg.id}: tier k multiple(s) {left_out} left out: above m_u or --tier-k-max ({self.tier_k_max})"
            )
        for multiple, ks in widths.items():
            parts_x, parts_y = [], []
            for x, y, more, kt in zip(xs, ys, extra, ks):
                grow = kt - x.shape[1]
                parts_x.append(np.concatenate([x, more[0][:, :grow]], axis=1) if grow else x)
                parts_y.append(np.concatenate([y, more[1][:, :grow]], axis=1) if grow else y)
            x_t, y_t = np.concatenate(parts_x, axis=1), np.concatenate(parts_y, axis=1)
            for code in self.tier_codes:
                codec = TierCodec(code, SignLayout(ks))
                stored = codec.decode(codec.encode(x_t)).astype(np.float64)
                self.tier_scores.setdefault(cfg.id, {})[f"{code}@{multiple}"] = y_t @ stored.T

    def _recall_queries(self, cfg: MethodConfig) -> torch.Tensor:
        """The rows of the PCA fitting set an index fitted on it would keep as its recall queries
        (:func:`~eogp_index.fit.code_choice.held_out_rows` at the fit's default fraction, the
        first :data:`~eogp_index.fit.recall.RECALL_QUERIES`), ``(h,)`` int64."""
        from eogp_index.config import HELD_OUT_FRACTION
        from eogp_index.fit.code_choice import held_out_rows
        from eogp_index.fit.recall import RECALL_QUERIES

        n_fit = int(self.fit_coordinates(self.names[0]).shape[0])
        return held_out_rows(n_fit, HELD_OUT_FRACTION, cfg.seeds[0])[:RECALL_QUERIES]

    def _score_held_out(
        self,
        cfg: MethodConfig,
        xs: List[np.ndarray],
        extra: List[Optional[Tuple[np.ndarray, np.ndarray]]],
        held: List[np.ndarray],
        rows: torch.Tensor,
    ) -> None:
        """The recall queries' scores of the training rows by each tier and by the 1-bit code,
        as the index measures them on its table (:mod:`eogp_index.store.table_recall`): each
        query's coordinates ``(h, k_tier)`` unquantized, the rows as stored; a query's own row (the
        PCA fitted on the training documents themselves) left out, ``(h, n - 1)``."""
        one_bit_rows = stored_coordinates(np.concatenate(xs, axis=1), "1bit", cfg.k).astype(np.float64)
        y_bit = np.concatenate([h[:, : x.shape[1]] for h, x in zip(held, xs)], axis=1)
        own = None if any(self.fit_parts[n] for n in self.names) else rows.numpy()
        out = self.held_out_scores.setdefault(cfg.id, {})
        for multiple, ks in self.tier_widths(cfg).items():
            parts = []
            for x, more, kt in zip(xs, extra, ks):
                grow = kt - x.shape[1]
                parts.append(np.concatenate([x, more[0][:, :grow]], axis=1) if grow else x)
            y_t = np.concatenate([h[:, :kt] for h, kt in zip(held, ks)], axis=1)
            for code in self.tier_codes:
                codec = TierCodec(code, SignLayout(ks))
                stored = codec.decode(codec.encode(np.concatenate(parts, axis=1))).astype(np.float64)
                for name, scores in (("tier", y_t @ stored.T), ("one_bit", y_bit @ one_bit_rows.T)):
                    out[f"{code}@{multiple}|{name}"] = _without_own(scores, own)

    def score_projected_curvature(self, cfg: MethodConfig, key: str) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Scores ``q^T H^{-1} t`` with ``H`` fitted on the projected training coordinates (LoGra, GraSS)."""
        xs, ys = [], []
        for n in self.names:
            train = torch.cat(self.train_parts[key][n], dim=0)
            query = torch.cat(self.query_parts[key][n], dim=0)
            curvature = ProjectedCurvature.fit(train, damping_ratio=self.damping_ratio)
            xs.append(train.float().numpy())
            ys.append(curvature.precondition(query.double()).numpy())
        x, y = np.concatenate(xs, axis=1), np.concatenate(ys, axis=1)
        stored = stored_coordinates(x, cfg.precision, cfg.k).astype(np.float64)
        unq = stored_coordinates(x, "fp16", cfg.k).astype(np.float64) if cfg.precision == "1bit" else None
        return y @ stored.T, (y @ unq.T if unq is not None else None)


def _without_own(scores: np.ndarray, own: Optional[np.ndarray]) -> np.ndarray:
    """``(h, n)`` scores → ``(h, n - 1)`` without each query's own column ``own[i]`` (None: as they are)."""
    if own is None:
        return scores
    keep = np.ones(scores.shape, dtype=bool)
    keep[np.arange(scores.shape[0]), own] = False
    return scores[keep].reshape(scores.shape[0], scores.shape[1] - 1)


# --------------------------------------------------------------------------- kronfluence


class _PairDataset(torch.utils.data.Dataset):
    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int):
        return self.pairs[index]


def kronfluence_scores(
    model: nn.Module,
    modules: Sequence[str],
    curvature_dir: Path,
    queries: Documents,
    train: Documents,
    *,
    pad_token_id: int = 0,
    query_batch_size: int = 64,
    train_batch_size: int = 8,
    progress: bool = False,
) -> np.ndarray:
    """kronfluence's own uncompressed EK-FAC pairwise scores ``(n_queries, n_train)`` float64.

    Uses the factors :func:`eogp_index.fit.curvature.fit_curvature` wrote under ``curvature_dir``
    and ``damping_factor=None`` (kronfluence's heuristic ``0.1 · mean(Λ)``, the paper's
    damping). The model is wrapped for the computation and unwrapped afterwards.
    """
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    from eogp_index.fit.curvature import ANALYSIS_NAME, FACTORS_NAME, _unwrap_tracked_modules
    from eogp_index.fit.task import LanguageModelingTask

    task = LanguageModelingTask(modules=list(modules))
    prepared = prepare_model(model, task)
    try:
        analyzer = Analyzer(
            analysis_name=ANALYSIS_NAME,
            model=prepared,
            task=task,
            cpu=True,
            disable_tqdm=not progress,
            output_dir=str(curvature_dir),
            log_level=logging.WARNING,
        )
        analyzer.compute_pairwise_scores(
            scores_name="eval_reference",
            factors_name=FACTORS_NAME,
            query_dataset=_PairDataset(queries.pairs()),
            train_dataset=_PairDataset(train.pairs()),
            per_device_query_batch_size=min(query_batch_size, len(queries)),
            per_device_train_batch_size=train_batch_size,
            dataloader_kwargs=DataLoaderKwargs(collate_fn=lambda b: collate(b, pad_token_id)),
            score_args=ScoreArguments(damping_factor=None),
            overwrite_output_dir=True,
        )
        return analyzer.load_pairwise_scores("eval_reference")["all_modules"].double().numpy()
    finally:
        _unwrap_tracked_modules(model)


def load_kfac_eigenvalues(curvature_dir: Path, modules: Sequence[str]) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """kronfluence's K-FAC eigenvalues ``{module: (activation (d_in,), gradient (d_out,))}``."""
    from safetensors.torch import load_file

    folder = factors_dir(curvature_dir)
    act = load_file(str(folder / "activation_eigenvalues.safetensors"))
    grad = load_file(str(folder / "gradient_eigenvalues.safetensors"))
    return {n: (act[n].double(), grad[n].double()) for n in modules}


# --------------------------------------------------------------------------- the whole computation


@dataclass
class ScoreSet:
    """Every score matrix of one evaluation, ``(n_queries, n_train)`` per method and seed.

    ``reference`` is kronfluence's EK-FAC; ``references`` holds ``"ekfac"`` (index-side full
    width), ``"kfac"`` and ``"tracin"``; ``scores[config.id]`` is ``(n_seeds, nq, n)``;
    ``unquantized[config.id]`` the FP16 scores at the same ``k`` of a 1-bit config;
    ``tiers["<config.id>|<code>@<multiple>"]`` ``(nq, n)`` the scores of a 1-bit PCA config's
    rescoring tier ``code`` at ``k_tier = multiple · k`` (:meth:`SharedPass.tier_widths`);
    ``held_out["<config.id>|<code>@<multiple>|tier"]`` (and ``|one_bit``) ``(h, n - 1)`` the
    index's recall queries' scores of the training rows (:meth:`held_out_scores`).
    """

    train_ids: Tuple[str, ...]
    query_ids: Tuple[str, ...]
    modules: Tuple[ModuleShape, ...]
    configs: List[MethodConfig]
    skipped: List[Dict[str, Any]]
    reference: np.ndarray
    references: Dict[str, np.ndarray]
    scores: Dict[str, np.ndarray]
    unquantized: Dict[str, np.ndarray]
    timings: Dict[str, float] = field(default_factory=dict)
    key: str = ""
    notes: List[str] = field(default_factory=list)
    choices: List[Dict[str, Any]] = field(default_factory=list)
    tiers: Dict[str, np.ndarray] = field(default_factory=dict)
    held_out: Dict[str, np.ndarray] = field(default_factory=dict)

    def held_out_scores(self, cfg: MethodConfig, code: str, multiple: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The index's recall queries' ``(tier, one_bit)`` ``(h, n')`` scores of the training rows
        for ``cfg``'s tier ``code`` at ``multiple`` (:meth:`SharedPass._score_held_out`), or None
        (not measured: no held-out documents, or a cache written before them)."""
        key = f"{cfg.id}|{code}@{multiple}|"
        if key + "tier" not in self.held_out:
            return None
        return self.held_out[key + "tier"], self.held_out[key + "one_bit"]

    def tier_keys(self, cfg: MethodConfig) -> List[Tuple[str, int]]:
        """``[(code, multiple)]`` of the tiers scored for ``cfg``, in :data:`TIER_CODES` order, then
        multiples ascending."""
        prefix = cfg.id + "|"
        keys = [key[len(prefix) :].split("@") for key in self.tiers if key.startswith(prefix)]
        rank = {code: i for i, code in enumerate(TIER_CODES)}
        return sorted(((code, int(multiple)) for code, multiple in keys), key=lambda item: (rank[item[0]], item[1]))

    def tier(self, cfg: MethodConfig, code: str, multiple: int) -> np.ndarray:
        """The ``(nq, n)`` scores of ``cfg``'s tier ``code`` at ``multiple`` times its ``k``."""
        return self.tiers[f"{cfg.id}|{code}@{multiple}"]

    def config(self, method: str, budget: int) -> Optional[MethodConfig]:
        for cfg in self.configs:
            if cfg.method == method and cfg.budget == budget:
                return cfg
        return None

    def reference_error(self) -> float:
        """Relative Frobenius error of the index-side full-width EK-FAC against kronfluence."""
        ours = self.references.get("ekfac")
        if ours is None:
            return float("nan")
        return float(np.linalg.norm(ours - self.reference) / max(np.linalg.norm(self.reference), 1e-300))

    # -- cache ------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        arrays = {"reference": self.reference}
        arrays.update({f"ref/{k}": v for k, v in self.references.items()})
        arrays.update({f"scores/{k}": v for k, v in self.scores.items()})
        arrays.update({f"unquantized/{k}": v for k, v in self.unquantized.items()})
        arrays.update({f"tier/{k}": v for k, v in self.tiers.items()})
        arrays.update({f"heldout/{k}": v for k, v in self.held_out.items()})
        meta = {
            "train_ids": list(self.train_ids),
            "query_ids": list(self.query_ids),
            "modules": [asdict(m) for m in self.modules],
            "configs": [asdict(c) for c in self.configs],
            "skipped": self.skipped,
            "timings": self.timings,
            "key": self.key,
            "notes": self.notes,
            "choices": self.choices,
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "ScoreSet":
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            get = lambda prefix: {k[len(prefix) :]: data[k] for k in data.files if k.startswith(prefix)}  # noqa: E731
            configs = [
                MethodConfig(
                    **{
                        **c,
                        "k": tuple(c["k"]),
                        "m": tuple(c["m"]) if c["m"] else None,
                        "rank": tuple(c["rank"]) if c["rank"] else None,
                        "seeds": tuple(c["seeds"]),
                    }
                )
                for c in meta["configs"]
            ]
            return cls(
                train_ids=tuple(meta["train_ids"]),
                query_ids=tuple(meta["query_ids"]),
                modules=tuple(ModuleShape(**m) for m in meta["modules"]),
                configs=configs,
                skipped=meta["skipped"],
                reference=data["reference"],
                references=get("ref/"),
                scores=get("scores/"),
                unquantized=get("unquantized/"),
                timings=meta["timings"],
                key=meta["key"],
                notes=meta.get("notes", []),
                choices=meta.get("choices", []),
                tiers=get("tier/"),
                held_out=get("heldout/"),
            )


def compute_scores(
    model: nn.Module,
    train: Documents,
    queries: Documents,
    work_dir: Path,
    *,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    methods: Sequence[str] = DEFAULT_METHODS,
    modules: Optional[Sequence[str]] = None,
    damping_ratio: float = 0.1,
    m: Optional[int] = None,
    gaussian_seeds: int = 3,
    seed: int = 0,
    batch_size: int = 8,
    curvature_batch_size: int = 8,
    pca_docs: Optional[Documents] = None,
    pad_token_id: int = 0,
    progress: bool = False,
    log: Optional[Callable[[str], None]] = None,
    tier_codes: Sequence[str] = TIER_CODES,
    tier_k: Sequence[int] = (1, 2, 4),
    tier_k_max: int = 4096,
) -> ScoreSet:
    """Fit EK-FAC once on ``train`` and score every method, budget and reference.

    Args:
        model: the attributed model (``Conv1D`` layers are replaced in place).
        train: candidate training documents (EK-FAC and, unless ``pca_docs``, PCA are fitted
            on all of them); queries: the query documents.
        work_dir: kronfluence's factors and scores go under ``work_dir/curvature``.
        pca_docs: fit EOGP's PCA on these documents instead of ``train``.
        m: first-stage width of EOGP and EOGP-R (None: the index's default, see :func:`plan_methods`).
        tier_codes, tier_k, tier_k_max: the rescoring tiers of the 1-bit PCA configs
            (:meth:`SharedPass.tier_widths`; no codes: none).
    """
    from eogp_index.config import CurvatureConfig
    from eogp_index.fit.curvature import fit_curvature
    from eogp_index.gradients.model import find_attributed_modules, replace_conv1d

    say = log or (lambda _msg: None)
    timings: Dict[str, float] = {}
    replace_conv1d(model)
    model.to("cpu").eval()
    names = find_attributed_modules(model, modules)
    curvature_dir = Path(work_dir) / "curvature"

    t0 = time.perf_counter()
    curvature = fit_curvature(
        model,
        train.pairs(),
        names,
        curvature_dir,
        config=CurvatureConfig(
            num_examples=len(train), batch_size=curvature_batch_size, damping_ratio=damping_ratio, seed=seed
        ),
        pad_token_id=pad_token_id,
        device="cpu",
        progress=progress,
    )
    timings["ekfac_fit_s"] = time.perf_counter() - t0
    say(f"EK-FAC fitted on {len(train)} documents in {timings['ekfac_fit_s']:.1f}s")
    kfac_values = load_kfac_eigenvalues(curvature_dir, names)
    shapes = tuple(ModuleShape(n, *curvature[n].shape) for n in names)
    configs, skipped = plan_methods(shapes, budgets, methods, m=m, gaussian_seeds=gaussian_seeds, seed=seed)
    num_fit = len(pca_docs) if pca_docs is not None else len(train)
    if any(c.spec.uses_pca and max(c.k) > num_fit for c in configs):
        say(f"PCA fitted on {num_fit} documents: a larger k is completed with leading EK-FAC axes, as the index does")

    t0 = time.perf_counter()
    reference = kronfluence_scores(
        model,
        names,
        curvature_dir,
        queries,
        train,
        pad_token_id=pad_token_id,
        train_batch_size=batch_size,
        progress=progress,
    )
    timings["kronfluence_scores_s"] = time.perf_counter() - t0
    say(f"kronfluence pairwise EK-FAC scores {reference.shape} in {timings['kronfluence_scores_s']:.1f}s")

    t0 = time.perf_counter()
    tiers = dict(tier_codes=tier_codes, tier_k=tier_k, tier_k_max=tier_k_max)
    shared = SharedPass(model, curvature, configs, damping_ratio=damping_ratio, kfac_eigenvalues=kfac_values, **tiers)
    kwargs = dict(batch_size=batch_size, pad_token_id=pad_token_id, progress=progress)
    shared.run(queries, "query", **kwargs)
    shared.run(train, "train", **kwargs)
    if pca_docs is not None:
        shared.run(pca_docs, "fit", **kwargs)
    timings["gradient_passes_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores, unquantized, references = shared.finish()
    timings["fitting_and_scoring_s"] = time.perf_counter() - t0
    say(
        f"shared pass over {len(queries)} queries and {len(train)} documents: "
        f"{timings['gradient_passes_s']:.1f}s gradients, {timings['fitting_and_scoring_s']:.1f}s PCA/curvature fits"
    )
    return ScoreSet(
        train_ids=train.ids,
        query_ids=queries.ids,
        modules=shapes,
        configs=shared.configs,
        skipped=skipped + shared.skipped,
        notes=shared.notes,
        reference=reference,
        references=references,
        scores=scores,
        unquantized=unquantized,
        timings=timings,
        choices=registry.Auto.code_choices(shared, reference),
        tiers=shared.kept_tier_scores(),
        held_out=shared.kept_held_out_scores(),
    )


# --------------------------------------------------------------------------- fidelity metrics


def fidelity_records(
    scoreset: ScoreSet,
    *,
    ndcg_k: int = 20,
    rescore_factors: Sequence[int] = (1, 2, 3, 5, 10, 20),
    rescore: int = 5,
) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Appendix D.2 metrics of every config against kronfluence's EK-FAC, and Table 2.

    Returns ``(records, details)``. Records (for :func:`report.write_report`): per config,
    ``ndcg@20`` and ``spearman`` (query means, averaged over seeds) at the nominal budget,
    and for 1-bit configs ``pearson_1bit_fp16`` (median query-wise Pearson between 1-bit and
    FP16 scores at the same ``k``); for 1-bit PCA configs with tiers, each tier alone and the
    one-bit top ``rescore · ndcg_k`` rescored by it (:func:`rescoring.rescoring_records`).
    ``details`` holds the per-seed values, the references' fidelity (reference lines), the
    index-vs-kronfluence check and ``rescoring`` (:func:`rescoring.rescoring_details` at each of
    ``rescore_factors``).
    """
    from eogp_index.evaluation import rescoring

    ref = scoreset.reference
    ndcg_name = f"ndcg@{ndcg_k}"
    records: List[Dict[str, Any]] = []
    per_config: Dict[str, Any] = {}
    for cfg in scoreset.configs:
        s = scoreset.scores[cfg.id]
        sp = [metrics.mean_spearman(x, ref) for x in s]
        nd = [metrics.mean_ndcg_at_k(x, ref, ndcg_k) for x in s]
        entry = {
            "config": cfg.to_json(),
            "spearman": [v for v, _ in sp],
            "spearman_valid": [n for _, n in sp],
            ndcg_name: nd,
        }
        records.append(_record(cfg, ndcg_name, float(np.mean(nd))))
        records.append(_record(cfg, "spearman", metrics.nanmean([v for v, _ in sp])))
        if cfg.id in scoreset.unquantized:
            pr = [metrics.median_pearson(a, b) for a, b in zip(s, scoreset.unquantized[cfg.id])]
            entry["pearson_1bit_fp16"] = [v for v, _ in pr]
            records.append(_record(cfg, "pearson_1bit_fp16", metrics.nanmean([v for v, _ in pr])))
        per_config[cfg.id] = entry
    lines: Dict[str, Dict[str, float]] = {ndcg_name: {}, "spearman": {}}
    names = {"kfac": f"{REF_KFAC} (uncompressed)", "tracin": f"{REF_TRACIN} (uncompressed)"}
    for key, label in names.items():
        if key in scoreset.references:
            lines[ndcg_name][label] = metrics.mean_ndcg_at_k(scoreset.references[key], ref, ndcg_k)
            lines["spearman"][label] = metrics.mean_spearman(scoreset.references[key], ref)[0]
    details = {
        "per_config": per_config,
        "reference_lines": lines,
        "index_vs_kronfluence_rel_err": scoreset.reference_error(),
        "skipped": scoreset.skipped,
    }
    for family in registry.families():
        details.update(family.fidelity_details(scoreset, ndcg_k))
    if scoreset.tiers:
        factors = sorted(set(rescore_factors) | {rescore})
        details["rescoring"] = rescoring.rescoring_details(scoreset, ndcg_k=ndcg_k, factors=factors)
        details["rescore"] = rescore
        records += rescoring.rescoring_records(details["rescoring"], ndcg_k=ndcg_k, factor=rescore)
    return records, details


def _record(cfg: MethodConfig, metric: str, value: float, ci: Optional[Tuple[float, float]] = None) -> Dict[str, Any]:
    rec = {"method": cfg.label, "bytes_per_example": cfg.budget, "metric": metric, "value": value}
    if ci is not None and all(math.isfinite(v) for v in ci):
        rec["ci_low"], rec["ci_high"] = ci
    return rec
