"""Result files written whole or not at all: summary.json, config.yaml, results.json, a checkpoint, ...

Each is written to <name>.tmp beside it, flushed to disk, then renamed over the old one. A full disk, a file-size
limit or a kill mid-write leaves the previous version whole (or no file), never a truncated or 0-byte one, and the
.tmp is removed on any failure.
"""

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

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
    """A file object for `path` (mode "w" or "wb"; its folder is made) that becomes `path` when the block ends
    without an error.

    A failure to write it (an OSError: ENOSPC, EFBIG, EACCES, ...; also when torch.save wraps it in a RuntimeError)
    raises a WriteError naming the path, `intact` (what is still whole; default: the previous version, if any) and
    what to do: what_to_do(the OSError), `then`.
    replace=False refuses an existing `path` (FileExistsError): the exclusive creation of a result another run may
    have written meanwhile. `place` moves the finished temporary file into place."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        encoding = None if "b" in mode else "utf-8"
        with open(tmp, mode, encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
        if replace:
            place(tmp, path)
        else:
            _create(tmp, path)
    except BaseException as e:  # also Ctrl-C: no .tmp stays behind; the error itself goes on
        tmp.unlink(missing_ok=True)
        cause = os_error_in(e)
        if cause is None or isinstance(e, (WriteError, FileExistsError)) or not _of_writing(cause, path, tmp):
            raise
        kept = intact or (f"the previous {path.name} is intact" if existed else "no partial file was left")
        raise WriteError(
            f"could not write {path} ({cause.strerror or cause}); {kept}: {what_to_do(cause)}, then {then}"
        ) from e


def _of_writing(error: OSError, path: Path, tmp: Path) -> bool:
    """Whether the error is one of writing `path`: it names no file (a write, a flush), or this one, its .tmp or a
    folder above it; not, say, a file the block read."""
    return error.filename is None or Path(error.filename) in (tmp, path, *path.parents)


def _create(tmp: Path, path: Path) -> None:
    """Rename tmp to path unless path exists (a hard link fails on an existing name; then the temporary name goes)."""
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
    """`text` as the whole of `path`; `how`: atomic_file's intact, then, replace."""
    with atomic_file(path, "w", **how) as f:
        f.write(text)


def write_json(path: str | Path, data: object, **how: Any) -> None:
    """`data` as indented JSON (made before the file is opened: a value JSON cannot hold leaves no file)."""
    write_text(path, json.dumps(data, indent=2), **how)


def check_new_file(out: Path, *, overwrite: bool, example: str) -> None:
    """Where a command's results go, checked before the work that makes them, so that none of it is lost: a new
    file, or an old one with overwrite=true; never a directory, nor a path below a file (`example`: a file name)."""
    if out.is_dir():
        raise UserError(f"out={out} is a directory: give the file to write, e.g. out={out / example}")
    blocking = next((folder for folder in out.parents if folder.exists() and not folder.is_dir()), None)
    if blocking is not None:
        raise UserError(f"out={out}: {blocking} is a file, not a folder; choose another path")
    if out.exists() and not overwrite:
        raise UserError(f"out={out} exists: choose another path or add overwrite=true")
