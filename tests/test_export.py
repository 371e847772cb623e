"""`xsa-lm export`: a checkpoint as a transformers model gives our logits, our greedy tokens (through transformers'
generate and its KV cache) and our lm-eval scores (through lm-eval's `hf` backend), for SA, XSA and XSA's variants;
a sharded checkpoint exports to the same weights; bad inputs fail in one line."""

import ast
import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.conftest import REPO, run_cli
from tests.helpers import cli_in_process
from tests.test_checkpoint_errors import assert_refused
from xsa_lm.checkpoints.sharded import META
from xsa_lm.data.tokenizer import EOT, train_bpe
from xsa_lm.errors import UserError
from xsa_lm.eval.sample import sample
from xsa_lm.export.run import TRANSFORMERS_REQUIREMENT, export, hf_fields
from xsa_lm.model import GPT, GPTConfig, generate

transformers = pytest.importorskip("transformers")

TEXTS = ["the cat sat on the mat. " * 30, "a dog ran in the park and the cat ran too. " * 30]
TINY = dict(n_layer=3, d_model=32, n_head=4, head_dim=8, vocab_size=320, block_size=40)
VARIANTS = {
    "sa": dict(attention="sa"),
    "xsa": dict(attention="xsa"),
    # every option at once: a gate, XSA on a subset of layers, grouped-query attention, sinks, biases
    "xsa-gated-subset-gqa-sinks": dict(
        attention="xsa", xsa_gate=True, xsa_layers=(0, 2), n_kv_head=2, n_sinks=2, bias=True
    ),
}


def trained_looking(config: GPTConfig) -> GPT:
    """A GPT far from its init, whose greedy tokens vary, with gates and biases not zero (a gate at 0 is SA)."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate"):
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() >= 2 and name != "wte.weight":
                p.normal_(0.0, 0.3)
    return model.eval()


def write_run(run_dir: Path, data_dir: Path, model: GPT, sharded: bool = False) -> Path:
    """A run as `xsa-lm train` leaves it: checkpoints/last.ckpt (or trainer=fsdp's directory), run_info.json."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    (run_dir / "run_info.json").write_text(json.dumps({"data_dir": str(data_dir)}))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    checkpoint = {"state_dict": state, "model_config": asdict(model.config), "global_step": 7}
    if not sharded:
        torch.save(checkpoint, ckpt)
        return ckpt
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=ckpt)
    torch.save(checkpoint, ckpt / META)
    return ckpt


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    train_bpe(TEXTS, vocab_size=300).save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, tuple[GPT, Path, Path]]:
    """Per variant: our model, its checkpoint, and the directory `export` wrote from it."""
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for variant, options in VARIANTS.items():
        model = trained_looking(GPTConfig(**TINY, **options))
        ckpt = write_run(root / variant, data_dir, model)
        made[variant] = model, ckpt, export(ckpt, root / f"{variant}-hf")
    return made


def load_exported(folder: Path):
    """The model and tokenizer as a user loads them (trusting the code for both: the tokenizer reads config.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    return model.eval(), AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_transformers_gives_our_logits_and_loss(variant: str, runs):
    model, _, folder = runs[variant]
    hf, _ = load_exported(folder)
    assert type(hf).__name__ == "XSAForCausalLM" and hf.dtype == torch.float32
    assert hf.lm_head.weight is hf.wte.weight  # tied, as ours
    idx = torch.randint(0, TINY["vocab_size"], (3, TINY["block_size"]), generator=torch.Generator().manual_seed(1))
    ours = model(idx)
    out = hf(idx, labels=idx)
    assert (out.logits - ours).abs().max() <= 1e-5
    _, our_loss = model(idx[:, :-1], idx[:, 1:].contiguous())
    assert out.loss.item() == pytest.approx(our_loss.item(), abs=1e-5)  # transformers' labels: shifted inside
    # Through transformers' KV cache: a prefix, then one token at a time (the sinks enter with the first tokens).
    first = hf(idx[:, :25], use_cache=True)
    pieces, cache = [first.logits], first.cache
    for t in range(25, TINY["block_size"]):
        step = hf(idx[:, t : t + 1], cache=cache, use_cache=True)
        pieces.append(step.logits)
        cache = step.cache
    assert (torch.cat(pieces, dim=1) - ours).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_generate_gives_the_greedy_tokens_of_xsa_lm_generate(variant: str, runs):
    model, ckpt, folder = runs[variant]
    hf, tokenizer = load_exported(folder)
    prompt = "the cat sat"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    theirs = hf.generate(ids, max_new_tokens=25, do_sample=False)[0, ids.size(1) :]
    ours = generate(model, ids, 25, vocab_size=len(tokenizer))[0, ids.size(1) :]
    # transformers stops at <|endoftext|> (the exported eos_token_id); ours runs on to max_new_tokens
    assert len(theirs) == 25 or theirs[-1] == tokenizer.convert_tokens_to_ids(EOT)
    assert theirs.tolist() == ours[: len(theirs)].tolist() and len(set(ours.tolist())) > 3  # no single repeated token
    # the table's padding past the tokenizer's ids (320 > 300) is never drawn, here or by `xsa-lm generate`
    assert hf.generation_config.suppress_tokens == list(range(len(tokenizer), TINY["vocab_size"]))
    (text,) = sample(str(ckpt), prompt, max_new_tokens=25, temperature=0, top_k=None, num_samples=1, seed=0)
    assert prompt + tokenizer.decode(theirs, skip_special_tokens=True) == text  # `xsa-lm generate`'s text


@pytest.mark.parametrize("variant", ["sa", "xsa-gated-subset-gqa-sinks"])
def test_a_left_padded_batch_generates_as_each_prompt_alone(variant: str, runs):
    _, _, folder = runs[variant]
    hf, tokenizer = load_exported(folder)
    tokenizer.padding_side = "left"
    prompts = ["the cat sat on the mat and", "a dog"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert not batch["attention_mask"].all()  # padded
    together = hf.generate(**batch, max_new_tokens=8, do_sample=False)[:, batch["input_ids"].size(1) :]
    for row, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        alone = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.size(1) :]
        assert together[row, : len(alone)].tolist() == alone.tolist()


def test_the_export_holds_weights_config_tokenizer_and_code_also_of_a_sharded_checkpoint(runs, data_dir, tmp_path):
    model, _, folder = runs["xsa-gated-subset-gqa-sinks"]
    exported = export(write_run(tmp_path / "fsdp", data_dir, model, sharded=True), tmp_path / "hf")
    weights, expected = load_file(exported / "model.safetensors"), load_file(folder / "model.safetensors")
    assert weights.keys() == expected.keys() and "blocks.0.attn.gate" in weights and "sinks" in weights
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    config = json.loads((folder / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == config
    auto_map = {"AutoConfig": "configuration_xsa.XSAConfig", "AutoModelForCausalLM": "modeling_xsa.XSAForCausalLM"}
    assert config["auto_map"] == auto_map
    expected = hf_fields(model.config)  # GPTConfig's fields, the attention's as modeling_xsa.py reads them
    assert expected["xsa_layers"] == [0, 2] and expected["xsa_gate"] and expected["attention"] == "xsa"
    assert {key: config[key] for key in expected} == expected
    for name in ("configuration_xsa.py", "modeling_xsa.py"):  # the package's files, verbatim
        assert (folder / name).read_text() == (REPO / "xsa_lm" / "export" / name).read_text()
    code = (folder / "modeling_xsa.py").read_text() + (folder / "configuration_xsa.py").read_text()
    assert "xsa_lm" not in code.replace("xsa_lm/model", "")  # self-contained: torch and transformers only
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)  # without trust_remote_code too (it asks, then loads)
    ours = train_bpe(TEXTS, vocab_size=300)
    assert tokenizer("the cat ran")["input_ids"] == ours.encode("the cat ran").ids
    assert tokenizer.eos_token == EOT and tokenizer.model_max_length == TINY["block_size"]
    assert not list(folder.parent.glob(f".{folder.name}.*"))  # no staging directory left behind


def test_an_empty_directory_or_a_link_to_one_is_filled_as_mkdir_would_make_it(runs, tmp_path: Path):
    _, ckpt, _ = runs["sa"]
    (tmp_path / "empty").mkdir()
    assert (export(ckpt, tmp_path / "empty") / "model.safetensors").is_file()
    umask = os.umask(0o022)
    try:  # readable by others, as a folder mkdir made
        assert export(ckpt, tmp_path / "shared").stat().st_mode & 0o777 == 0o755
    finally:
        os.umask(umask)
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")  # a link to an empty directory: that directory is filled
    assert export(ckpt, tmp_path / "link") == tmp_path / "target" and (tmp_path / "target" / "config.json").is_file()


def test_without_transformers_the_export_says_how_to_install_the_eval_extra(runs, monkeypatch, tmp_path: Path):
    import importlib.util

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert Requirement(TRANSFORMERS_REQUIREMENT) in [Requirement(r) for r in project["optional-dependencies"]["eval"]]
    assert "transformers" not in [Requirement(r).name for r in project["dependencies"]]  # not in the core install
    find_spec = importlib.util.find_spec  # as in an install without the extra `eval`
    without = lambda name, *a: None if name == "transformers" else find_spec(name)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", without)
    with pytest.raises(UserError, match=r"^xsa-lm export needs transformers, the extra `eval`: pip install 'transf"):
        export(runs["sa"][1], tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.long
def test_export_through_the_cli(runs, data_cache: Path, tmp_path: Path, monkeypatch, capsys):
    _, ckpt, _ = runs["xsa"]
    out = tmp_path / "hf"
    proc = run_cli(["export", f"ckpt={ckpt}", f"out={out}"], data_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"wrote {out} (") and (out / "model.safetensors").is_file()
    assert "AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)" in proc.stdout  # else transformers asks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing else written (no Hydra outputs)
    again = cli_in_process(["export", f"ckpt={ckpt}", f"out={out}"], data_cache, tmp_path, monkeypatch, capsys)
    assert_refused(again, "exists and is not empty")


def test_only_the_shipped_modelling_code_imports_transformers_at_import_time():
    """The core install has no transformers: the export imports it inside its functions, and only the two files it
    copies beside a model import it at their top."""
    shipped = {"configuration_xsa.py", "modeling_xsa.py"}
    for path in (REPO / "xsa_lm").rglob("*.py"):
        top = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        uses = {name for name in names if name.split(".")[0] in ("transformers", "lm_eval", "accelerate")}
        assert not uses or path.name in shipped, (path, uses)
