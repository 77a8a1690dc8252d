r"""The manifold registry: one place that turns a name such as ``"dgram"`` or ``"bdgram@1.5"``
into a `GramManifold`.

A **spec** is ``NAME`` or ``NAME@ARG[,ARG...]``:

- ``NAME`` is a registered name, case-insensitive (``"DGram"`` is ``"dgram"``);
- each ``ARG`` is a positional argument, or ``KEY=VALUE`` for a keyword argument;
- a value that reads as an integer (``16``) is passed as ``int``, one that reads as a number
  (``1.5``, ``2e-3``) as ``float``, anything else as the stripped string (``svd``).

So ``"bdgram@1.5"`` is ``BoundedDGram(1.5)``, ``"dgram@polar_method=svd"`` is
``DGram(polar_method="svd")`` and, once a user has called ``register("blockgram", BlockGram)``,
``"blockgram@16"`` is ``BlockGram(16)``. The factory registered under a name is called with the
parsed arguments and must return a `GramManifold`.

Built in: ``stiefel``, ``dgram``, ``oblique``, ``euclidean`` and ``bdgram`` (`BoundedDGram`;
``bdgram@B`` bounds every column norm by ``B``, plain ``bdgram`` means ``B = 1``).
"""

from __future__ import annotations

import difflib
import inspect
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

from .base import GramManifold
from .bounded import BoundedDGram
from .dgram import DGram
from .euclidean import Euclidean
from .oblique import Oblique
from .stiefel import Stiefel

__all__ = ["SPEC_SYNTAX", "MANIFOLDS", "register", "unregister", "manifold_names", "parse_spec", "get_manifold"]

Factory = Callable[..., GramManifold]

# A registered name: letters, digits, '_', '-', '.'; so never '@', '=', ',' or whitespace, the
# separators of a spec and of a ``GLOB=TARGET`` rule.
_NAME = re.compile(r"[a-z0-9_.\-]+")
_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = re.compile(r"[+-]?\d+")
SPEC_SYNTAX = "NAME@ARG[,ARG|KEY=VALUE...], e.g. bdgram@1.5"

_FACTORIES: dict[str, Factory] = {}
MANIFOLDS: Mapping[str, Factory] = types.MappingProxyType(_FACTORIES)
"""Read-only live view ``name -> factory`` of the registry (built-ins first, in registration order)."""


def manifold_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_FACTORIES)


def _valid_choices() -> str:
    return f"valid: {', '.join(_FACTORIES)}; parametric: {SPEC_SYNTAX}"


def _unknown(spec: str, key: str) -> str:
    """``unknown manifold 'stifel' (did you mean 'stiefel'?); valid: ...``: the closest registered name
    (`difflib.get_close_matches`, if one is close) and the valid ones."""
    close = difflib.get_close_matches(key, list(_FACTORIES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown manifold {spec!r}{hint}; {_valid_choices()}"


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a manifold name must be a str; got {type(name).__name__}")
    key = name.lower()
    if not _NAME.fullmatch(key):
        raise ValueError(
            f"bad manifold name {name!r}: use letters, digits, '_', '-' or '.' "
            "(no '@', '=', ',' or whitespace: they separate a spec's arguments and a rule's target)"
        )
    return key


def register(name: str, factory: Factory, *, overwrite: bool = False) -> Factory:
    """Register ``factory`` (a `GramManifold` subclass, or any callable returning one) under ``name``.

    ``get_manifold("name@a,b,k=v")`` then calls ``factory(a, b, k=v)``. Names are
    case-insensitive. Re-registering a name is a ``ValueError`` unless ``overwrite=True``.
    Returns ``factory``.
    """
    key = _check_name(name)
    if not callable(factory):
        raise TypeError(
            f"factory for manifold {name!r} must be a GramManifold subclass or a callable; got {type(factory).__name__}"
        )
    if key in _FACTORIES and not overwrite:
        raise ValueError(
            f"manifold {key!r} is already registered (to {_FACTORIES[key]!r}); pass overwrite=True to replace it"
        )
    _FACTORIES[key] = factory
    return factory


def unregister(name: str) -> None:
    """Remove a registered name; ``ValueError`` naming the valid choices if it is not registered."""
    key = _check_name(name)
    if key not in _FACTORIES:
        raise ValueError(f"manifold {name!r} is not registered; {_valid_choices()}")
    del _FACTORIES[key]


def _parse_value(text: str) -> Any:
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def parse_spec(spec: str) -> tuple[str, tuple, dict]:
    """Split a spec into ``(name, args, kwargs)``: ``"BDGram@1.5"`` -> ``("bdgram", (1.5,), {})``.

    Only the syntax is checked (the name need not be registered); ``ValueError`` on a bad one.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a manifold spec must be a str; got {type(spec).__name__}")
    name, at, rest = spec.strip().partition("@")
    key = name.strip().lower()
    if not _NAME.fullmatch(key):
        raise ValueError(_unknown(spec, key))
    args: list = []
    kwargs: dict = {}
    if at:
        for item in rest.split(","):
            item = item.strip()
            keyword, eq, value = item.partition("=")
            keyword, value = keyword.strip(), value.strip()
            if not item or (eq and not (_KEYWORD.fullmatch(keyword) and value)):
                raise ValueError(f"bad arguments in manifold spec {spec!r}: write {SPEC_SYNTAX}")
            if eq:
                kwargs[keyword] = _parse_value(value)
            elif kwargs:
                raise ValueError(f"bad arguments in manifold spec {spec!r}: positional argument after KEY=VALUE")
            else:
                args.append(_parse_value(item))
    return key, tuple(args), kwargs


def _signature(factory: Factory) -> str:
    """``"(bound=1.0, polar_method='auto')"``: the factory's parameters, without annotations."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return "(...)"
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def get_manifold(spec: str) -> GramManifold:
    """A new manifold instance for ``spec`` (``"stiefel"``, ``"bdgram@1.5"``, a user's name).

    ``ValueError`` (one line, naming the registered names and the syntax) on an unknown name or
    arguments the factory refuses; ``TypeError`` if the factory returns something else than a
    `GramManifold`.
    """
    key, args, kwargs = parse_spec(spec)
    if key not in _FACTORIES:
        raise ValueError(_unknown(spec, key))
    factory = _FACTORIES[key]
    try:
        manifold = factory(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"bad manifold spec {spec!r}: {reason}; {key} takes {_signature(factory)}") from None
    if not isinstance(manifold, GramManifold):
        raise TypeError(f"the factory of manifold {key!r} returned {type(manifold).__name__}, not a GramManifold")
    return manifold


def _register_builtins() -> None:
    for name, factory in (
        ("stiefel", Stiefel),
        ("dgram", DGram),
        ("oblique", Oblique),
        ("euclidean", Euclidean),
        ("bdgram", BoundedDGram),
    ):
        register(name, factory)


_register_builtins()
