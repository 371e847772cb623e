"""Mistakes a user can make end in one actionable line naming the field, a non-zero exit, and no damage."""

import json
from pathlib import Path

import pytest

from tests.helpers import FAST, assert_clean_error, cli_in_process, refused_in_process, run_cli
from tests.leftovers import nothing_left_behind

pytestmark = pytest.mark.slow


CASES = {  # through the CLI: nothing is written (each rule of the spec: test_schema.py)
    "unknown option": (["attention=foo"], ["attention/foo", "sa", "xsa"]),
    "typo'd key": (["optim.lrr=0.1"], ["optim.lrr"]),
    "negative lr": (["optim.lr=-1e-3"], ["optim.lr"]),
    "missing data path": (["data=local", "data.files=/no/such/dir/*.txt"], ["data.files"]),
    "data=prepared without data.dir": (["data=prepared"], ["data.dir"]),
    "data.dir that holds no shards": (["data=prepared", "data.dir=/no/such/dir"], ["data.dir", "xsa-lm prepare"]),
    "hub dataset offline": (["data=fineweb"], ["data=local data.files="]),
    "missing tokenizer file": (["tokenizer=file", "tokenizer.path=/no/such/tokenizer.json"], ["tokenizer.path"]),
    "resume from a missing checkpoint": (["resume=/no/such.ckpt"], ["resume"]),
    "resume from a file that is no checkpoint": (["resume=/etc/passwd"], ["resume", "not a checkpoint"]),
    "resume from a device": (["resume=/dev/null"], ["resume: /dev/null is not a regular file"]),
    "a model far larger than the machine": (["model.n_layer=100000"], ["needs about", "GiB", "check_memory=false"]),
    "a micro-batch larger than the corpus": (
        ["data=local", "data.files={tmp}/small.txt", "micro_batch_size=64", "global_batch_tokens=4096"],
        ["fewer than micro_batch_size=64"],
    ),
    "an empty corpus": (["data=local", "data.files={tmp}/*.jsonl", "data.val_fraction=0.5"], ["data:", "no text"]),
    # refused after the preparation wrote files (its tokenizer, shards), which go with the folders made for them
    "no document in the validation split": (
        ["data=local", "data.files={tmp}/tiny/c.jsonl", "data.val_split=document", "data.cache_dir={tmp}/cache"],
        ["data: no document fell into the validation split (30 documents"],
    ),
    "a vocabulary under 257": (
        ["data=local", "data.files={tmp}/tiny/c.jsonl", "tokenizer.vocab_size=100", "data.cache_dir={tmp}/new/cache"],
        ["tokenizer.vocab_size must be at least 257"],
    ),
    "a corpus that is not valid JSON": (
        ["data=local", "data.files={tmp}/bad.json"],
        ["data.files: {tmp}/bad.json at line 1, column 26 is not valid JSON (Expecting value)"],
    ),
}


IN_A_SUBPROCESS = {"hub dataset offline"}  # HF_HUB_OFFLINE is read when huggingface_hub is imported


@pytest.mark.parametrize("overrides, expected", CASES.values(), ids=CASES.keys())
def test_bad_input(
    overrides: list[str],
    expected: list[str],
    data_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    request: pytest.FixtureRequest,
    caches: list[Path],
):
    """In this process, as `xsa-lm train ...` runs it (a subprocess adds ~5 s of imports per case and nothing else);
    the working folder and the caches are as they were (a refused run writes nothing, not even an empty folder)."""
    run_dir = tmp_path / "run"
    (tmp_path / "small.txt").write_text("To be, or not to be, that is the question.\n" * 60)
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n' * 20)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "c.jsonl").write_text("".join(f'{{"text": "document {i}, tiny"}}\n' for i in range(30)))
    (tmp_path / "bad.json").write_text('[{"text": "a"}, {"text": ')
    overrides, expected = [o.format(tmp=tmp_path) for o in overrides], [e.format(tmp=tmp_path) for e in expected]
    switches_tokenizer = any(o.startswith("tokenizer=") for o in overrides)
    fast = [a for a in FAST if not (switches_tokenizer and a.startswith("tokenizer."))]
    args = ["train", *fast, *overrides, f"hydra.run.dir={run_dir}"]
    monkeypatch.setenv("XSA_LM_DATA_DIR", str(data_cache))
    with nothing_left_behind(tmp_path):
        if request.node.callspec.id in IN_A_SUBPROCESS:
            out = run_cli(args, data_cache, tmp_path)
            assert_clean_error(out, *expected)
            assert out.returncode == 2
        else:
            monkeypatch.chdir(tmp_path)
            err = refused_in_process(args, monkeypatch, capsys)  # exit code 2
            assert "Traceback" not in err
            last = err.strip().splitlines()[-1]
            assert last.startswith("xsa-lm"), err[-2000:]
            for text in expected:
                assert text in last, last


def test_existing_run_is_never_overwritten(data_cache: Path, tmp_path: Path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "final_val_loss": 1.0}))
    (run_dir / "config.yaml").write_text("original: true\n")
    out = cli_in_process(["train", *FAST, f"hydra.run.dir={run_dir}"], data_cache, tmp_path, monkeypatch, capsys)
    assert_clean_error(out, "hydra.run.dir", "resume=auto")
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == 1.0
    assert (run_dir / "config.yaml").read_text() == "original: true\n"
    assert not (run_dir / "checkpoints").exists()


def test_run_directory_that_cannot_be_created(data_cache: Path, tmp_path: Path, monkeypatch, capsys):
    args = ["train", *FAST, "hydra.run.dir=/proc/xsa-lm-run"]  # /proc: no new folders
    out = cli_in_process(args, data_cache, tmp_path, monkeypatch, capsys)
    assert_clean_error(out, "hydra.run.dir=/proc/xsa-lm-run", "cannot be created")
    assert out.returncode == 2
