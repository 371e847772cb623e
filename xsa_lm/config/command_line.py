"""The command line: what Hydra would take but should not, Hydra's refusals as one line, the checks every job makes
before it starts, and the full command line read back inside a job."""

import difflib
import glob
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from xsa_lm import errors
from xsa_lm.errors import UserError

ARGV_VARIABLE = "XSA_LM_ARGV"  # the full command line as JSON, for full_command_line()
WITH_A_VALUE = "--cfg -c --package -p -cn --config-name -cd --config-dir -cp --config-path --experimental-rerun"
MULTIRUN_FLAGS = ("--multirun", "-m")
QUOTE_AS_ONE = "a value with spaces or brackets must be quoted as one argument: 'key=a value'"
INFO_TOPICS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
TRAINING_COMMANDS = ("train", "sweep", "scale", "plan")  # their configs compose configs/train.yaml
# Mappings whose keys the user names (a model's LR grid): a new entry is added with `+`, never a typo of another one.
OPEN_MAPPINGS = {"sweep.lr_grids": "the LR grid of another model.name"}
# hydra.sweep.dir's defaults: configs/train.yaml's (train, sweep, scale, plan), Hydra's own (the other commands)
SWEEP_DIRS = ("outputs/multirun/${now:%Y-%m-%d_%H-%M-%S}", "multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}")


def split_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's flags (with their values) and the overrides."""
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        takes_value = arg in WITH_A_VALUE.split() or (
            arg in ("--info", "-i") and i + 1 < len(args) and args[i + 1] in INFO_TOPICS
        )
        width = 2 if arg.startswith("-") and takes_value else 1
        (flags if arg.startswith("-") else overrides).extend(args[i : i + width])
        i += width
    return flags, overrides


def flags_first(args: list[str]) -> list[str]:
    """Hydra's flags before the overrides: argparse refuses `seed=1 --multirun lr=2` with its whole usage text."""
    flags, overrides = split_flags(args)
    return flags + overrides


def check_command_line(args: list[str]) -> str | None:
    """What is wrong with a command line that Hydra would take otherwise, or reports badly (None: nothing)."""
    flags, overrides = split_flags(args)
    for before, word in zip(["", *overrides], overrides, strict=False):
        # Most often the rest of an unquoted value with a space: `data.files=/tmp/my dir/a.txt`, split by the shell.
        if "=" not in word and not word.startswith("~"):
            example = f"'{before} {word}'" if "=" in before else "'key=a value'"
            return (
                f"{word!r} is not an override (key=value): a value with spaces must be quoted as one argument, "
                f"e.g. {example}"
            )
    for key, value in (o.split("=", 1) for o in overrides if override_key(o) in ("hydra.run.dir", "hydra.sweep.dir")):
        if not value.strip():  # Path("") is the current directory
            key = key.lstrip("+")
            return f"{key} is empty (an unset shell variable?): set it to a folder for the results, e.g. {key}=runs/a"
    if any(f in MULTIRUN_FLAGS for f in flags) and any(override_key(o) == "hydra.run.dir" for o in overrides):
        return (
            "hydra.run.dir is not used under --multirun (each job writes to hydra.sweep.dir/hydra.sweep.subdir): "
            "set hydra.sweep.dir=... instead"
        )
    return None


def multirun_problem(command: str, args: list[str]) -> str | None:
    """A command that writes into the working folder only what it is told (hydra.run.dir: .) has no run folder for
    --multirun's jobs: Hydra would leave outputs/multirun/... behind."""
    if not any(a in MULTIRUN_FLAGS for a in args):
        return None
    settings = yaml.safe_load(files("xsa_lm.configs").joinpath(f"{command}.yaml").read_text()) or {}
    if settings.get("hydra", {}).get("run", {}).get("dir") != ".":
        return None
    only = "it writes only what it is told"
    return f"--multirun: xsa-lm {command} makes no run folder for the jobs ({only}): run it once per setting"


def run_hydra(command: str, main: Callable[[], None], args: list[str]) -> None:
    """A command's Hydra main with `args`; a bad command line ends in one line, exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    with errors.exit_on_user_error():
        problem = check_command_line(args) or multirun_problem(command, args)
        if problem:
            raise UserError(problem)
    sys.argv = [sys.argv[0], *flags_first(args)]  # Hydra reads its overrides from sys.argv[1:]
    errors.STARTED[0] = time.time()
    errors.JOB_CHECKS[:] = [check_job]
    if errors.full_errors():
        main()
        return
    os.environ.update({"HYDRA_FULL_ERROR": "1", errors.OURS_VARIABLE: "1"})  # Hydra raises instead of reporting
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        print(f"xsa-lm: error: {hydra_problem(command, e, args)}", file=sys.stderr)
        if any(a in MULTIRUN_FLAGS for a in args):
            remove_refused_sweep_dirs(args)
        sys.exit(errors.EXIT_USER_ERROR)
    except OSError as e:  # Hydra could not make the run directory, before the job started
        key = "hydra.sweep.dir" if any(a in MULTIRUN_FLAGS for a in args) else "hydra.run.dir"
        print(
            f"xsa-lm: error: {key}={e.filename} cannot be created ({e.strerror or e}): choose another", file=sys.stderr
        )
        sys.exit(errors.EXIT_USER_ERROR)
    finally:
        for name in ("HYDRA_FULL_ERROR", errors.OURS_VARIABLE):
            os.environ.pop(name, None)


def remove_refused_sweep_dirs(args: list[str]) -> None:
    """Hydra writes multirun.yaml into hydra.sweep.dir before it composes the jobs: when one is refused, that folder
    (its ${...} parts matched as wildcards) goes again if this command made it and it holds nothing else."""
    _, overrides = split_flags(args)
    given = [o.split("=", 1)[1] for o in overrides if override_key(o) == "hydra.sweep.dir"]
    for pattern in given[-1:] or SWEEP_DIRS:
        for folder in glob.glob(re.sub(r"\$\{[^}]*\}", "*", os.path.expanduser(pattern))):
            errors.remove_refused_sweep_dir(Path(folder))


def hydra_problem(command: str, error: BaseException, args: list[str]) -> str:
    """Hydra's refusal of a command line as one line, with the hint that fixes it where one is cheap."""
    from hydra.errors import OverrideParseException

    _, overrides = split_flags(args)
    quoting = quoting_hint(str(error), overrides)
    if isinstance(error, OverrideParseException):
        return f"{one_line(error)} ({quoting or QUOTE_AS_ONE})"
    if str(error).startswith("Ambiguous value"):  # a comma: a list, a string or a sweep?
        return f"{one_line(error)} ({quoting})" if quoting else one_line(error)
    typo = re.match(r"Could not (?:override|append to config)[^']*'([^']+)'", str(error))
    if not typo:
        return one_line(error)
    # Hydra's hint is to add the key with `+`: the command would never read it. Ours: the closest key.
    key, mapping = typo[1], typo[1].rpartition(".")[0]
    if mapping in OPEN_MAPPINGS:
        return f"{command} has no key {key} yet: add {OPEN_MAPPINGS[mapping]} with +{key}=[...]"
    if mapping == "attention" and command in ("train", "plan"):  # an option of another attention variant
        option, variants = key.partition(".")[2], files("xsa_lm.configs").joinpath("attention")
        chosen = next((o for o in overrides if override_key(o) == "attention"), "the chosen attention")
        takers = [f"attention={f.name[:-5]}" for f in variants.iterdir() if f"\n{option}:" in f"\n{f.read_text()}"]
        return f"{chosen} takes no option {option}" + (f" ({', '.join(takers)} takes it)" if takers else "")
    from xsa_lm.config.spec import all_fields

    text = files("xsa_lm.configs").joinpath(f"{command}.yaml").read_text()  # its own keys: read, not composed
    own = [str(k) for k in yaml.safe_load(text) or {} if k not in ("defaults", "hydra")]
    # 0.85: a typo (lrr, temprature, lmit); a key of another name (accumulate_grad_batches) is shown no lookalike
    keys = own + (list(all_fields()) if command in TRAINING_COMMANDS else [])
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.85)
    hint = f"did you mean {close[0]}?" if close else f"its keys are {', '.join(own)}"
    return f"{command} has no key {key}: {hint} (configs/{command}.yaml)"


def check_job(command: str, choices: dict[str, str | None], config: dict[str, Any], run_dir: Path | None) -> None:
    """Refused before every job: a group's shared part as an option (data=_base), a `???` value, another's folder."""
    from xsa_lm.config.spec import group_options, require_values

    for group, option in choices.items():
        if option is not None and Path(str(option)).name.startswith("_"):  # data/_base.yaml: shared settings
            raise UserError(
                f"{group}={option} is not an option (it holds settings the {group} options share); choose one "
                f"of: {', '.join(group_options(group))}"
            )

    require_values(config)
    elsewhere = another_commands_folder(command, run_dir) if run_dir is not None else None
    if elsewhere:
        raise UserError(elsewhere)


# The files that mark a command's folder: a command refuses another one's (it would overwrite its files or mix them).
FOLDER_MARKS = {
    "train": ("a training run", ("summary.json", "checkpoints")),
    "sweep": ("an `xsa-lm sweep`", ("sweep.json",)),
    "scale": ("an `xsa-lm scale` study", ("scale.json",)),
    "analyze": ("an `xsa-lm analyze`", ("diagnostics.csv",)),
    "eval": ("an `xsa-lm eval`", ("eval.json",)),
}
RESUMING = ("train", "sweep", "scale")  # a rerun into their own folder continues it; the others would overwrite


def another_commands_folder(command: str, folder: Path) -> str | None:
    """The line refusing `xsa-lm <command>` in a folder that holds another command's results, else None."""
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


def override(key: str, value: object) -> str:
    """`key=value` as Hydra reads it back as the string `value` (an argument of a command this program starts): the
    value quoted for Hydra where its grammar would not take it bare (a non-ASCII character, `~`, `,`, `=`, a bracket,
    a value read as a number); a list, each of its elements so."""
    if isinstance(value, list):
        return f"{key}=[{','.join(override(key, element).partition('=')[2] for element in value)}]"
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Quote, QuotedString
    from hydra.errors import HydraException

    text = str(value)
    try:
        bare = OverridesParser.create().parse_override(f"{key}={text}").value() == text
    except HydraException:
        bare = False
    return f"{key}={text if bare else QuotedString(text=text, quote=Quote.double).with_quotes()}"


def pasteable(key: str, value: object) -> str:
    """override(key, value) as one word of a printed command that works pasted into a shell: in single quotes, or in
    double quotes where it holds an apostrophe (bash expands `!` inside double quotes)."""
    word = override(key, value)
    if "'" in word and "!" not in word:
        return '"' + re.sub(r'(["\\$`])', r"\\\1", word) + '"'
    return shlex.quote(word)


def quoting_hint(error: str, overrides: list[str]) -> str | None:
    """A value with an apostrophe, a comma or a non-ASCII character that Hydra refused, quoted as a user types it."""
    bad = next((o for o in overrides if o in error and "=" in o), None)
    if bad is None or not re.search(r"[',]|[^\x00-\x7f]", bad):
        return None
    return (
        "Hydra reads an apostrophe, a comma or a non-ASCII character only inside quotes: quote the value for Hydra "
        f"too, e.g. {pasteable(*bad.split('=', 1))}"
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
    """The command line as typed (`xsa-lm train ...`), also in a job whose sys.argv was shortened for Hydra."""
    saved = json.loads(os.environ.get(ARGV_VARIABLE, "null"))
    if saved and [saved[0], *flags_first(saved[2:])] == sys.argv:  # exported for this process, not a parent's
        return [str(word) for word in saved]
    return list(sys.argv)
