"""Shared fixtures: a prepared-data cache for the whole session. Shared helpers are in tests/helpers.py (imported
here too, for the modules that take them from conftest)."""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, REPO, cli_env, run_cli

__all__ = ["FAST", "REPO", "cli_env", "run_cli"]

# One OpenMP thread per process, for this process and the training runs it starts: the suite runs one worker per core
# and a test's runs beside it, and more threads than cores spin and wait (four tiny runs at once on 2 cores: 80 s with
# 2 threads each, 32 s with 1). An explicit setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-data directory for every test of the session (tokenizer training happens once)."""
    return tmp_path_factory.mktemp("data_cache")
