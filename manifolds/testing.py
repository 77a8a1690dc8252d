r"""Contract kit: Hypothesis strategies and property checks for any `GramManifold`.

A researcher who subclasses `GramManifold` gets every invariant checked with
one call::

    from manifolds.testing import check_manifold
    check_manifold(MyManifold())          # raises AssertionError naming the violated property

or, inside pytest, one test per property::

    @pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
    def test_contract(prop):
        run_property(prop, MyManifold())

Each property draws a case (shape, dtype, seed) with Hypothesis, builds a point with
``manifold.random`` and tangent vectors with ``proju``, and asserts one identity.

**Tolerances** (`TOLERANCE`): float64 ``1e-9``, float32 ``2e-4``, relative to the scale
of the quantities compared (``max(1, |x|)``). Justification: every property composes at most a
few Gram products, one thin SVD or one conjugate-gradient solve (to a relative residual of
$10^{-6}$ in float32, $10^{-12}$ in float64: `manifolds.gram_solve.CG_RTOL`) on matrices with
$n \le 16$ columns whose condition number stays below $e^{3} \approx 20$ (column norms are drawn
log-normal), so the rounding error is about $n \kappa\, \varepsilon$: $16 \cdot 20 \cdot 2.2\times10^{-16}
\approx 7\times10^{-14}$ in float64 and $16 \cdot 20 \cdot 1.2\times10^{-7} \approx
4\times10^{-5}$ in float32; the tolerances leave a margin of about $10^4$ and $5$. A real bug
(a wrong projection, a retraction that moves points) produces errors of order $10^{-2}$ to $1$.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .base import GramManifold, to_tall

__all__ = [
    "TOLERANCE",
    "DEFAULT_SHAPES",
    "DEFAULT_DTYPES",
    "DEFAULT_SCALES",
    "Case",
    "cases",
    "PROPERTIES",
    "run_property",
    "check_manifold",
    "register_fact",
]

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4}
DEFAULT_SHAPES: tuple[tuple[int, ...], ...] = ((8, 4), (4, 8), (6, 6), (2, 7, 3), (16, 5))
DEFAULT_DTYPES = (torch.float64, torch.float32)
# Entry scales (standard deviations) of the inputs projx must bring onto the manifold: 0.02 is GPT-2's
# initialisation, the others span six decades around the manifold's own scale.
DEFAULT_SCALES = (1e-3, 0.02, 0.1, 1.0, 3.0, 1e3)


class Case:
    """One drawn example: a point ``x``, two tangent vectors ``u`` and ``v``, an ambient matrix ``z``, a ``lam``,
    and a ``scale`` for inputs that need not be near the manifold.

    The tensors are drawn on first use (all at once, so the draws depend on the seed only): a property that
    needs none of them, as the mask check, runs even where ``random`` or ``projx`` would fail.
    """

    def __init__(self, manifold: GramManifold, shape: Sequence[int], dtype: torch.dtype, seed: int, scale=1.0):
        self.manifold, self.shape, self.dtype, self.seed, self.scale = manifold, tuple(shape), dtype, seed, scale
        self.tol = TOLERANCE[dtype]

    @functools.cached_property
    def _draws(self) -> dict[str, torch.Tensor]:
        manifold, shape, dtype = self.manifold, self.shape, self.dtype
        g = torch.Generator().manual_seed(self.seed)
        # Build in float64 and cast: a float32 point is then on the manifold to float32 rounding.
        x = manifold.random(*shape, dtype=torch.float64, generator=g).to(dtype)
        if dtype != torch.float64:
            x = manifold.projx(x)
        randn = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g).to(dtype)  # noqa: E731
        z = randn(*shape)
        u = manifold.proju(x, randn(*shape))
        v = manifold.proju(x, randn(*shape))
        k = min(shape[-2], shape[-1])
        return {"x": x, "z": z, "u": u, "v": v, "lam": randn(*shape[:-2], k, k)}

    x = property(lambda self: self._draws["x"])
    z = property(lambda self: self._draws["z"])
    u = property(lambda self: self._draws["u"])
    v = property(lambda self: self._draws["v"])
    lam = property(lambda self: self._draws["lam"])

    def __repr__(self) -> str:
        return (
            f"Case({type(self.manifold).__name__}, shape={self.shape}, dtype={self.dtype}, seed={self.seed}, "
            f"scale={self.scale:g})"
        )


def cases(
    manifold: GramManifold, shapes=DEFAULT_SHAPES, dtypes=DEFAULT_DTYPES, scales=DEFAULT_SCALES
) -> st.SearchStrategy:
    """Hypothesis strategy of `Case` for ``manifold`` over the given shapes, dtypes and input scales."""
    return st.builds(
        Case,
        st.just(manifold),
        st.sampled_from(list(shapes)),
        st.sampled_from(list(dtypes)),
        st.integers(min_value=0, max_value=2**31 - 1),
        st.sampled_from(list(scales)),
    )


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str, case: Case) -> None:
    scale = max(1.0, float(a.abs().max()), float(b.abs().max()))
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x scale {scale:.3g} for {case}"


def _small(a: torch.Tensor, tol: float, scale: float, what: str, case: Case) -> None:
    err = float(a.abs().max()) if a.numel() else 0.0
    assert err <= tol * max(1.0, scale), f"{what}: {err:.3g} > {tol:g} x {max(1.0, scale):.3g} for {case}"


def _on_manifold(M: GramManifold, y: torch.Tensor, case: Case, what: str) -> None:
    ok, reason = M.check_point_on_manifold(y, explain=True, atol=case.tol)
    assert ok, f"{what}: not on the manifold ({reason}) for {case}"


def _fro(a: torch.Tensor) -> float:
    return float(a.norm())


# ----------------------------------------------------------------------------- properties
def project_gram_is_an_entrywise_mask(case: Case) -> None:
    """project_gram multiplies by a symmetric 0/1 mask (`GramManifold.check_mask`): what every solve assumes."""
    try:
        case.manifold.check_mask(min(case.shape[-2:]))
    except ValueError as err:
        raise AssertionError(f"{err} for {case}") from None


def projx_lands_on_manifold(case: Case) -> None:
    """projx of a Gaussian matrix with entries of standard deviation ``case.scale`` (1e-3 to 1e3, in the case's
    dtype) is on the manifold: the weights a model starts from, at any scale, can be projected."""
    M = case.manifold
    _on_manifold(M, M.projx(case.scale * case.z), case, f"projx(X) at scale {case.scale:g}")


def projx_is_idempotent(case: Case) -> None:
    """projx(projx(X)) = projx(X)."""
    M = case.manifold
    y = M.projx(case.x + 0.3 * case.z / max(1.0, _fro(case.z)) * _fro(case.x))
    _close(M.projx(y), y, case.tol, "projx(projx(X)) - projx(X)", case)


def projx_fixes_points(case: Case) -> None:
    """A point already on the manifold is returned unchanged by projx."""
    _close(case.manifold.projx(case.x), case.x, case.tol, "projx(W) - W", case)


def retr_at_zero_is_identity(case: Case) -> None:
    """retr(W, 0) = W bitwise (not to rounding: an optimizer step of zero must not move a weight)."""
    y = case.manifold.retr(case.x, torch.zeros_like(case.x))
    assert torch.equal(y, case.x), f"retr(W, 0) - W: max {float((y - case.x).abs().max()):.3g}, not 0, for {case}"


def retr_lands_on_manifold(case: Case) -> None:
    """retr(W, U) is on the manifold for a tangent step of 30% of |W|."""
    M = case.manifold
    step = case.u * (0.3 * _fro(case.x) / max(_fro(case.u), 1e-30))
    _on_manifold(M, M.retr(case.x, step), case, "retr(W, U)")


def retr_is_first_order(case: Case) -> None:
    r"""$|R(W + tU) - (W + tU)| = O(t^2)$: halving $t$ divides the error by ~4 (at most 3.3)."""
    M = case.manifold
    u = case.u * (_fro(case.x) / max(_fro(case.u), 1e-30))
    t = 0.02 if case.dtype == torch.float64 else 0.05

    def err(s: float) -> float:
        return _fro(M.retr(case.x, s * u) - (case.x + s * u))

    floor = 100 * torch.finfo(case.dtype).eps * max(1.0, _fro(case.x))
    e1, e2 = err(t), err(t / 2)
    assert e2 <= 0.3 * e1 + floor, f"retraction not first order: err(t)={e1:.3g}, err(t/2)={e2:.3g} for {case}"
    assert e1 <= 50 * t**2 * _fro(case.x) + floor, f"retraction error {e1:.3g} too large at t={t} for {case}"


def proju_is_tangent(case: Case) -> None:
    """L_W(proju(W, Z)) = 0."""
    M = case.manifold
    p = M.proju(case.x, case.z)
    _small(M.tangent_constraint(case.x, p), case.tol, _fro(case.x) * _fro(case.z), "L(proju(Z))", case)


def proju_is_idempotent(case: Case) -> None:
    """proju(proju(Z)) = proju(Z)."""
    M = case.manifold
    p = M.proju(case.x, case.z)
    _close(M.proju(case.x, p), p, case.tol, "proju(proju(Z)) - proju(Z)", case)


def proju_is_orthogonal(case: Case) -> None:
    """Z - proju(Z) is orthogonal to every tangent vector V, and proju kills normal vectors L*(Lam)."""
    M = case.manifold
    residual = case.z - M.proju(case.x, case.z)
    dot = float(M.inner(case.x, residual, case.v).abs().max())
    _small(torch.tensor(dot), case.tol, _fro(residual) * _fro(case.v), "<Z - proju(Z), V>", case)
    normal = M.tangent_constraint_adjoint(case.x, case.lam)
    _small(M.proju(case.x, normal), case.tol, _fro(normal), "proju(L*(Lam))", case)


def egrad2rgrad_is_tangent(case: Case) -> None:
    """The Riemannian gradient is a tangent vector."""
    M = case.manifold
    r = M.egrad2rgrad(case.x, case.z)
    _small(M.tangent_constraint(case.x, r), case.tol, _fro(case.x) * _fro(case.z), "L(egrad2rgrad(Z))", case)


def constraint_maps_are_adjoint(case: Case) -> None:
    """<L_W(A), Lam> = <A, L_W^*(Lam)> for any A and any (not necessarily symmetric) Lam."""
    M = case.manifold
    lhs = (M.tangent_constraint(case.x, case.z) * case.lam).sum()
    rhs = (case.z * M.tangent_constraint_adjoint(case.x, case.lam)).sum()
    scale = _fro(case.x) * _fro(case.z) * _fro(case.lam)
    _small(lhs - rhs, case.tol, scale, "<L(A), Lam> - <A, L*(Lam)>", case)


def tangent_space_is_kernel(case: Case) -> None:
    """A is tangent iff L_W(A) = 0: kernel vectors are fixed by proju, and tangent vectors pass the check."""
    M = case.manifold
    _close(M.proju(case.x, case.u), case.u, case.tol, "proju(U) - U for U in ker L", case)
    ok, reason = M.check_vector_on_tangent(case.x, case.u, explain=True, atol=case.tol)
    assert ok, f"check_vector_on_tangent rejects a kernel vector ({reason}) for {case}"


def proju_matches_generic_solve(case: Case) -> None:
    """A closed-form proju equals the base class's generic solve of P(GS + SG) = L(U) (conjugate gradients)."""
    M = case.manifold
    generic = GramManifold.proju(M, case.x, case.z)
    _close(M.proju(case.x, case.z), generic, case.tol, "closed-form vs generic proju", case)


def transp_is_tangent_at_target(case: Case) -> None:
    """transp(x, y, v) lies in the tangent space at y = retr(x, u)."""
    M = case.manifold
    y = M.retr(case.x, 0.1 * case.u)
    w = M.transp(case.x, y, case.v)
    _small(M.tangent_constraint(y, w), case.tol, _fro(y) * _fro(w), "L_y(transp(v))", case)


def manifold_specific_facts(case: Case) -> None:
    """Facts registered for the manifold's class (Stiefel: sigma = 1; DGram: sigma = column norms; ...)."""
    for cls, fact in _FACTS:
        if isinstance(case.manifold, cls):
            fact(case)


PROPERTIES: tuple[Callable[[Case], None], ...] = (
    project_gram_is_an_entrywise_mask,
    projx_lands_on_manifold,
    projx_is_idempotent,
    projx_fixes_points,
    retr_at_zero_is_identity,
    retr_lands_on_manifold,
    retr_is_first_order,
    proju_is_tangent,
    proju_is_idempotent,
    proju_is_orthogonal,
    egrad2rgrad_is_tangent,
    constraint_maps_are_adjoint,
    tangent_space_is_kernel,
    proju_matches_generic_solve,
    transp_is_tangent_at_target,
    manifold_specific_facts,
)

# ----------------------------------------------------------------------------- facts per class
_FACTS: list[tuple[type, Callable[[Case], None]]] = []


def register_fact(cls: type) -> Callable:
    """Decorator: register ``fact(case)`` to run for every manifold that is an instance of ``cls``."""

    def deco(fn: Callable[[Case], None]) -> Callable[[Case], None]:
        _FACTS.append((cls, fn))
        return fn

    return deco


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


def _register_builtin_facts() -> None:
    from .dgram import DGram
    from .euclidean import Euclidean
    from .oblique import Oblique
    from .stiefel import Stiefel

    @register_fact(Stiefel)
    def stiefel_singular_values_are_one(case: Case) -> None:
        s = _singular_values(case.x)
        _close(s, torch.ones_like(s), case.tol, "Stiefel singular values - 1", case)

    @register_fact(DGram)
    def dgram_singular_values_are_column_norms(case: Case) -> None:
        s = _singular_values(case.x)
        norms = to_tall(case.x).double().norm(dim=-2).sort(dim=-1, descending=True).values
        _close(s, norms, case.tol, "DGram singular values - column norms", case)

    @register_fact(Oblique)
    def oblique_columns_are_unit(case: Case) -> None:
        norms = to_tall(case.x).norm(dim=-2)
        _close(norms, torch.ones_like(norms), case.tol, "Oblique column norms - 1", case)

    @register_fact(Euclidean)
    def euclidean_maps_are_identity(case: Case) -> None:
        M = case.manifold
        assert torch.equal(M.proju(case.x, case.z), case.z), f"Euclidean proju is not the identity for {case}"
        assert torch.equal(M.projx(case.z), case.z), f"Euclidean projx is not the identity for {case}"
        assert torch.equal(M.retr(case.x, case.z), case.x + case.z), f"Euclidean retr is not x + u for {case}"


_register_builtin_facts()


# ----------------------------------------------------------------------------- runners
def run_property(
    prop: Callable[[Case], None],
    manifold: GramManifold,
    shapes: Iterable[Sequence[int]] = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
    max_examples: int | None = None,
    scales: Iterable[float] = DEFAULT_SCALES,
) -> None:
    """Run one property under Hypothesis (the active settings profile unless ``max_examples``)."""
    test = given(case=cases(manifold, tuple(shapes), tuple(dtypes), tuple(scales)))(lambda case: prop(case))
    if max_examples is not None:
        test = settings(max_examples=max_examples)(test)
    test()


def check_manifold(
    manifold: GramManifold,
    shapes: Iterable[Sequence[int]] = DEFAULT_SHAPES,
    dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
    max_examples: int | None = 50,
    properties: Iterable[Callable[[Case], None]] = PROPERTIES,
    scales: Iterable[float] = DEFAULT_SCALES,
) -> None:
    """Run every property on ``manifold``; raises ``AssertionError`` naming the first that fails.

    The mask comes first, at every constrained size of ``shapes``, before any point is drawn: every other
    property (and ``random``) assumes an entrywise mask, and would fail with a less telling message.
    An exception other than ``AssertionError`` (a ``ValueError`` from ``projx``, say) fails the property too.
    """
    name = type(manifold).__name__
    shapes = tuple(tuple(s) for s in shapes)
    for n in sorted({min(s[-2:]) for s in shapes}):
        try:
            manifold.check_mask(n)
        except ValueError as err:
            raise AssertionError(f"{name} fails {project_gram_is_an_entrywise_mask.__name__}: {err}") from None
    for prop in properties:
        try:
            run_property(prop, manifold, shapes, dtypes, max_examples, scales)
        except AssertionError as exc:
            raise AssertionError(f"{name} fails {prop.__name__}: {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"{name} fails {prop.__name__}: {type(exc).__name__}: {exc}") from exc
