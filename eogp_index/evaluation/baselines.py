"""Gradient-compression baselines at matched storage (paper Appendix C.3), in torch.

Each baseline compresses the per-example gradient of one linear module from its factors,
without materializing the dense per-example gradient where it can:

* ``a``: module input activations, ``(B, T, d_in)``, with a column of ones already appended
  when the layer has a bias;
* ``g``: gradients of the loss with respect to the module outputs, ``(B, T, d_out)``;
* the per-example gradient is ``G_b = g_b^T a_b``, ``(d_out, d_in)``; ``vec`` flattens it
  row-major (index ``o * d_in + i``).

Projectors (all follow :class:`Projector`):

* :class:`LoGraProjector` -- LoGra: ``vec(P_g^T G P_a)``, random or PCA-initialized factors,
  ``rank**2`` coordinates; its curvature is estimated after projection
  (:class:`ProjectedCurvature`).
* :class:`GraSSProjector` -- FactGraSS: factor-wise random masking, then a CountSketch to
  ``k`` coordinates; curvature after projection as for LoGra.
* :class:`GaussianProjector` -- the Gaussian random-projection control: standard Gaussian
  factors, training gradients projected directly, query gradients preconditioned by the
  full-space damped EK-FAC inverse before projection, inner products scaled by
  ``rank**-2``.

Storage budgets (FP16 coordinates, or one sign bit per coordinate plus a two-byte scale per
module as in the paper) are turned into projection sizes by :func:`rank_for_bytes` and
:func:`k_for_bytes`. Everything runs in float32 unless the inputs are float64; seeds fix
every random draw through a ``torch.Generator``.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from eogp_index import config as storage
from eogp_index.errors import ConfigError, InputError

__all__ = [
    "GaussianProjector",
    "GraSSProjector",
    "LoGraProjector",
    "ProjectedCurvature",
    "Projector",
    "bytes_for_coordinates",
    "k_for_bytes",
    "rank_for_bytes",
]

_PRECISIONS = ("fp16", "fp32", "1bit")


# --------------------------------------------------------------------------- interface


@runtime_checkable
class Projector(Protocol):
    """Per-module gradient compressor."""

    name: str

    def num_coordinates(self) -> int:
        """Number of stored coordinates per example for this module."""
        ...

    def project(self, a: Tensor, g: Tensor) -> Tensor:
        """a: ``(B, T, d_in)``, g: ``(B, T, d_out)`` -> ``(B, k)`` coordinates."""
        ...


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _generator(seed) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def _check_factors(a: Tensor, g: Tensor, d_in: int, d_out: int) -> tuple[Tensor, Tensor]:
    """Validate the factor shapes; 2-D ``(B, d)`` inputs are read as one token per example."""
    if not isinstance(a, Tensor) or not isinstance(g, Tensor):
        raise InputError("activations and output gradients must be torch tensors")
    if a.dim() == 2:
        a = a.unsqueeze(1)
    if g.dim() == 2:
        g = g.unsqueeze(1)
    if a.dim() != 3 or g.dim() != 3:
        raise InputError(
            f"expected a (B, T, d_in) and g (B, T, d_out), got shapes {tuple(a.shape)} and {tuple(g.shape)}"
        )
    if a.shape[:2] != g.shape[:2]:
        raise InputError(f"a and g disagree on (B, T): {tuple(a.shape[:2])} vs {tuple(g.shape[:2])}")
    if a.shape[2] != d_in:
        raise InputError(
            f"a has {a.shape[2]} input features, the projector expects d_in={d_in} "
            "(append the ones column for a bias before projecting)"
        )
    if g.shape[2] != d_out:
        raise InputError(f"g has {g.shape[2]} output features, the projector expects d_out={d_out}")
    dtype = torch.promote_types(a.dtype, g.dtype)
    if not dtype.is_floating_point:
        raise InputError(f"factors must be floating point, got {a.dtype} and {g.dtype}")
    # Half-precision inputs are upcast: summing over thousands of tokens in fp16 loses the
    # small per-example signals the baselines are compared on.
    if dtype not in (torch.float32, torch.float64):
        dtype = torch.float32
    return a.to(dtype), g.to(dtype)


# --------------------------------------------------------------------------- budgets


def bytes_for_coordinates(k: int, precision: str = "fp16") -> int:
    """Per-example bytes of ``k`` coordinates of one module.

    fp16: ``2k``; fp32: ``4k``; 1bit: ``ceil(k / 8) + 2`` (packed signs + an FP16 scale).
    """
    _positive_int(k, "k")
    return storage.bytes_per_module(k, precision)


def k_for_bytes(bytes_per_module: int, precision: str = "fp16") -> int:
    """Largest coordinate count ``k`` whose per-example storage fits ``bytes_per_module``.

    Raises ConfigError when not even one coordinate fits.
    """
    if isinstance(bytes_per_module, bool) or not isinstance(bytes_per_module, int) or bytes_per_module < 1:
        raise ConfigError(f"bytes_per_module must be a positive integer, got {bytes_per_module!r}")
    k = storage.k_for_bytes(bytes_per_module, precision)
    if k < 1:
        raise ConfigError(f"{bytes_per_module} bytes per module cannot hold one {precision} coordinate")
    return k


def rank_for_bytes(bytes_per_module: int, precision: str = "fp16") -> int:
    """Largest factor rank ``r`` whose ``r**2`` coordinates fit ``bytes_per_module``.

    For fp16 this is the largest r with ``2 * r**2 <= bytes_per_module`` (LoGra and the
    Gaussian control store ``r**2`` coordinates per module).
    """
    return math.isqrt(k_for_bytes(bytes_per_module, precision))


# --------------------------------------------------------------------------- curvature


class ProjectedCurvature:
    """Damped second moment of one module's projected training coordinates.

    ``H = E[v v^T] + lambda I`` with ``lambda = damping_ratio * tr(E[v v^T]) / k`` (the
    paper's relative damping, coefficient 0.1). The expectation is uncentered, over
    training examples. Influence is then ``q^T H^{-1} v``: precondition the query
    coordinates with :meth:`precondition` and take inner products with stored ones.
    """

    def __init__(self, cholesky: Tensor, damping: float, num_examples: int):
        self._cholesky = cholesky  # lower factor of H, float64
        self.damping = float(damping)
        self.num_examples = int(num_examples)

    @property
    def num_coordinates(self) -> int:
        return self._cholesky.shape[0]

    @classmethod
    def fit(cls, coords: Tensor, damping_ratio: float = 0.1) -> ProjectedCurvature:
        """coords: ``(n, k)`` projected training coordinates of this module."""
        if not isinstance(coords, Tensor) or coords.dim() != 2 or coords.shape[0] < 1 or coords.shape[1] < 1:
            shape = tuple(coords.shape) if isinstance(coords, Tensor) else type(coords).__name__
            raise InputError(f"coords must be a non-empty (n, k) tensor, got {shape}")
        # Accumulated and factorized in float64: with strong damping ratios the matrix is
        # well conditioned, but the sum over many examples is not exact in float32.
        v = coords.detach().to(torch.float64)
        return cls.from_second_moment(v.T @ v / v.shape[0], damping_ratio, num_examples=v.shape[0])

    @classmethod
    def from_second_moment(
        cls, second_moment: Tensor, damping_ratio: float = 0.1, *, num_examples: int = 0
    ) -> ProjectedCurvature:
        """second_moment: ``(k, k)`` uncentered ``E[v v^T]``, e.g. accumulated in batches."""
        if (
            not isinstance(second_moment, Tensor)
            or second_moment.dim() != 2
            or second_moment.shape[0] != second_moment.shape[1]
        ):
            raise InputError("second_moment must be a square (k, k) tensor")
        if isinstance(damping_ratio, bool) or not isinstance(damping_ratio, (int, float)) or not damping_ratio > 0:
            raise ConfigError(f"damping_ratio must be a positive number, got {damping_ratio!r}")
        C = second_moment.detach().to(torch.float64)
        C = (C + C.T) / 2
        k = C.shape[0]
        trace = float(torch.trace(C))
        if not math.isfinite(trace):
            raise InputError("projected coordinates contain nan or inf")
        if trace <= 0:
            raise InputError("projected training coordinates are all zero; relative damping is undefined")
        damping = damping_ratio * trace / k
        H = C + damping * torch.eye(k, dtype=torch.float64)
        L, info = torch.linalg.cholesky_ex(H)
        if int(info) != 0:
            raise InputError("damped curvature is not positive definite; is second_moment a covariance?")
        return cls(L, damping, num_examples)

    def precondition(self, q: Tensor) -> Tensor:
        """q: ``(nq, k)`` query coordinates -> ``(nq, k)`` ``H^{-1} q`` in q's dtype."""
        if not isinstance(q, Tensor) or q.dim() != 2 or q.shape[1] != self.num_coordinates:
            shape = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
            raise InputError(f"q must have shape (nq, {self.num_coordinates}), got {shape}")
        x = torch.cholesky_solve(q.detach().to(torch.float64).T, self._cholesky).T
        return x.to(q.dtype if q.dtype.is_floating_point else torch.float32)


# --------------------------------------------------------------------------- LoGra


def _top_eigenvectors(vectors: Tensor | None, values: Tensor | None, dim: int, rank: int, which: str) -> Tensor:
    if vectors is None or values is None:
        raise ConfigError(
            f"init='pca' needs {which}_eigenvectors and {which}_eigenvalues "
            "(eigenvalues select the top directions; torch.linalg.eigh returns them ascending)"
        )
    if vectors.dim() != 2 or vectors.shape[0] != dim:
        raise InputError(
            f"{which}_eigenvectors must be ({dim}, n_vectors) with eigenvectors as columns, got {tuple(vectors.shape)}"
        )
    if values.dim() != 1 or values.shape[0] != vectors.shape[1]:
        raise InputError(
            f"{which}_eigenvalues must have one value per eigenvector column ({vectors.shape[1]}), got {tuple(values.shape)}"
        )
    if vectors.shape[1] < rank:
        raise ConfigError(f"rank={rank} exceeds the {vectors.shape[1]} {which} eigenvectors given")
    order = torch.argsort(values.detach().to(torch.float64), descending=True, stable=True)[:rank]
    return vectors.detach()[:, order]


class LoGraProjector:
    """LoGra: ``vec(P_g^T G P_a)``, ``rank**2`` coordinates per module.

    P_a: ``(d_in, rank)``, P_g: ``(d_out, rank)``. ``init="random"`` draws i.i.d. Gaussian
    entries with variance ``1 / rank`` (so ``E[P P^T] = I`` and projected inner products
    are unbiased); ``init="pca"`` takes the top-``rank`` eigenvectors by eigenvalue of the
    activation and output-gradient covariances (the K-FAC factors), given as column
    matrices with their eigenvalues. Coordinates are computed from the factors:
    ``sum_t (g_bt P_g)^T (a_bt P_a)`` -> ``(rank, rank)``, flattened row-major.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        rank: int,
        init: str = "random",
        seed: int = 0,
        activation_eigenvectors: Tensor | None = None,
        gradient_eigenvectors: Tensor | None = None,
        *,
        activation_eigenvalues: Tensor | None = None,
        gradient_eigenvalues: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.d_in = _positive_int(d_in, "d_in")
        self.d_out = _positive_int(d_out, "d_out")
        self.rank = _positive_int(rank, "rank")
        if rank > min(d_in, d_out):
            raise ConfigError(f"rank={rank} exceeds min(d_in, d_out) = {min(d_in, d_out)}")
        if init == "random":
            gen = _generator(seed)
            scale = 1.0 / math.sqrt(rank)
            self.P_a = (torch.randn(d_in, rank, generator=gen, dtype=torch.float64) * scale).to(dtype)
            self.P_g = (torch.randn(d_out, rank, generator=gen, dtype=torch.float64) * scale).to(dtype)
        elif init == "pca":
            self.P_a = _top_eigenvectors(activation_eigenvectors, activation_eigenvalues, d_in, rank, "activation").to(
                dtype
            )
            self.P_g = _top_eigenvectors(gradient_eigenvectors, gradient_eigenvalues, d_out, rank, "gradient").to(dtype)
        else:
            raise ConfigError(f"init must be 'random' or 'pca', got {init!r}")
        self.init = init
        self.name = f"logra-{init}"

    @classmethod
    def from_covariances(
        cls,
        activation_covariance: Tensor,
        gradient_covariance: Tensor,
        rank: int,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> LoGraProjector:
        """PCA initialization from the K-FAC factors ``(d_in, d_in)`` and ``(d_out, d_out)``."""
        va, Va = torch.linalg.eigh(activation_covariance.detach().to(torch.float64))
        vg, Vg = torch.linalg.eigh(gradient_covariance.detach().to(torch.float64))
        return cls(
            Va.shape[0],
            Vg.shape[0],
            rank,
            init="pca",
            activation_eigenvectors=Va,
            gradient_eigenvectors=Vg,
            activation_eigenvalues=va,
            gradient_eigenvalues=vg,
            dtype=dtype,
        )

    def num_coordinates(self) -> int:
        return self.rank * self.rank

    def project(self, a: Tensor, g: Tensor) -> Tensor:
        """a: ``(B, T, d_in)``, g: ``(B, T, d_out)`` -> ``(B, rank**2)``."""
        a, g = _check_factors(a, g, self.d_in, self.d_out)
        pa = a @ self.P_a.to(a.dtype)  # (B, T, r)
        pg = g @ self.P_g.to(g.dtype)  # (B, T, r)
        return torch.einsum("btr,bts->brs", pg, pa).reshape(a.shape[0], -1)


# --------------------------------------------------------------------------- GraSS


class GraSSProjector:
    """FactGraSS: factor-wise random masking followed by a CountSketch to ``k`` outputs.

    The mask keeps ``m_in`` random input features and ``m_out`` random output features
    (without replacement), with ``m_in * m_out`` close to ``mask_factor * k`` and the two
    sizes balanced where the layer allows. The masked gradient ``g_m^T a_m``
    ``(m_out, m_in)`` is formed from the masked factors, scaled by
    ``sqrt(d_in d_out / (m_in m_out))`` so that masked inner products are unbiased, and
    each of its entries ``j`` (row-major) is added to bucket ``buckets[j]`` with sign
    ``signs[j]``.
    """

    def __init__(self, d_in: int, d_out: int, k: int, seed: int = 0, mask_factor: float = 4.0):
        self.d_in = _positive_int(d_in, "d_in")
        self.d_out = _positive_int(d_out, "d_out")
        self.k = _positive_int(k, "k")
        if isinstance(mask_factor, bool) or not isinstance(mask_factor, (int, float)) or not mask_factor >= 1:
            raise ConfigError(f"mask_factor must be a number >= 1, got {mask_factor!r}")
        self.mask_factor = float(mask_factor)
        self.m_in, self.m_out = self._mask_sizes(d_in, d_out, math.ceil(self.mask_factor * k))
        if self.m_in * self.m_out < k:
            raise ConfigError(f"k={k} exceeds the module's {d_in * d_out} gradient entries")
        gen = _generator(seed)
        self.input_indices = torch.sort(torch.randperm(d_in, generator=gen)[: self.m_in]).values
        self.output_indices = torch.sort(torch.randperm(d_out, generator=gen)[: self.m_out]).values
        n_masked = self.m_in * self.m_out
        self.buckets = torch.randint(0, k, (n_masked,), generator=gen)
        self.signs = torch.randint(0, 2, (n_masked,), generator=gen).to(torch.float32) * 2 - 1
        self.scale = math.sqrt(d_in * d_out / n_masked)
        self.name = "grass"

    @staticmethod
    def _mask_sizes(d_in: int, d_out: int, target: int) -> tuple[int, int]:
        # Balanced split of the target entry count; a side capped by its layer width hands
        # the remainder to the other side.
        side = math.isqrt(max(target - 1, 0)) + 1  # ceil(sqrt(target))
        m_in = min(d_in, side)
        m_out = min(d_out, -(-target // m_in))
        m_in = min(d_in, -(-target // m_out))
        return m_in, m_out

    def num_coordinates(self) -> int:
        return self.k

    def project(self, a: Tensor, g: Tensor) -> Tensor:
        """a: ``(B, T, d_in)``, g: ``(B, T, d_out)`` -> ``(B, k)``."""
        a, g = _check_factors(a, g, self.d_in, self.d_out)
        masked = torch.einsum("bto,bti->boi", g[..., self.output_indices], a[..., self.input_indices])
        flat = masked.reshape(a.shape[0], -1) * (self.signs.to(a.dtype) * self.scale)
        out = torch.zeros(a.shape[0], self.k, dtype=a.dtype)
        return out.index_add_(1, self.buckets, flat)


# --------------------------------------------------------------------------- Gaussian


class GaussianProjector:
    """Gaussian random-projection control: standard Gaussian factors, ``rank**2`` coordinates.

    Training coordinates are ``vec(P_g^T G P_a)`` with i.i.d. N(0, 1) entries in
    P_a ``(d_in, rank)`` and P_g ``(d_out, rank)``. Query gradients are preconditioned in the
    full parameter space (damped EK-FAC inverse) *before* projection, and influence is
    ``rank**-2 * <project(H^{-1} Q), project(G)>`` (see :meth:`score`), which is unbiased
    for ``<H^{-1} Q, G>``.
    """

    def __init__(self, d_in: int, d_out: int, rank: int, seed: int = 0, *, dtype: torch.dtype = torch.float32):
        self.d_in = _positive_int(d_in, "d_in")
        self.d_out = _positive_int(d_out, "d_out")
        self.rank = _positive_int(rank, "rank")
        gen = _generator(seed)
        self.P_a = torch.randn(d_in, rank, generator=gen, dtype=torch.float64).to(dtype)
        self.P_g = torch.randn(d_out, rank, generator=gen, dtype=torch.float64).to(dtype)
        self.name = "gaussian"

    @property
    def inner_product_scale(self) -> float:
        return 1.0 / (self.rank * self.rank)

    def num_coordinates(self) -> int:
        return self.rank * self.rank

    def project(self, a: Tensor, g: Tensor) -> Tensor:
        """Training side. a: ``(B, T, d_in)``, g: ``(B, T, d_out)`` -> ``(B, rank**2)``."""
        a, g = _check_factors(a, g, self.d_in, self.d_out)
        pa = a @ self.P_a.to(a.dtype)
        pg = g @ self.P_g.to(g.dtype)
        return torch.einsum("btr,bts->brs", pg, pa).reshape(a.shape[0], -1)

    def project_dense(self, gradients: Tensor) -> Tensor:
        """gradients: ``(B, d_out, d_in)`` dense (e.g. already preconditioned) -> ``(B, rank**2)``."""
        if (
            not isinstance(gradients, Tensor)
            or gradients.dim() != 3
            or tuple(gradients.shape[1:]) != (self.d_out, self.d_in)
        ):
            shape = tuple(gradients.shape) if isinstance(gradients, Tensor) else type(gradients).__name__
            raise InputError(f"gradients must have shape (B, {self.d_out}, {self.d_in}), got {shape}")
        x = gradients if gradients.dtype in (torch.float32, torch.float64) else gradients.to(torch.float32)
        return (self.P_g.to(x.dtype).T @ x @ self.P_a.to(x.dtype)).reshape(x.shape[0], -1)

    def project_query(self, a: Tensor, g: Tensor, precondition: Callable[[Tensor], Tensor]) -> Tensor:
        """Query side: dense ``G_b = g_b^T a_b``, then ``precondition`` (``(B, d_out, d_in)`` ->
        same shape, the damped EK-FAC inverse), then projection -> ``(B, rank**2)``.

        The dense query gradient is unavoidable here: the EK-FAC inverse mixes all of a
        module's coordinates, and queries are few.
        """
        a, g = _check_factors(a, g, self.d_in, self.d_out)
        dense = torch.einsum("bto,bti->boi", g, a)
        pre = precondition(dense)
        if not isinstance(pre, Tensor) or pre.shape != dense.shape:
            shape = tuple(pre.shape) if isinstance(pre, Tensor) else type(pre).__name__
            raise InputError(f"precondition must return a tensor of shape {tuple(dense.shape)}, got {shape}")
        return self.project_dense(pre)

    def score(self, query_coords: Tensor, train_coords: Tensor) -> Tensor:
        """query_coords: ``(nq, rank**2)`` from :meth:`project_query`; train_coords:
        ``(n, rank**2)`` from :meth:`project` -> ``(nq, n)`` module influence."""
        return (query_coords @ train_coords.to(query_coords.dtype).T) * self.inner_product_scale
