"""What the device offers a training step: TF32 matmuls, and the peak the MFU is measured against.

**TF32.** `model_matmul_precision` picks ``"high"`` (TF32 tensor cores: float32 inputs rounded to a
10-bit mantissa, accumulation in float32) for the model's passes on CUDA, and `matmul_precision`
scopes it to them, so the optimizer's Gram-space solves keep IEEE float32 matmuls.

**MFU** (model FLOPs utilisation): the FLOPs a training step needs, over what the device could do.

Per token, a GPT with ``N`` parameters (position embeddings excluded: a lookup, not a matmul; the
token embedding counted, as the tied LM head) and ``L`` layers of width ``d`` over a context of
``T`` tokens costs

    flops_per_token = 6 N + 12 L d T

``6 N``: one multiply-add (2 FLOPs) per weight and token in the forward pass, twice that in the
backward pass; ``12 L d T``: attention's scores ``Q K^T`` and weighted values ``A V``, each
``2 T d`` FLOPs per token and layer forward, times 3 with the backward pass (PaLM, appendix B).
Then ``MFU = flops_per_token * tokens_per_s / (peak * devices)`` with ``peak`` the dense bf16
tensor-core rate of one device (`PEAK_BF16_FLOPS`; the usual reference even for float32 runs).
The optimizer's own work (Manifold Muon's solves) is not model FLOPs: it lowers the MFU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = [
    "PEAK_BF16_FLOPS",
    "flops_per_token",
    "matmul_precision",
    "mfu",
    "model_flops_per_token",
    "model_matmul_precision",
    "peak_bf16_flops",
    "peak_flops_of",
]

PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)
"""Dense bf16 peak FLOP/s by a part of the CUDA device name (datasheets), first match wins."""


def flops_per_token(n_params: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L d T`` (module docstring)."""
    return 6.0 * n_params + 12.0 * n_layer * n_embd * block_size


def model_flops_per_token(model: Any, block_size: int) -> float:
    """`flops_per_token` of a `geomtrain.model.GPT` trained on ``block_size``-token sequences."""
    cfg = model.config
    return flops_per_token(model.num_parameters(non_embedding=True), cfg.n_layer, cfg.n_embd, block_size)


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of the device called ``device_name`` (`PEAK_BF16_FLOPS`), None if not listed."""
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in device_name), None)


def peak_bf16_flops(device: Any) -> float | None:
    """`peak_flops_of` a CUDA device (a ``torch.device`` or its name); None for any other device."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, devices: int = 1) -> float | None:
    """``flops_per_token * tokens_per_s / (peak * devices)``; None when the peak is unknown (CPU)."""
    if peak is None or not peak > 0:
        return None
    return flops_per_token * tokens_per_s / (peak * devices)


def model_matmul_precision(device: torch.device, tf32: bool) -> str | None:
    """The float32 matmul precision of the model's passes: on CUDA ``"high"`` (TF32 tensor cores,
    10-bit mantissa) with ``tf32``, else ``"highest"`` (IEEE float32); None (unchanged) elsewhere."""
    if device.type != "cuda":
        return None
    return "high" if tf32 else "highest"


@contextlib.contextmanager
def matmul_precision(precision: str | None):
    """``torch.set_float32_matmul_precision(precision)`` inside the block, the previous one restored
    after it; None changes nothing."""
    if precision is None:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
