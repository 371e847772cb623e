"""Reports as golden files: a test renders a report from a fixed results record and compares it with the file here.
After a deliberate change of a report, write them again: XSA_LM_GOLDEN=update pytest <the test>, and read the diff."""

import os
from pathlib import Path

GOLDEN = Path(__file__).parent


def assert_golden(name: str, text: str) -> None:
    """`text` is tests/golden/<name> (with XSA_LM_GOLDEN=update: becomes it)."""
    path = GOLDEN / name
    if os.environ.get("XSA_LM_GOLDEN") == "update":
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: write it with XSA_LM_GOLDEN=update"
    assert text == path.read_text(), f"the report differs from {path}; if deliberate, XSA_LM_GOLDEN=update"
