r"""What both exchanges (`geomtrain.optim.muon_dist`, `geomtrain.optim.muon_fsdp`) of a `ManifoldMuon` step share:
`CommCount`, `state_slots`, `reduce_stats` and `comm_device`.

`CommCount` (``last_stats["comm"]``) counts per step and rank ``collectives``, ``bytes_in`` (the buffers this rank hands
to them), ``bytes_sent`` (under the ring algorithms: $(N-1)L$ for an all-gather of $L$ bytes per rank,
$2\frac{N-1}{N}S$ for an all-reduce of $S$ bytes, $\frac{N-1}{N}S$ for a broadcast; an ``all_to_all`` this rank's own
bytes for the others) and ``bytes_padding`` (zeros in gathered buffers, all ranks together), from the buffers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .muon_step import MatrixItem, StatsTable

__all__ = ["CommCount", "state_slots", "reduce_stats", "comm_device"]


@dataclass
class CommCount:
    """What one rank sends in one step (module docstring)."""

    collectives: int = 0
    bytes_in: int = 0
    bytes_sent: float = 0.0  # fractional per collective (a rank's share of a broadcast); rounded in as_dict
    bytes_padding: int = 0

    def add(self, kind: str, size: int, world: int, padding: int = 0, sent: int = 0) -> None:
        """One collective of ``kind`` on ``size`` bytes per rank (``"all_to_all"``: ``sent`` to the others)."""
        factor = {"all_gather": world - 1, "all_reduce": 2 * (world - 1) / world, "broadcast": (world - 1) / world}
        self.collectives += 1
        self.bytes_in += size
        self.bytes_sent += sent if kind == "all_to_all" else factor[kind] * size
        self.bytes_padding += padding

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_sent": round(self.bytes_sent)}


def state_slots(it: MatrixItem) -> list[tuple[str, tuple, torch.dtype]]:
    """``(key, shape, dtype)`` of each kept `StateSlot` of a matrix (``"flag"``: one uint8 per matrix)."""
    lead, n = tuple(it.p.shape[:-2]), min(it.p.shape[-2:])
    return [
        (s.key, (*lead, n, n), it.p.dtype) if s.kind == "matrix" else (s.key, (math.prod(lead),), torch.uint8)
        for s in it.plan.kept_slots
    ]


def reduce_stats(
    items: list[MatrixItem], states: dict, table: StatsTable, world: int, owner: list[int], comm: CommCount
) -> None:
    """Sum the statistics rows from their owners (NaN travels as -1) in one all-reduce; drop the state of matrices
    whose owner kept none."""
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
            for slot in it.plan.solver.state:
                states[it.p].pop(slot.key, None)


def comm_device() -> torch.device:
    """Where collective buffers live: the current CUDA device under nccl, else the CPU."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
