"""The study: smoke run of two presets, resumability, report rebuild, figures, bad input; training
on the bounded DGram manifold by name; the automatic assignment policy; the toy attention
demonstration."""
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch

from geomtrain.study import figures as plots
from geomtrain.study.autoassign import Policy, _guard, groups_for, matching_preset, propose, rules_for
from geomtrain.cli import main as cli_main
from geomtrain.config import make_config
from geomtrain.data import prepare
from geomtrain.study import collect, load_summary, main as study_main, toy_attention
from geomtrain.train import train
from manifolds import BoundedDGram, get_manifold

WORDS = "the king and queen of a far land went to see their old friend who lived by the sea with many ships and men".split()
FAST = ["--set", "batch_size=4", "--set", "eval_iters=1", "--set", "log_interval=1", "--set", "diag_batch_size=2",
        "--set", "block_size=32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small synthetic corpus with a trained byte-level BPE (a few hundred tokens): fast to train on."""
    root = tmp_path_factory.mktemp("study-data")
    rng = random.Random(0)
    texts = root / "txt"
    texts.mkdir()
    for i in range(12):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "." for _ in range(300)]
        (texts / f"doc{i:02d}.txt").write_text("\n".join(lines))
    out = root / "data"
    prepare(out, dataset="text", tokenizer="bpe4k", text_files=[str(texts)])
    return str(out)


def _study(data_dir, out, *extra):
    return study_main(["--model", "tiny", "--data-dir", data_dir, "--iters", "6", "--set", "eval_interval=3",
                       "--out", str(out), "--quiet", *FAST, *extra])


# ----------------------------------------------------------------------------- the study
def test_smoke_study_report_and_resume(data_dir, tmp_path, capsys):
    out = tmp_path / "study"
    assert _study(data_dir, out, "--presets", "adamw,hetero", "--seeds", "2") == 0
    for name in ("study.json", "summary.json", "results.csv", "results.md", "val_loss.png", "sigma_max.png",
                 "attention.png", "overhead.png"):
        assert (out / name).stat().st_size > 0, name
    study = json.loads((out / "study.json").read_text())
    assert study["seeds"] == [0, 1] and [v["name"] for v in study["variants"]] == ["adamw", "hetero"]
    assert study["command"].startswith("geomtrain study --model tiny") and "torch" in study["environment"]
    assert study["data"]["tokenizer"] == "bpe4k" and set(study["timing"]["runs"]) == {"adamw/s0", "hetero/s0", "adamw/s1", "hetero/s1"}
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

    # a second call trains nothing: every run is skipped
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("ckpt.pt")}
    capsys.readouterr()
    assert study_main(["--model", "tiny", "--data-dir", data_dir, "--iters", "6", "--set", "eval_interval=3",
                       "--out", str(out), *FAST, "--presets", "adamw,hetero", "--seeds", "2", "--no-report"]) == 0
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


def test_interrupted_runs_resume(data_dir, tmp_path):
    out = tmp_path / "study"
    assert _study(data_dir, out, "--presets", "adamw", "--set", "stop_after=3") == 0
    status = json.loads((out / "runs" / "adamw" / "s0" / "status.json").read_text())
    assert status["status"] == "interrupted" and status["step"] == 3
    assert _study(data_dir, out, "--presets", "adamw") == 0
    status = json.loads((out / "runs" / "adamw" / "s0" / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 6
    steps = [json.loads(line)["step"] for line in (out / "runs" / "adamw" / "s0" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # no duplicated records after the resume


def test_suites_sharing_a_runs_dir_reuse_identical_runs(data_dir, tmp_path, capsys):
    runs = str(tmp_path / "runs")
    assert _study(data_dir, tmp_path / "main", "--presets", "adamw", "--runs-dir", runs) == 0
    capsys.readouterr()
    assert study_main(["--model", "tiny", "--data-dir", data_dir, "--iters", "6", "--set", "eval_interval=3", *FAST,
                       "--suite", "lr-sweep", "--presets", "adamw", "--sweep", "muon_lr=0.02,0.05", "--runs-dir", runs,
                       "--out", str(tmp_path / "sweep"), "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "adamw__muon_lr-0.05 seed 0: training" in out and "adamw seed 0: already finished (skipped)" in out
    rows = {r["variant"]: r for r in collect(tmp_path / "sweep")["table"]}
    assert set(rows) == {"adamw", "adamw__muon_lr-0.05"} and rows["adamw__muon_lr-0.05"]["vs_adamw"] == 1.0


def test_parallel_workers_give_the_same_results(data_dir, tmp_path):
    # --jobs 2: runs in two spawned processes; every run is seeded on its own, so the results
    # must match one worker's exactly (losses and singular values, bit for bit).
    one, two = tmp_path / "one", tmp_path / "two"
    presets = ["--presets", "adamw,hetero,hetero-inv", "--no-report"]
    assert _study(data_dir, one, *presets) == 0
    assert _study(data_dir, two, *presets, "--jobs", "2") == 0
    a, b = collect(one)["runs"], collect(two)["runs"]
    assert [(r["variant"], r["seed"], r["status"]) for r in a] == [(r["variant"], r["seed"], r["status"]) for r in b]
    for ra, rb in zip(a, b):
        assert ra["eval"] == rb["eval"] and ra["train"] == rb["train"] and ra["diag"]["sigma_max"] == rb["diag"]["sigma_max"]
    timing = json.loads((two / "study.json").read_text())["timing"]
    assert timing["workers"] == [2] and set(timing["runs"]) == {"adamw/s0", "hetero/s0", "hetero-inv/s0"}
    assert 0 < timing["elapsed_s"] and all(not p.exists() for p in (two / "runs").rglob(".lock"))


def test_run_lock(tmp_path):
    import os

    from geomtrain.study import RunLock

    lock = RunLock(tmp_path / "run")
    assert lock.acquire() is None and (tmp_path / "run" / ".lock").read_text() == str(os.getpid())
    (tmp_path / "run" / ".lock").write_text(str(os.getppid()))  # a live process holds it
    assert RunLock(tmp_path / "run").acquire() == os.getppid()
    (tmp_path / "run" / ".lock").write_text("999999999")  # a dead one: stale, taken over
    other = RunLock(tmp_path / "run")
    assert other.acquire() is None
    other.release()
    assert not (tmp_path / "run" / ".lock").exists()


def test_sweep_variants_and_dry_run(data_dir, tmp_path, capsys):
    assert study_main(["--model", "tiny", "--data-dir", data_dir, "--out", str(tmp_path / "s"), "--presets", "hetero,hetero-inv",
                       "--sweep", "muon_lr=0.02,0.1", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "4 variants" in text and "hetero-inv__muon_lr-0.1" in text and not (tmp_path / "s").exists()
    assert "  hetero-inv: preset hetero-inv" in text  # the shared value keeps the plain name
    assert study_main(["--model", "tiny", "--data-dir", data_dir, "--out", str(tmp_path / "b"), "--suite", "bounded",
                       "--bounds", "1.5", "--dry-run"]) == 0
    assert "bdgram@1.5" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["--presets", "adamw,nope"], "unknown preset 'nope'; valid: adamw, unconstrained"),
    (["--suite", "everything"], "unknown suite 'everything'; valid: presets, lr-sweep, bounded, autoassign"),
    (["--model", "huge"], "unknown model 'huge'; valid:"),
    (["--set", "colour=red"], "unknown config key 'colour' in --set; valid: model,"),
    (["--set", "muon_lr=fast"], "bad value 'fast' for muon_lr"),
    (["--seeds", "0"], "--seeds '0'"),
    (["--granularity", "atom"], "unknown granularity 'atom'; valid: module, kind, layer"),
    (["--jobs", "0"], "--jobs must be >= 1; got 0"),
    (["--suite", "bounded", "--bounds", "0"], "--bounds must be numbers > 0"),
])
def test_bad_input_is_one_line_exit_2(data_dir, tmp_path, capsys, argv, needle):
    code = cli_main(["study", "--model", "tiny", "--data-dir", data_dir, "--out", str(tmp_path / "x"), "--dry-run", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_other_settings_in_the_folder_are_refused(data_dir, tmp_path, capsys):
    out = tmp_path / "study"
    assert _study(data_dir, out, "--presets", "adamw", "--set", "stop_after=1") == 0
    assert study_main(["--model", "tiny", "--data-dir", data_dir, "--iters", "8", "--out", str(out), *FAST, "--presets", "adamw"]) == 2
    err = capsys.readouterr().err
    assert "holds a study with other settings (" in err and "max_iters: 6 -> 8" in err
    assert cli_main(["report", str(tmp_path / "nothing-here")]) == 2


def test_overhead_measures_interleaved_step_times(data_dir, tmp_path, capsys):
    assert cli_main(["study", "overhead", "--model", "tiny", "--data-dir", data_dir, "--presets", "adamw,unconstrained,hetero",
                     "--solvers", "tangent,default", "--steps", "2", "--warmup", "1", "--set", "batch_size=4",
                     "--set", "block_size=32", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    assert [(r["preset"], r["solver"]) for r in rows] == [("adamw", "-"), ("unconstrained", "-"), ("hetero", "tangent"),
                                                          ("hetero", "default")]
    assert rows[0]["vs_adamw"] == 1.0 and rows[1]["vs_unconstrained"] == 1.0 and all(r["ms_per_step"] > 0 for r in rows)
    assert (tmp_path / "overhead_solvers.png").exists() and "| hetero | tangent |" in (tmp_path / "overhead.md").read_text()
    capsys.readouterr()
    assert cli_main(["study", "overhead", "--out", str(tmp_path), "--solvers", "magic"]) == 2
    assert "unknown solver 'magic'; valid: default, " in capsys.readouterr().err


# ----------------------------------------------------------------------------- figures
def _fake_run(variant, seed, status, n=6, grow=1.0):
    steps = list(range(10, 10 * n + 1, 10))
    sig = [[1.0 * grow ** i, 0.9 * grow ** i] for i in range(n)]
    att = {"max_abs_logit": [[5 * grow ** (2 * i)] * 2 for i in range(n)],
           "mean_entropy": [[2.0 / grow ** i] * 2 for i in range(n)],
           "saturated_frac": [[min(1.0, 0.1 * i * (grow - 1))] * 2 for i in range(n)],
           "jacobian_norm": [[0.3 / grow ** (2 * i)] * 2 for i in range(n)]}
    kinds = {k: sig for k in ("attn_in", "attn_q", "attn_k", "attn_out", "mlp_in", "mlp_out")}
    return {"variant": variant, "seed": seed, "status": status, "step": steps[-1],
            "diverged_step": steps[-1] if status == "diverged" else None,
            "final_val": 4.0 + 0.01 * seed if status == "finished" else None, "best_val": 4.0, "ms_per_step": 10.0 * grow,
            "attn": "dgram" if grow > 1 else "stiefel", "mlp": "dgram",
            "eval": {"step": steps, "val": [5.0 - 0.1 * i if grow == 1 else 5.0 - 0.1 * i + (i > 3) * 3 for i in range(n)]},
            "train": {"step": steps, "loss": [5.0] * n},
            "diag": {"step": steps, "sigma_max": kinds, "grad_norm": kinds, "attention": att}}


def test_figures_from_a_synthetic_summary(tmp_path):
    from geomtrain.study import make_table

    variants = [{"name": "hetero", "preset": "hetero", "base": "hetero"},
                {"name": "hetero-inv__muon_lr-0.1", "preset": "hetero-inv", "base": "hetero-inv",
                 "sweep": {"key": "muon_lr", "value": 0.1}, "attn": "dgram"},
                {"name": "hetero-inv__muon_lr-0.02", "preset": "hetero-inv", "base": "hetero-inv",
                 "sweep": {"key": "muon_lr", "value": 0.02}, "attn": "dgram"}]
    runs = [_fake_run("hetero", s, "finished") for s in (0, 1)]
    runs += [_fake_run("hetero-inv__muon_lr-0.1", s, "diverged", grow=1.8) for s in (0, 1)]
    runs += [_fake_run("hetero-inv__muon_lr-0.02", 0, "finished", grow=1.1)]
    summary = {"study": {"base_config": {"model": "tiny", "max_iters": 60, "muon_lr": 0.02}, "seeds": [0, 1]},
               "variants": variants, "runs": runs, "table": make_table(variants, runs)}
    assert summary["table"][1]["status"] == "diverged 2/2 (step 60, 60)"
    written = {p.name for p in plots.write_all(summary, tmp_path)}
    assert written == {"val_loss.png", "sigma_max.png", "attention.png", "overhead.png", "mechanism.png", "sweep.png"}
    assert plots.mechanism({**summary, "variants": variants[:1]}) is None  # no DGram attention: nothing to explain


# ----------------------------------------------------------------------------- bounded DGram
# The manifold itself (contract kit in its interior, the boundary) is tested in tests/test_manifolds.py
# and tests/test_manifold_contract.py; here it trains by name.
def test_bounded_dgram_by_name_in_training(data_dir, tmp_path):
    assert get_manifold("BDGram@0.4").bound == 0.4
    with pytest.raises(ValueError, match="bound must be"):
        get_manifold("bdgram@big")
    with pytest.raises(ValueError, match="bound must be"):
        BoundedDGram(0)
    custom = {"bdgram@0.4": BoundedDGram(0.4)}
    cfg = make_config(dict(model="tiny", data_dir=data_dir, out_dir=str(tmp_path / "run"), max_iters=4, batch_size=4,
                           warmup_iters=1, eval_interval=4, eval_iters=1, block_size=32, progress=False, muon_lr=0.2,
                           preset="hetero-inv", rules=["*.attn.*.weight=bdgram@0.4"]), custom_names=tuple(custom))
    status = train(cfg, custom_manifolds=custom, print_fn=lambda *a: None)
    assert status["status"] == "finished"
    diag = json.loads((tmp_path / "run" / "diagnostics.jsonl").read_text().splitlines()[-1])
    attn = [m for m in diag["matrices"] if m["kind"] in ("attn_in", "attn_out")]
    assert attn and all(m["manifold"] == "bdgram@0.4" and m["sigma_max"] <= 0.4 * (1 + 1e-5) for m in attn)


# ----------------------------------------------------------------------------- autoassign
def test_autoassign_policy_helpers():
    g = groups_for("layer", 2)
    assert list(g) == ["h0.attention", "h1.attention", "h0.mlp", "h1.mlp"]
    assert rules_for({"attention": "stiefel", "mlp": "dgram"}, groups_for("module", 2)) == [
        "*.attn.c_attn.weight=stiefel", "*.attn.c_proj.weight=stiefel", "*.mlp.c_fc.weight=dgram", "*.mlp.c_proj.weight=dgram"]
    assert matching_preset({"attention": "stiefel", "mlp": "dgram"}) == "hetero"
    assert matching_preset({"attention": "dgram", "mlp": "dgram"}) == "all-dgram"
    assert matching_preset({"h0.attention": "dgram", "h1.attention": "stiefel", "h0.mlp": "dgram", "h1.mlp": "dgram"}) is None
    ref = {"mean_entropy": [2.0, 2.0], "max_abs_logit": [10.0, 10.0]}
    assert _guard({"mean_entropy": [1.9, 1.6], "max_abs_logit": [12.0, 19.0]}, ref, Policy())[0]
    ok, why = _guard({"mean_entropy": [1.9, 1.4], "max_abs_logit": [12.0, 12.0]}, ref, Policy())
    assert not ok and "layer 1: attention entropy" in why
    ok, why = _guard({"mean_entropy": [1.9, 1.9], "max_abs_logit": [25.0, 12.0]}, ref, Policy())
    assert not ok and "layer 0: max |logit|" in why


def test_autoassign_on_a_tiny_model(data_dir, tmp_path):
    base = dict(model="tiny", data_dir=data_dir, max_iters=8, warmup_iters=1, eval_interval=2, eval_iters=1, batch_size=4,
                block_size=32, diag_batch_size=2, log_interval=1)
    result = propose(base, tmp_path / "probes", seed=0, probe_iters=3, print_fn=lambda *a: None)
    assert result["probe_iters"] == 4  # rounded up to end on an evaluation
    assert [p["name"] for p in result["probes"]] == ["all-stiefel", "attention-dgram", "mlp-dgram"]
    assert all(p["val_loss"] is None or math.isfinite(p["val_loss"]) for p in result["probes"])
    assert set(result["choice"]) == {"attention", "mlp"} and set(result["choice"].values()) <= {"stiefel", "dgram"}
    assert len(result["decisions"]) == 2 and all(d["reason"] for d in result["decisions"])
    assert result["matches_preset"] == matching_preset(result["choice"])
    make_config({**base, "preset": "adamw", "rules": result["rules"]})  # the rules are a valid config
    again = propose(base, tmp_path / "probes", seed=0, probe_iters=3, print_fn=lambda *a: None)  # probes are reused
    assert again["choice"] == result["choice"] and [p["val_loss"] for p in again["probes"]] == [p["val_loss"] for p in result["probes"]]


# ----------------------------------------------------------------------------- toy attention
def test_toy_attention_saturates(tmp_path):
    r = toy_attention(scales=(0.5, 1, 2, 4, 8, 16), n_tokens=32, d_model=32, d_head=8)
    std = np.asarray(r["logit_std"])
    assert np.allclose(std / std[0], (np.asarray(r["scale"]) / 0.5) ** 2, rtol=1e-9)  # logits scale as s^2
    assert r["mean_entropy"][-1] < 0.1 * r["mean_entropy"][0] and r["saturated_frac"][-1] > 0.8
    jac = r["jacobian_norm"]
    assert jac[-1] < 0.1 * max(jac)
    # per row: the Jacobian norm is ~2 exp(-gap) once a row is saturated
    gaps, rows = np.concatenate(r["row_gap"]), np.concatenate(r["row_jacobian"])
    sel = (gaps > 3) & (gaps < 15)
    slope = np.polyfit(gaps[sel], np.log(rows[sel]), 1)[0]
    assert sel.sum() > 10 and slope == pytest.approx(-1.0, abs=0.15)  # exponential decay in the gap
    excess = np.log(rows[sel]) - (np.log(2) - gaps[sel])  # 2 exp(-gap) with one competitor, more with several
    assert excess.min() > -0.1 and excess.max() < np.log(32)
    assert cli_main(["study", "toy", "--out", str(tmp_path), "--scales", "1,4"]) == 0
    assert (tmp_path / "toy_saturation.png").exists() and json.loads((tmp_path / "toy.json").read_text())["scale"] == [1.0, 4.0]
    assert cli_main(["study", "toy", "--out", str(tmp_path), "--scales", "-1"]) == 2
