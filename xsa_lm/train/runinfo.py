"""What makes a run self-describing: versions, git state, hardware, command line."""

import hashlib
import importlib.metadata
import importlib.resources
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

import torch

import xsa_lm
from xsa_lm.model import GPTConfig
from xsa_lm.model.sdpa import backend_used, resolve, sdpa_backends
from xsa_lm.records import CodeVersion
from xsa_lm.train.devices import uses_cuda

SdpaKernels = dict[str, Any]  # order: the SDPA kernels a run allows, most preferred first; used: the one it runs
PACKAGES = ["xsa-lm", "torch", "lightning", "hydra-core", "omegaconf", "datasets", "tokenizers", "wandb", "numpy"]


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_state() -> tuple[str | None, bool | None]:
    """Commit and dirty flag of the source tree the package runs from (None outside a git checkout)."""
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain") if commit else None
    return commit, bool(status) if status is not None else None


def source_sha256() -> str:
    """sha256 over the package's .py files and its bundled configs (xsa_lm.configs: in the package when installed,
    configs/ mapped in by an editable install), each by its path in the package, sorted: the same for an installed
    package, an editable install and a checkout of the same source."""
    files: dict[str, Path] = {}
    configs = Path(str(importlib.resources.files("xsa_lm.configs")))
    for name, root in (("", Path(xsa_lm.__file__).parent), ("configs/", configs)):
        for folder, _, names in os.walk(root):  # a configs/ link in a checkout is not followed: it is walked as configs
            for file in names:
                if file.endswith((".py", ".yaml")):
                    path = Path(folder, file)
                    files[name + path.relative_to(root).as_posix()] = path
    digest = hashlib.sha256()
    for key in sorted(files):
        digest.update(key.encode() + b"\0" + files[key].read_bytes() + b"\0")
    return digest.hexdigest()


@cache
def code_version() -> CodeVersion:
    """The code this process runs: summary.json's `code`, what a study compares before reusing a run."""
    commit, dirty = git_state()
    return CodeVersion(
        package=versions()["xsa-lm"],
        commit=commit,
        dirty=dirty,
        source_sha256=source_sha256(),
        torch=torch.__version__,
    )


def attention_kernels(
    sdpa_backends_value: str | Sequence[str], *, model: GPTConfig, context: int, precision: str, accelerator: str
) -> SdpaKernels:
    """The SDPA kernels a run allows, most preferred first (config `sdpa_backends` on this device), and the one its
    attention runs: tried once on a tensor of the run's shape (sinks included) and precision."""
    device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda(accelerator) else torch.device("cpu")
    order = resolve(sdpa_backends_value, device)
    # the dtype attention computes in under a Lightning precision (`bf16-mixed`: autocast's bf16)
    dtypes = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}
    dtype = next((d for prefix, d in dtypes.items() if precision.startswith(prefix)), torch.float32)
    with sdpa_backends(order):
        used = backend_used(
            heads=model.n_head,
            kv_heads=model.n_kv_head,
            seq=context + model.n_sinks,
            head_dim=model.head_dim,
            dtype=dtype,
            device=device,
        )
    return {"order": order, "used": used}


def run_info(*, attention: SdpaKernels | None = None) -> dict[str, Any]:
    """run_info.json (and resumes.jsonl's `run_info`); `attention`: attention_kernels' answer, recorded as `sdpa`."""
    return {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "host": platform.node(),
        "versions": versions(),
        "git": dict(zip(("commit", "dirty"), git_state(), strict=True)),
        "code": code_version().to_json(),  # what a study compares before resuming the run
        "hardware": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        },
        "sdpa": attention,
    }
