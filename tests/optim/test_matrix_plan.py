"""MatrixPlan: each parameter's geometry, solver, options and warm-start slots, fixed when its group is added."""

import torch

from geomtrain.optim import ManifoldMuon, default_solver, get_solver
from geomtrain.optim.muon_step import make_plan
from manifolds import DGram, Euclidean, Oblique, Stiefel


def _params(manifold, shape=(12, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(*shape, generator=gen)
    return torch.nn.Parameter(W if manifold.unconstrained else manifold.projx(W))


def test_plans_resolve_the_default_solver_and_its_options_once_per_parameter():
    manifolds = (Stiefel(), DGram(), Oblique(), Euclidean())
    params = [_params(m) for m in manifolds]
    opt = ManifoldMuon([{"params": [p], "manifold": m} for p, m in zip(params, manifolds)], lr=0.01, msign_steps=7)
    for p, m in zip(params, manifolds):
        plan = opt._plan_of[id(p)]
        assert plan.manifold is m and plan.solver is get_solver(default_solver(m))
        # the optimizer's msign settings reach the solver's options where it takes them, and nowhere else
        assert ("msign_steps" in plan.options) == ("msign_steps" in plan.solver.options and plan.solver.optimizer_msign)
        assert plan.options.get("msign_steps", 7) == 7
    # filled_split (carry) on Stiefel and DGram and exact on Oblique keep a warm start; Euclidean keeps nothing
    assert [bool(opt._plan_of[id(p)].kept_slots) for p in params] == [True, True, True, False]


def test_filled_split_keeps_state_only_where_it_splits():
    manifolds = (Stiefel(), DGram(), Oblique())
    params = [_params(m) for m in manifolds]
    groups = [{"params": [p], "manifold": m} for p, m in zip(params, manifolds)]
    opt = ManifoldMuon(groups, lr=0.01, solver="filled_split")
    assert [bool(opt._plan_of[id(p)].kept_slots) for p in params] == [True, True, False]
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    # Oblique's direction is unsplit: no multiplier, so no slot is kept, sent between ranks or checkpointed
    assert [set(opt.state[p]) for p in params] == [{"momentum_buffer", "correction"}] * 2 + [{"momentum_buffer"}]


def test_a_solver_that_carries_no_state_under_its_options_keeps_no_slots():
    group = {"solver": "filled_split", "solver_options": {"carry": False}, "warm_start": True}
    group.update(msign_method="polar_express", msign_steps=None, msign_dtype=None)
    assert not make_plan(group, DGram()).kept_slots
    assert make_plan(dict(group, solver_options={}), DGram()).kept_slots
    assert not make_plan(dict(group, solver_options={}, warm_start=False), DGram()).kept_slots


def test_equal_settings_batch_together_and_a_named_solver_does_not():
    m = DGram()
    group = {
        "solver": None,
        "solver_options": {},
        "warm_start": True,
        "msign_method": "polar_express",
        "msign_steps": None,
        "msign_dtype": None,
    }
    a, b = make_plan(group, m), make_plan(dict(group), DGram())
    c = make_plan(dict(group, solver="exact"), m)
    assert a.key == b.key and a.key != c.key and c.solver.name == "exact"


def test_a_loaded_state_dict_replans_from_its_groups():
    p = _params(DGram())
    opt = ManifoldMuon([{"params": [p], "manifold": DGram()}], lr=0.01)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["solver"] = "exact"
    fresh = ManifoldMuon([{"params": [p], "manifold": DGram()}], lr=0.01)
    assert fresh._plan_of[id(p)].solver.name == "filled_split"
    fresh.load_state_dict(sd)
    plan = fresh._plan_of[id(p)]
    assert plan.solver.name == "exact" and type(plan.manifold) is DGram
    p.grad = torch.randn_like(p)
    fresh.step()  # the step uses the loaded group's solver: its warm-start state is exact's
    assert all(slot.key in fresh.state[p] for slot in get_solver("exact").state)
