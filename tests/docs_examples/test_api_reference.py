"""docs/api.md against the code: every public name of ``lightning_zero3`` is on the page, every signature
printed there is the function's or class's own (names, order, kinds, defaults), and every error in its table
is exported with the base class the page names."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import lightning_zero3

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
HEADING = re.compile(r"^### `(?P<call>[A-Za-z_]\w*\(.*?\))`(?: and `(?P<second>[A-Za-z_]\w*\(.*?\))`)?$", re.M)
ERROR_ROW = re.compile(r"^\| `(?P<name>\w+)` \| `(?P<base>\w+)` \|", re.M)


def documented_calls() -> dict[str, ast.arguments]:
    calls = {}
    for match in HEADING.finditer(PAGE):
        for call in filter(None, (match.group("call"), match.group("second"))):
            name = call.split("(", 1)[0]
            calls[name] = ast.parse(f"def {call}: pass").body[0].args  # the printed signature, parsed as Python
    return calls


def _default_text(node: ast.expr) -> str:
    """A printed default as the code's default's ``repr`` reads (a constant, or a call such as ``DtypePolicy(...)``)."""
    return ast.unparse(node) if isinstance(node, ast.Call) else repr(ast.literal_eval(node))


def test_every_public_name_is_on_the_page():
    missing = [name for name in lightning_zero3.__all__ if f"`{name}" not in PAGE]
    assert not missing, f"docs/api.md does not describe {missing}"


def test_every_printed_signature_is_the_codes():
    calls = documented_calls()
    assert {"load_pretrained", "save_full_weights", "from_pretrained", "Zero3Strategy"} <= calls.keys()
    for name, printed in calls.items():
        real = inspect.signature(getattr(lightning_zero3, name))
        params = {p.name: p for p in real.parameters.values()}
        shown = [*printed.posonlyargs, *printed.args]
        defaults = dict(zip([a.arg for a in shown][len(shown) - len(printed.defaults):], printed.defaults))
        defaults.update({a.arg: d for a, d in zip(printed.kwonlyargs, printed.kw_defaults) if d is not None})
        for arg in [*shown, *printed.kwonlyargs]:
            assert arg.arg in params, f"docs/api.md: {name}({arg.arg}=...) is not a parameter of {real}"
            kind = params[arg.arg].kind
            keyword_only = arg in printed.kwonlyargs
            assert keyword_only == (kind is inspect.Parameter.KEYWORD_ONLY), f"{name}: {arg.arg}'s kind ({kind})"
            if arg.arg in defaults:
                assert _default_text(defaults[arg.arg]) == repr(params[arg.arg].default), f"{name}: {arg.arg}'s default"
            else:
                assert params[arg.arg].default is inspect.Parameter.empty, f"{name}: {arg.arg} has a default"
        if printed.kwarg is not None and printed.kwarg.arg == "settings":
            fields = set(lightning_zero3.Zero3Config.__dataclass_fields__)
            assert fields <= params.keys() or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        elif printed.kwarg is not None:
            assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), name
        else:  # a function printed whole: no parameter left out
            left_out = [p for p in params if p not in {a.arg for a in [*shown, *printed.kwonlyargs]}]
            assert not left_out or inspect.isclass(getattr(lightning_zero3, name)), f"{name}: {left_out} not printed"


def test_every_error_in_the_table_is_exported_with_its_base_class():
    rows = {m.group("name"): m.group("base") for m in ERROR_ROW.finditer(PAGE)}
    assert len(rows) >= 10
    for name, base in rows.items():
        error = getattr(lightning_zero3, name, None)
        assert error is not None and name in lightning_zero3.__all__, f"{name} is not exported from lightning_zero3"
        assert error.__mro__[1].__name__ == base, f"{name}'s base class is {error.__mro__[1].__name__}, not {base}"
    exported = [n for n in lightning_zero3.__all__ if isinstance(getattr(lightning_zero3, n), type)
                and issubclass(getattr(lightning_zero3, n), Exception)]  # fmt: skip
    assert set(exported) <= rows.keys(), f"errors exported but not in docs/api.md's table: {set(exported) - rows.keys()}"
