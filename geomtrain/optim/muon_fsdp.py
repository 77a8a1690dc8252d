r"""`ManifoldMuon` on FSDP2 parameters: DTensors split by rows like ``torch.chunk`` (`chunk_rows`), ``Shard(0)`` on a
1-D mesh over all ranks; momentum and warm-start ``"matrix"`` slots are split the same way, ``"flag"`` slots are plain.

**A step** (all ranks, in order; a direction needs the whole matrix, so each has an owner rank):

1. ONE all-reduce (min) of each rank's flags (finite gradient, update exactly zero) makes both checks global.
2. Owners (`owners_by_size`), from the shapes alone: the same on every rank.
3. ONE ``all_to_all_single`` sends each owner every rank's rows of $W$, of the update and of the matrix slots.
4. Each owner solves and retracts as one process does, and ONE ``all_to_all_single`` sends every rank its rows of the
   new $W$ and matrix slots (zeros where it keeps none) and every flag slot whole.
5. Every rank writes its rows (`Commit` s), then `reduce_stats`. A matrix with $u = 0$ is not sent: its owner only
   fills its statistics row (a Euclidean one decays on every rank's rows).

All ranks together send about $\frac{N-1}{N}(3|W| + 2|S|)$ bytes per step ($|S|$: the warm-start matrices).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .exchange import CommCount, comm_device, reduce_stats, state_slots
from .muon_step import (
    Commit,
    MatrixItem,
    MatrixPlan,
    StatsTable,
    apply_directions,
    batched_directions,
    group_batches,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "chunk_rows",
    "is_dtensor",
    "owners_by_size",
    "check_sharded",
    "whole",
    "local_grad",
    "sharded_like",
    "agree",
    "ShardedExchange",
    "solve_sharded",
    "placeholder_slots",
    "settle_loaded",
    "drop_placeholders",
    "cold_slot",
]

SUPPORTED = (
    "placement Shard(0) on one 1-D device mesh over all ranks, rows split like torch.chunk (FSDP2's fully_shard)"
)


def chunk_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank under ``torch.chunk``: $\\lceil R/N \\rceil$ each, the last ranks fewer or 0."""
    c = -(-rows // world)
    return [max(0, min(c, rows - r * c)) for r in range(world)]


def owners_by_size(sizes: list[int], world: int) -> list[int]:
    """The owner of each matrix of ``sizes`` elements: largest first, each to the least-loaded rank (ties: lower)."""
    load, out = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + sizes[i]
    return out


def is_dtensor(t) -> bool:
    """``t`` is a DTensor (without importing ``torch.distributed.tensor``: none exists before FSDP2 imports it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def check_sharded(params: list[torch.Tensor]):
    """The device mesh of FSDP2 parameters (None: all plain); a one-line error for a mix or another DTensor layout."""
    dts = [p for p in params if is_dtensor(p)]
    if not dts:
        return None
    from torch.distributed.tensor import Shard

    if len(dts) != len(params):
        raise ValueError(
            "ManifoldMuon takes plain tensors (one process, DDP) or FSDP2 DTensors, not both in one optimizer; "
            "give each kind its own ManifoldMuon"
        )
    mesh, world = dts[0].device_mesh, dist.get_world_size()
    for p in dts:
        m = p.device_mesh
        ok = m == mesh and m.ndim == 1 and m.size() == world and m.get_local_rank() == dist.get_rank()
        ok = ok and tuple(p.placements) == (Shard(0),)
        if not ok or p.to_local().shape[0] != chunk_rows(p.shape[0], world)[dist.get_rank()]:
            raise ValueError(
                f"ManifoldMuon supports DTensor parameters with {SUPPORTED}; got placements {tuple(p.placements)} "
                f"on a mesh of shape {tuple(m.shape)}, local shape {tuple(p.to_local().shape)} of {tuple(p.shape)}"
            )
    return mesh


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached as a plain full tensor: a DTensor's `full_tensor` (a collective every rank calls)."""
    t = t.detach()
    return (t.full_tensor() if is_dtensor(t) else t).as_subclass(torch.Tensor)


def local_grad(p: DTensor) -> torch.Tensor:
    """This rank's rows of ``p.grad`` (redistributed to ``p``'s placement where it differs)."""
    g = p.grad
    if not is_dtensor(g):  # a full plain gradient: this rank's rows
        return _rows(g, dist.get_rank(), dist.get_world_size())
    if tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


def sharded_like(p: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` (this rank's rows of a tensor of ``p``'s shape) as a DTensor of ``p``'s placement."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _sharded(local: torch.Tensor, mesh, shape: tuple) -> DTensor:
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    sizes = chunk_rows(t.shape[0], world)
    return t.narrow(0, sum(sizes[:rank]), sizes[rank])


def agree(flags: list[torch.Tensor], comm: CommCount) -> list[bool]:
    """Each 0-dim bool flag AND-ed over the ranks: ONE all-reduce (min) of int32."""
    if not flags:
        return []
    buf = torch.stack(flags).to(torch.int32).to(comm_device())
    dist.all_reduce(buf, op=dist.ReduceOp.MIN)
    comm.add("all_reduce", buf.numel() * buf.element_size(), dist.get_world_size())
    return [bool(v) for v in buf.tolist()]


def _slots(it: MatrixItem) -> tuple[list, list]:
    """`state_slots` as ``(matrix slots, flag slots)``."""
    slots = state_slots(it)
    return [s for s in slots if s[2] != torch.uint8], [s for s in slots if s[2] == torch.uint8]


def _exchange(parts: list[list[torch.Tensor]], recv: list[int], comm: CommCount) -> list[torch.Tensor]:
    """ONE ``all_to_all_single``: ``parts[d]`` (as bytes) to rank ``d``; returns ``recv[s]`` bytes from each ``s``."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), comm_device()
    flat = [[t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in ts] for ts in parts]
    sizes = [sum(t.numel() for t in ts) for ts in flat]
    send = torch.cat([t for ts in flat for t in ts] + [torch.zeros(0, dtype=torch.uint8, device=device)])
    out = torch.empty(sum(recv), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send, recv, sizes)
    comm.add("all_to_all", send.numel(), world, sent=send.numel() - sizes[rank])
    return list(out.split(recv))


class _Reader:
    def __init__(self, buf: torch.Tensor):
        self.buf, self.offset = buf, 0

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        out = self.buf[self.offset : self.offset + n].clone().view(dtype).reshape(shape)
        self.offset += n
        return out


def _piece(shape: tuple, rank: int, world: int) -> tuple:
    return (chunk_rows(shape[0], world)[rank], *shape[1:])


def _bytes(fields: list[tuple], rank: int | None, world: int) -> int:
    """Bytes of ``fields`` (``(shape, dtype)``): rank ``rank``'s rows of each, or each whole (``rank`` None)."""
    return sum(math.prod(s if rank is None else _piece(s, rank, world)) * d.itemsize for s, d in fields)


class ShardedExchange:
    """FSDP2: `solve` moves each matrix's rows to its owner and back (`solve_sharded`); `share`, once the commits are
    written, sums the statistics rows (`reduce_stats`) and adds what `solve` sent to the step's count."""

    def solve(self, items: list[MatrixItem], states: dict, table: StatsTable, certify_now: bool):
        owner, commits, self.sent = solve_sharded(items, states, table, certify_now)
        return commits, owner

    def share(self, items: list[MatrixItem], states: dict, table: StatsTable, owner: list[int], comm: CommCount):
        reduce_stats(items, states, table, dist.get_world_size(), owner, comm)
        for key, value in self.sent.as_dict().items():
            setattr(comm, key, getattr(comm, key) + value)
        return comm


def solve_sharded(
    items: list[MatrixItem], states: dict, table: StatsTable, certify_now: bool
) -> tuple[list[int], list[Commit], CommCount]:
    """Steps 2-4 of the module docstring: each item's owner, the `Commit` s of this rank's rows and what was sent."""
    rank, world, comm = dist.get_rank(), dist.get_world_size(), CommCount()
    moving = [it for it in items if not it.still]
    owner = [it.index % world for it in items]  # a zero update: its owner only fills its statistics row
    for it, o in zip(moving, owners_by_size([it.p.numel() for it in moving], world)):
        owner[it.index] = o
    commits = []
    for it in items:
        if not it.still:
            continue
        euclid = it.manifold.unconstrained
        if owner[it.index] == rank:
            table.set(it.index, "matrices", 1 if euclid else math.prod(it.p.shape[:-2]))
            table.set(it.index, "converged", 1.0)
        decay = it.group["lr"] * it.group["weight_decay"]
        if euclid and decay:  # decoupled weight decay, elementwise: every rank on its rows
            commits.append(Commit(it.p, weights=it.p * (1 - decay)))
    if moving:
        mine = [it for it in moving if owner[it.index] == rank]
        new = _solve(_gather(moving, mine, owner, states, comm), table, certify_now)
        commits += _scatter(moving, mine, owner, new, comm)
    return owner, commits, comm


def _present(it: MatrixItem, states: dict) -> list[tuple]:
    return [(k, s, d) for k, s, d in _slots(it)[0] if k in states[it.p]]


def _gather(moving, mine, owner, states, comm) -> list[MatrixItem]:
    """Step 3; returns the owner's items as whole plain matrices (flag slots from its own state)."""
    world = dist.get_world_size()
    parts = [[] for _ in range(world)]
    for it in moving:
        slots = [states[it.p][k].to_local().to(d) for k, _, d in _present(it, states)]
        parts[owner[it.index]] += [it.p.to_local(), it.update.to(it.p.dtype), *slots]
    fields = {
        id(it): [(tuple(it.p.shape), it.p.dtype)] * 2 + [(s, d) for _, s, d in _present(it, states)] for it in mine
    }
    recv = [sum(_bytes(fields[id(it)], src, world) for it in mine) for src in range(world)]
    readers = [_Reader(b) for b in _exchange(parts, recv, comm)]
    full = []
    for it in mine:
        pieces = [
            torch.cat([r.take(_piece(s, src, world), d) for src, r in enumerate(readers)]) for s, d in fields[id(it)]
        ]
        W, u, *slots = [p.to(it.p.device) for p in pieces]
        st = {k: v for (k, _, _), v in zip(_present(it, states), slots)}
        st.update({k: states[it.p][k] for k, _, _ in _slots(it)[1] if k in states[it.p]})
        u = u.reshape(u.shape[0], -1) if it.manifold.unconstrained else u
        full.append(MatrixItem(it.index, W, it.group, it.plan, u, it.name, st))
    return full


def _solve(full: list[MatrixItem], table: StatsTable, certify_now: bool) -> list[tuple]:
    """Step 4, on the owner: per item its new weights and warm-start state, and its ``has_state`` row."""
    solved = []
    for batch in group_batches(full):
        A, st, sizes = batched_directions(batch, certify_now)
        solved += apply_directions(batch, A, st, sizes, table)
    new = {id(f.p): (f.p, dict(f.state)) for f in full}
    for c in solved:
        W, st = new[id(c.p)]
        for key, value in (c.state or {}).items():
            if value is None:
                st.pop(key, None)
            else:
                st[key] = value
        new[id(c.p)] = (W if c.weights is None else c.weights, st)
    for f in full:
        slots, st = f.plan.solver.state, new[id(f.p)][1]
        table.set(f.index, "has_state", float(bool(slots) and all(s.key in st for s in slots)))
    return [new[id(f.p)] for f in full]


def _scatter(moving, mine, owner, new, comm) -> list[Commit]:
    """Step 4, back to every rank; returns this rank's `Commit` s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [[] for _ in range(world)]
    for it, (W, st) in zip(mine, new):
        matrix, flag = _slots(it)
        values = [W] + [st[k].to(d) if k in st else torch.zeros(s, dtype=d, device=W.device) for k, s, d in matrix]
        flags = [st[k].to(d) if k in st else torch.zeros(s, dtype=d, device=W.device) for k, s, d in flag]
        for dest in range(world):
            parts[dest] += [_rows(v, dest, world) for v in values] + flags
    recv = [0] * world
    for it in moving:
        matrix, flag = _slots(it)
        rows = [(tuple(it.p.shape), it.p.dtype)] + [(s, d) for _, s, d in matrix]
        recv[owner[it.index]] += _bytes(rows, rank, world) + _bytes([(s, d) for _, s, d in flag], None, world)
    readers = [_Reader(b) for b in _exchange(parts, recv, comm)]
    commits = []
    for it in moving:  # each owner's buffer holds its items in item order
        r, mesh, device = readers[owner[it.index]], it.p.device_mesh, it.p.device
        W = r.take(_piece(tuple(it.p.shape), rank, world), it.p.dtype).to(device)
        matrix, flag = _slots(it)
        st = {k: _sharded(r.take(_piece(s, rank, world), d).to(device), mesh, s) for k, s, d in matrix}
        st.update({k: r.take(s, d).to(device) for k, s, d in flag})
        commits.append(Commit(it.p, weights=sharded_like(it.p, W), state=st))
    return commits


PLACEHOLDER_FLAG = 255  # a flag slot is 0 or 1


def placeholder_slots(p: DTensor, group: dict, plan: MatrixPlan, entry: dict) -> dict:
    """A state entry with every warm-start slot it lacks as a placeholder (NaN, or `PLACEHOLDER_FLAG`): DCP loads only
    the keys a state dict has, so a fresh optimizer's must have every key a checkpoint may have."""
    it = MatrixItem(0, p, group, plan, None, "", entry)
    matrix, flag = _slots(it)
    out = dict(entry)
    for k, s, d in matrix:
        if k not in out:
            local = torch.full(_piece(s, dist.get_rank(), dist.get_world_size()), math.nan, dtype=d, device=p.device)
            out[k] = _sharded(local, p.device_mesh, s)
    for k, s, d in flag:
        out.setdefault(k, torch.full(s, PLACEHOLDER_FLAG, dtype=d, device=p.device))
    return out


def settle_loaded(entries: list[tuple]) -> list[tuple[int, str]]:
    """Loaded entries ``(p, group, plan, state)`` made this rank's DTensor rows in place (a collective); placeholders
    and non-finite matrix slots are dropped. Returns ``(entry index, slot)`` of the damaged ones (`cold_slot`)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def rows(t: torch.Tensor, shape: tuple, what: str) -> torch.Tensor:
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"loaded optimizer state {what!r} has shape {tuple(t.shape)}; expected {tuple(shape)}")
        return _rows(t, rank, world)

    matrix = []
    for i, (p, group, plan, st) in enumerate(entries):
        buf = st.get("momentum_buffer")
        if buf is not None and not is_dtensor(buf):
            st["momentum_buffer"] = sharded_like(p, rows(buf.to(p.device, p.dtype), p.shape, "momentum_buffer"))
        slots, flags = _slots(MatrixItem(0, p, group, plan, None, "", st))
        for k, s, d in slots:
            if k in st and not is_dtensor(st[k]):
                st[k] = _sharded(rows(st[k].to(p.device, d), s, k), p.device_mesh, s)
            if k in st:
                matrix.append((i, st, k))
        for k, _, d in flags:
            if k in st and bool((st[k] == PLACEHOLDER_FLAG).any()):
                st.pop(k)
            elif k in st:
                st[k] = st[k].to(d)
    local = [st[k].to_local() for _, st, k in matrix]
    checks = agree([torch.isfinite(t).all() for t in local] + [torch.isnan(t).all() for t in local], CommCount())
    damaged = []
    for (i, st, k), finite, placeholder in zip(matrix, checks, checks[len(matrix) :]):
        if not finite:
            st.pop(k)
            damaged += [] if placeholder else [(i, k)]
    return damaged


def drop_placeholders(entries: list[dict]) -> list[tuple[int, str]]:
    """Drop `placeholder_slots`' placeholders and damaged (non-finite) warm-start slots from loaded state entries of an
    unsharded optimizer, in place. Returns ``(entry index, slot)`` of the damaged ones (`cold_slot`)."""
    damaged = []
    for i, entry in enumerate(entries):
        for key in [k for k, v in entry.items() if isinstance(v, torch.Tensor) and k != "momentum_buffer"]:
            v = entry[key]
            flag = v.dim() == 1 and bool((v == PLACEHOLDER_FLAG).any())
            if flag or (v.is_floating_point() and not bool(torch.isfinite(v).all())):
                entry.pop(key)
                damaged += [] if flag or bool(torch.isnan(v).all()) else [(i, key)]
    return damaged


def cold_slot(name: str, slot: str) -> str:
    """The notice of a damaged warm-start slot dropped at load (`settle_loaded`, `drop_placeholders`)."""
    return f"ManifoldMuon: the saved warm-start state {slot!r} of {name} is not finite; that matrix starts cold"
