"""Every config composes, resolves, and builds its components."""

from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from xsa_lm.train.run import check_config, model_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and not p.name.startswith("_"))
CHOICES = [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml")) if not p.stem.startswith("_")]


def compose_train(overrides: list[str], config_name: str = "train"):
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def test_groups_cover_the_required_concerns():
    assert {"model", "attention", "data", "optim", "trainer", "logger", "experiment", "sweep"} <= set(GROUPS)


def test_prepare_config_composes_with_every_source():
    for option, extra in [("shakespeare", []), ("local", ["data.files=x"]), ("hf", ["data.path=x"]), ("fineweb", [])]:
        cfg = compose_train([f"data={option}", "tokenizer=gpt2", *extra], config_name="prepare")
        OmegaConf.resolve(cfg)
        assert cfg.data.source._target_.startswith("xsa_lm.data.sources.") and cfg.data.block_size is None
    assert compose_train(["data=fineweb"], config_name="prepare").data.source.subset == "sample-10BT"


@pytest.mark.parametrize("group, option", CHOICES, ids=[f"{g}={o}" for g, o in CHOICES])
def test_every_option_composes_and_builds(group: str, option: str):
    overrides = [f"{group}={option}"]
    required = {"local": "data.files=/dev/null", "hf": "data.path=org/name", "prepared": "data.dir=/tmp"}
    if group == "data" and option in required:
        overrides.append(required[option])
    if group == "tokenizer" and option == "file":
        overrides.append("tokenizer.path=/dev/null")
    if group == "model" and option.startswith("paper_"):
        overrides += ["global_batch_tokens=524288", "micro_batch_size=8"]  # the paper's 0.5M tokens per step
    cfg = compose_train(overrides, config_name="sweep" if group == "sweep" else "train")
    OmegaConf.resolve(cfg)  # every interpolation resolves
    check_config(cfg)
    mcfg = model_config(cfg, vocab_size=50257)
    assert mcfg.vocab_size % 64 == 0 and mcfg.attention == cfg.attention.name
    optimizer = hydra.utils.instantiate(cfg.optim)([torch.nn.Parameter(torch.zeros(2))])
    hydra.utils.instantiate(cfg.scheduler)(optimizer, total_steps=cfg.trainer.max_steps)
    assert callable(hydra.utils.instantiate(cfg.tokenizer))


def test_attention_choice_reaches_the_model():
    assert model_config(compose_train(["attention=xsa"]), 4096).attention == "xsa"
    assert model_config(compose_train([]), 4096).attention == "sa"


def test_demo_experiment_is_a_cpu_recipe():
    cfg = compose_train(["experiment=demo"])
    assert cfg.trainer.accelerator == "cpu" and cfg.model.name == "tiny"
    assert check_config(cfg)["accumulate"] == 1


def test_fsdp_is_fsdp2_through_the_model_parallel_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = hydra.utils.instantiate(compose_train(["trainer=fsdp"]).trainer.strategy)
    assert isinstance(strategy, ModelParallelStrategy) and not strategy._save_distributed_checkpoint
    assert compose_train(["trainer=ddp"]).trainer.strategy == "ddp"
    slurm = compose_train(["sweep=slurm"], config_name="sweep").sweep
    assert slurm.launch_prefix[0] == "srun" and slurm.max_parallel == 4
