"""Configuration, in one place: what a user can set, and how each way of setting it becomes one
``Zero3Config``.

    settings.py         ``Zero3Config``: every setting, its default and its documentation, validated once
    knobs.py            the strategy's keyword arguments generated from it, and their precedence
    deepspeed.py        a DeepSpeed config (``zero_optimization`` ...) translated into settings
    precision_flags.py  the one table of Lightning's ``precision=`` flags: dtypes and bytes of each

Imports: nothing of the package but ``errors.py`` (the engine and the doors read settings from here).
"""

from .settings import Zero3Config, default_nvme_path

__all__ = ["Zero3Config", "default_nvme_path"]
