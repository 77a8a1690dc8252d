r"""The controlled demonstration: softmax saturation in one attention layer as $W_Q, W_K$ grow
(``geomtrain study toy``; notebook 03)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["DEFAULT_SCALES", "toy_attention", "toy_saturation", "write_toy"]

DEFAULT_SCALES = (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16)
_KEYS = (
    "scale",
    "max_abs_logit",
    "logit_std",
    "mean_entropy",
    "saturated_frac",
    "jacobian_norm",
    "grad_logits",
    "grad_wq",
    "grad_wk",
    "grad_wq_stable_rank",
    "grad_rows_90",
    "row_gap",
    "row_jacobian",
)


def toy_attention(
    scales: Sequence[float] = DEFAULT_SCALES, n_tokens: int = 64, d_model: int = 64, d_head: int = 16, seed: int = 0
) -> dict:
    r"""A single causal attention layer with $W_Q = s\,Q_0$, $W_K = s\,K_0$ ($Q_0, K_0$ with
    orthonormal rows, so $\sigma_{\max}(W_Q) = \sigma_{\max}(W_K) = s$) on LayerNorm-like inputs
    ($\|x_t\| = \sqrt{d_{\mathrm{model}}}$). For each $s$: the logits $Z = X W_Q^\top W_K X^\top /
    \sqrt{d_{\mathrm{head}}}$ (scale $s^2$), the mean row entropy, the fraction of rows with
    $\max p > 0.99$, the mean softmax Jacobian norm $\|\operatorname{diag}(p) - pp^\top\|_F$ and,
    for the loss $L = \langle P V, R \rangle$ with a fixed random $R$, the gradient norms
    $\|\partial L/\partial Z\|_F$ and $\|\partial L/\partial W_Q\|_F$ (autograd, float64).

    Degeneracy of the gradient: ``grad_wq_stable_rank`` $= \|G\|_F^2 / \|G\|_2^2$ of
    $G = \partial L/\partial W_Q$, and ``grad_rows_90``, the fraction of query rows that carry 90%
    of $\|\partial L/\partial Z\|_F^2$.

    Per row (rows 1.., row 0 sees a single key): ``row_gap`` (largest minus second largest
    logit) and ``row_jacobian``; a saturated row has $\|J\|_F \approx 2 e^{-\mathrm{gap}}$."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    X = torch.randn(n_tokens, d_model, generator=g, dtype=dt)
    X = (X - X.mean(-1, keepdim=True)) / X.std(-1, keepdim=True, unbiased=False)  # LayerNorm, unit gain
    Q0 = torch.linalg.qr(torch.randn(d_model, d_head, generator=g, dtype=dt))[0].T
    K0 = torch.linalg.qr(torch.randn(d_model, d_head, generator=g, dtype=dt))[0].T
    V = X @ torch.linalg.qr(torch.randn(d_model, d_head, generator=g, dtype=dt))[0]
    R = torch.randn(n_tokens, d_head, generator=g, dtype=dt)
    out = {k: [] for k in _KEYS}
    for s in scales:
        for k, v in _at_scale(float(s), X, Q0, K0, V, R).items():
            out[k].append(v)
    out.update(n_tokens=n_tokens, d_model=d_model, d_head=d_head, seed=seed)
    return out


def _at_scale(s: float, X, Q0, K0, V, R) -> dict:
    """Every quantity of :func:`toy_attention` at one scale ``s``."""
    import torch

    from ..diagnostics import softmax_row_stats

    n_tokens, d_head = X.shape[0], Q0.shape[0]
    causal = torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    Wq = (s * Q0).clone().requires_grad_(True)
    Wk = (s * K0).clone().requires_grad_(True)
    Z = (X @ Wq.T) @ (X @ Wk.T).T / math.sqrt(d_head)
    Z.retain_grad()
    Zm = Z.masked_fill(~causal, float("-inf"))
    P = torch.softmax(Zm, dim=-1)
    ((P @ V) * R).sum().backward()
    st = softmax_row_stats(Zm.detach(), P.detach())
    grad_z = Z.grad.masked_fill(~causal, 0)
    sv = torch.linalg.svdvals(Wq.grad)
    energy = (grad_z**2).sum(-1).sort(descending=True).values
    share = energy.cumsum(0) / energy.sum()
    # per row: the gap between the two largest visible logits and the row's Jacobian norm
    p = P.detach()
    top2 = Zm.detach()[1:].topk(2, dim=-1).values  # row 0 sees one key only
    s2, s3 = (p[1:] ** 2).sum(-1), (p[1:] ** 3).sum(-1)
    return {
        "scale": s,
        "max_abs_logit": st["max_abs_logit"],
        "logit_std": float(Z.detach()[causal].std()),
        "mean_entropy": st["mean_entropy"],
        "saturated_frac": st["saturated_frac"],
        "jacobian_norm": st["jacobian_norm"],
        "grad_logits": float(grad_z.norm()),
        "grad_wq": float(Wq.grad.norm()),
        "grad_wk": float(Wk.grad.norm()),
        "grad_wq_stable_rank": float((sv**2).sum() / sv[0] ** 2),
        "grad_rows_90": float((int((share < 0.9).sum()) + 1) / n_tokens),
        "row_gap": [float(v) for v in (top2[:, 0] - top2[:, 1])],
        "row_jacobian": [float(v) for v in (s2 - 2 * s3 + s2 * s2).clamp_min(0).sqrt()],
    }


def write_toy(result: dict, out: str | Path, command: str) -> list[Path]:
    """``toy.json`` (``result`` to 5 significant digits, the per-row lists to 4; one line) and
    ``toy_saturation.png`` into ``out``."""
    from .._io import atomic_write_json
    from . import figures
    from .collect import round_sig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    per_row = ("row_gap", "row_jacobian")
    record = {
        "command": command,
        **{k: round_sig(v, 5) if isinstance(v, list) and k not in per_row else v for k, v in result.items()},
        **{k: [round_sig(r, 4) for r in result[k]] for k in per_row},
    }
    atomic_write_json(out / "toy.json", record, compact=True)
    figures.save(toy_saturation(result), out / "toy_saturation.png")
    return [out / "toy.json", out / "toy_saturation.png"]


def toy_saturation(result: dict):
    """The controlled demonstration (:func:`geomtrain.study.toy.toy_attention`): one attention layer
    with $W_Q, W_K$ scaled by $s$; logits, entropy, softmax Jacobian and gradients against $s$,
    and (last panel) every row's Jacobian norm against its top-two logit gap."""
    from matplotlib.figure import Figure

    from .figures import add_legend

    s = np.asarray(result["scale"], dtype=float)
    fig = Figure(figsize=(16, 4.2), layout="constrained")
    a1, a2, a3, a4 = fig.subplots(1, 4)
    a1.plot(s, result["max_abs_logit"], "o-", label="max |logit|")
    a1.plot(s, result["logit_std"], "s-", label="std of logits")
    a1.plot(s, result["logit_std"][0] * (s / s[0]) ** 2, "k:", lw=1, label=r"$\propto s^2$")
    a1.set(
        xscale="log",
        yscale="log",
        xlabel=r"scale $s$ of $W_Q$ and $W_K$ ($\sigma_{\max} = s$)",
        title=r"logits grow as $s^2$",
    )
    add_legend(a1, fontsize=8)
    a2.plot(s, result["mean_entropy"], "o-", label="mean row entropy (nats)")
    a2.plot(s, result["saturated_frac"], "s-", label="rows with max p > 0.99")
    a2.set(xscale="log", xlabel=r"scale $s$", title="entropy collapses, rows saturate")
    add_legend(a2, fontsize=8)
    a3.plot(s, result["jacobian_norm"], "o-", label=r"softmax Jacobian $\|\mathrm{diag}(p) - pp^\top\|_F$ (row mean)")
    a3.plot(
        s,
        np.asarray(result["grad_logits"]) / max(result["grad_logits"]),
        "^-",
        label=r"$\|\partial L / \partial Z\|_F$ (relative to its max)",
    )
    gq = np.asarray(result["grad_wq"])
    a3.plot(s, gq / gq.max(), "s-", label=r"$\|\partial L / \partial W_Q\|_F$ (relative)")
    rel = gq / s  # |W_Q|_F = s * sqrt(d_head)
    a3.plot(s, rel / rel.max(), "d-", label=r"$\|\partial L / \partial W_Q\|_F / \|W_Q\|_F$ (relative)")
    if result.get("grad_rows_90"):
        a3.plot(
            s,
            result["grad_rows_90"],
            "x--",
            color="0.3",
            label=r"fraction of rows carrying 90% of $\|\partial L / \partial Z\|^2$",
        )
    a3.set(xscale="log", yscale="log", xlabel=r"scale $s$", title="softmax Jacobian and gradients")
    add_legend(a3, fontsize=7)
    _row_panel(a4, result, s)
    fig.suptitle(
        f"one causal attention layer, T={result['n_tokens']}, d_model={result['d_model']}, d_head={result['d_head']}"
    )
    return fig


def _row_panel(ax, result: dict, s) -> None:
    """Every row's softmax Jacobian norm against its top-two logit gap, one colour per scale."""
    import matplotlib

    from .figures import add_legend, mark_empty

    if result.get("row_gap"):
        cmap = matplotlib.colormaps["viridis"]
        for i, (gaps, jac) in enumerate(zip(result["row_gap"], result["row_jacobian"])):
            gaps, jac = np.asarray(gaps), np.asarray(jac)
            keep = jac > 1e-7  # |J|^2 is formed in float64: below ~1e-8 rounding hides |J|
            ax.scatter(
                gaps[keep],
                jac[keep],
                s=6,
                color=cmap(i / max(1, len(s) - 1)),
                label=f"s={s[i]:g}" if i in (0, len(s) - 1) else None,
            )
        g = np.linspace(0, 20, 200)
        ax.plot(g, 2 * np.exp(-g), "k--", lw=1, label=r"$2e^{-\mathrm{gap}}$")
        ax.set(
            yscale="log",
            xlim=(0, 20),
            ylim=(1e-8, 2),
            xlabel="gap between the two largest logits of a row",
            ylabel=r"$\|J\|_F$ of the row",
            title="per row: exponential in the gap",
        )
        add_legend(ax, fontsize=8)
    else:
        mark_empty(ax)
