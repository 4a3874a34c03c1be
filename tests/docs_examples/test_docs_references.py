"""What the pages point at exists: every relative link of README.md, CHANGELOG.md and docs/*.md reaches a file
(and its ``#anchor`` a heading of that page), and every setting the pages name is a field of ``Zero3Config``
with the default they give. Reads files only: no process is started."""

from __future__ import annotations

import ast
import dataclasses
import re
from datetime import timedelta
from pathlib import Path

import yaml

from lightning_zero3 import Zero3Config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
SETTINGS_CALL = re.compile(r"\b(?:Zero3Strategy|Zero3FabricStrategy|Zero3Config)\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
FIELDS = {f.name: f for f in dataclasses.fields(Zero3Config)}
CALL_KEYWORDS = set(FIELDS) | {"config", "deepspeed_config"}  # the strategies take a whole config beside the settings


def prose(text: str) -> str:
    """The page without its code: links and headings in code blocks are not the page's own."""
    return FENCED.sub("", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for line in prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(INLINE_CODE.sub("", prose(page.read_text()))) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_reaches_a_file_and_its_anchor_a_heading():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in set(anchors(resolved)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {resolved.name})")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_the_pages_links():
    """The check is not vacuous: the index links every page, and anchors come out as GitHub makes them."""
    index = relative_links(ROOT / "docs" / "index.md")
    assert {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"} <= {t.partition("#")[0] for t in index}
    assert "across-nodes-secondary-shards-int8-gathers-and-the-bytes-that-cross" in set(anchors(ROOT / "docs" / "multi-node.md"))


def table_rows(text: str, heading: str) -> dict[str, str]:
    """``| `name` | default | ... |`` rows of the first table under ``heading``: name -> default cell."""
    section = text[text.index(heading) :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def documented_default(cell: str):
    """A default cell as a value: a Python literal in backticks (words after it explain it), or a duration."""
    literal = re.match(r"`([^`]+)`", cell)
    if literal:
        return ast.literal_eval(literal.group(1))
    amount, unit = re.fullmatch(r"(\d+) (min|s)", cell).groups()
    return timedelta(**{"minutes" if unit == "min" else "seconds": int(amount)})


def default_of(name: str):
    field = FIELDS[name]
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def test_configuration_md_lists_every_setting_of_zero3config_with_its_default():
    rows = table_rows((ROOT / "docs" / "configuration.md").read_text(), "## Settings")
    assert set(rows) == set(FIELDS), f"only in the page: {set(rows) - set(FIELDS)}; only in the code: {set(FIELDS) - set(rows)}"
    wrong = {name: (cell, default_of(name)) for name, cell in rows.items() if documented_default(cell) != default_of(name)}
    assert not wrong, f"page default, code default: {wrong}"


def test_the_readmes_settings_are_zero3configs_with_its_defaults():
    rows = table_rows((ROOT / "README.md").read_text(), "## The settings that matter most")
    assert rows and set(rows) <= set(FIELDS), set(rows) - set(FIELDS)
    wrong = {name: (cell, default_of(name)) for name, cell in rows.items() if documented_default(cell) != default_of(name)}
    assert not wrong, f"README default, code default: {wrong}"


def test_every_setting_the_pages_pass_is_a_setting():
    """Keywords of ``Zero3Strategy(...)`` / ``Zero3Config(...)`` in prose and code, the strategy's ``init_args`` in
    the pages' YAML and command lines, and the DeepSpeed table's zero3 side."""
    unknown, named = [], 0
    for page in PAGES:
        text = page.read_text()
        passed = [k for args in SETTINGS_CALL.findall(text) for k in re.findall(r"(?<![\w*])(\w+)\s*=", args)]
        passed += re.findall(r"--trainer\.strategy\.init_args\.(\w+)", text)
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
            strategy = (yaml.safe_load(block).get("trainer") or {}).get("strategy")
            passed += list(strategy.get("init_args", {})) if isinstance(strategy, dict) else []
        named += len(passed)
        unknown += [f"{page.relative_to(ROOT)}: {k}" for k in passed if k not in CALL_KEYWORDS]
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    deepspeed = configuration[configuration.index("| DeepSpeed `zero_optimization` | zero3 setting |") :].split("\n\n")[0]
    for row in deepspeed.splitlines()[2:]:
        for name in re.findall(r"`(\w+)`", row.split("|")[2]):
            named += 1
            if name not in FIELDS and name not in ("none", "cpu", "nvme"):
                unknown.append(f"docs/configuration.md DeepSpeed table: {name}")
    assert named > 10 and not unknown, unknown
