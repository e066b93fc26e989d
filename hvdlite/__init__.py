"""hvdlite: Horovod-style data-parallel training over MPI; ``import hvdlite as hvd`` works on numpy arrays."""
from __future__ import annotations

from types import ModuleType

from .core import *  # noqa: F401,F403
from .core import __all__ as _core_all
from .core import elastic

__version__ = "0.1.0"
__all__ = list(_core_all) + ["__version__", "elastic"]


def __getattr__(name: str) -> ModuleType:  # lazy: `hvdlite.run(fn, ...)` without importing the launcher early
    if name == "run":
        import importlib
        return importlib.import_module(".run", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
