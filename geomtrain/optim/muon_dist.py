r"""The exchange of a `ManifoldMuon` step in one process and under DDP (`OwnerExchange`). The step's matrices are
grouped by ``(shape, dtype, device)`` into `buckets`, largest first; matrix $j$, counted over the buckets in order, is
owned by rank $j \bmod N$ (`owners`). After the solve each rank writes what it owns in a bucket (weights, then
warm-start slots) into one flat ``uint8`` buffer, padded to the longest rank's, and ONE ``all_gather`` per bucket
carries them all (`share_bucketed`; `share`: one broadcast per matrix and slot); then `reduce_stats`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .exchange import CommCount, comm_device, reduce_stats, state_slots
from .muon_step import MatrixItem, StatsTable, solve_owned

__all__ = ["OwnerExchange", "owners", "buckets", "share", "share_bucketed", "all_gather_flat"]


class OwnerExchange:
    """One process (every matrix is rank 0's) or DDP: `solve` the matrices this rank owns (`owners`); once their
    commits are written, `share` marks which kept their warm-start state and, with several ranks, sends every rank
    the owners' weights, state and statistics (`share_bucketed`, else `share`)."""

    def __init__(self, bucketed: bool):
        self.bucketed = bucketed
        on = dist.is_available() and dist.is_initialized()
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)

    def solve(self, items: list[MatrixItem], states: dict, table: StatsTable, certify_now: bool):
        owner = owners(items, self.world, self.bucketed)
        return solve_owned([it for it in items if owner[it.index] == self.rank], table, certify_now), owner

    def share(self, items: list[MatrixItem], states: dict, table: StatsTable, owner: list[int], comm: CommCount):
        for it in (it for it in items if owner[it.index] == self.rank):
            slots = it.plan.solver.state
            table.set(it.index, "has_state", float(bool(slots) and all(s.key in states[it.p] for s in slots)))
        if self.world == 1:
            return comm
        return (share_bucketed if self.bucketed else share)(items, states, table, self.world, owner)


def buckets(items: list[MatrixItem]) -> list[list[MatrixItem]]:
    """The step's matrices grouped by ``(shape, dtype, device)``, largest matrix first (stable)."""
    out: dict[tuple, list[MatrixItem]] = {}
    for it in items:
        out.setdefault((tuple(it.p.shape), it.p.dtype, it.p.device), []).append(it)
    return sorted(out.values(), key=lambda b: -b[0].p.numel())


def owners(items: list[MatrixItem], world: int, bucketed: bool = True) -> list[int]:
    """The rank that solves each item: round-robin through the `buckets`, else ``index % world``."""
    if not bucketed:
        return [it.index % world for it in items]
    out = [0] * len(items)
    j = 0
    for bucket in buckets(items):
        for it in bucket:
            out[it.index], j = j % world, j + 1
    return out


def _slot_tensor(st: dict, key: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The state entry to send or receive into, zeros where this rank has none yet."""
    if key not in st:
        st[key] = torch.zeros(shape, dtype=dtype, device=device)
    return st[key]


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def share_bucketed(items: list[MatrixItem], states: dict, table: StatsTable, world: int, owner: list[int]) -> CommCount:
    """One all-gather per bucket, then `reduce_stats`; writes what other ranks own, returns what was sent."""
    rank, comm = dist.get_rank(), CommCount()
    for bucket in buckets(items):
        parts: list[list[tuple]] = [[] for _ in range(world)]  # per rank: (tensor or None, key, shape, dtype)
        for it in bucket:
            mine = owner[it.index] == rank
            parts[owner[it.index]].append((it, None, tuple(it.p.shape), it.p.dtype))
            for key, shape, dtype in state_slots(it):
                if mine:
                    _slot_tensor(states[it.p], key, shape, dtype, it.p.device)
                parts[owner[it.index]].append((it, key, shape, dtype))
        lengths = [sum(_nbytes(s, d) for _, _, s, d in rank_parts) for rank_parts in parts]
        size = max(lengths)
        device = comm_device()
        flat = [
            (it.p.data if key is None else states[it.p][key]).contiguous().reshape(-1).view(torch.uint8)
            for it, key, _, _ in parts[rank]
        ]
        pad = torch.zeros(size - lengths[rank], dtype=torch.uint8, device=device)
        received = all_gather_flat(torch.cat([t.to(device) for t in flat] + [pad]), world)
        comm.add("all_gather", size, world, padding=world * size - sum(lengths))
        for r in range(world):
            if r == rank:
                continue
            offset = r * size
            for it, key, shape, dtype in parts[r]:
                n = _nbytes(shape, dtype)
                value = received[offset : offset + n].clone().view(dtype).reshape(shape).to(it.p.device)
                offset += n
                if key is None:
                    it.p.data.copy_(value)
                else:
                    states[it.p][key] = value
    reduce_stats(items, states, table, world, owner, comm)
    return comm


def all_gather_flat(send: torch.Tensor, world: int) -> torch.Tensor:
    """The ranks' equal-length flat buffers, concatenated in rank order (one all-gather)."""
    out = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        single(out, send)
    except (RuntimeError, NotImplementedError):  # raised before sending, on every rank alike (same backend)
        dist.all_gather(list(out.chunk(world)), send)
    return out


def share(items: list[MatrixItem], states: dict, table: StatsTable, world: int, owner: list[int]) -> CommCount:
    """One broadcast per matrix and state slot from its owner, then `reduce_stats`; returns what was sent."""
    comm = CommCount()
    for it in items:
        dist.broadcast(it.p.data, src=owner[it.index])
        comm.add("broadcast", it.p.numel() * it.p.element_size(), world)
        for key, shape, dtype in state_slots(it):
            dist.broadcast(_slot_tensor(states[it.p], key, shape, dtype, it.p.device), src=owner[it.index])
            comm.add("broadcast", _nbytes(shape, dtype), world)
    reduce_stats(items, states, table, world, owner, comm)
    return comm
