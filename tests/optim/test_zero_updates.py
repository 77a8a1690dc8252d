"""Zero updates in Manifold Muon: a matrix whose gradient (or update) is zero gets the direction A = 0 from every
solver, is not retracted, and keeps its warm-start state; the other matrices of its batch get what a batch of
only them gets; a `step` that raises changes nothing.

Results are compared bitwise (`same_bits`): the rule is that a zero matrix is *left out* of the solve and of the
retraction, so the others are computed by exactly the operations of a batch without it (the same kernels on the
same shapes), and a zero matrix's weights and state are never written. Solving each matrix one at a time is a
different computation (batched kernels round differently, ~1e-6 in float32); that is covered by
``test_batched_same_shape_solves_equal_separate_optimizers`` in test_muon.py."""

import copy

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from optim_cases import seeded

from geomtrain.optim import SOLVERS, ManifoldMuon, spectral_direction
from manifolds import DGram, get_manifold, manifold_names

MANIFOLD_NAMES = manifold_names()  # every registered manifold (the built-ins at import time)
# tall, near-square tall (DGram's Douglas-Rachford path: m < 2n), square (square DGram / Stiefel paths), wide
SHAPES = [(20, 5), (12, 8), (8, 8), (8, 12), (5, 20)]
DTYPES = [torch.float32, torch.float64]
_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (``torch.equal`` would let -0.0 equal 0.0): same dtype, shape and bits."""
    a, b = a.detach().as_subclass(torch.Tensor), b.detach().as_subclass(torch.Tensor)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _INT_OF.get(a.dtype)
    return torch.equal(a.view(view), b.view(view)) if view is not None else torch.equal(a, b)


def snapshot(opt: ManifoldMuon, params) -> tuple[list, list]:
    """Copies of the weights and of each parameter's optimizer state."""
    weights = [p.detach().clone() for p in params]
    return weights, [copy.deepcopy(dict(opt.state[p])) if p in opt.state else {} for p in params]


def assert_unchanged(params, weights, opt, states, *, momentum_zero: bool) -> None:
    """Weights and state bitwise as in the snapshot; the momentum buffer, which a zero gradient legitimately
    decays, is checked to be zero where ``momentum_zero`` (an absent buffer counts as a zero one)."""
    for p, w, before in zip(params, weights, states):
        assert same_bits(p, w)
        after = dict(opt.state[p])
        if momentum_zero:
            assert not bool(after.pop("momentum_buffer").ne(0).any())
            before = {k: v for k, v in before.items() if k != "momentum_buffer"}
        assert set(after) == set(before)
        for key, value in before.items():
            assert same_bits(after[key], value), key


def _manifold_params(manifold, shape, count, dtype, seed):
    gen = seeded(seed)
    return [torch.nn.Parameter(manifold.random(*shape, dtype=dtype, generator=gen)) for _ in range(count)]


# ------------------------------------------------------------------ spectral_direction
@given(
    name=st.sampled_from(MANIFOLD_NAMES),
    shape=st.sampled_from(SHAPES),
    solver=st.sampled_from(SOLVERS),
    dtype=st.sampled_from(DTYPES),
    zero=st.lists(st.booleans(), min_size=1, max_size=4),
    warm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_solver_gives_a_zero_direction_for_a_zero_gradient(name, shape, solver, dtype, zero, warm, seed):
    # Per matrix of a batch: G = 0 gives exactly A = 0 and no evaluation, with the warm-start state passed
    # through; the matrices with G != 0 get bitwise the result of a batch of only them (module docstring).
    manifold = get_manifold(name)
    W = manifold.random(len(zero), *shape, dtype=dtype, generator=seeded(seed))
    G = torch.randn(W.shape, dtype=dtype, generator=seeded(seed + 1))
    mask = torch.tensor(zero)
    G[mask] = 0
    opts = {}
    previous = spectral_direction(manifold, W, torch.randn(W.shape, dtype=dtype), solver=solver)[1].dual
    if warm and previous is not None:  # a previous solve's state (tangent and Euclidean keep none)
        opts["dual"] = previous
        if solver == "exact":
            opts["escalate"] = torch.ones(len(zero), dtype=torch.bool)
    A, stats = spectral_direction(manifold, W, G, solver=solver, **opts)
    assert A.dtype == W.dtype and A.shape == W.shape
    assert not bool(A[mask].ne(0).any())
    assert not bool(stats.evaluations[mask].ne(0).any()) and bool(stats.converged[mask].all())
    for key, state in (("dual", opts.get("dual")), ("escalated", opts.get("escalate"))):
        if state is not None and getattr(stats, key) is not None:
            assert same_bits(getattr(stats, key)[mask].to(state.dtype), state[mask]), key
    if bool(mask.all()):
        return
    sub = {k: v[~mask] for k, v in opts.items()}
    A_alone, stats_alone = spectral_direction(manifold, W[~mask], G[~mask], solver=solver, **sub)
    assert same_bits(A[~mask], A_alone)
    assert torch.equal(stats.evaluations[~mask], stats_alone.evaluations)


# ------------------------------------------------------------------ ManifoldMuon
@given(
    name=st.sampled_from(MANIFOLD_NAMES),
    shape=st.sampled_from([*SHAPES, (2, 10, 6)]),
    solver=st.sampled_from(SOLVERS),
    dtype=st.sampled_from(DTYPES),
    history=st.sampled_from(["fresh", "zeroed buffer", "momentum 0"]),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_zero_step_leaves_weights_and_state_bitwise_unchanged(name, shape, solver, dtype, history, nesterov, seed):
    # A zero update (zero gradient, zero momentum buffer) moves nothing: no solve, no retraction (retr(W, 0) is
    # W only up to rounding), the warm-start state as it was. "momentum 0 after a step" is the measured IndexError
    # of the default solver; "fresh" is a zero-initialised gate in front of the matrix at step 1.
    manifold = get_manifold(name)
    (p,) = _manifold_params(manifold, shape, 1, dtype, seed)
    opt = ManifoldMuon([{"params": [p], "manifold": manifold}], lr=0.05, solver=solver, nesterov=nesterov)
    if history != "fresh":  # a real step first: momentum, dual variable and precision flag in the state
        p.grad = torch.randn(p.shape, dtype=dtype, generator=seeded(seed + 1))
        opt.step()
        if history == "zeroed buffer":
            opt.state[p]["momentum_buffer"].zero_()
        else:
            opt.param_groups[0]["momentum"] = 0.0
    weights, states = snapshot(opt, [p])
    p.grad = torch.zeros_like(p)
    opt.step()
    assert_unchanged([p], weights, opt, states, momentum_zero=True)
    assert opt.last_stats["msign_calls"] == 0 and opt.last_stats["n_matrices"] == (
        2 if len(shape) == 3 and name != "euclidean" else 1
    )


@given(
    name=st.sampled_from(MANIFOLD_NAMES),
    shape=st.sampled_from(SHAPES),
    solver=st.sampled_from(SOLVERS),
    dtype=st.sampled_from(DTYPES),
    zero=st.lists(st.booleans(), min_size=2, max_size=4).filter(lambda z: any(z) and not all(z)),
    stacked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_batch_mixing_zero_and_nonzero_gradients(name, shape, solver, dtype, zero, stacked, seed):
    # Matrices of one batch (same-shape parameters of a group, or the slices of one (k, m, n) parameter), some
    # with zero gradients, for two steps (the second warm-started): the zero ones never move and their state stays
    # empty or as it was; the others end bitwise where an optimizer holding only them ends (module docstring).
    assume(not (stacked and name == "euclidean"))  # a Euclidean (k, m, n) weight is one (k, m n) matrix
    manifold = get_manifold(name)
    points = torch.stack([p.detach() for p in _manifold_params(manifold, shape, len(zero), dtype, seed)])
    grads = torch.randn(2, *points.shape, dtype=dtype, generator=seeded(seed + 1))
    mask = torch.tensor(zero)
    grads[:, mask] = 0
    if stacked:
        mixed, alone = [torch.nn.Parameter(points.clone())], [torch.nn.Parameter(points[~mask].clone())]
    else:
        mixed = [torch.nn.Parameter(w.clone()) for w in points]
        alone = [torch.nn.Parameter(w.clone()) for w, z in zip(points, zero) if not z]
    opts = [ManifoldMuon([{"params": ps, "manifold": manifold}], lr=0.05, solver=solver) for ps in (mixed, alone)]
    for k in range(2):
        for ps, g in ((mixed, grads[k]), (alone, grads[k][~mask])):
            for i, p in enumerate(ps):
                p.grad = g.clone() if stacked else g[i].clone()
        if not stacked:
            weights, states = snapshot(opts[0], [p for p, z in zip(mixed, zero) if z])
        for opt in opts:
            opt.step()
        if not stacked:
            zeros = [p for p, z in zip(mixed, zero) if z]
            assert_unchanged(zeros, weights, opts[0], states, momentum_zero=True)
    moved = torch.stack([p.detach() for p in mixed]).reshape(points.shape)
    assert same_bits(moved[mask], points[mask])
    assert same_bits(moved[~mask], torch.stack([p.detach() for p in alone]).reshape(points[~mask].shape))


@pytest.mark.parametrize(
    "name, shape",
    [
        ("stiefel", (32, 8)),
        ("stiefel", (8, 32)),
        ("dgram", (32, 8)),
        ("dgram", (8, 32)),
        ("dgram", (16, 16)),
        ("oblique", (16, 16)),
    ],
)
def test_a_zero_initialised_gate_in_front_of_a_constrained_matrix_trains(name, shape):
    # ReZero: y = gate * (x W) with gate = 0 at the start, so W's first gradient is exactly zero. Step 1 (the
    # default solver, which raised IndexError on this) leaves W bitwise alone while AdamW moves the gate; step 2
    # moves W along its manifold.
    manifold = get_manifold(name)
    W = torch.nn.Parameter(manifold.random(*shape, generator=seeded(3)))
    gate = torch.nn.Parameter(torch.zeros(()))
    muon = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=0.02)
    adam = torch.optim.AdamW([gate], lr=0.1)
    x = torch.randn(16, shape[0], generator=seeded(4))
    target = torch.randn(16, shape[1], generator=seeded(5))
    start = W.detach().clone()
    for step in range(2):
        loss = (gate * (x @ W) - target).square().mean()
        muon.zero_grad()
        adam.zero_grad()
        loss.backward()
        assert bool(W.grad.eq(0).all()) == (step == 0)
        muon.step()
        adam.step()
        if step == 0:
            assert same_bits(W, start) and float(gate.detach()) != 0
    assert not torch.equal(W.detach(), start)
    assert float(manifold.constraint_violation(W.detach()).max()) < 1e-5


# ------------------------------------------------------------------ a step that raises
@pytest.mark.parametrize("history", ["fresh", "after a step"])
@pytest.mark.parametrize("fault", ["solver", "retraction"])
def test_a_step_that_raises_changes_neither_weights_nor_state(history, fault, monkeypatch):
    # Two batches (two shapes) and a Euclidean matrix: the second manifold batch fails after the first is solved.
    # Nothing may have been written: momentum, weights, dual variables and flags are as before the call.
    gen = seeded(21)
    first = torch.nn.Parameter(get_manifold("stiefel").random(16, 8, generator=gen))
    second = torch.nn.Parameter(get_manifold("dgram").random(12, 6, generator=gen))
    euclid = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    params = [first, second, euclid]
    opt = ManifoldMuon(
        [
            {"params": [first], "manifold": get_manifold("stiefel")},
            {"params": [second], "manifold": get_manifold("dgram")},
            {"params": [euclid], "weight_decay": 0.1},
        ],
        lr=0.05,
    )
    if history == "after a step":
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    if fault == "solver":  # a point the solver refuses (ValueError: W is not on DGram)
        with torch.no_grad():
            second.mul_(torch.linspace(0.5, 1.5, 12)[:, None]).add_(0.3)
    else:  # an unexpected retraction error, which surfaces (only ValueError is a skipped update)

        def broken(self, x, u):
            raise RuntimeError("broken retraction")

        monkeypatch.setattr(DGram, "retr", broken)
    weights, states = snapshot(opt, params)
    with pytest.raises((ValueError, RuntimeError), match="not on DGram|broken retraction"):
        opt.step()
    assert_unchanged(params, weights, opt, states, momentum_zero=False)


def test_a_zero_slice_keeps_its_warm_start_state_in_a_cold_batch():
    # A (2, 12, 6) parameter whose slice 0 has a zero update, batched with a new (12, 6) parameter that has no
    # warm-start state yet (so the whole batch is solved cold): slice 0 keeps its weights, its dual variable and
    # its precision flag bitwise; slice 1 gets new ones.
    stiefel = get_manifold("stiefel")
    stacked = torch.nn.Parameter(stiefel.random(2, 12, 6, generator=seeded(31)))
    newcomer = torch.nn.Parameter(stiefel.random(12, 6, generator=seeded(32)))
    opt = ManifoldMuon([{"params": [stacked, newcomer], "manifold": stiefel}], lr=0.05, solver="exact")
    stacked.grad = torch.randn(stacked.shape, generator=seeded(33))
    opt.step()  # the newcomer has no gradient yet: no state
    state = opt.state[stacked]
    state["momentum_buffer"][0] = 0
    state["escalated"][0] = 1  # as if slice 0 had needed float64: a flag the cold float32 solve would not set
    (weights,), (before,) = snapshot(opt, [stacked])
    stacked.grad = torch.randn(stacked.shape, generator=seeded(34))
    stacked.grad[0] = 0
    newcomer.grad = torch.randn(newcomer.shape, generator=seeded(35))
    opt.step()
    assert same_bits(stacked[0], weights[0]) and not torch.equal(stacked[1].detach(), weights[1])
    assert same_bits(state["dual"][0], before["dual"][0]) and not torch.equal(state["dual"][1], before["dual"][1])
    assert int(state["escalated"][0]) == 1
    assert "dual" in opt.state[newcomer]
