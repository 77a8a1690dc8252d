"""Gram-space matrix manifolds on geoopt: Stiefel, DGram, Oblique, Euclidean and a base class.

`manifolds` knows nothing of training; `geomtrain` builds on it.
"""
from .base import GramManifold, from_tall, to_tall
from .dgram import DGram
from .euclidean import Euclidean
from .oblique import Oblique
from .matrix_sign import MSIGN_METHODS, msign, polar
from .stiefel import Stiefel

MANIFOLDS = {"stiefel": Stiefel, "dgram": DGram, "oblique": Oblique, "euclidean": Euclidean}


def get_manifold(name: str) -> GramManifold:
    """A manifold instance by name (case-insensitive); ValueError naming the valid choices."""
    key = name.lower()
    if key not in MANIFOLDS:
        raise ValueError(f"unknown manifold {name!r}; valid: {', '.join(MANIFOLDS)}")
    return MANIFOLDS[key]()


__all__ = [
    "GramManifold", "Stiefel", "DGram", "Oblique", "Euclidean",
    "msign", "polar", "MSIGN_METHODS", "MANIFOLDS", "get_manifold", "to_tall", "from_tall",
]
