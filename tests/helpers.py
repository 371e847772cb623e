"""What several test modules share: the fast recipe, the CLI runners, composition, checks of a refusal, small files."""

import csv
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from xsa_lm import cli
from xsa_lm.config.command_line import ARGV_VARIABLE
from xsa_lm.model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]

# A fast training recipe for tests: the tiny model, shortened, on the bundled corpus.
FAST = """model=tiny model.n_layer=2 model.d_model=64 model.n_head=2 model.head_dim=32 model.block_size=64
tokenizer.vocab_size=512 global_batch_tokens=1024 micro_batch_size=8 optim.lr=3e-3 scheduler.warmup_steps=5
trainer=cpu trainer.max_steps=40 trainer.log_every_n_steps=1 val_every_steps=20 data.val_windows=64 logger=csv
progress_bar=false""".split()


def cli_env(data_cache: Path, home: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(XSA_LM_DATA_DIR=str(data_cache), WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if home is not None:
        env["HOME"] = str(home)
    return env


def run_cli(
    args: list[str],
    data_cache: Path,
    cwd: Path,
    timeout: int = 300,
    module: str = "xsa_lm.cli",
    preexec_fn: Callable[[], None] | None = None,
    **env,
) -> subprocess.CompletedProcess:
    """`xsa-lm <args>` in a subprocess (`module`: another entry point; `preexec_fn`: run in the child first)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env={**cli_env(data_cache), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


@contextmanager
def process_state_restored() -> Iterator[None]:
    """The environment and every logger as they were before a command ran in this process (eval sets HF switches,
    generate's hydra/job_logging: disabled disables every logger)."""
    environ = dict(os.environ)
    loggers = [
        logging.getLogger(),
        *(g for g in logging.Logger.manager.loggerDict.values() if isinstance(g, logging.Logger)),
    ]
    saved = [(g, g.disabled, g.level, g.propagate, list(g.handlers)) for g in loggers]
    try:
        yield
    finally:
        for g in logging.Logger.manager.loggerDict.values():
            if isinstance(g, logging.Logger) and g not in loggers:  # made during the command (a module it imported)
                g.disabled = False
        for g, disabled, level, propagate, handlers in saved:
            for handler in set(g.handlers) - set(handlers):
                handler.close()
            g.disabled, g.propagate, g.handlers[:] = disabled, propagate, handlers
            g.setLevel(level)  # also clears the loggers' cached levels
        os.environ.clear()
        os.environ.update(environ)


def cli_in_process(
    args: list[str], data_cache: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> subprocess.CompletedProcess:
    """`xsa-lm <args>` in this process with run_cli's environment and folder, for commands refused before training
    (a check read at import time, such as HF_HUB_OFFLINE, needs run_cli)."""
    for name in [n for n in os.environ if n.startswith(("WANDB_", "HYDRA_"))]:
        monkeypatch.delenv(name)
    for name, value in {**cli_env(data_cache), ARGV_VARIABLE: "null"}.items():
        monkeypatch.setenv(name, value)  # restored after the test, with what the CLI sets itself
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["xsa-lm", *args])
    capsys.readouterr()
    try:
        with process_state_restored():
            cli.main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def refused_in_process(args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """`xsa-lm <args>` in this process, refused (exit code 2): its stderr."""
    monkeypatch.setattr(sys, "argv", ["xsa-lm", *args])
    monkeypatch.setenv(ARGV_VARIABLE, "null")  # restored after the test
    with pytest.raises(SystemExit) as exit_, process_state_restored():
        cli.main()
    assert exit_.value.code == 2, exit_.value.code
    return capsys.readouterr().err


def start_cli(args: list[str], data_cache: Path, cwd: Path) -> subprocess.Popen:
    """`xsa-lm <args>` started in the background, its output piped."""
    command, pipe = [sys.executable, "-m", "xsa_lm.cli", *args], subprocess.PIPE
    return subprocess.Popen(command, cwd=cwd, env=cli_env(data_cache), stdout=pipe, stderr=pipe, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"the run ended before {path.name} appeared"
        time.sleep(0.02)


def compose_train(overrides: list[str], config_name: str = "train") -> DictConfig:
    """A config as the CLI composes it (configs/<config_name>.yaml with the overrides), in this process."""
    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def train_from(cfg: DictConfig, run_dir: Path, **kwargs):
    """`xsa-lm train` of a composed config in this process, as its main does."""
    from xsa_lm.config.spec import TrainSpec, parse
    from xsa_lm.train.run import train

    return train(parse(TrainSpec, cfg), OmegaConf.to_container(cfg, resolve=True), run_dir, **kwargs)


def assert_refused(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """assert_clean_error's line, alone on stderr, `xsa-lm: error: ...`, exit code 2."""
    line = assert_clean_error(proc, *expected)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line], proc.stderr[-2000:]
    assert line.startswith("xsa-lm: error: "), line
    return line


def assert_clean_error(out: subprocess.CompletedProcess, *expected: str) -> str:
    """A non-zero exit whose last line on stderr is xsa-lm's, with the expected texts, and no traceback."""
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("xsa-lm"), out.stderr[-2000:]
    for text in expected:
        assert text in last, last
    return last


def assert_nothing_written(folder: Path) -> None:
    assert not folder.exists(), sorted(folder.iterdir())  # not even the folder Hydra made


TINY = dict(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=16)
# Gated XSA with grouped heads: every input of the XSA ops (the gate, GQA broadcasting) in one small layer
GATED_GQA = dict(
    n_layer=1,
    d_model=32,
    n_head=4,
    head_dim=8,
    n_kv_head=2,
    vocab_size=64,
    block_size=16,
    attention="xsa",
    xsa_gate=True,
)


def lightning_checkpoint(config: GPTConfig) -> dict:
    """What `xsa-lm train` saves, as far as load_model reads it: Lightning's prefixed state_dict and the config."""
    torch.manual_seed(0)
    state = {f"model.{k}": v for k, v in GPT(config).state_dict().items()}
    return {"state_dict": state, "model_config": asdict(config), "global_step": 0}


def write_checkpoint(run_dir: Path, config: GPTConfig | None = None) -> Path:
    """A checkpoint of the tiny model in <run_dir>/checkpoints/last.ckpt (no training; no tokenizer beside it)."""
    path = run_dir / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(lightning_checkpoint(config or GPTConfig(**TINY)), path)
    return path


def train_losses(run_dir: Path) -> dict[int, float]:
    """train/loss per step from metrics.csv (a resumed run's later rows win)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


QUESTIONS = [
    ("The cat sat on the", ["mat", "sky", "moon"], 0),
    ("A dog ran in the", ["river", "park", "cloud"], 1),
    ("the cat ran", ["too", "never", "fast"], 0),
    ("on the", ["mat", "cat", "dog"], 0),
]


def write_local_task(folder: Path) -> Path:
    """A 4-question multiple-choice task for lm-evaluation-harness, as a local task YAML and its items."""
    folder.mkdir(parents=True, exist_ok=True)
    items = folder / "items.jsonl"
    items.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    task = folder / "toy_mc.yaml"
    task.write_text(f"""task: xsa_toy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return task
