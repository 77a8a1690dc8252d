r"""The distributed exchange of a `ManifoldMuon` step: which rank solves each matrix (`owners`), how its new
weights and warm-start state reach the other ranks (`share_bucketed`: one gather per bucket; `share`: the
per-matrix broadcasts, kept for comparison), then the statistics all-reduce (`geomtrain.optim.exchange`).

**Buckets.** The step's matrices are grouped by ``(shape, dtype, device)`` of their parameter; buckets are
taken largest matrix first (ties: first appearance), and inside the run of buckets matrix $j$ (counted over
all buckets) is owned by rank $j \bmod N$, so each bucket splits as evenly as it can (each rank owns
$\lfloor b/N \rfloor$ or $\lceil b/N \rceil$ of its $b$ matrices) and the ranks that get one more in a bucket
change from bucket to bucket. After the solve, each rank writes the bytes of what it owns in a bucket (per
matrix: the weights, then every warm-start `StateSlot` of its solver) into one flat ``uint8`` buffer, padded
to the longest rank's, and ONE ``all_gather`` per bucket carries them all. Every rank derives the layout from
the parameters alone, so nothing else is sent.

The counts (`geomtrain.optim.exchange.CommCount`) are those of every exchange.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .exchange import CommCount, comm_device, reduce_stats, state_slots
from .muon_step import MatrixItem, StatsTable

__all__ = ["owners", "buckets", "share", "share_bucketed", "all_gather_flat"]


def buckets(items: list[MatrixItem]) -> list[list[MatrixItem]]:
    """The step's matrices grouped by ``(shape, dtype, device)``, largest matrix first (stable)."""
    out: dict[tuple, list[MatrixItem]] = {}
    for it in items:
        out.setdefault((tuple(it.p.shape), it.p.dtype, it.p.device), []).append(it)
    return sorted(out.values(), key=lambda b: -b[0].p.numel())


def owners(items: list[MatrixItem], world: int, bucketed: bool = True) -> list[int]:
    """The rank that solves each item (by ``item.index``): round-robin through the `buckets` in order
    (bucketed), else ``index % world`` (the per-matrix broadcast path)."""
    if not bucketed:
        return [it.index % world for it in items]
    out = [0] * len(items)
    j = 0
    for bucket in buckets(items):
        for it in bucket:
            out[it.index], j = j % world, j + 1
    return out


def _slot_tensor(st: dict, key: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The state entry to send (or receive into): allocated as zeros where this rank has none yet (a
    non-owner's first step, or an owner that kept none: ``has_state`` 0 drops it after the exchange)."""
    if key not in st:
        st[key] = torch.zeros(shape, dtype=dtype, device=device)
    return st[key]


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def share_bucketed(items: list[MatrixItem], states: dict, table: StatsTable, world: int, owner: list[int]) -> CommCount:
    """One all-gather per bucket of every owner's new weights and warm-start state (see the module
    docstring), then `reduce_stats`. Writes only what other ranks own; returns what was sent."""
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
    """The ``world`` equal-length flat buffers of the ranks, concatenated in rank order: one
    ``all_gather_single`` (``all_gather_into_tensor`` before torch 2.13), or ``all_gather`` into a list where
    the backend has no single-tensor gather."""
    out = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        single(out, send)
    except (RuntimeError, NotImplementedError):  # raised before sending, on every rank alike (same backend)
        dist.all_gather(list(out.chunk(world)), send)
    return out


def share(items: list[MatrixItem], states: dict, table: StatsTable, world: int, owner: list[int]) -> CommCount:
    """The per-matrix path: broadcast each matrix's new weights and each warm-start state slot from its owner
    (1-3 broadcasts per matrix), then `reduce_stats`; returns what was sent."""
    comm = CommCount()
    for it in items:
        dist.broadcast(it.p.data, src=owner[it.index])
        comm.add("broadcast", it.p.numel() * it.p.element_size(), world)
        for key, shape, dtype in state_slots(it):
            dist.broadcast(_slot_tensor(states[it.p], key, shape, dtype, it.p.device), src=owner[it.index])
            comm.add("broadcast", _nbytes(shape, dtype), world)
    reduce_stats(items, states, table, world, owner, comm)
    return comm
