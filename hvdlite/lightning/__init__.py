"""hvdlite.lightning: a Lightning 2.x strategy over hvdlite; importing it registers ``strategy="hvdlite"``."""
from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(f"hvdlite.lightning needs Lightning 2.x ({error}); install it with "
                      f"pip install 'hvdlite[lightning]' (or pip install lightning)") from error

from .strategy import HvdliteEnvironment, HvdliteStrategy

__all__ = ["HvdliteEnvironment", "HvdliteStrategy"]

# Lightning builds its registry from its own strategy classes only (no entry points for strategies), so a
# name such as "hvdlite" exists once the module that registers it has been imported.
HvdliteStrategy.register_strategies(StrategyRegistry)
