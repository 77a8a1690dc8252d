"""geomtrain.study.tune: the grid search per arm (interior search, disjoint seeds), and a tuned study."""

import json
import math

import pytest
from conftest import tiny_study

from geomtrain._io import atomic_write_json, read_json
from geomtrain.study import StudyError, plan
from geomtrain.study.plan import Variant
from geomtrain.study.report import format_tuning, tuning_section
from geomtrain.study.runner import save_record
from geomtrain.study.tune import (
    TuneProtocol,
    choose,
    extend_grid,
    parse_tune,
    run_tuning,
    selection_seeds,
    validate_selection,
)
from geomtrain.train import lr_at


def test_parse_tune_scopes_and_errors():
    grids = parse_tune(["muon_lr=0.04,0.01,0.02", "adamw:lr=3e-4,6e-4,1.2e-3"])
    assert grids == {
        "*": [{"key": "muon_lr", "values": [0.01, 0.02, 0.04]}],
        "adamw": [{"key": "lr", "values": [3e-4, 6e-4, 1.2e-3]}],
    }
    two = parse_tune(["muon_lr=0.01,0.02,0.04", "lr=1e-3,2e-3,4e-3"])["*"]  # several keys: in the order given
    assert [g["key"] for g in two] == ["muon_lr", "lr"]
    for bad, match in [
        ("muon_lr", "must look like"),
        ("muon_lr=0.01,0.02", "at least 3 values"),
        ("nope:lr=1,2,3", "unknown preset 'nope'"),
        ("muon_lr=a,b,c", "expects a number"),
        ("adamw:muon_lr=0.01,0.02,0.04", "adamw trains no matrix with Muon, so muon_lr changes nothing; tune lr"),
    ]:
        with pytest.raises((StudyError, ValueError), match=match):
            parse_tune([bad])
    with pytest.raises(StudyError, match="two grids of muon_lr for every arm"):
        parse_tune(["muon_lr=1,2,3", "muon_lr=4,5,6"])
    texts = ["muon_lr=0.1,0.2,0.4", "lr=1,2,4", "hetero:weight_decay=0,1,2", "hetero:muon_lr=7,8,9"]
    protocol = TuneProtocol(grids=parse_tune(texts), select_seeds=[9])
    keys = {p: [(g["key"], g["values"][0]) for g in protocol.grids_of(Variant(p, p))] for p in ("hetero", "adamw")}
    # a preset's grid of a key replaces the shared one in its place; its other keys come after the shared ones
    assert keys["hetero"] == [("muon_lr", 7), ("lr", 1), ("weight_decay", 0)] and keys["adamw"] == [("lr", 1)]
    old = {"grids": {"*": {"key": "muon_lr", "values": [1, 2, 3]}}, "select_seeds": [9]}  # an older study.json
    assert TuneProtocol.from_dict(old).grids == {"*": [{"key": "muon_lr", "values": [1, 2, 3]}]}


def test_selection_seeds_are_apart_from_confirmation_seeds():
    assert selection_seeds("2") == [1000, 1001] and selection_seeds("5,6") == [5, 6]
    for bad in ("0", "5,-3", ","):  # the error names the option the user gave
        with pytest.raises(StudyError, match=f"^--select-seeds '{bad}': give a count >= 1"):
            selection_seeds(bad)
    protocol = TuneProtocol(grids={}, select_seeds=[0, 7])
    with pytest.raises(StudyError, match="selection seeds 0 are also confirmation seeds"):
        protocol.check([0, 1, 2])
    assert protocol.check([1, 2]) is protocol
    with pytest.raises(StudyError, match="fraction"):
        TuneProtocol(grids={}, select_seeds=[9], fraction=0).check([0])
    with pytest.raises(StudyError, match="--tune-passes must be >= 1; got 0"):
        TuneProtocol(grids={}, select_seeds=[9], max_passes=0).check([0])


def test_extend_grid_geometric_arithmetic_and_bounds():
    assert extend_grid([0.01, 0.02, 0.04], "high") == 0.08
    assert extend_grid([0.01, 0.02, 0.04], "low") == 0.005
    assert extend_grid([1.0, 2.0, 3.0], "high") == 4.0 and extend_grid([1.0, 2.0, 3.0], "low") is None  # 0 is out
    assert extend_grid([2, 4, 6], "low") is None and extend_grid([2, 4, 6], "high") == 8
    assert extend_grid([-1.0, 0.0, 1.0], "low") == -2.0  # a grid through zero steps on


def test_choose_interior_edge_and_diverged():
    grid = [0.01, 0.02, 0.04]
    assert choose(grid, {0.01: 3.0, 0.02: 2.9, 0.04: 3.1}, 0, 2) == {"best": 0.02, "where": "interior", "grow": None}
    assert choose(grid, {0.01: 3.0, 0.02: 2.9, 0.04: 2.8}, 0, 2)["grow"] == "high"
    assert choose(grid, {0.01: 2.0, 0.02: 2.9, 0.04: 2.8}, 0, 2)["grow"] == "low"
    stopped = choose(grid, {0.01: 3.0, 0.02: 2.9, 0.04: 2.8}, 2, 2)
    assert stopped == {"best": 0.04, "where": "edge", "grow": None}
    assert choose(grid, {0.01: 3.0, 0.02: 2.9, 0.04: math.inf}, 0, 2)["where"] == "interior"  # diverged is worst
    assert choose(grid, {v: math.inf for v in grid}, 0, 2) == {"best": None, "where": "diverged", "grow": None}


def _fake_study(
    tmp_path, data_dir, max_extend=2, optimum=0.1, tune=("muon_lr=0.01,0.02,0.04",), lr_optimum=None, **protocol_args
):
    """A tuned study whose "training" writes a final val loss (x - log optimum)^2 in x = log muon_lr (plus the same
    in y = log lr about ``lr_optimum``, where given; with ``coupling`` c, muon_lr's optimum moves with lr: the loss is
    (x - log optimum - c (y - log lr_optimum))^2 + (y - log lr_optimum)^2)."""
    coupling = protocol_args.pop("coupling", 0.0)
    protocol = TuneProtocol(grids=parse_tune(tune), select_seeds=[1000], max_extend=max_extend, **protocol_args)
    base = {"model": "tiny", "data_dir": data_dir, "max_iters": 40, "warmup_iters": 4, "eval_interval": 2}
    study = plan(
        tmp_path / "s",
        presets=["unconstrained", "adamw"],
        seeds=[0, 1],
        base=base,
        options={"tune": protocol.to_dict()},
    )
    trained = []

    def train_jobs(jobs):
        for v, seed in jobs:
            if (study.run_dir(v, seed) / "status.json").exists():  # done: the scheduler passes it over
                continue
            cfg = study.config(v, seed)
            trained.append((v.name, seed, cfg.max_iters, cfg.warmup_iters))
            dy = 0.0 if lr_optimum is None else math.log(cfg.lr) - math.log(lr_optimum)
            loss = (math.log(cfg.muon_lr) - math.log(optimum) - coupling * dy) ** 2 + dy**2 + 0.001 * seed
            run = study.run_dir(v, seed)
            run.mkdir(parents=True, exist_ok=True)
            atomic_write_json(
                run / "status.json", {"status": "finished", "final_val_loss": loss, "step": cfg.max_iters}
            )
        return 0

    return study, validate_selection(study), train_jobs, trained


def test_the_grid_grows_until_the_best_value_is_interior(tmp_path, data_dir):
    study, _, train_jobs, trained = _fake_study(tmp_path, data_dir, fraction=0.5)
    record = {"invocations": [{"id": "me"}], "timing": {"runs": {}}}
    assert run_tuning(study, record, train_jobs, lambda: None, print_fn=lambda *a: None) == 0
    arm = record["tuning"]["arms"]["unconstrained"]
    assert arm["grid"] == [0.01, 0.02, 0.04, 0.08, 0.16] and arm["best"] == 0.08 and arm["where"] == "interior"
    assert record["tuning"]["untuned"] == ["adamw"]  # a muon_lr grid passes the AdamW baseline by
    selection = [t for t in trained if t[0].startswith("select-")]
    assert {t[1] for t in selection} == {1000} and {(t[2], t[3]) for t in selection} == {(20, 2)}  # half horizon
    assert len(selection) == 5  # each grid value trained once, the grown ones after the first three
    confirm = [t for t in trained if not t[0].startswith("select-")]
    assert sorted((t[0], t[1], t[2]) for t in confirm) == [
        (n, s, 40) for n in ("adamw", "unconstrained") for s in (0, 1)
    ]
    final = {v.name: v for v in study.variants if v.role is None}
    assert final["unconstrained"].overrides == {"muon_lr": 0.08} and final["adamw"].overrides == {}


def test_the_search_stops_at_the_edge_after_max_extend(tmp_path, data_dir):
    study, _, train_jobs, _ = _fake_study(tmp_path, data_dir, max_extend=1, optimum=1.0)
    record = {"invocations": [{"id": "me"}], "timing": {"runs": {}}}
    run_tuning(study, record, train_jobs, lambda: None, print_fn=lambda *a: None)
    arm = record["tuning"]["arms"]["unconstrained"]
    assert arm["grid"][-1] == 0.08 and arm["best"] == 0.08 and arm["where"] == "edge" and arm["extended"] == 1


def test_several_keys_are_searched_one_after_the_other(tmp_path, data_dir):
    # muon_lr first (lr at the study's 6e-4: its optimum 0.08 is independent of lr here), then lr at muon_lr 0.08;
    # one pass (later passes: the next test)
    tune = ("muon_lr=0.01,0.02,0.04", "lr=3e-4,6e-4,1.2e-3")
    one = {"optimum": 0.08, "tune": tune, "lr_optimum": 2.4e-3, "max_passes": 1}
    study, _, train_jobs, trained = _fake_study(tmp_path, data_dir, **one)
    record = {"invocations": [{"id": "me"}], "timing": {"runs": {}}}
    assert run_tuning(study, record, train_jobs, lambda: None, print_fn=lambda *a: None) == 0
    first, second = record["tuning"]["arms"]["unconstrained"]["stages"]
    assert first["key"] == "muon_lr" and "fixed" not in first and first["best"] == 0.08 and first["where"] == "interior"
    assert second["key"] == "lr" and second["fixed"] == {"muon_lr": 0.08}
    assert second["grid"] == [3e-4, 6e-4, 1.2e-3, 2.4e-3, 4.8e-3] and second["best"] == 2.4e-3
    adamw = record["tuning"]["arms"]["adamw"]  # the shared muon_lr grid passes it by; lr alone: a one-key record
    assert "stages" not in adamw and adamw["key"] == "lr" and adamw["best"] == 2.4e-3
    names = {t[0] for t in trained if t[0].startswith("select-unconstrained")}
    assert "select-unconstrained__muon_lr-0.04" in names and "select-unconstrained__muon_lr-0.08__lr-0.0024" in names
    # each grid grew by two; lr 6e-4, the study's value, is muon_lr 0.08's run of the first search: not trained again
    assert len(names) == 5 + 4 and "select-unconstrained__muon_lr-0.08__lr-0.0006" not in names
    assert second["reused"] == {"0.0006": "select-unconstrained__muon_lr-0.08"}
    assert second["scores"]["0.0006"] == first["scores"]["0.08"]
    final = {v.name: v for v in study.variants if v.role is None}
    # a tuned lr moves min_lr with it: 6e-5 * 2.4e-3 / 6e-4
    assert final["unconstrained"].overrides == {"muon_lr": 0.08, "lr": 2.4e-3, "min_lr": 2.4e-4}
    assert final["adamw"].overrides == {"lr": 2.4e-3, "min_lr": 2.4e-4}
    assert [(t[0], t[1]) for t in trained if not t[0].startswith("select-")] == [
        (n, s) for s in (0, 1) for n in ("unconstrained", "adamw")
    ]
    table = format_tuning(record["tuning"])
    assert "| unconstrained | lr (at muon_lr=0.08) |" in table and table.count("| unconstrained |") == 2
    assert "A tuned lr moves min_lr with it." in tuning_section(record["tuning"])[0]
    count = len(trained)  # resuming replays the same search from the recorded runs and trains nothing
    fresh, _, _, _ = _fake_study(tmp_path, data_dir, **one)
    again = {"invocations": [{"id": "me"}], "timing": {"runs": {}}}
    assert run_tuning(fresh, again, train_jobs, lambda: None, print_fn=lambda *a: None) == 0
    assert len(trained) == count and again["tuning"]["arms"] == record["tuning"]["arms"]


def _search(tmp_path, data_dir, **args):
    study, _, train_jobs, trained = _fake_study(tmp_path, data_dir, **args)
    record = {"invocations": [{"id": "me"}], "timing": {"runs": {}}}
    assert run_tuning(study, record, train_jobs, lambda: None, print_fn=lambda *a: None) == 0
    final = {v.name: v.overrides for v in study.variants if v.role is None}["unconstrained"]
    return record["tuning"], final, [t[0] for t in trained if t[0].startswith("select-unconstrained")]


def test_later_passes_search_each_key_again_until_none_moves(tmp_path, data_dir):
    """muon_lr's optimum moves with lr (coupling 1/2; optimum 0.04 at lr 2.4e-3, 0.02 at the study's 6e-4): one pass
    stops at (0.02, 2.4e-3), where muon_lr 0.04 is better; a second pass moves muon_lr there, and lr, searched again
    about 2.4e-3, stays: the search ends at the optimum."""
    tune = ("muon_lr=0.01,0.02,0.04", "lr=3e-4,6e-4,1.2e-3")
    coupled = {"optimum": 0.04, "tune": tune, "lr_optimum": 2.4e-3, "coupling": 0.5}
    once, final, _ = _search(tmp_path / "one", data_dir, **coupled, max_passes=1)
    assert [(s["key"], s["best"]) for s in once["arms"]["unconstrained"]["stages"]] == [
        ("muon_lr", 0.02),
        ("lr", 2.4e-3),
    ]
    assert final["muon_lr"] == 0.02
    tuning, final, names = _search(tmp_path / "three", data_dir, **coupled)
    stages = tuning["arms"]["unconstrained"]["stages"]
    assert [(s["key"], s.get("pass", 1), s["best"]) for s in stages] == [
        ("muon_lr", 1, 0.02),
        ("lr", 1, 2.4e-3),
        ("muon_lr", 2, 0.04),
        ("lr", 2, 2.4e-3),
    ]
    # pass 2: about the choice (its grid neighbours, growing at an edge), every other key at its choice
    assert stages[2]["grid"] == [0.01, 0.02, 0.04, 0.08] and stages[2]["fixed"] == {"lr": 2.4e-3}
    assert stages[3]["grid"] == [1.2e-3, 2.4e-3, 4.8e-3] and stages[3]["fixed"] == {"muon_lr": 0.04}
    assert stages[2]["reused"] == {"0.02": "select-unconstrained__muon_lr-0.02__lr-0.0024"}
    assert final == {"muon_lr": 0.04, "lr": 2.4e-3, "min_lr": 2.4e-4}
    assert len(names) == len(set(names)) == 3 + 4 + 3 + 2  # the value a later search starts from is not retrained
    table = format_tuning(tuning)
    assert (
        "| unconstrained | muon_lr, pass 2 (at lr=0.0024) |" in table
        and "at most 3 passes" in tuning_section(tuning)[0]
    )
    # uncoupled keys: the second pass keeps muon_lr, and the search stops after one more key
    tuning, final, _ = _search(tmp_path / "free", data_dir, optimum=0.08, tune=tune, lr_optimum=2.4e-3)
    stages = tuning["arms"]["unconstrained"]["stages"]
    assert [(s["key"], s["best"]) for s in stages] == [("muon_lr", 0.08), ("lr", 2.4e-3), ("muon_lr", 0.08)]
    assert final["muon_lr"] == 0.08 and TuneProtocol.from_dict({"grids": {}, "select_seeds": [9]}).max_passes == 1


def test_a_tuned_lr_keeps_the_schedules_shape(tmp_path, data_dir):
    # every run of a tuned lr, selection and confirmation, ends both cosines (AdamW's; Muon's, which follows
    # lr_t / lr) at the study's min_lr / lr = 6e-5 / 6e-4 = 0.1 of their peaks; min_lr is rounded to 6
    # significant digits, hence rel=1e-5
    tune = ("muon_lr=0.01,0.02,0.04", "lr=3e-4,6e-4,1.2e-3")
    study, _, train_jobs, _ = _fake_study(tmp_path, data_dir, optimum=0.08, tune=tune, lr_optimum=2.4e-3)
    record = {"invocations": [{"id": "me"}], "timing": {"runs": {}}}
    assert run_tuning(study, record, train_jobs, lambda: None, print_fn=lambda *a: None) == 0
    lrs = set()
    for v in study.variants:
        cfg = study.config(v, (v.seeds or study.seeds)[0])
        lrs.add(cfg.lr)
        end = lr_at(cfg.max_iters, cfg)
        assert end / cfg.lr == pytest.approx(0.1, rel=1e-5)  # AdamW's floor, and Muon's: muon_lr * end / lr
        if cfg.lr == 6e-4:  # the study's own lr (the muon_lr search, the reused run): its min_lr untouched
            assert cfg.min_lr == 6e-5 and "min_lr" not in v.overrides
    assert lrs >= {3e-4, 6e-4, 1.2e-3, 2.4e-3, 4.8e-3}


def test_follow_leaves_min_lr_alone_where_it_should():
    arm = Variant("hetero", "hetero")
    scaled = TuneProtocol(grids={}, select_seeds=[1000])
    assert scaled.follow(arm, {"lr": 1e-3, "min_lr": 1e-4}, {"lr": 4e-3}) == {"lr": 4e-3, "min_lr": 4e-4}
    assert scaled.follow(arm, {}, {"lr": 1.2e-3}) == {"lr": 1.2e-3, "min_lr": 1.2e-4}  # the config's 6e-4, 6e-5
    assert scaled.follow(arm, {}, {"muon_lr": 0.04}) == {"muon_lr": 0.04}  # no lr: nothing to follow
    assert scaled.follow(arm, {}, {"lr": 6e-4}) == {"lr": 6e-4}  # the arm's own lr
    assert scaled.follow(arm, {}, {"lr": 1.2e-3, "min_lr": 0.0}) == {"lr": 1.2e-3, "min_lr": 0.0}  # tuned too
    fixed = TuneProtocol(grids={}, select_seeds=[1000], scale_min_lr=False)
    assert fixed.follow(arm, {}, {"lr": 1.2e-3}) == {"lr": 1.2e-3}
    # a record written before the rule (no scale_min_lr) kept the study's min_lr: it reads as such
    old = TuneProtocol.from_dict({"grids": {"*": {"key": "lr", "values": [1e-3, 2e-3, 4e-3]}}, "select_seeds": [1000]})
    assert old.scale_min_lr is False and TuneProtocol.from_dict(scaled.to_dict()).scale_min_lr is True


def test_overlapping_seeds_are_refused_before_any_folder(data_dir, tmp_path, capsys):
    code = tiny_study(
        data_dir, tmp_path / "s", "--presets", "hetero", "--tune", "muon_lr=0.01,0.02,0.04", "--select-seeds", "0,5"
    )
    assert code == 2 and "also confirmation seeds" in capsys.readouterr().err and not (tmp_path / "s").exists()
    code = tiny_study(data_dir, tmp_path / "t", "--tune", "muon_lr=0.01,0.02,0.04", "--sweep", "lr=1e-3,2e-3")
    assert code == 2 and "--tune runs on the presets suite without --sweep" in capsys.readouterr().err


def test_save_record_keeps_both_invocations(tmp_path):
    first = {"invocations": [{"id": "a", "started": "1", "elapsed_s": 3.0}], "timing": {"runs": {}}}
    second = {"invocations": [{"id": "b", "started": "2", "elapsed_s": 5.0}], "timing": {"runs": {}}}
    save_record(tmp_path, first, added=("x/s0", 10.0))
    save_record(tmp_path, second, added=("y/s0", 20.0))  # b never saw a's run
    save_record(tmp_path, first, added=("x/s1", 1.0))
    disk = read_json(tmp_path / "study.json")
    assert [i["id"] for i in disk["invocations"]] == ["a", "b"]
    assert disk["timing"]["runs"] == {"x/s0": 10.0, "y/s0": 20.0, "x/s1": 1.0}
    assert disk["timing"]["total_s"] == 31.0 and disk["timing"]["elapsed_s"] == 8.0


@pytest.mark.slow
def test_a_tuned_study_end_to_end(data_dir, tmp_path):
    """A real tuned study of the tiny model: selection runs apart from the table, comparisons paired."""
    out = tmp_path / "s"
    args = ["--presets", "unconstrained,hetero", "--tune", "muon_lr=0.01,0.02,0.04", "--tune-max-extend", "0"]
    assert tiny_study(data_dir, out, *args, "--seeds", "2") == 0
    study = read_json(out / "study.json")
    assert study["tuning"]["protocol"]["select_seeds"] == [1000]
    assert set(study["tuning"]["arms"]) == {"unconstrained", "hetero"}
    assert sorted(p.name for p in (out / "runs").iterdir() if p.name.startswith("select-")) == [
        f"select-{a}__muon_lr-{v}" for a in ("hetero", "unconstrained") for v in ("0.01", "0.02", "0.04")
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["variant"] for r in summary["table"]] == ["unconstrained", "hetero"]
    (comparison,) = summary["comparisons"]
    assert (
        comparison["arm"] == "hetero" and comparison["reference"] == "unconstrained" and comparison["seeds"] == [0, 1]
    )
    text = (out / "results.md").read_text()
    assert "Tuning (selection runs" in text and "Paired comparisons" in text
    assert tiny_study(data_dir, out, *args, "--seeds", "2") == 0  # a rerun trains nothing more
    assert len(read_json(out / "study.json")["invocations"]) == 2


@pytest.mark.slow
def test_a_tuned_study_continues_only_at_its_own_selection_horizon(data_dir, tmp_path, capsys):
    """A study selected at half the horizon (the default before 1) refuses to continue at another fraction or on
    other selection seeds, naming its own, before anything is written; with them it continues."""
    out = tmp_path / "s"
    args = ["--presets", "unconstrained", "--tune", "muon_lr=0.01,0.02,0.04", "--tune-max-extend", "0", "--seeds", "1"]
    assert tiny_study(data_dir, out, *args, "--tune-fraction", "0.5") == 0
    before = (out / "study.json").read_bytes()
    assert tiny_study(data_dir, out, *args) == 2
    err = capsys.readouterr().err
    assert "selects at --tune-fraction 0.5 (its selection runs have that length); pass it to continue" in err
    assert (out / "study.json").read_bytes() == before
    assert tiny_study(data_dir, out, *args, "--tune-fraction", "0.5", "--select-seeds", "7,8") == 2
    err = capsys.readouterr().err  # other selection seeds would choose anew beside the confirmed runs
    assert "selects on seeds 1000 (its choices were made there); pass --select-seeds with them to continue" in err
    assert (out / "study.json").read_bytes() == before
    assert tiny_study(data_dir, out, *args, "--tune-fraction", "0.5") == 0


@pytest.mark.slow
def test_a_tuned_study_of_two_keys_end_to_end(data_dir, tmp_path):
    """`--tune muon_lr=... --tune lr=...` from the command line: the Muon arm searches both keys in turn, `adamw` the
    shared `lr` grid alone; the report shows a row per key."""
    out = tmp_path / "s"
    grids = ["--tune", "muon_lr=0.01,0.02,0.04", "--tune", "lr=1e-3,2e-3,4e-3", "--tune-max-extend", "0"]
    grids += ["--tune-passes", "1"]  # one pass over the keys (later passes: test_later_passes_...)
    assert tiny_study(data_dir, out, "--presets", "adamw,hetero", *grids, "--seeds", "1") == 0
    record = read_json(out / "study.json")
    assert " --tune-fraction 1.0 " in record["command"]  # the protocol at its defaults too (command_argv)
    arms = record["tuning"]["arms"]
    first, second = arms["hetero"]["stages"]
    assert (first["key"], second["key"], second["fixed"]) == ("muon_lr", "lr", {"muon_lr": first["best"]})
    assert arms["adamw"]["key"] == "lr" and "stages" not in arms["adamw"]
    picked = f"select-hetero__muon_lr-{first['best']:g}__lr-"
    runs = sorted(p.name for p in (out / "runs").iterdir() if p.name.startswith("select-hetero"))
    assert len(runs) == 6 and sum(r.startswith(picked) for r in runs) == 3
    text = (out / "results.md").read_text()
    assert f"| hetero | lr (at muon_lr={first['best']:g}) |" in text and "searches them in turn" in text
    (hetero,) = [r for r in json.loads((out / "summary.json").read_text())["table"] if r["variant"] == "hetero"]
    assert f"lr={second['best']:g}" in hetero["label"] and f"muon_lr={first['best']:g}" in hetero["label"]


def test_a_dry_run_prints_each_arms_grids_and_the_least_number_of_runs(data_dir, tmp_path, capsys):
    from geomtrain.cli import main as cli_main

    grids = ["muon_lr=0.01,0.02,0.04", "lr=3e-4,6e-4,1.2e-3", "adamw:lr=1e-3,2e-3,4e-3,8e-3"]
    argv = ["study", "--model", "tiny", "--data-dir", data_dir, "--out", str(tmp_path / "x"), "--iters", "40"]
    argv += ["--presets", "hetero,adamw", "--seeds", "3", "--select-seeds", "2", "--dry-run"]
    assert cli_main([*argv, *(a for g in grids for a in ("--tune", g))]) == 0
    out = capsys.readouterr().out
    assert "  hetero: muon_lr 0.01, 0.02, 0.04, then lr 0.0003, 0.0006, 0.0012\n" in out
    assert "  adamw: lr 0.001, 0.002, 0.004, 0.008\n" in out
    # (6 - 1 + 4 values) x 2 selection seeds at the whole horizon, 40 steps (the default; lr 6e-4, the study's, is the
    # best muon_lr's run); 2 arms x 3 confirmation seeds at 40
    assert "selection: at least 18 runs of 40 steps (seeds 1000, 1001; each grid may grow by 2; " in out
    assert "several keys: up to 3 passes); " in out
    assert "confirmation: 6 runs of 40 steps" in out and not (tmp_path / "x").exists()
