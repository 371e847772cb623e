"""The package's layering (scripts/import_graph.py): nothing imports the CLI or the runner but the entry points, and
no import arrow goes from a lower layer to a higher one."""

import importlib.util
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
