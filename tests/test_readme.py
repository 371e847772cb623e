"""The README's Python examples run as written."""

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_every_config_group_in_the_readme_exists():
    configs = Path(__file__).resolve().parents[1] / "configs"
    table = README.split("### Config groups")[1].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 7
    groups = {row.split("|")[1].strip(" `") for row in rows}
    assert groups == {d.name for d in configs.iterdir() if d.is_dir() and not d.name.startswith("_")}
    for row in rows:
        group, options = row.split("|")[1:3]
        for option in re.findall(r"`([^`]+)`", options):
            assert (configs / group.strip(" `") / f"{option}.yaml").exists(), (group, option)
