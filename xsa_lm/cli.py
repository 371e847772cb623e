"""`xsa-lm <command> [hydra overrides]`: one entry point for every job."""

import importlib
import json
import os
import sys
from pathlib import Path
from typing import cast

COMMANDS = {  # command -> (module with a Hydra main, help); each reads configs/<command>.yaml
    "train": ("xsa_lm.train.run", "train one SA or XSA model"),
    "prepare": ("xsa_lm.data.run", "tokenize a corpus into shards"),
    "analyze": ("xsa_lm.analysis.run", "Figure 1 diagnostics per layer"),
    "eval": ("xsa_lm.eval.run", "zero-shot tasks through lm-evaluation-harness"),
    "generate": ("xsa_lm.eval.sample", "text from a checkpoint, with a KV cache"),
    "consolidate": ("xsa_lm.train.consolidate", "a sharded checkpoint (trainer=fsdp) as one file"),
    "export": ("xsa_lm.export.run", "a checkpoint as a Hugging Face transformers model"),
    "sweep": ("xsa_lm.sweep.run", "LR search on SA, then SA vs XSA at that LR per seed"),
    "scale": ("xsa_lm.scale.run", "the sweep at several sizes, XSA's compute multiplier"),
    "plan": ("xsa_lm.train.plan", "memory per device for DDP and FSDP, largest micro-batch"),
    "bench": ("xsa_lm.bench.run", "SA vs XSA time and memory, Lightning vs plain, MFU"),
}
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

USAGE = "usage: xsa-lm <command> [hydra overrides | --help | --cfg job | --multirun]\n\ncommands:\n" + "\n".join(
    f"  {name:<13}{help_} (configs/{name}.yaml)" for name, (_, help_) in COMMANDS.items()
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
        from xsa_lm.errors import UserError
        from xsa_lm.train.checks import check_values

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


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    command = sys.argv[1]
    if command not in COMMANDS:
        print(f"xsa-lm: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    module_name, _ = COMMANDS[command]
    check_overrides(command, sys.argv[2:])
    module = importlib.import_module(module_name)
    # Hydra reads its overrides from sys.argv[1:], so the command name goes; the job reads the full command line back
    # through full_command_line().
    os.environ[ARGV_VARIABLE] = json.dumps(sys.argv)
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    module.main()


if __name__ == "__main__":
    main()
