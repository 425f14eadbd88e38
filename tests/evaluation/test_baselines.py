"""Tests of the compression baselines against dense reference computations."""

from __future__ import annotations

import pytest
import torch

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation.baselines import (
    GaussianProjector,
    GraSSProjector,
    LoGraProjector,
    ProjectedCurvature,
    Projector,
    bytes_for_coordinates,
    k_for_bytes,
    rank_for_bytes,
)

B, T, D_IN, D_OUT = 3, 5, 7, 6


def _factors(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(B, T, D_IN, generator=gen, dtype=dtype)
    g = torch.randn(B, T, D_OUT, generator=gen, dtype=dtype)
    return a, g


def _dense(a, g):
    return torch.einsum("bto,bti->boi", g, a)  # (B, d_out, d_in)


# ----------------------------------------------------------------------------- LoGra


@pytest.mark.parametrize("init", ["random", "pca"])
def test_logra_matches_dense(init):
    a, g = _factors()
    if init == "random":
        proj = LoGraProjector(D_IN, D_OUT, 3, init="random", seed=1, dtype=torch.float64)
    else:
        proj = LoGraProjector.from_covariances(
            torch.einsum("bti,btj->ij", a, a), torch.einsum("bti,btj->ij", g, g), 3, dtype=torch.float64
        )
    coords = proj.project(a, g)
    expected = (proj.P_g.T @ _dense(a, g) @ proj.P_a).reshape(B, -1)
    assert coords.shape == (B, 9) and proj.num_coordinates() == 9
    torch.testing.assert_close(coords, expected, rtol=1e-12, atol=1e-12)
    assert isinstance(proj, Projector)


def test_logra_pca_selects_top_eigenvectors_by_eigenvalue():
    a_vecs = torch.eye(D_IN, dtype=torch.float64)
    a_vals = torch.arange(D_IN, dtype=torch.float64)  # ascending, as eigh returns
    g_vecs = torch.eye(D_OUT, dtype=torch.float64)
    g_vals = torch.tensor([5.0, 1.0, 3.0, 0.0, 4.0, 2.0], dtype=torch.float64)
    proj = LoGraProjector(
        D_IN,
        D_OUT,
        2,
        init="pca",
        activation_eigenvectors=a_vecs,
        gradient_eigenvectors=g_vecs,
        activation_eigenvalues=a_vals,
        gradient_eigenvalues=g_vals,
        dtype=torch.float64,
    )
    torch.testing.assert_close(proj.P_a, a_vecs[:, [6, 5]])
    torch.testing.assert_close(proj.P_g, g_vecs[:, [0, 4]])


def test_logra_pca_without_eigenvalues_raises():
    with pytest.raises(ConfigError):
        LoGraProjector(
            D_IN, D_OUT, 2, init="pca", activation_eigenvectors=torch.eye(D_IN), gradient_eigenvectors=torch.eye(D_OUT)
        )


def test_logra_float32_default_and_2d_inputs():
    a, g = _factors(dtype=torch.float32)
    proj = LoGraProjector(D_IN, D_OUT, 2, seed=0)
    assert proj.project(a, g).dtype == torch.float32
    # (B, d) is one token per example.
    torch.testing.assert_close(proj.project(a[:, 0], g[:, 0]), proj.project(a[:, :1], g[:, :1]))


def test_projector_rejects_wrong_shapes():
    proj = LoGraProjector(D_IN, D_OUT, 2, seed=0)
    a, g = _factors(dtype=torch.float32)
    with pytest.raises(InputError):
        proj.project(a[..., :-1], g)
    with pytest.raises(InputError):
        proj.project(a, g[:, :-1])
    with pytest.raises(ConfigError):
        LoGraProjector(D_IN, D_OUT, D_OUT + 1)


# ----------------------------------------------------------------------------- GraSS


def test_grass_matches_dense_sketch():
    d_in, d_out, k = 20, 16, 10
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(B, T, d_in, generator=gen, dtype=torch.float64)
    g = torch.randn(B, T, d_out, generator=gen, dtype=torch.float64)
    proj = GraSSProjector(d_in, d_out, k, seed=4, mask_factor=4)
    assert proj.m_in * proj.m_out >= 4 * k
    assert proj.m_in < d_in and proj.m_out < d_out

    # Dense sketch matrix S (k, d_out * d_in) from the same mask and hash.
    S = torch.zeros(k, d_out * d_in, dtype=torch.float64)
    j = 0
    for o in proj.output_indices.tolist():
        for i in proj.input_indices.tolist():
            S[proj.buckets[j], o * d_in + i] += proj.signs[j].item() * proj.scale
            j += 1
    expected = _dense(a, g).reshape(B, -1) @ S.T
    coords = proj.project(a, g)
    assert coords.shape == (B, k)
    torch.testing.assert_close(coords, expected, rtol=1e-12, atol=1e-12)


def test_grass_mask_sizes_capped_by_layer():
    proj = GraSSProjector(3, 50, 20, seed=0, mask_factor=4)
    assert proj.m_in == 3 and proj.m_in * proj.m_out >= 80
    with pytest.raises(ConfigError):
        GraSSProjector(3, 3, 10)


# ----------------------------------------------------------------------------- Gaussian


def test_gaussian_query_path_and_scaling():
    a, g = _factors()
    proj = GaussianProjector(D_IN, D_OUT, 3, seed=5, dtype=torch.float64)
    train = proj.project(a, g)
    torch.testing.assert_close(train, proj.project_dense(_dense(a, g)))
    weights = torch.rand(D_OUT, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    query = proj.project_query(a[:2], g[:2], lambda G: G / weights)
    torch.testing.assert_close(query, proj.project_dense(_dense(a[:2], g[:2]) / weights))
    scores = proj.score(query, train)
    assert scores.shape == (2, B)
    torch.testing.assert_close(scores, query @ train.T / 9.0)


def test_gaussian_inner_products_unbiased():
    # Averaged over many draws, rank^-2 <P^T X P, P^T Y P> approaches <X, Y>.
    gen = torch.Generator().manual_seed(6)
    X = torch.randn(1, D_OUT, D_IN, generator=gen, dtype=torch.float64)
    Y = X + 0.5 * torch.randn(1, D_OUT, D_IN, generator=gen, dtype=torch.float64)
    est = torch.stack(
        [
            (lambda p: p.score(p.project_dense(X), p.project_dense(Y)))(
                GaussianProjector(D_IN, D_OUT, 4, seed=s, dtype=torch.float64)
            )
            for s in range(400)
        ]
    ).mean()
    exact = (X * Y).sum()
    assert abs(est - exact) < 0.1 * abs(exact)


# ----------------------------------------------------------------------------- curvature


def test_projected_curvature_matches_dense_solve():
    gen = torch.Generator().manual_seed(7)
    coords = torch.randn(50, 8, generator=gen, dtype=torch.float64) @ torch.randn(
        8, 8, generator=gen, dtype=torch.float64
    )
    q = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    curv = ProjectedCurvature.fit(coords, damping_ratio=0.1)
    C = coords.T @ coords / 50
    lam = 0.1 * torch.trace(C) / 8
    H = C + lam * torch.eye(8, dtype=torch.float64)
    assert curv.damping == pytest.approx(float(lam))
    torch.testing.assert_close(curv.precondition(q), torch.linalg.solve(H, q.T).T, rtol=1e-10, atol=1e-12)
    assert curv.precondition(q.float()).dtype == torch.float32


def test_projected_curvature_rejects_bad_input():
    with pytest.raises(InputError):
        ProjectedCurvature.fit(torch.zeros(5, 3))
    curv = ProjectedCurvature.fit(torch.randn(5, 3))
    with pytest.raises(InputError):
        curv.precondition(torch.randn(2, 4))
    with pytest.raises(ConfigError):
        ProjectedCurvature.fit(torch.randn(5, 3), damping_ratio=0.0)


# ----------------------------------------------------------------------------- seeds


@pytest.mark.parametrize(
    "make",
    [
        lambda s: LoGraProjector(D_IN, D_OUT, 3, seed=s),
        lambda s: GraSSProjector(D_IN, D_OUT, 8, seed=s),
        lambda s: GaussianProjector(D_IN, D_OUT, 3, seed=s),
    ],
)
def test_projections_deterministic_under_seed_and_differ_across_seeds(make):
    a, g = _factors(dtype=torch.float32)
    first, again, other = make(0).project(a, g), make(0).project(a, g), make(1).project(a, g)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


# ----------------------------------------------------------------------------- budgets


def test_budget_helpers():
    assert rank_for_bytes(2 * 64 * 64) == 64
    assert rank_for_bytes(2 * 64 * 64 - 1) == 63
    assert k_for_bytes(1000) == 500
    assert k_for_bytes(1000, precision="fp32") == 250
    assert k_for_bytes(258, precision="1bit") == 2048
    assert bytes_for_coordinates(2048, "1bit") == 258
    assert bytes_for_coordinates(2048) == 4096
    assert rank_for_bytes(258, precision="1bit") == 45
    with pytest.raises(ConfigError):
        k_for_bytes(1)
    with pytest.raises(ConfigError):
        k_for_bytes(100, precision="int8")
