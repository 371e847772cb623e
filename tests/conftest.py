"""Shared fixtures: a prepared-data cache for the whole session. Shared helpers are in tests/helpers.py (imported
here too, for the modules that take them from conftest)."""

from pathlib import Path

import pytest

from tests.helpers import FAST, REPO, cli_env, run_cli

__all__ = ["FAST", "REPO", "cli_env", "run_cli"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-data directory for every test of the session (tokenizer training happens once)."""
    return tmp_path_factory.mktemp("data_cache")
