"""The training config is typed once (xsa_lm/config/spec.py): every bad value, misspelt or missing key is refused in
one line naming the key, and what a run derives is computed on the spec."""

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.helpers import REPO, compose_train, refused_in_process
from xsa_lm.config.spec import DataSpec, TrainSpec, all_fields, is_free, parse
from xsa_lm.errors import UserError
from xsa_lm.model import GPTConfig

CONFIGS = REPO / "configs"
MODELS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml") if not p.stem.startswith("_"))
ATTENTION_FIELDS = {"attention", "attention_target", "attention_options"}  # set by the attention group


def spec(overrides: list[str]) -> TrainSpec:
    return parse(TrainSpec, compose_train(overrides))


REFUSED = {  # overrides -> the one line (its start)
    "fractional steps": (["trainer.max_steps=1.5"], "trainer.max_steps=1.5 must be an integer"),
    "a word for a number": (["model.n_layer=four"], "model.n_layer=four must be an integer"),
    "a word for a switch": (["model.bias=maybe"], "model.bias=maybe must be true or false"),
    "a word for a real": (["attention=xsa", "attention.eps=small"], "attention.eps=small must be a finite number"),
    "two at once": (["seed=-1", "val_every_steps=0"], "seed=-1 must be >= 0; val_every_steps=0 must be >= 1"),
    "no LR": (["optim.lr=0"], "optim.lr=0 must be > 0"),
    "negative eps": (["attention=xsa", "attention.eps=-1e-6"], "attention.eps=-1e-06 must be > 0"),
    "no validation window": (["data.val_windows=0"], "data.val_windows=0 must be >= 1"),
    "a number as text": (
        ["samples.prompt=1e3"],
        "samples.prompt=1000.0 must be text (Hydra read it as a float): quote",
    ),
    "resume=true": (["resume=true"], "resume=True must be auto, null or a checkpoint path (quote a path Hydra"),
    "resume=AUTO": (["resume=AUTO"], "resume=AUTO must be auto, null or a checkpoint path: did you mean resume=auto?"),
    "seed above numpy's": (["seed=4294967296"], "seed=4294967296 must be <= 4294967295"),
    "a union": (["compile=maybe"], "compile=maybe must be true, false or auto"),
    "a bounded union": (["data.num_workers=-1"], "data.num_workers=-1 must be >= 0 or auto"),
    "null or a number": (["data.val_windows=all"], "data.val_windows=all must be an integer or null"),
    "a literal": (["attention=xsa", "attention.gate=sigmoid"], "attention.gate=sigmoid must be one of none, tanh"),
    "a rule of its own": (["optim.betas=[1,2]"], "optim.betas=[1, 2] must be two numbers in [0, 1)"),
    "devices": (["trainer.devices=0"], "trainer.devices=0 must be a number of devices >= 1, -1 or auto"),
    "kernels": (["sdpa_backends=[foo]"], "sdpa_backends=['foo'] names no kernel: foo"),
    "W&B mode": (
        ["logger.wandb.mode=sometimes"],
        "logger.wandb.mode=sometimes must be one of auto, online, offline, disabled",
    ),
    "precision": (["trainer.precision=17"], "trainer.precision=17 is not a precision Lightning accepts"),
    "GPTConfig's own check": (["model.n_kv_head=3"], "model.n_head=4 must be a multiple of n_kv_head=3"),
    "attention.layers": (["attention=xsa", "attention.layers=5"], "attention.layers=5: the last N layers needs"),
    "XSA on no layer": (["attention=xsa", "attention.layers=[]"], "attention.layers=[] puts XSA on no layer"),
    "XSA on the last 0": (["attention=xsa", "attention.layers=0"], "attention.layers=0 puts XSA on no layer, which is"),
    "a layer twice": (["attention=xsa", "attention.layers=[1,1]"], "attention.layers=[1, 1] names a layer twice"),
    "a layer past": (["attention=xsa", "attention.layers=[0,4]"], "attention.layers=[0, 4]: each layer is a 0-based"),
    "a negative layer": (["attention=xsa", "attention.layers=[-1]"], "attention.layers=[-1]: each layer is a 0-based"),
    "no layer number": (["attention=xsa", "attention.layers=[a]"], "attention.layers=['a'] must be all, a number of"),
    "more sinks than positions": (["model.n_sinks=100000"], "model.n_sinks=100000 must be in [0, block_size=128]"),
    "negative devices": (["trainer.devices=-5"], "trainer.devices=-5 must be a number of devices >= 1"),
    "a device twice": (["trainer.devices=[0,0]"], "trainer.devices=[0, 0] must be a number of devices >= 1"),
    "tensor parallel": (["trainer=fsdp", "trainer.strategy.tensor_parallel_size=2"], "trainer.strategy.tensor_"),
    "batch": (["global_batch_tokens=1000"], "global_batch_tokens=1000 is not divisible by micro_batch_size x"),
    "context": (["model.block_size=64", "data.block_size=128"], "data.block_size=128 is above model.block_size=64"),
    "spans": (["val_position_buckets=129"], "val_position_buckets=129 is above data.block_size=128"),
    "fsdp samples": (["trainer=fsdp", "samples.every_n_steps=5"], "samples.every_n_steps: not available under"),
    "async save": (["checkpoint.async_save=true"], "checkpoint.async_save=true: only for sharded checkpoints"),
    "NaN rank": (["faults.inject_nan_at_step=3", "faults.inject_nan_on_rank=1"], "faults.inject_nan_on_rank=1:"),
    "profile": (["profile.start_step=999", "trainer.max_steps=1000"], "profile.start_step=999 + profile.steps=3"),
    "missing value": (["data=local"], "missing required value(s): data.files; set them on the command line"),
    "a key missing, not filled in": (["~optim.weight_decay"], "optim.weight_decay is missing from the config: set it"),
    "appended key": (["+optim.lrr=0.1"], "optim.lrr: not an option of the optim group (it has _target_, _partial_"),
    "appended deep": (["+logger.wandb.projct=x"], "logger.wandb.projct: not an option of logger.wandb (it has _tar"),
    "appended node": (["+checkpoint.keep=1"], "checkpoint.keep: not an option of checkpoint (it has keep_last, "),
    "appended root": (["+seeed=1"], "seeed: not an option of configs/train.yaml (it has seed, "),
}


@pytest.mark.parametrize("overrides, line", REFUSED.values(), ids=REFUSED.keys())
def test_a_bad_config_is_refused_in_one_line(overrides: list[str], line: str):
    with pytest.raises(UserError) as error:
        spec(overrides)
    assert str(error.value).startswith(line) and "\n" not in str(error.value), error.value


def test_a_node_parsed_alone_names_its_keys_from_the_root():
    """parse converts any pydantic model; `at` is where its node sits in the composed config."""
    node = OmegaConf.to_container(compose_train([]).data, resolve=True) | {"split_seed": 1.5, "shards": 2}
    with pytest.raises(UserError) as error:
        parse(DataSpec, node, at="data.")
    assert str(error.value).startswith(
        "data.split_seed=1.5 must be an integer; data.shards: not an option of the data group (it has dir, cache_dir,"
    )
    del node["shards"]
    assert parse(DataSpec, {**node, "split_seed": 1}, at="data.").split_seed == 1


def test_what_a_run_derives_is_on_the_spec():
    s = spec(["scheduler.warmup_steps=50", "trainer.max_steps=20", "trainer.precision=16"])
    assert (s.accumulate, s.trainer.world_size, s.trainer.strategy_kind, s.block_size) == (8, 1, "ddp", 128)
    assert s.trainer.resolved_precision == "16-mixed" and s.run_label == "sa-tiny-lr0.001-s0"
    assert (s.schedule.total_steps, s.schedule.warmup_steps) == (20, 20) and "clipped to 20" in s.schedule.warning
    assert s.scheduler_node["warmup_steps"] == 20 and s.gpt_config(vocab_size=500).vocab_size == 512
    assert spec(["trainer=fsdp"]).trainer.strategy_kind == "fsdp"
    spec(["faults.inject_nan_at_step=3", "faults.inject_nan_on_rank=0", "trainer.max_steps=10", "profile.start_step=7"])


@pytest.mark.parametrize("model", MODELS)
def test_every_preset_holds_exactly_the_architecture_fields_from_gptconfigs_defaults(model: str):
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.name not in ATTENTION_FIELDS}
    cfg = compose_train([f"model={model}"])
    assert set(cfg.model) == set(defaults) | {"name"} and cfg.model.name == model
    base = yaml.safe_load((CONFIGS / "model" / "_base.yaml").read_text())
    assert base == {**defaults, "vocab_size": None}  # null: the tokenizer's, padded


@pytest.mark.parametrize(
    "path, key, renamed",
    [
        ("train.yaml", "  keep_last:", "  keep_lst:"),
        ("data/_base.yaml", "num_workers:", "num_worker:"),
        ("optim/adamw.yaml", "weight_decay:", "wd:"),
        ("trainer/default.yaml", "max_steps:", "max_step:"),
        ("logger/wandb.yaml", "  mode:", "  mod:"),
    ],
)
def test_a_renamed_key_in_a_config_file_is_refused(tmp_path: Path, path: str, key: str, renamed: str):
    configs = shutil.copytree(CONFIGS, tmp_path / "configs")
    text = (configs / path).read_text()
    assert text.count(key) == 1
    (configs / path).write_text(text.replace(key, renamed))
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="train")
    with pytest.raises(UserError, match=f"{renamed.strip(' :')}: not an option"):
        parse(TrainSpec, cfg)


def test_the_free_keys_are_how_long_how_often_where_and_how_fast():
    free = [k for k in all_fields() if is_free(k)]
    assert {
        "trainer.max_steps",
        "trainer.devices",
        "micro_batch_size",
        "logger.wandb.mode",
        "checkpoint.keep_last",
    } <= set(free)
    assert not [k for k in free if k.startswith(("model.", "optim.", "attention.", "tokenizer.", "trainer.strategy."))]
    assert is_free("logger.csv.flush_logs_every_n_steps") and not is_free("trainer.strategy.sharding_strategy")


def test_the_cli_reports_a_wrong_type_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    stderr = refused_in_process(["train", "model.n_layer=four", f"hydra.run.dir={tmp_path}/run"], monkeypatch, capsys)
    assert stderr.strip() == "xsa-lm: error: model.n_layer=four must be an integer"
    assert not (tmp_path / "run").exists()
