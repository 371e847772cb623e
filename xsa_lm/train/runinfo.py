"""What makes a run self-describing: versions, git state, hardware, command line."""

import importlib.metadata
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

PACKAGES = ["xsa-lm", "torch", "lightning", "hydra-core", "omegaconf", "datasets", "tokenizers", "wandb", "numpy"]


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_state(repo: Path | None = None) -> dict[str, str | bool | None]:
    """Commit and dirty flag of the source tree the package runs from (None outside a git checkout)."""
    repo = repo or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def hardware() -> dict:
    info = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    return info


def run_info() -> dict:
    return {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "host": platform.node(),
        "versions": versions(),
        "git": git_state(),
        "hardware": hardware(),
    }
