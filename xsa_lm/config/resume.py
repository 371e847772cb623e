"""A resume continues the run as it was: its saved config.yaml, not the defaults, decides what is trained.

The command line of a resume may change only what cannot change the model being trained (how long, how often it is
validated and logged, on how many devices); any other difference is refused, naming each key as `key: saved -> given`.
The LR schedule keeps its saved length: extending trainer.max_steps continues at the final LR, exactly as a run
planned with that many steps and the same scheduler.total_steps would; passing scheduler.total_steps recomputes the
cosine for the new length.
"""

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import cast

import yaml
from omegaconf import DictConfig, OmegaConf

from xsa_lm.config.command_line import flatten, override_key
from xsa_lm.config.schema import GROUP_SCHEMAS, GROUPS, TrainOptions
from xsa_lm.errors import UserError, yaml_problem


def free_on_resume() -> list[str]:
    """The keys a resume may change (schema.FREE); a node's ending in `.`: all of its keys."""
    free = ["logger."]  # where the run reports
    for prefix, schema in [("", TrainOptions), *((f"{group}.", s) for group, s in GROUP_SCHEMAS.items())]:
        nodes = [f for f in fields(schema) if f.metadata.get("free_on_resume")]
        free += [f"{prefix}{f.name}{'.' if is_dataclass(f.type) else ''}" for f in nodes]
    return free


def plain(config: DictConfig) -> dict[str, object]:
    """The config resolved into plain dicts and lists."""
    return cast(dict[str, object], OmegaConf.to_container(config, resolve=True))  # a DictConfig gives a dict


def is_free(key: str) -> bool:
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in free_on_resume())


def continuation_config(
    given: DictConfig, defaults: DictConfig, overrides: list[str], run_dir: Path
) -> tuple[DictConfig, list[str]]:
    """The config a resume into `run_dir` trains with: the saved config.yaml, with the command line's changes
    (the keys `overrides` name, and any other key where `given` differs from the untouched `defaults`, as an
    `experiment=` sets) applied where they are free, else refused. A new run directory (no config.yaml) starts a
    new run from the checkpoint (`resume=PATH`): the given config as it is; one that holds a run without a readable
    config.yaml is refused. Returns the config and the lines that say what changed, the LR schedule's last."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.exists():
        if (run_dir / "checkpoints").exists() or (run_dir / "summary.json").exists():  # its run's config is gone
            raise UserError(
                f"resume: {run_dir} holds a run but no config.yaml, the config it was trained with: put it back, or "
                "start a new run from one of its checkpoints in another hydra.run.dir (resume=<checkpoint>)"
            )
        return given, []
    try:
        saved = cast(DictConfig, OmegaConf.load(saved_file))  # written by xsa-lm train: a mapping
    except yaml.YAMLError as e:
        raise UserError(
            f"resume: {saved_file} is not valid YAML{yaml_problem(e)}: put back the config the run saved"
        ) from None
    if saved.scheduler.get("total_steps") is None:  # written before the schedule length was resolved into it
        saved.scheduler.total_steps = saved.trainer.max_steps
    saved_flat, given_flat, default_flat = (flatten(plain(c)) for c in (saved, given, defaults))
    # The run clipped a warmup longer than its schedule to the schedule (settle_schedule): given again, it is no change.
    warmup, total = given_flat.get("scheduler.warmup_steps"), saved.scheduler.total_steps
    if saved_flat.get("scheduler.warmup_steps") == total and isinstance(warmup, int) and warmup > total:
        given_flat["scheduler.warmup_steps"] = total
    named = [override_key(o) for o in overrides]  # `attention=sa` names attention.*
    on_command_line = {
        k: v
        for k, v in given_flat.items()
        if k not in default_flat or default_flat[k] != v or any(k == n or k.startswith(f"{n}.") for n in named)
    }
    changes = {k: (saved_flat.get(k, "<unset>"), v) for k, v in on_command_line.items() if saved_flat.get(k) != v}
    changes.pop("resume", None)
    refused = [f"{k}: {old} -> {new}" for k, (old, new) in changes.items() if not is_free(k)]
    if refused:
        raise UserError(
            f"resume: the run in {run_dir} was trained with another config ({'; '.join(refused)}); a resume continues "
            "the saved config.yaml: drop these overrides, or start a new run in another hydra.run.dir"
        )
    merged = OmegaConf.create(plain(saved))
    for key, (_, new) in changes.items():
        OmegaConf.update(merged, key, new, force_add=True)
    for key, value in given_flat.items():  # free keys added to train.yaml after this run was saved: as given
        in_group = key.split(".")[0] in GROUPS  # a group's keys follow the saved option (logger=csv has no wandb)
        if key not in saved_flat and key not in changes and is_free(key) and not in_group:
            OmegaConf.update(merged, key, value, force_add=True)
    merged.resume = given.resume
    notes = [f"{k}: {old} -> {new}" for k, (old, new) in changes.items()]
    return merged, [*notes, schedule_note(saved.scheduler.total_steps, merged)]


def edited_since(trained: dict[str, object], config: DictConfig) -> list[str]:
    """`key: trained -> now` for each key a resume may not change whose value in `config` differs from the config a
    checkpoint was trained with (`trained`, saved in the checkpoint): a run folder's config.yaml edited by hand."""
    then, now = flatten(trained), flatten(plain(config))
    return [f"{k}: {v} -> {now[k]}" for k, v in then.items() if k in now and now[k] != v and not is_free(k)]


def with_hand_edits(notes: list[str], *, trained: dict[str, object], config: DictConfig) -> list[str]:
    """A continuation's `notes` (continuation_config's), completed from the config its checkpoint was trained with
    (`trained`): each key a resume may change whose config.yaml value was edited by hand since, then the LR
    schedule's note told from the checkpoint's schedule, not the edited one."""
    named = {note.split(":")[0] for note in notes}
    then, now = flatten(trained), flatten(plain(config))
    edits = [
        f"{k}: {v} -> {now[k]} (config.yaml edited since the checkpoint)"
        for k, v in then.items()
        if k in now and now[k] != v and k not in named and k != "resume"
    ]
    total = then.get("scheduler.total_steps") or then.get("trainer.max_steps")
    schedule = [schedule_note(total, config)] if isinstance(total, int) else notes[-1:]
    return [*notes[:-1], *edits, *schedule]


def schedule_note(saved_total_steps: int, config: DictConfig) -> str:
    """How the LR schedule continues, for the resume's first line."""
    total = config.scheduler.total_steps
    if total != saved_total_steps:
        return f"LR schedule recomputed for scheduler.total_steps={total} (was {saved_total_steps})"
    if config.trainer.max_steps > total:
        final = config.optim.lr * config.scheduler.min_lr_ratio
        return (
            f"LR schedule keeps its saved length (scheduler.total_steps={total}): steps {total}-"
            f"{config.trainer.max_steps} run at the final LR {final:g} (pass scheduler.total_steps to recompute it)"
        )
    return f"LR schedule as saved (scheduler.total_steps={total})"
