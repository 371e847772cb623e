"""The command line: checked against the composed config before Hydra runs, and read back inside a job."""

import difflib
import errno
import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import NoReturn, cast

ARGV_VARIABLE = "XSA_LM_ARGV"  # the full command line as JSON, for full_command_line()
HYDRA_FLAGS_WITHOUT_CHECK = (
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
)
HYDRA_FLAGS_WITH_A_VALUE = (
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--experimental-rerun",
)
MULTIRUN_FLAGS = ("--multirun", "-m")
QUOTE_AS_ONE = "a value with spaces or brackets must be quoted as one argument: 'key=a value'"
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's flags (with their values) and the overrides."""
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        takes_value = arg in HYDRA_FLAGS_WITH_A_VALUE or (
            arg in ("--info", "-i") and i + 1 < len(args) and args[i + 1] in INFO_TOPICS
        )
        if arg.startswith("-") and takes_value:
            flags += args[i : i + 2]
            i += 2
            continue
        (flags if arg.startswith("-") else overrides).append(arg)
        i += 1
    return flags, overrides


def flags_first(args: list[str]) -> list[str]:
    """Hydra's flags (with their values) before the overrides: argparse refuses a flag placed between overrides
    (`seed=1 --multirun lr=2`) with its whole usage text, while a user means the same command either way."""
    flags, overrides = split_flags(args)
    return flags + overrides


def refuse(message: str) -> NoReturn:
    print(f"xsa-lm: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_overrides(config_name: str, args: list[str]) -> None:
    """Compose the config before Hydra runs (under --multirun, that of every job), so that an unknown option or a
    typo'd key ends in one actionable line and exit code 2 instead of Hydra's multi-line report (HYDRA_FULL_ERROR=1
    keeps Hydra's)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or any(a in HYDRA_FLAGS_WITHOUT_CHECK for a in args):
        return
    _, overrides = split_flags(args)
    check_words(overrides)
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    multirun = any(a in MULTIRUN_FLAGS for a in args)
    if multirun and any(override_key(o) == "hydra.run.dir" for o in overrides):
        refuse(
            "hydra.run.dir is not used under --multirun (each job writes to hydra.sweep.dir/hydra.sweep.subdir): "
            "set hydra.sweep.dir=... instead"
        )
    job, jobs, configs = overrides, [overrides], []
    try:
        with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
            if multirun:
                jobs = sweep_jobs(config_name, overrides)
            for job in jobs:
                configs.append(compose(config_name=config_name, overrides=job, return_hydra_config=True))
            # resolved here: ${now:...} needs Hydra's resolvers
            run_dir_value = configs[0].hydra.sweep.dir if multirun else configs[0].hydra.run.dir
    except (HydraException, OmegaConfBaseException) as e:
        quoting = quoting_hint(str(e), overrides)
        if isinstance(e, OverrideParseException):
            refuse(f"{one_line(e)} ({quoting or QUOTE_AS_ONE})")
        if str(e).startswith("Ambiguous value"):  # a comma: a list, a string or a sweep?
            refuse(f"{one_line(e)} ({quoting})" if quoting else one_line(e))
        typo = re.match(r"Could not override '([^']+)'", str(e))  # Hydra's hint is to add it with `+`: never read
        unknown = typo and no_such_key(config_name, typo.group(1), [o for o in job if override_key(o) != typo[1]])
        refuse(f"{unknown or one_line(e)}{job_named(job, jobs)}")
    for cfg, job in zip(configs, jobs, strict=True):
        for group, option in cfg.hydra.runtime.choices.items():
            if option is not None and Path(str(option)).name.startswith("_"):  # data/_base.yaml: shared settings
                refuse(
                    f"{group}={option} is not an option (it holds settings the {group} options share); choose one "
                    f"of: {', '.join(group_options(group))}{job_named(job, jobs)}"
                )
        everything = cast(dict, OmegaConf.to_container(cfg, resolve=False))  # a DictConfig gives a dict
        missing = [k for k, v in flatten(everything).items() if v == "???" and k.split(".")[0] != "hydra"]
        if missing:
            refuse(
                f"missing required value(s): {', '.join(missing)}; set them on the command line, e.g. "
                f"{missing[0]}=...{job_named(job, jobs)}"
            )
    if config_name not in ("train", "sweep", "scale"):  # train's schema refuses a key it lacks (check_known_keys)
        for job in jobs:
            check_appended_keys(config_name, job, jobs)
    if any(a in ("--cfg", "-c") for a in args):  # prints the config: no run, no run directory
        return
    if config_name in ("train", "sweep", "scale"):  # wrong types or ranges: before torch and Lightning load (5 s)
        from xsa_lm.config.checks import check_values
        from xsa_lm.errors import UserError

        for cfg, job in zip(configs, jobs, strict=True):
            try:
                check_values(cfg)
            except UserError as e:
                refuse(f"{e}{job_named(job, jobs)}")
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if run_dir_value is None or not str(run_dir_value).strip():  # Path("") is the current directory
        refuse(f"{key} is empty (an unset shell variable?): set it to a folder for the results, e.g. {key}=runs/a")
    run_dir = Path(run_dir_value)
    elsewhere = None if multirun else another_commands_folder(config_name, run_dir)
    if elsewhere:
        refuse(elsewhere)
    # Hydra creates the run directory (a multirun's sweep directory) before the job starts: a path that cannot exist
    # fails here, in one line. The folders made for the test are removed again: a default one holds the time, which
    # Hydra reads anew.
    absent = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        refuse(f"{key}={run_dir} cannot be created ({e.strerror or e}): choose another")
    for folder in absent:  # deepest first
        try:
            folder.rmdir()
        except OSError as e:  # a sweep's trials start at once: another one's run directory is in this parent now
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise
            break  # its parents hold it too


# The files that mark a command's folder (what a rerun resumes from). A command refuses a folder another one wrote:
# it would overwrite that one's files (config.yaml, report.md, results.json) or mix its own in.
FOLDER_MARKS = {
    "train": ("a training run", ("summary.json", "checkpoints")),
    "sweep": ("an `xsa-lm sweep`", ("sweep.json",)),
    "scale": ("an `xsa-lm scale` study", ("scale.json",)),
    "analyze": ("an `xsa-lm analyze`", ("diagnostics.csv",)),
    "eval": ("an `xsa-lm eval`", ("eval.json",)),
}
RESUMING = ("train", "sweep", "scale")  # a rerun into their own folder continues it; the others would overwrite


def another_commands_folder(command: str, folder: Path) -> str | None:
    """The line refusing `xsa-lm <command>` in a folder that holds another command's results; None where it holds
    none (or the command is not one that FOLDER_MARKS knows)."""
    if command not in FOLDER_MARKS:
        return None
    run = next((p for p in folder.absolute().parents if (p / "run_info.json").is_file()), None)
    if run is not None:  # e.g. hydra.run.dir=runs/a/checkpoints: the run's own files would mix with ours
        return f"hydra.run.dir={folder} is inside the training run {run} (run_info.json): choose a folder outside it"
    continued_by = [m for c in ("sweep", "scale") for m in FOLDER_MARKS[c][1]]
    if (folder / "results.json").is_file() and not any((folder / m).exists() for m in continued_by):
        return (  # a study's report without the state that continues it (results/ ships such folders)
            f"hydra.run.dir={folder} holds a study's results (results.json) without the sweep.json or scale.json "
            f"that would continue it: xsa-lm {command} would overwrite its files; choose a new hydra.run.dir"
        )
    for other, (what, marks) in FOLDER_MARKS.items():
        found = [m + ("/" if (folder / m).is_dir() else "") for m in marks if (folder / m).exists()]
        if found and other != command:
            return (
                f"hydra.run.dir={folder} holds {what} ({', '.join(found)}): xsa-lm {command} would overwrite its "
                "files; choose a new hydra.run.dir"
            )
        if found and command not in RESUMING:
            return (
                f"hydra.run.dir={folder} holds the results of an earlier xsa-lm {command} ({', '.join(found)}): "
                "it would overwrite them; choose a new hydra.run.dir"
            )
    return None


def override_key(override: str) -> str:
    """The key of `key=value`, `+key=value`, `++key=value` or `~key`."""
    return override.split("=", 1)[0].lstrip("~+")


def flatten(node: dict[str, object], prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are values."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# Mappings whose keys the user names (a model's LR grid): a new entry is added with `+`, never a typo of another one.
OPEN_MAPPINGS = {"sweep.lr_grids": "the LR grid of another model.name"}


def no_such_key(config_name: str, key: str, overrides: list[str]) -> str | None:
    """`<command> has no key K: did you mean ...?`, the closest key of the config the other overrides compose (None
    where they compose none)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException):
        return None
    leaves = [key.split(".") for key in flatten(cast(dict, OmegaConf.to_container(cfg, resolve=False)))]
    keys = list(dict.fromkeys(".".join(parts[:n]) for parts in leaves for n in range(1, len(parts) + 1)))  # nodes too
    if key in keys:
        return None
    mapping = key.rpartition(".")[0]
    if mapping in OPEN_MAPPINGS:
        return f"{config_name} has no key {key} yet: add {OPEN_MAPPINGS[mapping]} with +{key}=[...]"
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f"did you mean {close[0]}?" if close else f"its keys are {', '.join(k for k in keys if '.' not in k)}"
    return f"{config_name} has no key {key}: {hint} (configs/{config_name}.yaml)"


def check_appended_keys(config_name: str, job: list[str], jobs: list[list[str]]) -> None:
    """A `+key=value` that adds a key the command's config lacks would be ignored without a word (the command reads
    only its own keys): refused, naming the closest key. `+hydra.*` (Hydra's own settings) stays."""
    for override in job:
        key = override_key(override).split("@")[0]  # +group@package=option: the group
        if not override.startswith("+") or key.startswith("hydra."):
            continue
        others = [o for o in job if not o.startswith("+") or o == override]  # `++key` may override a key it has
        unknown = no_such_key(config_name, key, [o for o in others if o != override])
        if unknown:
            refuse(f"{unknown}; {config_name} would ignore {override}{job_named(job, jobs)}")


def group_options(group: str) -> list[str]:
    """The options of a config group a user can choose: its YAML files, but those named _* (shared parts)."""
    from importlib.resources import files

    folder = files("xsa_lm.configs").joinpath(group)
    names = [entry.name for entry in folder.iterdir()] if folder.is_dir() else []
    return sorted(name.removesuffix(".yaml") for name in names if name.endswith(".yaml") and name[0] != "_")


def check_words(overrides: list[str]) -> None:
    """An argument that is no override (`key=value`, `~key`) is most often the rest of an unquoted value with a
    space, which the shell split: `data.files=/tmp/my dir/a.txt` is `data.files=/tmp/my` and `dir/a.txt`."""
    for before, word in zip(["", *overrides], overrides, strict=False):
        if "=" not in word and not word.startswith("~"):
            example = f"'{before} {word}'" if "=" in before else "'key=a value'"
            refuse(
                f"{word!r} is not an override (key=value): a value with spaces must be quoted as one argument, "
                f"e.g. {example}"
            )


def sweep_jobs(config_name: str, overrides: list[str]) -> list[list[str]]:
    """The jobs of `--multirun`, each as its overrides: what Hydra's basic sweeper launches, the product of the
    sweeps on the command line and in the config's hydra.sweeper.params (an experiment sets them). Another sweeper
    chooses its own jobs: the command line without its sweeps stands for them. The basic sweeper's rule, in Hydra's
    public override API: a key given again replaces its earlier values, and the jobs are the product of them all."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from hydra.types import RunMode

    hydra = GlobalHydra.instance().hydra
    assert hydra is not None  # inside initialize_config_module
    master = hydra.compose_config(config_name, overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    parser = OverridesParser.create(config_loader=hydra.config_loader)
    if not str(master.hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"):
        return [[o for o in overrides if not parser.parse_override(o).is_sweep_override()]]
    params = [f"{key}={value}" for key, value in (master.hydra.sweeper.get("params") or {}).items()]
    values: dict[str, list[str]] = {}
    for override in parser.parse_overrides(params + overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            values[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:  # a range of reals: the basic sweeper's own refusal
            raise HydraException(f"BasicSweeper does not support sweep type : {override.value_type.name}")  # type: ignore[union-attr]
    return [list(job) for job in itertools.product(*values.values())]


def job_named(job: list[str], jobs: list[list[str]]) -> str:
    """Which job of a multirun a message is about (nothing for a single run)."""
    return f" (in the job {' '.join(job)})" if len(jobs) > 1 else ""


def quoting_hint(error: str, overrides: list[str]) -> str | None:
    """For a value with an apostrophe, a comma or a non-ASCII character that Hydra's grammar refused: the same value
    quoted for Hydra inside the shell's quotes, as the user would type it (a value with a double quote or a backslash
    gets no example)."""
    bad = next((o for o in overrides if o in error and "=" in o), None)
    if bad is None or not re.search(r"[',]|[^\x00-\x7f]", bad) or re.search(r'["\\$`]', bad):
        return None
    key, value = bad.split("=", 1)
    return (
        "Hydra reads an apostrophe, a comma or a non-ASCII character only inside quotes: quote the value for Hydra "
        f'too, e.g. "{key}=\\"{value}\\""'
    )


def one_line(error: BaseException) -> str:
    """Hydra's message without the search-path listing, on one line."""
    noise = ("provider=", "Config search path", "full_key:", "object_type=", "reference_type=")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = error.__cause__
    if cause is not None and str(cause).splitlines()[0].strip() not in lines:
        lines.append(str(cause).splitlines()[0].strip())
    kept = [line for line in lines if not line.startswith(noise)]
    text = " ".join(kept).replace(" Available options in", "; available options in").replace(":\t", ": ")
    head, listed, options = text.partition("; available options in ")
    return head + listed + re.sub(r" _[\w.-]+", "", options)  # data/_base.yaml is a shared part, not an option


def full_command_line() -> list[str]:
    """The command line as typed (`xsa-lm train ...`), also inside a job whose sys.argv main() has shortened for
    Hydra. Lightning's DDP launcher re-runs sys.argv for the other ranks, and run_info.json records it."""
    saved = json.loads(os.environ.get(ARGV_VARIABLE, "null"))
    if (
        saved and [saved[0], *flags_first(saved[2:])] == sys.argv
    ):  # exported for this process, not inherited from a parent's
        return saved
    return list(sys.argv)
