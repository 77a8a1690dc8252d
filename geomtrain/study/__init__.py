"""The module-wise manifold study (being split into modules; see runner.py for now)."""
from .runner import *  # noqa: F401,F403
from .runner import RunLock, make_table, main  # noqa: F401
from .runner import __all__  # noqa: F401
