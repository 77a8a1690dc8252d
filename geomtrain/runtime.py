"""Process-level concerns of a run: stop signals and ``torch.distributed`` set-up.

- `StopSignals`: SIGINT and SIGTERM become a flag the training loop checks at step boundaries
  (agreed across ranks under DDP), so a step is never half-applied.
- `any_rank`: a flag agreed across ranks (one all-reduce), so every rank takes the same branch.
- `distributed_from_env`: initialise the process group when launched by ``torchrun`` and tear it
  down in the order that avoids aborts at exit.
- `resolve_device`: the device a config's ``device`` names, checked against this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["StopSignals", "any_rank", "distributed_from_env", "resolve_device", "DEVICES"]

DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an unavailable or unknown device is a ValueError."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here; valid here: auto, cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type == "mps" and not mps:
        raise ValueError(f"device {name!r} requested but MPS is not available here; valid here: auto, cpu")
    return device


class StopSignals:
    """SIGINT and SIGTERM become a flag checked between steps, so a step is never half-applied.

    Once a stop is under way a repeated SIGTERM is ignored: under torchrun a scheduler that signals every
    process of the job (Slurm, Kubernetes) reaches each rank twice, directly and forwarded by torchrun, and
    a rank that gave up would leave the others waiting in a collective. A second SIGINT (Ctrl-C pressed
    again) gives up at once (KeyboardInterrupt), without a new checkpoint."""

    CODES = {"SIGINT": 130, "SIGTERM": 143}

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals only work there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def requested(self, ddp: bool) -> bool:
        """Whether any rank received a stop signal (an all-reduce under DDP, so all ranks agree)."""
        flag = self.received is not None
        if ddp:
            flag = any_rank(flag)
            self.received = self.received or ("SIGTERM" if flag else None)
        return flag

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: an all-reduce (every rank calls it), or ``flag`` itself without a
    process group. All ranks get the same answer, so they take the same branch after it."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([float(flag)], device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def distributed_from_env():
    """Initialise ``torch.distributed`` when launched by torchrun (``RANK`` set); tear it down cleanly."""
    if "RANK" not in os.environ or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield
    finally:
        import gc

        gc.collect()  # nothing that touched the process group (DDP model, optimizer) may outlive it
        dist.barrier()
        dist.destroy_process_group()
