"""The contract kit run over every built-in manifold and a user subclass (one test per property)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import BlockGram, forget_manifold

from manifolds import BoundedDGram, DGram, Euclidean, GramManifold, Oblique, Stiefel, get_manifold
from manifolds.testing import PROPERTIES, check_manifold, run_property


class ParityOblique(GramManifold):
    """A user manifold written as docs/custom-manifold.md says (``project_gram`` only): unit columns, and columns
    i and j orthogonal where i + j is odd (the even-indexed columns span a space orthogonal to the odd ones)."""

    name = "ParityOblique"

    def project_gram(self, M):
        i = torch.arange(M.shape[-1], device=M.device)
        mask = (i[:, None] == i[None, :]) | ((i[:, None] + i[None, :]) % 2 == 1)
        return M * mask.to(M.dtype)


# BoundedDGram is a manifold with boundary: the kit holds in its interior, which is where its
# ``random`` draws points (largest column norm <= 0.9 * bound). Bound 0.5 rescales nearly every
# DGram draw (log-normal norms around 1), bound 3 almost none.
MANIFOLDS = [
    Stiefel(),
    DGram(),
    Oblique(),
    Euclidean(),
    BlockGram(),
    ParityOblique(),
    BoundedDGram(0.5),
    BoundedDGram(3.0),
]
IDS = ["Stiefel", "DGram", "Oblique", "Euclidean", "BlockGram", "ParityOblique", "BoundedDGram-0.5", "BoundedDGram-3"]


@pytest.mark.slow
@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
def test_contract(manifold, prop):
    run_property(prop, manifold)


class PublishedDGram(DGram):
    """The published DGram retraction: (U V^T) * S with the SVD's sorted singular values."""

    def projx(self, x):
        U, S, Vh = torch.linalg.svd(x, full_matrices=False)
        return (U @ Vh) * S[..., None, :]


def test_kit_catches_published_dgram_retraction():
    # Points with unsorted column norms are moved by the published map: the kit must say so.
    with pytest.raises(AssertionError, match="projx_fixes_points|retr_at_zero"):
        check_manifold(PublishedDGram(), shapes=((12, 4),), dtypes=(torch.float64,), max_examples=20)


class BrokenStiefel(Stiefel):
    """A wrong tangent projection (forgets the symmetrisation)."""

    def proju(self, x, u):
        return u - x @ (x.mT @ u)


def test_kit_catches_wrong_projection():
    with pytest.raises(AssertionError, match="BrokenStiefel fails"):
        check_manifold(BrokenStiefel(), shapes=((8, 4),), dtypes=(torch.float64,), max_examples=10)


def project_zero_row_sums(M):
    r"""Orthogonal projection of a symmetric ``M`` onto the symmetric matrices with zero diagonal and zero row sums
    (the null-direction deflation prototype's multipliers): $\operatorname{Off}(M) + 2\operatorname{diag}(\mu) -
    (\mu 1^\top + 1 \mu^\top)$, where $(n - 2)\mu + (1^\top \mu) 1 = r$, the row sums of $\operatorname{Off}(M)$."""
    n = M.shape[-1]
    off = M - torch.diag_embed(M.diagonal(dim1=-2, dim2=-1))
    r = off.sum(-1)
    mu = (r - r.sum(-1, keepdim=True) / (2 * n - 2)) / (n - 2)
    return off + torch.diag_embed(2 * mu) - (mu[..., :, None] + mu[..., None, :])


class ZeroRowSums(DGram):
    """Not a Gram-space manifold: its P is a genuine orthogonal projector, but not a 0/1 mask."""

    def project_gram(self, M):
        return project_zero_row_sums(M)


def test_zero_row_sum_projection_is_a_projection_but_not_a_mask():
    # The counterexample is a genuine orthogonal projector (so only the mask check can catch it).
    P = ZeroRowSums().project_gram
    X = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    X = X + X.mT
    Y = P(X)
    assert torch.allclose(P(Y), Y, atol=1e-12) and torch.allclose(
        Y.sum(-1), torch.zeros(6, dtype=torch.float64), atol=1e-12
    )
    assert torch.allclose(Y.diagonal(), torch.zeros(6, dtype=torch.float64)) and abs(float(((X - Y) * Y).sum())) < 1e-10


@pytest.mark.parametrize(
    "manifold, problem",
    [
        (ZeroRowSums(), "it mixes entries"),
        (type("Halves", (DGram,), {"project_gram": lambda self, M: 0.5 * M})(), "entries other than 0 and 1"),
        (type("Upper", (DGram,), {"project_gram": lambda self, M: torch.triu(M, 1)})(), "not symmetric"),
    ],
    ids=["zero-row-sums", "halves", "upper"],
)
def test_a_projection_that_is_not_a_mask_is_refused_by_the_kit_and_the_solver(manifold, problem):
    from geomtrain.optim import spectral_direction

    assert all(m.check_mask(5) is None for m in MANIFOLDS)  # the built-ins and BlockGram pass
    with pytest.raises(AssertionError, match=f"project_gram is not an entrywise 0/1 mask at n = \\d+: .*{problem}"):
        run_property(PROPERTIES[0], manifold)  # project_gram_is_an_entrywise_mask, with its own shapes
    W = DGram().projx(torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=f"^{type(manifold).__name__}.project_gram is not an entrywise 0/1 mask"):
        spectral_direction(manifold, W, torch.randn(12, 4, dtype=torch.float64))


@pytest.fixture(scope="module", autouse=True)
def forget_docs_example():
    """The docs example registers "blockgram" and "blockgram-generic" in the process-wide registry when imported:
    undo that after this module, so that tests elsewhere (the error messages listing the valid names) see the
    built-ins only."""
    yield
    forget_manifold("blockgram-generic")
    forget_manifold("blockgram", "block_gram")


def _load_docs_example():
    # Imported once per process, as a user module is: it registers "blockgram" when it runs.
    name = "block_gram"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "block_gram.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", ["BlockGram", "FastBlockGram"])
def test_docs_guide_manifolds_pass_the_kit(cls_name):
    # The "Define your own manifold" guide's classes, checked exactly as the guide says.
    cls = getattr(_load_docs_example(), cls_name)
    check_manifold(cls(block_size=2), shapes=((8, 4), (4, 8), (6, 6), (2, 7, 3)), max_examples=25)


def test_docs_example_registers_itself():
    # The guide's "register, then use by name" path: blockgram@4 -> FastBlockGram(4), through the registry.
    example = _load_docs_example()
    manifold = get_manifold("BlockGram@4")
    assert type(manifold) is example.FastBlockGram and manifold.block_size == 4
    assert get_manifold("blockgram@4").key() == manifold.key() != get_manifold("blockgram@2").key()
    with pytest.raises(ValueError, match=r"bad manifold spec 'blockgram@0': block_size must be an integer >= 1"):
        get_manifold("blockgram@0")
    # the guide's generic arm: the same mask by the generic maps, for timing the two from the command line
    generic = get_manifold("blockgram-generic@4")
    assert type(generic) is example.BlockGram and generic.block_size == 4 and generic.key() != manifold.key()
