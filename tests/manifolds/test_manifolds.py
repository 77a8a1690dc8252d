"""Manifold-specific behaviour beyond the generic contract: msign accuracy, errors, the boundary of
BoundedDGram, geoopt interop."""

import geoopt
import pytest
import torch

from manifolds import (
    BoundedDGram,
    DGram,
    Euclidean,
    Oblique,
    Stiefel,
    get_manifold,
    matrix_sign,
    msign,
    polar,
    polar_near_orthogonal,
    to_tall,
)

ALL = [Stiefel(), DGram(), Oblique(), Euclidean(), BoundedDGram(1.5)]


def _gaussian(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- msign accuracy
def test_msign_svd_is_exact():
    X = _gaussian(64, 16)
    s = torch.linalg.svdvals(msign(X, "svd"))
    assert (s - 1).abs().max() < 1e-13


@pytest.mark.parametrize("shape", [(96, 24), (24, 96), (3, 20, 20)])
def test_polar_express_float32_converges(shape):
    # 12 steps: 7 optimal ones bring sigma/|X|_F >= 1e-3 into [0.99, 1.01], the cubic-order
    # (15/8, -10/8, 3/8) tail then squares the error away: float32 round-off level.
    X = _gaussian(*shape, seed=1, dtype=torch.float32)
    s = torch.linalg.svdvals(msign(X, "polar_express", steps=12).double())
    assert (s - 1).abs().max() < 1e-4
    ref = msign(X.double(), "svd")
    assert (msign(X, "polar_express", steps=12).double() - ref).abs().max() < 1e-4


def test_polar_express_five_steps_is_a_direction_not_a_retraction():
    # Muon's 5-step variant: singular values only roughly 1 (well-conditioned Gaussian input).
    X = _gaussian(256, 64, seed=2, dtype=torch.float32)
    s = torch.linalg.svdvals(msign(X, "polar_express", steps=5))
    assert 0.6 < float(s.min()) and float(s.max()) < 1.25
    assert float((s - 1).abs().max()) > 1e-3  # not accurate enough for a retraction


def test_polar_express_bf16_runs_and_returns_input_dtype():
    X = _gaussian(64, 32, seed=3, dtype=torch.float32)
    Y = msign(X, "polar_express", steps=5, compute_dtype=torch.bfloat16)
    assert Y.dtype == torch.float32
    s = torch.linalg.svdvals(Y)
    assert 0.5 < float(s.min()) and float(s.max()) < 1.3


def test_newton_schulz_converges():
    X = _gaussian(40, 10, seed=4)
    s = torch.linalg.svdvals(msign(X, "newton_schulz", steps=40))
    assert (s - 1).abs().max() < 1e-10


@pytest.mark.parametrize("method", ["svd", "polar_express", "newton_schulz"])
def test_msign_zero_matrix_is_zero(method):
    X = torch.zeros(2, 5, 3)
    X[1] = _gaussian(5, 3, dtype=torch.float32)
    Y = msign(X, method)
    assert torch.equal(Y[0], torch.zeros(5, 3)) and float(Y[1].abs().max()) > 0.1


def test_msign_errors():
    with pytest.raises(ValueError, match="valid: svd, polar_express, newton_schulz"):
        msign(torch.ones(3, 3), "qr")
    with pytest.raises(ValueError, match="at least 2 dims"):
        msign(torch.ones(3))


def test_polar_matches_svd_on_cpu():
    X = _gaussian(30, 7, seed=5)
    assert torch.allclose(polar(X), msign(X, "svd"), atol=1e-14)


@pytest.mark.parametrize(
    "fixture", ["sgesdd_clustered_128.npz", "sgesdd_nan_128.npz", "sgesdd_nonorthonormal_512x128.npz"]
)
def test_svd_polar_survives_float32_lapack_breakdown(fixture):
    # Real Stiefel retraction inputs from training (mini, all-stiefel, seeds 1 and 0): W + dW for a
    # 128x128 attn.c_proj, every singular value in [1.0000, 1.0002]. On the first, MKL's sgesdd
    # fails to converge (raises); on the second it returns NaN singular vectors. The third is a
    # 512x128 MLP matrix of the 2,000-step all-stiefel run (step 1,009, singular values in
    # [1.00004, 1.00011]): there sgesdd returns finite U and V with max|U^T U - I| = 0.999. polar() must give
    # the exact polar factor either way (before the fix Manifold Muon skipped these updates). On a
    # LAPACK where sgesdd copes, this checks the plain path.
    import pathlib

    import numpy as np

    X = torch.from_numpy(np.load(pathlib.Path(__file__).resolve().parents[1] / "fixtures" / fixture)["x"])
    assert X.dtype == torch.float32
    # the SVD path (polar_method="svd"; "auto" takes these near-orthonormal inputs to Newton-Schulz, below)
    Q = Stiefel(polar_method="svd").projx(X)
    assert Q.dtype == torch.float32 and bool(torch.isfinite(Q).all())
    # float32 orthonormality: 128 columns, rounding ~6e-8 each, measured 3.6e-7 and 4.8e-7
    assert (Q.mT @ Q - torch.eye(128)).abs().max() < 5e-6
    assert (Q.double() - msign(X.double(), "svd")).abs().max() < 1e-5
    # the default retraction never calls LAPACK on them: the same polar factor from matrix products alone
    Q_ns = Stiefel().projx(X)
    assert (Q_ns.mT @ Q_ns - torch.eye(128)).abs().max() < 5e-6
    assert (Q_ns.double() - msign(X.double(), "svd")).abs().max() < 1e-5


def test_svd_polar_retries_in_float64_when_lapack_fails(monkeypatch):
    real_svd = torch.linalg.svd
    calls = []

    def flaky_svd(A, *args, **kwargs):
        calls.append(A.dtype)
        if A.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real_svd(A, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", flaky_svd)
    X = _gaussian(20, 6, seed=3, dtype=torch.float32)
    Q = msign(X, "svd")
    assert calls == [torch.float32, torch.float64] and Q.dtype == torch.float32
    assert (torch.linalg.svdvals(Q.double()) - 1).abs().max() < 1e-6
    with pytest.raises(torch.linalg.LinAlgError):  # float64 failing too is reported, not hidden
        monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: (_ for _ in ()).throw(torch.linalg.LinAlgError("x")))
        msign(X.double(), "svd")


def test_svd_polar_retries_in_float64_when_lapack_returns_nan(monkeypatch):
    real_svd = torch.linalg.svd

    def nan_svd(A, *args, **kwargs):
        U, S, Vh = real_svd(A, *args, **kwargs)
        return (U * float("nan"), S, Vh) if A.dtype == torch.float32 else (U, S, Vh)

    monkeypatch.setattr(torch.linalg, "svd", nan_svd)
    X = _gaussian(3, 20, 6, seed=4, dtype=torch.float32)
    Q = msign(X, "svd")
    assert Q.dtype == torch.float32 and bool(torch.isfinite(Q).all())
    assert (Q.double() - msign(X.double(), "svd")).abs().max() < 1e-6

    def all_nan_svd(A, *a, **k):
        return tuple(t * float("nan") for t in real_svd(A, *a, **k))

    with pytest.raises(torch.linalg.LinAlgError, match="non-finite"):
        monkeypatch.setattr(torch.linalg, "svd", all_nan_svd)
        msign(X.double(), "svd")


@pytest.mark.parametrize("factor", ["U", "V"])
def test_svd_polar_retries_in_float64_when_lapack_returns_non_orthonormal_factors(monkeypatch, factor):
    # the failure seen in training: finite factors, one of them not orthonormal (a rank-4 defect here),
    # so U V^T is far from a polar factor; the float32 check must catch it and redo the batch in float64
    real_svd = torch.linalg.svd

    def broken_svd(A, *args, **kwargs):
        U, S, Vh = real_svd(A, *args, **kwargs)
        if A.dtype == torch.float32:
            if factor == "U":
                U = U.clone()
                U[..., :4] = U[..., :4] * 3.0  # finite, but U^T U != I
            else:
                Vh = Vh.clone()
                Vh[..., 0, :] = Vh[..., 1, :]  # two equal right singular vectors
        return U, S, Vh

    X = Stiefel().random(3, 40, 12, dtype=torch.float32, generator=torch.Generator().manual_seed(5))
    X = X + 1e-3 * _gaussian(3, 40, 12, seed=6, dtype=torch.float32)  # W + dW, near the manifold
    monkeypatch.setattr(torch.linalg, "svd", broken_svd)
    Q = Stiefel(polar_method="svd").projx(X)
    assert Q.dtype == torch.float32
    assert (Q.mT @ Q - torch.eye(12)).abs().max() < 5e-6  # on the manifold, as an unbroken SVD leaves it
    monkeypatch.setattr(torch.linalg, "svd", real_svd)
    assert (Q.double() - msign(X.double(), "svd")).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(40, 12), (12, 40), (3, 64, 16), (16, 16)], ids=str)
@pytest.mark.parametrize("lr", [0.0, 0.02, 0.1])
def test_polar_near_orthogonal_is_the_polar_factor(dtype, shape, lr):
    # a Stiefel retraction input W - lr A (A tangent, ||A||_op = 1): Newton-Schulz gives the exact polar factor to
    # the dtype's rounding. Against a float64 SVD: float32 measured 1-4e-7 (products of 16-64 terms of ~6e-8
    # rounding), so 2e-6; float64 1e-13 (measured ~1e-15, the margin covers the last step's products).
    man = Stiefel()
    W = man.random(*shape, dtype=dtype, generator=torch.Generator().manual_seed(7))
    A = man.proju(W, _gaussian(*shape, seed=8, dtype=dtype))
    A = A / torch.linalg.matrix_norm(A.double(), ord=2).to(dtype)[..., None, None]
    X = W - lr * A
    Q = polar_near_orthogonal(X)
    assert Q.dtype == dtype and Q.shape == X.shape
    ref = msign(X.double(), "svd")
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    assert float((Q.double() - ref).abs().max()) < tol
    # the default Stiefel retraction takes this path (a zero step returns W itself, bitwise)
    assert torch.allclose(man.retr(W, -lr * A), Q) if lr else torch.equal(man.retr(W, -lr * A), W)


def test_polar_near_orthogonal_sends_far_matrices_to_polar(monkeypatch):
    # per batch entry: an entry far from orthonormal (||X^T X - I||_F > NEAR_ORTHOGONAL) gets polar(X) (the SVD on
    # CPU), the near one Newton-Schulz; each equals its exact polar factor
    near = Stiefel().random(30, 8, generator=torch.Generator().manual_seed(9))
    far = _gaussian(30, 8, seed=10, dtype=torch.float32)
    X = torch.stack([near + 1e-3 * _gaussian(30, 8, seed=11, dtype=torch.float32), far])
    calls = []
    real = matrix_sign.polar
    monkeypatch.setattr(matrix_sign, "polar", lambda Y, method="auto": calls.append(Y.shape[0]) or real(Y, method))
    Q = polar_near_orthogonal(X)
    assert calls == [1]  # only the far entry
    assert float((Q.double() - msign(X.double(), "svd")).abs().max()) < 2e-6


# ----------------------------------------------------------------------------- DGram retraction
def _published_dgram_retraction(X):
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return (U @ Vh) * S[..., None, :]


def test_dgram_retraction_fixes_points_but_published_one_moves_them():
    W = DGram().random(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert (DGram().retr(W, torch.zeros_like(W)) - W).abs().max() < 1e-12
    moved = float((_published_dgram_retraction(W) - W).abs().max())
    assert moved > 0.1, moved


def test_dgram_retraction_is_first_order_where_column_norms_cross():
    # At W = Q (equal column norms) move along the tangent U = Q diag(0, 1): W + tU = Q diag(1, 1 + t)
    # is already on DGram. Ours returns it (error 0); the published map hands the larger singular
    # value to the first column, an O(t) error: it is not a retraction there.
    Q = Stiefel().random(10, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    U = Q * torch.tensor([0.0, 1.0], dtype=torch.float64)
    for t in (1e-2, 1e-3):
        X = Q + t * U
        assert (DGram().retr(Q, t * U) - X).abs().max() < 1e-13
        assert (_published_dgram_retraction(X) - X).norm() > 0.5 * t


def test_dgram_singular_values_are_column_norms_after_retraction():
    X = _gaussian(20, 6, seed=3)
    Y = DGram().projx(X)
    s = torch.linalg.svdvals(Y)
    assert torch.allclose(s, Y.norm(dim=0).sort(descending=True).values, atol=1e-12)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("manifold", ALL, ids=lambda m: type(m).__name__)
def test_bfloat16_is_refused(manifold):
    with pytest.raises(TypeError, match="float32 or float64"):
        manifold.projx(torch.ones(4, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("manifold", ALL, ids=lambda m: type(m).__name__)
def test_non_finite_is_refused(manifold):
    x = manifold.random(5, 3)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        manifold.projx(bad)
    with pytest.raises(ValueError, match="non-finite"):
        manifold.retr(x, bad)
    assert not manifold.check_point_on_manifold(bad)


@pytest.mark.parametrize("manifold", ALL, ids=lambda m: type(m).__name__)
def test_vector_shape_is_refused(manifold):
    with pytest.raises(ValueError, match=r"\(\.\.\., m, n\)"):
        manifold.projx(torch.ones(4))


def test_dgram_zero_column_is_refused():
    W = torch.zeros(6, 3, dtype=torch.float64)
    W[0, 0], W[1, 1] = 1.0, 2.0  # third column zero: orthogonal, but not a manifold point
    ok, reason = DGram().check_point_on_manifold(W, explain=True)
    assert not ok and "zero column" in reason
    with pytest.raises(ValueError, match="full column rank"):
        DGram().projx(W)


def test_oblique_zero_column_is_refused():
    with pytest.raises(ValueError, match="zero column"):
        Oblique().projx(torch.zeros(4, 2))


def test_get_manifold_names():
    assert isinstance(get_manifold("DGram"), DGram)
    with pytest.raises(ValueError, match="valid: stiefel, dgram, oblique, euclidean, bdgram"):
        get_manifold("sphere")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"polar_method": "qr"}, "unknown polar_method 'qr'; valid: auto, svd, polar_express, newton_schulz"),
        ({"max_newton_steps": 0}, "max_newton_steps must be an integer >= 1; got 0"),
        ({"max_newton_steps": 2.5}, "max_newton_steps must be an integer >= 1; got 2.5"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    for cls in (Stiefel, DGram, Oblique, Euclidean):
        with pytest.raises(ValueError, match=match):
            cls(**kwargs)


@pytest.mark.parametrize("bound", [0, -1.0, float("nan"), float("inf"), "big", None])
def test_bounded_dgram_refuses_bad_bounds(bound):
    with pytest.raises(ValueError, match="bound must be a finite number > 0"):
        BoundedDGram(bound)


# ----------------------------------------------------------------------------- BoundedDGram boundary
# The contract kit covers the interior (tests/manifolds/test_manifold_contract.py); these cover the boundary.
def test_bounded_dgram_clips_to_the_bound():
    torch.manual_seed(0)
    M = BoundedDGram(1.0)
    X = 3 * torch.randn(12, 5, dtype=torch.float64)
    W = M.projx(X)
    assert torch.allclose(M.column_norms(W), torch.ones(5, dtype=torch.float64))  # all clipped to the bound
    assert M.check_point_on_manifold(W) and not M.check_point_on_manifold(1.01 * W)
    assert float(M.constraint_violation(1.5 * W).max()) == pytest.approx(0.5)
    assert bool(M.at_bound(W).all())
    Wt = M.projx(X.mT.contiguous())  # wide: rows are the constrained vectors
    assert torch.allclose(Wt.norm(dim=-1), torch.ones(5, dtype=torch.float64))
    inner = 0.5 * W
    assert torch.equal(M.projx(inner), DGram().projx(inner))  # inside the bound it is DGram


def test_bounded_dgram_retraction_at_the_boundary():
    # A boundary point: column 0 at the bound, the others inside.
    torch.manual_seed(0)
    M = BoundedDGram(1.0)
    Q = torch.linalg.qr(torch.randn(12, 5, dtype=torch.float64))[0]
    W = Q * torch.tensor([1.0, 0.5, 0.3, 0.7, 0.2], dtype=torch.float64)
    assert M.at_bound(W).tolist() == [True, False, False, False, False]
    A = M.project_cone(W, M.proju(W, torch.randn(12, 5, dtype=torch.float64)))
    assert M.check_vector_on_tangent(W, A)
    assert float((to_tall(W)[:, 0] * A[:, 0]).sum()) <= 1e-12  # column 0 does not point outward
    assert torch.allclose(M.project_cone(W, A), A)  # idempotent

    def err(V, t):
        return float((M.retr(W, t * V) - (W + t * V)).norm())

    A = A / A.norm()  # along the cone: first order (halving t quarters the error)
    assert err(A, 1e-3) <= 0.3 * err(A, 2e-3) + 1e-12
    radial = torch.zeros_like(W)
    radial[:, 0] = W[:, 0]
    out = M.proju(W, radial)
    out = out / out.norm()  # outward: the clip moves the point by O(t), the boundary's signature
    assert err(out, 1e-3) / err(out, 2e-3) == pytest.approx(0.5, abs=0.05)
    Y = M.retr(W, 1e-2 * out)
    assert M.check_point_on_manifold(Y) and float(M.column_norms(Y)[0]) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- orientation
def test_wide_matrices_constrain_rows():
    W = Stiefel().random(4, 9, dtype=torch.float64)
    assert torch.allclose(W @ W.mT, torch.eye(4, dtype=torch.float64), atol=1e-12)
    D = DGram().random(3, 8, dtype=torch.float64)
    G = D @ D.mT
    assert (G - torch.diag_embed(G.diagonal())).abs().max() < 1e-12


def test_origin_is_on_every_manifold():
    for m in ALL:
        for shape in [(5, 3), (3, 5), (2, 4, 4)]:
            assert m.check_point_on_manifold(m.origin(*shape))


# ----------------------------------------------------------------------------- geoopt interop
@pytest.mark.parametrize("manifold", [Stiefel(), DGram(), Oblique()], ids=lambda m: type(m).__name__)
def test_riemannian_adam_stays_on_manifold_and_descends(manifold):
    torch.manual_seed(0)
    target = torch.randn(12, 5)
    W = geoopt.ManifoldParameter(manifold.random(12, 5), manifold=manifold)
    opt = geoopt.optim.RiemannianAdam([W], lr=2e-2)
    loss0 = float(((W.detach() - target) ** 2).sum())
    for _ in range(300):
        opt.zero_grad()
        loss = ((W - target) ** 2).sum()
        loss.backward()
        opt.step()
    assert manifold.check_point_on_manifold(W.detach(), atol=1e-5)
    assert float(((W.detach() - target) ** 2).sum()) < 0.7 * loss0


def test_riemannian_sgd_on_stiefel_finds_minor_eigenspace():
    # min tr(W^T C W) on St(8, 3) = sum of the 3 smallest eigenvalues of C.
    torch.manual_seed(1)
    A = torch.randn(8, 8, dtype=torch.float64)
    C = A @ A.mT
    W = geoopt.ManifoldParameter(Stiefel().random(8, 3, dtype=torch.float64), manifold=Stiefel())
    opt = geoopt.optim.RiemannianSGD([W], lr=0.5 / float(torch.linalg.eigvalsh(C).max()), momentum=0.9)
    for _ in range(1500):
        opt.zero_grad()
        torch.trace(W.mT @ C @ W).backward()
        opt.step()
    best = float(torch.linalg.eigvalsh(C)[:3].sum())
    Wd = W.detach()
    assert abs(float(torch.trace(Wd.mT @ C @ Wd)) - best) < 1e-6 * max(1.0, abs(best))


def test_inputs_checked_skips_only_the_finite_check_and_restores_it():
    from manifolds import Stiefel

    m = Stiefel()
    x = m.random(12, 4, dtype=torch.float64)
    u = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        m.retr(x, u)
    v = 1e-2 * m.proju(x, torch.randn_like(x))
    with m.inputs_checked():
        with m.inputs_checked():  # nested: the outer one still holds after the inner one
            pass
        assert torch.equal(m.retr(x, v), Stiefel().retr(x, v))  # the same retraction, less its checks
        with pytest.raises(ValueError, match="needs"):  # shapes are still checked
            m.retr(x[0], v[0])
        with pytest.raises(Exception) as raised:  # NaN is the caller's promise broken: not refused as such here
            m.retr(x, u)
        assert "non-finite entries" not in str(raised.value)
    with pytest.raises(ValueError, match="non-finite"):  # checked again after the context
        m.retr(x, u)
    assert "inputs_checked" not in str(m.key()) and "_inputs_checked" not in str(m.key())
