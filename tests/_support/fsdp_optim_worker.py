"""Launched by torchrun from tests/optim/test_muon_fsdp.py (or `run` in-process for the 1-process reference): a
few ManifoldMuon steps on a ``fully_shard``-ed module of bare Stiefel, DGram, Oblique and Euclidean matrices
whose rows do not divide by 2 or 4 (at 4 ranks some ranks hold no rows of DGram 5x12 and Oblique 3x9x4), then
write this rank's record to ``<out_dir>/rank<r>.pt``: ``python fsdp_optim_worker.py OUT [dcp]``.

The loss is a pure function of the weights and a fixed per-step batch, computed whole on every rank, so FSDP's
averaged gradient is the one-process gradient (the mean of N equal values, N a power of two, is exact). At step
`NAN_STEP` the last row of DGram's gradient (held by a rank other than 0) gets a NaN. With ``dcp``, the
optimizer state of the ``exact`` run is saved with torch.distributed.checkpoint, loaded into a fresh optimizer
(``get_optimizer_state_dict`` / ``set_optimizer_state_dict``) and both take one more step.
"""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from geomtrain.optim import ManifoldMuon
from geomtrain.optim.muon_fsdp import chunk_rows
from manifolds import DGram, Oblique, Stiefel

STEPS = 3
NAN_STEP = 1
SOLVERS = ("exact", "tangent", "filled_split")  # stateful, stateless, and the default (stateful except on Oblique)
SHAPES = {"st0": (13, 5), "st1": (13, 5), "dg": (5, 12), "ob": (3, 9, 4), "eu": (7, 6), "z": (5, 3)}
GROUPS = (("st", Stiefel()), ("dg", DGram()), ("ob", Oblique()))  # then eu and z: Euclidean, weight decay


class Bare(torch.nn.Module):
    """The matrices as parameters; ``forward(step)`` is the loss (``z`` has a zero gradient at step 0)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            m = dict(GROUPS).get(name[:2])
            w = m.random(*shape, generator=gen) if m is not None else torch.randn(shape, generator=gen)
            self.register_parameter(name, torch.nn.Parameter(w))

    def forward(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 + step)
        loss = torch.zeros(())
        for name, w in self.named_parameters():
            c, d = torch.randn(w.shape, generator=gen), torch.randn(w.shape, generator=gen)
            scale = 0.0 if (name == "z" and step == 0) else 1.0
            loss = loss + scale * (c * torch.tanh(d * w)).sum()
        return loss


def param_groups(model: Bare) -> list[dict]:
    """One group per manifold in the order st, dg, ob, then ``eu`` and ``z`` (Euclidean, weight decay 0.1)."""
    params = dict(model.named_parameters())
    groups = [{"params": [p for n, p in params.items() if n.startswith(k)], "manifold": m} for k, m in GROUPS]
    return groups + [{"params": [params["eu"], params["z"]], "weight_decay": 0.1}]


def make(sharded: bool, solver: str) -> tuple[Bare, ManifoldMuon]:
    model = Bare()
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    return model, ManifoldMuon(param_groups(model), lr=0.05, solver=solver, certify_every=2)


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def step(model: Bare, opt: ManifoldMuon, k: int) -> dict:
    """One step with the gradient of step ``k``'s loss (and the planted NaN at `NAN_STEP`)."""
    opt.zero_grad(set_to_none=True)
    model(k).backward()
    if k == NAN_STEP:
        g = model.dg.grad
        if hasattr(g, "to_local"):  # the last global row: on the last rank that holds any rows
            rows, rank = chunk_rows(SHAPES["dg"][0], dist.get_world_size()), dist.get_rank()
            if rows[rank] and sum(rows[: rank + 1]) == SHAPES["dg"][0]:
                g.to_local()[-1, 0] = float("nan")
        else:
            g[-1, 0] = float("nan")
    opt.step()
    return dict(opt.last_stats)


def record(model: Bare, opt: ManifoldMuon) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: whole(p) for n, p in model.named_parameters()},
        "state": {names[id(p)]: {k: whole(v) for k, v in st.items()} for p, st in opt.state.items()},
        "counters": (opt.step_count, opt.n_skipped_nonfinite_total),
        "sharded": {
            names[id(p)]: sorted(k for k, v in st.items() if hasattr(v, "to_local")) for p, st in opt.state.items()
        },
    }


def run(solver: str, sharded: bool = False) -> dict:
    model, opt = make(sharded, solver)
    stats = [step(model, opt, k) for k in range(STEPS)]
    return {**record(model, opt), "stats": stats, "model": model, "opt": opt}


def dcp_round_trip(out: dict, ckpt: Path) -> dict:
    """Save the optimizer state with DCP, load it into a fresh optimizer of a copy of the model (and, as whole
    plain tensors, into another); the records, and both after one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, opt = out["model"], out["opt"]
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(ckpt))
    model2, opt2 = make(True, "exact")
    with torch.no_grad():
        for p2, p in zip(model2.parameters(), model.parameters()):
            p2.copy_(p)
    target = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(target, checkpoint_id=str(ckpt))
    set_optimizer_state_dict(model2, opt2, target["optim"])
    loaded = record(model2, opt2)
    model3, opt3 = make(True, "exact")  # a loader of whole plain tensors (a .pt checkpoint): sharded on load
    whole_sd = opt.state_dict()
    whole_sd["state"] = {i: {k: whole(v) for k, v in st.items()} for i, st in whole_sd["state"].items()}
    opt3.load_state_dict(whole_sd)
    loaded_whole = record(model3, opt3)
    step(model, opt, STEPS)
    step(model2, opt2, STEPS)
    saved = record(model, opt) | {"before": out["state"]}
    return {"saved": saved, "loaded": loaded, "loaded_whole": loaded_whole, "after": record(model2, opt2)}


def refusals() -> dict:
    """The one-line errors: a replicated DTensor, plain and sharded parameters together, an off-manifold one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, _ = make(True, "exact")
    out = {}
    cases = {
        "replicated": lambda: [torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]))],
        "mixed": lambda: [model.st0, torch.nn.Parameter(torch.zeros(4, 3))],
        "off_manifold": lambda: [{"params": [model.eu], "manifold": Stiefel()}],
    }
    for name, params in cases.items():
        try:
            ManifoldMuon(params())
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def main(out_dir: str, *flags: str) -> None:
    dist.init_process_group("gloo")
    try:
        rec = {"world_size": dist.get_world_size()}
        for solver in SOLVERS:
            out = run(solver, sharded=True)
            if solver == "exact" and "dcp" in flags:
                rec["dcp"] = dcp_round_trip(out, Path(out_dir) / "ckpt")
            rec[solver] = {k: v for k, v in out.items() if k not in ("model", "opt")}
        rec["refusals"] = refusals()
        torch.save(rec, Path(out_dir) / f"rank{dist.get_rank()}.pt")
        gc.collect()  # nothing that touched the process group may outlive it (gloo aborts at exit otherwise)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
