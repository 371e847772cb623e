"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """A mistake in the configuration or the inputs, with a message that says how to fix it."""


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Around a command's work: a UserError or a config error (e.g. a `???` value left unset) becomes one line on
    stderr and exit code 2, instead of a traceback."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except UserError as e:
        print(f"xsa-lm: error: {e}", file=sys.stderr)
        remove_empty_run_dir()
        sys.exit(2)
    except OmegaConfBaseException as e:
        print(f"xsa-lm: config error: {str(e).splitlines()[0]} (key: {getattr(e, 'full_key', '?')})", file=sys.stderr)
        remove_empty_run_dir()
        sys.exit(2)


def remove_empty_run_dir() -> None:
    """A refused command leaves no folder behind: Hydra made the run directory before the job started."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if run_dir.is_dir() and run_dir.resolve() != Path.cwd().resolve() and not any(run_dir.iterdir()):
            run_dir.rmdir()
