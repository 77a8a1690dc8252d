r"""One line per slow manifold path, before training starts: `slow_path_notes`.

A manifold defined by ``project_gram`` alone takes the generic maps and solves (`manifolds.gram_solve`: conjugate
gradients on $n \times n$ Gram matrices): milliseconds per call at the ``mini`` model's $n = 128$ on a CPU, seconds
at GPT-2 small's $n = 768$. `geomtrain.train.train` times, once per custom mask, tall shape and solver, one
retraction (a Manifold Muon step of spectral norm 0.02 from the matrix's current weight) and one cold direction
(a Gaussian gradient) on the first matrix, and prints a note for each over `SLOW_SECONDS`: the matrix, why, and
what to override. Built-in masks (closed forms) are not timed, nor sharded (FSDP) parameters. The probe draws its
random numbers from its own generator: the run's random state is untouched.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence

import torch

from manifolds import MaskForm, to_tall

__all__ = ["SLOW_SECONDS", "slow_path_notes", "time_paths"]

SLOW_SECONDS = 1.0  # a path over this, per call, gets a note: it runs for every such matrix at every step


def _seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def time_paths(manifold, W: torch.Tensor, solver: str) -> tuple[float, float]:
    """``(retraction seconds, direction seconds)`` of one call each at the point ``W`` (the probe above)."""
    from .optim import spectral_direction

    gen = torch.Generator(device=W.device).manual_seed(0)
    G = torch.randn(W.shape, generator=gen, device=W.device, dtype=W.dtype)
    U = manifold.proju(W, G)
    step = -0.02 * U / torch.linalg.matrix_norm(U.double(), ord=2).clamp_min(1e-30).to(W.dtype)
    retr = _seconds(lambda: manifold.retr(W, step), W.device)
    direction = _seconds(lambda: spectral_direction(manifold, W, G, solver=solver), W.device)
    return retr, direction


def slow_path_notes(assignments: Sequence, params: Mapping[str, torch.Tensor], limit: float | None = None) -> list[str]:
    """The notes (module docstring) for the Muon matrices of ``assignments`` (`geomtrain.assign.Assignment`, their
    ``solver`` picked) whose manifold has a custom mask, ``params`` by name; ``limit``: `SLOW_SECONDS` if None."""
    from .optim import default_solver

    limit = SLOW_SECONDS if limit is None else limit
    groups: dict[tuple, list] = {}
    for a in assignments:
        if a.optimizer != "muon" or a.manifold is None or a.manifold.mask_form is not MaskForm.CUSTOM:
            continue
        p = params[a.name]
        if hasattr(p, "full_tensor"):  # an FSDP shard: the probe needs the whole matrix
            continue
        solver = a.solver or default_solver(a.manifold)
        key = (a.manifold.key(), tuple(to_tall(p).shape), solver)
        groups.setdefault(key, [a, p, solver, 0])[3] += 1
    notes = []
    for a, p, solver, count in groups.values():
        retr, direction = time_paths(a.manifold, p.detach(), solver)
        n = min(p.shape[-2:])
        slow = []
        if retr > limit:
            slow.append(f"a retraction {retr:.1f} s (override projx/retr in closed form: docs/custom-manifold.md)")
        if direction > limit:
            glob = re.sub(r"\.\d+\.", ".*.", a.name)  # every layer's matrix of this name
            fix = "override its solve_normal in closed form"
            fix = f"--solver-rule '{glob}=filled_split', products only" if solver != "filled_split" else fix
            slow.append(f"a direction ({solver}) {direction:.1f} s ({fix})")
        if slow:
            shape = "x".join(map(str, p.shape))
            notes.append(
                f"{a.name} ({shape}, {a.manifold_name}; {count} such matrices) is slow on this machine: "
                f"{' and '.join(slow)}, every step; its mask is project_gram alone, solved by conjugate gradients on "
                f"{n} x {n} Gram matrices"
            )
    return notes
