"""Stage 2: the two-stage projection of Section 3.2 (and Appendix B).

First stage, per module ``u``: the gradient in the Kronecker eigenbasis ``Q_S^T G Q_A``,
restricted to the ``m_u`` coordinates with the largest corrected eigenvalues and half-whitened
by ``(Λ + λ_u)^{-1/2}``. It is computed from the factors ``(a, g)`` as
``(g Q_S)[:, rows]^T (a Q_A)[:, cols]`` over only the rows and columns the kept coordinates
touch: no dense ``d × m`` matrix, no dense per-example gradient when ``m_u < d_u``.

Second stage: ``P^T z`` with ``P`` the top-``k_u`` uncentered principal directions of the
first-stage coordinates of a fitting set (EOGP); an SRHT (EOGP-R); or nothing (the
``ekfac-topk`` ablation, ``k_u = m_u``).

Everything shared across examples and queries is saved in one safetensors file (format 2:
``P`` in FP16 by default, as in the paper's Appendix E; format 1, all float32, is still read),
identified in the index manifest by its SHA-256 (checked in full by ``eogp verify``) and by a
cheap sampled fingerprint (checked on every open, :func:`file_fingerprint`).

A loaded projection reads the ``P`` matrices lazily from the memory-mapped file. When they all
fit a memory limit each is read once, on first use, and kept; otherwise every module's ``P`` is
read when its transform runs — in the backward hook, one module after another — and dropped
after, so a batch holds one module's ``P`` at a time (the paper's "modules in turn").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Literal, Optional, Sequence

import torch
from safetensors.torch import save_file

from eogp_index.config import PCA_DTYPE_BYTES, ProjectionConfig, SecondStage, StorageConfig
from eogp_index.fit.curvature import ModuleCurvature
from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError

#: 2: ``P`` stored at ``ProjectionConfig.pca_dtype`` (FP16 by default), recorded in the metadata.
#: 1: everything float32, no ``pca_dtype``. Both are read.
PROJECTION_FORMAT_VERSION = 2
READABLE_PROJECTION_VERSIONS = (1, 2)
PCA_TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
#: Rows of an FP16 ``P`` upcast to float32 at once are capped so that the float32 copy stays
#: under this many bytes: applying a 1 GB FP16 ``P`` never needs a 2 GB float32 one.
_UPCAST_BYTES = 64 << 20


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
        second_stage: ``"pca"`` (``pca`` is ``(m, k)``, float32 or float16), ``"srht"``
            (``srht_signs`` ``(m,)``, ``srht_rows`` ``(k,)``) or ``"none"``.
        damping: ``λ_u``.
        pca_loader: for a projection loaded from disk, reads ``pca`` when it is used (then
            ``pca`` is read through it; see :class:`_LazyPca`).
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
    pca_loader: Optional[Callable[[], torch.Tensor]] = field(default=None, repr=False, compare=False)

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
            return apply_pca(z, self.pca)
        if self.second_stage == "srht":
            return srht_apply(z, self.srht_signs.to(z.device), self.srht_rows.to(z.device))
        return z

    def project(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``(B, k)`` float32 coordinates of a batch."""
        return self.second(self.first_stage(a, g))


def _get_pca(self: ModuleProjection) -> Optional[torch.Tensor]:
    if self._pca is None and self.pca_loader is not None:
        return self.pca_loader()  # kept by the loader or not, as its memory limit says
    return self._pca


def _set_pca(self: ModuleProjection, value: Optional[torch.Tensor]) -> None:
    self._pca = value


# ``pca`` stays a constructor argument and an attribute (fitting sets it, tests read it), but a
# loaded projection reads it through ``pca_loader``: the dataclass's __init__ assigns through this.
ModuleProjection.pca = property(_get_pca, _set_pca)  # type: ignore[assignment]


def apply_pca(z: torch.Tensor, pca: torch.Tensor) -> torch.Tensor:
    """``z @ P`` in float32, ``(B, m) @ (m, k) → (B, k)``, whatever ``P``'s stored dtype.

    An FP16 ``P`` is upcast a block of rows at a time (at most ``_UPCAST_BYTES`` of float32), so
    the products and sums are float32: the only difference from a float32 ``P`` is ``P``'s own
    rounding to FP16.
    """
    pca = pca.to(z.device)
    if pca.dtype == z.dtype:
        return z @ pca
    m, k = pca.shape
    rows = max(1, _UPCAST_BYTES // (4 * max(1, k)))
    if rows >= m:
        return z @ pca.to(z.dtype)
    out = z.new_zeros(z.shape[0], k)
    for i in range(0, m, rows):
        out.addmm_(z[:, i:i + rows], pca[i:i + rows].to(z.dtype))
    return out


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
    """The ordered per-module projections of an index, with their on-disk format.

    Attributes:
        modules: ``{name: ModuleProjection}`` in module order.
        in_turn: for a loaded projection, whether the ``P`` matrices exceed the memory limit and
            are read module by module in every batch (False: each is read once and kept).
    """

    def __init__(self, modules: Dict[str, ModuleProjection], *, config: ProjectionConfig, damping_ratio: float,
                 lazy: Optional["_LazyPca"] = None):
        self.modules = modules
        self.config = config
        self.damping_ratio = damping_ratio
        self._lazy = lazy

    @property
    def names(self) -> List[str]:
        return list(self.modules)

    @property
    def k(self) -> tuple[int, ...]:
        return tuple(p.k for p in self.modules.values())

    @property
    def m(self) -> tuple[int, ...]:
        return tuple(p.m for p in self.modules.values())

    @property
    def in_turn(self) -> bool:
        return self._lazy is not None and not self._lazy.resident

    @property
    def pca_bytes(self) -> int:
        """Bytes of every module's ``P`` at its stored dtype (0 without a PCA stage)."""
        if self._lazy is not None:
            return self._lazy.total_bytes
        return sum(p.m * p.k * PCA_DTYPE_BYTES[self.config.pca_dtype]
                   for p in self.modules.values() if p.second_stage == "pca")

    def transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """A :data:`~eogp_index.gradients.Transform` giving the final coordinates."""
        return self.modules[name].project(a, g)

    def first_stage_transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.modules[name].first_stage(a, g)

    # -- on disk -----------------------------------------------------------------------------
    def save(self, path: Path) -> str:
        """Write the projection as safetensors (format 2, ``P`` at ``config.pca_dtype``); return the
        file's SHA-256 (its identity)."""
        pca_dtype = PCA_TORCH_DTYPES[self.config.pca_dtype]
        tensors: Dict[str, torch.Tensor] = {}
        modules_meta = []
        for name, p in self.modules.items():
            tensors[f"{name}/activation_eigenvectors"] = p.activation_eigenvectors.contiguous()
            tensors[f"{name}/gradient_eigenvectors"] = p.gradient_eigenvectors.contiguous()
            tensors[f"{name}/local_index"] = p.local_index.contiguous()
            tensors[f"{name}/whiten"] = p.whiten.contiguous()
            pca = p.pca
            if pca is not None:
                tensors[f"{name}/pca"] = torch.as_tensor(pca).to(pca_dtype).contiguous()
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
            "pca_dtype": self.config.pca_dtype,
            "config": json.dumps(self.config.__dict__),
            "modules": json.dumps(modules_meta),
        }
        save_file(tensors, str(path), metadata=metadata)
        return file_sha256(path)

    @classmethod
    def load(cls, path: Path, *, memory_limit: Optional[int] = None) -> "Projection":
        """Read a projection file (format 1 or 2); the ``P`` matrices are read lazily.

        Args:
            memory_limit: bytes the ``P`` matrices may hold at once (default
                :func:`default_projection_memory`). Under it each is read once, on first use, and
                kept; over it each is read whenever its module is projected, then dropped.
        """
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise IndexNotFoundError(f"projection file {path} is missing; the index was not fitted (eogp fit)")
        # The handle stays open for the projection's lifetime: P is read from it later. A file
        # replaced on disk meanwhile (a refit) leaves this open file, the one checked, in place.
        handle = safe_open(str(path), framework="pt")
        metadata = handle.metadata() or {}
        if metadata.get("format") != "eogp-projection":
            raise IncompatibleIndexError(f"{path} is not an eogp projection file")
        version = int(metadata.get("format_version", "0"))
        if version not in READABLE_PROJECTION_VERSIONS:
            raise IncompatibleIndexError(
                f"{path} has projection format version {version}; this eogp-index reads versions "
                f"{list(READABLE_PROJECTION_VERSIONS)}. Refit the index with this version (eogp fit --overwrite), "
                "or install the eogp-index that wrote it."
            )
        config_fields = json.loads(metadata["config"])
        # Format 1 stored P in float32 and had no pca_dtype: it is fp32, whatever today's default.
        config_fields.setdefault("pca_dtype", metadata.get("pca_dtype", "fp32"))
        config = ProjectionConfig(**config_fields)
        keys = set(handle.keys())
        pca_keys = {}
        for meta in json.loads(metadata["modules"]):
            key = f"{meta['name']}/pca"
            if key in keys:
                stored = str(handle.get_slice(key).get_dtype())
                if stored != {"fp16": "F16", "fp32": "F32"}[config.pca_dtype]:
                    raise IncompatibleIndexError(f"{path}: {key} is stored as {stored} but the file says pca_dtype "
                                                 f"{config.pca_dtype!r}; the file is damaged. Refit the index.")
                pca_keys[key] = math.prod(handle.get_slice(key).get_shape()) * PCA_DTYPE_BYTES[config.pca_dtype]
        lazy = _LazyPca(handle, pca_keys, default_projection_memory() if memory_limit is None else memory_limit)
        modules = {}
        for meta in json.loads(metadata["modules"]):
            name = meta["name"]
            optional = {key: handle.get_tensor(f"{name}/{key}") if f"{name}/{key}" in keys else None
                        for key in ("srht_signs", "srht_rows")}
            modules[name] = ModuleProjection(
                shape=tuple(meta["shape"]),
                activation_eigenvectors=handle.get_tensor(f"{name}/activation_eigenvectors"),
                gradient_eigenvectors=handle.get_tensor(f"{name}/gradient_eigenvectors"),
                local_index=handle.get_tensor(f"{name}/local_index"),
                whiten=handle.get_tensor(f"{name}/whiten"),
                damping=float(meta["damping"]),
                second_stage=meta["second_stage"],
                k=int(meta["k"]),
                pca_loader=functools.partial(lazy.get, f"{name}/pca") if f"{name}/pca" in keys else None,
                **optional,
            )
        return cls(modules, config=config, damping_ratio=float(metadata["damping_ratio"]), lazy=lazy)


class _LazyPca:
    """The ``P`` matrices of a projection file, read on demand from its open, memory-mapped handle.

    ``resident``: all of them fit ``limit`` bytes, so each is kept after its first read; else
    each read is handed out and dropped by the caller (one module's ``P`` alive at a time).
    """

    def __init__(self, handle, sizes: Dict[str, int], limit: int):
        self._handle = handle
        self.total_bytes = sum(sizes.values())
        self.limit = int(limit)
        self.resident = self.total_bytes <= self.limit
        self._kept: Dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # a server's worker thread and the main thread may both project

    def get(self, key: str) -> torch.Tensor:
        with self._lock:
            tensor = self._kept.get(key)
            if tensor is None:
                tensor = self._handle.get_tensor(key)
                if self.resident:
                    self._kept[key] = tensor
            return tensor


#: Environment variable giving the default memory limit of the P matrices, in GiB.
PROJECTION_MEMORY_ENV = "EOGP_PROJECTION_MEMORY_GB"


def available_memory() -> int:
    """Bytes of memory available to new allocations now (psutil, else /proc/meminfo, else 8 GiB)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        pass
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 8 << 30  # pragma: no cover


def default_projection_memory() -> int:
    """The default memory limit of a loaded projection's ``P`` matrices, in bytes:
    ``$EOGP_PROJECTION_MEMORY_GB`` GiB when set, else half the memory available now (the rest is
    left to the model, its activations and the hot copy of the codes)."""
    value = os.environ.get(PROJECTION_MEMORY_ENV)
    if value:
        try:
            gib = float(value)
        except ValueError as exc:
            raise ConfigError(f"${PROJECTION_MEMORY_ENV}={value!r} is not a number of GiB") from exc
        if gib <= 0:
            raise ConfigError(f"${PROJECTION_MEMORY_ENV} must be positive, got {value!r}")
        return int(gib * (1 << 30))
    return available_memory() // 2


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: A file up to this size is fingerprinted whole (it reads in well under a second).
FINGERPRINT_WHOLE_FILE_BYTES = 64 << 20
#: Otherwise: the safetensors header, this many evenly spaced chunks, and each tensor's ends.
FINGERPRINT_CHUNKS = 1024
FINGERPRINT_CHUNK_BYTES = 4096
FINGERPRINT_TENSOR_END_BYTES = 256
FINGERPRINT_PREFIX = "sample1:"


def file_fingerprint(path: Path) -> str:
    """A cheap identity of a safetensors file, checked on every open instead of its full SHA-256.

    ``sample1:`` + SHA-256 over the file size and either the whole file (up to
    ``FINGERPRINT_WHOLE_FILE_BYTES``) or: the header (every tensor's name, dtype, shape and
    offsets, and the metadata), ``FINGERPRINT_CHUNKS`` chunks of ``FINGERPRINT_CHUNK_BYTES`` evenly
    spaced over the file, and the first and last ``FINGERPRINT_TENSOR_END_BYTES`` of every tensor
    — about 4 MiB read from a 481 GB file. A change of size, layout, metadata or a sampled byte is
    caught; a change confined to unsampled bytes is not (``eogp verify`` hashes every byte).
    """
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}|".encode())
    with open(path, "rb") as handle:
        if size <= FINGERPRINT_WHOLE_FILE_BYTES:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
            return FINGERPRINT_PREFIX + digest.hexdigest()
        raw = handle.read(8)
        header_len = min(struct.unpack("<Q", raw)[0], size - 8) if len(raw) == 8 else 0
        header = handle.read(header_len)
        digest.update(raw + header)
        reads = [(round(i * (size - FINGERPRINT_CHUNK_BYTES) / (FINGERPRINT_CHUNKS - 1)), FINGERPRINT_CHUNK_BYTES)
                 for i in range(FINGERPRINT_CHUNKS)]
        try:
            entries = json.loads(header)
        except ValueError:
            entries = {}  # not a safetensors header: the evenly spaced chunks still cover the file
        data_start = 8 + header_len
        for key, entry in sorted(entries.items()):
            if key == "__metadata__" or not isinstance(entry, dict) or "data_offsets" not in entry:
                continue
            begin, end = (data_start + int(x) for x in entry["data_offsets"])
            n = min(FINGERPRINT_TENSOR_END_BYTES, end - begin)
            reads += [(begin, n), (end - n, n)]
        for offset, n in sorted(reads):  # in file order: one forward sweep
            handle.seek(offset)
            digest.update(handle.read(n))
    return FINGERPRINT_PREFIX + digest.hexdigest()


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
