"""Every ``bash`` and ``python`` block of README.md and docs/*.md runs as printed.

Each page runs in a scratch copy of the repository (its tracked files, no ``runs/``, no venv), block after
block in page order, so a block may use what an earlier block of its page wrote (the README's resume reads
the quickstart's checkpoint). A ``python`` block is written to a file and run with this interpreter; a
``bash`` block runs with ``bash -e`` and this venv's ``bin`` first on ``PATH``; both see the scratch copy
first on ``PYTHONPATH``, as a clone's root is. Every block must exit 0.

Blocks that differ only in the paths they name (the README's monitoring example and docs/monitoring.md's)
share one run: the first in page order runs, and a later twin is left out where no later block of its page
names one of its paths (nothing there reads what it wrote).

A block is not run here when the line right before its opening fence says so, with why:

- ``<!-- run by tests/<folder>/test_x.py -->``: that test runs these commands (a long job, or one checked more
  closely there); the file must exist and name the page, so the claim is visible on both sides.
- ``<!-- not run here: REASON -->``: it needs what a test machine has not (GPUs, a cluster, a serving
  engine, an install into your environment).

The blocks not run here are listed in one place, docs/index.md's "Blocks the tests do not run" (a test holds
it to the marks); ``python tests/docs_examples/test_docs_blocks.py`` prints that table and every block run by
another test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>bash|python)\n(?P<body>.*?)\n(?P=indent)```", re.S | re.M)
MARK = re.compile(r"<!--\s*(?:(?P<by>run by)\s+(?P<test>\S+)|(?P<not>not run here):\s*(?P<reason>.+?))\s*-->\s*$")
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "lightning_logs", "__pycache__", "*.egg-info", ".pytest_cache")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    body: str
    run_by: Optional[str] = None
    not_run: Optional[str] = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        indent = match.group("indent")
        body = "\n".join(row[len(indent):] if row.startswith(indent) else row for row in match.group("body").splitlines())
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        block = Block(page, line, match.group("lang"), body)
        if mark and mark.group("by"):
            block.run_by = mark.group("test")
        elif mark:
            block.not_run = mark.group("reason")
        found.append(block)
    return found


#: a path in Python: a string with a slash or a dot in it; in a shell command: a word with a slash or a file suffix
PYTHON_PATH = re.compile(r"""(["'])([^"'\n]*[/.][^"'\n]*)\1""")
SHELL_PATH = re.compile(r"""(?<!\S)(\S*/\S*|\S+\.(?:pt|pth|ckpt|safetensors|bin|json|jsonl|yaml|yml|py|txt)/?)(?!\S)""")


def paths(block: Block) -> set[str]:
    """The files and directories a block names."""
    if block.lang == "python":
        return {match.group(2) for match in PYTHON_PATH.finditer(block.body)}
    return {match.group(1) for match in SHELL_PATH.finditer(block.body)}


def shape(block: Block) -> str:
    """The block with every path it names replaced by one placeholder: blocks of one shape differ only in paths."""
    pattern = PYTHON_PATH if block.lang == "python" else SHELL_PATH
    return block.lang + ":" + pattern.sub("<path>", block.body)


def runs() -> dict[str, list[Block]]:
    """Page -> the blocks its test runs, in page order: neither marked nor the twin of a block run before it."""
    planned, seen = {}, set()
    for page in PAGES:
        ours = [b for b in blocks(page) if not (b.run_by or b.not_run)]
        planned[page] = []
        for i, block in enumerate(ours):
            read_later = any(p in later.body for later in ours[i + 1 :] for p in paths(block))
            if shape(block) in seen and not read_later:
                continue
            seen.add(shape(block))
            planned[page].append(block)
    return planned


def _run(block: Block, scratch: Path, index: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    if block.lang == "python":
        script = scratch / f".block{index}.py"
        script.write_text(block.body + "\n")
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.body]
    return subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=900)


INDEX = "docs/index.md"
NOT_RUN_HEADING = "## Blocks the tests do not run"


def not_run_table() -> list[str]:
    """docs/index.md's table of the blocks not run here: page, the block's first line of substance, why."""
    rows = ["| page | block | why it is not run here |", "| --- | --- | --- |"]
    for page in PAGES:
        name = Path(page).name
        link = f"[{name}]({os.path.relpath(ROOT / page, (ROOT / INDEX).parent)})"
        for block in blocks(page):
            if block.not_run:
                lines = [r.strip() for r in block.body.splitlines()]
                first = next(r for r in lines if r and not r.startswith(("#", "import ", "from ")))
                shown = re.sub(r"\s+#\s.*$", "", first).rstrip(" \\")  # without its comment or line continuation
                rows.append(f"| {link} | `{shown}` | {block.not_run} |")
    return rows


def test_the_blocks_not_run_here_are_listed_in_one_place():
    text = (ROOT / INDEX).read_text()
    assert NOT_RUN_HEADING in text, f"{INDEX} lacks its section '{NOT_RUN_HEADING}'"
    section = text[text.index(NOT_RUN_HEADING) :].split("\n## ")[0]
    listed = [line for line in section.splitlines() if line.startswith("|")]
    assert listed == not_run_table(), ("the table under " + NOT_RUN_HEADING + " in " + INDEX + " should read:\n"
                                       + "\n".join(not_run_table()))  # fmt: skip


def test_every_marked_block_names_a_test_that_names_its_page():
    for page in PAGES:
        for block in blocks(page):
            if block.run_by:
                test = ROOT / block.run_by
                assert test.is_file(), f"{block.where}: marked 'run by {block.run_by}', which does not exist"
                assert Path(page).name in test.read_text(), f"{block.where}: {block.run_by} does not name {page}"


def test_blocks_that_differ_only_in_a_path_share_one_run():
    planned = runs()
    monitoring = [b for b in blocks("docs/monitoring.md") if b.lang == "python"]
    assert monitoring and not planned["docs/monitoring.md"]  # the README's identical example ran for it
    readme = {b.line for b in planned["README.md"]}
    assert any(shape(b) == shape(monitoring[0]) and b.line in readme for b in blocks("README.md"))
    consolidate = Block("x.md", 1, "bash", "zero3-consolidate runs/quickstart.ckpt model.pt")
    assert shape(consolidate) == shape(Block("y.md", 1, "bash", "zero3-consolidate epoch=0-step=3.ckpt/ model.pt"))
    assert paths(consolidate) == {"runs/quickstart.ckpt", "model.pt"}
    assert shape(Block("x.md", 1, "python", 'Trainer(strategy="zero3")')) != shape(Block("y.md", 1, "python", 'Trainer(strategy="ddp")'))


@pytest.mark.parametrize("page", [page for page, planned in runs().items() if planned])
def test_the_blocks_of_each_page_run_as_printed(page, tmp_path):
    scratch = tmp_path / "clone"
    shutil.copytree(ROOT, scratch, ignore=COPY_IGNORE)
    for index, block in enumerate(runs()[page]):
        done = _run(block, scratch, index)
        assert done.returncode == 0, (
            f"{block.where} ({block.lang}) failed with status {done.returncode}:\n{block.body}\n"
            f"--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-4000:]}"
        )


if __name__ == "__main__":
    print("\n".join(not_run_table()) + "\n")
    for page in PAGES:
        for block in blocks(page):
            if block.run_by:
                first = block.body.strip().splitlines()[0]
                print(f"{block.where:28} run by {block.run_by:52} {first[:70]}")
