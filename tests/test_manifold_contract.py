"""The contract kit run over every built-in manifold and a user subclass (one test per property)."""
import pytest
import torch

from manifolds import DGram, Euclidean, GramManifold, Oblique, Stiefel
from manifolds.testing import PROPERTIES, check_manifold, run_property


class BlockGram(GramManifold):
    """User-style subclass: columns orthogonal across blocks of 2, free inside a block."""

    def project_gram(self, M):
        block = torch.arange(M.shape[-1], device=M.device) // 2
        return M * (block[:, None] != block[None, :]).to(M.dtype)


MANIFOLDS = [Stiefel(), DGram(), Oblique(), Euclidean(), BlockGram()]


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=lambda m: type(m).__name__)
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


def _load_docs_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "docs" / "examples" / "block_gram.py"
    spec = importlib.util.spec_from_file_location("block_gram_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cls_name", ["BlockGram", "FastBlockGram"])
def test_docs_guide_manifolds_pass_the_kit(cls_name):
    # The "Define your own manifold" guide's classes, checked exactly as the guide says.
    cls = getattr(_load_docs_example(), cls_name)
    check_manifold(cls(block_size=2), shapes=((8, 4), (4, 8), (6, 6), (2, 7, 3)), max_examples=25)
