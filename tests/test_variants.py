"""Attention variants as plugins: a class outside xsa_lm (docs/examples/gated_attention) trains, generates and is
checked through the same interface as SA and XSA; a target or option that cannot be built is refused in one line;
model configs saved before variants were classes still build the model they were."""

from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, REPO, compose_train, lightning_checkpoint, refused_in_process, run_cli
from xsa_lm.checkpoints.load import load_model
from xsa_lm.config.spec import AttentionSpec, TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.export.run import hf_fields
from xsa_lm.model import GPT, GPTConfig, generate
from xsa_lm.train.plan import run_shape

EXAMPLE = REPO / "docs" / "examples" / "gated_attention"
GATED = "lab_attention.gated.GatedAttention"
TINY = dict(n_layer=2, d_model=32, n_head=4, head_dim=8, vocab_size=64, block_size=16)


@pytest.fixture
def lab(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's package importable, as PYTHONPATH=docs/examples/gated_attention makes it."""
    monkeypatch.syspath_prepend(str(EXAMPLE))


def gated(**options: object) -> GPTConfig:
    return GPTConfig(**TINY, attention="gated", attention_target=GATED, attention_options=dict(options))


@pytest.mark.parametrize("granularity", ["elementwise", "headwise"])
def test_a_lab_variant_trains_and_generates_through_the_interface(lab: None, granularity: str):
    torch.manual_seed(0)
    model = GPT(gated(granularity=granularity))
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    gates = [p for n, p in model.named_parameters() if n.endswith("attn.gate.weight")]
    width = 8 if granularity == "elementwise" else 1
    assert [p.shape for p in gates] == [(4 * width, 32)] * 2 and all(p.grad.abs().sum() > 0 for p in gates)
    # the gate acts: the same weights without it (plain SA) give other logits
    sa = GPT(GPTConfig(**TINY))
    sa.load_state_dict({k: v for k, v in model.state_dict().items() if ".gate." not in k})
    assert not torch.allclose(sa(idx), model(idx))
    # a KV cache serves it as it serves SA: cached generation equals recomputing the whole window each step
    prompt = idx[:1, :4]
    assert torch.equal(generate(model, prompt, 6), generate(model, prompt, 6, use_cache=False))


REFUSED = {  # GPTConfig's arguments -> the one line (its start)
    "no such module": (
        dict(attention="mine", attention_target="lab_nowhere.Mine"),
        "attention_target=lab_nowhere.Mine cannot be imported (No module named 'lab_nowhere'): put its package on",
    ),
    "no such class": (
        dict(attention="mine", attention_target="lab_attention.gated.Gated"),
        "attention_target=lab_attention.gated.Gated cannot be imported (module 'lab_attention.gated' has no",
    ),
    "no module": (dict(attention="mine", attention_target="Gated"), "attention_target=Gated must name a class by"),
    "not a variant": (
        dict(attention="mine", attention_target="torch.nn.Linear"),
        "attention_target=torch.nn.Linear is not an attention variant (a subclass of CausalSelfAttention)",
    ),
    "an option SA lacks": (
        dict(attention="sa", attention_options={"gate": "tanh"}),
        "attention.gate: sa (xsa_lm.model.attention.CausalSelfAttention) takes no such option (its options: none)",
    ),
    "an option the lab's lacks": (
        dict(attention="gated", attention_target=GATED, attention_options={"eps": 1e-6}),
        f"attention.eps: gated ({GATED}) takes no such option (its options: granularity)",
    ),
    "a value the lab's refuses": (
        dict(attention="gated", attention_target=GATED, attention_options={"granularity": "rowwise"}),
        "attention.granularity=rowwise must be one of elementwise, headwise",
    ),
    "no built-in of that name": (dict(attention="gated"), "attention='gated' is no built-in variant (sa, xsa)"),
}


@pytest.mark.parametrize("arguments, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_variant_that_cannot_be_built_is_refused_in_one_line(lab: None, arguments: dict, message: str):
    with pytest.raises(ValueError) as refused:
        GPTConfig(**TINY, **arguments)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_the_config_group_names_the_class_and_its_options_by_their_keys(lab: None):
    """`attention=sa attention.gate=tanh` trained plain SA before; now SA's class refuses the option it lacks."""
    with pytest.raises(UserError, match=r"^attention\.gate: sa \(xsa_lm\.model\.attention\.CausalSelfAttention\) "):
        parse(TrainSpec, compose_train(["attention=sa", "+attention.gate=tanh"]))
    with pytest.raises(UserError, match=r"^attention\._target_=lab_attention\.gated\.Nope cannot be imported"):
        parse(TrainSpec, compose_train(["attention=sa", f"attention._target_={GATED[: -len('GatedAttention')]}Nope"]))
    spec = parse(TrainSpec, compose_train(["attention=xsa", "attention.layers=1"]))
    config = spec.gpt_config(vocab_size=64)
    assert config.attention_options == {"eps": 1e-6, "layers": [3], "gate": "none"}  # the last 1 of 4, settled
    assert [type(b.attn).__name__ for b in GPT(config).blocks] == ["ExclusiveSelfAttention"] * 4


def test_a_target_that_cannot_be_imported_is_refused_before_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    run_dir = tmp_path / "run"
    args = ["train", "attention._target_=lab_nowhere.Mine", f"hydra.run.dir={run_dir}"]
    lines = refused_in_process(args, monkeypatch, capsys).strip().splitlines()
    assert lines == [
        "xsa-lm: error: attention._target_=lab_nowhere.Mine cannot be imported (No module named 'lab_nowhere'): put "
        "its package on PYTHONPATH"
    ]
    assert not run_dir.exists()


SAVED_BEFORE = {  # a model config as checkpoints and summaries stored it before variants were classes -> today's
    "sa": (
        dict(attention="sa", xsa_eps=1e-6, xsa_layers=None, xsa_gate=False),
        ["attention=sa"],
    ),
    "xsa, gated, two layers": (
        dict(attention="xsa", xsa_eps=1e-6, xsa_layers=[0, 1], xsa_gate=True),
        ["attention=xsa", "attention.gate=tanh", "attention.layers=[0,1]"],
    ),
    "xsa, every layer": (
        dict(attention="xsa", xsa_eps=1e-5, xsa_layers=None, xsa_gate=False),
        ["attention=xsa", "attention.eps=1e-5"],
    ),
}


@pytest.mark.parametrize("stored, overrides", SAVED_BEFORE.values(), ids=SAVED_BEFORE.keys())
def test_a_model_config_saved_before_variants_were_classes_builds_the_same_model(
    stored: dict, overrides: list[str], tmp_path: Path
):
    today = parse(TrainSpec, compose_train([*overrides, "model.n_layer=2"])).gpt_config(vocab_size=64)
    checkpoint = lightning_checkpoint(GPTConfig(**TINY, **stored))  # the weights such a run saved
    torch.save({**checkpoint, "model_config": {**TINY, **stored}}, tmp_path / "old.ckpt")
    model = load_model(tmp_path / "old.ckpt")
    attention = ("attention", "attention_target", "attention_options")
    assert [getattr(model.config, k) for k in attention] == [getattr(today, k) for k in attention]
    gates = [k for k in model.state_dict() if k.endswith("attn.gate")]
    assert len(gates) == (2 if stored["xsa_gate"] else 0)


def test_a_run_config_saved_before_the_group_named_classes_still_parses():
    """config.yaml of a run saved before (resume reads it): sa kept XSA's options, neither had a _target_."""
    old = {"name": "sa", "eps": 1e-6, "layers": "all", "gate": "none"}
    assert AttentionSpec.model_validate(old).options == {}
    xsa = AttentionSpec.model_validate({**old, "name": "xsa", "gate": "tanh"})
    assert xsa.target == "xsa_lm.model.xsa.ExclusiveSelfAttention"
    assert xsa.options == {"eps": 1e-6, "layers": "all", "gate": "tanh"}


def test_the_memory_plan_and_export_ask_the_variant(lab: None, monkeypatch: pytest.MonkeyPatch):
    """XSA's saved numbers are counted for the class that says it keeps them; export writes the built-ins only."""
    spec = parse(TrainSpec, compose_train(["attention=xsa"]))
    assert run_shape(spec).memory_args()["exclusive"]
    assert not run_shape(parse(TrainSpec, compose_train([]))).memory_args()["exclusive"]
    with pytest.raises(UserError, match=rf"^ckpt: attention gated \({GATED}\) is a lab's own variant; export writes"):
        hf_fields(gated())
    fields = hf_fields(GPTConfig(**TINY, attention="xsa", attention_options={"layers": 1, "gate": "tanh"}))
    assert (fields["attention"], fields["xsa_layers"], fields["xsa_gate"]) == ("xsa", [1], True)


@pytest.mark.long  # ~1 min: a train, then generate from its checkpoint, from a lab's folder
def test_the_worked_example_trains_from_its_folder_and_its_checkpoint_rebuilds(data_cache: Path, tmp_path: Path):
    example = ["--config-dir", str(EXAMPLE / "configs"), "attention=gated", "attention.granularity=headwise"]
    run_dir = tmp_path / "run"
    lab_path = f"{EXAMPLE}:{REPO}"
    trained = run_cli(
        ["train", *example, *FAST, "trainer.max_steps=4", f"hydra.run.dir={run_dir}"],
        data_cache,
        tmp_path,
        PYTHONPATH=lab_path,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "attention=gated" in trained.stdout
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    config = torch.load(ckpt, weights_only=True)["model_config"]
    assert config["attention_target"] == GATED and config["attention_options"] == {"granularity": "headwise"}
    sampled = run_cli(["generate", f"ckpt={ckpt}", "max_new_tokens=4"], data_cache, tmp_path, PYTHONPATH=lab_path)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    # without the lab's package: one line naming what to do; export: refused, nothing written
    missing = run_cli(["generate", f"ckpt={ckpt}", "max_new_tokens=4"], data_cache, tmp_path, PYTHONPATH=str(REPO))
    assert missing.returncode == 2 and "cannot be imported (No module named 'lab_attention'): put its package" in (
        missing.stderr
    )
    exported = run_cli(["export", f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"], data_cache, tmp_path, PYTHONPATH=lab_path)
    assert exported.returncode == 2 and "is a lab's own variant" in exported.stderr and not (tmp_path / "hf").exists()
