"""`did_you_mean`: the closest valid choice, for one-line errors (config keys, flags, manifold names,
data folders). A leaf module: anything in `geomtrain` may import it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

__all__ = ["did_you_mean"]


def did_you_mean(word: str, choices: Iterable[str] | Mapping[str, str]) -> str:
    """``" (did you mean 'X'?)"`` with X the closest of ``choices`` to ``word`` (`difflib.get_close_matches`,
    similarity ratio >= 0.6), or ``""`` when none is that close. A mapping compares its keys and names
    the value: ``{"max-iters": "--max-iters"}``, ``{"classics": "data/classics"}``."""
    shown = choices if isinstance(choices, Mapping) else {choice: choice for choice in choices}
    close = difflib.get_close_matches(word, list(shown), n=1)
    return f" (did you mean {shown[close[0]]!r}?)" if close else ""
