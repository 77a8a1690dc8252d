"""One line before training per slow path of a custom mask (issue 55): naming the matrix, why and what to override;
none for built-in masks or fast paths; the run's random state untouched; train() prints it."""

import pytest
import torch
from conftest import BlockGram, forget_manifold, tiny_config

import geomtrain.slow_paths as slow_paths
from geomtrain.assign import assign
from geomtrain.model import GPT, model_config
from geomtrain.slow_paths import slow_path_notes


def _assignments(rules, solver=None):
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=256))
    params = dict(model.named_parameters())
    assignments = assign(params.items(), "hetero", rules, {"blocks": BlockGram()})
    for a in assignments:
        if a.manifold is not None:
            with torch.no_grad():
                params[a.name].copy_(a.manifold.projx(params[a.name].detach()))
            a.solver = solver
    return assignments, params


@pytest.mark.slow
def test_a_note_names_the_matrix_why_and_what_to_override():
    assignments, params = _assignments(["*.attn.c_proj.weight=blocks"], solver="exact")
    state = torch.get_rng_state()
    notes = slow_path_notes(assignments, params, limit=0.0)  # every path counts as slow
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws from its own generator
    assert len(notes) == 1  # one line per (mask, shape, solver): both layers' c_proj share it
    note = notes[0]
    assert "\n" not in note and note.startswith("transformer.h.0.attn.c_proj.weight (64x64, blocks; 2 such matrices)")
    assert "a retraction" in note and "override projx/retr in closed form" in note
    assert "a direction (exact)" in note and "--solver-rule 'transformer.h.*.attn.c_proj.weight=filled_split'" in note
    assert "project_gram alone" in note and "64 x 64 Gram matrices" in note


def test_no_note_for_built_in_masks_or_fast_paths():
    assignments, params = _assignments([])
    assert slow_path_notes(assignments, params, limit=0.0) == []  # hetero: Stiefel and DGram, closed forms
    assignments, params = _assignments(["*.attn.c_proj.weight=blocks"], solver="filled_split")
    assert slow_path_notes(assignments, params) == []  # 32 columns: milliseconds, under SLOW_SECONDS
    note = slow_path_notes(assignments, params, limit=0.0)[0]
    assert "a direction (filled_split)" in note and "override its solve_normal in closed form" in note


@pytest.mark.slow
def test_train_prints_the_notes_before_training(data_dir, tmp_path, monkeypatch):
    from geomtrain.train import train
    from manifolds import register

    monkeypatch.setattr(slow_paths, "SLOW_SECONDS", 0.0)
    register("blocks", BlockGram)
    try:
        lines = []
        cfg = tiny_config(data_dir, tmp_path / "run", rules=["*.attn.c_proj.weight=blocks"], max_iters=1)
        train(cfg, print_fn=lines.append)
    finally:
        forget_manifold("blocks")
    notes = [i for i, line in enumerate(lines) if line.startswith("note: transformer.h.0.attn.c_proj.weight")]
    assert len(notes) == 1 and notes[0] < len(lines) - 1  # before the run's last line
