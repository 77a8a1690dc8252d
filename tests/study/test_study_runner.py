"""geomtrain.study.runner: a smoke study with its report, skipping done runs, resuming
interrupted ones, runs shared between suites, parallel workers, run locks, refusing a folder of
other settings, and a bounded-DGram variant trained by its registry name."""

import json
import os
import shutil

import pytest
from conftest import FAST_STUDY_SETS, tiny_study

from geomtrain.cli import main as cli_main
from geomtrain.data import load_manifest
from geomtrain.study import claim_lock, collect, load_summary, plan
from geomtrain.study import main as study_main
from geomtrain.study.runner import train_one


@pytest.mark.slow
def test_smoke_study_report_and_resume(data_dir, tmp_path, capsys):
    out = tmp_path / "study"
    assert tiny_study(data_dir, out, "--presets", "adamw,hetero", "--seeds", "2") == 0
    for name in (
        "study.json",
        "summary.json",
        "results.csv",
        "results.md",
        "val_loss.png",
        "sigma_max.png",
        "attention.png",
        "overhead.png",
    ):
        assert (out / name).stat().st_size > 0, name
    study = json.loads((out / "study.json").read_text())
    assert study["seeds"] == [0, 1] and [v["name"] for v in study["variants"]] == ["adamw", "hetero"]
    assert study["command"].startswith("geomtrain study --model tiny") and "torch" in study["environment"]
    manifest = load_manifest(data_dir)  # the data record names the very corpus trained on
    assert study["data"]["tokenizer"] == manifest["tokenizer"]
    assert study["data"]["splits"]["train"]["sha256"] == manifest["splits"]["train"]["sha256"]
    assert set(study["timing"]["runs"]) == {"adamw/s0", "hetero/s0", "adamw/s1", "hetero/s1"}
    summary = load_summary(out)
    rows = {r["variant"]: r for r in summary["table"]}
    assert rows["hetero"]["attention"] == "stiefel" and rows["hetero"]["mlp"] == "dgram"
    assert rows["adamw"]["finished"] == 2 and rows["adamw"]["final_val_std"] is not None
    assert rows["adamw"]["vs_adamw"] == 1.0 and rows["hetero"]["vs_adamw"] > 0
    hetero = [r for r in summary["runs"] if r["variant"] == "hetero"][0]
    assert hetero["eval"]["step"] == [3, 6] and len(hetero["diag"]["attention"]["mean_entropy"][0]) == 2
    assert max(hetero["diag"]["sigma_max"]["attn_out"][-1]) == pytest.approx(1.0, abs=1e-3)  # Stiefel attention
    assert max(hetero["diag"]["sigma_max"]["attn_q"][-1]) <= 1.0 + 1e-3
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("variant,label,attention,mlp") and len(csv_lines) == 3
    assert "| hetero | stiefel | dgram |" in (out / "results.md").read_text()
    # the direction solver's record: every logged step (log_interval 1) of both seeds, each direction
    # either within tol (1e-4; float32 stops at 0.95 tol, rounding of A adds up to 0.4%) or counted as polished
    solver = hetero["solver"]
    assert solver["logged_steps"] == 6 and solver["evals_per_step"] >= 8  # tiny: 8 hidden matrices, >= 1 each
    assert solver["residual_max"] <= 1e-4 * 1.01 or solver["unconverged_steps"] > 0
    # and which matrices were polished, per matrix name: present exactly when some step had one
    assert (solver["unconverged_steps"] > 0) == bool(solver["unconverged_matrices"])
    assert all(name.endswith(".weight") for name in solver["unconverged_matrices"])
    assert rows["hetero"]["solver_logged_steps"] == 12 and rows["adamw"].get("solver_evals_per_step") is None
    assert "| hetero | " in (out / "results.md").read_text().split("Direction solver")[1]

    # a second call trains nothing: every run is skipped
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("ckpt.pt")}
    capsys.readouterr()
    assert (
        study_main(
            [
                "--model",
                "tiny",
                "--data-dir",
                data_dir,
                "--iters",
                "6",
                "--set",
                "eval_interval=3",
                "--out",
                str(out),
                *FAST_STUDY_SETS,
                "--presets",
                "adamw,hetero",
                "--seeds",
                "2",
                "--no-report",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("(skipped)") == 4
    assert mtimes == {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("ckpt.pt")}

    # report rebuilds from the runs, then (runs gone) from summary.json alone
    (out / "val_loss.png").unlink()
    assert cli_main(["report", str(out)]) == 0 and (out / "val_loss.png").exists()
    shutil.rmtree(out / "runs")
    (out / "sigma_max.png").unlink()
    assert study_main(["report", str(out)]) == 0 and (out / "sigma_max.png").exists()
    assert "rebuilt from" in capsys.readouterr().out
    assert load_summary(out)["table"] == summary["table"]


@pytest.mark.slow
def test_interrupted_runs_resume(data_dir, tmp_path):
    out = tmp_path / "study"
    assert tiny_study(data_dir, out, "--presets", "adamw", "--set", "stop_after=3") == 0
    status = json.loads((out / "runs" / "adamw" / "s0" / "status.json").read_text())
    assert status["status"] == "interrupted" and status["step"] == 3
    assert tiny_study(data_dir, out, "--presets", "adamw") == 0
    status = json.loads((out / "runs" / "adamw" / "s0" / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 6
    steps = [
        json.loads(line)["step"]
        for line in (out / "runs" / "adamw" / "s0" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == [1, 2, 3, 4, 5, 6]  # no duplicated records after the resume


@pytest.mark.slow
def test_suites_sharing_a_runs_dir_reuse_identical_runs(data_dir, tmp_path, capsys):
    runs = str(tmp_path / "runs")
    assert tiny_study(data_dir, tmp_path / "main", "--presets", "adamw", "--runs-dir", runs) == 0
    capsys.readouterr()
    assert (
        study_main(
            [
                "--model",
                "tiny",
                "--data-dir",
                data_dir,
                "--iters",
                "6",
                "--set",
                "eval_interval=3",
                *FAST_STUDY_SETS,
                "--suite",
                "lr-sweep",
                "--presets",
                "adamw",
                "--sweep",
                "muon_lr=0.02,0.05",
                "--runs-dir",
                runs,
                "--out",
                str(tmp_path / "sweep"),
                "--no-report",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "adamw__muon_lr-0.05 seed 0: training" in out and "adamw seed 0: already finished (skipped)" in out
    rows = {r["variant"]: r for r in collect(tmp_path / "sweep")["table"]}
    assert set(rows) == {"adamw", "adamw__muon_lr-0.05"} and rows["adamw__muon_lr-0.05"]["vs_adamw"] == 1.0


@pytest.mark.slow
def test_parallel_workers_give_the_same_results(data_dir, tmp_path):
    # --jobs 2: runs in two spawned processes; every run is seeded on its own, so the results
    # must match one worker's exactly (losses and singular values, bit for bit).
    one, two = tmp_path / "one", tmp_path / "two"
    presets = ["--presets", "adamw,hetero,hetero-inv", "--no-report"]
    assert tiny_study(data_dir, one, *presets) == 0
    assert tiny_study(data_dir, two, *presets, "--jobs", "2") == 0
    a, b = collect(one)["runs"], collect(two)["runs"]
    assert [(r["variant"], r["seed"], r["status"]) for r in a] == [(r["variant"], r["seed"], r["status"]) for r in b]
    for ra, rb in zip(a, b):
        assert (
            ra["eval"] == rb["eval"]
            and ra["train"] == rb["train"]
            and ra["diag"]["sigma_max"] == rb["diag"]["sigma_max"]
        )
    timing = json.loads((two / "study.json").read_text())["timing"]
    assert json.loads((two / "study.json").read_text())["invocations"][-1]["workers"] == 2  # each invocation's own
    assert set(timing["runs"]) == {"adamw/s0", "hetero/s0", "hetero-inv/s0"}
    assert 0 < timing["elapsed_s"] and not [*(two / "runs").rglob(".lock"), *(two / "runs").rglob(".claim")]


def test_claim_lock(tmp_path):
    lock = claim_lock(tmp_path / "run")
    assert lock.acquire() is None and (tmp_path / "run" / ".claim").read_text() == str(os.getpid())
    assert claim_lock(tmp_path / "run").acquire() == os.getpid()  # a second claim is refused, naming the holder
    lock.release()
    assert not (tmp_path / "run" / ".claim").exists()
    (tmp_path / "run" / ".claim").write_text("999999999")  # left by a killed study: taken over
    other = claim_lock(tmp_path / "run")
    assert other.acquire() is None and other.took_over == 999999999
    other.release()


@pytest.mark.slow
def test_other_settings_in_the_folder_are_refused(data_dir, tmp_path, capsys):
    out = tmp_path / "study"
    assert tiny_study(data_dir, out, "--presets", "adamw", "--set", "stop_after=1") == 0
    assert (
        study_main(
            [
                "--model",
                "tiny",
                "--data-dir",
                data_dir,
                "--iters",
                "8",
                "--out",
                str(out),
                *FAST_STUDY_SETS,
                "--presets",
                "adamw",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "holds a study with other settings (" in err and "max_iters: 6 -> 8" in err
    assert cli_main(["report", str(tmp_path / "nothing-here")]) == 2


@pytest.mark.slow
def test_bounded_variant_trains_by_its_registry_name(data_dir, tmp_path):
    # The bounded suite's rules name the manifold ``bdgram@0.4``; the registry resolves it, no
    # custom-manifold dict: every attention matrix ends on BoundedDGram(0.4), sigma_max <= 0.4.
    base = dict(
        model="tiny",
        data_dir=data_dir,
        max_iters=4,
        batch_size=4,
        warmup_iters=1,
        eval_interval=4,
        eval_iters=1,
        block_size=32,
        muon_lr=0.2,
    )
    study = plan(tmp_path / "study", suite="bounded", bounds=[0.4], presets=[], base=base)
    variant = next(v for v in study.variants if v.name == "bdgram0.4+stiefel")
    assert variant.rules == ["*.attn.c_attn.weight=bdgram@0.4", "*.attn.c_proj.weight=bdgram@0.4"]
    cfg = study.config(variant, 0)
    assert train_one(cfg, "new", print_fn=lambda *a: None)["status"] == "finished"
    diag = json.loads((study.run_dir(variant, 0) / "diagnostics.jsonl").read_text().splitlines()[-1])
    attn = [m for m in diag["matrices"] if m["kind"] in ("attn_in", "attn_out")]
    assert attn and all(m["manifold"] == "bdgram@0.4" and m["sigma_max"] <= 0.4 * (1 + 1e-5) for m in attn)


@pytest.mark.slow
def test_an_invocation_killed_between_runs_keeps_its_wall_time(data_dir, tmp_path, monkeypatch):
    # study.json's elapsed time is stamped after every finished run, not only when the invocation ends: a
    # session that ends (the process killed) between runs must not lose the time of the runs it finished.
    from geomtrain.study import runner

    out = tmp_path / "study"
    original = runner._Scheduler.record_run

    def record_then_die(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise SystemExit(137)  # killed right after the first run was recorded

    monkeypatch.setattr(runner._Scheduler, "record_run", record_then_die)
    with pytest.raises(SystemExit):
        tiny_study(data_dir, out, "--presets", "adamw,hetero", "--no-report")
    first = json.loads((out / "study.json").read_text())
    assert first["invocations"][0]["elapsed_s"] > 0
    assert first["timing"]["elapsed_s"] == first["invocations"][0]["elapsed_s"]
    monkeypatch.setattr(runner._Scheduler, "record_run", original)
    assert tiny_study(data_dir, out, "--presets", "adamw,hetero", "--no-report") == 0
    done = json.loads((out / "study.json").read_text())
    assert len(done["invocations"]) == 2 and set(done["timing"]["runs"]) == {"adamw/s0", "hetero/s0"}
    assert done["timing"]["elapsed_s"] == pytest.approx(sum(i["elapsed_s"] for i in done["invocations"]))
