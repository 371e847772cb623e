"""The command line: checked against the composed config before Hydra runs, and read back inside a job."""

import json
import os
import sys
from pathlib import Path
from typing import cast

ARGV_VARIABLE = "XSA_LM_ARGV"  # the full command line as JSON, for full_command_line()
HYDRA_FLAGS_WITHOUT_CHECK = (
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
    "--multirun",
    "-m",
)


def check_overrides(config_name: str, args: list[str]) -> None:
    """Compose the config once before Hydra runs, so that an unknown option or a typo'd key ends in one
    actionable line and exit code 2 instead of Hydra's multi-line report (HYDRA_FULL_ERROR=1 keeps Hydra's)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(a in HYDRA_FLAGS_WITHOUT_CHECK for a in args):
        return
    overrides, skip_next = [], False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg.startswith("-"):
            skip_next = arg in ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd")
        else:
            overrides.append(arg)
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
            run_dir = Path(cfg.hydra.run.dir)  # resolved here: ${now:...} needs Hydra's resolvers
    except (HydraException, OmegaConfBaseException) as e:
        print(f"xsa-lm: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    everything = cast(dict, OmegaConf.to_container(cfg, resolve=False))  # a DictConfig gives a dict
    job = {k: v for k, v in everything.items() if k != "hydra"}
    missing = missing_values(job)  # `???` values the chosen options need, e.g. data.files
    if missing:
        listed = ", ".join(missing)
        print(
            f"xsa-lm: error: missing required value(s): {listed}; set them on the command line, e.g. {missing[0]}=...",
            file=sys.stderr,
        )
        sys.exit(2)
    if any(a in ("--cfg", "-c") for a in args):  # prints the config: no run, no run directory
        return
    if config_name in ("train", "sweep", "scale"):  # wrong types or ranges: before torch and Lightning load (5 s)
        from xsa_lm.config.checks import check_values
        from xsa_lm.errors import UserError

        try:
            check_values(cfg)
        except UserError as e:
            print(f"xsa-lm: error: {e}", file=sys.stderr)
            sys.exit(2)
    # Hydra creates the run directory before the job starts: a path that cannot exist fails here, in one line. The
    # folders made for the test are removed again: a default run dir holds the time, which Hydra reads anew.
    absent = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = e.strerror or e
        print(f"xsa-lm: error: hydra.run.dir={run_dir} cannot be created ({reason}): choose another", file=sys.stderr)
        sys.exit(2)
    for folder in absent:  # deepest first
        folder.rmdir()


def missing_values(node: object, prefix: str = "") -> list[str]:
    """Keys whose value is still `???` (e.g. data.files for data=local), without resolving interpolations."""
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in missing_values(v, f"{prefix}{k}.")]
    if isinstance(node, list):
        return [key for i, v in enumerate(node) for key in missing_values(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if node == "???" else []


def one_line(error: BaseException) -> str:
    """Hydra's message without the search-path listing, on one line."""
    noise = ("provider=", "Config search path", "full_key:", "object_type=", "reference_type=")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = error.__cause__
    if cause is not None and str(cause).splitlines()[0].strip() not in lines:
        lines.append(str(cause).splitlines()[0].strip())
    kept = [line for line in lines if not line.startswith(noise)]
    return " ".join(kept).replace(" Available options in", "; available options in").replace(":\t", ": ")


def full_command_line() -> list[str]:
    """The command line as typed (`xsa-lm train ...`), also inside a job whose sys.argv main() has shortened for
    Hydra. Lightning's DDP launcher re-runs sys.argv for the other ranks, and run_info.json records it."""
    saved = json.loads(os.environ.get(ARGV_VARIABLE, "null"))
    if saved and [saved[0], *saved[2:]] == sys.argv:  # exported for this process, not inherited from a parent's
        return saved
    return list(sys.argv)
