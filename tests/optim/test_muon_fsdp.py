"""ManifoldMuon on FSDP2 (``fully_shard``, gloo CPU, 2 and 4 ranks): each matrix solved whole by one owner,
ranks agree and equal one process, a NaN in one rank's rows skips the matrix everywhere, the optimizer state
goes through torch.distributed.checkpoint bit-exact, the all-to-all bytes follow muon_fsdp's formula."""

import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies
from ranks import run_ranks

from geomtrain.optim.muon_fsdp import chunk_rows, owners_by_size
from geomtrain.optim.muon_step import StatsTable

SUPPORT = Path(__file__).resolve().parents[1] / "_support"  # fsdp_optim_worker.py (a torchrun script)

# The owner solves a matrix in another batch than one process does (the ranks split the matrices), and batched
# float32 kernels may round differently per batch: ~1e-7 relative on O(1) entries. 1e-6 leaves a margin.
ATOL = 1e-6


@given(
    sizes=strategies.lists(strategies.integers(1, 500), min_size=0, max_size=12),
    world=strategies.integers(1, 8),
)
def test_owners_by_size_balance_the_load(sizes, world):
    """Greedy largest-first to the least-loaded rank: the loads differ by at most the largest matrix, the
    largest min(N, count) matrices go to distinct ranks, and the assignment is a function of the sizes."""
    owner = owners_by_size(sizes, world)
    assert owner == owners_by_size(list(sizes), world) and all(0 <= o < world for o in owner)
    load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(world)]
    assert max(load) - min(load) <= max(sizes, default=0), (load, sizes)
    largest = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))[:world]
    assert len({owner[i] for i in largest}) == len(largest)


@given(rows=strategies.integers(0, 40), world=strategies.integers(1, 8))
def test_chunk_rows_is_torch_chunk(rows, world):
    """FSDP2 splits dim 0 like ``torch.chunk`` (ceil(R/N) rows each, the last ranks fewer or none)."""
    chunks = [c.shape[0] for c in torch.empty(rows).chunk(world)] if rows else []
    assert chunk_rows(rows, world) == chunks + [0] * (world - len(chunks))


def _torchrun(tmp_path, ranks: int, *args: str) -> list[dict]:
    """Run the worker on ``ranks`` gloo CPU ranks; each rank's record."""
    run_ranks(ranks, SUPPORT / "fsdp_optim_worker.py", tmp_path, *args)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def _without_comm(stats: list[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "comm"} for s in stats]


def _check_against_one_process(ranks: list[dict]) -> None:
    """Every solver: ranks bitwise identical, equal to one process to `ATOL` (weights, momentum, warm-start
    state), the same statistics (the comm counts are per rank), the planted NaN skipping dg everywhere."""
    import fsdp_optim_worker as worker  # tests/_support is on sys.path (tests/conftest.py)

    for solver in worker.SOLVERS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the planted NaN gradient warns once
            ref = worker.run(solver)
        r0 = ranks[0][solver]
        for other in ranks[1:]:
            for name in ref["params"]:
                assert torch.equal(r0["params"][name], other[solver]["params"][name]), (solver, name)
            assert _without_comm(r0["stats"]) == _without_comm(other[solver]["stats"]), solver
        for name, value in ref["params"].items():
            assert float((r0["params"][name] - value).abs().max()) < ATOL, (solver, name)
        assert r0["state"].keys() == ref["state"].keys()
        for name, state in ref["state"].items():
            assert r0["state"][name].keys() == state.keys(), (solver, name)
            for key, value in state.items():
                assert r0["state"][name][key].dtype == value.dtype, (solver, name, key)
                assert float((r0["state"][name][key].double() - value.double()).abs().max()) < ATOL, (solver, key)
        if solver == "exact":
            assert "dual" in ref["state"]["st0"]  # the warm start travelled
        for a, b in zip(r0["stats"], ref["stats"]):
            for key in ("n_matrices", "n_skipped_nonfinite", "skipped", "msign_calls"):
                assert a[key] == b[key], (solver, key)
        assert r0["stats"][1]["certified_gap_max"] is not None  # certify_every=2: the owners certify step 2
        skipped = r0["stats"][worker.NAN_STEP]["skipped"]
        assert [s["reason"] for s in skipped] == ["non-finite gradient"] and r0["counters"] == ref["counters"]


@pytest.mark.slow
def test_two_ranks_match_one_process_and_checkpoint_bit_exact(tmp_path):
    """2 ranks: the comparison above, the one-line refusals, and the DCP round trip: a fresh optimizer loads
    the saved state (momentum, dual, flags, counters) bitwise and the next step is bitwise the same."""
    import fsdp_optim_worker as worker

    assert chunk_rows(worker.SHAPES["dg"][0], 2)[0] < worker.SHAPES["dg"][0]  # the NaN row is not on rank 0
    ranks = _torchrun(tmp_path, 2, "dcp")
    _check_against_one_process(ranks)
    for r in ranks:
        saved, after = r["dcp"]["saved"], r["dcp"]["after"]
        assert saved["sharded"]["st0"] == ["dual", "momentum_buffer"] and saved["sharded"]["eu"] == ["momentum_buffer"]
        for how in ("loaded", "loaded_whole"):  # through DCP; from whole plain tensors (sharded on load)
            loaded = r["dcp"][how]
            assert loaded["state"].keys() == saved["before"].keys()
            for name, state in saved["before"].items():
                assert loaded["state"][name].keys() == state.keys(), (how, name)
                for key, value in state.items():
                    assert torch.equal(loaded["state"][name][key], value), (how, name, key)
                assert loaded["sharded"][name] == saved["sharded"][name], (how, name)  # momentum and dual
            assert loaded["counters"] == r["exact"]["counters"]
        for name, value in saved["params"].items():
            assert torch.equal(after["params"][name], value), name
            for key, v in saved["state"][name].items():
                assert torch.equal(after["state"][name][key], v), (name, key)
    refusals = ranks[0]["refusals"]
    assert "Shard(0) on one 1-D device mesh" in refusals["replicated"] and "Replicate" in refusals["replicated"]
    assert "not both in one optimizer" in refusals["mixed"]
    assert "not on its manifold Stiefel" in refusals["off_manifold"]
    assert all("\n" not in msg for msg in refusals.values())


@pytest.mark.slow
def test_four_ranks_with_empty_chunks_match_one_process_and_count_bytes(tmp_path):
    """4 ranks (DGram 5x12 and Oblique 3x9x4 leave rank 3 no rows): the comparison above, and at the last step
    4 collectives whose bytes, summed over ranks, are the formula of geomtrain.optim.muon_fsdp."""
    import fsdp_optim_worker as worker

    world = 4
    assert chunk_rows(worker.SHAPES["dg"][0], world)[-1] == 0 and chunk_rows(worker.SHAPES["ob"][0], world)[-1] == 0
    ranks = _torchrun(tmp_path, world)
    _check_against_one_process(ranks)

    def off_owner(shape, itemsize, o):  # bytes of a tensor outside its owner's rows
        return (shape[0] - chunk_rows(shape[0], world)[o]) * math.prod(shape[1:]) * itemsize

    for solver in worker.SOLVERS:
        state = ranks[0][solver]["state"]
        model = worker.Bare()
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in worker.param_groups(model) for p in g["params"]]
        owner = owners_by_size([math.prod(worker.SHAPES[n]) for n in order], world)
        expected = 0
        for name, o in zip(order, owner):
            shape = worker.SHAPES[name]
            slots = [v for k, v in state[name].items() if k != "momentum_buffer"]
            matrix = [v for v in slots if v.dtype != torch.uint8]
            flags = sum(v.numel() for v in slots if v.dtype == torch.uint8)
            s = sum(off_owner(tuple(v.shape), v.element_size(), o) for v in matrix)
            expected += 3 * off_owner(shape, 4, o) + 2 * s + (world - 1) * flags
        n = len(order)
        reduced = 2 * n * 4 + n * len(StatsTable.FIELDS) * 8  # the flags (int32) and the statistics (float64)
        expected += world * 2 * (world - 1) / world * reduced
        comm = [r[solver]["stats"][-1]["comm"] for r in ranks]
        assert {c["collectives"] for c in comm} == {4} and {c["bytes_padding"] for c in comm} == {0}
        assert sum(c["bytes_sent"] for c in comm) == expected, solver


def test_an_unsharded_optimizer_drops_the_placeholders_of_an_fsdp_state():
    # An FSDP2 run's state dict holds placeholders for warm-start slots a matrix has no value for yet (NaN
    # matrices, flags of PLACEHOLDER_FLAG); loaded whole into a one-process optimizer they must go, and the
    # real entries stay: a NaN warm start would reach the solver.
    from geomtrain.optim import ManifoldMuon
    from geomtrain.optim.muon_fsdp import PLACEHOLDER_FLAG
    from manifolds import Stiefel

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(Stiefel().random(12, 4, generator=gen)) for _ in range(2)]
    opt = ManifoldMuon([{"params": params, "manifold": Stiefel()}], solver="exact")  # a matrix slot and a flag
    for p in params:
        p.grad = torch.randn(12, 4, generator=gen)
    opt.step()
    sd = opt.state_dict()
    real = {k: v.clone() for k, v in sd["state"][0].items()}
    sd["state"][1]["dual"] = torch.full((4, 4), math.nan)
    sd["state"][1]["escalated"] = torch.full((1,), PLACEHOLDER_FLAG, dtype=torch.uint8)
    fresh = ManifoldMuon([{"params": params, "manifold": Stiefel()}], solver="exact")
    fresh.load_state_dict(sd)
    assert set(fresh.state[params[1]]) == {"momentum_buffer"}
    for key, value in real.items():
        assert torch.equal(fresh.state[params[0]][key], value.to(fresh.state[params[0]][key].dtype)), key
