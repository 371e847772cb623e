"""A resume continues the run as it was: its saved config.yaml decides what is trained; the command line may change
only the keys marked FREE (config/spec.py), any other difference is refused as `key: saved -> given`."""

from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import OmegaConf

from xsa_lm.config.command_line import override_key
from xsa_lm.config.spec import flatten, is_free
from xsa_lm.errors import UserError, yaml_problem

Config = dict[str, Any]  # a composed config as plain dicts and lists (OmegaConf.to_container)


def continuation_config(
    given: Config, defaults: Config, overrides: list[str], run_dir: Path
) -> tuple[Config, list[str]]:
    """The saved config.yaml with the command line's free changes (what `overrides` name or differs from the
    `defaults`); a new folder: `given`. Returns it and the lines saying what changed, the LR schedule's last."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.exists():
        if (run_dir / "checkpoints").exists() or (run_dir / "summary.json").exists():  # its run's config is gone
            raise UserError(
                f"resume: {run_dir} holds a run but no config.yaml, the config it was trained with: put it back, or "
                "start a new run from one of its checkpoints in another hydra.run.dir (resume=<checkpoint>)"
            )
        return given, []
    try:
        saved = cast(Config, OmegaConf.to_container(OmegaConf.load(saved_file), resolve=True))
    except yaml.YAMLError as e:
        raise UserError(
            f"resume: {saved_file} is not valid YAML{yaml_problem(e)}: put back the config the run saved"
        ) from None
    saved_flat, given_flat, default_flat = flatten(saved), flatten(given), flatten(defaults)
    # The run clipped a warmup longer than its schedule to the schedule (TrainSpec.schedule): given again, no change.
    warmup, total = given_flat.get("scheduler.warmup_steps"), saved_flat["scheduler.total_steps"]
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
    merged = OmegaConf.create(saved)
    for key, (_, new) in changes.items():
        OmegaConf.update(merged, key, new, force_add=True)
    merged.resume = given["resume"]
    notes = [f"{k}: {old} -> {new}" for k, (old, new) in changes.items()]
    config = cast(Config, OmegaConf.to_container(merged, resolve=True))
    return config, [*notes, schedule_note(total, config)]


def edited_since(trained: Config, config: Config, *, free: bool = False) -> list[str]:
    """`key: trained -> now` for each key config.yaml's hand edits changed since the checkpoint's config `trained`:
    those a resume may not change, or (`free`) those it may."""
    then, now = flatten(trained), flatten(config)
    return [f"{k}: {v} -> {now[k]}" for k, v in then.items() if k in now and now[k] != v and is_free(k) == free]


def with_hand_edits(notes: list[str], *, trained: Config, config: Config) -> list[str]:
    """`notes` with the free keys edited by hand since the checkpoint's config `trained`, and its schedule's note."""
    named = {note.split(":")[0] for note in notes} | {"resume"}
    edited = [e for e in edited_since(trained, config, free=True) if e.split(":")[0] not in named]
    edits = [f"{e} (config.yaml edited since the checkpoint)" for e in edited]
    then = flatten(trained)
    total = then.get("scheduler.total_steps") or then.get("trainer.max_steps")
    schedule = [schedule_note(total, config)] if isinstance(total, int) else notes[-1:]
    return [*notes[:-1], *edits, *schedule]


def schedule_note(saved_total_steps: int, config: Config) -> str:
    """How the LR schedule continues, for the resume's first line."""
    scheduler, max_steps = config["scheduler"], config["trainer"]["max_steps"]
    total = scheduler["total_steps"] or max_steps
    if total != saved_total_steps:
        return f"LR schedule recomputed for scheduler.total_steps={total} (was {saved_total_steps})"
    if max_steps > total:
        final = config["optim"]["lr"] * scheduler["min_lr_ratio"]
        return (
            f"LR schedule keeps its saved length (scheduler.total_steps={total}): steps {total}-"
            f"{max_steps} run at the final LR {final:g} (pass scheduler.total_steps to recompute it)"
        )
    return f"LR schedule as saved (scheduler.total_steps={total})"
