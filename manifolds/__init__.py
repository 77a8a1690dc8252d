"""Gram-space matrix manifolds on geoopt: Stiefel, DGram, Oblique, Euclidean, BoundedDGram, a base
class, and the registry that names them (``get_manifold("bdgram@1.5")``, ``register``).

`manifolds` knows nothing of training; `geomtrain` builds on it.
"""

from .base import GramManifold, MaskForm, from_tall, to_tall
from .bounded import BoundedDGram
from .dgram import DGram
from .euclidean import Euclidean
from .matrix_sign import MSIGN_METHODS, msign, newton_schulz_polar, newton_schulz_steps, polar, polar_near_orthogonal
from .oblique import Oblique
from .registry import MANIFOLDS, SPEC_SYNTAX, get_manifold, manifold_names, parse_spec, register, unregister
from .stiefel import Stiefel

__all__ = [
    "GramManifold",
    "MaskForm",
    "Stiefel",
    "DGram",
    "Oblique",
    "Euclidean",
    "BoundedDGram",
    "msign",
    "polar",
    "polar_near_orthogonal",
    "newton_schulz_polar",
    "newton_schulz_steps",
    "MSIGN_METHODS",
    "MANIFOLDS",
    "get_manifold",
    "register",
    "unregister",
    "manifold_names",
    "parse_spec",
    "SPEC_SYNTAX",
    "to_tall",
    "from_tall",
]
