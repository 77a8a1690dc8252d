"""numerics.py: Anderson mixing, the working set, the safeguard, spectral norm estimates, host reads, eigh."""

import math

import pytest
import torch
from optim_cases import seeded


def test_anderson_solves_a_small_linear_fixed_point_and_entries_are_independent():
    # Type-II Anderson on x -> x + (b - A x) with depth >= the dimension N is GMRES in disguise: exact
    # after N + 1 steps (float64, well-conditioned A: 1e-8). An entry mixed alone, or inside a batch where
    # the others sit some calls out, gets the same iterates (to float64 rounding, 1e-12).
    from geomtrain.optim.numerics import Anderson

    gen = seeded(95)
    B, n = 3, 2  # N = 4 unknowns per entry
    A = torch.eye(4, dtype=torch.float64) + 0.3 * torch.randn(B, 4, 4, dtype=torch.float64, generator=gen)
    b = torch.randn(B, 4, dtype=torch.float64, generator=gen)

    def run(entries, schedule):
        mixer = Anderson(5, torch.zeros(B, n, n, dtype=torch.float64))
        x = torch.zeros(B, n, n, dtype=torch.float64)
        for step in range(6):
            idx = torch.tensor(schedule(step))
            xi = x[idx].reshape(len(idx), 4)
            f = b[idx] - (A[idx] @ xi.unsqueeze(-1)).squeeze(-1)
            x[idx] = mixer.mix(idx, x[idx], f.reshape(len(idx), n, n))
        return x[entries].reshape(len(entries), 4)

    solution = torch.linalg.solve(A, b)
    together = run([0, 1, 2], lambda step: [0, 1, 2])
    assert float((together - solution).abs().max()) <= 1e-8
    alone = run([1], lambda step: [1])
    with_gaps = run([1], lambda step: [1] if step % 2 else [0, 1, 2])
    assert float((alone - together[1:2]).abs().max()) <= 1e-12
    assert float((with_gaps - together[1:2]).abs().max()) <= 1e-12


def test_anderson_compact_keeps_the_histories_of_the_kept_entries():
    # A solver loop drops converged entries from its batch (`WorkingSet`) and compacts the mixer with it:
    # the kept entry must go on exactly as if nothing had been dropped (float64 rounding, 1e-12), and
    # reset(where=...) must forget exactly the flagged entries' histories.
    from geomtrain.optim.numerics import Anderson

    gen = seeded(96)
    B, n = 3, 2
    A = torch.eye(4, dtype=torch.float64) + 0.3 * torch.randn(B, 4, 4, dtype=torch.float64, generator=gen)
    b = torch.randn(B, 4, dtype=torch.float64, generator=gen)

    def step(mixer, x, rows):
        f = b[rows] - (A[rows] @ x.reshape(len(rows), 4).unsqueeze(-1)).squeeze(-1)
        return mixer.mix(mixer.every, x, f.reshape(len(rows), n, n))

    full = Anderson(5, torch.zeros(B, n, n, dtype=torch.float64))
    x_full = torch.zeros(B, n, n, dtype=torch.float64)
    dropped = Anderson(5, torch.zeros(B, n, n, dtype=torch.float64))
    x_drop = torch.zeros(B, n, n, dtype=torch.float64)
    rows = torch.arange(B)
    for it in range(6):
        x_full = step(full, x_full, torch.arange(B))
        if it == 2:  # entries 0 and 2 leave
            keep = torch.tensor([1])
            dropped.compact(keep)
            x_drop, rows = x_drop[keep], rows[keep]
        x_drop = step(dropped, x_drop, rows)
    assert float((x_drop[0] - x_full[1]).abs().max()) <= 1e-12
    mixer = Anderson(3, torch.zeros(2, n, n, dtype=torch.float64))
    for _ in range(3):
        mixer.mix(mixer.every, torch.randn(2, n, n, dtype=torch.float64), torch.randn(2, n, n, dtype=torch.float64))
    mixer.reset(mixer.every, where=torch.tensor([True, False]))
    assert mixer.count.tolist() == [0, 2] and mixer.has_prev.tolist() == [False, True]


def test_working_set_shrinks_to_the_entries_that_go_on_and_writes_back_the_others():
    from geomtrain.optim.numerics import WorkingSet

    out = {"x": torch.zeros(5), "n": torch.zeros(5, dtype=torch.long)}
    idx = torch.tensor([0, 2, 3, 4])  # entry 1 is not live
    ws = WorkingSet(idx, {name: value[idx] for name, value in out.items()}, out)
    ws["scratch"] = torch.ones(4)  # not in out: kept compact, never written back
    ws["x"], ws["n"] = torch.tensor([1.0, 2.0, 3.0, 4.0]), ws["n"] + 1
    assert ws.shrink(torch.ones(4, dtype=torch.bool)) is None and len(ws) == 4
    keep = ws.shrink(torch.tensor([False, True, False, True]))
    assert keep.tolist() == [1, 3] and ws.idx.tolist() == [2, 4] and ws["scratch"].shape == (2,)
    assert out["x"].tolist() == [1.0, 0.0, 2.0, 3.0, 4.0] and out["n"].tolist() == [1, 0, 1, 1, 1]
    ws["x"] = ws["x"] * 10
    ws.flush()
    assert out["x"].tolist() == [1.0, 0.0, 20.0, 3.0, 40.0]
    assert ws.shrink(torch.zeros(2, dtype=torch.bool)).numel() == 0 and len(ws) == 0


def test_safeguard_accepts_its_own_plain_step_so_a_rejected_point_is_not_repeated():
    # A rejected (mixed) point is followed by the plain step from the anchor. Where that step is rejected too
    # (its residual norm rose by rounding, at the iteration's floor) it used to be retried: the same point
    # again and again until the budget ran out.
    from geomtrain.optim.numerics import Anderson, WorkingSet, safeguarded_mix

    X0, F0, F1 = torch.zeros(1, 2, 2), torch.ones(1, 2, 2), torch.full((1, 2, 2), -2.0)
    ws = WorkingSet(torch.arange(1), {}, {})
    ws["best_f"], ws["from_anchor"] = torch.full((1,), math.inf), torch.zeros(1, dtype=torch.bool)
    ws["anchor_x"], ws["anchor_F"] = X0.clone(), torch.zeros_like(X0)
    mixer = Anderson(2, X0)
    X1 = safeguarded_mix(mixer, ws, X0, F0, F0.norm(dim=(-2, -1)), 1.0)  # accepted: the anchor, then X0 + F0
    assert torch.equal(X1, X0 + F0) and not bool(ws["from_anchor"])
    # at X1 the residual norm is larger: rejected, the plain step from the anchor is X1 itself
    X2 = safeguarded_mix(mixer, ws, X1, F1, F1.norm(dim=(-2, -1)), 1.0)
    assert torch.equal(X2, X1) and bool(ws["from_anchor"])
    # the same point and residual again: now accepted as the anchor, and the iteration moves on
    X3 = safeguarded_mix(mixer, ws, X2, F1, F1.norm(dim=(-2, -1)), 1.0)
    assert torch.equal(X3, X2 + F1) and torch.equal(ws["anchor_x"], X2) and float(ws["best_f"]) == 4.0


def test_spectral_norm_estimate_is_a_lower_bound_that_converges_with_a_spectral_gap():
    from geomtrain.bench.syncs import count_host_syncs
    from geomtrain.optim.numerics import spectral_norm_estimate

    gen = torch.Generator().manual_seed(7)
    U = torch.linalg.qr(torch.randn(3, 40, 24, generator=gen, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(3, 24, 24, generator=gen, dtype=torch.float64))[0]
    s = torch.linspace(1.0, 0.1, 24, dtype=torch.float64)
    s[0] = 2.0  # top singular value 2, the next 1: each iteration shrinks the error by (1/2)^2
    X = (U * s) @ V.mT * torch.tensor([1.0, 1e-3, 1e3], dtype=torch.float64)[:, None, None]
    exact = torch.linalg.matrix_norm(X, ord=2)
    with count_host_syncs() as counts:
        est = [spectral_norm_estimate(X, k) for k in (0, 2, 30)]
    assert sum(counts.values()) == 0  # no host read: the square DGram cold start must not wait for the device
    for e in est:  # |Xv| <= |X|_op for a unit v: a lower bound at every iteration count (rounding aside)
        assert bool((e <= exact * (1 + 1e-12)).all())
    assert bool((est[0] < est[1]).all())
    torch.testing.assert_close(est[2], exact, rtol=1e-12, atol=0)  # (1/4)^30 ~ 1e-18 relative
    assert float(spectral_norm_estimate(torch.zeros(2, 5, 3), 10).abs().max()) == 0.0  # no NaN at zero
    # a row-centred matrix (the all-ones vector in its null space) still gets a positive, exact estimate
    C = X[0] - X[0].mean(-1, keepdim=True)
    assert float((C @ torch.ones(24, dtype=C.dtype)).abs().max()) < 1e-12
    torch.testing.assert_close(spectral_norm_estimate(C, 60), torch.linalg.matrix_norm(C, ord=2), rtol=1e-9, atol=0)


def test_host_values_reads_a_list_of_scalars_in_order_with_one_read_per_dtype():
    from geomtrain.bench.syncs import count_host_syncs
    from geomtrain.optim.numerics import host_values

    x = torch.tensor([1.0, float("nan"), 3.0])
    scalars = [torch.isfinite(x).all(), x[0] * 2, torch.isfinite(x[0]), x[2]]
    with count_host_syncs() as counts:
        values = host_values(scalars)
    assert values == [False, 2.0, True, 3.0] and [type(v) for v in values] == [bool, float, bool, float]
    assert dict(counts) == {"copy to host": 2}  # one stacked copy per dtype (bool, float), not one per scalar
    assert host_values([]) == []


def test_eigendecompositions_run_in_float64_for_float32_on_cuda_only():
    # cuSOLVER's float32 eigenpairs let ||A||_op reach 1.04 on square Stiefel (measured on an H200), and
    # float64 costs the same there; on a CPU float32 LAPACK is accurate enough and twice as fast.
    from geomtrain.optim.numerics import eigh_dtype, eigh_psd, eigvalsh_psd

    assert eigh_dtype(torch.device("cuda"), torch.float32) == torch.float64
    assert eigh_dtype(torch.device("cuda", 0), torch.float64) == torch.float64
    assert eigh_dtype(torch.device("cpu"), torch.float32) == torch.float32
    assert eigh_dtype(torch.device("cpu"), torch.float64) == torch.float64
    X = torch.randn(3, 12, 5, generator=torch.Generator().manual_seed(0))
    M = X.mT @ X
    lam, V = eigh_psd(M)
    assert lam.dtype == V.dtype == torch.float32 and eigvalsh_psd(M).dtype == torch.float32
    torch.testing.assert_close(V @ torch.diag_embed(lam) @ V.mT, M, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("failure", ["nan", "error"])
def test_a_failed_float32_eigendecomposition_is_redone_in_float64(monkeypatch, failure):
    # MKL's float32 solvers occasionally fail on clustered spectra (an error or NaN output): the batch is redone
    # in float64 and returned in float32; a float64 failure is raised, not hidden.
    from geomtrain.optim import numerics

    X = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(1))
    M = X.mT @ X
    calls = []

    def flaky(real):
        def decompose(A):
            calls.append(A.dtype)
            if A.dtype == torch.float32:
                if failure == "error":
                    raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
                out = real(A)
                nan = float("nan")
                return tuple(torch.full_like(t, nan) for t in out) if isinstance(out, tuple) else out * nan
            return real(A)

        return decompose

    for name, fn in (("eigh", numerics.eigh_psd), ("eigvalsh", numerics.eigvalsh_psd)):
        real = getattr(torch.linalg, name)
        monkeypatch.setattr(torch.linalg, name, flaky(real))
        calls.clear()
        out = fn(M)
        lam = out[0] if isinstance(out, tuple) else out
        assert calls == [torch.float32, torch.float64] and lam.dtype == torch.float32
        torch.testing.assert_close(lam, real(M.double()).float() if name == "eigvalsh" else real(M.double())[0].float())
        monkeypatch.setattr(torch.linalg, name, lambda A: (_ for _ in ()).throw(torch.linalg.LinAlgError("x")))
        with pytest.raises(torch.linalg.LinAlgError):
            fn(M)
        monkeypatch.setattr(torch.linalg, name, real)
