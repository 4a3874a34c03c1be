"""Registering ``"zero3"`` with Lightning's strategy registries.

Lightning only knows the names of the strategies it ships, so the package registers its own at import.
``lightning.pytorch`` and ``pytorch_lightning`` are two separate copies of Lightning with separate
registries and base classes; the ``pytorch_lightning`` flavour of the strategy is built by
``_pl_flavour`` when that package is installed.
"""

from __future__ import annotations


def register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from .strategy import Zero3Strategy

    if Zero3Strategy.strategy_name not in StrategyRegistry:
        Zero3Strategy.register_strategies(StrategyRegistry)
