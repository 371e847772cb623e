"""`xsa-lm prepare` -> shards -> `xsa-lm train data=prepared`, through the CLI as a user runs it."""

import json
import shlex
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import FAST, assert_clean_error, assert_refused, cli_in_process, run_cli, start_cli, wait_for
from tests.leftovers import nothing_left_behind
from tests.test_data import many_docs, shakespeare_text, write_jsonl
from xsa_lm.config.command_line import override

pytestmark = pytest.mark.slow
TRAIN = [o for o in FAST if not o.startswith("tokenizer.")]  # data=prepared: the shards' own tokenizer


def prepare_args(corpus: str, out: Path, *extra: str) -> list[str]:
    bpe = ["tokenizer=bpe", "tokenizer.vocab_size=300", "data.val_fraction=0.05", "progress_bar=false"]
    return ["prepare", "data=local", f"data.files={corpus}", *bpe, override("data.dir", out), *extra]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    write_jsonl(root / "corpus" / "part-0.jsonl", many_docs(3000))
    write_jsonl(root / "corpus" / "part-1.jsonl", many_docs(3000)[::-1])
    out = root / "shards"
    proc = run_cli(prepare_args(str(root / "corpus" / "*.jsonl"), out, "data.shard_documents=1000"), data_cache, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"train on it: xsa-lm train data=prepared data.dir={out}" in proc.stdout
    return out


def test_prepare_writes_shards_and_metadata(prepared: Path):
    meta = json.loads((prepared / "meta.json").read_text())
    assert len(meta["shards"]) == 6 and meta["dtype"] == "uint16" and meta["vocab_size"] <= 300
    assert meta["train_documents"] + meta["val_documents"] == 6000 and meta["val_documents"] > 100
    assert meta["tokenizer"]["config"]["vocab_size"] == 300 and len(meta["tokenizer"]["sha256"]) == 64
    assert meta["identity"]["source"]["text_field"] == "text"
    assert meta["split"] == meta["identity"]["split"] == "document"  # 6000 x 0.05: whole documents
    sizes = [(prepared / f"train-{s['index']:06d}.bin").stat().st_size for s in meta["shards"]]
    assert sizes == [2 * s["train_tokens"] for s in meta["shards"]]


def test_train_on_prepared_shards_needs_no_source(prepared: Path, data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["train", *TRAIN, "data=prepared", f"data.dir={prepared}", "trainer.max_steps=20"]
    proc = run_cli([*args, f"hydra.run.dir={run_dir}"], data_cache, tmp_path, HF_DATASETS_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_val_loss"] < np.log(300)
    assert json.loads((run_dir / "run_info.json").read_text())["data_dir"] == str(prepared)
    # The same tokenizer named explicitly is fine.
    same = ["tokenizer.vocab_size=300", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run2'}"]
    again = run_cli(["train", *TRAIN, "data=prepared", f"data.dir={prepared}", *same], data_cache, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_relative_data_dir_is_the_one_beside_where_the_run_started(
    prepared: Path, data_cache: Path, tmp_path: Path, monkeypatch, capsys
):
    """A resume run from inside the run's folder read `data.dir=shards` from there ("no finished preparation"); a
    command on a run whose data folder is gone names the folder the run used, and says it does not exist."""
    shutil.copytree(prepared, tmp_path / "shards")
    args = ["train", *TRAIN, "data=prepared", "data.dir=shards", "trainer.max_steps=4", "val_every_steps=2"]
    first = run_cli([*args, "hydra.run.dir=run"], data_cache, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run_cli(["train", "resume=auto", "trainer.max_steps=6", "hydra.run.dir=."], data_cache, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 6
    (tmp_path / "shards").rename(tmp_path / "moved")
    args = ["analyze", "ckpts=[run/checkpoints/last.ckpt]", "sequences=2", "hydra.run.dir=analysis"]
    gone = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert_clean_error(gone, f"data.dir={tmp_path / 'shards'} does not exist: restore it, or run `xsa-lm prepare")


@pytest.mark.long  # a run and its resume from another folder (~15 s)
def test_a_resume_from_elsewhere_reads_the_files_and_tokenizer_the_run_started_with(
    prepared: Path, data_cache: Path, tmp_path: Path
):
    """Relative data.files and tokenizer.path are read from where the run started: resumed from a folder that holds
    another input.txt, the run trained on it without a word (its earlier validations dropped as another set's)."""
    text = shakespeare_text(60_000)
    for folder, part in (("A", text[:30_000]), ("B", text[30_000:])):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "input.txt").write_text(part)
    shutil.copy(prepared / "tokenizer.json", tmp_path / "A" / "tok.json")
    data = ["data=local", "data.files=input.txt", "tokenizer=file", "tokenizer.path=tok.json"]
    args = ["train", *TRAIN, *data, "trainer.max_steps=4", "val_every_steps=2", "hydra.run.dir=../run"]
    first = run_cli(args, data_cache, tmp_path / "A")
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = run_cli(
        ["train", "resume=auto", "trainer.max_steps=6", "hydra.run.dir=../run"], data_cache, tmp_path / "B"
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "another validation set" not in resumed.stdout + resumed.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [point["step"] for point in summary["val_history"]] == [2, 4, 6]
    sources = [json.loads(p.read_text())["identity"]["source"] for p in data_cache.glob("local-*/meta.json")]
    assert str(tmp_path / "A" / "input.txt") in str(sources) and str(tmp_path / "B") not in str(sources)


@pytest.mark.long  # make test resumes an interrupted preparation in-process (test_data.py)
def test_killed_preparation_resumes_to_identical_shards(data_cache: Path, tmp_path: Path):
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(100_000))
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    args = partial(prepare_args, str(tmp_path / "corpus.jsonl"))
    small = ["data.shard_documents=500", "tokenizer.vocab_size=260"]
    proc = start_cli(args(killed, *small), data_cache, tmp_path)
    wait_for(tmp_path / "killed.partial" / "shard-000003.json", proc)  # renamed to `killed` when whole
    proc.kill()
    proc.wait()
    assert not killed.exists()
    stamp = (tmp_path / "killed.partial" / "train-000000.bin").stat().st_mtime_ns
    for out in (killed, whole):
        done = run_cli(args(out, *small), data_cache, tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (killed / "train-000000.bin").stat().st_mtime_ns == stamp  # finished shards are never rewritten
    names = sorted(p.name for p in whole.glob("*-*.bin"))
    assert names == sorted(p.name for p in killed.glob("*-*.bin")) and len(names) == 400
    for name in names:
        assert (whole / name).read_bytes() == (killed / name).read_bytes(), name


@pytest.fixture(scope="module")
def input_txt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A nanoGPT-style input.txt: one ~100 KB document."""
    path = tmp_path_factory.mktemp("one_file") / "input.txt"
    path.write_text(shakespeare_text(100_000))
    return path


def test_one_text_file_trains_on_the_tail_split(input_txt: Path, data_cache: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    args = ["train", *FAST, "data=local", f"data.files={input_txt}", "trainer.max_steps=6", "val_every_steps=3"]
    proc = run_cli([*args, f"hydra.run.dir={run_dir}"], data_cache, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: 1 document is too few for a document-level split" in proc.stdout
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    data_dir = Path(json.loads((run_dir / "run_info.json").read_text())["data_dir"])
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["split"] == "tail" and meta["identity"]["val_fraction"] == 0.1
    assert meta["train_documents"] == meta["val_documents"] == 1
    assert 0.09 < meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) < 0.11


LOCAL, PREPARED = ["data=local", "data.files={input}"], ["train", *TRAIN, "data=prepared", "data.dir={prepared}"]
REFUSALS = [  # args ({input}: a text file, {bad}: one not UTF-8, {prepared}: shards, {cut}: one cut short), the line
    (["train", *TRAIN, "data=prepared", "data.dir={cut}"], "{cut}/train-000002.bin is truncated or corrupt (100 bytes"),
    ([*PREPARED, "tokenizer.vocab_size=512"], "was prepared with the tokenizer {{'_target_': 'xsa_lm.data.tokenizer"),
    ([*PREPARED, "tokenizer.vocab_size=512"], ": drop the tokenizer override (the shards' own tokenizer is used)"),
    ([*PREPARED, "model.vocab_size=128"], "model.vocab_size=128 is smaller than the tokenizer's "),
    (["prepare", "data.tokenizer_documents=0"], "data.tokenizer_documents=0 must be >= 1"),
    (["prepare", *LOCAL, "data.shard_documents=0"], "data.shard_documents=0 must be >= 1"),
    (["prepare", *LOCAL, "data.prepare_workers=0"], "data.prepare_workers=0 must be >= 1"),
    (["prepare", "data=local", "data.files={bad}"], "data.files: {bad} is not UTF-8 text (invalid byte at offset 3)"),
    (["prepare", "data=local", "data.files={cut}"], "data.files: '{cut}' matches only a directory"),
    (["train", *TRAIN, *LOCAL, "tokenizer=file", "tokenizer.path={bad}"], "tokenizer.path: {bad} is not a tokenizer"),
]


@pytest.mark.parametrize(("args", "message"), REFUSALS)
def test_bad_settings_are_one_line(
    args, message, input_txt, prepared, data_cache, tmp_path, monkeypatch, capsys, caches
):
    """Nothing is written: no shards, no folder in the data cache, no run folder, no log folder where it was typed."""
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    cut = Path(shutil.copytree(prepared, tmp_path / "cut")) / "train-000002.bin"
    cut.write_bytes(cut.read_bytes()[:100])
    where = {"input": input_txt, "bad": tmp_path / "bad.txt", "prepared": prepared, "cut": cut.parent}
    out = [f"data.dir={tmp_path / 'out'}"] if args[0] == "prepare" else [f"hydra.run.dir={tmp_path / 'run'}"]
    args = [arg.format(**where) for arg in [*args, *out, f"data.cache_dir={tmp_path / 'cache'}"]]
    with nothing_left_behind(tmp_path, data_cache):
        proc = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert assert_refused(proc, message.format(**where))


def test_the_printed_train_command_works_pasted(data_cache: Path, tmp_path: Path, monkeypatch, capsys):
    """prepare's `train on it:` line for a folder with a space, a non-ASCII character, an apostrophe, a comma and
    brackets, split as a shell splits it, is read by Hydra as the folder: the run it starts loads the shards (refused
    after, by a vocabulary smaller than theirs, to stay fast). Each character alone: test_one_line_errors.py."""
    folder = "my données, it's [copy]"
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(40))
    args = prepare_args(str(tmp_path / "corpus.jsonl"), tmp_path / folder)
    prepared = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    line = prepared.stdout.strip().splitlines()[-1].removeprefix("train on it: ")
    words = shlex.split(line)
    assert words[:4] == ["xsa-lm", "train", "data=prepared", f"data.dir={words[3].split('=', 1)[1]}"]
    args = [*words[1:], *TRAIN, "model.vocab_size=128", f"hydra.run.dir={tmp_path / 'run'}"]
    refused = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert_refused(refused, "model.vocab_size=128 is smaller than the tokenizer's")
