"""The solver registry (`geomtrain.optim.registry`): names and aliases, one-line errors, and a solver registered
from outside (one `Solver` record) working end to end: `spectral_direction`, option checks, `ManifoldMuon`
carrying its warm-start state, the config."""

import pytest
import torch

from geomtrain.config import TrainConfig
from geomtrain.optim import (
    REFERENCE_SOLVER,
    SOLVER_OPTIONS,
    SOLVERS,
    ManifoldMuon,
    Solver,
    StateSlot,
    default_solver,
    describe_default,
    get_solver,
    register_solver,
    solver_names,
    spectral_direction,
    unregister_solver,
)
from geomtrain.optim.solver import OPTION_RULES
from manifolds import DGram, Euclidean, Oblique, Stiefel
from manifolds.base import GramManifold


def test_training_default_is_filled_split_on_stiefel_dgram_and_custom_masks_and_exact_elsewhere():
    class StiefelLike(Stiefel):  # keeps Stiefel's mask: its closed forms, and its default
        pass

    class Diagonal(GramManifold):  # a custom mask
        def project_gram(self, H):
            return torch.diag_embed(H.diagonal(dim1=-2, dim2=-1))

    picks = {m: default_solver(m()) for m in (Stiefel, StiefelLike, DGram, Oblique, Euclidean, Diagonal)}
    assert picks == {
        Stiefel: "filled_split",
        StiefelLike: "filled_split",
        DGram: "filled_split",
        Oblique: "exact",
        Euclidean: "exact",
        Diagonal: "filled_split",  # a custom mask: the split W = U H0 of any mask (issue 55)
    }
    assert describe_default() == (
        "filled_split on Stiefel matrices, filled_split on DGram matrices, filled_split on custom-mask matrices, "
        "exact on the others"
    )
    W = Stiefel().projx(torch.randn(16, 4))
    assert ManifoldMuon([{"params": [torch.nn.Parameter(W)], "manifold": Stiefel()}]).param_groups[0]["solver"] is None


def test_built_in_names_and_the_gram_newton_alias():
    assert list(SOLVERS) == list(solver_names()) and list(SOLVERS)[:3] == ["exact", "tangent", "published"]
    assert REFERENCE_SOLVER == "exact"
    assert "gram_newton" in SOLVERS and "bogus" not in SOLVERS
    assert get_solver("gram_newton") is get_solver("exact")
    assert SOLVER_OPTIONS["gram_newton"] == SOLVER_OPTIONS["exact"]
    assert get_solver("exact").warm_starts and not get_solver("tangent").warm_starts
    W = Stiefel().projx(torch.randn(16, 4, dtype=torch.float64))
    G = torch.randn(16, 4, dtype=torch.float64)
    A_old, st_old = spectral_direction(Stiefel(), W, G, solver="gram_newton")
    A_new, st_new = spectral_direction(Stiefel(), W, G, solver="exact")
    assert torch.equal(A_old, A_new) and st_old.solver == st_new.solver == "exact"


def test_unknown_names_and_bad_registrations_are_one_line_errors():
    with pytest.raises(ValueError, match=r"unknown solver 'exakt' \(did you mean 'exact'\?\); valid: exact") as err:
        get_solver("exakt")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="already registered"):
        register_solver(get_solver("tangent"))
    with pytest.raises(ValueError, match="taken"):
        register_solver(Solver(name="mine", solve=lambda *a: None, options={}, aliases=("gram_newton",)))
    with pytest.raises(ValueError, match="rho.*need a rule"):
        register_solver(Solver(name="mine", solve=lambda *a: None, options={"rho": 1.0}))
    with pytest.raises(ValueError, match="bad solver name"):
        register_solver(Solver(name="My Solver", solve=lambda *a: None, options={}))
    assert "mine" not in SOLVERS


def _scaled_tangent(manifold, W, G, state, options):
    """A products-only test solver: msign of the projected G, carrying a per-matrix counter as its state."""
    from geomtrain.optim.baselines import msign_with

    B, n = W.shape[0], W.shape[-1]
    count = torch.zeros(B, n, n, dtype=W.dtype) if state is None else state["count"].to(W.dtype)
    A = msign_with(manifold.proju(W, G), options) * options["shrink"]
    stats = {
        "evaluations": torch.ones(B, dtype=torch.long),
        "residual": torch.zeros(B, dtype=torch.float64),
        "converged": torch.ones(B, dtype=torch.bool),
    }
    return A, stats, {"count": count + 1}


@pytest.fixture
def counting_solver():
    solver = register_solver(
        Solver(
            name="counting",
            solve=_scaled_tangent,
            options={**get_solver("tangent").options, "shrink": 0.5},
            rules={"shrink": (lambda v: isinstance(v, float) and 0 < v <= 1, "a number in (0, 1]")},
            state=(StateSlot("count", "count", "matrix"),),
            warm_starts=True,
        )
    )
    yield solver
    unregister_solver("counting")


def test_a_registered_solver_works_everywhere(counting_solver):
    assert "counting" in SOLVERS and SOLVERS[-1] == "counting"
    W = Stiefel().projx(torch.randn(3, 16, 4, dtype=torch.float64))
    G = torch.randn(3, 16, 4, dtype=torch.float64)
    G[1] = 0
    A, st = spectral_direction(Stiefel(), W, G, solver="counting")
    assert st.solver == "counting" and not bool(A[1].ne(0).any())
    assert st.state["count"].shape == (3, 4, 4) and float(st.state["count"][0, 0, 0]) == 1.0
    A2, st2 = spectral_direction(Stiefel(), W, G, solver="counting", count=st.state["count"])
    assert float(st2.state["count"][0, 0, 0]) == 2.0
    with pytest.raises(ValueError, match=r"bad solver option shrink=2.0 for solver 'counting': must be a number in"):
        spectral_direction(Stiefel(), W, G, solver="counting", shrink=2.0)
    with pytest.raises(ValueError, match="count must be a float tensor of shape"):
        spectral_direction(Stiefel(), W, G, solver="counting", count=torch.zeros(2, 4, 4))
    # the optimizer carries the state from step to step and round-trips it
    p = torch.nn.Parameter(W[0].float().clone())
    opt = ManifoldMuon([dict(params=[p], manifold=Stiefel())], solver="counting", solver_options={"shrink": 0.25})
    for step in (1, 2, 3):
        p.grad = torch.randn_like(p)
        opt.step()
        assert float(opt.state[p]["count"][0, 0]) == step
    again = ManifoldMuon([dict(params=[p], manifold=Stiefel())], solver="counting")
    again.load_state_dict(opt.state_dict())
    assert torch.equal(again.state[p]["count"], opt.state[p]["count"])
    assert TrainConfig(muon_solver="counting", muon_solver_options=["shrink=0.5"]).validate().solver_options() == {
        "shrink": 0.5
    }


def test_the_optimizer_keeps_a_solvers_own_msign_steps_unless_it_names_them():
    # ManifoldMuon(msign_steps=None), the default, leaves each solver its own msign iterations (filled_split's 6);
    # a number replaces them (and a checkpoint's saved number comes back with it)
    seen = []

    def spy(manifold, W, G, state, options):
        seen.append(options["msign_steps"])
        return _scaled_tangent(manifold, W, G, None, {**options, "shrink": 1.0})[:2] + (None,)

    register_solver(Solver(name="spy", solve=spy, options={**get_solver("tangent").options, "msign_steps": 7}))
    try:
        p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 4)))
        for steps, want in ((None, 7), (5, 5)):
            p.grad = torch.randn_like(p)
            ManifoldMuon([dict(params=[p], manifold=Stiefel())], solver="spy", msign_steps=steps).step()
            assert seen[-1] == want, (steps, seen)
    finally:
        unregister_solver("spy")
    assert get_solver("filled_split").options["msign_steps"] == 6


def test_old_configs_and_checkpoints_that_say_gram_newton_still_load():
    assert TrainConfig(muon_solver="gram_newton").validate().muon_solver == "gram_newton"
    assert TrainConfig(muon_solver=None).validate().muon_solver is None
    with pytest.raises(ValueError, match="unknown muon_solver 'newton'; valid: exact, tangent, published"):
        TrainConfig(muon_solver="newton").validate()
    torch.manual_seed(0)
    p = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 4)))
    old = ManifoldMuon([dict(params=[p], manifold=Stiefel())], solver="gram_newton")
    p.grad = torch.randn_like(p)
    old.step()
    assert "dual" in old.state[p]  # the alias warm-starts like the exact solver
    new = ManifoldMuon([dict(params=[p], manifold=Stiefel())])
    new.load_state_dict(old.state_dict())
    p.grad = torch.randn_like(p)
    new.step()
    assert new.last_stats["dual_gap_max"] is not None


def test_every_shared_option_rule_is_used_by_a_built_in_solver():
    used = {name for solver in solver_names() for name in get_solver(solver).options}
    assert set(OPTION_RULES) <= used


def test_an_option_named_like_a_state_slot_is_refused_at_registration():
    # issue 53: a state slot listed as an option passed the config check and failed at step 1
    slot = StateSlot("correction", "correction")
    mine = Solver(name="mine", solve=lambda *a: None, options={"correction": 1.0}, state=(slot,))
    with pytest.raises(ValueError, match="correction is both an option and a warm-start state slot"):
        register_solver(mine)
    assert "mine" not in SOLVERS
