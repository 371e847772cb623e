"""Packaging: the configs ship inside the package, every third-party import is a declared dependency, constraints.txt
fits pyproject.toml's ranges, and lm-eval is an optional extra that `xsa-lm eval` asks for in one line."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest's own dependency
from packaging.utils import canonicalize_name

from tests.helpers import refused_in_process

REPO = Path(__file__).resolve().parents[1]


@cache
def project() -> dict:
    import tomllib  # Python 3.11+: the module imports on 3.10 too

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.mark.slow
def test_non_editable_install_ships_the_configs(tmp_path: Path):
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    source = tmp_path / "source"  # a copy: setuptools would reuse the checkout's build/ (stale modules included)
    for tree in ("xsa_lm", "configs"):
        shutil.copytree(REPO / tree, source / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / file, source / file)
    build = subprocess.run([*pip, "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    assert (target / "xsa_lm" / "configs" / "train.yaml").exists()
    assert (target / "xsa_lm" / "configs" / "model" / "paper_2.7b.yaml").exists()
    assert not (target / "xsa_lm" / "configs" / "train.yaml").is_symlink()
    modules = {p.relative_to(REPO) for p in (REPO / "xsa_lm").rglob("*.py")}  # every subpackage listed in pyproject
    assert modules <= {p.relative_to(target) for p in (target / "xsa_lm").rglob("*.py")}
    # Run from an unrelated directory with only the installed copy importable (not the source tree).
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = (
        "import sys; sys.argv = ['xsa-lm', 'train', 'attention=xsa', '--cfg', 'job'];"
        "import xsa_lm, xsa_lm.cli; print(xsa_lm.__file__); xsa_lm.cli.main()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith(str(target))
    assert "name: xsa" in out.stdout


def test_dockerfile_base_torch_fits_the_pinned_range_and_copies_existing_paths():
    """No Docker engine here: check what can be checked statically (the image build runs on GPU hosts)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    torch_version = re.search(r"^FROM pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda", dockerfile, re.M)
    assert torch_version, "the base image should be an official CUDA PyTorch image"
    spec = next(d for d in project()["dependencies"] if d.startswith("torch"))
    low, high = ((int(a), int(b)) for a, b in re.findall(r"[<>]=?(\d+)\.(\d+)", spec))
    version = tuple(map(int, torch_version.groups()))
    assert low <= version < high
    for src in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in src.split():
            assert (REPO / path).exists(), path
    assert 'ENTRYPOINT ["xsa-lm"]' in dockerfile


def requirements(*extras: str) -> list[Requirement]:
    """pyproject.toml's dependencies and those of the given extras."""
    optional = [r for extra in extras for r in project()["optional-dependencies"][extra]]
    return [Requirement(r) for r in project()["dependencies"] + optional]


def pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {canonicalize_name(name): version for name, version in (line.split("==") for line in lines if line)}


def test_constraints_pin_every_dependency_inside_its_range():
    """make install uses constraints.txt: after a range changes in pyproject.toml, `make lock` must be rerun."""
    pinned = pins(REPO / "constraints.txt")
    assert "xsa-lm" not in pinned and not [v for v in pinned.values() if "+" in v]  # the +cpu label would miss CUDA
    lines = (REPO / "tests/constraints.txt").read_text().splitlines()
    caps = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    assert caps, "tests/constraints.txt names no package"
    for requirement in requirements("dev", "eval", "docs") + caps:
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in constraints.txt: run make lock"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (str(requirement), pinned[name])


def test_the_version_is_written_once_and_the_install_reports_it():
    """pyproject.toml takes the version from xsa_lm.__version__ (setuptools reads the file's text, as a build does),
    so the package and its metadata cannot disagree; the installed metadata says it too (after a reinstall)."""
    from setuptools.config.pyprojecttoml import read_configuration

    import xsa_lm

    assert "version" not in project() and "version" in project()["dynamic"]
    assert read_configuration(REPO / "pyproject.toml")["project"]["version"] == xsa_lm.__version__
    assert importlib.metadata.version("xsa-lm") == xsa_lm.__version__, "reinstall: make install"


def third_party_imports(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    local = {path.stem for path in folder.glob("*.py")}  # scripts importing one another
    return found - set(sys.stdlib_module_names) - {"xsa_lm", "__future__"} - local


def test_every_third_party_import_is_a_declared_dependency():
    declared = {canonicalize_name(r.name) for r in requirements("eval")}
    owners = importlib.metadata.packages_distributions()
    for module in sorted(third_party_imports(REPO / "xsa_lm") | third_party_imports(REPO / "scripts")):
        distributions = {canonicalize_name(d) for d in owners.get(module, [])}
        assert distributions & declared, f"`import {module}` ({distributions or 'not installed'}) is not declared"


def test_the_eval_message_names_the_extra_of_pyproject():
    from xsa_lm.eval.run import HARNESS_REQUIREMENT

    extra = next(r for r in project()["optional-dependencies"]["eval"] if r.startswith("lm-eval"))
    assert Requirement(HARNESS_REQUIREMENT) == Requirement(extra)
    assert "lm-eval" not in {canonicalize_name(r.name) for r in requirements()}  # not in the core install


NEEDS_THE_HARNESS = {
    "xsa-lm eval": ["eval", "ckpts=[x.ckpt]"],
    "sweep.eval_tasks": ["sweep", "experiment=demo", "sweep.eval_tasks=paper"],
}


@pytest.mark.slow
@pytest.mark.parametrize("needed_by, command", NEEDS_THE_HARNESS.items())
def test_eval_without_lm_eval_says_how_to_install_it_in_one_line(
    needed_by: str, command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
):
    """As in an install without the extra `eval`: `import lm_eval` fails (a None entry in sys.modules). A sweep that
    would evaluate its runs is refused before it trains any."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "e1"
    err = refused_in_process([*command, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)
    assert err.splitlines() == [
        f"xsa-lm: error: {needed_by} needs lm-evaluation-harness, the extra `eval`: "
        "pip install 'lm-eval>=0.4.9,<0.5' (in a checkout: pip install -e '.[eval]')"
    ]
    assert not run_dir.exists()  # refused before any output


@pytest.mark.slow
def test_every_module_but_the_harness_adapter_imports_without_lm_eval():
    """lm_eval is imported lazily, inside `xsa-lm eval`: the rest of the package works without the extra."""
    code = (
        "import importlib, pkgutil, sys; sys.modules['lm_eval'] = None; import xsa_lm\n"
        "for m in pkgutil.walk_packages(xsa_lm.__path__, 'xsa_lm.'):\n"
        "    if m.name != 'xsa_lm.eval.harness' and not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
