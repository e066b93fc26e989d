"""hvdlite.lightning: a Lightning 2.x strategy over hvdlite; importing it registers ``strategy="hvdlite"``."""
from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(f"hvdlite.lightning needs Lightning 2.x ({error}); install it with "
                      f"pip install 'hvdlite[lightning]' (or pip install lightning)") from error

from .strategy import HvdliteEnvironment, HvdliteStrategy

__all__ = ["HvdliteEnvironment", "HvdliteStrategy"]

# Lightning has no entry points for strategies: "hvdlite" exists once this module has registered it.
HvdliteStrategy.register_strategies(StrategyRegistry)
