"""docs/errors.md's promise as a check: a refused command leaves the working folder and the caches as it found them.
A table of refusals opts in with `with nothing_left_behind(tmp_path, data_cache): ...` and the `caches` fixture."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CACHE_VARIABLES = ("HF_HOME", "XDG_CACHE_HOME")  # Hugging Face's hub and datasets caches; wandb, matplotlib, ...


@pytest.fixture
def caches(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Empty cache folders for the libraries the command may use, set in the environment (subprocesses inherit it).
    Matplotlib's font list is not watched: any program that imports Lightning writes it once (torchmetrics imports
    matplotlib), refused or not."""
    folders = [tmp_path_factory.mktemp(name.lower()) for name in CACHE_VARIABLES]
    for name, folder in zip(CACHE_VARIABLES, folders, strict=True):
        monkeypatch.setenv(name, str(folder))
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path_factory.mktemp("matplotlib")))
    return folders


def snapshot(*folders: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under the folders: a file's (size, mtime_ns), a folder's None (its own mtime moves with a
    temporary file made and removed again, which leaves nothing)."""
    found: dict[str, tuple[int, int] | None] = {}
    for root in folders:
        for folder, names, files in os.walk(root):
            found.update({os.path.join(folder, name): None for name in names})
            for name in files:
                stat = os.lstat(path := os.path.join(folder, name))
                found[path] = (stat.st_size, stat.st_mtime_ns)
    return found


def finished_preparation(path: str, data_cache: str | None) -> bool:
    """A path of a data-cache folder that holds a finished preparation (meta.json): a cache entry that a refusal
    after the data was prepared keeps, so that the corrected command reuses it."""
    inside = data_cache is not None and Path(data_cache) in Path(path).parents
    return inside and any((folder / "meta.json").is_file() for folder in (Path(path), *Path(path).parents))


@contextmanager
def nothing_left_behind(*folders: Path) -> Iterator[None]:
    """Asserts that the block adds, changes or removes nothing under `folders` and the caches of the environment
    (CACHE_VARIABLES, XSA_LM_DATA_DIR), but for a finished preparation in the data cache."""
    data_cache = os.environ.get("XSA_LM_DATA_DIR")
    watched = {*folders, *(Path(os.environ[v]) for v in CACHE_VARIABLES if v in os.environ)}
    watched |= {Path(data_cache)} if data_cache else set()
    before = snapshot(*watched)
    yield
    after = snapshot(*watched)
    added = sorted(p for p in after.keys() - before.keys() if not finished_preparation(p, data_cache))
    changed = sorted(p for p in before.keys() & after.keys() if before[p] != after[p])
    removed = sorted(before.keys() - after.keys())
    assert (added, changed, removed) == ([], [], []), f"added {added}, changed {changed}, removed {removed}"
