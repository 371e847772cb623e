"""An option acts or is refused: a value that would leave the chosen configuration as it was (XSA's eps that switches
the projection off, an option the variant never reads, a setting of the other scale axis) is one line, not a run."""

import re
from functools import cache
from pathlib import Path

import pytest

from tests.helpers import compose_train, refused_in_process
from tests.leftovers import nothing_left_behind
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.sweep.settings import ScaleSpec, SweepSpec

REFUSED = {  # training overrides -> the one line (a part of it)
    "eps far above ||v||^2": (["attention=xsa", "attention.eps=1e30"], "attention.eps=1e+30 must be at most 0.0164"),
    "eps above 1% of ||v||^2": (["attention=xsa", "attention.eps=0.02"], "1% of ||v||^2 at initialisation"),
    "eps against a wider model": (["attention=xsa", "attention.eps=0.05", "model.init_std=0.01"], "at most 0.0041"),
    "infinite eps": (["attention=xsa", "attention.eps=inf"], "attention.eps=inf must be a finite number"),
    "a NaN's rank without its step": (["faults.inject_nan_on_rank=0"], "faults.inject_nan_on_rank=0 would do nothing"),
    "an infinite LR": (["optim.lr=inf"], "optim.lr=inf must be a finite number"),
    "an infinite weight decay": (["optim.weight_decay=inf"], "optim.weight_decay=inf must be a finite number"),
    "an infinite temperature": (["samples.temperature=inf"], "samples.temperature=inf must be a finite number"),
    "no key/value head": (["model.n_kv_head=0"], "model.n_kv_head=0 must be >= 1"),
    "SA given XSA's options": (
        ["attention=sa", "+attention.gate=tanh", "+attention.layers=[0]"],
        "attention.gate, layers: sa (xsa_lm.model.attention.CausalSelfAttention) takes no such option",
    ),
}


@pytest.mark.parametrize("overrides, line", REFUSED.values(), ids=REFUSED.keys())
def test_a_training_option_that_would_not_act_is_refused(overrides: list[str], line: str):
    with pytest.raises(UserError) as refused:
        parse(TrainSpec, compose_train(overrides))
    assert line in str(refused.value)


SWITCHED_OFF = {  # an option of a feature left off (its switch null) -> the one line (a part of it)
    "a prompt without samples": (["samples.prompt=Hello"], "samples.prompt acts only when samples.every_n_steps"),
    "sampling's temperature": (["samples.temperature=0"], "samples.temperature acts only when samples.every_n_steps"),
    "a profile's length without its start": (["profile.steps=5"], "profile.steps acts only when profile.start_step"),
    "diagnostics' sequences": (["diagnostics.sequences=4"], "diagnostics.sequences acts only when diagnostics.every"),
    "diagnostics switched off by hand": (
        ["diagnostics.every_n_steps=null", "diagnostics.chunk=64"],
        "diagnostics.chunk acts only when diagnostics.every_n_steps is set, and it is null (off)",
    ),
}


@pytest.mark.parametrize("overrides, line", SWITCHED_OFF.values(), ids=SWITCHED_OFF.keys())
def test_an_option_of_a_switched_off_feature_is_refused(overrides: list[str], line: str):
    spec = parse(TrainSpec, compose_train(overrides))
    with pytest.raises(UserError, match=f"^{re.escape(overrides[-1])}: {re.escape(line)}"):
        spec.refuse_idle_options(overrides)


def test_train_refuses_an_option_of_a_switched_off_feature_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, caches: list[Path]
):
    """`xsa-lm train` in this process: one line, exit 2, nothing written, not in the caches either (data.dir: were it
    not refused, the run would end at its missing shards rather than train)."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "data=prepared", f"data.dir={tmp_path}", "profile.steps=5", f"hydra.run.dir={tmp_path / 'run'}"]
    with nothing_left_behind(tmp_path):
        err = refused_in_process(args, monkeypatch, capsys)
    assert err.strip().splitlines() == [
        "xsa-lm: error: profile.steps=5: profile.steps acts only when profile.start_step is set, and it is null (off): "
        "set profile.start_step=N too, or leave it out"
    ]


def test_an_option_of_a_switched_on_feature_acts():
    overrides = ["samples.every_n_steps=5", "samples.prompt=Hello", "profile.start_step=1", "profile.steps=5"]
    parse(TrainSpec, compose_train(overrides)).refuse_idle_options(overrides)


def test_a_small_eps_is_taken_as_given():
    spec = parse(TrainSpec, compose_train(["attention=xsa", "attention.eps=1e-3"]))
    assert spec.gpt_config(vocab_size=64).attention_options["eps"] == 1e-3


OTHER_AXIS = [  # (the study's axis, an override the other axis reads)
    ("size", "scale.tokens_per_param=5"),
    ("size", "scale.sa_budgets=[1,2]"),
    ("size", "scale.xsa_budgets=[8]"),  # not among SA's either: on the size axis no budget acts
    ("size", "scale.measure_throughput=false"),
    ("tokens", "scale.fit=power_law"),
    ("tokens", "scale.bench=bench/results.json"),
    ("tokens", "scale.wandb_report=false"),
]


@cache
def scale_spec(axis: str) -> ScaleSpec:
    return parse(ScaleSpec, compose_train([f"scale.axis={axis}"], config_name="scale").scale, at="scale.")


@pytest.mark.parametrize("axis, override", OTHER_AXIS)
def test_a_setting_of_the_other_scale_axis_is_refused(axis: str, override: str):
    scale, key = scale_spec(axis), override.split("=")[0]
    with pytest.raises(UserError, match=f"^{re.escape(override)}: {key} acts on scale.axis=.* only, and this study"):
        scale.refuse_other_axis(["model.block_size=64", override])
    scale.refuse_other_axis(["model.block_size=64", "scale.seeds=[1,2]", "scale.bootstrap_seed=3"])  # both axes'


@cache
def sweep_spec() -> SweepSpec:
    return parse(SweepSpec, compose_train([], config_name="sweep").sweep, at="sweep.")


IDLE = [  # (a sweep setting turned on, the compare seeds): the setting cannot act without what it needs
    ({"null_arm": ["init"]}, []),
    ({"seeds_until_significant": 4}, []),
    ({"reuse_search_run": True}, []),
    ({"eval_tasks": "paper"}, []),
    ({"eval_limit": 10.0}, [1, 2]),  # without sweep.eval_tasks
    ({"expected_sd": 0.1}, []),
]


@pytest.mark.parametrize("setting, seeds", IDLE)
def test_a_sweep_setting_that_cannot_act_is_refused(setting: dict, seeds: list[int]):
    spec = sweep_spec().model_copy(update=setting)
    (key,) = setting
    with pytest.raises(UserError, match=f"^sweep.{key}=.* would do nothing: it needs"):
        spec.idle_settings(seeds)
    spec.model_copy(update={"eval_tasks": "paper"}).idle_settings([1, 2])  # with compare seeds and tasks, each acts
