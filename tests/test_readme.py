"""README.md and docs/ stay true: their Python runs, the config groups tables match configs/, and every `xsa-lm
<command>` and `make <target>` they name exists (the site build itself: `make docs`)."""

import re
from pathlib import Path

import pytest

from xsa_lm.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"(?<![\w.-])xsa-lm ([a-z][\w-]*)")
MAKE = re.compile(r"(?<![\w.-])make ([a-z][\w-]*)")
MISSPELT_ON_PURPOSE = {"trian"}  # docs/errors.md shows what an unknown command prints


def label(page: Path) -> str:
    return str(page.relative_to(REPO))


def code(page: Path) -> list[str]:
    """Where a page writes commands: its code blocks but ```text ones (reports, file trees), and its inline code."""
    markdown = page.read_text()
    blocks = [block for language, block in FENCE.findall(markdown) if language != "text"]
    return blocks + re.findall(r"`([^`]+)`", FENCE.sub("", markdown))


@pytest.mark.parametrize("page", PAGES, ids=label)
def test_every_code_block_is_closed(page: Path):
    """A block opened and never closed renders the rest of the page as code (links included), with no warning."""
    fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
    openings, closings = fences[::2], fences[1::2]
    assert len(fences) % 2 == 0 and all(line == "```" for line in closings), (label(page), fences)
    assert all(line != "```" for line in openings), (label(page), "a block opened without a language", fences)


def test_python_blocks_run():
    blocks = [
        (page, block) for page in PAGES for language, block in FENCE.findall(page.read_text()) if language == "python"
    ]
    assert blocks
    for page, block in blocks:
        exec(compile(block, label(page), "exec"), {})


@pytest.mark.parametrize("page", [REPO / "docs" / "configuration.md"], ids=label)
def test_the_config_groups_table_lists_every_group_and_option(page: Path):
    configs = REPO / "configs"
    table = re.split(r"^#+ Config groups.*$", page.read_text(), flags=re.M)[1].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {}
    for row in rows:
        group, options = row.split("|")[1:3]
        listed[group.strip(" `")] = set(re.findall(r"`([^`]+)`", options))
    assert set(listed) == {d.name for d in configs.iterdir() if d.is_dir() and not d.name.startswith("_")}
    for group, options in listed.items():
        files = {f.stem for f in (configs / group).glob("*.yaml") if not f.name.startswith("_")}
        assert options == files, (group, "missing:", files - options, "no such option:", options - files)


def test_every_xsa_lm_command_named_exists():
    named = {(label(page), command) for page in PAGES for snippet in code(page) for command in COMMAND.findall(snippet)}
    assert len({command for _, command in named}) >= 8  # the pattern finds them
    unknown = sorted((page, c) for page, c in named if c not in COMMANDS and c not in MISSPELT_ON_PURPOSE)
    assert not unknown, f"not an xsa-lm command: {unknown}"


def test_every_make_target_named_exists():
    targets = set(re.findall(r"^([\w-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), re.M))
    named = {(label(page), target) for page in PAGES for snippet in code(page) for target in MAKE.findall(snippet)}
    assert {"demo", "test", "docs"} <= {target for _, target in named}
    unknown = sorted((page, t) for page, t in named if t not in targets)
    assert not unknown, f"not a Makefile target: {unknown}"


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert len(links) >= 10
    assert [link for link in links if not (REPO / link).is_file()] == []
