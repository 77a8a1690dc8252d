"""geomtrain: Manifold Muon, a GPT-2 trainer with module-wise manifold assignment, and the study.

``geomtrain.param_groups`` (from `geomtrain.groups`) is loaded on first use, so ``import geomtrain``
stays cheap (no torch import).
"""

__all__ = ["param_groups", "ParamGroups"]


def __getattr__(name: str):
    if name in __all__:
        from . import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'geomtrain' has no attribute {name!r}")
