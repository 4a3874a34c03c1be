"""CHANGELOG.md keeps Keep a Changelog's shape: [Unreleased] first, then the releases newest first, each with its
kinds of change once and in the format's order. Reads the file only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"]


def versions() -> list[tuple[str, list[str]]]:
    """Each ``## [version]`` with the ``### `` headings under it, in file order."""
    found = []
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if line.startswith("## "):
            found.append((re.fullmatch(r"## \[([^\]]+)\].*", line).group(1), []))
        elif line.startswith("### ") and found:
            found[-1][1].append(line[4:].strip())
    return found


def test_unreleased_comes_first_then_the_releases_newest_first():
    names = [name for name, _ in versions()]
    assert names[0] == "Unreleased" and "0.1.0" in names
    released = [tuple(int(part) for part in name.split(".")) for name in names[1:]]
    assert released == sorted(released, reverse=True)


def test_unreleased_lists_each_kind_of_change_once_in_the_formats_order():
    (kinds,) = [kinds for name, kinds in versions() if name == "Unreleased"]
    assert set(kinds) <= set(KINDS), set(kinds) - set(KINDS)
    assert kinds == sorted(kinds, key=KINDS.index) and len(kinds) == len(set(kinds)), kinds
