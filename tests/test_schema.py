"""The training config is typed (xsa_lm/config/schema.py): a renamed or misspelt key fails when the config is composed
or when the run starts, every field has a real type, and every checked field names a key the config has."""

import dataclasses
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tests.helpers import REPO, compose_train, refused_in_process
from xsa_lm.config.builders import model_config
from xsa_lm.config.checks import check_values
from xsa_lm.config.resume import continuation_config
from xsa_lm.config.schema import (
    ATTENTION_FIELDS,
    SCHEMAS,
    TrainOptions,
    check_known_keys,
    hydra_schema,
    knob,
    register,
)
from xsa_lm.errors import UserError
from xsa_lm.model import GPTConfig

CONFIGS = REPO / "configs"
MODELS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml") if not p.stem.startswith("_"))


def compose_copy(configs: Path, overrides: list[str]) -> DictConfig:
    """configs/train.yaml of a changed copy of the config tree (its schemas registered, as xsa_lm.configs does)."""
    register()
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def every_schema(schemas: list[type]) -> list[type]:
    """The schemas and the schemas of their fields, down to the leaves."""
    nested = [k for s in schemas for f in dataclasses.fields(s) for k in typing.get_args(f.type) or [f.type]]
    inner = [k for k in nested if dataclasses.is_dataclass(k) and k not in schemas]
    return schemas + every_schema(inner) if inner else schemas


@pytest.mark.parametrize("model", MODELS)
def test_every_preset_holds_exactly_the_architecture_fields(model: str):
    cfg = compose_train([f"model={model}"])
    architecture = {f.name for f in dataclasses.fields(GPTConfig)} - set(ATTENTION_FIELDS)
    assert set(cfg.model) == architecture | {"name"} and cfg.model.name == model


def test_a_short_preset_takes_the_model_defaults():
    tiny, d32 = compose_train(["model=tiny"]).model, compose_train(["model=tiny_d32"]).model
    defaults = GPTConfig()
    assert (tiny.n_layer, tiny.d_model, tiny.block_size) == (defaults.n_layer, defaults.d_model, defaults.block_size)
    assert d32.d_model == 32 and d32.block_size == defaults.block_size and d32.vocab_size is None
    assert model_config(compose_train(["model=tiny_d32"]), vocab_size=500).vocab_size == 512


@pytest.mark.parametrize("override", ["model.n_layer=four", "model.bias=maybe", "attention.eps=small"])
def test_a_value_of_the_wrong_type_fails_at_composition(override: str):
    with pytest.raises((HydraException, OmegaConfBaseException)):
        compose_train([override])


def test_a_typo_in_a_preset_file_fails_at_composition(tmp_path: Path):
    configs = shutil.copytree(REPO / "configs", tmp_path / "configs")
    preset = (configs / "model" / "tiny.yaml").read_text().replace("name: tiny", "name: typo\nn_layr: 3")
    (configs / "model" / "typo.yaml").write_text(preset)
    with pytest.raises((HydraException, OmegaConfBaseException), match="n_layr"):
        compose_copy(configs, ["model=typo"])


def test_an_appended_key_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    with pytest.raises(UserError, match=r"model\.n_layr: not an option of the model group"):
        check_known_keys(compose_train(["+model.n_layr=3"]))
    check_known_keys(compose_train(["attention=xsa", "attention.layers=[0,1]"]))
    stderr = refused_in_process(
        ["train", "+attention.gates=tanh", f"hydra.run.dir={tmp_path}/run"], monkeypatch, capsys
    )
    assert stderr.strip() == (
        "xsa-lm: error: attention.gates: not an option of the attention group (it has name, eps, layers, gate)"
    )


def test_the_cli_reports_a_wrong_type_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    stderr = refused_in_process(["train", "model.n_layer=four", f"hydra.run.dir={tmp_path}/run"], monkeypatch, capsys)
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "model.n_layer=four" in stderr and not (tmp_path / "run").exists()


def test_the_resolved_model_group_round_trips_through_config_yaml(tmp_path: Path):
    # A run saves its config resolved and a resume composes against it: the typed node must survive the trip.
    cfg = compose_train(["model=paper_0.7b", "attention=xsa", "attention.layers=2"])
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert OmegaConf.to_container(saved.model) == OmegaConf.to_container(cfg.model)
    assert saved.attention.layers == 2


@pytest.mark.parametrize(
    "path, key, renamed",
    [
        ("train.yaml", "  keep_last:", "  keep_lst:"),  # a node of train.yaml
        ("data/_base.yaml", "num_workers:", "num_worker:"),
        ("optim/adamw.yaml", "weight_decay:", "wd:"),
        ("scheduler/warmup_cosine.yaml", "warmup_steps:", "warmup:"),
        ("trainer/default.yaml", "max_steps:", "max_step:"),
        ("tokenizer/bpe.yaml", "vocab_size:", "vocab:"),
        ("logger/wandb.yaml", "  mode:", "  mod:"),
    ],
)
def test_a_renamed_key_in_a_config_file_fails_at_composition(tmp_path: Path, path: str, key: str, renamed: str):
    configs = shutil.copytree(CONFIGS, tmp_path / "configs")
    text = (configs / path).read_text()
    assert text.count(key) == 1
    (configs / path).write_text(text.replace(key, renamed))
    with pytest.raises((HydraException, OmegaConfBaseException), match=renamed.strip(" :")):
        compose_copy(configs, [])


def test_a_renamed_top_level_key_fails_before_the_run_starts(tmp_path: Path):
    # The root stays open to the keys sweep, scale and plan add beside the training config: checked at the start.
    configs = shutil.copytree(CONFIGS, tmp_path / "configs")
    text = (configs / "train.yaml").read_text()
    (configs / "train.yaml").write_text(text.replace("\nprogress_bar:", "\nprogres_bar:"))
    cfg = compose_copy(configs, [])
    with pytest.raises(UserError, match=r"^progres_bar: not an option of configs/train.yaml \(it has seed, "):
        check_values(cfg)
    for command in ("plan", "sweep", "scale"):  # their own keys beside the training config's are theirs
        check_values(compose_train([], config_name=command))


def test_a_key_checked_where_present_is_in_some_option():
    # A checked key that an option lacks is refused as missing: test_configs.py checks the config of every option.
    fsdp = compose_train(["trainer=fsdp"])
    assert fsdp.trainer.strategy.tensor_parallel_size == 1


def test_every_field_has_a_real_type():
    schemas = every_schema([TrainOptions, *SCHEMAS.values()])
    assert len(schemas) > 20
    untyped = [f"{s.__name__}.{f.name}" for s in schemas for f in dataclasses.fields(s) if f.type is Any]
    assert not untyped, untyped


def test_hydra_holds_a_checked_field_untyped_and_the_others_typed():
    trainer = {f.name: f.type for f in dataclasses.fields(hydra_schema(SCHEMAS["_trainer_schema"]))}
    assert trainer["max_steps"] is Any and trainer["activation_checkpointing"] is Any  # checked: 1.5 reaches its check
    assert trainer["precision"] is str and trainer["enable_model_summary"] is bool
    assert trainer["deterministic"] is Any  # bool | "warn": no type of OmegaConf's
    attention = {f.name: f.type for f in dataclasses.fields(hydra_schema(SCHEMAS["_attention_schema"]))}
    assert attention["eps"] is float  # GPTConfig checks it: typed, as the model's fields are


@pytest.mark.parametrize(
    "annotation, check, value, problem",
    [
        (int, knob(ge=1), 0, "must be >= 1"),
        (int, knob(ge=1), True, "must be an integer"),
        (int | None, knob(ge=0, le=9), 10, "must be >= 0 and <= 9"),
        (int | None, knob(ge=0), "x", "must be an integer or null"),
        (int | None, knob(ge=0), None, None),
        (float, knob(gt=0), 0, "must be > 0"),
        (float, knob(ge=0, le=1), 1.5, "must be in [0, 1]"),
        (float | None, knob(ge=0, lt=1), 1, "must be in [0, 1)"),
        (float, knob(gt=0), float("nan"), "must be a finite number"),
        (bool, knob(), 1, "must be true or false"),
        (bool | typing.Literal["auto"], knob(), "yes", "must be true, false or auto"),
        (int | typing.Literal["auto"], knob(ge=0), -1, "must be >= 0 or auto"),
        (int | typing.Literal["auto"], knob(ge=0), "auto", None),
        (str, knob(rule=lambda v: None if v == "a" else "must be a"), "b", "must be a"),
    ],
)
def test_a_field_checks_its_type_and_bounds(annotation: Any, check: Any, value: Any, problem: str | None):
    assert check.metadata["check"].problem(annotation, value) == problem


def test_a_rule_whose_key_is_missing_is_an_error():
    cfg = OmegaConf.create(OmegaConf.to_container(compose_train([])))  # as a resume reads config.yaml back
    check_values(cfg)
    del cfg.checkpoint["keep_last"]
    with pytest.raises(UserError, match=r"^checkpoint.keep_last is missing from the config"):
        check_values(cfg)


def test_a_run_saved_before_a_free_key_existed_resumes_with_it(tmp_path: Path):
    """config.yaml of a run saved before `profile` and checkpoint.every_n_steps existed: the resume takes them as
    given (keys a resume may change anyway); a missing key a resume may not change stays missing, and is refused."""
    given = compose_train(["resume=auto"])  # the default logger, wandb
    saved = OmegaConf.create(OmegaConf.to_container(compose_train(["logger=csv"])))
    del saved["profile"], saved.checkpoint["every_n_steps"], saved.optim["weight_decay"]
    OmegaConf.save(saved, tmp_path / "config.yaml")
    merged, _ = continuation_config(given, compose_train([]), ["resume=auto"], tmp_path)
    assert merged.profile == given.profile and merged.checkpoint.every_n_steps == given.checkpoint.every_n_steps
    assert "weight_decay" not in merged.optim  # what the model learns with: never filled in silently
    assert "wandb" not in merged.logger  # a group's keys are those of the saved option
    with pytest.raises(UserError, match=r"^optim.weight_decay is missing from the config"):
        check_values(merged)


@pytest.mark.parametrize(
    "override, message",
    [
        ("+optim.lrr=0.1", "optim.lrr: not an option of the optim group (it has _target_, _partial_, lr, "),
        ("+trainer.max_step=5", "trainer.max_step: not an option of the trainer group"),
        ("+checkpoint.keep=1", "checkpoint.keep: not an option of checkpoint (it has keep_last, every_n_steps, "),
        ("+logger.wandb.projct=x", "logger.wandb.projct: not an option of logger.wandb (it has _target_, project, "),
        ("+seeed=1", "seeed: not an option of configs/train.yaml"),
    ],
)
def test_an_appended_key_anywhere_is_refused(override: str, message: str):
    with pytest.raises(UserError) as error:
        check_values(compose_train([override]))
    assert str(error.value).startswith(message), error.value
