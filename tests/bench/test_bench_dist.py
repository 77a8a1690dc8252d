"""geomtrain bench dist: one process, DDP broadcast and DDP bucketed side by side on 2 gloo ranks, the bytes
and collectives each sends (checked against the model's own matrices), and bad input as one line (exit 2)."""

import math

import pytest

from geomtrain.bench.dist import MODES, bench_dist, format_dist_table
from geomtrain.cli import main as cli_main
from geomtrain.groups import param_groups
from geomtrain.model import GPT, model_config
from geomtrain.optim.muon_step import StatsTable


def _exchanged(model: str) -> tuple[int, int, int]:
    """From the ``hetero`` Muon matrices of ``model``: the bytes every owner sends in all (weights, and per
    matrix its n x n dual in the weights' dtype and a one-byte precision flag), the parameters, the shapes."""
    groups = param_groups(GPT(model_config(model)), preset="hetero")
    params = [p for g in groups.muon for p in g["params"]]
    payload = 0
    for p in params:
        k, n = math.prod(p.shape[:-2]), min(p.shape[-2:])
        payload += p.numel() * p.element_size() + k * (n * n * p.element_size() + 1)
    return payload, len(params), len({(tuple(p.shape), p.dtype) for p in params})


@pytest.mark.slow
def test_bench_dist_counts_what_each_exchange_sends(capsys):
    ranks = 2
    rows = bench_dist(("tiny",), ranks=ranks, steps=1, warmup=0, log=print)
    assert [r["mode"] for r in rows] == list(MODES)
    one, broadcast, bucketed, fsdp = rows
    # FSDP2: the flags all-reduce, an all-to-all to the owners and one back, the statistics all-reduce; the
    # model's exchange: two all-gathers and a reduce-scatter against DDP's all-reduce (3 : 2)
    assert fsdp["collectives"] == 4 and fsdp["bytes_sent"] > 0
    assert 2 * fsdp["model_bytes"] == 3 * bucketed["model_bytes"] and one["model_bytes"] == 0
    payload, n_params, n_shapes = _exchanged("tiny")
    stats = n_params * len(StatsTable.FIELDS) * 8 * 2 * (ranks - 1) / ranks  # the statistics all-reduce
    assert (one["collectives"], one["bytes_sent"], one["ranks"]) == (0, 0, 1)
    # per matrix: its weights and each of its 2 warm-start slots broadcast; then the statistics
    assert broadcast["collectives"] == 3 * n_params + 1
    assert bucketed["collectives"] == bucketed["buckets"] + 1 == n_shapes + 1
    # ring algorithms: a broadcast costs each rank (N-1)/N of it, a gather (N-1) x its padded share
    assert broadcast["bytes_sent"] == round(payload * (ranks - 1) / ranks + stats)
    share = (payload + bucketed["bytes_padding"]) / ranks
    assert bucketed["bytes_sent"] == round((ranks - 1) * share + stats)
    assert all(r["ms_step"] > 0 and r["matrices"] == one["matrices"] for r in rows)
    table = format_dist_table(rows)
    assert table.count("\n") == 1 + len(rows) and "DDP bucketed" in table
    assert "tiny: one process" in capsys.readouterr().out  # the log line


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--models", "nope"], "unknown model 'nope'; valid: "),
        (["--preset", "nope"], "unknown preset 'nope'; valid: "),
        (["--ranks", "1"], "need ranks >= 2"),
        (["--steps", "0"], "argument --steps: invalid integer >= 1 value: '0'"),
    ],
)
def test_bench_dist_rejects_bad_input_in_one_line(argv, says, capsys):
    assert cli_main(["bench", "dist", "--models", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
