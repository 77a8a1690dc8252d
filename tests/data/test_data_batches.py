"""Batches: stateless in (seed, step), rank slices of one global batch, fixed evaluation batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geomtrain import data

pytest_plugins = ["data_corpora"]


@pytest.fixture
def tokens():
    return np.arange(10_000, dtype=np.uint16) % 50257


def test_get_batch_shapes_and_targets(tokens):
    x, y = data.get_batch(tokens, 4, 16, seed=0, step=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # tokens are consecutive integers here


def test_get_batch_is_stateless_and_deterministic(tokens):
    a = data.get_batch(tokens, 4, 16, seed=1, step=7)
    data.get_batch(tokens, 4, 16, seed=1, step=8)
    b = data.get_batch(tokens, 4, 16, seed=1, step=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], data.get_batch(tokens, 4, 16, seed=1, step=8)[0])
    assert not torch.equal(a[0], data.get_batch(tokens, 4, 16, seed=2, step=7)[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_form_the_global_batch(tokens, world_size):
    B = 8 // world_size
    x_all, y_all = data.get_batch(tokens, 8, 16, seed=3, step=5)
    parts = [data.get_batch(tokens, B, 16, seed=3, step=5, rank=r, world_size=world_size) for r in range(world_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x_all)
    assert torch.equal(torch.cat([p[1] for p in parts]), y_all)
    with pytest.raises(ValueError, match="rank"):
        data.get_batch(tokens, B, 16, seed=3, step=5, rank=world_size, world_size=world_size)


def test_batch_covers_the_ends_and_rejects_short_data():
    toks = np.arange(6, dtype=np.uint16)
    seen = set()
    for step in range(200):
        x, y = data.get_batch(toks, 1, 5, seed=0, step=step)
        seen.add(int(x[0, 0]))
        assert int(y[0, -1]) <= 5
    assert seen == {0}  # only one window of 5 + 1 tokens fits
    with pytest.raises(ValueError, match="too few"):
        data.get_batch(toks, 1, 6, seed=0, step=0)
    with pytest.raises(ValueError, match="non-negative"):
        data.get_batch(np.arange(100, dtype=np.uint16), 1, 5, seed=0, step=-1)


def test_eval_batches_are_fixed(tokens):
    a = data.fixed_batch(tokens, 4, 16, seed=0)
    b = data.fixed_batch(tokens, 4, 16, seed=0)
    assert torch.equal(a[0], b[0])
    batches = list(data.iter_eval_batches(tokens, 4, 16, 3, seed=0))
    assert len(batches) == 3 and torch.equal(batches[0][0], a[0])
    assert not torch.equal(batches[0][0], batches[1][0])
    assert [
        torch.equal(p[0], q[0]) for p, q in zip(batches, data.iter_eval_batches(tokens, 4, 16, 3, seed=0), strict=True)
    ] == [True] * 3
    halves = [data.fixed_batch(tokens, 2, 16, seed=0, rank=r, world_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), a[0])
    # never the offsets of a training batch with the same seed
    assert not torch.equal(a[0], data.get_batch(tokens, 4, 16, seed=0, step=0)[0])


def test_token_data_wraps_a_split(prepared):
    out, manifest, _ = prepared
    td = data.TokenData(out, "val")
    assert len(td) == manifest["splits"]["val"]["tokens"] and td.manifest == manifest
    same = data.TokenData(out / "val.bin")
    assert torch.equal(td.get_batch(2, 8, seed=0, step=0)[0], data.get_batch(same, 2, 8, seed=0, step=0)[0])
    assert torch.equal(td.fixed_batch(2, 8, seed=0)[0], data.fixed_batch(td.tokens, 2, 8, 0)[0])
    with pytest.raises(ValueError, match="train, val"):
        data.load_split(out, "test")
    with pytest.raises(FileNotFoundError, match="prepare"):
        data.load_split(out / "missing", "train")
