"""ManifoldMuon on 2 and 4 CPU ranks (gloo): solves split across ranks, every rank ends identical and equal to
one process; the bucketed exchange's ownership and what it sends."""

import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies
from ranks import run_ranks

from geomtrain.optim import ManifoldMuon, muon_dist
from geomtrain.optim.muon_step import MatrixItem, StatsTable

SUPPORT = Path(__file__).resolve().parents[1] / "_support"  # dist_optim_worker.py (a torchrun script)


@pytest.mark.slow
def test_two_ranks_match_each_other_and_one_process(tmp_path):
    import dist_optim_worker  # tests/_support is on sys.path (tests/conftest.py)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the planted NaN gradient warns once
        ref_params, ref_state, ref_stats = dist_optim_worker.run()

    run_ranks(2, SUPPORT / "dist_optim_worker.py", tmp_path, timeout=180)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    for name in ref_params:
        assert torch.equal(r0["params"][name], r1["params"][name]), name  # ranks bitwise identical
        # the owner rank runs the same computation in a smaller batch: equal up to float rounding
        assert float((r0["params"][name] - ref_params[name]).abs().max()) < 1e-6, name
    for pid, st in ref_state.items():  # momentum and dual variables agree too
        for key, val in st.items():
            assert torch.equal(r0["state"][pid][key], r1["state"][pid][key]), (pid, key)
            assert float((r0["state"][pid][key] - val).abs().max()) < 1e-5, (pid, key)
    assert r0["stats"] == r1["stats"]
    for a, b in zip(r0["stats"], ref_stats):
        assert a["n_matrices"] == b["n_matrices"] and a["n_skipped_nonfinite"] == b["n_skipped_nonfinite"]
        assert a["msign_calls"] == b["msign_calls"]
    assert ref_stats[2]["n_skipped_nonfinite"] == 1 and ref_stats[2]["n_matrices"] == 7  # 8 matrices (ob: 2), 1 skipped


def _torchrun(tmp_path, ranks: int, *args: str) -> list[dict]:
    """Run the worker on ``ranks`` gloo CPU ranks; each rank's record."""
    run_ranks(ranks, SUPPORT / "dist_optim_worker.py", tmp_path, *args)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def _items(shapes: list[tuple]) -> list[MatrixItem]:
    return [MatrixItem(i, torch.empty(s), {}, None, None, f"m{i}", {}) for i, s in enumerate(shapes)]


@given(
    sizes=strategies.lists(strategies.integers(1, 9), min_size=1, max_size=5),
    world=strategies.integers(2, 8),
    data=strategies.data(),
)
def test_owners_split_each_bucket_evenly(sizes, world, data):
    """Each bucket of b matrices gives every rank floor(b/N) or ceil(b/N) of them, and all buckets together
    give every rank within one matrix of the others: the padding of each gather is at most one matrix."""
    shapes = [(4 + k, 3) for k, b in enumerate(sizes) for _ in range(b)]
    shapes = data.draw(strategies.permutations(shapes))  # buckets interleaved in parameter order
    items = _items(shapes)
    owner = muon_dist.owners(items, world)
    for bucket in muon_dist.buckets(items):
        counts = [sum(owner[it.index] == r for it in bucket) for r in range(world)]
        assert max(counts) - min(counts) <= 1, counts
    totals = [owner.count(r) for r in range(world)]
    assert max(totals) - min(totals) <= 1, totals
    assert muon_dist.owners(items, world, bucketed=False) == [i % world for i in range(len(items))]


def test_bucketed_must_be_bool():
    with pytest.raises(ValueError, match="bucketed must be True or False"):
        ManifoldMuon([torch.nn.Parameter(torch.zeros(3, 2))], bucketed="yes")


@pytest.mark.slow
def test_four_ranks_uneven_buckets_match_one_process(tmp_path):
    """Buckets of 3, 5 and 1 matrices on 4 ranks, bucketed and per-matrix: ranks bitwise identical, equal to
    one process, ONE gather per bucket carrying exactly every matrix's weights and warm-start state."""
    import dist_optim_worker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the planted NaN gradient warns once
        ref_params, ref_state, ref_stats = dist_optim_worker.run(layout="buckets")
    ranks = _torchrun(tmp_path, 4, "buckets")
    assert {r["world_size"] for r in ranks} == {4}
    # what the exchange must carry at the last step (every matrix has a finite gradient there): the weights
    # and each warm-start entry of the state (all but the momentum, which every rank updates itself)
    payload = sum(p.numel() * p.element_size() for p in ref_params.values())
    entries = [v for state in ref_state.values() for key, v in state.items() if key != "momentum_buffer"]
    payload += sum(v.numel() * v.element_size() for v in entries)
    stats_bytes = len(ref_params) * len(StatsTable.FIELDS) * 8  # the float64 statistics rows, all-reduced
    n_buckets = len({(tuple(p.shape), p.dtype) for p in ref_params.values()})
    for mode in dist_optim_worker.MODES:
        r0 = ranks[0][mode]
        for other in ranks[1:]:
            for name in ref_params:
                assert torch.equal(r0["params"][name], other[mode]["params"][name]), (mode, name)
            for pid, state in r0["state"].items():
                for key, val in state.items():
                    assert torch.equal(val, other[mode]["state"][pid][key]), (mode, pid, key)
            assert r0["stats"] == other[mode]["stats"], mode
        for name in ref_params:  # the same solves in other batches: equal up to float rounding (as above)
            assert float((r0["params"][name] - ref_params[name]).abs().max()) < 1e-6, (mode, name)
        assert r0["state"].keys() == ref_state.keys()
        for pid, state in ref_state.items():
            assert r0["state"][pid].keys() == state.keys(), (mode, pid)
            for key, val in state.items():
                assert float((r0["state"][pid][key] - val).abs().max()) < 1e-5, (mode, pid, key)
        for a, b in zip(r0["stats"], ref_stats):
            assert (a["n_matrices"], a["n_skipped_nonfinite"]) == (b["n_matrices"], b["n_skipped_nonfinite"])
        comm = r0["stats"][-1]["comm"]
        if mode == "bucketed":
            assert comm["collectives"] == n_buckets + 1
            assert 4 * (comm["bytes_in"] - stats_bytes) - comm["bytes_padding"] == payload
        else:
            assert comm["collectives"] == len(ref_params) + len(entries) + 1
            assert comm["bytes_in"] - stats_bytes == payload
    assert ref_stats[-1]["comm"] == {"collectives": 0, "bytes_in": 0, "bytes_sent": 0, "bytes_padding": 0}
