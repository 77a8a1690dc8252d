r"""Numerical kernels of the direction solvers on ``(B, n, n)`` tensors, knowing nothing of manifolds: symmetric parts,
normalisation, a guarded symmetric eigendecomposition, Anderson mixing, batched host reads, CG and the trace."""

from __future__ import annotations

import torch

__all__ = [
    "sym",
    "frob",
    "normalise",
    "spectral_norm_estimate",
    "eigh_dtype",
    "symmetric_eigen",
    "eigh_psd",
    "eigvalsh_psd",
    "Anderson",
    "WorkingSet",
    "start_safeguard",
    "safeguarded_mix",
    "host_values",
    "pcg",
    "Trace",
    "first_objective",
]


def sym(X: torch.Tensor) -> torch.Tensor:
    r"""$\tfrac12 (X + X^\top)$ on the last two dims."""
    return 0.5 * (X + X.mT)


def frob(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched Frobenius inner product over the last two dims, shape ``(..., 1, 1)``."""
    return (a * b).sum(dim=(-2, -1), keepdim=True)


def normalise(G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""$G / \|G\|_F$ per matrix (robust to tiny and huge scales) and the mask of zero matrices."""
    amax = G.abs().amax(dim=(-2, -1), keepdim=True)
    zero = amax == 0
    Gs = G / torch.where(zero, torch.ones_like(amax), amax)
    nrm = Gs.norm(dim=(-2, -1), keepdim=True)
    return Gs / torch.where(zero, torch.ones_like(nrm), nrm), zero


def spectral_norm_estimate(X: torch.Tensor, iters: int) -> torch.Tensor:
    r"""A lower bound on $\|X\|_{\mathrm{op}}$ per matrix: the larger of $\|X\|_F / \sqrt{\min(m, n)}$ and $\|Xv\|$
    after ``iters`` power iterations from the normalised column norms (all-ones misses row-centred matrices)."""
    tiny = torch.finfo(X.dtype).tiny
    v = X.norm(dim=-2).unsqueeze(-1)
    v = v / v.norm(dim=-2, keepdim=True).clamp_min(tiny)
    for _ in range(iters):
        v = X.mT @ (X @ v)
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(tiny)
    return torch.maximum((X @ v).norm(dim=(-2, -1)), X.norm(dim=(-2, -1)) / min(X.shape[-2:]) ** 0.5)


def eigh_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    r"""The dtype of a symmetric eigendecomposition: float64 for float32 on CUDA (latency-bound there, and cuSOLVER's
    float32 eigenpairs are too inaccurate for the solvers' rounding floor), else ``dtype``."""
    if device.type == "cuda" and dtype == torch.float32:
        return torch.float64
    return dtype


def symmetric_eigen(decompose, M: torch.Tensor):
    """``decompose`` (``torch.linalg.eigh`` or ``eigvalsh``) of symmetric matrices in `eigh_dtype`, returned in
    ``M.dtype``; a float32 batch that fails (LAPACK error or non-finite output) is redone in float64."""
    work = eigh_dtype(M.device, M.dtype)

    def back(out):  # eigh returns (eigenvalues, eigenvectors), eigvalsh a tensor: in M's dtype either way
        return tuple(t.to(M.dtype) for t in out) if isinstance(out, tuple) else out.to(M.dtype)

    try:
        out = decompose(M.to(work))
        parts = out if isinstance(out, tuple) else (out,)
        if work == torch.float64 or bool(torch.stack([torch.isfinite(t).all() for t in parts]).all()):
            return back(out)
    except torch.linalg.LinAlgError:
        if work == torch.float64:
            raise
    return back(decompose(M.double()))


def eigh_psd(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a batch of symmetric matrices (`symmetric_eigen`)."""
    return symmetric_eigen(torch.linalg.eigh, M)


def eigvalsh_psd(M: torch.Tensor) -> torch.Tensor:
    """Eigenvalues only (ascending) of a batch of symmetric matrices (`symmetric_eigen`)."""
    return symmetric_eigen(torch.linalg.eigvalsh, M)


class Anderson:
    """Type-II Anderson mixing of the fixed point x -> x + f(x), one history per batch entry: the last ``depth``
    differences of iterates and steps in a ring buffer (order does not matter to the fit), fitted in float64."""

    def __init__(self, depth: int, like: torch.Tensor):
        self.depth = depth
        B, N = like.shape[0], like.shape[1:].numel()  # B = 0 allowed (a batch with nothing left to solve)
        kw = {"dtype": like.dtype, "device": like.device}
        self.dX = torch.zeros(B, max(depth, 1), N, **kw)
        self.dF = torch.zeros(B, max(depth, 1), N, **kw)
        self.count = torch.zeros(B, dtype=torch.long, device=like.device)  # differences stored so far
        self.prev_x = torch.zeros(B, N, **kw)
        self.prev_f = torch.zeros(B, N, **kw)
        self.has_prev = torch.zeros(B, dtype=torch.bool, device=like.device)

    def reset(self, idx: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Forget the history of entries ``idx`` (where ``where`` is True, if given: no synchronisation)."""
        if where is None:
            self.count[idx] = 0
            self.has_prev[idx] = False
        else:
            self.count[idx] = torch.where(where, torch.zeros_like(self.count[idx]), self.count[idx])
            self.has_prev[idx] = self.has_prev[idx] & ~where

    @property
    def every(self) -> torch.Tensor:
        """The index of every entry (for callers that keep their batch compact)."""
        return torch.arange(self.count.shape[0], device=self.count.device)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the histories of entries ``keep`` (positions), renumbered ``0..len(keep)-1``."""
        for name in ("dX", "dF", "count", "prev_x", "prev_f", "has_prev"):
            setattr(self, name, getattr(self, name)[keep])

    def mix(self, idx: torch.Tensor, X: torch.Tensor, F: torch.Tensor) -> torch.Tensor:
        """Next iterate for entries ``idx`` (an integer index) at points X with plain steps F (shapes (len(idx), ...)).
        No host synchronisation: an entry without history gets the plain step $X + F$ (zero weights)."""
        if self.depth == 0:
            return X + F
        b = len(idx)
        x, f = X.reshape(b, -1).to(self.dX.dtype), F.reshape(b, -1).to(self.dX.dtype)
        hp = self.has_prev[idx]
        pos = self.count[idx] % self.depth
        keep = hp.unsqueeze(-1)
        self.dX[idx, pos] = torch.where(keep, x - self.prev_x[idx], self.dX[idx, pos])
        self.dF[idx, pos] = torch.where(keep, f - self.prev_f[idx], self.dF[idx, pos])
        self.count[idx] += hp.long()
        self.prev_x[idx], self.prev_f[idx], self.has_prev[idx] = x, f, True
        k = self.count[idx].clamp(max=self.depth)
        # Products with the whole history, then the rows of idx (never copied); an unfilled slot gets weight 0
        valid = (torch.arange(self.depth, device=k.device)[None, :] < k[:, None]).double()
        Gm = (self.dF @ self.dF.mT)[idx].double() * (valid[:, :, None] * valid[:, None, :])
        reg = 1e-10 * Gm.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True) + 1e-300
        Gm = Gm + torch.diag_embed(valid * reg + (1 - valid))
        rhs = torch.linalg.vecdot(self.dF, self.prev_f.unsqueeze(1))[idx].double() * valid  # 4x a bmm's speed (CPU)
        w = torch.linalg.solve_ex(Gm, rhs)[0]  # solve_ex: no error check, which would synchronise
        w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
        g = torch.zeros(self.dX.shape[0], 1, self.depth, dtype=self.dX.dtype, device=self.dX.device)
        g[idx] = w.to(g.dtype).unsqueeze(1)
        out = x + f - (g @ self.dX + g @ self.dF).squeeze(1)[idx]
        return out.reshape(X.shape).to(X.dtype)


class WorkingSet:
    """The entries of a batch still iterating, their state compact: ``idx`` their positions in the batch, ``state``
    tensors over them, ``out`` the full-batch tensors of the same names. `shrink` is the one host synchronisation."""

    def __init__(self, idx: torch.Tensor, state: dict[str, torch.Tensor], out: dict[str, torch.Tensor]):
        self.idx, self.state, self.out = idx, state, out

    def __len__(self) -> int:
        return self.idx.numel()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self.state[name] = value

    def flush(self) -> None:
        """Write every entry's state to ``out``."""
        for name, value in self.state.items():
            if name in self.out:
                self.out[name][self.idx] = value.to(self.out[name].dtype)

    def shrink(self, go: torch.Tensor) -> torch.Tensor | None:
        """Keep the entries where ``go``: their positions in the working set (for the caller's own per-entry objects),
        or None when every entry goes on. The leavers' state goes to ``out``."""
        keep = go.nonzero().squeeze(-1)
        if keep.numel() == len(self):
            return None
        self.flush()
        self.idx = self.idx[keep]
        self.state = {name: value[keep] for name, value in self.state.items()}
        return keep


def start_safeguard(ws: WorkingSet, X: torch.Tensor) -> None:
    """The per-entry state of `safeguarded_mix` at the start point ``X`` (compact, like ``ws``): ``X`` the anchor."""
    ws["anchor_x"], ws["anchor_F"] = X, torch.zeros_like(X)
    ws["best_f"] = torch.full((X.shape[0],), float("inf"), dtype=X.dtype, device=X.device)
    ws["from_anchor"] = torch.zeros(X.shape[0], dtype=torch.bool, device=X.device)


def safeguarded_mix(
    mixer: Anderson, ws: WorkingSet, X: torch.Tensor, F: torch.Tensor, fn: torch.Tensor, relax: float
) -> torch.Tensor:
    r"""The next iterate of $X \to X + \lambda F$ (``relax`` $= \lambda$), per entry of ``ws``: the mixed step where
    ``fn`` $= \|F\|$ is at most the best so far or the point is the plain step from the anchor (it becomes the
    anchor), else the plain step from the anchor with the history reset."""
    ok = (fn <= ws["best_f"]) | ws["from_anchor"]
    okm = ok.view(-1, *([1] * (X.dim() - 1)))
    ws["best_f"] = torch.where(ok, fn, ws["best_f"])
    ws["anchor_x"] = torch.where(okm, X, ws["anchor_x"])
    ws["anchor_F"] = torch.where(okm, F, ws["anchor_F"])
    mixed = mixer.mix(mixer.every, X, relax * F)
    mixer.reset(mixer.every, where=~ok)
    ws["from_anchor"] = ~ok
    return torch.where(okm, mixed, ws["anchor_x"] + relax * ws["anchor_F"])


def host_values(scalars: list[torch.Tensor]) -> list:
    """Python numbers of a list of 0-dim tensors, read with one host transfer per device and dtype; bools for bool
    tensors."""
    out: list = [None] * len(scalars)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(scalars):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for where in groups.values():
        for i, value in zip(where, torch.stack([scalars[i] for i in where]).tolist()):
            out[i] = value
    return out


class HostRead:
    """Scalars read to the host together, by name: `add` collects 0-dim tensors under a key, `read` returns
    ``{key: number}`` (`host_values`)."""

    def __init__(self) -> None:
        self._keys: list = []
        self._values: list[torch.Tensor] = []

    def add(self, key, value: torch.Tensor) -> None:
        self._keys.append(key)
        self._values.append(value)

    def read(self) -> dict:
        return dict(zip(self._keys, host_values(self._values)))


def pcg(op, b: torch.Tensor, pre, iters: int, rtol: float) -> torch.Tensor:
    """Batched preconditioned CG for an SPD operator on (B, n, n) tensors; per-entry stopping."""
    x = torch.zeros_like(b)
    r = b.clone()
    bnorm = frob(b, b).sqrt()
    done = bnorm == 0
    z = pre(r)
    p = z.clone()
    rz = frob(r, z)
    for _ in range(iters):
        Ap = op(p)
        pAp = frob(p, Ap)
        ok = (~done) & (pAp > 0) & (rz > 0)
        if not bool(ok.any()):
            break
        alpha = torch.where(ok, rz / torch.where(ok, pAp, torch.ones_like(pAp)), torch.zeros_like(pAp))
        x = x + alpha * p
        r = r - alpha * Ap
        done = done | ~ok | (frob(r, r).sqrt() <= rtol * bnorm)
        if bool(done.all()):
            break
        z = pre(r)
        rz_new = frob(r, z)
        beta = torch.where(ok & (rz > 0), rz_new / torch.where(rz > 0, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p = z + beta * p
        rz = rz_new
    return x


class Trace:
    """Per-evaluation history of the first matrix of a batch (option ``trace=True``)."""

    def __init__(self):
        self.residual, self.objective, self.dual_bound = [], [], []

    def add(self, residual, objective, dual_bound=None) -> None:
        self.residual.append(float(residual))
        self.objective.append(float(objective))
        self.dual_bound.append(None if dual_bound is None else float(dual_bound))

    def as_dict(self) -> dict:
        return {"residual": self.residual, "objective": self.objective, "dual_bound": self.dual_bound}


def first_objective(G: torch.Tensor, A: torch.Tensor) -> float:
    r"""$\langle G/\|G\|_F, A\rangle$ of the first matrix of a batch (for traces)."""
    G0, A0 = G[0].double(), A[0].double()
    nrm = float(G0.norm())
    return float((G0 * A0).sum()) / nrm if nrm > 0 else 0.0
