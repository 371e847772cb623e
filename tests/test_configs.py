"""Every config composes, resolves, and builds its components."""

import ast
import re
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import compose_train, refused_in_process
from xsa_lm.config.spec import TrainSpec, parse

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and not p.name.startswith("_"))
CHOICES = [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml")) if not p.stem.startswith("_")]


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
    cfg = compose_train(overrides, config_name="sweep" if group in ("sweep", "launcher") else "train")
    OmegaConf.resolve(cfg)  # every interpolation resolves
    mcfg = parse(TrainSpec, cfg).gpt_config(vocab_size=50257)
    assert mcfg.vocab_size % 64 == 0 and mcfg.attention == cfg.attention.name
    optimizer = hydra.utils.instantiate(cfg.optim)([torch.nn.Parameter(torch.zeros(2))])
    hydra.utils.instantiate(cfg.scheduler)(optimizer, total_steps=cfg.trainer.max_steps)
    assert callable(hydra.utils.instantiate(cfg.tokenizer))


def test_a_shared_part_of_a_group_is_no_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """data/_base.yaml holds what every data option shares: chosen alone it is no data source (not data=prepared)."""
    stderr = refused_in_process(["train", "data=_base", f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    options = ", ".join(option for group, option in CHOICES if group == "data")
    assert (
        stderr == f"xsa-lm: error: data=_base is not an option (it holds settings the data options share); "
        f"choose one of: {options}\n"
    )
    assert not (tmp_path / "run").exists()
    stderr = refused_in_process(["train", "data=foo", f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert stderr.endswith(f"available options in 'data': {options.replace(',', '')}\n")  # without _base


def test_demo_experiment_is_a_cpu_recipe():
    cfg = compose_train(["experiment=demo"])
    assert cfg.trainer.accelerator == "cpu" and cfg.model.name == "tiny"
    assert parse(TrainSpec, cfg).accumulate == 1


def test_fsdp_is_fsdp2_through_the_model_parallel_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = hydra.utils.instantiate(compose_train(["trainer=fsdp"]).trainer.strategy)
    assert isinstance(strategy, ModelParallelStrategy) and strategy._save_distributed_checkpoint  # sharded
    assert parse(TrainSpec, compose_train(["trainer=fsdp"])).trainer.strategy_kind == "fsdp"
    assert compose_train(["trainer=ddp"]).trainer.strategy._target_.endswith("AtomicDDPStrategy")


# The paper's Table 1 and training protocol (shared/reference/paper.md): layers, width, heads, head dim, peak LR.
TABLE_1 = {"0.7b": (24, 1536, 6, 256, 5e-4), "1.4b": (24, 2048, 24, 128, 4e-4), "2.7b": (32, 2560, 24, 128, 3e-4)}
PAPER_PROTOCOL = {"block_size": 2048, "global_batch_tokens": 256 * 2048, "warmup_steps": 2000, "max_steps": 200_000}


@pytest.mark.parametrize("size", sorted(TABLE_1))
def test_paper_presets_hold_the_papers_numbers_and_their_toys_its_attention_width(size: str):
    cfg = compose_train([f"experiment=paper_{size}"])
    model, protocol = cfg.model, PAPER_PROTOCOL
    assert (model.n_layer, model.d_model, model.n_head, model.head_dim, cfg.optim.lr) == TABLE_1[size]
    taken = (model.block_size, cfg.global_batch_tokens, cfg.scheduler.warmup_steps, cfg.trainer.max_steps)
    assert taken == tuple(protocol.values())  # block_size, global_batch_tokens, warmup_steps, max_steps
    # XSA acts on the attention width n_head x head_dim, which the paper sets apart from d_model: a toy keeps it.
    toy = compose_train([f"experiment=paper_{size}_toy"]).model
    assert toy.n_head * toy.head_dim / toy.d_model == pytest.approx(model.n_head * model.head_dim / model.d_model)


LABELLED = [f"{group}/paper_{size}.yaml" for group in ("model", "experiment") for size in TABLE_1]
LABELLED += ["optim/adamw.yaml", "scheduler/warmup_cosine.yaml"]
NOT_HYPERPARAMETERS = {"_target_", "_partial_", "name", "total_steps", "defaults", "- override"}


@pytest.mark.parametrize("path", LABELLED)
def test_every_paper_preset_value_says_whether_the_paper_states_it(path: str):
    # Values the paper does not state are our choices: each value line says "paper:" or "ours" in its comment.
    for line in (CONFIGS / path).read_text().splitlines():
        key, _, rest = line.strip().partition(":")
        value = rest.split("#", 1)[0].strip()
        if line.startswith("#") or not value or key in NOT_HYPERPARAMETERS or key.startswith("- "):
            continue
        comment = rest.partition("#")[2]
        assert "paper:" in comment or "ours" in comment, f"{path}: {line}"


def test_every_module_a_config_file_names_exists():
    """The `_target_`s and the `xsa_lm/...py` pointers of configs/**/*.yaml name code that exists (read, not
    imported: a name defined at the top of its module)."""
    text = "\n".join(p.read_text() for p in sorted(CONFIGS.rglob("*.yaml")))
    paths = set(re.findall(r"[\w.]+(?:/[\w.]+)+\.py\b", text))
    assert "xsa_lm/model/config.py" in paths
    assert [p for p in paths if not (CONFIGS.parent / p).is_file()] == []
    dotted = set(re.findall(r"\bxsa_lm(?:\.\w+)+", text))
    assert "xsa_lm.data.sources.LocalFiles" in dotted
    assert [name for name in dotted if not defined(name)] == []


def defined(dotted: str) -> bool:
    """A module of the repository (xsa_lm.data), or a name at the top of one (xsa_lm.data.sources.LocalFiles)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        stem = CONFIGS.parent.joinpath(*parts[:cut])
        source = stem / "__init__.py" if stem.is_dir() else stem.with_suffix(".py")
        if source.is_file():
            rest = parts[cut:]
            return not rest or (len(rest) == 1 and rest[0] in top_level_names(source))
    return False


def top_level_names(source: Path) -> set[str]:
    tree = ast.parse(source.read_text())
    names = {getattr(node, "name", None) for node in tree.body}
    names |= {
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    }
    return {name for name in names if name}
