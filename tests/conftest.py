"""Shared fixtures: a prepared-data cache for the whole session and a CLI runner."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A fast training recipe for tests: the tiny model, shortened, on the bundled corpus.
FAST = [
    "model=tiny",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=2",
    "model.head_dim=32",
    "model.block_size=64",
    "tokenizer.vocab_size=512",
    "global_batch_tokens=1024",
    "micro_batch_size=8",
    "optim.lr=3e-3",
    "scheduler.warmup_steps=5",
    "trainer=cpu",
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=1",
    "val_every_steps=20",
    "data.val_windows=64",
    "logger=csv",
    "progress_bar=false",
]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared-data directory for every test of the session (tokenizer training happens once)."""
    return tmp_path_factory.mktemp("data_cache")


def cli_env(data_cache: Path, home: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(XSA_LM_DATA_DIR=str(data_cache), WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if home is not None:
        env["HOME"] = str(home)
    return env


def run_cli(args: list[str], data_cache: Path, cwd: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    """`python -m xsa_lm.cli <args>` in a subprocess, as a user would type `xsa-lm <args>`."""
    return subprocess.run(
        [sys.executable, "-m", "xsa_lm.cli", *args],
        cwd=cwd,
        env={**cli_env(data_cache), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
