"""hvdlite: Horovod-style data-parallel training over MPI; ``import hvdlite as hvd`` works on numpy arrays."""
from __future__ import annotations

from .core import *  # noqa: F401,F403
from .core import __all__ as _core_all
from .core import elastic

__version__ = "0.1.0"
__all__ = list(_core_all) + ["__version__", "elastic"]
