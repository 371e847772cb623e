"""Files written whole or not at all: to <name>.tmp, fsynced, renamed over the old one (a full disk or a kill leaves
the previous version; the .tmp goes on any failure)."""

import csv
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from pydantic import ConfigDict, TypeAdapter

from xsa_lm.errors import UserError, WriteError, os_error_in, what_to_do


@contextmanager
def atomic_file(
    path: str | Path,
    mode: str = "w",
    *,
    intact: str | None = None,
    then: str = "run the command again",
    replace: bool = True,
    place: Callable[[Path, Path], None] = os.replace,
    newline: str | None = None,
) -> Iterator[IO[Any]]:
    """A file that becomes `path` when the block ends without an error; a failure to write it raises a WriteError
    naming `intact` (what is still whole) and what to do, `then`. replace=False: FileExistsError if `path` exists."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8", newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
        (place if replace else _create)(tmp, path)
    except BaseException as e:  # also Ctrl-C: no .tmp stays behind; the error itself goes on
        tmp.unlink(missing_ok=True)
        cause = os_error_in(e)
        if cause is None or isinstance(e, (WriteError, FileExistsError)):
            raise
        if cause.filename is not None and Path(cause.filename) not in (tmp, path, *path.parents):
            raise  # an error of reading another file, not of writing this one
        kept = intact or (f"the previous {path.name} is intact" if existed else "no partial file was left")
        raise WriteError(
            f"could not write {path} ({cause.strerror or cause}); {kept}: {what_to_do(cause)}, then {then}"
        ) from e


@contextmanager
def undo_new_folders(path: Path) -> Iterator[None]:
    """`path` and its parents that do not exist yet: if the block fails, those it made and left empty go again (a
    refusal leaves no folder behind)."""
    missing = [folder for folder in (path, *path.parents) if not folder.exists()]  # the deepest first
    try:
        yield
    except BaseException:
        for folder in missing:
            with suppress(OSError):  # not empty: something in it is kept on purpose
                folder.rmdir()
        raise


def _create(tmp: Path, path: Path) -> None:
    """Rename tmp to path unless path exists (a hard link fails on an existing name)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: a check and a rename, not atomic against another writer
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def write_text(path: str | Path, text: str, **how: Any) -> None:
    with atomic_file(path, "w", **how) as f:
        f.write(text)


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def write_csv(path: Path, header: list[str], rows: list[dict[str, str]], **how: Any) -> None:
    with atomic_file(path, "w", newline="", **how) as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


_JSONABLE = TypeAdapter(Any, config=ConfigDict(ser_json_inf_nan="null"))  # paths, tuples, NaN -> JSON's own


def write_json(path: str | Path, data: object, **how: Any) -> None:
    """Strict JSON, which every reader parses: a NaN or infinity (a diverged run's loss) is written as null."""
    strict = _JSONABLE.dump_python(data, mode="json")
    write_text(path, json.dumps(strict, indent=2, allow_nan=False), **how)


def check_new_file(out: Path, *, overwrite: bool, example: str) -> None:
    """A command's output file, checked before the work that makes it (`example`: a file name for the refusal)."""
    if out.is_dir():
        raise UserError(f"out={out} is a directory: give the file to write, e.g. out={out / example}")
    if (blocking := next((p for p in out.parents if p.exists() and not p.is_dir()), None)) is not None:
        raise UserError(f"out={out}: {blocking} is a file, not a folder; choose another path")
    if out.exists() and not overwrite:
        raise UserError(f"out={out} exists: choose another path or add overwrite=true")
