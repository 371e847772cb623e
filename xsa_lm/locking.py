"""One writer per directory: a flock held for the job (the kernel drops it with the process), naming its pid."""

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from xsa_lm.errors import UserError, WriteError, what_to_do


@contextmanager
def hold_directory(
    directory: Path, lock_name: str, what: str, key: str = "hydra.run.dir", wait: bool = False
) -> Iterator[None]:
    """Hold `directory/lock_name` while the block runs: wait for its holder, or raise a UserError naming its pid."""
    path = directory / lock_name
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock = open(path, "a+")
        except OSError as e:
            raise UserError(f"{directory} is not writable ({e.strerror or e}): choose another {key}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise UserError(
                f"{directory} is in use by another {what} (pid {holder}): wait for it to finish, or choose another "
                f"{key}"
            ) from None
        # The holder may have removed the file between our open and flock: lock the one at the path now instead.
        if path.exists() and os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
            break
        lock.close()
    try:
        try:  # unbuffered: a full disk fails here, not again when the file is closed
            os.ftruncate(lock.fileno(), 0)
            os.write(lock.fileno(), f"{os.getpid()}\n".encode())
        except OSError as e:
            raise WriteError(
                f"could not write {path} ({e.strerror or e}); nothing else was written: {what_to_do(e)}, then run "
                "the command again"
            ) from None
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: a newcomer then creates and locks a new file
        lock.close()
