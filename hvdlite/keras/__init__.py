"""hvdlite.keras: the same package as ``hvdlite.tensorflow.keras`` (Keras 3 or tf-keras), by another name."""
from __future__ import annotations

import sys

from hvdlite.tensorflow.keras import *  # noqa: F401,F403
from hvdlite.tensorflow.keras import __all__, callbacks, elastic  # noqa: F401

sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic

