"""The errors a user's settings raise, apart from the modules that check them, so that every module that
validates a setting (``config/settings.py``, ``config/deepspeed.py``) can raise them without importing another."""

from __future__ import annotations


class Zero3ConfigError(ValueError):
    """A zero3 setting is unknown or out of range; the message names the setting and the fix."""


class UnsupportedPrecisionError(ValueError):
    """The ``precision`` flag asks for something zero3 does not run; the message lists what works."""


class OptimizerShardingError(ValueError):
    """The optimizer cannot be moved onto the shards as given (it stepped already, or holds a parameter
    twice); raised by the engine's ``grads/optim.py`` and its host-side twin under offload."""
