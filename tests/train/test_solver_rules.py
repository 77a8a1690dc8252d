"""A direction solver per module (issue 42's hetero question): ``--solver-rule GLOB=SOLVER`` /
``muon_solver_rules``. Bad rules are one line (exit 2, nothing written); ``hetero`` with an MLP rule
gets the default's attention (``filled_split``, per manifold kind) and ``tangent`` MLP param
groups; a tiny run trains with them, names
them in its assignment files and checkpoint, and resumes with them."""

import json
import math

import pytest
import torch
from conftest import tiny_config
from fault_helpers import assert_one_line_error, cli, records, run_args

from geomtrain.assign import assign, is_gpt_matrix
from geomtrain.config import RUN_DEFINING_KEYS
from geomtrain.groups import build_optimizers, param_groups, pick_solvers, project_onto_manifolds
from geomtrain.model import GPT, model_config
from geomtrain.train import load_checkpoint

MLP_RULE = "*.mlp.*=tangent"


def _short(data_dir, out, *extra):
    return run_args(data_dir, out, "--max-iters", "3", "--eval-interval", "3", "--no-diagnostics", *extra)


def _solver_of(groups) -> dict[str, str]:
    """Parameter name -> the solver of its ManifoldMuon param group."""
    return {name: g["solver"] for g in groups for name in g["param_names"]}


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "rule, needles",
    [
        ("*.mlp.*=exakt", ["exakt", "did you mean 'exact'", "valid: exact"]),
        ("*.mlp.*=projected_tangent", ["projected_tangent", "retired from the product", "git worktree add"]),
        ("*.mlp.*", ["'*.mlp.*'", "GLOB=SOLVER", "filled_split"]),
        ("*.nothing.*=tangent", ["'*.nothing.*=tangent'", "matches no Muon matrix", "transformer.h."]),
        ("*.ln_1.*=tangent", ["'*.ln_1.*=tangent'", "matches no Muon matrix"]),  # AdamW parameters only
    ],
)
def test_bad_solver_rule_is_one_line_and_writes_nothing(rule, needles, data_dir, tmp_path, capsys):
    code, _, err = cli(_short(data_dir, tmp_path / "run", "--solver-rule", rule), capsys)
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "run").exists()


def test_solver_rules_are_checked_by_validate_and_define_the_run(data_dir):
    with pytest.raises(ValueError, match=r"solver rule '\*=nope': unknown solver 'nope'; valid: exact") as e:
        tiny_config(data_dir, muon_solver_rules=["*=nope"])
    assert "\n" not in str(e.value)
    assert "muon_solver_rules" in RUN_DEFINING_KEYS


# ----------------------------------------------------------------------------- the groups
def _hetero(data_dir, **overrides):
    """A tiny hetero GPT on its manifolds, its assignments, and the optimizers `build_optimizers` makes."""
    torch.manual_seed(0)
    model = GPT(model_config("tiny", block_size=16))
    named = list(model.named_parameters())
    assignments = assign(named, "hetero", (), None, is_gpt_matrix)
    project_onto_manifolds(dict(named), assignments)
    _, muon = build_optimizers(model, assignments, tiny_config(data_dir, **overrides))
    return assignments, muon


def test_hetero_with_an_mlp_rule_gets_default_attention_and_tangent_mlp(data_dir):
    assignments, muon = _hetero(data_dir, muon_solver_rules=[MLP_RULE])
    solvers = _solver_of(muon.param_groups)
    muon_names = [a.name for a in assignments if a.optimizer == "muon"]
    assert sorted(solvers) == sorted(muon_names) and len(muon_names) == 8  # 2 layers x (2 attention + 2 MLP)
    for name in muon_names:
        assert solvers[name] == ("tangent" if ".mlp." in name else "filled_split"), name
    assert {(g["manifold_name"], g["solver"]) for g in muon.param_groups} == {
        ("stiefel", "filled_split"),  # the default on Stiefel
        ("dgram", "tangent"),
    }
    assert {a.name: a.solver for a in assignments if a.optimizer == "muon"} == solvers  # what the table shows
    assert all(a.solver is None for a in assignments if a.optimizer == "adamw")


def test_one_manifold_splits_into_a_group_per_solver_and_options_stay_with_muon_solver(data_dir):
    # c_proj of attention (Stiefel) and of the MLP (DGram) go to tangent; the c_attn / c_fc stay exact.
    _, muon = _hetero(
        data_dir, muon_solver="exact", muon_solver_rules=["*.c_proj.weight=tangent"], muon_solver_options=["tol=1e-5"]
    )
    groups = {(g["manifold_name"], g["solver"]): g for g in muon.param_groups}
    assert set(groups) == {("stiefel", "exact"), ("stiefel", "tangent"), ("dgram", "exact"), ("dgram", "tangent")}
    tangent = [n for (_, solver), g in groups.items() if solver == "tangent" for n in g["param_names"]]
    assert len(tangent) == 4 and all(n.endswith("c_proj.weight") for n in tangent), tangent
    for (_, solver), g in groups.items():  # muon_solver_options are exact's; tangent runs with its defaults
        assert g["solver_options"] == ({"tol": 1e-5} if solver == "exact" else {}), solver


def test_first_matching_rule_wins_and_param_groups_takes_solver_rules():
    model = GPT(model_config("tiny", block_size=16))
    groups = param_groups(model, "hetero", solver_rules=["*.h.0.mlp.*=tangent", "*.mlp.*=exact"])
    by_name = {name: g.get("solver") for g in groups.muon for name in g["param_names"]}
    assert by_name["transformer.h.0.mlp.c_fc.weight"] == "tangent"
    assert by_name["transformer.h.1.mlp.c_fc.weight"] == "exact"
    assert by_name["transformer.h.0.attn.c_attn.weight"] is None  # no rule: the optimizer's default solver
    assert "solver" in groups.table().splitlines()[0].split()


def test_pick_solvers_refuses_a_rule_matching_no_muon_matrix():
    model = GPT(model_config("tiny", block_size=16))
    named = list(model.named_parameters())
    assignments = assign(named, "hetero", (), None, is_gpt_matrix)
    with pytest.raises(ValueError, match=r"solver rule 'lm_head\.\*=exact' matches no Muon matrix; closest: ") as e:
        pick_solvers(assignments, ["lm_head.*=exact"])
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- training and resuming
def _check_solvers_on_file(run) -> None:
    """assignment.json / .txt name each Muon matrix's solver; the checkpoint's Muon groups carry them."""
    table = json.loads((run / "assignment.json").read_text())
    matrices = {a["name"]: a["solver"] for a in table if a["optimizer"] == "muon"}
    expected = {n: "tangent" if ".mlp." in n else "filled_split" for n in matrices}
    assert matrices and matrices == expected
    assert all("solver" not in a for a in table if a["optimizer"] == "adamw")
    text = (run / "assignment.txt").read_text()
    assert "solver" in text.splitlines()[0] and "tangent" in text
    assert _solver_of(load_checkpoint(run)["muon"]["param_groups"]) == matrices


def test_tiny_run_with_solver_rules_logs_finite_losses_and_names_the_solvers(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code, out, err = cli(_short(data_dir, run, "--solver-rule", MLP_RULE), capsys)
    assert code == 0, err[-3000:]
    losses = [(r["step"], r["loss"]) for r in records(run, "train")]
    assert [s for s, _ in losses] == [1, 2, 3] and all(math.isfinite(v) for _, v in losses), losses
    assert "tangent" in out  # the printed table
    assert json.loads((run / "config.json").read_text())["muon_solver_rules"] == [MLP_RULE]
    _check_solvers_on_file(run)


def test_stopped_run_with_solver_rules_resumes_and_refuses_other_rules(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    argv = run_args(data_dir, run, "--max-iters", "4", "--eval-interval", "2", "--no-diagnostics")
    code, _, err = cli([*argv, "--solver-rule", MLP_RULE, "--stop-after", "2"], capsys)
    assert code == 130, err[-3000:]  # interrupted (as by SIGINT) at step 2, with a checkpoint
    assert load_checkpoint(run)["step"] == 2

    code, _, err = cli([*argv, "--resume", "--solver-rule", "*.attn.*=tangent"], capsys)
    assert_one_line_error(code, err, "muon_solver_rules")

    code, out, err = cli([*argv, "--resume"], capsys)  # the run's own rules
    assert code == 0, err[-3000:]
    assert "from step 2" in out
    losses = [(r["step"], r["loss"]) for r in records(run, "train")]
    assert [s for s, _ in losses] == [1, 2, 3, 4] and all(math.isfinite(v) for _, v in losses), losses
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    _check_solvers_on_file(run)


def test_resume_that_changes_a_solver_is_refused_even_when_config_changes_are_allowed(data_dir, tmp_path, capsys):
    # Loading the optimizer state would keep the checkpoint's solver under a config naming another one.
    run = tmp_path / "run"
    argv = run_args(data_dir, run, "--max-iters", "4", "--eval-interval", "2", "--no-diagnostics")
    assert cli([*argv, "--solver-rule", MLP_RULE, "--stop-after", "2"], capsys)[0] == 130
    before = (run / "ckpt.pt").read_bytes()
    for change in (["--solver-rule", "*.mlp.*=exact"], ["--muon-solver", "tangent", "--solver-rule", MLP_RULE]):
        code, _, err = cli([*argv, "--resume", *change, "--allow-config-change"], capsys)
        assert_one_line_error(code, err, "Muon solver", "muon_solver_rules")
    assert (run / "ckpt.pt").read_bytes() == before
    assert json.loads((run / "status.json").read_text())["status"] == "interrupted"


def test_without_a_solver_each_kind_gets_its_default_and_an_exact_checkpoint_names_the_way_on(data_dir):
    # muon_solver unset: filled_split on the Stiefel attention and on the DGram MLP, written into the
    # assignment (so the table and the checkpoint name it). A checkpoint of a run begun with other solvers (exact
    # everywhere, the first default; or exact on the DGram matrices, the second) is refused in one line that
    # says how to continue it.
    from geomtrain.checkpoint import CheckpointError
    from geomtrain.train import Trainer

    trainer = Trainer(tiny_config(data_dir, preset="hetero"))
    picked = {a.manifold_name: a.solver for a in trainer.assignments if a.optimizer == "muon"}
    assert picked == {"stiefel": "filled_split", "dgram": "filled_split"}
    exact = Trainer(tiny_config(data_dir, preset="hetero", muon_solver="exact")).state_dict()
    with pytest.raises(CheckpointError, match=r"c_attn.weight has .*'exact'.*'filled_split'.*muon_solver=exact") as e:
        trainer.load_state_dict(exact)
    assert "\n" not in str(e.value)
    Trainer(tiny_config(data_dir, preset="hetero", muon_solver="exact")).load_state_dict(exact)
    mixed = Trainer(tiny_config(data_dir, preset="hetero", muon_solver_rules=["*.mlp.*=exact"])).state_dict()
    hint = r"mlp.c_fc.weight has .*'exact'.*'filled_split'.*its solvers are filled_split on stiefel matrices, "
    with pytest.raises(CheckpointError, match=hint + r"exact on dgram matrices: .*muon_solver_rules, e\.g\. .*=exact"):
        trainer.load_state_dict(mixed)


def test_checkpoint_without_solvers_in_its_assignment_still_loads(data_dir):
    from geomtrain.train import Trainer

    ckpt = Trainer(tiny_config(data_dir)).state_dict()
    assert all("solver" in a for a in ckpt["assignment"] if a["optimizer"] == "muon")
    for a in ckpt["assignment"]:  # as written before solvers were recorded
        a.pop("solver", None)
    Trainer(tiny_config(data_dir)).load_state_dict(ckpt)
