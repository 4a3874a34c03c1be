"""The strategy's keyword knobs: their documentation, and how passed values become one ``Zero3Config``.

[Note: one list of knobs]
``Zero3Strategy.__init__`` spells every ``Zero3Config`` field out as a typed keyword argument, because
LightningCLI (jsonargparse) validates ``init_args`` from the signature and documents them from the
docstring. The signature is the one list written by hand; everything else comes from ``Zero3Config``:
the defaults (``DEFAULTS.<field>``), the docstring (``knob_docstring`` reads the field docstrings from
the dataclass source), and the validation (``Zero3Config.from_kwargs``). A test asserts that the
signature and the dataclass fields agree name by name and default by default.

Precedence, lowest first: ``config=`` (a Zero3Config), ``deepspeed_config=``, keywords. A keyword left
at its default does not override the other two (it cannot be told apart from one never passed).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Optional

from .settings import Zero3Config
from .deepspeed import DeepSpeedSource, merge, translate

DEFAULTS = Zero3Config()


def field_docs(cls: type = Zero3Config) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def knob_docstring(summary: str, leading: dict[str, str]) -> str:
    """A Google-style docstring: ``summary``, then ``Args:`` for ``leading`` and every Zero3Config field."""
    lines = [inspect.cleandoc(summary), "", "Args:"]
    for name, doc in {**leading, **field_docs()}.items():
        text = " ".join(doc.split())
        wrapped = textwrap.wrap(f"{name}: {text}", width=100, initial_indent="    ", subsequent_indent="        ")
        lines.extend(wrapped)
    return "\n".join(lines) + "\n"


def _is_default(name: str, value: Any) -> bool:
    if not hasattr(DEFAULTS, name):
        return False  # an unknown name: from_kwargs names it and lists the valid ones
    default = getattr(DEFAULTS, name)
    try:
        return value is default or bool(value == default)
    except Exception:  # values that do not compare (callables compare by identity above)
        return False


def build_config(
    config: Optional[Zero3Config], deepspeed_config: Optional[DeepSpeedSource], knobs: dict[str, Any]
) -> Zero3Config:
    """The strategy's config from its three sources (see [Note: one list of knobs]); validated once."""
    explicit = {name: value for name, value in knobs.items() if not _is_default(name, value)}
    translated = translate(deepspeed_config) if deepspeed_config is not None else {}
    return Zero3Config.from_kwargs(config, **merge(translated, explicit))
