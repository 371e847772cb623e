"""Whatever goes wrong ends in one line: a failed write leaves the previous file whole and no .tmp, an unforeseen
exception names itself and its saved traceback, a bad command line says what to type instead."""

import csv
import errno
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig

from tests.helpers import FAST, TINY, assert_clean_error, refused_in_process, run_cli
from tests.leftovers import nothing_left_behind
from xsa_lm import cli, errors
from xsa_lm.config.command_line import override, pasteable
from xsa_lm.errors import UserError, WriteError, exit_on_user_error
from xsa_lm.files import atomic_file, write_json
from xsa_lm.model import GPTConfig
from xsa_lm.records import RunSummary

DISK_FULL = OSError(errno.ENOSPC, "No space left on device")
TORCH_SAVE = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
TORCH_SAVE.__context__ = DISK_FULL  # what torch.save raises: a RuntimeError while handling the OSError
FAILURES = [(DISK_FULL, "No space"), (OSError(errno.EFBIG, "File too large"), "too large"), (TORCH_SAVE, "No space")]


@pytest.mark.parametrize("failure, reason", FAILURES)
@pytest.mark.parametrize("existed", [True, False], ids=["over an old file", "a new file"])
def test_a_failed_write_leaves_the_previous_file_whole_and_no_tmp(failure, reason: str, existed: bool, tmp_path: Path):
    path = tmp_path / "results.json"
    if existed:
        write_json(path, {"old": 1})
    with pytest.raises(WriteError) as error, atomic_file(path) as f:
        f.write('{"new": ')
        raise failure
    message = str(error.value)
    assert message.startswith(f"could not write {path} (") and reason in message, message
    assert ("the previous results.json is intact" if existed else "no partial file was left") in message
    assert sorted(tmp_path.iterdir()) == ([path] if existed else [])  # no .tmp, no 0-byte file
    if existed:
        assert json.loads(path.read_text()) == {"old": 1}


def test_exclusive_creation_refuses_a_file_made_meanwhile(tmp_path: Path):
    path = tmp_path / "bench.json"
    write_json(path, {"theirs": 1})
    with pytest.raises(FileExistsError):
        write_json(path, {"ours": 1}, replace=False)
    assert json.loads(path.read_text()) == {"theirs": 1} and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("new_metric", [False, True], ids=["an append", "a new header"])
def test_a_metrics_write_that_fails_leaves_metrics_csv_whole(new_metric: bool, monkeypatch, tmp_path: Path):
    from xsa_lm.tracking import RunCSVLogger

    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss\n0,1.5\n")
    writer = RunCSVLogger(save_dir=str(tmp_path)).experiment
    writer.log_metrics({"val/loss" if new_metric else "train/loss": 1.25}, step=1)

    def disk_full(self: csv.DictWriter, rows: list) -> None:
        self.writer.writerow(["1", "1.2"])  # part of the rows reaches the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", disk_full)
    with pytest.raises(WriteError, match=r"metrics.csv \(No space left on device\); its earlier rows are intact"):
        writer.save()
    assert path.read_text() == "step,train/loss\n0,1.5\n" and sorted(tmp_path.iterdir()) == [path]


def limit_file_size() -> None:
    """In the child: a file may not grow past 256 KiB. SIGXFSZ ignored (as Python itself does at start-up): a write
    past the limit raises OSError(EFBIG) instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


@pytest.mark.slow
def test_a_file_size_limit_mid_run_is_one_line_and_leaves_no_partial_file(data_cache: Path, tmp_path: Path):
    """A corpus whose prepared files stay under the limit; the run's first checkpoint cannot be written: one line
    naming it, exit 2, summary.json says failed, and no .tmp or 0-byte file anywhere."""
    (tmp_path / "corpus.txt").write_text("To be, or not to be, that is the question.\n" * 600)
    run_dir = tmp_path / "run"
    args = ["train", *FAST, "data=local", f"data.files={tmp_path / 'corpus.txt'}", "data.val_windows=8"]
    args += ["trainer.max_steps=5", "val_every_steps=5", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, data_cache, tmp_path, preexec_fn=limit_file_size)
    line = assert_clean_error(proc, "could not write", "checkpoints/best.ckpt", "File too large", "ulimit -f")
    assert proc.returncode == 2 and "no checkpoint was written yet" in line
    assert [p for p in run_dir.rglob("*") if p.name.endswith(".tmp") or p.stat().st_size == 0] == []
    summary = json.loads((run_dir / "summary.json").read_text())  # fit() records the failure before re-raising
    assert summary["status"] == "failed" and "File too large" in summary["error"]


def test_an_unforeseen_error_is_one_line_with_its_traceback_in_the_run_folder(monkeypatch, capsys, tmp_path: Path):
    run_dir = tmp_path / "run"

    def bug(*args, **kwargs):
        try:
            open(tmp_path / "no" / "such.file")
        except OSError:
            raise RuntimeError("something nobody foresaw") from None

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("xsa_lm.train.run.train", bug)
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "train", *FAST, f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "xsa-lm: error: RuntimeError: something nobody foresaw (caused by FileNotFoundError: [Errno 2] No such file "
        f"or directory: '{tmp_path / 'no' / 'such.file'}'); full traceback in {run_dir / 'error.log'}"
    ]
    trace = (run_dir / "error.log").read_text()
    assert "Traceback" in trace and "in bug" in trace and "RuntimeError: something nobody foresaw" in trace


def test_without_a_run_folder_the_traceback_goes_to_a_temporary_file(monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # no Hydra job (an earlier test's would linger)
    with pytest.raises(SystemExit) as exit_, exit_on_user_error():
        raise KeyError("boom")
    assert exit_.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("xsa-lm: error: KeyError: 'boom'; full traceback in ")
    saved = Path(line.rsplit(" ", 1)[1])
    assert "KeyError: 'boom'" in saved.read_text()
    saved.unlink()


def test_a_folder_that_cannot_be_removed_stays_without_a_traceback(monkeypatch, tmp_path: Path):
    """A refused run's empty folder is removed, with the empty folders above it in the current directory; one whose
    parent cannot be written stays (the refusal was said)."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "outputs" / "train" / "now"
    run_dir.mkdir(parents=True)
    monkeypatch.setattr(errors, "hydra_run_dir", lambda: run_dir)
    errors.remove_empty_run_dir()
    assert list(tmp_path.iterdir()) == []

    def read_only(path: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    run_dir.mkdir(parents=True)
    monkeypatch.setattr(os, "rmdir", read_only)
    errors.remove_empty_run_dir()
    assert run_dir.is_dir()


COMMAND_LINES = {  # `xsa-lm <args>` -> texts of the one line (a key the command lacks: the closest)
    "multirun: an option": (
        ["train", "-m", "attention=foo"],
        ["Could not find 'attention/foo'", "options in 'attention'"],
    ),
    "multirun: one job's option": (
        ["train", "--multirun", "attention=sa,foo"],
        ["attention/foo", "options in 'attention'"],
    ),
    "multirun: one job's option, into a given folder": (
        ["train", "--multirun", "attention=sa,foo", "hydra.sweep.dir=runs/${now:%H-%M-%S}"],
        ["attention/foo", "options in 'attention'"],
    ),
    "multirun: one job's value": (
        ["train", "-m", "attention=sa,xsa", "seed=-1,0"],
        ["seed=-1 must be >= 0", "(in the job attention=sa seed=-1)"],
    ),
    "space": (
        ["train", "data=local", "data.files=/tmp/my", "dir/a.txt"],
        ["quoted", "e.g. 'data.files=/tmp/my dir/a.txt'"],
    ),
    "bracket": (["train", "data.files=[a"], ["must be quoted"]),
    "an apostrophe": (
        ["train", "samples.prompt=it's"],
        ['quote the value for Hydra too, e.g. "samples.prompt=\\"it\'s\\""'],
    ),
    "a comma": (["train", "samples.prompt=a, b"], ["e.g. 'samples.prompt=\"a, b\"'"]),
    "non-ASCII": (
        ["train", "samples.prompt=日本語"],
        ["non-ASCII character only inside quotes", "e.g. 'samples.prompt=\"日本語\"'"],
    ),
    # an empty path is the current directory: an unset shell variable would train into it
    "empty run dir": (["train", "hydra.run.dir="], ["hydra.run.dir is empty (an unset shell variable?): set it to a"]),
    "blank run dir": (["train", "hydra.run.dir= "], ["hydra.run.dir is empty (an unset", "e.g. hydra.run.dir=runs/a"]),
    "empty sweep dir": (
        ["train", "-m", "hydra.sweep.dir="],
        ["hydra.sweep.dir is empty", "e.g. hydra.sweep.dir=runs/a"],
    ),
    **{  # the commands that make no run folder (hydra.run.dir: .), among them one that writes nothing at all
        f"multirun: {command}": ([command, "--multirun", *args], [f"--multirun: xsa-lm {command} makes no run folder"])
        for command, args in {"plan": ["attention=sa,xsa"], "generate": ["ckpt=a,b"], "prepare": ["seed=1,2"]}.items()
    },
    "multirun: run dir": (
        ["train", "-m", "seed=1,2", "hydra.run.dir=x"],
        ["hydra.run.dir is not used under --multirun"],
    ),
    # a key the command's config lacks (Hydra's hint, to add it with `+`, would have it ignored)
    "unknown command": (["trian"], ["unknown command 'trian': did you mean 'train'? (commands: train, "]),
    "generate temprature": (
        ["generate", "ckpt=x", "temprature=0"],
        ["generate has no key temprature: did you mean temperature?"],
    ),
    "eval lmit": (["eval", "ckpts=[x]", "lmit=3"], ["eval has no key lmit: did you mean limit?"]),
    "plan model.n_layr": (["plan", "model.n_layr=2"], ["plan has no key model.n_layr: did you mean model.n_layer?"]),
    "plan +model.n_layr": (["plan", "+model.n_layr=2"], ["model.n_layr: not an option of the model group (it has"]),
    "an option of another attention variant": (
        ["train", "attention=sa", "attention.eps=1e-3"],
        ["xsa-lm: error: attention=sa takes no option eps (attention=xsa takes it)"],
    ),
    "plan: an option no variant takes": (["plan", "attention.epss=0"], ["the chosen attention takes no option epss"]),
    "train optim.lrr": (["train", "optim.lrr=0.1"], ["train has no key optim.lrr: did you mean optim.lr?"]),
    "train another name": (
        ["train", "trainer.accumulate_grad_batches=4"],
        ["train has no key trainer.accumulate_grad_batches: its keys are "],
    ),
    "generate foo.bar": (["generate", "ckpt=x", "foo.bar=1"], ["generate has no key foo.bar: its keys are ckpt, "]),
    "sweep new lr_grids entry": (
        ["sweep", "sweep.lr_grids.mine=[1e-3]"],
        ["sweep has no key sweep.lr_grids.mine yet: add the LR grid of another model.name with +sweep.lr_grids."],
    ),
}


@pytest.mark.parametrize("args, expected", COMMAND_LINES.values(), ids=COMMAND_LINES.keys())
def test_a_bad_command_line_is_refused_in_one_line(
    args: list[str], expected: list[str], monkeypatch, capsys, tmp_path, caches
):
    """No outputs/ folder either: not the multirun.yaml Hydra's sweeper writes before it composes each job."""
    monkeypatch.chdir(tmp_path)
    with nothing_left_behind(tmp_path):
        err = refused_in_process(args, monkeypatch, capsys).strip()
    assert len(err.splitlines()) == 1 and err.startswith("xsa-lm: error: "), err
    for text in expected:
        assert text in err, err


@pytest.mark.parametrize("mode", ["auto", "offline"])
def test_an_unknown_wandb_mode_in_the_environment_is_refused(mode: str, monkeypatch):
    """Whatever logger.wandb.mode says (wandb.init reads WANDB_MODE too); refused where the run checks its config,
    before anything is written (test_bad_inputs.py: an unknown logger.wandb.mode)."""
    from xsa_lm.tracking import resolve_mode

    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(UserError, match="the environment variable WANDB_MODE='bogus' is no W&B mode: set it to"):
        resolve_mode(mode)
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # W&B's older name
    assert resolve_mode(mode) == "offline"


@pytest.mark.slow
def test_wandb_with_a_key_but_no_server_goes_offline_in_one_line_and_leaves_no_debris(
    monkeypatch, capsys, tmp_path: Path
):
    """A fake key and a W&B server that takes no connection (port 9 on this host): offline at once, not after
    init_timeout, with one line and no folder of a failed online run."""
    import wandb

    from xsa_lm.tracking import wandb_init

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings file
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    wandb.teardown()  # W&B's settings are read once per process: read them with these
    started = time.time()
    try:
        run = wandb_init(str(tmp_path), "run", {"lr": 1e-3}, mode="auto")
        run.finish()
    finally:
        wandb.teardown()
    assert time.time() - started < 25  # the online init's timeout alone is 30 s
    assert run.settings.mode == "offline"
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("W&B: 127.0.0.1:9: "), lines
    assert "logging offline in" in lines[0] and "wandb sync" in lines[0]
    assert [p.name for p in (tmp_path / "wandb").glob("run-*")] == []
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1


def finished_run(run_dir: Path, status: str) -> None:
    run_dir.mkdir()
    summary = RunSummary(
        status=status, attention="sa", model="tiny", lr=1e-3, seed=0, final_val_loss=1.0, steps=40, tokens_seen=40960,
        run_dir=str(run_dir), model_config=TINY,
    )  # fmt: skip
    write_json(run_dir / "summary.json", summary.to_json())
    (run_dir / "metrics.csv").write_text("step,train/loss\n1,9.0\n")
    (run_dir / "config.yaml").write_text("original: true\n")


def test_resume_auto_never_replaces_the_results_of_a_run_without_a_checkpoint(monkeypatch, tmp_path: Path):
    from xsa_lm.train.run import FROM_SCRATCH, find_resume_checkpoint

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # not the log file of an earlier in-process job
    finished_run(tmp_path / "completed", "completed")
    with pytest.raises(UserError) as refusal:
        find_resume_checkpoint("auto", tmp_path / "completed", GPTConfig(**TINY))
    assert str(refusal.value) == (
        f"resume=auto: hydra.run.dir={tmp_path / 'completed'} holds the results of a completed run of 40 steps "
        "(summary.json, metrics.csv, config.yaml) but no usable checkpoint to continue from: a new run there would "
        "replace them; choose a new hydra.run.dir, or move the old run aside"
    )
    # Nothing to lose yet: a run that failed (a full disk, say), or was killed, before its first checkpoint.
    finished_run(tmp_path / "failed", "failed")
    assert find_resume_checkpoint("auto", tmp_path / "failed", GPTConfig(**TINY)) == FROM_SCRATCH
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "metrics.csv").write_text("step,train/loss\n1,9.0\n")
    assert find_resume_checkpoint("auto", tmp_path / "killed", GPTConfig(**TINY)) == FROM_SCRATCH


def test_a_refused_job_leaves_no_log_file_handler_into_its_removed_folder(tmp_path: Path, monkeypatch, capsys):
    """Hydra's <run dir>/train.log handler opens its file at the first line: once the refused run's folder is gone,
    a later line in the same process (the next --multirun job, a test) would fail on it."""
    run_dir = tmp_path / "run"
    args = ["train", *FAST, "attention=xsa", "attention.layers=[]", f"hydra.run.dir={run_dir}"]  # refused in the job
    refused_in_process(args, monkeypatch, capsys)
    assert not run_dir.exists()
    files = [Path(h.baseFilename) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    assert run_dir not in [file.parent for file in files]
    logging.getLogger("xsa_lm.train").warning("a line after the refusal")  # raised FileNotFoundError before


def test_ctrl_c_at_any_moment_of_any_command_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while the imports load or while generate samples: one line, the shell's code for SIGINT."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "generate", "ckpt=x.ckpt"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["xsa-lm: interrupted (Ctrl-C) during xsa-lm generate"]


HYDRA_TAKES_BARE = ["/tmp/x", "/tmp/my dir"]


QUOTED = ["/tmp/a  b ", "/tmp/données", "it's", 'a"b\\', "it's $HOME`x`!", "a,b", "a=b", "[a]", "~/x", "1e-3"]


@pytest.mark.parametrize("value", [*HYDRA_TAKES_BARE, *QUOTED])
def test_a_printed_override_reads_back_as_the_value(value: str):
    """A value in a printed command is read back as itself, through bash and then Hydra: bare where both take it
    so, quoted where either would change it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    printed = pasteable("data.dir", value)
    word = subprocess.run(["bash", "-c", f"printf %s {printed}"], capture_output=True, text=True, check=True).stdout
    assert word == override("data.dir", value)
    assert OverridesParser.create().parse_override(word).value() == value
    assert (word == f"data.dir={value}") == (value in HYDRA_TAKES_BARE)


def test_a_list_of_paths_reads_back_as_the_paths():
    """The sweep's `xsa-lm eval ckpts=[...]`: each checkpoint path quoted where Hydra would not take it bare."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    paths = [*HYDRA_TAKES_BARE, *QUOTED]
    assert OverridesParser.create().parse_override(override("ckpts", paths)).value() == paths
