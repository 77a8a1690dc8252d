r"""Diagnostics that carry the paper's mechanism: spectra of weights and saturation of attention.

Per Muon-managed matrix ``W`` (tall form $T$; the Gram matrix $G = T^\top T$):

- ``sigma_max``, ``sigma_min``: extreme singular values;
- ``col_norm_min``, ``col_norm_max``, ``col_norm_cv``: constrained column norms and their
  coefficient of variation (std / mean), the scale freedom DGram adds;
- ``gram_offdiag``: $\|\operatorname{Off}(G)\|_F / \|G\|_F$ (0 when columns are orthogonal);
- ``manifold_distance``: max of `manifolds.GramManifold.constraint_violation` (0 on the manifold);
- ``grad_norm``: Frobenius norm of the gradient at the last step before the evaluation.

For ``c_attn`` (rows ``[0:C]`` = $W_Q$, ``[C:2C]`` = $W_K$, ``[2C:3C]`` = $W_V$) the Q and K blocks
get their own ``sigma_max`` and gradient norms, since attention logits are
$x W_Q^\top W_K x'^\top / \sqrt{d}$ per head. A parameter stored as a batch of matrices (``c_attn``
with ``split_qkv``: $[W_Q, W_K, W_V]$) is described as its stacked rows, the matrix the fused
layout would hold, so split and fused runs compare column by column; its ``manifold_distance`` is
the largest over the matrices of the batch, each of which is constrained.

Per attention layer, on a fixed validation batch (causal rows $p$ of the softmax):

- ``max_abs_logit``: $\max |z|$ over visible (unmasked) entries;
- ``mean_entropy``: mean of $-\sum_j p_j \log p_j$ over rows (nats);
- ``saturated_frac``: fraction of rows with $\max_j p_j > 0.99$;
- ``jacobian_norm``: mean over rows of $\|\operatorname{diag}(p) - p p^\top\|_F$, computed as
  $\sqrt{\sum p_j^2 - 2 \sum p_j^3 + (\sum p_j^2)^2}$: it tends to 0 as a row saturates, which
  is how large logits starve attention of gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from manifolds import Euclidean, to_tall

from ._io import to_jsonable

__all__ = [
    "matrix_stats",
    "softmax_row_stats",
    "attention_stats",
    "collect_diagnostics",
    "gradient_norms",
    "module_kind",
]


def module_kind(name: str) -> str:
    """``attn_in`` (c_attn), ``attn_out`` (attn.c_proj), ``mlp_in`` (c_fc), ``mlp_out`` (mlp.c_proj) or ``other``."""
    if ".attn.c_attn." in f".{name}":
        return "attn_in"
    if ".attn.c_proj." in f".{name}":
        return "attn_out"
    if ".mlp.c_fc." in f".{name}":
        return "mlp_in"
    if ".mlp.c_proj." in f".{name}":
        return "mlp_out"
    return "other"


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "h" and b.isdigit():
            return int(b)
    return None


@torch.no_grad()
def matrix_stats(W: torch.Tensor, manifold=None) -> dict[str, float]:
    """Spectral and Gram statistics of one weight matrix, or of a batch ``(k, m, n)`` as its stacked
    ``(k m, n)`` rows (see the module docstring)."""
    T = to_tall(W.detach().float().reshape(-1, W.shape[-1]))
    s = torch.linalg.svdvals(T)
    norms = T.norm(dim=-2)
    G = T.mT @ T
    off = G - torch.diag_embed(G.diagonal())
    out = {
        "sigma_max": float(s[0]),
        "sigma_min": float(s[-1]),
        "col_norm_min": float(norms.min()),
        "col_norm_max": float(norms.max()),
        "col_norm_cv": float(norms.std() / norms.mean()) if norms.numel() > 1 else 0.0,
        "gram_offdiag": float(off.norm() / G.norm().clamp_min(1e-30)),
    }
    if manifold is not None and not isinstance(manifold, Euclidean):
        out["manifold_distance"] = float(manifold.constraint_violation(to_tall(W.detach().float())).max())
    return out


@torch.no_grad()
def softmax_row_stats(logits: torch.Tensor, probs: torch.Tensor) -> dict[str, float]:
    """Saturation statistics of attention rows; masked entries are ``-inf`` logits / zero probs."""
    visible = torch.isfinite(logits)
    p = probs.double()
    entropy = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1)
    s2, s3 = (p * p).sum(-1), (p * p * p).sum(-1)
    jac = (s2 - 2 * s3 + s2 * s2).clamp_min(0).sqrt()
    return {
        "max_abs_logit": float(logits.abs().masked_fill(~visible, 0).amax()),
        "mean_entropy": float(entropy.mean()),
        "saturated_frac": float((p.amax(-1) > 0.99).double().mean()),
        "jacobian_norm": float(jac.mean()),
    }


@torch.no_grad()
def attention_stats(model, idx: torch.Tensor) -> list[dict[str, float]]:
    """`softmax_row_stats` per layer of a GPT on the batch ``idx`` (eval mode, restored after)."""
    was_training = model.training
    model.eval()
    try:
        probe = model.attention_probe(idx, on_layer=lambda i, logits, probs: softmax_row_stats(logits, probs))
    finally:
        model.train(was_training)
    return [{"layer": i, **st} for i, st in enumerate(probe.stats)]


def collect_diagnostics(
    model,
    assignments: Sequence,
    idx: torch.Tensor | None,
    grad_norms: Mapping[str, float] | None = None,
) -> dict:
    """Everything recorded at one evaluation: ``{"matrices": [...], "attention": [...]}``.

    ``matrices`` has one entry per Muon-managed matrix (plus ``q``/``k`` entries for each
    ``c_attn``) with ``name``, ``layer``, ``kind``, ``manifold`` and `matrix_stats`.
    """
    params = dict(model.named_parameters())
    grad_norms = grad_norms or {}
    rows = []
    for a in assignments:
        if a.optimizer != "muon":
            continue
        W = params[a.name]
        base = {"name": a.name, "layer": _layer_index(a.name), "manifold": a.manifold_name}
        rows.append(
            {**base, "kind": module_kind(a.name), **matrix_stats(W, a.manifold), "grad_norm": grad_norms.get(a.name)}
        )
        if module_kind(a.name) == "attn_in":
            W, C = W.reshape(-1, W.shape[-1]), W.shape[-1]  # the fused (3C, C) rows, split or not
            for part, block in (("q", W[:C]), ("k", W[C : 2 * C])):
                st = matrix_stats(block)
                rows.append(
                    {
                        **base,
                        "name": f"{a.name}[{part}]",
                        "kind": f"attn_{part}",
                        "sigma_max": st["sigma_max"],
                        "sigma_min": st["sigma_min"],
                        "grad_norm": grad_norms.get(f"{a.name}[{part}]"),
                    }
                )
    out = {"matrices": rows}
    if idx is not None:
        out["attention"] = attention_stats(model, idx)
    return to_jsonable(out)


def gradient_norms(model, assignments: Sequence) -> dict[str, float]:
    """Frobenius norms of the current gradients of Muon-managed matrices (and the Q/K blocks)."""
    params = dict(model.named_parameters())
    out = {}
    for a in assignments:
        g = params[a.name].grad
        if a.optimizer != "muon" or g is None:
            continue
        out[a.name] = float(g.norm())
        if module_kind(a.name) == "attn_in":
            g, C = g.reshape(-1, g.shape[-1]), g.shape[-1]
            out[f"{a.name}[q]"] = float(g[:C].norm())
            out[f"{a.name}[k]"] = float(g[C : 2 * C].norm())
    return out
