"""The generic projection (`GramManifold.projx`) from the weights a model really has: GPT-2's initialisation
(std 0.02), any scale from 1e-3 to 1e3, float32; a user's ``project_gram``-only manifold through training; the
exact identity ``retr(W, 0) = W``; and the kit's mask-first order."""

import pytest
import torch
from conftest import BlockGram, forget_manifold, tiny_config
from test_manifold_contract import MANIFOLDS, ParityOblique

from geomtrain.model import GPT, model_config
from manifolds import get_manifold, manifold_names, to_tall
from manifolds.testing import check_manifold

# check_point_on_manifold's own default: what the trainer and a user call
ATOL = 1e-5


def _gaussian(*shape, scale=1.0, seed=0, dtype=torch.float32):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _gpt_matrices():
    """The hidden matrices of the first block of a freshly initialised ``tiny`` GPT (std 0.02; c_proj scaled down)."""
    torch.manual_seed(0)
    model = GPT(model_config("tiny", vocab_size=256))
    return {n: p.detach() for n, p in model.named_parameters() if n.startswith("transformer.h.0.") and p.dim() == 2}


@pytest.mark.parametrize(
    "manifold",
    [*manifold_names(), ParityOblique()],
    ids=lambda m: m if isinstance(m, str) else type(m).__name__,
)
@pytest.mark.slow
def test_gpt_initialisation_projects_onto_every_manifold(manifold):
    # Every registered name and a project_gram-only user mask (the generic path): the trainer projects these
    # very weights (float32) at the start of a run. Before the fix the generic Newton raised from this scale.
    manifold = get_manifold(manifold) if isinstance(manifold, str) else manifold
    for name, W in _gpt_matrices().items():
        Y = manifold.projx(W)
        ok, reason = manifold.check_point_on_manifold(Y, explain=True, atol=ATOL)
        assert ok and Y.dtype == W.dtype and Y.shape == W.shape, f"{name}: {reason}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale", [1e-3, 0.02, 0.1, 1.0, 3.0, 1e3])
@pytest.mark.parametrize("shape", [(24, 24), (40, 12), (12, 40), (3, 16, 6)], ids=str)
def test_generic_projx_reaches_the_manifold_from_any_scale(shape, scale, dtype):
    # Before the fix: Newton did not converge from 0.02 or 0.1, and float32 returned points that
    # check_point_on_manifold rejects (residuals 1e-5 to 1) from scale 1 up.
    M = ParityOblique()
    X = _gaussian(*shape, scale=scale, seed=1, dtype=dtype)
    Y = M.projx(X)
    ok, reason = M.check_point_on_manifold(Y, explain=True, atol=ATOL)
    assert ok and Y.dtype == dtype, reason
    # columns whose norm the mask leaves free (all of BlockGram's) keep their norms: float32 rounding of a norm
    # is ~1e-7 relative, 1e-5 leaves a margin for the cast of the float64 result
    Z = BlockGram().projx(X)
    assert BlockGram().check_point_on_manifold(Z, atol=ATOL)
    ratio = to_tall(Z).norm(dim=-2) / to_tall(X).norm(dim=-2)  # columns, or rows of a wide matrix
    assert float((ratio - 1).abs().max()) < (1e-5 if dtype == torch.float32 else 1e-12)


def test_generic_projx_refuses_what_it_cannot_reach_in_one_line():
    # Rank one: all columns parallel, so no unit even column can be orthogonal to the odd ones; and a zero column
    # whose norm P fixes. Both are a one-line ValueError naming the manifold and the dtype, never a wrong point.
    M = ParityOblique()
    X = _gaussian(8, 1, seed=2) @ (1 + _gaussian(1, 6, seed=3).abs())
    with pytest.raises(ValueError, match=r"^ParityOblique.projx could not reach the manifold from this torch.float32"):
        M.projx(X)
    try:
        M.projx(X)
    except ValueError as err:
        assert "\n" not in str(err) and "residual" in str(err)
    W = _gaussian(10, 4, seed=3)
    W[:, 2] = 0
    with pytest.raises(ValueError, match=r"^ParityOblique.projx cannot normalise a zero column"):
        M.projx(W)


@pytest.mark.parametrize("manifold", [*MANIFOLDS, get_manifold("bdgram@1.5")], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_retraction_at_zero_is_bitwise_identity(manifold, dtype):
    # README: "retr(W, 0) == W exactly". Before the fix Stiefel, DGram, Oblique and BoundedDGram rounded W.
    W = manifold.random(3, 12, 5, dtype=dtype, generator=torch.Generator().manual_seed(4))
    U = torch.zeros_like(W)
    assert torch.equal(manifold.retr(W, U).view(torch.int8), W.view(torch.int8))
    # per matrix of a batch: a zero step leaves its matrix alone, a nonzero one moves its own
    U[1] = 0.1 * manifold.proju(W[1], _gaussian(12, 5, seed=5, dtype=dtype))
    Y = manifold.retr(W, U)
    assert torch.equal(Y[0], W[0]) and torch.equal(Y[2], W[2])
    assert manifold.check_point_on_manifold(Y, atol=ATOL)


class Upper(ParityOblique):
    """Not an entrywise symmetric mask: only the upper triangle."""

    def project_gram(self, M):
        return torch.triu(M)


def test_kit_checks_the_mask_first():
    # Before the fix the kit drew points first: a non-symmetric mask failed with the generic Newton's message.
    with pytest.raises(AssertionError, match=r"^Upper fails project_gram_is_an_entrywise_mask: .*not symmetric"):
        check_manifold(Upper(), max_examples=5)


@pytest.fixture
def parity_module(tmp_path, monkeypatch):
    """A user module, as ``geomtrain train --manifolds mypkg.parity`` imports: it registers ``parityob``."""
    (tmp_path / "user_parity.py").write_text(
        "from manifolds import register\n"
        "from test_manifold_contract import ParityOblique\n\n"
        'register("parityob", ParityOblique)\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_parity"
    forget_manifold("parityob", "user_parity")


@pytest.mark.slow
def test_a_project_gram_only_manifold_trains(data_dir, parity_module):
    # The run: rule *.attn.c_proj.weight=parityob on a GPT; before the fix the trainer's initial
    # projection raised. Now it trains: finite losses, the matrices move and stay on the manifold.
    from geomtrain.train import Trainer

    cfg = tiny_config(
        data_dir, manifold_modules=[parity_module], rules=["*.attn.c_proj.weight=parityob"], block_size=16, max_iters=3
    )
    trainer = Trainer(cfg)
    chosen = {a.name: a.manifold for a in trainer.assignments if a.manifold_name == "parityob"}
    assert sorted(chosen) == [f"transformer.h.{i}.attn.c_proj.weight" for i in range(2)]
    params = dict(trainer.model.named_parameters())
    start = {name: params[name].detach().clone() for name in chosen}
    for _ in range(3):
        result = trainer.step()
        assert result.skipped is None and torch.isfinite(torch.tensor(result.loss))
    for name, manifold in chosen.items():
        W = params[name].detach()
        ok, reason = manifold.check_point_on_manifold(W, explain=True, atol=ATOL)
        assert ok, f"{name}: {reason}"
        assert float((W - start[name]).norm()) > 1e-4 * float(start[name].norm()), f"{name} did not move"
