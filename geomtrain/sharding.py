"""FSDP2 sharding of the GPT.

- `shard_model`: ``fully_shard`` on each transformer block, then on the root (which keeps the tied
  ``wte``/``lm_head`` weight in one parameter). Each rank holds a ``Shard(0)`` slice of every
  parameter, gradients and optimizer state alike; the forward and backward all-gather the weights of
  a block and the backward reduce-scatters its gradients (averaged over the ranks).
- `full_copy`: a plain, unsharded copy of a sharded model (weights and gradients), for the
  diagnostics, which need whole matrices. A collective: every rank calls it.
- `shard_like`, `local`, `full`: a tensor laid out as a parameter, this rank's part, the whole.

A sharded run's checkpoint (DCP) is written and read by `geomtrain.checkpoint`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["shard_model", "is_sharded", "local", "full", "full_copy", "shard_like"]


def shard_model(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """``fully_shard`` each block of ``model.transformer.h``, then the root (in place; returns ``model``).
    ``mesh``: a 1-D device mesh over all ranks (default: on the model's device type)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if is_sharded(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective); a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


@torch.no_grad()
def full_copy(model: torch.nn.Module, make_model, grads: bool = False) -> torch.nn.Module:
    """A plain copy of ``model`` (``make_model()`` built on the meta device, then filled) with whole
    weights and, with ``grads``, whole gradients. All-gathers every parameter: call it on every rank."""
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = make_model()
    copy.to_empty(device=device)
    source = dict(model.named_parameters(remove_duplicate=False))
    gathered: dict[int, tuple] = {}  # by parameter: a tied weight is gathered once
    for name, q in copy.named_parameters(remove_duplicate=False):  # to_empty may untie: fill every name
        p = source[name]
        if id(p) not in gathered:
            gathered[id(p)] = (full(p.detach()), full(p.grad) if grads and p.grad is not None else None)
        weight, grad = gathered[id(p)]
        q.copy_(weight)
        q.grad = grad
    return copy


def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor, equal on every rank) laid out as ``param``: sharded as it is, when it is a
    DTensor of ``value``'s shape; else ``value`` itself."""
    from torch.distributed.tensor import distribute_tensor

    if is_sharded(param) and not is_sharded(value) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value
