"""Shared fixtures: a prepared-data cache for the whole session, a single-node SLURM (helpers: tests/helpers.py)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, REPO, cli_env, run_cli
from tests.leftovers import caches

__all__ = ["FAST", "REPO", "caches", "cli_env", "run_cli"]

# One OpenMP thread per process and per run it starts: more threads than cores spin and wait (four tiny runs at once
# on 2 cores: 80 s with 2 threads each, 32 s with 1). An explicit setting is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The heaviest files (~500, ~320, ~310, ~260 s on 2 cores) go to the workers first: neither starts one when the other
# is nearly done (make test-long turns off xdist's own order).

HEAVIEST_FIRST = ("test_sweep.py", "test_scale.py", "test_gpu_check.py", "test_token_axis.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-data directory for every test of the session (tokenizer training happens once)."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def slurm() -> str:
    """scripts/slurm_up.sh (idempotent: ~0.1 s when SLURM runs, ~1 s from stopped, ~20 s with the apt install);
    its one line, e.g. `slurm_up: node vm idle (SLURM 22.05.8, 2 CPUs, 21694 MB)`."""
    if os.geteuid() != 0:
        pytest.skip("needs root: scripts/slurm_up.sh installs slurm-wlm and munge and starts their daemons")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is not here to install it (scripts/slurm_up.sh: Debian/Ubuntu)")
    up = subprocess.run([REPO / "scripts" / "slurm_up.sh"], capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr  # root and apt: SLURM must come up (CI runs this)
    return up.stdout.strip()
