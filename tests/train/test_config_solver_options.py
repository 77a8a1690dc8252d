"""Solver options are checked in full before a run folder exists (issue 53, items 6 and 13): a solver's
warm-start state slot (``correction``, ``dual``, ``escalate``) is not an option, the optimizer refuses it
too, and a misspelt solver name gets the same "did you mean" as a solver rule."""

import pytest
import torch
from fault_helpers import assert_one_line_error, cli, run_args

from geomtrain.config import TrainConfig
from geomtrain.optim import SOLVER_OPTIONS, SOLVERS, ManifoldMuon, get_solver
from manifolds import Stiefel


@pytest.mark.parametrize("solver, slot", [("filled_split", "correction"), ("exact", "escalate"), ("exact", "dual")])
def test_a_state_slot_given_as_an_option_is_refused_by_the_config(solver, slot):
    cfg = TrainConfig(muon_solver=solver, muon_solver_options=[f"{slot}=1"])
    with pytest.raises(ValueError) as err:
        cfg.validate()
    message = str(err.value)
    assert "\n" not in message and f"{slot}=1" in message and "warm-start state" in message
    assert all(option in message for option in SOLVER_OPTIONS[solver] if option != "trace")


def test_a_state_slot_option_makes_no_run_folder(data_dir, tmp_path, capsys):
    # before: the config check let it through, the folder was made, the run died at step 1 and the corrected
    # command was then refused with "already holds a run"
    run = tmp_path / "run"
    argv = run_args(data_dir, run, "--max-iters", "1", "--muon-solver", "filled_split")
    code, _, err = cli([*argv, "--muon-solver-options", "correction=1"], capsys)
    assert_one_line_error(code, err, "correction=1", "warm-start state", "degree, carry")
    assert not run.exists()


def test_no_solver_lists_a_state_slot_among_its_options():
    for name in SOLVERS:
        assert not set(SOLVER_OPTIONS[name]) & set(get_solver(name).state_options()), name
    assert "correction" not in SOLVER_OPTIONS["filled_split"] and "dual" not in SOLVER_OPTIONS["exact"]


def test_the_optimizer_refuses_a_state_slot_in_solver_options():
    W = torch.nn.Parameter(Stiefel().projx(torch.randn(16, 4)))
    group = {"params": [W], "manifold": Stiefel(), "solver": "filled_split", "solver_options": {"correction": 1}}
    with pytest.raises(ValueError, match="unknown solver option.*correction"):
        ManifoldMuon([group])


def test_an_unknown_option_name_says_which_one_was_meant():
    cfg = TrainConfig(muon_solver="filled_split", muon_solver_options=["cary=false"])
    with pytest.raises(ValueError, match=r"did you mean 'carry'\?"):
        cfg.validate()


def test_a_misspelt_muon_solver_says_which_one_was_meant():
    with pytest.raises(ValueError, match=r"unknown muon_solver 'exakt' \(did you mean 'exact'\?\); valid: exact"):
        TrainConfig(muon_solver="exakt").validate()
