"""ManifoldMuon: steps, manifolds, batching, state, non-finite handling, statistics, errors."""

import io
import json
import math
import warnings

import geoopt
import pytest
import scipy.linalg
import torch
from optim_cases import CONSTRAINED, MANIFOLDS, opnorm, problem, seeded

from geomtrain.optim import SOLVERS, ManifoldMuon
from manifolds import BoundedDGram, DGram, Euclidean, Oblique, Stiefel, msign, to_tall


# ============================================================================ ManifoldMuon
def _loss_linear(W, C):
    return (W * C).sum()


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (12, 12), (3, 10, 6)], ids=str)
def test_step_is_tangent_with_spectral_norm_lr(manifold, shape):
    lr = 1e-3
    W0, C = problem(manifold, shape, seed=20)
    W = torch.nn.Parameter(W0.clone())
    opt = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=lr, momentum=0.0, shape_scale="none")
    _loss_linear(W, C).backward()
    opt.step()
    D = (W.detach() - W0).double()
    if isinstance(manifold, Euclidean):  # plain Muon: 5 Polar Express steps leave sigma in ~[0.7, 1.2]
        assert 0.7 * lr <= opnorm(D) <= 1.2 * lr
    else:
        assert opnorm(D) <= lr * (1 + 1e-4) + 5 * lr**2  # the retraction adds O(lr^2)
        assert opnorm(D) >= lr * 0.99  # it did move by lr
    # tangent to first order: the constraint map of the step is O(lr^2) (retraction), far below lr
    L = manifold.tangent_constraint(W0.double(), D)
    assert float(L.abs().max()) <= 1e-4 * lr + 10 * lr**2
    assert opt.last_stats["residual_max"] <= 1e-4
    assert opt.last_stats["off_manifold_max"] <= 1e-5
    # a (k, m, n) parameter is k matrices on a manifold; Euclidean Muon flattens it to one (as torch's Muon)
    assert opt.last_stats["n_matrices"] == (1 if isinstance(manifold, Euclidean) else math.prod(W.shape[:-2]))


@pytest.mark.slow
@pytest.mark.parametrize("manifold", CONSTRAINED, ids=lambda m: type(m).__name__)
def test_parameters_stay_on_the_manifold_for_1000_steps(manifold):
    W = torch.nn.Parameter(manifold.random(2, 10, 4, generator=seeded(21)))
    opt = ManifoldMuon([{"params": [W], "manifold": manifold}], lr=0.05)
    gen = seeded(22)
    worst = 0.0
    for _ in range(1000):
        W.grad = torch.randn(2, 10, 4, generator=gen)
        opt.step()
        worst = max(worst, opt.last_stats["off_manifold_max"])
    ok, reason = manifold.check_point_on_manifold(W.detach(), explain=True)
    assert ok, reason
    assert worst <= 1e-5
    assert float(manifold.constraint_violation(W.detach()).max()) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("solver", SOLVERS)
def test_stiefel_trace_minimisation_reaches_the_eigenvalue_optimum(solver):
    m, n = 16, 4
    Q = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=seeded(30)))[0]
    evals = torch.linspace(-1.0, 2.0, m, dtype=torch.float64)
    C = (Q * evals) @ Q.T
    optimum = float(scipy.linalg.eigh(C.numpy(), eigvals_only=True)[:n].sum())
    W = torch.nn.Parameter(Stiefel().random(m, n, dtype=torch.float64, generator=seeded(31)))
    opt = ManifoldMuon([{"params": [W], "manifold": Stiefel()}], lr=0.1, momentum=0.9, solver=solver)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.97**k)
    for _ in range(250):
        opt.zero_grad()
        loss = torch.trace(W.T @ C @ W)
        loss.backward()
        opt.step()
        sched.step()
    final = float(torch.trace(W.T @ C @ W).detach())
    assert final - optimum <= 1e-3 * abs(optimum), (final, optimum)
    ok, reason = Stiefel().check_point_on_manifold(W.detach(), explain=True)
    assert ok, reason


@pytest.mark.slow
def test_dgram_toy_problem_converges():
    # fit a DGram target B (orthogonal columns of norms 0.5..2): the optimum is W = B, loss 0
    B = DGram().random(12, 4, dtype=torch.float64, generator=seeded(40))
    W = torch.nn.Parameter(DGram().random(12, 4, dtype=torch.float64, generator=seeded(41)))
    opt = ManifoldMuon([{"params": [W], "manifold": DGram()}], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.97**k)
    start = float(0.5 * (W - B).square().sum().detach())
    for _ in range(250):
        opt.zero_grad()
        loss = 0.5 * (W - B).square().sum()
        loss.backward()
        opt.step()
        sched.step()
    final = float(0.5 * (W - B).square().sum().detach())
    assert final < 1e-4 * start, (start, final)
    ok, reason = DGram().check_point_on_manifold(W.detach(), explain=True)
    assert ok, reason


def test_euclidean_update_is_muon_with_decoupled_weight_decay_and_shape_scale():
    lr, wd, beta = 0.02, 0.1, 0.95
    W0 = torch.randn(12, 4, generator=seeded(50))
    g = torch.randn(12, 4, generator=seeded(51))
    W = torch.nn.Parameter(W0.clone())
    opt = ManifoldMuon([W], lr=lr, momentum=beta, weight_decay=wd)
    W.grad = g.clone()
    opt.step()
    buf = (1 - beta) * g
    u = (1 - beta) * g + beta * buf
    expect = W0 * (1 - lr * wd) - lr * math.sqrt(12 / 4) * msign(u, "polar_express", steps=5)
    assert float((W.detach() - expect).abs().max()) < 1e-6
    assert opt.last_stats["msign_calls"] == 1 and opt.last_stats["dual_gap_max"] is None


def test_manifold_from_geoopt_parameter_and_from_group():
    P = geoopt.ManifoldParameter(Stiefel().random(10, 4, generator=seeded(60)), manifold=Stiefel())
    E = geoopt.ManifoldParameter(torch.randn(6, 3, generator=seeded(61)))  # geoopt.Euclidean: plain Muon
    T = torch.nn.Parameter(Oblique().random(9, 3, generator=seeded(62)))
    opt = ManifoldMuon([{"params": [P, E]}, {"params": [T], "manifold": Oblique()}], lr=0.05)
    for k in range(5):
        for p in (P, E, T):
            p.grad = torch.randn(p.shape, generator=seeded(70 + k))
        opt.step()
    assert Stiefel().check_point_on_manifold(P.detach().as_subclass(torch.Tensor))
    assert Oblique().check_point_on_manifold(T.detach())
    assert not Stiefel().check_point_on_manifold(E.detach().as_subclass(torch.Tensor))
    assert opt.last_stats["n_matrices"] == 3


def test_batched_same_shape_solves_equal_separate_optimizers():
    ps = [torch.nn.Parameter(DGram().random(10, 4, generator=seeded(80 + i))) for i in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    together = ManifoldMuon([{"params": ps, "manifold": DGram()}], lr=0.05)
    apart = [ManifoldMuon([{"params": [q], "manifold": DGram()}], lr=0.05) for q in qs]
    for k in range(4):
        for i, (p, q) in enumerate(zip(ps, qs)):
            p.grad = torch.randn(10, 4, generator=seeded(90 + 10 * k + i))
            q.grad = p.grad.clone()
        together.step()
        for o in apart:
            o.step()
    for p, q in zip(ps, qs):
        assert float((p - q).detach().abs().max()) < 1e-6


def _make_model(seed=0):
    gen = seeded(seed)
    return {
        "st": torch.nn.Parameter(Stiefel().random(12, 6, generator=gen)),
        "dg": torch.nn.Parameter(DGram().random(6, 12, generator=gen)),
        "ob": torch.nn.Parameter(Oblique().random(2, 8, 4, generator=gen)),
        "eu": torch.nn.Parameter(torch.randn(8, 8, generator=gen)),
    }


def _make_opt(model):
    return ManifoldMuon(
        [
            {"params": [model["st"]], "manifold": Stiefel()},  # the default: filled_split, no warm-start state
            {"params": [model["dg"]], "manifold": DGram(), "solver": "exact", "solver_options": {"tol": 1e-5}},  # warm
            {"params": [model["ob"]], "manifold": Oblique(), "solver": "tangent"},
            {"params": [model["eu"]], "weight_decay": 0.1},
        ],
        lr=0.03,
    )


def _train(model, opt, steps, seed):
    gen = seeded(seed)
    for _ in range(steps):
        for p in model.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_state_dict_round_trip_is_exact():
    a = _make_model()
    opt_a = _make_opt(a)
    _train(a, opt_a, 5, seed=1)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    b = {k: torch.nn.Parameter(v.detach().clone()) for k, v in a.items()}
    opt_b = _make_opt(b)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf, weights_only=True))
    assert "dual" in opt_b.state[b["dg"]] and "momentum_buffer" in opt_b.state[b["eu"]]
    _train(a, opt_a, 5, seed=2)
    _train(b, opt_b, 5, seed=2)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    for p in sa["state"]:
        for key in sa["state"][p]:
            assert torch.equal(sa["state"][p][key], sb["state"][p][key])


def test_precision_flag_is_kept_per_matrix_and_passed_back():
    # a Stiefel matrix with a nearly low-rank gradient escalates; its flag is stored next to the dual variable
    # (uint8, one per matrix) and handed to the next solve as `escalate`
    import geomtrain.optim.muon_step as muon_mod

    W = torch.nn.Parameter(Stiefel().random(2, 48, 16, generator=seeded(86)))
    opt = ManifoldMuon([{"params": [W], "manifold": Stiefel()}], lr=0.01, solver="exact")
    seen = []
    real = muon_mod.spectral_direction

    def spy(*args, **kwargs):
        seen.append(kwargs.get("escalate"))
        return real(*args, **kwargs)

    U, V = torch.randn(2, 48, 2, generator=seeded(87)), torch.randn(2, 16, 2, generator=seeded(88))
    for _ in range(2):
        W.grad = U @ V.mT
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(muon_mod, "spectral_direction", spy)
            opt.step()
    flag = opt.state[W]["escalated"]
    assert flag.dtype == torch.uint8 and flag.tolist() == [1, 1]
    assert seen[0] is None and seen[1].tolist() == [True, True]


def test_load_state_dict_refuses_a_different_manifold():
    a = _make_model()
    opt_a = _make_opt(a)
    _train(a, opt_a, 1, seed=3)
    sd = opt_a.state_dict()
    sd["param_groups"][0]["manifold"] = "DGram"
    with pytest.raises(ValueError, match="manifold"):
        _make_opt(_make_model()).load_state_dict(sd)


def test_nonfinite_gradient_is_skipped_counted_and_warned_once():
    model = _make_model()
    opt = _make_opt(model)
    _train(model, opt, 2, seed=4)
    before = {k: v.detach().clone() for k, v in model.items()}
    mom = opt.state[model["dg"]]["momentum_buffer"].clone()
    for p in model.values():
        p.grad = torch.randn(p.shape, generator=seeded(5))
    model["dg"].grad[0, 0] = float("nan")
    model["eu"].grad[1, 1] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert torch.equal(model["dg"].detach(), before["dg"]) and torch.equal(model["eu"].detach(), before["eu"])
    assert torch.equal(opt.state[model["dg"]]["momentum_buffer"], mom)
    assert not torch.equal(model["st"].detach(), before["st"])  # the others moved
    assert opt.last_stats["n_skipped_nonfinite"] == 2
    assert opt.last_stats["n_matrices"] == 3  # st (1) and the (2, 8, 4) ob batch (2) were updated
    for p in model.values():
        assert bool(torch.isfinite(p).all())
    for p in model.values():
        p.grad = torch.randn(p.shape, generator=seeded(6))
    model["dg"].grad = torch.full_like(model["dg"].grad, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        opt.step()
    assert opt.last_stats["n_skipped_nonfinite"] == 1 and opt.last_stats["n_skipped_nonfinite_total"] == 3
    assert opt.last_stats["skipped"] == [{"param": "group 1 param 0", "reason": "non-finite gradient"}]


class _RefusingDGram(DGram):
    """DGram whose retraction refuses every point, as DGram does a point with a zero column."""

    def retr(self, x, u):
        raise ValueError("a zero column")


def test_a_dgram_column_zeroed_in_training_is_a_named_skip(monkeypatch):
    """The first skipped update of the 8,000-step `hetero-inv` study run (step 2,183): a 128x128 DGram
    ``attn.c_proj`` weight with one column of norm 1.7e-3 (< lr) and the step the exact direction gave it,
    which is minus that column (to 1e-4). DGram refuses the rank-deficient point; ManifoldMuon skips that
    matrix, names it and the reason, and leaves its weight as it was."""
    import pathlib

    import numpy as np

    import geomtrain.optim.muon_step as muon_module

    saved = np.load(pathlib.Path(__file__).parents[1] / "fixtures" / "dgram_column_zeroed_128.npz")
    X, step = torch.from_numpy(saved["x"]), torch.from_numpy(saved["step"])
    lr = 0.018  # the run's Muon learning rate at that step
    before, after = torch.linalg.vector_norm(X, dim=0), torch.linalg.vector_norm(X + step, dim=0)
    k = int(before.argmin())
    assert float(before[k]) < lr < float(before.sort().values[1])  # one column below the step size
    assert float(after[k]) < 1e-2 * float(before[k])  # and the step all but removes it (1.7e-3 -> 1.4e-5)
    with pytest.raises(ValueError, match="zero column"):
        DGram().retr(X, step)
    W = torch.nn.Parameter(X.clone())
    opt = ManifoldMuon([{"params": [W], "param_names": ["attn.c_proj.weight"], "manifold": DGram()}], lr=lr)
    original = muon_module.spectral_direction

    def captured_direction(m, W, U, **opts):  # the solver's statistics, the captured direction
        return -step[None] / lr, original(m, W, U, **opts)[1]

    monkeypatch.setattr(muon_module, "spectral_direction", captured_direction)
    W.grad = torch.randn(W.shape, generator=seeded(12))
    with pytest.warns(RuntimeWarning, match="retraction refused the point"):
        opt.step()
    assert opt.last_stats["skipped"] == [{"param": "attn.c_proj.weight", "reason": "retraction refused the point"}]
    assert torch.equal(W.detach(), X)


@pytest.mark.parametrize("fault", ["gradient", "direction", "retraction refused", "retraction non-finite"])
def test_a_skipped_update_is_named_with_its_reason(fault, monkeypatch):
    """Each way a matrix update can be skipped names the parameter (torch.optim's ``param_names``) and
    the reason in ``last_stats["skipped"]`` and the warning; that weight is untouched, the others move."""
    import geomtrain.optim.muon_step as muon_module

    gen = seeded(11)
    a = torch.nn.Parameter(DGram().random(12, 6, generator=gen))
    b = torch.nn.Parameter(Stiefel().random(12, 6, generator=gen))
    manifold = _RefusingDGram() if fault == "retraction refused" else DGram()
    opt = ManifoldMuon([{"params": [a, b], "param_names": ["layer.a", "layer.b"], "manifold": manifold}], lr=0.01)
    for p in (a, b):
        p.grad = torch.randn(p.shape, generator=gen)
    if fault == "gradient":
        a.grad[0, 0] = float("nan")
    original = muon_module.spectral_direction

    def poisoned_direction(m, W, U, **opts):  # a solve returning NaN for the first matrix of the batch
        A, stats = original(m, W, U, **opts)
        A[0] = float("nan")
        return A, stats

    if fault == "direction":
        monkeypatch.setattr(muon_module, "spectral_direction", poisoned_direction)
    if fault == "retraction non-finite":
        monkeypatch.setattr(DGram, "retr", lambda self, x, u: torch.full_like(x, float("inf")))
    before, before_b = a.detach().clone(), b.detach().clone()
    reason = {
        "gradient": "non-finite gradient",
        "direction": "non-finite direction",
        "retraction refused": "retraction refused the point",
        "retraction non-finite": "non-finite retraction",
    }[fault]
    with pytest.warns(RuntimeWarning, match=f"layer.a: {reason}"):
        opt.step()
    skipped = opt.last_stats["skipped"]
    if fault.startswith("retraction"):  # one manifold, one batch: both matrices go through the retraction
        assert skipped == [{"param": "layer.a", "reason": reason}, {"param": "layer.b", "reason": reason}]
    else:
        assert skipped == [{"param": "layer.a", "reason": reason}]
        assert not torch.equal(b.detach(), before_b) and bool(torch.isfinite(b).all())
    assert torch.equal(a.detach(), before) and opt.last_stats["n_skipped_nonfinite"] == len(skipped)
    assert json.loads(json.dumps(opt.last_stats))["skipped"] == skipped
    # the step-length statistics count the applied directions only: a skipped one never makes them NaN
    lengths = [opt.last_stats["length_mean"], opt.last_stats["length_min"]]
    assert lengths == [None, None] if len(skipped) == 2 else all(math.isfinite(v) for v in lengths), lengths


def test_a_non_finite_warm_start_state_is_never_kept(monkeypatch):
    # A solve whose direction is finite but whose warm-start state is not: the state is dropped (the next
    # solve starts cold) instead of stored, where the next step's spectral_direction would refuse it.
    import geomtrain.optim.muon_step as muon_module

    gen = seeded(21)
    a = torch.nn.Parameter(DGram().random(12, 6, generator=gen))
    b = torch.nn.Parameter(DGram().random(12, 6, generator=gen))
    opt = ManifoldMuon([{"params": [a, b], "manifold": DGram()}], lr=0.01, solver="exact")  # warm-started
    original = muon_module.spectral_direction

    def poisoned_state(m, W, U, **opts):
        A, stats = original(m, W, U, **opts)
        stats.dual[0, 0, 1] = float("nan")
        return A, stats

    for p in (a, b):
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()  # both states kept
    assert "dual" in opt.state[a] and "dual" in opt.state[b]
    monkeypatch.setattr(muon_module, "spectral_direction", poisoned_state)
    before = a.detach().clone()
    opt.step()
    assert not torch.equal(a.detach(), before)  # the direction was fine: applied
    assert "dual" not in opt.state[a] and "escalated" not in opt.state[a]
    assert bool(torch.isfinite(opt.state[b]["dual"]).all())
    monkeypatch.setattr(muon_module, "spectral_direction", original)
    opt.step()  # a cold, b warm: both fine
    assert opt.last_stats["n_unconverged"] == 0 and bool(torch.isfinite(opt.state[a]["dual"]).all())


def test_a_damaged_warm_start_slot_loaded_starts_that_matrix_cold():
    # A NaN or an Inf among the finite entries of a saved warm-start slot (filled_split's carried correction): the
    # load drops it with one RuntimeWarning naming the matrix, which starts cold (before, an Inf reached the
    # solver, which refused it at every step); an FSDP placeholder (NaN throughout) goes silently; the other
    # matrices keep theirs and the next step runs.
    from geomtrain.optim.muon_fsdp import cold_slot

    gen = seeded(41)
    start = [Stiefel().random(24, 8, generator=gen) for _ in range(4)]
    names = ["has_inf", "has_nan", "placeholder", "kept"]

    def make():
        params = [torch.nn.Parameter(w.clone()) for w in start]
        group = {"params": params, "param_names": names, "manifold": Stiefel()}
        return params, ManifoldMuon([group], lr=0.02, solver="filled_split")

    def step(params, opt):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()

    params, opt = make()
    step(params, opt)
    sd = opt.state_dict()
    sd["state"][0]["correction"][1, 2] = math.inf
    sd["state"][1]["correction"][0, 0] = math.nan
    sd["state"][2]["correction"] = torch.full_like(sd["state"][2]["correction"], math.nan)
    kept = sd["state"][3]["correction"].clone()
    params, opt = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(sd)
    assert [str(w.message) for w in caught] == [cold_slot("has_inf", "correction"), cold_slot("has_nan", "correction")]
    assert [("correction" in opt.state[p]) for p in params] == [False, False, False, True]
    assert torch.equal(opt.state[params[3]]["correction"], kept)
    step(params, opt)
    assert all(bool(torch.isfinite(opt.state[p]["correction"]).all()) for p in params)


def test_last_stats_are_json_ready_and_lr_schedulers_work():
    model = _make_model()
    opt = _make_opt(model)
    _train(model, opt, 1, seed=6)
    keys = {
        "n_matrices",
        "msign_calls",
        "iterations_max",
        "residual_max",
        "residual_mean",
        "dual_gap_max",
        "n_unconverged",
        "off_manifold_max",
        "n_skipped_nonfinite",
        "n_skipped_nonfinite_total",
    }
    assert keys <= set(opt.last_stats) and json.loads(json.dumps(opt.last_stats))
    assert opt.last_stats["n_matrices"] == 5 and opt.last_stats["n_unconverged"] == 0  # ob is a batch of 2
    assert opt.last_stats["unconverged"] == []
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k == 0 else 0.0)
    before = {k: v.detach().clone() for k, v in model.items()}
    _train(model, opt, 1, seed=7)
    mid = {k: v.detach().clone() for k, v in model.items()}
    assert all(not torch.equal(before[k], mid[k]) for k in model)
    sched.step()  # lr = 0 from now on: nothing moves
    _train(model, opt, 1, seed=9)
    assert all(torch.equal(mid[k], model[k].detach()) for k in model)


def test_optimizer_errors_name_the_choices():
    W = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="valid: exact, tangent, published"):
        ManifoldMuon([W], solver="adam")
    with pytest.raises(ValueError, match="valid: muon, match_rms_adamw, none"):
        ManifoldMuon([W], shape_scale="moonlight")
    with pytest.raises(ValueError, match="valid: tol"):
        ManifoldMuon([W], solver_options={"tolerance": 1})
    with pytest.raises(ValueError, match=r"tol=0.*must be a finite number > 0"):  # at construction, not at a step
        ManifoldMuon([W], solver_options={"tol": 0})
    # every hyperparameter, of the defaults and of a group's own: NaN/Inf, truthy strings and unknown names
    # used to be taken (lr=nan skipped every update with a warning; warm_start="no" meant warm starts on)
    for bad, needle in (
        ({"lr": float("nan")}, "lr must be a finite number >= 0"),
        ({"lr": float("inf")}, "lr must be a finite number >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\)"),
        ({"warm_start": "no"}, "warm_start must be True or False"),
        ({"nesterov": 1}, "nesterov must be True or False"),
        ({"msign_method": "foo"}, "valid: svd, polar_express"),
        ({"msign_steps": 0}, "msign_steps must be an integer >= 1"),
        ({"msign_dtype": torch.int32}, "msign_dtype must be None or a floating torch dtype"),
    ):
        with pytest.raises(ValueError, match=needle):
            ManifoldMuon([W], **bad)
        with pytest.raises(ValueError, match=needle):  # a group's own value
            ManifoldMuon([{"params": [W], **bad}])
    # a manifold parameter must start on its manifold: a raw weight is refused with the fix named
    raw = torch.nn.Parameter(torch.randn(12, 4, generator=seeded(3)))
    with pytest.raises(ValueError, match=r"not on its manifold DGram .*projx"):
        ManifoldMuon([{"params": [raw], "manifold": DGram()}])
    raw.data.copy_(DGram().projx(raw.data))
    ManifoldMuon([{"params": [raw], "manifold": DGram()}])  # projected: accepted
    with pytest.raises(ValueError, match="AdamW"):
        ManifoldMuon([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(TypeError, match="GramManifold"):
        ManifoldMuon([geoopt.ManifoldParameter(torch.randn(4, 3), manifold=geoopt.Sphere())])
    with pytest.raises(TypeError, match="GramManifold"):
        ManifoldMuon([{"params": [W], "manifold": "stiefel"}])


def test_batches_keep_each_manifolds_own_settings():
    # two BoundedDGram bounds on same-shape matrices in one optimizer: each is retracted with its own bound
    lo, hi = BoundedDGram(0.5), BoundedDGram(2.0)
    assert lo.key() != hi.key() and BoundedDGram(0.5).key() == lo.key()
    a = torch.nn.Parameter(lo.random(12, 4, generator=seeded(70)))
    b = torch.nn.Parameter(hi.random(12, 4, generator=seeded(71)))
    opt = ManifoldMuon([{"params": [a], "manifold": lo}, {"params": [b], "manifold": hi}], lr=0.5, momentum=0.0)
    for _ in range(6):  # the loss grows every column norm: the steps push past both bounds
        opt.zero_grad()
        (-(a.square().sum() + b.square().sum())).backward()
        opt.step()
    na, nb = lo.column_norms(a.detach()), hi.column_norms(b.detach())
    assert float(na.max()) <= 0.5 * (1 + 1e-5) and float(na.max()) >= 0.5 * (1 - 1e-3)
    assert float(nb.max()) <= 2.0 * (1 + 1e-5) and float(nb.max()) >= 2.0 * (1 - 1e-3)  # not clipped to 0.5


class _BrokenRetraction(Stiefel):
    def retr(self, x, u):
        raise RuntimeError("a bug in a user manifold")


def test_unexpected_retraction_errors_surface():
    W = torch.nn.Parameter(Stiefel().random(8, 4, generator=seeded(72)))
    opt = ManifoldMuon([{"params": [W], "manifold": _BrokenRetraction()}], lr=0.1)
    W.grad = torch.randn(8, 4, generator=seeded(73))
    with pytest.raises(RuntimeError, match="a bug in a user manifold"):
        opt.step()


def _muon_pair(adjust_lr_fn, **ours_kwargs):
    torch.manual_seed(0)
    shapes = [(32, 16), (16, 48), (32, 16)]  # tall, wide, and a second tall one (batched with the first)
    theirs = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    common = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ref = torch.optim.Muon(theirs, adjust_lr_fn=adjust_lr_fn, **common)
    opt = ManifoldMuon(ours, **common, **ours_kwargs)
    start = [p.detach().clone() for p in theirs]
    for step in range(20):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(theirs, ours):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ref.step()
        opt.step()
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(theirs, ours))
    moved = max(float((p - s).detach().abs().max()) for p, s in zip(theirs, start))
    return gap, moved


@pytest.mark.parametrize("adjust_lr_fn, shape_scale", [(None, "muon"), ("match_rms_adamw", "match_rms_adamw")])
def test_torch_muon_conventions_reproduce_torch_optim_muon(adjust_lr_fn, shape_scale):
    # Keller Jordan's coefficients in bfloat16 (torch.optim.Muon's orthogonaliser) and its lr adjustment:
    # the same update up to float32 rounding of the weight arithmetic (|W| ~ 4 here, ulp 4.8e-7).
    gap, moved = _muon_pair(
        adjust_lr_fn, msign_method="keller_jordan", msign_dtype=torch.bfloat16, shape_scale=shape_scale
    )
    assert gap <= 1e-6 and moved > 0.1
    # our defaults (Polar Express in float32) are another orthogonaliser: a visibly different trajectory
    gap_default, moved = _muon_pair(adjust_lr_fn, shape_scale=shape_scale)
    assert gap_default > 0.05 * moved


def test_last_stats_name_the_matrices_whose_direction_was_polished():
    # max_iter=1 on the exact DGram group: its direction cannot converge and is polished; the Stiefel one converges
    model = _make_model()
    opt = ManifoldMuon(
        [
            {"params": [model["st"]], "manifold": Stiefel(), "param_names": ["st"]},
            {
                "params": [model["dg"]],
                "manifold": DGram(),
                "solver": "exact",
                "solver_options": {"max_iter": 1},
                "param_names": ["dg"],
            },
        ],
        lr=0.03,
    )
    _train({k: model[k] for k in ("st", "dg")}, opt, 1, seed=8)
    assert opt.last_stats["unconverged"] == ["dg"] and opt.last_stats["n_unconverged"] == 1
    assert json.loads(json.dumps(opt.last_stats))["unconverged"] == ["dg"]


class _RefusingMarkedDGram(DGram):
    """DGram refusing a batch that holds a matrix whose first entry is exactly ``marker`` (a stand-in for a
    zero column, on a point that is still on the manifold)."""

    def __init__(self, marker: float):
        super().__init__()
        self.marker = marker

    def retr(self, x, u):
        if bool((to_tall(x)[..., 0, 0] == self.marker).any()):
            raise ValueError("a zero column")
        return super().retr(x, u)


def test_one_refused_matrix_of_a_batch_is_skipped_and_the_others_move():
    # A batch's matrices are retracted in one call; when that call refuses, each is retracted alone, so only
    # the refused one is skipped, and the others get exactly the per-matrix retraction.
    gen = seeded(13)
    points = [DGram().random(12, 6, generator=gen) for _ in range(3)]
    grads = [torch.randn(12, 6, generator=gen) for _ in range(3)]
    params = [torch.nn.Parameter(p.clone()) for p in points]
    refusing = _RefusingMarkedDGram(marker=float(points[1][0, 0]))
    opt = ManifoldMuon([{"params": params, "param_names": ["a", "b", "c"], "manifold": refusing}], lr=0.01)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    with pytest.warns(RuntimeWarning, match="b: retraction refused the point"):
        opt.step()
    assert opt.last_stats["skipped"] == [{"param": "b", "reason": "retraction refused the point"}]
    assert torch.equal(params[1].detach(), points[1])
    alone = [torch.nn.Parameter(p.clone()) for p in points]
    for i in (0, 2):  # each matrix in its own optimizer: a batch of one, retracted alone
        single = ManifoldMuon([{"params": [alone[i]], "manifold": DGram()}], lr=0.01)
        alone[i].grad = grads[i].clone()
        single.step()
        assert torch.equal(params[i].detach(), alone[i].detach())


def test_batched_retraction_matches_one_matrix_at_a_time():
    # Same-shape matrices of one group share a solve and a retraction; with different solver settings they
    # are solved and retracted apart. The weights agree to float32 rounding (the Stiefel polar step count is
    # set per batch, one more Newton-Schulz step past convergence changes the last bits).
    gen = seeded(14)
    for manifold in (Stiefel(), DGram()):
        points = [manifold.random(24, 8, generator=gen) for _ in range(2)]
        grads = [torch.randn(24, 8, generator=gen) for _ in range(2)]
        together = [torch.nn.Parameter(p.clone()) for p in points]
        apart = [torch.nn.Parameter(p.clone()) for p in points]
        opt_together = ManifoldMuon([{"params": together, "manifold": manifold}], lr=0.02, solver="exact")
        opt_apart = ManifoldMuon(
            [
                {"params": [apart[0]], "manifold": manifold, "solver_options": {"tol": 1e-4}},
                {"params": [apart[1]], "manifold": manifold, "solver_options": {"tol": 1.0000001e-4}},
            ],
            lr=0.02,
            solver="exact",
        )
        for step in range(3):
            for ps in (together, apart):
                for p, g in zip(ps, grads):
                    p.grad = g * (1 + step)
            opt_together.step()
            opt_apart.step()
        for t, a in zip(together, apart):
            assert float((t.detach() - a.detach()).abs().max()) <= 1e-5
            assert (
                not torch.equal(t.detach(), points[0]) and float(manifold.constraint_violation(t.detach()).max()) < 1e-5
            )


@pytest.mark.slow  # about 1 s under load: six steps
def test_filled_split_carry_keeps_its_multiplier_and_resumes_from_it():
    # carry=True (the default): one (n, n) multiplier correction per matrix in the optimizer state, checkpointed;
    # carry=False keeps none. A step after a state_dict round trip equals the step of the optimizer that never
    # stopped.
    gen = seeded(31)
    start = [DGram().random(24, 8, generator=gen), Stiefel().random(30, 6, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) for w in start] for _ in range(3)]

    def make(weights, options):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        groups = [{"params": [params[0]], "manifold": DGram()}, {"params": [params[1]], "manifold": Stiefel()}]
        return params, ManifoldMuon(groups, lr=0.02, solver="filled_split", solver_options=options)

    def step(params, opt, g):
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()

    params, opt = make(start, {"carry": False})
    step(params, opt, grads[0])
    assert all("correction" not in opt.state[p] for p in params)
    params, opt = make(start, {})  # carry=True, the default
    for g in grads[:2]:
        step(params, opt, g)
    assert [tuple(opt.state[p]["correction"].shape) for p in params] == [(8, 8), (6, 6)]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    resumed, opt2 = make([p.detach() for p in params], {})
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    step(params, opt, grads[2])
    step(resumed, opt2, grads[2])
    for a, b in zip(resumed, params):
        assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt2.state[resumed[0]]["correction"], opt.state[params[0]]["correction"])
