"""geomtrain: Manifold Muon, a GPT-2 trainer with module-wise manifold assignment, and the study.

``geomtrain.param_groups`` (from `geomtrain.groups`) is loaded on first use, so ``import geomtrain``
stays cheap (no torch import). The core (`manifolds`, `geomtrain.optim`, ``param_groups``) needs only
torch and geoopt; the rest comes with the extras of ``pyproject.toml``, listed in `EXTRAS`.
"""

import importlib.util

__all__ = ["param_groups", "ParamGroups", "EXTRAS", "install_hint", "require_extras"]

EXTRAS: dict[str, str] = {
    "numpy": "train",
    "tqdm": "train",
    "tiktoken": "train",
    "tiktoken_ext": "train",
    "tokenizers": "train",
    "matplotlib": "study",
    "PIL": "study",
    "hypothesis": "testing",
    "tensorboard": "tensorboard",
    "safetensors": "hf",
    "transformers": "hf",
    "datasets": "openwebtext",
}
"""Top-level import name of every optional package the code imports -> the extra that installs it."""


def install_hint(module: str | None) -> str | None:
    """``pip install 'geomtrain[EXTRA]'`` for a (dotted) module of an extra's package; None for any other."""
    extra = EXTRAS.get((module or "").partition(".")[0])
    return None if extra is None else f"pip install 'geomtrain[{extra}]'"


def require_extras(*extras: str) -> None:
    """Check, without importing them, that the packages of ``extras`` are installed; else raise
    ModuleNotFoundError for the first missing one (its ``name`` gives `install_hint`)."""
    unknown = sorted(set(extras) - set(EXTRAS.values()))
    if unknown:
        raise ValueError(f"unknown extras {unknown}; choose from {sorted(set(EXTRAS.values()))}")
    for module, extra in EXTRAS.items():
        if extra in extras and importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def __getattr__(name: str):
    if name in ("param_groups", "ParamGroups"):
        from . import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'geomtrain' has no attribute {name!r}")
