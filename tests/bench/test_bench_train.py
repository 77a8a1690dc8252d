"""geomtrain bench train: a line per timed step, Manifold Muon evaluations per step, ``--set`` applied
to every preset, and bad input as one line with exit code 2."""

import json

import pytest

from geomtrain.cli import main as cli_main


def _bench(data_dir, out, *extra):
    return cli_main(
        [
            "bench",
            "train",
            "--model",
            "tiny",
            "--data-dir",
            data_dir,
            "--presets",
            "unconstrained,all-stiefel",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch-size",
            "2",
            "--set",
            "block_size=16",
            *extra,
            "--out",
            str(out),
        ]
    )


@pytest.mark.slow
def test_bench_train_logs_each_step_and_counts_evaluations(data_dir, tmp_path, capsys):
    assert _bench(data_dir, tmp_path / "default.json") == 0
    err = capsys.readouterr().err
    assert err.count("(warmup)") == 2 and err.count("(timed)") == 4  # 2 presets x (1 + 2) steps
    record = json.loads((tmp_path / "default.json").read_text())
    rows = {r["preset"]: r for r in record["rows"]}
    muon = rows["unconstrained"]["evaluations_per_step"]
    assert muon > 0  # one msign per Muon matrix
    assert rows["all-stiefel"]["evaluations_per_step"] > muon  # filled_split: two msigns per tall matrix
    assert rows["all-stiefel"]["tokens_per_s"] == 2 * 16 / (rows["all-stiefel"]["ms_per_step"] / 1000)
    assert record["sets"] == ["block_size=16"] and record["warmup"] == 1
    assert {r["muon_solver"] for r in record["rows"]} == {"default"}  # per manifold kind
    # host synchronisations of the warmup step, counted: the solver's checks add to Muon's guards
    syncs = {p: r["host_syncs_per_step"] for p, r in rows.items()}
    assert all(isinstance(v, int) and v > 0 for v in syncs.values())
    assert syncs["all-stiefel"] > syncs["unconstrained"]
    # those inside the Manifold Muon step: a part of the whole, and the whole difference between the presets
    # (the rest of the step, forward, backward, checks and AdamW, is the same)
    inside = {p: r["muon_host_syncs_per_step"] for p, r in rows.items()}
    assert all(isinstance(v, int) and 0 < v < syncs[p] for p, v in inside.items())
    assert syncs["all-stiefel"] - inside["all-stiefel"] == syncs["unconstrained"] - inside["unconstrained"]


def test_bench_train_set_reaches_every_preset(data_dir, tmp_path, capsys):
    # With the one-shot tangent solver every Manifold Muon matrix costs one msign, as in plain Muon: the
    # --set reached the all-stiefel trainer (with the default solver it costs more, test above).
    assert _bench(data_dir, tmp_path / "tangent.json", "--set", "muon_solver=tangent", "--quiet") == 0
    assert "(timed)" not in capsys.readouterr().err  # --quiet
    rows = {r["preset"]: r for r in json.loads((tmp_path / "tangent.json").read_text())["rows"]}
    assert rows["all-stiefel"]["evaluations_per_step"] == rows["unconstrained"]["evaluations_per_step"] > 0
    assert rows["all-stiefel"]["muon_solver"] == "tangent"


def test_bench_train_rejects_bad_sets_in_one_line(data_dir, tmp_path, capsys):
    for bad, says in (
        (["model=gpt2"], "set by bench train itself"),
        (["nonsense=1"], "unknown config key 'nonsense'"),
        (["muon_solver=exact", "muon_solver_options=bogus=1"], "KEY one of tol, max_iter"),
        (["muon_solver_options=tol=1e-5"], "need a solver to belong to"),  # the default is per manifold kind
    ):
        assert _bench(data_dir, tmp_path / "bad.json", *[arg for text in bad for arg in ("--set", text)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "bad.json").exists()


def test_bench_train_rejects_bad_counts_and_empty_presets_in_one_line(data_dir, tmp_path, capsys):
    # before: --warmup -1 read "max_iters must be >= 1; got 0", and --presets , printed an empty table, exit 0
    for flag, bad, says in (
        ("--steps", "0", "argument --steps: invalid integer >= 1 value: '0'"),
        ("--warmup", "-1", "argument --warmup: invalid integer >= 0 value: '-1'"),
        ("--threads", "-1", "argument --threads: invalid integer >= 0 value: '-1'"),
        ("--presets", ",", "no preset given; valid: adamw, unconstrained"),
    ):
        assert _bench(data_dir, tmp_path / "bad.json", flag, bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.slow
def test_bench_train_threads_sets_and_records_the_torch_threads(data_dir, tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        assert _bench(data_dir, tmp_path / "one.json", "--threads", "1", "--quiet") == 0
        assert torch.get_num_threads() == 1
        assert json.loads((tmp_path / "one.json").read_text())["environment"]["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_bench_train_checks_its_out_path_before_timing(data_dir, tmp_path, capsys):
    # before: the JSON was written after every step had run, so a bad --out lost the whole measurement
    (tmp_path / "a_file").write_text("")
    for out, says in (
        (tmp_path / "a_file" / "rows.json", f"cannot make this folder: a file is in its path: {tmp_path / 'a_file'}"),
        (tmp_path, f"a folder, not a file: {tmp_path}"),
    ):
        assert _bench(data_dir, out) == 2
        captured = capsys.readouterr()
        assert captured.err == f"geomtrain bench train: error: {says}\n" and "step" not in captured.out
    assert _bench(data_dir, tmp_path / "new" / "folder" / "rows.json", "--quiet") == 0  # folders are made
    assert json.loads((tmp_path / "new" / "folder" / "rows.json").read_text())["rows"]
