"""The two-stage projection against dense float64 math, and Proposition 2."""

import pytest
import torch
from scipy.linalg import hadamard

from eogp_index.config import ProjectionConfig, StorageConfig
from eogp_index.errors import ModelError
from eogp_index.fit.curvature import ModuleCurvature
from eogp_index.fit.projection import (
    apply_pca,
    apply_pca_groups,
    build_projection,
    first_stage_from_curvature,
    fit_pca,
    fwht,
    make_srht,
    srht_apply,
)
from eogp_index.store.projection_file import load_projection, save_projection


def _orthonormal(n, gen):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q


def _curvature(d_out=6, d_in=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    eig = torch.rand(d_out, d_in, generator=gen, dtype=torch.float64) ** 3
    return ModuleCurvature(
        activation_eigenvectors=_orthonormal(d_in, gen).float(),
        gradient_eigenvectors=_orthonormal(d_out, gen).float(),
        eigenvalues=eig.float(),
    )


@pytest.mark.parametrize(
    "d_out,d_in,m,route",
    [
        (6, 5, 11, None),
        (6, 5, 11, "factors"),
        (6, 5, 11, "rotate_after_g"),
        (6, 5, 11, "rotate_after_a"),
        (48, 40, 5, None),
    ],
    ids=["matmul-path", "factors", "rotate-after-g", "rotate-after-a", "gather-path"],
)
def test_first_stage_equals_dense_eigenbasis_selection(d_out, d_in, m, route):
    curv = _curvature(d_out, d_in)
    proj = first_stage_from_curvature(curv, m, damping_ratio=0.1)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 7, d_in, generator=gen)
    g = torch.randn(4, 7, d_out, generator=gen)
    # Tokens with zero output gradient (padding, text after the last counted label) are skipped
    # by the projection; their activations must not matter, and a fully dead example gives 0.
    g[0, 4:] = 0
    g[2] = 0
    got = proj.first_stage(a, g, route=route).double()
    assert torch.count_nonzero(got[2]) == 0
    # Dense reference: rotate the dense gradient, keep the m largest-Λ coordinates, whiten.
    G = torch.einsum("bto,bti->boi", g.double(), a.double())
    q_s, q_a = curv.gradient_eigenvectors.double(), curv.activation_eigenvectors.double()
    rotated = (q_s.T @ G @ q_a).reshape(4, -1)  # never formed by the projection itself
    lam = curv.eigenvalues.double().reshape(-1)
    top = torch.argsort(lam, descending=True, stable=True)[:m]
    damping = 0.1 * lam.mean()
    expected = rotated[:, top] / torch.sqrt(lam[top] + damping)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert proj.damping == pytest.approx(float(damping))


def test_block_route_picks_the_fewest_multiply_adds():
    from eogp_index.fit.projection import block_route

    # Long documents, most eigenvectors touched (small models): rotate per example, not per token.
    assert block_route(n=8 * 2048, batch=8, d_out=512, r=264, d_in=129, c=60) == "rotate_after_g"
    assert block_route(n=8 * 2048, batch=8, d_out=60, r=60, d_in=2048, c=300) == "rotate_after_a"
    # Short documents: per-token rotations are cheaper than the per-example ones.
    assert block_route(n=8 * 4, batch=8, d_out=512, r=264, d_in=129, c=60) == "factors"


def test_damping_equals_kronfluence_heuristic():
    from kronfluence.arguments import ScoreArguments
    from kronfluence.factor.config import FactorConfig

    gen = torch.Generator().manual_seed(3)
    lambda_sum = torch.rand(6, 5, generator=gen) * 40  # kronfluence stores a sum over examples
    count = torch.tensor(8.0)
    storage = {
        "activation_eigenvectors": torch.eye(5),
        "gradient_eigenvectors": torch.eye(6),
        "activation_eigenvalues": None,
        "gradient_eigenvalues": None,
        "lambda_matrix": lambda_sum.clone(),
        "num_lambda_processed": count,
    }
    FactorConfig.CONFIGS["ekfac"].prepare(storage, ScoreArguments(damping_factor=None), torch.device("cpu"))
    kron_damping = (1.0 / storage["lambda_matrix"].double() - lambda_sum.double() / 8.0).mean()
    ours = ModuleCurvature(torch.eye(5), torch.eye(6), (lambda_sum / count)).damping(0.1)
    assert ours == pytest.approx(float(kron_damping), rel=1e-5)


def test_proposition_2_pca_beats_top_k_axes_within_the_span():
    gen = torch.Generator().manual_seed(2)
    n, m, k = 200, 24, 6
    # First-stage coordinates with off-diagonal structure that the EK-FAC axes miss.
    mixing = torch.randn(m, m, generator=gen, dtype=torch.float64)
    z = torch.randn(n, m, generator=gen, dtype=torch.float64) @ mixing
    P = fit_pca(z.float(), k).double()
    torch.testing.assert_close(P.T @ P, torch.eye(k, dtype=torch.float64), atol=1e-5, rtol=0)
    pca_energy = ((z @ P) ** 2).sum(1).mean()
    axes_energy = (z[:, :k] ** 2).sum(1).mean()
    assert pca_energy >= axes_energy  # (i): reconstruction error is never larger
    for seed in range(5):  # and it is minimal among k-dim subspaces of the span
        W, _ = torch.linalg.qr(torch.randn(m, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        assert pca_energy >= ((z @ W) ** 2).sum(1).mean() - 1e-9
    # (ii): equals the sum of the top-k eigenvalues of the second moment
    top = torch.linalg.eigvalsh(z.T @ z / n).flip(0)[:k].sum()
    assert float(pca_energy) == pytest.approx(float(top), rel=1e-5)


def test_gram_route_spans_the_same_subspace_as_the_direct_route():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(10, 40, generator=gen, dtype=torch.float64) * torch.linspace(3, 0.1, 40, dtype=torch.float64)
    P_gram = fit_pca(z.float(), 5).double()  # n < m: n×n Gram matrix
    w, v = torch.linalg.eigh(z.T @ z)
    P_direct = v.flip(1)[:, :5]
    torch.testing.assert_close(P_gram @ P_gram.T, P_direct @ P_direct.T, atol=1e-4, rtol=0)


def test_pca_completes_a_rank_deficient_fitting_set_with_leading_axes():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    with pytest.warns(UserWarning, match="spans only 3"):
        P = fit_pca(z.float(), 6).double()
    torch.testing.assert_close(P.T @ P, torch.eye(6, dtype=torch.float64), atol=1e-5, rtol=0)
    # A fitting set that lies along a few axes: candidate axes nearly inside the span must be
    # dropped, not normalised into noise.
    z = torch.zeros(4, 10, dtype=torch.float64)
    z[:, :3] = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    z[:, 3] = 1e-7 * torch.randn(4, generator=gen, dtype=torch.float64)
    with pytest.warns(UserWarning):
        P = fit_pca(z.float(), 10).double()
    torch.testing.assert_close(P.T @ P, torch.eye(10, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(z @ P @ P.T, z, atol=1e-5, rtol=0)  # the data's span is kept whole


def _complete_axis_by_axis(z: torch.Tensor, k: int) -> torch.Tensor:
    """The completion's definition, one candidate axis at a time: PCA of the span, then each
    leading axis orthogonalised (twice) against the basis so far and kept when its residual is
    above 1e-4."""
    weights, vectors = torch.linalg.eigh(z @ z.T)
    weights, vectors = weights.flip(0), vectors.flip(1)
    rank = int((weights > weights[0] * 1e-10).sum())
    basis = (z.T @ vectors[:, :rank]) / weights[:rank].sqrt()
    for j in range(z.shape[1]):
        if basis.shape[1] == k:
            break
        v = torch.zeros(z.shape[1], 1, dtype=torch.float64)
        v[j] = 1.0
        for _ in range(2):
            v = v - basis @ (basis.T @ v)
        if v.norm() > 1e-4:
            basis = torch.cat([basis, v / v.norm()], dim=1)
    return basis


def test_blocked_completion_equals_axis_by_axis(monkeypatch):
    """Blocks of axes (here 3 at a time, so that several blocks and a skip inside one occur)
    give the directions the axis-by-axis definition gives."""
    import eogp_index.fit.projection as projection

    monkeypatch.setattr(projection, "_COMPLETION_BLOCK", 3)
    gen = torch.Generator().manual_seed(8)
    z = torch.zeros(4, 30, dtype=torch.float64)
    z[0, 0], z[1, 2] = 1.0, 2.0  # axes 0 and 2 lie in the span: skipped
    z[2:] = torch.randn(2, 30, generator=gen, dtype=torch.float64)
    for k in (6, 9, 20):
        with pytest.warns(UserWarning, match="spans only 4"):
            got = fit_pca(z.float(), k).double()
        expected = _complete_axis_by_axis(z.float().double(), k)
        torch.testing.assert_close(got, expected.float().double(), atol=1e-6, rtol=0)


def test_fwht_and_srht_normalisation():
    for p in (1, 2, 16, 512, 2048):  # square and non-square Kronecker splits
        x = torch.randn(3, p, dtype=torch.float64)
        torch.testing.assert_close(fwht(x), x @ torch.tensor(hadamard(p), dtype=torch.float64).T)
    signs, rows = make_srht(16, 4, torch.Generator().manual_seed(0))
    S_T = srht_apply(torch.eye(16, dtype=torch.float64), signs.double(), rows)  # (m, k) = S^T
    # S = sqrt(p/k) R H D with orthonormal H: S S^T = (p/k) I_k, and E[S^T S] = I_m.
    torch.testing.assert_close(S_T.T @ S_T, torch.eye(4, dtype=torch.float64) * 4, atol=1e-9, rtol=0)


def test_projection_roundtrips_through_safetensors(tmp_path):
    curv = {"a": _curvature(seed=0), "b": _curvature(4, 3, seed=1)}
    for variant in ("eogp-r", "ekfac-topk"):
        proj = build_projection(curv, ProjectionConfig(variant=variant, k=4, m=8), StorageConfig())
        digest = save_projection(proj, tmp_path / "p.safetensors")
        loaded = load_projection(tmp_path / "p.safetensors")
        assert loaded.k == proj.k and loaded.names == ["a", "b"] and len(digest) == 64
        a, g = torch.randn(2, 3, 5), torch.randn(2, 3, 6)
        torch.testing.assert_close(loaded.transform("a", a, g), proj.transform("a", a, g))


@pytest.mark.parametrize("block_bytes", [64 << 20, 4 * 7 * 5])  # one block; blocks of 5 rows, the last short
def test_apply_pca_upcasts_fp16_p_exactly_through_a_reused_buffer(monkeypatch, block_bytes):
    # An FP16 P is applied in float32 through a per-thread buffer reused across calls and shapes:
    # every call must equal the float32 product of the coordinates rounded to FP16 (as the fit's
    # PCA saw them) and P upcast, whatever the buffer held before.
    import eogp_index.fit.projection as projection

    monkeypatch.setattr(projection, "_UPCAST_BYTES", block_bytes)
    g = torch.Generator().manual_seed(3)
    shapes = [(23, 7), (4, 3), (23, 7), (9, 11)]  # a smaller P between two large ones
    for m, k in shapes:
        pca = torch.randn(m, k, generator=g).half()
        z = torch.randn(6, m, generator=g)
        expected = z.half().double() @ pca.double()
        got = apply_pca(z, pca)
        assert got.dtype == torch.float32 and got.shape == (6, k)
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
        if block_bytes > m * k * 4:  # one block: the very product of a float32 P
            assert torch.equal(got, z.half().float() @ pca.float())
        # Several row groups at once (P upcast once for all): each gets what it gets alone, also
        # from coordinates already at P's dtype (block ingest's cache).
        groups = [z[:1], z[1:5], z[5:]]
        for group, alone in zip(apply_pca_groups([t.half() for t in groups], pca), groups):
            assert torch.equal(group, apply_pca(alone, pca))


def test_apply_pca_refuses_coordinates_that_overflow_fp16():
    pca = torch.ones(3, 2).half()
    with pytest.raises(ModelError, match="overflow"):
        apply_pca(torch.tensor([[1.0, 7e4, 0.0]]), pca)


def test_the_default_variant_is_the_tiers():
    """No variant given: auto (every module drawn a rotation, kept where recall chooses it) with a
    rescoring tier, the paper's eogp (no rotation) without one; a given variant wins."""
    curv = {"a": _curvature(seed=0), "b": _curvature(4, 3, seed=1)}
    tiered = build_projection(curv, ProjectionConfig(k=4, m=8), StorageConfig())
    assert tiered.config.variant == "auto" and all(m.rotation is not None for m in tiered.modules.values())
    plain = build_projection(curv, ProjectionConfig(k=4, m=8), StorageConfig(rescore="none"))
    assert plain.config.variant == "eogp" and all(m.rotation is None for m in plain.modules.values())
    forced = build_projection(curv, ProjectionConfig(variant="eogp", k=4, m=8), StorageConfig())
    assert forced.config.variant == "eogp" and all(m.rotation is None for m in forced.modules.values())
