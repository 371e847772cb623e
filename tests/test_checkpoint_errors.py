"""Anything that is not a checkpoint of `xsa-lm train`, or one of another model, is refused in one line naming it; so
is a tokenizer other than the one a checkpoint was trained with."""

import contextlib
import json
import math
import shutil
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import TINY, assert_refused, cli_in_process, compose_train, lightning_checkpoint, write_checkpoint
from tests.test_data import shakespeare_text
from xsa_lm.analysis.run import validation_set
from xsa_lm.checkpoints.load import load_model, load_tokenizer, model_config_mismatch, run_data
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.data.run import prepare_data
from xsa_lm.data.tokenizer import read_tokenizer, train_bpe
from xsa_lm.errors import UserError
from xsa_lm.eval.sample import sample
from xsa_lm.model import GPTConfig


def not_checkpoints(folder: Path) -> dict[str, Path]:
    """One of each kind of path a user may pass by mistake, created in `folder` (a checkpoint too: `ckpt`, and one
    copied out of its run: `lone`), and eval's task files."""
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = write_checkpoint(folder / "run")
    files = {
        "yaml": ("settings.yaml", b"model:\n  n_layer: 2\nattention:\n  type: xsa\n"),
        "text": ("notes.txt", b"hello, these are my notes\n"),
        "empty": ("empty.ckpt", b""),
        "truncated": ("truncated.ckpt", ckpt.read_bytes()[: ckpt.stat().st_size // 2]),
        "lone": ("x.ckpt", ckpt.read_bytes()),
    } | {key: (f"{key}.yaml", f"{text}\n".encode()) for key, text in TASK_FILES.items()}
    paths = {kind: folder / name for kind, (name, _) in files.items()}
    for kind, (_, content) in files.items():
        paths[kind].write_bytes(content)
    torch.save(torch.zeros(3), paths.setdefault("tensor", folder / "tensor.pt"))
    torch.save({"state_dict": {}}, paths.setdefault("no_config", folder / "no_config.ckpt"))
    for kind, value in {"nan": math.nan, "huge": 1e30}.items():  # a diverged run's: NaN, or overflowing in a forward
        saved = lightning_checkpoint(GPTConfig(**TINY))
        saved["state_dict"] = {k: v.fill_(value) for k, v in saved["state_dict"].items()}
        torch.save(saved, paths.setdefault(kind, folder / f"{kind}.ckpt"))
    with zipfile.ZipFile(paths.setdefault("zip", folder / "archive.ckpt"), "w") as archive:
        archive.writestr("hello.txt", "not torch")
    (folder / "a_run").mkdir(exist_ok=True)
    return paths | {"directory": folder / "a_run", "run": folder / "run", "ckpt": ckpt, "missing": folder / "no.ckpt"}


def test_a_checkpoint_loads_back_as_the_model_it_was_or_is_refused(tmp_path: Path):
    """Lightning's `model.` prefix and a torch.compile wrapper's `_orig_mod.` are taken off the weights' names;
    weights of another model than the stored config are refused, naming the first that does not fit."""
    config = GPTConfig(**TINY, attention="xsa", xsa_layers=(1,))
    checkpoint = lightning_checkpoint(config)
    expected = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}
    compiled = {k.replace("model.", "model._orig_mod.", 1): v for k, v in checkpoint["state_dict"].items()}
    for name, state in (("plain", checkpoint["state_dict"]), ("compiled", compiled)):
        torch.save({**checkpoint, "state_dict": state}, tmp_path / f"{name}.ckpt")
        model = load_model(tmp_path / f"{name}.ckpt")
        assert model.config == config and model.state_dict().keys() == expected.keys()
        assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    torch.save({**checkpoint, "model_config": asdict(GPTConfig(**{**TINY, "d_model": 16}))}, tmp_path / "x.ckpt")
    with pytest.raises(UserError, match=f"^ckpts: {tmp_path / 'x.ckpt'} holds weights of another model than its con"):
        load_model(tmp_path / "x.ckpt")


def test_model_config_mismatch_lists_every_differing_field():
    saved = asdict(GPTConfig(**TINY))
    assert model_config_mismatch(saved, saved) == []
    smaller = asdict(GPTConfig(**{**TINY, "n_layer": 1, "d_model": 16}))
    assert model_config_mismatch(saved, smaller) == ["n_layer: 2 -> 1", "d_model: 32 -> 16"]
    # Fields that leave the weights' shapes alone count too: resuming must not turn SA into XSA.
    xsa = asdict(GPTConfig(**TINY, attention="xsa", xsa_layers=(0,)))
    sa_class, xsa_class = "xsa_lm.model.attention.CausalSelfAttention", "xsa_lm.model.xsa.ExclusiveSelfAttention"
    assert model_config_mismatch(saved, xsa) == [
        "attention: sa -> xsa",
        f"attention_target: {sa_class} -> {xsa_class}",
        "attention_options: {} -> {'eps': 1e-06, 'layers': [0], 'gate': 'none'}",
    ]
    # As GPTConfig holds them: defaults, a config saved before variants were classes; a field it does not know, as
    # stored.
    saved = {**TINY, "xsa_layers": [1, 0], "n_kv_head": None}  # as read back from JSON, with defaults left out
    expected = asdict(GPTConfig(**TINY, xsa_layers=(0, 1)))
    assert model_config_mismatch(saved, expected) == []
    newer = {**asdict(GPTConfig(**TINY)), "some_future_field": 3}
    assert model_config_mismatch(newer, asdict(GPTConfig(**TINY))) == ["some_future_field: 3 -> (absent)"]


def local_run(tmp_path: Path, *, record: bool = True) -> tuple[Path, Path]:
    """A run of `xsa-lm train data=local data.files=a.txt` as the loading commands read it (config.yaml, run_info.json,
    a checkpoint recording the tokenizer's sha256, or not): the checkpoint and the data folder."""
    (tmp_path / "a.txt").write_text(shakespeare_text(20_000))
    overrides = ["data=local", "data.files=a.txt", f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300"]
    cfg = compose_train([*overrides, "model.block_size=16"])
    data = prepare_data((spec := parse(TrainSpec, cfg)).data, spec.tokenizer)
    ckpt = write_checkpoint(tmp_path / "run", GPTConfig(**{**TINY, "vocab_size": 320}))
    if record:
        checkpoint = torch.load(ckpt, weights_only=True)
        torch.save({**checkpoint, "TokenDataModule": {"tokenizer_sha256": data.tokenizer_sha256}}, ckpt)
    OmegaConf.save(cfg, tmp_path / "run" / "config.yaml")
    info = {"data_dir": str(data.dir.relative_to(tmp_path)), "cwd": str(tmp_path)}
    (tmp_path / "run" / "run_info.json").write_text(json.dumps(info))
    return ckpt, data.dir


def generate(ckpt: Path) -> list[str]:
    return sample(str(ckpt), "ROMEO", max_new_tokens=3, temperature=0, top_k=None, num_samples=1, seed=0)


def test_generate_analyze_and_eval_refuse_a_tokenizer_other_than_the_checkpoints(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt, data_dir = local_run(tmp_path)
    assert generate(ckpt)[0].startswith("ROMEO") and validation_set(ckpt, 2)[0].shape == (2, 16)
    monkeypatch.chdir(tmp_path / "run")  # run_info.json's relative data folder is taken from the run's cwd
    assert load_tokenizer(ckpt).to_str() == read_tokenizer(data_dir / "tokenizer.json", "test").to_str()
    monkeypatch.chdir(tmp_path)
    # The folder's tokenizer.json replaced by another tokenizer.
    original = (data_dir / "tokenizer.json").read_bytes()
    train_bpe([shakespeare_text(3_000)], vocab_size=280).save(str(data_dir / "tokenizer.json"))
    with pytest.raises(UserError, match=f"was trained with another tokenizer .* than {data_dir / 'tokenizer.json'}"):
        load_tokenizer(ckpt)
    with pytest.raises(UserError, match="is not the tokenizer the shards were made with"):
        run_data(ckpt)
    (data_dir / "tokenizer.json").write_bytes(original)
    # The run's data folder is gone and the source changed since: the data prepared again has another tokenizer.
    shutil.rmtree(data_dir)
    (tmp_path / "a.txt").write_text(shakespeare_text(8_000))
    message = f"ckpts?: {ckpt} was trained with another tokenizer .*: the run's data folder {data_dir} is gone\\)"
    for load in (generate, load_tokenizer, lambda ckpt: validation_set(ckpt, 2)):  # generate, eval, analyze
        with pytest.raises(UserError, match=message):
            load(ckpt)


def test_a_checkpoint_without_a_recorded_tokenizer_loads_unchecked(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt, data_dir = local_run(tmp_path, record=False)
    assert generate(ckpt)[0].startswith("ROMEO")
    shutil.rmtree(data_dir)  # prepared again from config.yaml: the same inputs, so the same tokenizer
    assert load_tokenizer(ckpt).get_vocab_size() == 300


# --- through the CLI: every refusal of the commands that read a checkpoint ---------------------------------------

LIMIT = "must be an integer >= 1 (the first N), a fraction in (0, 1) of each task, or null (all)"
OUTS = {"": "", ".": "", "..": "..", "/": "/"}  # out= -> as the line shows it: none a rename could replace
NO_TASK = "is not a task file (a YAML mapping with a `task:` name)"
NOT = "not a checkpoint of `xsa-lm train` (not a torch.save file, or truncated)"
DIVERGED = "gives NaN or infinite logits (a diverged run's weights): use an earlier checkpoint"
REFUSED = {  # `xsa-lm <args>` -> the start of its one line; a checkpoint given once without brackets: ckpts=PATH
    # what holds no checkpoint of `xsa-lm train`, in each command
    "yaml": ("analyze ckpts=[{yaml}]", f"ckpts: {{yaml}} is {NOT}"),
    "text": ("generate ckpt={text}", f"ckpt: {{text}} is {NOT}"),
    "truncated": ("eval ckpts=[{truncated}]", f"ckpts: {{truncated}} is {NOT}"),
    "empty": ("eval ckpts=[{empty}]", "ckpts: {empty} is empty, not a checkpoint"),
    "directory": ("export ckpt={directory} out=hf", "ckpt: {directory} is a directory, not a checkpoint: give a .ckpt"),
    "run": ("analyze ckpts=[{run}]", "ckpts: {run} is a directory, not a checkpoint: give a .ckpt file, e.g. {ckpt}"),
    "missing": ("generate ckpt={missing}", "ckpt: checkpoint not found: {missing}"),
    "device": ("eval ckpts=[/dev/null]", "ckpts: /dev/null is not a regular file (a device, pipe or socket), not a"),
    "tensor": ("generate ckpt={tensor}", "ckpt: {tensor} holds a Tensor, not a checkpoint of `xsa-lm train`"),
    "zip": ("analyze ckpts=[{zip}]", "ckpts: {zip} is not a readable checkpoint"),
    "no_config": ("export ckpt={no_config} out=hf", "ckpt: {no_config} has no model config or weights: is it a"),
    "no checkpoint": ("eval ckpts=[]", "ckpts: give at least one checkpoint, e.g. ckpts=[runs/sa/"),
    "a number": ("eval ckpts=5", "ckpts: checkpoint not found: 5"),  # typed a number by Hydra
    "one without brackets": ("eval ckpts={ckpt} tasks=[]", "tasks: give at least one task, e.g. tasks=paper"),
    # eval's tasks (a task YAML that is not YAML ended in "ParserError"); one score per task name: a second file of
    # the same `task:` replaced the first's score without a word, the same name twice counted twice in the average
    **{
        f"tasks={t}": (f"eval ckpts=[{{ckpt}}] tasks={t}", "tasks: give at least one task")
        for t in ("", "null", "['']")
    },
    "a name twice": ("eval ckpts=[{ckpt}] tasks=[piqa,arc_easy,piqa]", "tasks: piqa is the task 'piqa', as piqa is"),
    "a task file twice": (
        "eval ckpts=[{ckpt}] tasks=[{a},{b}]",
        "tasks: {b} is the task 'cloze', as {a} is: give each",
    ),
    "not YAML": ("eval ckpts=[{ckpt}] tasks=[{broken}]", "tasks: {broken} is not valid YAML at line 2"),
    "a list": ("eval ckpts=[{ckpt}] tasks=[{listed}]", f"tasks: {{listed}} {NO_TASK}"),
    "no name": ("eval ckpts=[{ckpt}] tasks=[{nameless}]", f"tasks: {{nameless}} {NO_TASK}"),
    "no such file": ("eval ckpts=[{ckpt}] tasks=[none.yaml]", "tasks: task file not found: none.yaml"),
    # eval's options, checked before any scoring; a checkpoint given twice (also by another path) would count twice
    **{o: (f"eval ckpts=[{{ckpt}}] {o}", f"{o} {LIMIT}") for o in ("limit=0", "limit=-5", "limit=abc", "limit=inf")},
    "limit=2.5": ("eval ckpts=[{ckpt}] limit=2.5", f"limit=2.5 {LIMIT}"),  # the harness would run 2
    "limit=true": ("eval ckpts=[{ckpt}] limit=true", f"limit=True {LIMIT}"),
    "batch_size=2.5": ("eval ckpts=[{ckpt}] batch_size=2.5", "batch_size=2.5 must be an integer"),
    "wandb=maybe": ("eval ckpts=[{ckpt}] wandb=maybe", "wandb=maybe must be true or false"),  # text counts as true
    "eval: twice": ("eval ckpts=[{ckpt},{other},{ckpt}] tasks=[x]", "ckpts: {ckpt} is given twice: give each"),
    "eval: twice by another path": (
        "eval ckpts=[{ckpt},inputs/run/checkpoints/../checkpoints/last.ckpt] tasks=[x]",
        "ckpts: {ckpt} is given twice ({ckpt} and inputs/run/checkpoints/../checkpoints/last.ckpt): give each",
    ),
    # export's out, never overwritten (an empty file was "not empty", below a file a raw FileExistsError)
    **{
        f"out={o}": (f"export ckpt={{ckpt}} out={o}", f"out={shown} is empty, the current") for o, shown in OUTS.items()
    },
    "out=full": ("export ckpt={ckpt} out=full", "out: full exists and is not empty; choose another directory (nothing"),
    "out=empty.txt": ("export ckpt={ckpt} out=empty.txt", "out: empty.txt is a file, not a directory; choose another"),
    "out=empty.txt/hf": ("export ckpt={ckpt} out=empty.txt/hf", "out: empty.txt is a file, not a directory; choose"),
    # generate's options, checked before the checkpoint is read
    "top_k=0": ("generate ckpt={ckpt} top_k=0", "top_k=0 must be >= 1"),
    "temperature=-1": ("generate ckpt={ckpt} temperature=-1", "temperature=-1 must be >= 0"),
    "nan weights": ("generate ckpt={nan}", f"ckpt: {{nan}} {DIVERGED}"),
    "overflowing weights": ("export ckpt={huge} out=hf", f"ckpt: {{huge}} {DIVERGED}"),
    "temperature=nan": ("generate ckpt={ckpt} temperature=nan", "temperature=nan must be a finite number"),
    "prompt=1e3": (
        "generate ckpt={ckpt} prompt=1e3",
        "prompt must be text: quote one that Hydra reads as a number or boolean, e.g. prompt='\"1e3\"', got 1000.0",
    ),
    "max_new_tokens=0": ("generate ckpt={ckpt} max_new_tokens=0", "max_new_tokens=0 must be >= 1"),
    "num_samples=0": ("generate ckpt={ckpt} num_samples=0", "num_samples=0 must be >= 1"),
    "seed=abc": ("generate ckpt={ckpt} seed=abc", "seed=abc must be an integer"),
    "seed=2**64": ("generate ckpt={ckpt} seed=18446744073709551616", "seed=18446744073709551616 must be <= 4294967295"),
    # analyze's options; equal labels would draw two checkpoints as one line
    "sequences=0": ("analyze ckpts=[{ckpt}] sequences=0", "sequences=0 must be >= 1"),
    "chunk=0": ("analyze ckpts=[{ckpt}] chunk=0", "chunk=0 must be >= 1"),
    "position_buckets=17": (
        "analyze ckpts=[{data}] position_buckets=17",
        "position_buckets=17 is above the 16 positions of {data}'s windows",
    ),
    "labels=[a,b]": ("analyze ckpts=[{ckpt}] labels=[a,b]", "labels: 2 labels for 1 checkpoints"),
    "labels=foo": ("analyze ckpts=[{ckpt},{ckpt}] labels=foo", "labels: 1 labels for 2 checkpoints"),  # not 3 letters
    "labels=[a,a]": ("analyze ckpts=[{ckpt},{ckpt}] labels=[a,a]", "labels: 'a' labels more than one checkpoint"),
    "analyze: away from its run": (
        "analyze ckpts=[{lone}]",
        "ckpts: {lone} is neither in a run's checkpoints/ folder nor beside its config.yaml",
    ),
    "analyze: config.yaml gone": ("analyze ckpts=[{ckpt}]", "ckpts: {run}/config.yaml not found"),
}


TASK_FILES = {"a": "task: cloze", "b": "task: cloze", "broken": "task: [unclosed", "listed": "- task: a"}
TASK_FILES |= {"nameless": "dataset_path: json"}


@pytest.fixture(scope="module")
def data_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data_run")
    with contextlib.chdir(folder):
        return local_run(folder)[0]


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", REFUSED.values(), ids=REFUSED.keys())
def test_each_command_refuses_in_one_line_and_writes_nothing(
    args: str, expected: str, data_run: Path, data_cache: Path, tmp_path: Path, monkeypatch, capsys
):
    paths = not_checkpoints(tmp_path / "inputs") | {"data": data_run, "other": write_checkpoint(tmp_path / "other")}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "empty.txt").write_text("")
    before, out = sorted(tmp_path.rglob("*")), tmp_path / "out"
    argv = [arg.format(**paths) for arg in args.split()] + [f"hydra.run.dir={out}"] * (
        args.split()[0] in ("analyze", "eval")
    )
    proc = cli_in_process(argv, data_cache, tmp_path, monkeypatch, capsys)
    assert assert_refused(proc).startswith(f"xsa-lm: error: {expected.format(**paths)}")
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing overwritten
