"""How a command ends on an error: one line on stderr, never a traceback (HYDRA_FULL_ERROR=1: Hydra's full report).
A UserError exits with code 2; any other exception with 1, its traceback in <run dir>/error.log or a temporary file."""

import contextlib
import errno
import functools
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EXIT_USER_ERROR = 2
# Set beside HYDRA_FULL_ERROR=1 when cli.py, not the user, asked Hydra to raise: child processes inherit both.
OURS_VARIABLE = "XSA_LM_HYDRA_FULL_ERROR"
# What every job checks before it starts (command, group choices, unresolved config, run directory): cli.py sets it.
JOB_CHECKS: list[Callable[[str, dict[str, Any], Any, Path | None], None]] = []
STARTED = [0.0]  # when the command started: a folder older than that was not made for this job
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
FIXES = {  # what fixes a failed write, by its errno
    **dict.fromkeys((errno.ENOSPC, errno.EDQUOT), "free space (or choose a folder on another disk)"),
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    **dict.fromkeys(
        (errno.EACCES, errno.EPERM, errno.EROFS), "fix the folder's permissions (or choose another folder)"
    ),
}


def full_errors() -> bool:
    """Whether the user asked for full tracebacks (HYDRA_FULL_ERROR=1) instead of one line."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and os.environ.get(OURS_VARIABLE) != "1"


class UserError(Exception):
    """A mistake in the configuration or the inputs, with a message that says how to fix it."""


class WriteError(UserError):
    """A file that could not be written: the message names it and what is still intact."""


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """A UserError or config error: one line, exit code 2; any other exception: one line, exit code 1."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except (UserError, OmegaConfBaseException) as e:
        what = f"error: {e}" if isinstance(e, UserError) else f"config error: {str(e).splitlines()[0]}"
        key = f" (key: {getattr(e, 'full_key', '?')})" if isinstance(e, OmegaConfBaseException) else ""
        print(f"xsa-lm: {what}{key}{job_named()}", file=sys.stderr)
        remove_empty_run_dir()
        sys.exit(EXIT_USER_ERROR)
    except Exception as e:
        if full_errors():
            raise
        print(report_unexpected(e), file=sys.stderr)
        sys.exit(1)


def one_line_errors(job: Callable[..., Any]) -> Callable[..., Any]:
    """A command's job (under @hydra.main): JOB_CHECKS first, and whatever escapes it ends as one line."""

    @functools.wraps(job)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        # A log file that cannot be written (a full disk) would print a traceback for every line logged.
        logging.raiseExceptions = False
        with exit_on_user_error():
            from hydra.core.hydra_config import HydraConfig
            from omegaconf import OmegaConf

            if HydraConfig.initialized() and args:  # args[0]: the job's config
                hydra, config = HydraConfig.get(), OmegaConf.to_container(args[0], resolve=False)
                for check in JOB_CHECKS:
                    check(hydra.job.name, dict(hydra.runtime.choices), config, hydra_run_dir())
            return job(*args, **kwargs)

    return guarded


def report_unexpected(error: BaseException) -> str:
    """An unforeseen exception's line: its type and message, the OSError behind it, where its traceback went."""
    message = first_line(error)
    line = f"xsa-lm: error: {type(error).__name__}" + (f": {message}" if message else "")
    cause = os_error_in(error)
    if cause is not None and cause is not error:  # e.g. torch.save's RuntimeError over a full disk
        line += f" (caused by {type(cause).__name__}: {first_line(cause)})"
    if cause is not None and cause.filename is not None and str(cause.filename) not in line:
        line += f" (file: {cause.filename})"
    if cause is not None and cause.errno in DISK_ERRNOS:
        line += f": {what_to_do(cause)}"
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return f"{line}; {save_traceback(trace)}"


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:500]


def yaml_problem(error: BaseException) -> str:
    """Where a YAML parse failed and why: " at line N (what)"."""
    mark = getattr(error, "problem_mark", None)
    return (f" at line {mark.line + 1}" if mark is not None else "") + f" ({first_line(error)})"


def save_traceback(trace: str) -> str:
    """Append the traceback to <run dir>/error.log, else to a temporary file; what the line says about it."""
    header = f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {' '.join(sys.argv)}\n"
    run_dir, reasons = hydra_run_dir(), []
    if run_dir is not None and run_dir.is_dir() and run_dir.resolve() != Path.cwd().resolve():
        path = run_dir / "error.log"
        existed = path.exists()
        try:
            with open(path, "a") as f:
                f.write(header + trace)
            return f"full traceback in {path}"
        except OSError as e:  # a full disk, or the error was that the folder cannot be written
            reasons.append(f"{path}: {e.strerror or e}")
            if not existed:
                path.unlink(missing_ok=True)
    try:
        with tempfile.NamedTemporaryFile("w", prefix="xsa-lm-error-", suffix=".log", delete=False) as temporary:
            temporary.write(header + trace)
        return f"full traceback in {temporary.name}"
    except OSError as e:
        reasons.append(f"{tempfile.gettempdir()}: {e.strerror or e}")
        return f"the traceback could not be saved ({'; '.join(reasons)}): HYDRA_FULL_ERROR=1 prints it"


def job_named() -> str:
    """Which job of a --multirun a refusal is about (nothing for a single run)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    return f" (in the job {' '.join(HydraConfig.get().overrides.task)})"


def hydra_run_dir() -> Path | None:
    """The folder Hydra made for this job, if a job is running (--cfg: none)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    runtime = HydraConfig.get().runtime
    return None if OmegaConf.is_missing(runtime, "output_dir") else Path(runtime.output_dir)


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind an exception: itself, or one it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def what_to_do(error: OSError) -> str:
    return FIXES.get(error.errno or 0, "fix the cause")


def remove_empty_run_dir() -> None:
    """A refused command leaves no folder: its empty run dir, empty parents and a refused first job's multirun.yaml."""
    run_dir, here = hydra_run_dir(), Path.cwd().resolve()
    if run_dir is None or run_dir.resolve() == here:
        return
    with contextlib.suppress(OSError):  # a folder that cannot be read or removed stays: the line was said
        if run_dir.stat().st_ctime >= STARTED[0] and not any(run_dir.iterdir()):
            remove_with_empty_parents(run_dir, here)
            # Hydra's log handlers into the removed folder go: the next line logged (a --multirun's next job) would fail
            root, removed = logging.getLogger(), Path(os.path.abspath(run_dir))
            for handler in list(root.handlers):
                if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == removed:
                    root.removeHandler(handler)
                    handler.close()
    if job_named():
        remove_refused_sweep_dir(run_dir.parent)


def remove_refused_sweep_dir(sweep_dir: Path) -> None:
    """A refused --multirun's folder, made by this command, that holds only Hydra's multirun.yaml."""
    with contextlib.suppress(OSError):
        if sweep_dir.stat().st_ctime >= STARTED[0] and os.listdir(sweep_dir) == ["multirun.yaml"]:
            (sweep_dir / "multirun.yaml").unlink()
            remove_with_empty_parents(sweep_dir, Path.cwd().resolve())


def remove_with_empty_parents(folder: Path, here: Path) -> None:
    """An empty folder, and its empty parents up to the current directory (outputs/<command>/<time>)."""
    if here in folder.resolve().parents:
        os.removedirs(os.path.relpath(folder.resolve(), here))
    else:
        folder.rmdir()
