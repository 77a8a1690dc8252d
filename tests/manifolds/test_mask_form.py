"""MaskForm: each geometry declares the closed form of its mask, and the algebra solvers take from it."""

import pytest
import torch
from conftest import BlockGram

from manifolds import BoundedDGram, DGram, Euclidean, GramManifold, MaskForm, Oblique, Stiefel

BUILT_IN = {Stiefel: MaskForm.FULL, DGram: MaskForm.OFF_DIAGONAL, Oblique: MaskForm.DIAGONAL, Euclidean: MaskForm.ZERO}


@pytest.mark.parametrize("cls", list(BUILT_IN))
def test_a_subclass_keeps_its_parents_mask_form_only_while_it_keeps_the_mask(cls):
    class Same(cls):  # a new name, the same project_gram: the same closed forms
        pass

    class Redefined(cls):  # its own project_gram (here the parent's values): closed forms no longer apply
        def project_gram(self, M):
            return cls.project_gram(self, M)

    class Declared(Redefined):  # a subclass may declare the form of the mask it defines
        mask_form = BUILT_IN[cls]

    assert cls().mask_form is BUILT_IN[cls] and Same().mask_form is BUILT_IN[cls]
    assert Redefined().mask_form is MaskForm.CUSTOM and Declared().mask_form is BUILT_IN[cls]
    assert Same().unconstrained == (cls is Euclidean) and not Redefined().unconstrained


def test_only_euclidean_is_unconstrained_and_only_stiefel_and_dgram_have_orthogonal_columns():
    assert [c for c in BUILT_IN if c().unconstrained] == [Euclidean]
    assert {f for f in MaskForm if f.orthogonal_columns} == {MaskForm.FULL, MaskForm.OFF_DIAGONAL}
    assert BoundedDGram(2.0).mask_form is MaskForm.OFF_DIAGONAL and BlockGram().mask_form is MaskForm.CUSTOM
    assert [f.label for f in MaskForm] == ["Euclidean", "Stiefel", "DGram", "Oblique", "custom-mask"]


@pytest.mark.parametrize("make", [Stiefel, DGram, Oblique, Euclidean, lambda: BoundedDGram(2.0), BlockGram])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_constraint_count_is_the_mask_sum(make, n):
    # the built-in masks are counted by host arithmetic (MaskForm.constraint_count, no device read)
    manifold = make()
    assert manifold.constraint_count(n, torch.empty(0)) == float(manifold.gram_mask(n, torch.empty(0)).sum())


@pytest.mark.parametrize("cls", [Stiefel, DGram, Oblique])
@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (6, 6)])
def test_the_closed_normal_multiplier_is_the_normal_equations_solution_on_the_manifold(cls, shape):
    # On a point of a built-in manifold the closed form P(C + C^T) / (d_i + d_j) solves P(AS + SA) = L_W(U) exactly;
    # the generic conjugate-gradient solve (GramManifold.solve_normal, rtol 1e-12 in float64) must agree with it,
    # and U - W S must be tangent. float64: both sides are O(1); the CG stop test leaves ~1e-12 relative.
    gen = torch.Generator().manual_seed(7)
    M = cls()
    W = M.random(*shape, dtype=torch.float64, generator=gen)
    U = torch.randn(*shape, dtype=torch.float64, generator=gen)
    S = M.normal_multiplier(W, U)
    T, V = (W, U) if shape[0] >= shape[1] else (W.mT, U.mT)
    C = T.mT @ V
    generic = GramManifold.solve_normal(M, T.mT @ T, C + C.mT)
    assert torch.allclose(S, generic, rtol=0, atol=1e-9 * float(generic.abs().max()))
    assert float(M.tangent_constraint(W, U - (W @ S if shape[0] >= shape[1] else (T @ S).mT)).abs().max()) < 1e-10


def test_euclidean_normal_multiplier_is_zero():
    W, U = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    assert torch.equal(Euclidean().normal_multiplier(W, U), torch.zeros(3, 3, dtype=torch.float64))
