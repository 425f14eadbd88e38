"""Stage 2: the two-stage projection of Section 3.2 (and Appendix B).

First stage, per module ``u``: the gradient in the Kronecker eigenbasis ``Q_S^T G Q_A``,
restricted to the ``m_u`` coordinates with the largest corrected eigenvalues and half-whitened
by ``(Λ + λ_u)^{-1/2}``. It is computed from the factors ``(a, g)`` as
``(g Q_S)[:, rows]^T (a Q_A)[:, cols]`` over only the rows and columns the kept coordinates
touch: no dense ``d × m`` matrix, no dense per-example gradient when ``m_u < d_u``.

Second stage: ``P^T z`` with ``P`` the top-``k_u`` uncentered principal directions of the
first-stage coordinates of a fitting set (EOGP); an SRHT (EOGP-R); or nothing (the
``ekfac-topk`` ablation, ``k_u = m_u``).

Everything shared across examples and queries is saved in one safetensors file by the store
(:mod:`eogp_index.store.projection_file`), which reads it back with the ``P`` matrices loaded
lazily: all kept once read when they fit a memory limit, else each module's ``P`` read when it is
applied and dropped after (the paper's "modules in turn"). Applied in the backward hook that is
once per gradient batch; block ingest and batched queries instead apply each ``P`` once to the
first-stage coordinates of many batches (:meth:`ModuleProjection.second_groups`), as the paper's
Appendix E does.

The second stage sees the first-stage coordinates rounded to FP16 (:data:`FIRST_STAGE_DTYPE`):
the precision the fit's PCA was fitted on and the one block ingest caches them in, so that every
route gives the same coordinates.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Literal, Optional, Sequence

import torch

from eogp_index.config import PCA_DTYPE_BYTES, ProjectionConfig, SecondStage, StorageConfig
from eogp_index.errors import ConfigError, ModelError
from eogp_index.fit.curvature import ModuleCurvature

PCA_TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
#: The precision of first-stage coordinates kept between the two stages: in the fit's cache (the
#: PCA is fitted on them), block ingest's cache and batched queries. The second stage rounds them
#: to it on every route, the per-batch one included.
FIRST_STAGE_DTYPE = torch.float16
#: Rows of an FP16 ``P`` upcast to float32 at once are capped so that the float32 copy stays
#: under this many bytes: applying a 1 GB FP16 ``P`` never needs a 2 GB float32 one.
_UPCAST_BYTES = 64 << 20


@dataclass
class ModuleProjection:
    """The fitted projection of one module.

    Attributes:
        shape: ``(d_out, d_in')`` of the module's gradient.
        activation_eigenvectors: ``Q_A[:, cols]``, ``(d_in', c)`` — only the columns used.
        gradient_eigenvectors: ``Q_S[:, rows]``, ``(d_out, r)`` — only the columns used. Both are
            held in 16 bits for a half-precision model (float16, see
            :data:`~eogp_index.config.EIGENVECTOR_DTYPES`), in float32 for a float32 one or as read
            from a file written before they were; :meth:`first_stage` computes in float32 either way.
        local_index: ``(m,)`` int64 positions of the kept coordinates in the ``(r, c)`` block,
            ordered by decreasing corrected eigenvalue.
        whiten: ``(m,)`` float32, ``(Λ_m + λ_u)^{-1/2}``.
        second_stage: ``"pca"`` (``pca`` is ``(m, width)``, float32 or float16), ``"srht"``
            (``srht_signs`` ``(m,)``, ``srht_rows`` ``(width,)``) or ``"none"`` (``width = m``).
        k: the one-bit code's coordinates: the first ``k`` of the module's ``width``.
        tier_k: the rescoring tier's coordinates (``StorageConfig.rescore_k``) when more than
            ``k``: the second stage then outputs ``tier_k`` coordinates, whose first ``k`` are what
            it outputs without it (PCA directions are nested). None: ``k``.
        damping: ``λ_u``.
        pca_loader: for a projection loaded from disk, reads ``pca`` when it is used (then
            ``pca`` is read through it).
        rotation: variant ``eogp-rot`` (and ``auto`` where it chose the rotation), while fitting:
            the rotation folded into ``pca`` when it is fitted (:func:`second_stage_directions`).
            Not stored: the file's ``pca`` already includes it, so a loaded projection has None.
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
    rotation: Optional["HadamardRotation"] = field(default=None, repr=False, compare=False)
    tier_k: Optional[int] = None

    @property
    def m(self) -> int:
        return int(self.local_index.numel())

    @property
    def width(self) -> int:
        """Coordinates the module's second stage outputs: ``tier_k``, else ``k``."""
        return self.k if self.tier_k is None else int(self.tier_k)

    @property
    def has_pca(self) -> bool:
        """Whether a ``P`` is set or can be read (without reading it)."""
        return self._pca is not None or self.pca_loader is not None

    def first_stage(self, a: torch.Tensor, g: torch.Tensor, *, route: Optional[BlockRoute] = None) -> torch.Tensor:
        """Half-whitened top-``m`` EK-FAC coordinates, ``(B, m)`` float32.

        Args:
            a: ``(B, T, d_in')`` activations; g: ``(B, T, d_out)`` output gradients; float32.
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
        tokens = live.reshape(-1).nonzero().squeeze(1)  # index_select: cheaper than g[live]
        g_live = g.reshape(-1, g.shape[-1]).index_select(0, tokens)  # (N, d_out)
        a_live = a.reshape(-1, a.shape[-1]).index_select(0, tokens)  # (N, d_in')
        # The columns may be held in float16; this module's are upcast for its products only
        # (exactly: every float16 value is a float32 one) and dropped when it returns.
        q_s = self.gradient_eigenvectors.to(g.device, torch.float32)  # (d_out, r)
        q_a = self.activation_eigenvectors.to(a.device, torch.float32)  # (d_in', c)
        r, c = q_s.shape[1], q_a.shape[1]
        index = self.local_index.to(a.device)
        if r * c <= 256 * self.m:
            # A fair share of the (r, c) block is kept: form it with matmuls, then gather.
            # Measured on CPU, this wins until the block is a few hundred times larger than m.
            route = route or block_route(g_live.shape[0], batch, q_s.shape[0], r, q_a.shape[0], c)
            kept = _kept_from_blocks(route, g_live, a_live, counts, q_s, q_a, index)
        else:
            # Few coordinates kept: per-example sums over tokens of products of only the needed
            # entries, in chunks of coordinates so that (N, chunk) stays small.
            gs, aa = g_live @ q_s, a_live @ q_a  # (N, r), (N, c): both factors in the eigenbasis
            rows, cols = index // c, index % c
            example = torch.repeat_interleave(
                torch.arange(batch, device=g.device), torch.as_tensor(counts, device=g.device)
            )
            chunk = max(1, (1 << 24) // max(1, gs.shape[0]))
            kept = torch.cat(
                [
                    gs.new_zeros(batch, min(chunk, self.m - i)).index_add_(
                        0, example, gs[:, rows[i : i + chunk]] * aa[:, cols[i : i + chunk]]
                    )
                    for i in range(0, self.m, chunk)
                ],
                dim=1,
            )
        return kept * self.whiten.to(a.device)

    def second(self, z: torch.Tensor) -> torch.Tensor:
        """``(B, m)`` first-stage coordinates → ``(B, width)`` final coordinates."""
        return self.second_groups([z])[0]

    def second_groups(self, groups: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """:meth:`second` of several row groups (``(B_i, m)`` → ``(B_i, width)`` each), with ``P``
        read once for all of them: each group gives exactly what :meth:`second` gives it alone."""
        if self.second_stage == "pca":
            return apply_pca_groups(groups, self.pca)
        if self.second_stage == "srht":
            signs, rows = self.srht_signs, self.srht_rows
            return [srht_apply(z, signs.to(z.device), rows.to(z.device), k=self.k) for z in groups]
        return list(groups)

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
    """``z @ P`` in float32, ``(B, m) @ (m, k) → (B, k)``: :func:`apply_pca_groups` of one group."""
    return apply_pca_groups([z], pca)[0]


def apply_pca_groups(groups: Sequence[torch.Tensor], pca: torch.Tensor) -> List[torch.Tensor]:
    """``round(z_i) @ P`` in float32 for each ``(B_i, m)`` group: ``(B_i, k)`` each.

    ``z_i`` is first rounded to :data:`FIRST_STAGE_DTYPE` (a no-op for coordinates already kept
    at it). An FP16 ``P`` is upcast a block of rows at a time (at most ``_UPCAST_BYTES`` of
    float32), each block once for all the groups, so the products and sums are float32 whatever
    ``P``'s dtype. Each group is its own matmul, the one it would be alone: a BLAS's result for a
    row may depend on how many rows share the call, and grouping rows as the gradient batches were
    keeps every route's coordinates identical.

    Raises:
        ModelError: a coordinate overflows FP16 (``|z| > 65504``).
    """
    pca = pca.to(groups[0].device) if groups else pca
    rounded = [_at_precision(z, FIRST_STAGE_DTYPE) for z in groups]
    if pca.dtype == torch.float32:
        return [z.float() @ pca for z in rounded]
    m, k = pca.shape
    rows = min(m, max(1, _UPCAST_BYTES // (4 * max(1, k))))
    outs = [z.new_zeros(z.shape[0], k, dtype=torch.float32) for z in rounded]
    scratch = _upcast_scratch(rows * k, outs[0]) if outs else None
    for i in range(0, m, rows):
        block = pca[i : i + rows]
        upcast = block.float() if scratch is None else scratch[: block.numel()].view(block.shape).copy_(block)
        for z, out in zip(rounded, outs):
            out.addmm_(z[:, i : i + rows].float(), upcast)
    return outs


def _at_precision(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``z`` rounded to ``dtype`` (kept as it is when it already is).

    A ``z`` that requires a gradient (the explanations' pullback through the second stage) keeps
    its dtype and gets the rounded values with the identity as their gradient, so that the
    adjoint of the second stage is ``P`` itself, not a rounded copy of it.
    """
    if z.dtype == dtype:
        return z
    rounded = z.detach().to(dtype)
    if not torch.isfinite(rounded).all() and torch.isfinite(z).all():
        raise ModelError(
            f"first-stage coordinates overflow {dtype} (|z| up to {z.abs().max().item():.3g}): the "
            "half-whitened gradients are far larger than the curvature predicts; check that the model "
            "is the one the index was fitted with"
        )
    if z.requires_grad:
        return z + (rounded.to(z.dtype) - z).detach()  # exact: z and its rounding are within a factor 2
    return rounded


_scratch = threading.local()  # a server's worker thread and the main thread may both project


def _upcast_scratch(numel: int, z: torch.Tensor) -> Optional[torch.Tensor]:
    """A float32 buffer of at least ``numel`` entries, kept per thread and reused, on CPU (None on
    other devices, whose caching allocators already reuse memory).

    Upcasting into a fresh tensor costs, on CPU, mostly the first-touch page faults of the new
    allocation; a reused buffer has none, and ingest upcasts a block per module and batch.
    """
    if z.device.type != "cpu" or z.dtype != torch.float32:
        return None
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer


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


def _kept_from_blocks(
    route: BlockRoute,
    g: torch.Tensor,
    a: torch.Tensor,
    counts: List[int],
    q_s: torch.Tensor,
    q_a: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """The kept entries of each example's ``Q_S[:, rows]ᵀ G_b Q_A[:, cols]``, ``(B, m)``.

    Each example's ``(r, c)`` block is formed in one reused buffer and gathered at once, never
    the whole batch's ``(B, r, c)``: on GPT-2 small that was 32 MB per module and batch, and a
    fresh allocation that large costs more in first-touch page faults than its products.

    Args:
        g: ``(N, d_out)``; a: ``(N, d_in')``: the live tokens of the batch, example after example,
            ``counts[b]`` of them for example ``b``.
        index: ``(m,)`` positions of the kept entries in the flattened ``(r, c)`` block.
    """
    r, c = q_s.shape[1], q_a.shape[1]
    block = g.new_empty(r, c)
    if route == "factors":
        xs, ys = (g @ q_s).split(counts), (a @ q_a).split(counts)  # (n_b, r), (n_b, c)

        def form(x, y):
            return torch.mm(x.T, y, out=block)
    elif route == "rotate_after_g":
        xs, ys = g.split(counts), (a @ q_a).split(counts)  # (n_b, d_out), (n_b, c)
        middle = g.new_empty(g.shape[1], c)

        def form(x, y):
            return torch.mm(q_s.T, torch.mm(x.T, y, out=middle), out=block)
    elif route == "rotate_after_a":
        xs, ys = (g @ q_s).split(counts), a.split(counts)  # (n_b, r), (n_b, d_in')
        middle = g.new_empty(r, a.shape[1])

        def form(x, y):
            return torch.mm(torch.mm(x.T, y, out=middle), q_a, out=block)
    else:
        raise ConfigError(f"unknown first-stage route {route!r}; expected one of {BlockRoute.__args__}")
    kept = g.new_empty(len(counts), index.numel())
    for b, (x, y) in enumerate(zip(xs, ys)):
        torch.index_select(form(x, y).view(-1), 0, index, out=kept[b])
    return kept


def first_stage_from_curvature(
    curvature: ModuleCurvature, m: int, damping_ratio: float, *, dtype: torch.dtype = torch.float32
) -> ModuleProjection:
    """Keep the ``m`` EK-FAC directions with the largest corrected eigenvalues.

    Ties are broken by position (a stable sort) so that the same factors always give the same
    projection. The eigenvector columns they touch are kept in ``dtype``
    (:data:`~eogp_index.config.EIGENVECTOR_DTYPES` of the model's).
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
        activation_eigenvectors=curvature.activation_eigenvectors[:, cols].to(dtype).contiguous(),
        gradient_eigenvectors=curvature.gradient_eigenvectors[:, rows].to(dtype).contiguous(),
        local_index=(row_pos * cols.numel() + col_pos).long(),
        whiten=whiten,
        damping=damping,
        second_stage="none",
        k=m,
    )


def gram_matrix(z: torch.Tensor) -> torch.Tensor:
    """``Z Zᵀ`` ``(n, n)`` float64 of ``z`` ``(n, m)``, upcast a block of at most ``_UPCAST_BYTES`` of
    columns at a time: ``z`` may be a whole module's FP16 cache, never upcast as a whole (``n·m·8``
    bytes, the fit's largest buffer otherwise)."""
    n, m = z.shape
    cols = max(1, _UPCAST_BYTES // (8 * n))
    gram = z.new_zeros(n, n, dtype=torch.float64)
    for i in range(0, m, cols):
        block = z[:, i : i + cols].double()
        gram.addmm_(block, block.T)
    return gram


def _top_eigen(gram: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The top-``k`` eigenvalues ``(≤k,)`` and eigenvectors ``(n, ≤k)`` of a Gram matrix, largest
    first, and its numerical rank among them (eigenvalues above ``1e-10`` of the largest)."""
    weights, vectors = torch.linalg.eigh(gram)
    weights, vectors = weights.flip(0)[:k], vectors.flip(1)[:, :k]
    rank = int((weights > weights[0] * 1e-10).sum()) if weights.numel() and weights[0] > 0 else 0
    return weights, vectors, rank


def fit_pca(z: torch.Tensor, k: int, *, gram: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Top-``k`` uncentered principal directions of the rows of ``z``, ``(m, k)`` float32.

    With fewer rows than columns the directions come from the ``n × n`` Gram matrix
    (``Z Z^T = U W U^T`` ⇒ ``P = Z^T U W^{-1/2}``), never an ``m × m`` matrix; ``gram``, when
    given, is that matrix (:func:`gram_matrix` of ``z``), computed once for several fits.

    When the fitting set spans fewer than ``k`` directions, PCA leaves the rest undetermined;
    they are completed with the leading first-stage axes (largest EK-FAC eigenvalues first)
    orthogonalised against the span, and a warning says so.
    """
    n, m = z.shape
    # z may be a whole module's FP16 cache: it is upcast to float64 a block of at most
    # _UPCAST_BYTES at a time, never as a whole (n·m·8 bytes, the fit's largest buffer otherwise).
    if n < m:
        cols = max(1, _UPCAST_BYTES // (8 * n))
        weights, vectors, rank = _top_eigen(gram_matrix(z) if gram is None else gram, k)
        scaled = vectors[:, :rank] / weights[:rank].sqrt()
        directions = torch.empty(m, rank, dtype=torch.float64 if rank < k else torch.float32, device=z.device)
        for i in range(0, m, cols):
            directions[i : i + cols] = z[:, i : i + cols].double().T @ scaled
    else:
        rows = max(1, _UPCAST_BYTES // (8 * m))
        covariance = z.new_zeros(m, m, dtype=torch.float64)
        for i in range(0, n, rows):
            block = z[i : i + rows].double()
            covariance.addmm_(block.T, block)
        weights, vectors = torch.linalg.eigh(covariance)
        del covariance
        weights, directions = weights.flip(0)[:k], vectors.flip(1)[:, :k]
        rank = int((weights > weights[0] * 1e-10).sum()) if weights[0] > 0 else 0
        directions = directions[:, :rank]
    if rank < k:
        warnings.warn(
            f"the PCA fitting set spans only {rank} of the k={k} directions asked for; the rest are the "
            "leading EK-FAC axes orthogonal to it. Fit on more examples (num_fit_examples) for a full PCA.",
            stacklevel=2,
        )
        # Pivot on the axes in eigenvalue order: keep each axis that adds a new direction (its
        # residual after the basis so far is above 1e-4). Axes are taken a block at a time:
        # orthogonalised against the basis twice (one pass loses orthogonality to rounding), then
        # a QR of the block, whose |R_ii| is axis i's residual after the basis and the block's
        # earlier axes — what one axis at a time would give. Up to the first axis that adds
        # nothing the block is kept; that axis is skipped and the next block starts after it.
        basis = torch.empty(m, k, dtype=torch.float64, device=z.device)
        basis[:, :rank] = directions
        filled, j = rank, 0
        while filled < k and j < m:
            width = min(k - filled, m - j, _COMPLETION_BLOCK)
            block = torch.zeros(m, width, dtype=torch.float64, device=z.device)
            block[torch.arange(j, j + width), torch.arange(width)] = 1.0
            done = basis[:, :filled]
            for _ in range(2):
                block -= done @ (done.T @ block)
            q, r = torch.linalg.qr(block)
            diagonal = r.diagonal()
            small = (diagonal.abs() <= 1e-4).nonzero()
            take = int(small[0]) if small.numel() else width
            basis[:, filled : filled + take] = q[:, :take] * diagonal[:take].sign()
            filled += take
            j += take + (1 if take < width else 0)
        directions = basis[:, :filled]
    return directions.float().contiguous()


#: Axes orthogonalised at once when fit_pca completes a rank-deficient basis (bounds the
#: ``(m, block)`` float64 buffer).
_COMPLETION_BLOCK = 256


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


def srht_apply(z: torch.Tensor, signs: torch.Tensor, rows: torch.Tensor, *, k: Optional[int] = None) -> torch.Tensor:
    """``S z`` with ``S = sqrt(p/k) R H_p D J`` and ``H_p`` orthonormal (Appendix B.2).

    ``k``: the one-bit code's rows, whose scale every row gets (default: all of ``rows``), so
    that a tier's extra rows leave the first ``k`` coordinates exactly as they are without them.
    """
    m = z.shape[-1]
    p = 1 << max(0, math.ceil(math.log2(m)))
    padded = torch.nn.functional.pad(z * signs, (0, p - m))
    # sqrt(p/k) · (1/sqrt(p)) · H_unnormalised = H_unnormalised / sqrt(k)
    return fwht(padded)[..., rows] / math.sqrt(rows.numel() if k is None else k)


def make_srht(
    m: int, k: int, generator: torch.Generator, *, width: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random signs ``(m,)`` and ``width`` (default ``k``) distinct rows of the padded width: the
    first ``k`` sorted, then the tier's other ``width - k`` sorted. The draws do not depend on
    ``width``, so the first ``k`` rows are those of an SRHT of ``k`` rows alone."""
    width = k if width is None else width
    p = 1 << max(0, math.ceil(math.log2(m)))
    if width > p:
        raise ConfigError(f"SRHT cannot output {width} coordinates from a padded width of {p}; lower k or --rescore-k")
    signs = torch.randint(0, 2, (m,), generator=generator).float() * 2 - 1
    perm = torch.randperm(p, generator=generator)
    rows = torch.cat([perm[:k].sort().values, perm[k:width].sort().values])
    return signs, rows


# -- rotations inside the PCA subspace (variant eogp-rot) ------------------------------------
#
# PCA coordinates have very unequal variances, and one bit gives each the same magnitude, so the
# leading ones are under-weighted relative to the trailing ones (and the coordinates a small
# fitting set leaves empty are pure noise). An orthogonal R spreads the energy evenly over the k
# coordinates before the signs are taken. Scores in full precision are unchanged
# ((P R)ᵀ q · (P R)ᵀ z = qᵀ P Pᵀ z); only what the signs keep changes. R is folded into P at fit
# time (P' = P R), so the stored format, the codes and the kernels are those of EOGP.

#: Rounds of the randomized Hadamard rotation: one round mixes each coordinate with a
#: power-of-two block only; two give as good a rotation as a Haar-random one on both shipped
#: cases (NDCG@20 at every budget, checked offline).
HADAMARD_ROUNDS = 2


@dataclass(frozen=True)
class HadamardRotation:
    """A randomized Hadamard rotation ``R`` of ``R^k``, any ``k`` (not only powers of two).

    With ``p = 2^⌊log2 k⌋``, each round multiplies by random signs, applies the orthonormal
    Hadamard ``H_p / sqrt(p)`` to the first ``p`` coordinates, multiplies by random signs again,
    applies it to the last ``p`` coordinates (the two blocks overlap and cover all ``k`` when ``k``
    is not a power of two; when it is, the second block is skipped), then permutes the coordinates
    at random. Every step is orthogonal, so ``R`` is. Applying it costs ``O(k·sqrt(k))`` per vector
    with :func:`fwht`'s two small matmuls (a butterfly would be ``O(k log k)``), once per row of
    ``P`` at fit time: little next to fitting ``P`` itself.

    Attributes:
        signs: ``(rounds, 2, k)`` float64, ±1.
        perms: ``(rounds, k)`` int64, permutations of ``range(k)``.
    """

    signs: torch.Tensor
    perms: torch.Tensor

    @property
    def k(self) -> int:
        return int(self.perms.shape[1])

    @classmethod
    def draw(cls, k: int, generator: torch.Generator, rounds: int = HADAMARD_ROUNDS) -> "HadamardRotation":
        if k < 1 or rounds < 1:
            raise ConfigError(f"a Hadamard rotation needs k >= 1 and rounds >= 1, got k={k}, rounds={rounds}")
        signs = torch.randint(0, 2, (rounds, 2, k), generator=generator).double() * 2 - 1
        perms = torch.stack([torch.randperm(k, generator=generator) for _ in range(rounds)])
        return cls(signs=signs, perms=perms)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x R`` over the last axis: ``(..., k) → (..., k)``, in ``x``'s dtype."""
        k = self.k
        if x.shape[-1] != k:
            raise ConfigError(f"a rotation of R^{k} cannot rotate vectors of length {x.shape[-1]}")
        p = 1 << (k.bit_length() - 1)
        norm = 1.0 / math.sqrt(p)
        x = x.clone()
        for signs, perm in zip(self.signs.to(x), self.perms.to(x.device)):
            x *= signs[0]
            x[..., :p] = fwht(x[..., :p]) * norm
            if p < k:
                x *= signs[1]
                x[..., k - p :] = fwht(x[..., k - p :]) * norm
            x = x[..., perm]
        return x

    def matrix(self) -> torch.Tensor:
        """``R`` itself, ``(k, k)`` float64 (row ``i`` is ``e_i R``)."""
        return self.apply(torch.eye(self.k, dtype=torch.float64))


def rotation_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s rotation: from the projection seed and the module's name, so
    that a module's ``R`` does not depend on which other modules are attributed, or on the rank
    that fits it."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def rotate_directions(pca: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """``[P[:, :k] R, P[:, k:]]`` in float64, ``(m, w)`` → ``(m, w)`` float32 with ``k`` the
    rotation's (``w > k``: a rescoring tier's further directions, left as they are), a block of
    rows at a time (bounded memory)."""
    out = pca.to(torch.float32, copy=True)
    k = rotation.k
    rows = max(1, _UPCAST_BYTES // (8 * max(1, k)))
    for i in range(0, pca.shape[0], rows):
        out[i : i + rows, :k] = rotation.apply(pca[i : i + rows, :k].double()).float()
    return out


def second_stage_directions(
    z: torch.Tensor, module: "ModuleProjection", *, gram: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """A module's stored ``P``, ``(m, width)`` float32, from its fitting set's first-stage
    coordinates ``z`` ``(n, m)``: the top-``width`` principal directions (:func:`fit_pca`;
    ``gram``: ``z``'s Gram matrix if already computed), the first ``k`` rotated by the module's
    :class:`HadamardRotation` when it has one (variant ``eogp-rot``, and ``auto`` where it chose
    the rotation). With a wider rescoring tier the one-bit code's ``k`` directions are the
    prefix of the tier's (PCA directions are nested), and the tier's scores, dot products over
    all ``width``, are unchanged by the rotation."""
    directions = fit_pca(z, module.width, gram=gram)
    if module.rotation is not None:
        directions = rotate_directions(directions, module.rotation)
    return directions


def module_rotation(seed: int, name: str, k: int) -> HadamardRotation:
    """Module ``name``'s rotation of ``R^k`` (variants eogp-rot and auto), drawn from :func:`rotation_seed`."""
    return HadamardRotation.draw(k, torch.Generator().manual_seed(rotation_seed(seed, name)))


class Projection:
    """The ordered per-module projections of an index (written and read by
    :mod:`eogp_index.store.projection_file`).

    Attributes:
        modules: ``{name: ModuleProjection}`` in module order.
        in_turn: for a loaded projection, whether the ``P`` matrices exceed the memory limit and
            are read module by module whenever they are applied: per gradient batch in the
            backward hook, or once for many batches (:meth:`ModuleProjection.second_groups`).
            False: each is read once and kept.
    """

    def __init__(
        self, modules: Dict[str, ModuleProjection], *, config: ProjectionConfig, damping_ratio: float, lazy=None
    ):
        """``lazy``: for a projection read from its file, the reader of its ``P`` matrices
        (:class:`~eogp_index.store.projection_file.LazyPca`: ``resident``, ``total_bytes``, ``bytes_read``)."""
        self.modules = modules
        self.config = config
        self.damping_ratio = damping_ratio
        self._lazy = lazy
        #: While fitting: each module's held-out measurement
        #: (:class:`~eogp_index.fit.code_choice.CodeChoice`, which imports this module), in module order.
        self.choices: Dict[str, object] = {}

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
    def tier_k(self) -> tuple[int, ...]:
        """The rescoring tier's coordinates per module (:attr:`ModuleProjection.width`): what the
        second stages output, of which the one-bit code keeps the first :attr:`k`."""
        return tuple(p.width for p in self.modules.values())

    @property
    def in_turn(self) -> bool:
        return self._lazy is not None and not self._lazy.resident

    def rotation_record(self) -> Dict[str, object]:
        """What the manifest records of the rotation folded into ``P`` (``projection.rotation``):
        ``{"kind": "none"}``, or ``{"kind": "hadamard", "rounds": 2, "seed": s}`` (module ``u``'s
        ``R`` is drawn from :func:`rotation_seed` ``(s, name_u)``; it is already in ``P``, so
        readers need none of this to answer queries)."""
        if self.config.rotation == "none":
            return {"kind": "none"}
        record: Dict[str, object] = {"kind": self.config.rotation, "rounds": HADAMARD_ROUNDS, "seed": self.config.seed}
        if self.config.variant == "auto":  # chosen per module: name the modules whose P includes R
            record["modules"] = [name for name, module in self.modules.items() if module.rotation is not None]
        return record

    @property
    def eigenvector_dtype(self) -> torch.dtype:
        """The dtype the kept eigenvector columns are held in, the same for every module.

        Raises:
            ConfigError: modules holding them in different dtypes (a projection assembled by hand).
        """
        found = {t.dtype for p in self.modules.values() for t in (p.gradient_eigenvectors, p.activation_eigenvectors)}
        if len(found) != 1:
            raise ConfigError(
                f"the modules hold their eigenvector columns in {sorted(map(str, found))}: a projection "
                "holds them in one dtype; build it with build_projection"
            )
        return found.pop()

    @property
    def pca_bytes_read(self) -> int:
        """Bytes of ``P`` read from the projection file since it was loaded (0 when not loaded)."""
        return self._lazy.bytes_read if self._lazy is not None else 0

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype first-stage coordinates are kept at between the stages (block ingest's cache,
        batched queries): :data:`FIRST_STAGE_DTYPE`, which the second stage rounds them to anyway;
        float32 without a ``P``."""
        return FIRST_STAGE_DTYPE if self.config.second_stage == "pca" else torch.float32

    @property
    def pca_bytes(self) -> int:
        """Bytes of every module's ``P`` at its stored dtype (0 without a PCA stage)."""
        if self._lazy is not None:
            return self._lazy.total_bytes
        return sum(
            p.m * p.width * PCA_DTYPE_BYTES[self.config.pca_dtype]
            for p in self.modules.values()
            if p.second_stage == "pca"
        )

    def transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """A :data:`~eogp_index.gradients.Transform` giving the final coordinates."""
        return self.modules[name].project(a, g)

    def first_stage_transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.modules[name].first_stage(a, g)

    def cached_first_stage_transform(self, name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The first stage at :attr:`cache_dtype`, ``(B, m)``: what the second stage rounds it to
        anyway, so keeping it so (block ingest's cache, batched queries) changes no coordinate."""
        return _at_precision(self.modules[name].first_stage(a, g), self.cache_dtype)


def build_projection(
    curvature: Dict[str, ModuleCurvature],
    config: ProjectionConfig,
    storage: StorageConfig,
    *,
    damping_ratio: float = 0.1,
    eigenvector_dtype: torch.dtype = torch.float32,
) -> Projection:
    """Choose ``(m_u, k_u)`` per module (and the tier's ``tier_k``, ``storage.rescore_k``), build
    the first stages and draw the SRHTs and rotations (rotations of the one-bit code's ``k_u``).

    The kept eigenvector columns are held in ``eigenvector_dtype`` (for the model's dtype,
    :data:`~eogp_index.config.EIGENVECTOR_DTYPES`). For EOGP the PCA matrices are fitted afterwards
    (:func:`second_stage_directions`, from first-stage coordinates computed with the stages built
    here), so the PCA sees the columns as they are held.
    """
    config = config.resolved(storage.tier)
    modules = {}
    generator = torch.Generator().manual_seed(config.seed)
    for name, curv in curvature.items():
        m, k = config.dims(curv.num_params, len(curvature), storage.precision, storage.rescore_k)
        proj = first_stage_from_curvature(curv, m, damping_ratio, dtype=eigenvector_dtype)
        proj.k = k
        width = storage.tier_k(k, m)
        proj.tier_k = width if width != k else None
        proj.second_stage = config.second_stage
        if config.second_stage == "srht":
            proj.srht_signs, proj.srht_rows = make_srht(m, k, generator, width=width)
        if config.rotation == "hadamard":  # eogp-rot, and auto's candidate (dropped where EOGP wins)
            proj.rotation = module_rotation(config.seed, name, k)
        modules[name] = proj
    return Projection(modules, config=config, damping_ratio=damping_ratio)
