"""The model and attention groups are typed (xsa_lm/schema.py): mistakes fail when the config is composed."""

import dataclasses
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tests.conftest import REPO, run_cli
from xsa_lm.errors import UserError
from xsa_lm.model import GPTConfig
from xsa_lm.schema import ATTENTION_FIELDS, check_known_keys
from xsa_lm.train.run import model_config

MODELS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml") if not p.stem.startswith("_"))


def compose_train(overrides: list[str]):
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


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
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        with pytest.raises((HydraException, OmegaConfBaseException), match="n_layr"):
            compose(config_name="train", overrides=["model=typo"])


def test_an_appended_key_is_refused_in_one_line(tmp_path: Path):
    with pytest.raises(UserError, match=r"model\.n_layr: not an option of the model group"):
        check_known_keys(compose_train(["+model.n_layr=3"]))
    check_known_keys(compose_train(["attention=xsa", "attention.layers=[0,1]"]))
    result = run_cli(["train", "+attention.gates=tanh", f"hydra.run.dir={tmp_path}/run"], tmp_path, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "xsa-lm: error: attention.gates: not an option of the attention group (it has name, eps, layers, gate)"
    )


def test_the_cli_reports_a_wrong_type_in_one_line(tmp_path: Path):
    result = run_cli(["train", "model.n_layer=four", f"hydra.run.dir={tmp_path}/run"], tmp_path, cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "model.n_layer=four" in result.stderr and not (tmp_path / "run").exists()


def test_the_resolved_model_group_round_trips_through_config_yaml(tmp_path: Path):
    # A run saves its config resolved and a resume composes against it: the typed node must survive the trip.
    cfg = compose_train(["model=paper_0.7b", "attention=xsa", "attention.layers=2"])
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert OmegaConf.to_container(saved.model) == OmegaConf.to_container(cfg.model)
    assert saved.attention.layers == 2
