r"""``geomtrain bench dist``: what Manifold Muon's DDP exchange sends, and its step time, side by side.

For each model shape (`geomtrain.model.MODEL_CONFIGS`; the Muon matrices of a preset, ``hetero`` by default),
three ways to take the same optimizer steps on the same gradients:

- ``one process``: no exchange;
- ``DDP broadcast``: ``ManifoldMuon(bucketed=False)`` on ``--ranks`` gloo CPU ranks, one broadcast per
  matrix and warm-start state slot from its owner;
- ``DDP bucketed``: the default, one all-gather per ``(shape, dtype, device)`` bucket
  (`geomtrain.optim.muon_dist`);
- ``FSDP2``: the model sharded by `geomtrain.sharding.shard_model`, each matrix's rows sent to its owner
  rank and the new rows back, two all-to-alls per step (`geomtrain.optim.muon_fsdp`).

Per step and rank: the collectives and the bytes sent (``last_stats["comm"]``: the ring algorithms' bytes,
computed from the buffers, `geomtrain.optim.exchange.CommCount`), and the median time of
``ManifoldMuon.step`` over the timed steps (per step, the slowest rank). The ranks are processes spawned by
``torch.multiprocessing`` with a ``file://`` rendezvous, one CPU thread each (``--threads``); the distributed
modes run in the same processes, stepped alternately so a shared machine's drift hits them alike. FSDP2's
bytes differ between ranks (a rank sends the rows it holds of the matrices others own): the row gives the
largest. ``model bytes`` is what the training step sends besides the optimizer, computed from the $P$
float32 parameters under the ring algorithms (not measured): DDP's gradient all-reduce
$2\frac{N-1}{N} 4P$; FSDP2's all-gather of the weights in the forward and again in the backward and
reduce-scatter of the gradients, $3\frac{N-1}{N} 4P$. Every matrix runs the `SOLVER` ``exact``, whose
warm-start state (an $n \times n$ dual and a flag per matrix) travels with the weights: the most a step
sends. (Training's default, `geomtrain.optim.default_solver`, runs ``filled_split`` on Stiefel and DGram
matrices, which carries no state: only their weights travel.)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import non_negative_int, positive_int

__all__ = ["MODES", "SOLVER", "bench_dist", "format_dist_table", "add_parser"]

MODES = ("one process", "DDP broadcast", "DDP bucketed", "FSDP2")
SOLVER = "exact"  # the solver with a warm-start state to send: the exchange at its largest


def _optimizer(model_name: str, preset: str, bucketed: bool):
    """The Muon parameters of a fresh ``GPT(model_name)`` (seeded: equal on every rank) and their
    `ManifoldMuon`."""
    import torch

    from ..groups import param_groups
    from ..model import GPT, model_config
    from ..optim import ManifoldMuon

    torch.manual_seed(0)
    groups = param_groups(GPT(model_config(model_name)), preset=preset)
    params = [p for g in groups.muon for p in g["params"]]
    return params, ManifoldMuon(groups.muon, lr=0.02, bucketed=bucketed, solver=SOLVER)


def _fsdp_optimizer(model_name: str, preset: str):
    """`_optimizer`'s matrices, the model sharded by `geomtrain.sharding.shard_model` first (DTensor rows)."""
    import torch

    from ..groups import param_groups
    from ..model import GPT, model_config
    from ..optim import ManifoldMuon
    from ..sharding import shard_model

    torch.manual_seed(0)
    model = GPT(model_config(model_name))
    param_groups(model, preset=preset)  # projects the constrained matrices onto their manifolds, as _optimizer
    groups = param_groups(shard_model(model), preset=preset, project=False)
    return [p for g in groups.muon for p in g["params"]], ManifoldMuon(groups.muon, lr=0.02, solver=SOLVER)


def _like(grad, p):
    """``grad`` (whole, the same on every rank) as ``p``'s rows when ``p`` is a DTensor (sliced here, no exchange)."""
    if not hasattr(p, "device_mesh"):
        return grad
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)


def _timed_steps(runs: list, steps: int, warmup: int, barrier: Callable[[], None]) -> list[dict]:
    """Step every ``(params, optimizer)`` of ``runs`` alternately on the same seeded gradients; per run the
    seconds of each timed step and the last step's statistics."""
    import torch

    out = [{"seconds": []} for _ in runs]
    for i in range(warmup + steps):
        for (params, opt), rec in zip(runs, out):
            gen = torch.Generator().manual_seed(1000 + i)
            for p in params:
                p.grad = _like(torch.randn(p.shape, generator=gen) * 1e-3, p)
            barrier()
            start = time.perf_counter()
            opt.step()
            seconds = time.perf_counter() - start
            if i >= warmup:
                rec["seconds"].append(seconds)
            rec["stats"] = opt.last_stats
    return out


def _rank(rank: int, world: int, out_dir: str, models: list, preset: str, steps: int, warmup: int, threads: int):
    """One spawned rank: the distributed modes per model; each rank writes ``<out_dir>/<model>.rank<r>.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    init_file = Path(out_dir, "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name in models:
            runs = [_optimizer(name, preset, bucketed) for bucketed in (False, True)] + [_fsdp_optimizer(name, preset)]
            recs = _timed_steps(runs, steps, warmup, dist.barrier)
            Path(out_dir, f"{name}.rank{rank}.json").write_text(json.dumps(recs))
            del runs
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown (about one run in ten on CPU); the results are
    # written, so leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def bench_dist(
    models: Sequence[str] = ("mini",),
    ranks: int = 2,
    steps: int = 3,
    warmup: int = 1,
    preset: str = "hetero",
    threads: int = 1,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Rows per model and mode (`MODES`): ``model``, ``mode``, ``ranks``, ``matrices``, ``buckets``,
    ``collectives``, ``bytes_sent``, ``bytes_padding`` (per step and rank: the largest), ``model_bytes`` (the
    gradients' and weights' exchange, computed) and ``ms_step`` (median over the timed steps of the slowest
    rank's ``step``)."""
    import torch
    import torch.multiprocessing as mp

    from ..assign import PRESETS
    from ..model import MODEL_CONFIGS
    from ..optim.muon_dist import buckets

    bad = [m for m in models if m not in MODEL_CONFIGS]
    if bad or not models:
        raise ValueError(f"unknown model {(bad or [''])[0]!r}; valid: {', '.join(MODEL_CONFIGS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    if ranks < 2 or steps < 1 or warmup < 0 or threads < 1:
        got = f"{ranks}, {steps}, {warmup}, {threads}"
        raise ValueError(f"need ranks >= 2, steps >= 1, warmup >= 0, threads >= 1; got {got}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for name in models:
                run = _optimizer(name, preset, True)
                rec = _timed_steps([run], steps, warmup, lambda: None)[0]
                n_buckets = len(buckets(_shapes(run[0])))
                rows.append(_row(name, MODES[0], 1, [rec], n_buckets, 0))
                if log:
                    log(f"{name}: one process {rows[-1]['ms_step']:.1f} ms/step; {ranks} ranks next")
        finally:
            torch.set_num_threads(previous)
        args = (ranks, tmp, list(models), preset, steps, warmup, threads)
        try:
            mp.spawn(_rank, args=args, nprocs=ranks, join=True)
        except mp.ProcessExitedException:
            # a rank that died after writing every result (an abort at exit) lost nothing
            if not all(Path(tmp, f"{m}.rank{r}.json").is_file() for m in models for r in range(ranks)):
                raise
        for name in models:
            per_rank = [json.loads(Path(tmp, f"{name}.rank{r}.json").read_text()) for r in range(ranks)]
            n_buckets = next(r["buckets"] for r in rows if r["model"] == name)
            for k, mode in enumerate(MODES[1:]):
                model_bytes = _model_bytes(name, ranks, 3 if mode == "FSDP2" else 2)
                rows.append(_row(name, mode, ranks, [recs[k] for recs in per_rank], n_buckets, model_bytes))
    return sorted(rows, key=lambda r: (list(models).index(r["model"]), MODES.index(r["mode"])))


def _shapes(params: list) -> list:
    """Stand-ins with the ``index`` and ``p`` that `geomtrain.optim.muon_dist.buckets` reads."""
    from types import SimpleNamespace

    return [SimpleNamespace(index=i, p=p) for i, p in enumerate(params)]


def _model_bytes(model: str, ranks: int, passes: int) -> int:
    r"""Bytes a rank sends per step for the model's float32 parameters: ``passes`` ring collectives of
    $\frac{N-1}{N} 4P$ each (an all-reduce is 2, FSDP2's two all-gathers and a reduce-scatter 3)."""
    import torch

    from ..model import GPT, model_config

    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(model_config(model)).parameters())
    return round(passes * (ranks - 1) / ranks * 4 * n_params)


def _row(model: str, mode: str, ranks: int, recs: list[dict], n_buckets: int, model_bytes: int) -> dict:
    stats = recs[0]["stats"]
    comm = max((r["stats"].get("comm") or {} for r in recs), key=lambda c: c.get("bytes_sent", 0))
    slowest = [max(times) for times in zip(*(r["seconds"] for r in recs))]
    return {
        "model": model,
        "mode": mode,
        "ranks": ranks,
        "matrices": stats["n_matrices"],
        "buckets": n_buckets,
        "collectives": comm.get("collectives", 0),
        "bytes_sent": comm.get("bytes_sent", 0),
        "bytes_padding": comm.get("bytes_padding", 0),
        "model_bytes": model_bytes,
        "ms_step": 1000 * statistics.median(slowest),
    }


def format_dist_table(rows: list[dict]) -> str:
    """Markdown table of `bench_dist` rows."""
    lines = [
        "| model | exchange | ranks | matrices | buckets | collectives/step | bytes sent/step/rank | padding "
        "| model bytes/step/rank | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["model"], r["mode"], r["ranks"], r["matrices"], r["buckets"], r["collectives"]]
        cells += [f"{r['bytes_sent']:,}", f"{r['bytes_padding']:,}", f"{r['model_bytes']:,}", f"{r['ms_step']:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _cmd_dist(args) -> int:
    models = [s.strip() for s in args.models.split(",") if s.strip()]
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    rows = bench_dist(models, args.ranks, args.steps, args.warmup, args.preset, args.threads, log=log)
    print(format_dist_table(rows))
    return 0


def add_parser(sub) -> None:
    """Register ``dist`` on the ``geomtrain bench`` subparsers."""
    p = sub.add_parser(
        "dist",
        help="Manifold Muon's exchange: bytes and collectives per step, one process vs DDP broadcast, bucketed, FSDP2",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "--models",
        default="mini",
        help="comma-separated geomtrain.model.MODEL_CONFIGS names (gpt2: minutes per step on a CPU)",
    )
    p.add_argument("--ranks", type=positive_int, default=2, help="gloo CPU ranks (>= 2)")
    p.add_argument("--steps", type=positive_int, default=3, help="timed optimizer steps")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first")
    p.add_argument("--preset", default="hetero", help="the manifold assignment (geomtrain.assign.PRESETS)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per rank")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(handler=_cmd_dist)
