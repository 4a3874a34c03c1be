"""Registering ``"zero3"`` with Lightning's strategy registries: the Trainer's and Fabric's.

Lightning only knows the names of the strategies it ships, so the package registers its own at import
(``Zero3Strategy`` for ``Trainer(strategy="zero3")``, ``Zero3FabricStrategy`` for ``Fabric(strategy="zero3")``).

[Note: two Lightnings]
``lightning.pytorch`` and ``pytorch_lightning`` are two separate copies of the same framework, with
separate registries *and* separate base classes: a ``pytorch_lightning.Trainer`` only accepts strategies
derived from ``pytorch_lightning``'s ``Strategy``. So when ``pytorch_lightning`` is installed, the two
Lightning-facing modules of the Trainer's door (``trainer/precision.py``, ``trainer/strategy.py``) are loaded
a second time from their own source with the package names swapped, as ``trainer._pl_precision`` /
``trainer._pl_strategy``. There is
one source of truth; the engine and the config are shared by both flavours.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

_SWAPS = (
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
    ("from .precision import", "from ._pl_precision import"),
)


def register_strategies() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from .fabric.strategy import Zero3FabricStrategy
    from .trainer.strategy import Zero3Strategy

    if Zero3Strategy.strategy_name not in StrategyRegistry:
        Zero3Strategy.register_strategies(StrategyRegistry)
    if Zero3FabricStrategy.strategy_name not in STRATEGY_REGISTRY:  # Fabric's registry is its own
        Zero3FabricStrategy.register_strategies(STRATEGY_REGISTRY)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        _register_pytorch_lightning()


def _register_pytorch_lightning() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    _load_flavour("precision")
    strategy_module = _load_flavour("strategy")
    strategy_cls = strategy_module.Zero3Strategy
    if strategy_cls.strategy_name not in StrategyRegistry:
        strategy_cls.register_strategies(StrategyRegistry)


def _load_flavour(name: str) -> types.ModuleType:
    """``frontends/trainer/<name>.py`` compiled against ``pytorch_lightning`` (see [Note: two Lightnings])."""
    package = f"{__package__}.trainer"
    module_name = f"{package}._pl_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = Path(__file__).with_name("trainer") / f"{name}.py"
    source = path.read_text()
    for old, new in _SWAPS:
        source = source.replace(old, new)
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    module.__package__ = package
    sys.modules[module_name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module
