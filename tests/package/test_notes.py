"""Every ``[Note: X]`` reference resolves: ``[Note: X] in F`` names a file that exists and defines that
Note (F relative to the citing file's folder, the package, or the repository); a bare ``[Note: X]`` is
defined somewhere. A Note is defined once in the whole tree, where a line starts with its name: alone on
its line in a docstring or page, at the opening of a docstring, or opening a comment that explains it."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_zero3"
SCANNED = [PACKAGE, ROOT / "tests", ROOT / "examples", ROOT / "docs"]

_ALONE = re.compile(r'^\s*(?:"""|\'\'\')?\[Note: ([^\]]+)\]\s*$')
_COMMENT = re.compile(r"^\s*#\s*\[Note: ([^\]]+)\](.*)$")
_REFERENCE = re.compile(r"\[Note: ([^\]]+)\](?:\)?\s+in\s+`*([\w./-]+\.(?:py|md))`*)?")
_JOIN = re.compile(r"\s*\n\s*(?:#\s*)?")  # a Note's name or path may wrap onto the next line


def _files() -> list[Path]:
    return sorted(p for base in SCANNED for p in base.rglob("*") if p.suffix in (".py", ".md") and p.is_file()
                  and "__pycache__" not in p.parts and p != Path(__file__).resolve())


def _definitions(text: str) -> list[str]:
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if m := _ALONE.match(line):
            found.append(m.group(1))
        elif m := _COMMENT.match(line):
            rest = m.group(2).strip()
            explained_below = i + 1 < len(lines) and lines[i + 1].lstrip().startswith("#")
            # ``# [Note: X]`` above code, or ``# [Note: X] in F``, only points at the Note
            if (rest[:1].isalpha() and not rest.startswith("in ")) or (not rest and explained_below):
                found.append(m.group(1))
    return found


def _references(text: str) -> list[tuple[str, str | None]]:
    joined = _JOIN.sub(" ", text)
    found = [(" ".join(m.group(1).split()), m.group(2)) for m in _REFERENCE.finditer(joined)]
    return [(name, path) for name, path in found if name != "..."]  # "[Note: ...]" names the convention


def _resolve(path: str, referrer: Path) -> Path | None:
    for base in (referrer.parent, PACKAGE, ROOT):
        candidate = (base / path).resolve()
        if candidate.is_file():
            return candidate
    return None


def test_every_note_reference_resolves():
    files = _files()
    texts = {f: f.read_text() for f in files}
    defined = {f: set(_definitions(t)) for f, t in texts.items()}
    where = defaultdict(list)
    for f, names in defined.items():
        for name in names:
            where[name].append(f.relative_to(ROOT).as_posix())
    broken = []
    for f, text in texts.items():
        rel = f.relative_to(ROOT).as_posix()
        for name, path in _references(text):
            if path is None:
                if name not in where:
                    broken.append(f"{rel}: [Note: {name}] is defined nowhere")
                continue
            target = _resolve(path, f)
            if target is None:
                broken.append(f"{rel}: [Note: {name}] in {path}: no such file (defined in: {where.get(name)})")
            elif name not in defined.get(target, set(_definitions(target.read_text()))):
                broken.append(f"{rel}: [Note: {name}] in {path}: not defined there (defined in: {where.get(name)})")
    assert not broken, f"{len(broken)} Note references do not resolve:\n" + "\n".join(broken)


def test_each_note_is_defined_once():
    where = defaultdict(list)
    for f in _files():
        for name in _definitions(f.read_text()):
            where[name].append(f.relative_to(ROOT).as_posix())
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"Notes defined more than once: {twice}"
