r"""Count the host synchronisations a piece of torch code would make on a GPU, on any device.

On a GPU every operation whose result the host must read waits for all queued kernels: a tensor
read as a Python number (``bool``, ``float``, ``int``, ``.item()``), ``nonzero`` and indexing with a
boolean mask (its result size depends on the data), and a copy to the CPU. A solver loop with many
of them runs at the host's pace, the GPU idle between kernels. `count_host_syncs` records them at
the dispatcher, so the count is the same on a CPU, where they cost nothing, and can be tested there.

Not seen at this level: the error checks inside a few linear-algebra kernels on CUDA
(``torch.linalg.eigh``, ``solve``, ``cholesky``: one synchronisation per call; the ``_ex`` variants
skip it). ``tolist()``, ``numpy()`` and ``.cpu()`` are counted as copies to the host whatever the
device: on the CPU a ``.cpu()`` dispatches nothing, and code that calls it on a tensor moves that tensor
off a GPU.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_host_syncs", "counted_in_steps", "SYNC_KINDS"]

SYNC_KINDS = ("scalar read", "nonzero", "boolean index", "copy to host")
_SCALAR = {"_local_scalar_dense"}  # what bool(), float(), int() and .item() dispatch to
_NONZERO = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
_INDEX = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
    )


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SCALAR:
            self.counts["scalar read"] += 1
        elif name in _NONZERO:
            self.counts["nonzero"] += 1
        elif name in _INDEX and _has_bool_index(args):
            self.counts["boolean index"] += 1
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None:
                if torch.device(dst).type == "cpu":
                    self.counts["copy to host"] += 1
        return func(*args, **kwargs)


class _HostReadCounter(TorchFunctionMode):
    """``tolist()``, ``numpy()`` and ``cpu()`` (of a CPU tensor) read a tensor on the host without a dispatched
    operation."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.counts["copy to host"] += 1
        elif func is torch.Tensor.cpu and args and args[0].device.type == "cpu":  # else _to_copy counts it
            self.counts["copy to host"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs() -> Iterator[collections.Counter]:
    """Context manager: a `collections.Counter` of the host synchronisations (by kind, `SYNC_KINDS`)
    made by the torch operations run inside it; ``sum(counts.values())`` is the total."""
    counts: collections.Counter = collections.Counter()
    with _HostReadCounter(counts), _SyncCounter(counts):
        yield counts


@contextlib.contextmanager
def counted_in_steps(optimizer: torch.optim.Optimizer | None, counts: collections.Counter) -> Iterator[list[int]]:
    """Context manager, inside `count_host_syncs`: a one-item list holding how many of ``counts`` were added
    during ``optimizer.step()`` calls (its step hooks, removed on exit); with no optimizer (None), 0."""
    inside, start = [0], [0]
    if optimizer is None:
        yield inside
        return

    def before(*_):
        start[0] = sum(counts.values())

    def after(*_):
        inside[0] += sum(counts.values()) - start[0]

    hooks = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield inside
    finally:
        for hook in hooks:
            hook.remove()
