r"""A block-diagonal Gram manifold, defined by its mask alone.

Columns are split into consecutive blocks of ``block_size`` (the last block may be smaller).
Columns in different blocks must be orthogonal; inside a block they are free (any norms, any
angles). With blocks of one column this is DGram; with a single block it is Euclidean.

    M = { W : (W^T W)_ij = 0 whenever block(i) != block(j) },   block(i) = i // block_size

As for every Gram-space manifold, the constraint acts on the columns of a tall matrix and on the
rows of a wide one (``torch.nn.Linear`` weights are ``(out, in)``).

``BlockGram`` implements only ``project_gram``: projection, retraction, checks and sampling
come from the generic maps of :class:`manifolds.GramManifold` (products only: conjugate gradients
on ``n x n`` Gram matrices; milliseconds at 128 columns). ``FastBlockGram`` adds the closed forms
(per block-pair Sylvester solves and a polar retraction), for larger matrices on a CPU.

Importing this module registers ``FastBlockGram`` as ``blockgram`` and ``BlockGram`` as ``blockgram-generic``, so
that ``manifolds.get_manifold("blockgram@16")`` (and a training rule ``*.attn.*=blockgram@16``) is
``FastBlockGram(16)``, and ``blockgram-generic@16`` is ``BlockGram(16)``.
"""

from __future__ import annotations

import torch

from manifolds import GramManifold, from_tall, polar, register, to_tall

__all__ = ["BlockGram", "FastBlockGram", "block_mask"]


# --8<-- [start:blockgram]
def block_mask(n: int, block_size: int, *, dtype=None, device=None) -> torch.Tensor:
    """The ``(n, n)`` 0/1 mask: 1 where columns ``i`` and ``j`` lie in different blocks."""
    block = torch.arange(n, device=device) // block_size
    return (block[:, None] != block[None, :]).to(dtype or torch.get_default_dtype())


class BlockGram(GramManifold):
    """Columns orthogonal across blocks of ``block_size`` columns, free inside a block.

    Args:
        block_size: columns (rows, for a wide matrix) per block, e.g. the head dimension.
        **kwargs: passed to :class:`manifolds.GramManifold` (``polar_method``, ``max_newton_steps``).
    """

    name = "BlockGram"

    def __init__(self, block_size: int, **kwargs):
        super().__init__(**kwargs)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1; got {block_size!r}")
        self.block_size = block_size

    def project_gram(self, M: torch.Tensor) -> torch.Tensor:
        """Keep the cross-block entries of ``M``, zero the diagonal blocks."""
        return M * block_mask(M.shape[-1], self.block_size, dtype=M.dtype, device=M.device)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, " + super().extra_repr()


# --8<-- [end:blockgram]


# --8<-- [start:fast]
class FastBlockGram(BlockGram):
    r"""``BlockGram`` with closed-form ``proju`` and ``projx`` (cost O(m n^2), no iterative solve).

    On the manifold the Gram matrix $G = W^\top W$ is block diagonal, so the projection equation
    $P(GS + SG) = L_W(U)$ splits into one Sylvester equation $G_a S_{ab} + S_{ab} G_b = L_{ab}$
    per pair of blocks, solved in the eigenbasis of $G$. The retraction keeps the diagonal blocks
    of $H = Q^\top X = (X^\top X)^{1/2}$, $Q = \operatorname{polar}(X)$: $R(X) = Q\,\mathrm{bdiag}(H)$
    (DGram's retraction when blocks have one column). Like the built-in closed forms, ``proju``
    assumes ``x`` is on the manifold.
    """

    name = "FastBlockGram"

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        T = to_tall(x)
        G = T.mT @ T
        mask = block_mask(G.shape[-1], self.block_size, dtype=G.dtype, device=G.device)
        # Solve G S + S G = L(U) in the eigenbasis of G's diagonal blocks. With G block diagonal
        # the equation decouples per block pair, and S inherits L's zero diagonal blocks.
        lam, V = torch.linalg.eigh(G * (1 - mask))
        L = self.tangent_constraint(x, u)
        S = V @ ((V.mT @ L @ V) / (lam[..., :, None] + lam[..., None, :])) @ V.mT
        return u - from_tall(T @ (S * mask), like=x)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        self._validate(x)
        T = to_tall(x)
        Q = polar(T, self.polar_method)
        mask = block_mask(T.shape[-1], self.block_size, dtype=T.dtype, device=T.device)
        H = Q.mT @ T
        return from_tall(Q @ (0.5 * (H + H.mT) * (1 - mask)), like=x)


# --8<-- [end:fast]


# --8<-- [start:register]
# "blockgram@16" -> FastBlockGram(16): the arguments after "@" are passed to the class.
register("blockgram", FastBlockGram)
# "blockgram-generic@16" -> BlockGram(16): the same manifold by the generic maps (project_gram alone).
register("blockgram-generic", BlockGram)
# --8<-- [end:register]
