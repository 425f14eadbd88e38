"""Stage 2: the two-stage projection of Section 3.2 (and Appendix B).

First stage, per module ``u``: the gradient in the Kronecker eigenbasis ``Q_S^T G Q_A``,
restricted to the ``m_u`` coordinates with the largest corrected eigenvalues and half-whitened
by ``(Λ + λ_u)^{-1/2}``. It is computed from the factors ``(a, g)`` as
``(g Q_S)[:, rows]^T (a Q_A)[:, cols]`` over only the rows and columns the kept coordinates
touch: no dense ``d × m`` matrix, no dense per-example gradient when ``m_u < d_u``.

Second stage: ``P^T z`` with ``P`` the top-``k_u`` uncentered principal directions of the
first-stage coordinates of a fitting set (EOGP); an SRHT (EOGP-R); or nothing (the
``ekfac-topk`` ablation, ``k_u = m_u``).

Everything shared across examples and queries is saved in one safetensors file whose SHA-256
identifies the projection in the index manifest.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Literal, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from eogp_index.config import ProjectionConfig, SecondStage, StorageConfig
from eogp_index.fit.curvature import ModuleCurvature
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError

PROJECTION_FORMAT_VERSION = 1


@dataclass
class ModuleProjection:
    """The fitted projection of one module.

    Attributes:
        shape: ``(d_out, d_in')`` of the module's gradient.
        activation_eigenvectors: ``Q_A[:, cols]``, ``(d_in', c)`` float32 — only the columns used.
        gradient_eigenvectors: ``Q_S[:, rows]``, ``(d_out, r)`` float32 — only the columns used.
        local_index: ``(m,)`` int64 positions of the kept coordinates in the ``(r, c)`` block,
            ordered by decreasing corrected eigenvalue.
        whiten: ``(m,)`` float32, ``(Λ_m + λ_u)^{-1/2}``.
        second_stage: ``"pca"`` (``pca`` is ``(m, k)``), ``"srht"`` (``srht_signs`` ``(m,)``,
            ``srht_rows`` ``(k,)``) or ``"none"``.
        damping: ``λ_u``.
    """

    shape: tuple[int, int]
    activation_eigenvectors: torch.Tensor
    gradient_eigenvectors: torch.Tensor
    local_index: torch.Tensor
    whiten: torch.Tensor
    damping: float
    second_stage: SecondStage
    k: int
    pca: Optional[torch.Tensor] = None
    srht_signs: Optional[torch.Tensor] = None
    srht_rows: Optional[torch.Tensor] = None

    @property
    def m(self) -> int:
        return int(self.local_index.numel())

    def first_stage(self, a: torch.Tensor, g: torch.Tensor, *, route: Optional[BlockRoute] = None) -> torch.Tensor:
        """Half-whitened top-``m`` EK-FAC coordinates, ``(B, m)`` float32.

        Args:
            a: ``(B, T, d_in')`` activations; g: ``(B, T, d_out)`` output gradients.
            route: how to form the ``(r, c)`` eigenbasis block (tests force each one); by
                default the one with the fewest multiply-adds, see :func:`block_route`.
        """
        batch = g.shape[0]
        # Only tokens with a nonzero output gradient contribute to G = gᵀa: padding, and text
        # after the last counted label (e.g. a chat's trailing user turn), add exact zeros. The
        # rotations below cost about as much as the module's own forward on small models, so
        # they run over the live tokens only.
        live = g.abs().amax(dim=-1) > 0  # (B, T)
        counts = live.sum(dim=1).tolist()
        tokens = live.reshape(-1).nonzero().squeeze(1)  # index_select is ~5x faster than g[live]
        g_live = g.reshape(-1, g.shape[-1]).index_select(0, tokens)  # (N, d_out)
        a_live = a.reshape(-1, a.shape[-1]).index_select(0, tokens)  # (N, d_in')
        q_s = self.gradient_eigenvectors.to(g.device)  # (d_out, r)
        q_a = self.activation_eigenvectors.to(a.device)  # (d_in', c)
        r, c = q_s.shape[1], q_a.shape[1]
        index = self.local_index.to(a.device)
        if r * c <= 256 * self.m:
            # A fair share of the (r, c) block is kept: form it with matmuls, then gather.
            # Measured on CPU, this wins until the block is a few hundred times larger than m.
            route = route or block_route(g_live.shape[0], batch, q_s.shape[0], r, q_a.shape[0], c)
            kept = _eigenbasis_blocks(route, g_live, a_live, counts, q_s, q_a).reshape(batch, -1)[:, index]
        else:
            # Few coordinates kept: per-example sums over tokens of products of only the needed
            # entries, in chunks of coordinates so that (N, chunk) stays small.
            gs, aa = g_live @ q_s, a_live @ q_a  # (N, r), (N, c): both factors in the eigenbasis
            rows, cols = index // c, index % c
            example = torch.repeat_interleave(torch.arange(batch, device=g.device),
                                              torch.as_tensor(counts, device=g.device))
            chunk = max(1, (1 << 24) // max(1, gs.shape[0]))
            kept = torch.cat([
                gs.new_zeros(batch, min(chunk, self.m - i)).index_add_(
                    0, example, gs[:, rows[i:i + chunk]] * aa[:, cols[i:i + chunk]])
                for i in range(0, self.m, chunk)], dim=1)
        return kept * self.whiten.to(a.device)

    def half_whiten(self, rotated: torch.Tensor) -> torch.Tensor:
        """Select and whiten from a dense eigenbasis gradient ``(B, r, c)`` (reference path)."""
        return rotated.reshape(rotated.shape[0], -1)[:, self.local_index] * self.whiten

    def second(self, z: torch.Tensor) -> torch.Tensor:
        """``(B, m)`` first-stage coordinates → ``(B, k)`` final coordinates."""
        if self.second_stage == "pca":
            return z @ self.pca.to(z.device)
        if self.second_stage == "srht":
            return srht_apply(z, self.srht_signs.to(z.device), self.srht_rows.to(z.device))
        return z

    def project(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``(B, k)`` float32 coordinates of a batch."""
        return self.second(self.first_stage(a, g))


BlockRoute = Literal["factors", "rotate_after_g", "rotate_after_a"]


def block_route(n: int, batch: int, d_out: int, r: int, d_in: int, c: int) -> BlockRoute:
    """The cheapest order of products for the per-example blocks ``Q_S[:, rows]ᵀ g_bᵀ a_b Q_A[:, cols]``.

    ``n`` live tokens in a batch of ``batch`` examples. Multiply-adds of each order:

    * ``factors``: ``(g Q_S)ᵀ (a Q_A)`` per example — ``n·(d_out·r + d_in·c + r·c)``;
    * ``rotate_after_g``: ``Q_Sᵀ (gᵀ (a Q_A))`` — ``n·c·(d_in + d_out) + batch·d_out·r·c``;
    * ``rotate_after_a``: ``((g Q_S)ᵀ a) Q_A`` — ``n·r·(d_out + d_in) + batch·r·d_in·c``.

    The per-token rotation dominates on long documents and small models (where the kept
    coordinates touch most eigenvectors); the per-example one on short documents. The
    per-example orders run many small matmuls, measured ~20% below the throughput of the
    per-token ones on CPU, so they are taken only when they save at least a third.
    """
    factors = n * (d_out * r + d_in * c + r * c)
    after_g = n * c * (d_in + d_out) + batch * d_out * r * c
    after_a = n * r * (d_out + d_in) + batch * r * d_in * c
    if min(after_g, after_a) > factors * 2 / 3:
        return "factors"
    return "rotate_after_g" if after_g <= after_a else "rotate_after_a"


def _eigenbasis_blocks(route: BlockRoute, g: torch.Tensor, a: torch.Tensor, counts: List[int],
                       q_s: torch.Tensor, q_a: torch.Tensor) -> torch.Tensor:
    """Per-example ``Q_S[:, rows]ᵀ G_b Q_A[:, cols]``, ``(B, r, c)``, from live tokens.

    Args:
        g: ``(N, d_out)``; a: ``(N, d_in')``: the live tokens of the batch, example after example,
            ``counts[b]`` of them for example ``b``.
    """
    def per_example(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # (B, x_cols, y_cols)
        return torch.stack([xb.T @ yb for xb, yb in zip(x.split(counts), y.split(counts))])

    if route == "factors":
        return per_example(g @ q_s, a @ q_a)
    if route == "rotate_after_g":
        return q_s.T @ per_example(g, a @ q_a)  # (r, d_out) @ (B, d_out, c)
    if route == "rotate_after_a":
        return per_example(g @ q_s, a) @ q_a  # (B, r, d_in') @ (d_in', c)
    raise ConfigError(f"unknown first-stage route {route!r}; expected one of {BlockRoute.__args__}")


def first_stage_from_curvature(curvature: ModuleCurvature, m: int, damping_ratio: float) -> ModuleProjection:
    """Keep the ``m`` EK-FAC directions with the largest corrected eigenvalues.

    Ties are broken by position (a stable sort) so that the same factors always give the same
    projection.
    """
    d_out, d_in = curvature.shape
    eigenvalues = curvature.eigenvalues.reshape(-1)
    order = torch.sort(eigenvalues, descending=True, stable=True).indices[:m]
    rows_of, cols_of = order // d_in, order % d_in
    rows, row_pos = torch.unique(rows_of, return_inverse=True)
    cols, col_pos = torch.unique(cols_of, return_inverse=True)
    damping = curvature.damping(damping_ratio)
    whiten = (eigenvalues[order].double() + damping).rsqrt().float()
    return ModuleProjection(
        shape=(d_out, d_in),
        activation_eigenvectors=curvature.activation_eigenvectors[:, cols].contiguous(),
        gradient_eigenvectors=curvature.gradient_eigenvectors[:, rows].contiguous(),
        local_index=(row_pos * cols.numel() + col_pos).long(),
        whiten=whiten,
        damping=damping,
        second_stage="none",
        k=m,
    )


def fit_pca(z: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` uncentered principal directions of the rows of ``z``, ``(m, k)`` float32.

    With fewer rows than columns the directions come from the ``n × n`` Gram matrix
    (``Z Z^T = U W U^T`` ⇒ ``P = Z^T U W^{-1/2}``), never an ``m × m`` matrix.

    When the fitting set spans fewer than ``k`` directions, PCA leaves the rest undetermined;
    they are completed with the leading first-stage axes (largest EK-FAC eigenvalues first)
    orthogonalised against the span, and a warning says so.
    """
    z = z.double()
    n, m = z.shape
    if n < m:
        weights, vectors = torch.linalg.eigh(z @ z.T)
        weights, vectors = weights.flip(0)[:k], vectors.flip(1)[:, :k]
        rank = int((weights > weights[0] * 1e-10).sum()) if weights.numel() and weights[0] > 0 else 0
        directions = (z.T @ vectors[:, :rank]) / weights[:rank].sqrt()
    else:
        weights, vectors = torch.linalg.eigh(z.T @ z)
        weights, directions = weights.flip(0)[:k], vectors.flip(1)[:, :k]
        rank = int((weights > weights[0] * 1e-10).sum()) if weights[0] > 0 else 0
        directions = directions[:, :rank]
    if rank < k:
        warnings.warn(
            f"the PCA fitting set spans only {rank} of the k={k} directions asked for; the rest are the "
            "leading EK-FAC axes orthogonal to it. Fit on more examples (num_fit_examples) for a full PCA.",
            stacklevel=2,
        )
        # Pivot on the axes in eigenvalue order: keep each axis that adds a new direction.
        # Orthogonalise against the whole basis twice (one pass loses orthogonality to rounding).
        basis = directions
        for j in range(m):
            if basis.shape[1] == k:
                break
            v = torch.zeros(m, 1, dtype=z.dtype)
            v[j] = 1.0
            for _ in range(2):
                v = v - basis @ (basis.T @ v)
            norm = v.norm()
            if norm > 1e-4:
                basis = torch.cat([basis, v / norm], dim=1)
        directions = basis
    return directions.float().contiguous()


@functools.lru_cache(maxsize=32)
def _hadamard(n: int) -> torch.Tensor:
    """The unnormalised ``n × n`` Walsh–Hadamard matrix (Sylvester order), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform over the last axis (length a power of two).

    ``H_p = H_a ⊗ H_b`` with ``p = a·b``, so for ``x`` viewed as ``(a, b)`` row-major
    ``H_p x = H_a X H_b``: two small matmuls instead of ``log2 p`` butterfly passes
    (``O(p·(a+b))`` work, ``a, b ≈ sqrt(p)``), which is faster on CPU and GPU alike.
    """
    *batch, p = x.shape
    if p & (p - 1):
        raise ConfigError(f"the Walsh-Hadamard transform needs a power-of-two length, got {p}")
    a = 1 << ((p.bit_length() - 1) // 2)
    b = p // a
    y = _hadamard(a).to(x) @ x.reshape(-1, a, b) @ _hadamard(b).to(x)
    return y.reshape(*batch, p)


def srht_apply(z: torch.Tensor, signs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``S z`` with ``S = sqrt(p/k) R H_p D J`` and ``H_p`` orthonormal (Appendix B.2)."""
    m = z.shape[-1]
    p = 1 << max(0, math.ceil(math.log2(m)))
    padded = torch.nn.functional.pad(z * signs, (0, p - m))
    # sqrt(p/k) · (1/sqrt(p)) · H_unnormalised = H_unnormalised / sqrt(k)
    return fwht(padded)[..., rows] / math.sqrt(rows.numel())


def make_srht(m: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random signs ``(m,)`` and ``k`` sorted distinct rows of the padded width."""
    p = 1 << max(0, math.ceil(math.log2(m)))
    if k > p:
        raise ConfigError(f"SRHT cannot output k={k} coordinates from a padded width of {p}; lower k")
    signs = torch.randint(0, 2, (m,), generator=generator).float() * 2 - 1
    rows = torch.randperm(p, generator=generator)[:k].sort().values
    return signs, rows


class Projection:
    """The ordered per-module projections of an index, with their on-disk format."""

    def __init__(self, modules: Dict[str, ModuleProjection], *, config: ProjectionConfig, damping_ratio: float):
        self.modules = modules
        self.config = config
        self.damping_ratio = damping_ratio

    @property
    def names(self) -> List[str]:
        return list(self.modules)

    @property
    def k(self) -> tuple[int, ...]:
        return tuple(p.k for p in self.modules.values())

    @property
    def m(self) -> tuple[int, ...]:
        return tuple(p.m for p in self.modules.values())

    def transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """A :data:`~eogp_index.gradients.Transform` giving the final coordinates."""
        return self.modules[name].project(a, g)

    def first_stage_transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.modules[name].first_stage(a, g)

    # -- on disk -----------------------------------------------------------------------------
    def save(self, path: Path) -> str:
        """Write the projection as safetensors; return the file's SHA-256 (its identity)."""
        tensors: Dict[str, torch.Tensor] = {}
        modules_meta = []
        for name, p in self.modules.items():
            tensors[f"{name}/activation_eigenvectors"] = p.activation_eigenvectors.contiguous()
            tensors[f"{name}/gradient_eigenvectors"] = p.gradient_eigenvectors.contiguous()
            tensors[f"{name}/local_index"] = p.local_index.contiguous()
            tensors[f"{name}/whiten"] = p.whiten.contiguous()
            if p.pca is not None:
                tensors[f"{name}/pca"] = p.pca.contiguous()
            if p.srht_signs is not None:
                tensors[f"{name}/srht_signs"] = p.srht_signs.contiguous()
                tensors[f"{name}/srht_rows"] = p.srht_rows.contiguous()
            modules_meta.append({"name": name, "shape": list(p.shape), "m": p.m, "k": p.k, "damping": p.damping,
                                 "second_stage": p.second_stage})
        metadata = {
            "format": "eogp-projection",
            "format_version": str(PROJECTION_FORMAT_VERSION),
            "variant": self.config.variant,
            "damping_ratio": repr(self.damping_ratio),
            "config": json.dumps(self.config.__dict__),
            "modules": json.dumps(modules_meta),
        }
        save_file(tensors, str(path), metadata=metadata)
        return file_sha256(path)

    @classmethod
    def load(cls, path: Path) -> "Projection":
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise IndexNotFoundError(f"projection file {path} is missing; the index was not fitted (eogp fit)")
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if metadata.get("format") != "eogp-projection":
            raise IncompatibleIndexError(f"{path} is not an eogp projection file")
        version = int(metadata.get("format_version", "0"))
        if version != PROJECTION_FORMAT_VERSION:
            raise IncompatibleIndexError(
                f"{path} has projection format version {version}; this eogp-index reads version "
                f"{PROJECTION_FORMAT_VERSION}. Refit the index with this version."
            )
        tensors = load_file(str(path))
        modules = {}
        for meta in json.loads(metadata["modules"]):
            name = meta["name"]
            modules[name] = ModuleProjection(
                shape=tuple(meta["shape"]),
                activation_eigenvectors=tensors[f"{name}/activation_eigenvectors"],
                gradient_eigenvectors=tensors[f"{name}/gradient_eigenvectors"],
                local_index=tensors[f"{name}/local_index"],
                whiten=tensors[f"{name}/whiten"],
                damping=float(meta["damping"]),
                second_stage=meta["second_stage"],
                k=int(meta["k"]),
                pca=tensors.get(f"{name}/pca"),
                srht_signs=tensors.get(f"{name}/srht_signs"),
                srht_rows=tensors.get(f"{name}/srht_rows"),
            )
        config = ProjectionConfig(**json.loads(metadata["config"]))
        return cls(modules, config=config, damping_ratio=float(metadata["damping_ratio"]))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_projection(
    curvature: Dict[str, ModuleCurvature],
    config: ProjectionConfig,
    storage: StorageConfig,
    *,
    damping_ratio: float = 0.1,
) -> Projection:
    """Choose ``(m_u, k_u)`` per module, build the first stages and draw the SRHTs.

    For EOGP the PCA matrices are fitted afterwards by :func:`fit_second_stage_pca`, from
    first-stage coordinates computed with the stages built here.
    """
    modules = {}
    generator = torch.Generator().manual_seed(config.seed)
    for name, curv in curvature.items():
        m, k = config.dims(curv.num_params, len(curvature), storage.precision)
        proj = first_stage_from_curvature(curv, m, damping_ratio)
        proj.k = k
        proj.second_stage = config.second_stage
        if config.second_stage == "srht":
            proj.srht_signs, proj.srht_rows = make_srht(m, k, generator)
        modules[name] = proj
    return Projection(modules, config=config, damping_ratio=damping_ratio)


def fit_second_stage_pca(projection: Projection, first_stage: Dict[str, Sequence[torch.Tensor]]) -> None:
    """Fit every module's ``P`` from its cached first-stage coordinates (list of ``(B, m)``)."""
    for name, proj in projection.modules.items():
        z = torch.cat([t.cpu() for t in first_stage[name]], dim=0)
        proj.pca = fit_pca(z, proj.k)
