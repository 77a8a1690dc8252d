r"""The distributed exchange of a `ManifoldMuon` step: which rank solves each matrix (`owners`), how its new
weights and warm-start state reach the other ranks (`share_bucketed`: one gather per bucket; `share`: the
per-matrix broadcasts, kept for comparison), the statistics all-reduce, and what is sent (`CommCount`).

**Buckets.** The step's matrices are grouped by ``(shape, dtype, device)`` of their parameter; buckets are
taken largest matrix first (ties: first appearance), and inside the run of buckets matrix $j$ (counted over
all buckets) is owned by rank $j \bmod N$, so each bucket splits as evenly as it can (each rank owns
$\lfloor b/N \rfloor$ or $\lceil b/N \rceil$ of its $b$ matrices) and the ranks that get one more in a bucket
change from bucket to bucket. After the solve, each rank writes the bytes of what it owns in a bucket (per
matrix: the weights, then every warm-start `StateSlot` of its solver) into one flat ``uint8`` buffer, padded
to the longest rank's, and ONE ``all_gather`` per bucket carries them all. Every rank derives the layout from
the parameters alone, so nothing else is sent.

**Counting** (`CommCount`, ``last_stats["comm"]``): per step and rank, ``collectives``, ``bytes_in`` (the
bytes of the buffers this rank hands to the collectives) and ``bytes_sent`` (what it transmits under the ring
algorithms: $(N-1)L$ for an all-gather of $L$ bytes per rank, $2\frac{N-1}{N}S$ for an all-reduce of $S$
bytes, $\frac{N-1}{N}S$ for a pipelined broadcast, averaged over ranks) and ``bytes_padding`` (the zeros in
the gathered buffers, all ranks together). Equal on every rank; computed from the buffers, not measured on
the network. Under FSDP2 (`geomtrain.optim.muon_fsdp`) an ``all_to_all`` counts what this rank itself sends
to the others, which differs between ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .direction import get_solver, mask_kind
from .muon_step import MatrixItem, StatsTable, keeps_warm_state

__all__ = ["CommCount", "owners", "buckets", "state_slots", "share", "share_bucketed", "comm_device"]


@dataclass
class CommCount:
    """What one rank sends in one step (see the module docstring for each count)."""

    collectives: int = 0
    bytes_in: int = 0
    bytes_sent: float = 0.0  # fractional per collective (a rank's share of a broadcast); rounded in as_dict
    bytes_padding: int = 0

    def add(self, kind: str, size: int, world: int, padding: int = 0, sent: int = 0) -> None:
        """One collective of ``kind`` (``"all_gather"``, ``"all_reduce"``, ``"broadcast"``) on a buffer of
        ``size`` bytes per rank; ``"all_to_all"`` (`geomtrain.optim.muon_fsdp`): ``size`` is this rank's send
        buffer and ``sent`` its bytes for the other ranks (counted as they are, not averaged over ranks)."""
        factor = {"all_gather": world - 1, "all_reduce": 2 * (world - 1) / world, "broadcast": (world - 1) / world}
        self.collectives += 1
        self.bytes_in += size
        self.bytes_sent += sent if kind == "all_to_all" else factor[kind] * size
        self.bytes_padding += padding

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_sent": round(self.bytes_sent)}


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


def state_slots(it: MatrixItem) -> list[tuple[str, tuple, torch.dtype]]:
    """The warm-start state a matrix's owner sends: ``(key, shape, dtype)`` per `StateSlot` of its solver
    (``"matrix"`` slots ``(*lead, n, n)`` in the parameter's dtype, ``"flag"`` slots one uint8 per matrix);
    none for a Euclidean matrix or without warm start."""
    spec = get_solver(it.solver)
    if not keeps_warm_state(it.group, spec) or mask_kind(it.manifold) == "euclidean":
        return []
    lead, n = tuple(it.p.shape[:-2]), min(it.p.shape[-2:])
    return [
        (s.key, (*lead, n, n), it.p.dtype) if s.kind == "matrix" else (s.key, (math.prod(lead),), torch.uint8)
        for s in spec.state
    ]


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


def reduce_stats(
    items: list[MatrixItem], states: dict, table: StatsTable, world: int, owner: list[int], comm: CommCount
) -> None:
    """Sum the statistics rows (each row from its owner; NaN, an unknown gap, travels as -1) in one all-reduce;
    then drop the received state of matrices whose owner kept none (a skipped update)."""
    mine = torch.tensor([owner[it.index] == dist.get_rank() for it in items], dtype=torch.bool)
    local = torch.where(mine[:, None], table.rows, torch.zeros_like(table.rows))
    buf = torch.nan_to_num(local, nan=-1.0).to(comm_device())
    dist.all_reduce(buf)
    comm.add("all_reduce", buf.numel() * buf.element_size(), world)
    out = buf.cpu()
    for name in StatsTable.UNKNOWN:
        j = StatsTable.FIELDS.index(name)
        out[:, j] = torch.where(out[:, j] == -1, torch.nan, out[:, j])
    table.rows.copy_(out)
    for it in items:
        if table.rows[it.index, StatsTable.FIELDS.index("has_state")] == 0:
            for slot in get_solver(it.solver).state:
                states[it.p].pop(slot.key, None)


def comm_device() -> torch.device:
    """Where collective buffers live: the current CUDA device under nccl, else the CPU."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
