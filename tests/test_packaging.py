"""The configs ship inside the package: a non-editable install (the Docker image's) runs from anywhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_non_editable_install_ships_the_configs(tmp_path: Path):
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    assert (target / "xsa_lm" / "configs" / "train.yaml").exists()
    assert (target / "xsa_lm" / "configs" / "model" / "paper_2.7b.yaml").exists()
    assert not (target / "xsa_lm" / "configs" / "train.yaml").is_symlink()
    # Run from an unrelated directory with only the installed copy importable (not the source tree).
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv = ['xsa-lm', 'train', 'attention=xsa', '--cfg', 'job'];"
         "import xsa_lm, xsa_lm.cli; print(xsa_lm.__file__); xsa_lm.cli.main()"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith(str(target))
    assert "name: xsa" in out.stdout


def test_dockerfile_base_torch_fits_the_pinned_range_and_copies_existing_paths():
    """No Docker engine here: check what can be checked statically (the image build runs on GPU hosts)."""
    import re

    import tomllib

    dockerfile = (REPO / "Dockerfile").read_text()
    torch_version = re.search(r"^FROM pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda", dockerfile, re.M)
    assert torch_version, "the base image should be an official CUDA PyTorch image"
    spec = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                if d.startswith("torch"))  # fmt: skip
    low, high = ((int(a), int(b)) for a, b in re.findall(r"[<>]=?(\d+)\.(\d+)", spec))
    version = tuple(map(int, torch_version.groups()))
    assert low <= version < high
    for src in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in src.split():
            assert (REPO / path).exists(), path
    assert 'ENTRYPOINT ["xsa-lm"]' in dockerfile
