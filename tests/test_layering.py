"""The package's layering (scripts/import_graph.py): nothing imports the CLI or the runner but the entry points, and
no import arrow goes from a lower layer to a higher one."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
assert spec is not None and spec.loader is not None
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)

ALLOWED_UPWARD: dict[tuple[str, str], str] = {}  # (importer, imported) -> why it must stay; none remain


def arrows() -> dict[str, set[str]]:
    return import_graph.graph(REPO / "xsa_lm")


def test_every_module_has_a_layer():
    assert [m for m in arrows() if import_graph.layer_of(m) < 0] == []


def test_only_entry_points_import_the_cli_or_the_runner():
    assert import_graph.into_entry_points(arrows()) == []


def test_no_arrow_points_up():
    assert [arrow for arrow in import_graph.upward(arrows()) if arrow not in ALLOWED_UPWARD] == []


def test_no_cycles():
    assert import_graph.cycles(arrows()) == []


def test_the_script_refuses_a_folder_that_is_no_package(tmp_path: Path) -> None:
    """Run from outside the repository it measured nothing and printed 0 violations: a check that passed."""
    script = [sys.executable, str(REPO / "scripts" / "import_graph.py")]
    refused = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 2 and "xsa_lm is not a package folder" in refused.stderr
    measured = subprocess.run([*script, str(REPO / "xsa_lm")], cwd=tmp_path, capture_output=True, text=True)
    assert measured.returncode == 0 and "layer violations (lower -> higher): 0" in measured.stdout
