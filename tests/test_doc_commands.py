"""Every command README.md and docs/*.md show (code blocks but ```text ones, and inline code) runs as written.

- Up-front checks (every command, and a shown `make` target's xsa-lm commands, in this process): what the CLI and
  the job check before anything is written, each `--multirun` job apart; `...` stands for other overrides.
- RUN (make test-long): run for real, in order, in one folder, each shrunk as its entry says.
- NOT_RUN: every other command of a code block, with why and where it is tested instead; a command in neither list
  fails, and so does an entry no page shows any more.
"""

import itertools
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict

from tests.helpers import compose_train, run_cli
from xsa_lm.analysis.run import AnalyzeOptions
from xsa_lm.bench.run import resolve_device
from xsa_lm.config.command_line import check_command_line, check_job, hydra_problem
from xsa_lm.config.spec import VALUES_ONLY, PrepareSpec, TrainSpec, parse
from xsa_lm.eval.run import EvalOptions, require_harness
from xsa_lm.eval.sample import GenerateOptions
from xsa_lm.export.run import require_transformers
from xsa_lm.train.plan import run_shape

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# the shell variables of the shown commands: a folder in the test's temp dir, or a value
VARIABLES = {"DATA": "{tmp}/data", "SCRATCH": "{tmp}/scratch", "PWD": "{tmp}", "SLURM_JOB_ID": "1"}
ELIDED = "elided"  # the stand-in for a `key=...` value
HYDRA_FLAGS = {"--multirun", "-m", "--help", "-h", "--cfg", "-c", "--config-dir"}  # --cfg, --config-dir take a value
STUBS = ["srun", "sbatch"]  # programs the shown commands name for a cluster; the checks find a stub of each on PATH


@dataclass(frozen=True)
class Shown:
    """One command as a page shows it: `text` (its name in RUN and NOT_RUN); `argv`: what follows `xsa-lm` or `make`."""

    page: str
    text: str
    program: str  # xsa-lm | make
    argv: tuple[str, ...]
    fenced: bool  # from a code block (must be in RUN or NOT_RUN), else inline code in the prose

    @property
    def elided(self) -> bool:
        return any(a == "..." or a.endswith(("=...", "=[...]")) for a in self.argv)


def shell_lines(block: str, console: bool) -> list[str]:
    """The block's commands, continuation lines joined; in a ```console block the `$ ` lines."""
    commands, current = [], None
    for line in block.splitlines():
        if console and current is None:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        current = line if current is None else f"{current} {line.strip()}"
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1]
            continue
        commands.append(current)
        current = None
    return commands


def simple_commands(words: list[str]) -> list[list[str]]:
    """Words split at `&&`, `||`, `;` and `|`."""
    return [list(g) for sep, g in itertools.groupby(words, lambda w: w in ("&&", "||", ";", "|")) if not sep]


def command_of(words: list[str]) -> tuple[str, tuple[str, ...]] | None:
    """(program, argv) of an xsa-lm or make command, else None."""
    for i, word in enumerate(words):
        rest = words[i + 1 :]
        if word == "xsa-lm" or word.endswith("/xsa-lm"):
            if rest and re.fullmatch(r"[a-z][\w-]*", rest[0]):  # `docker build -t xsa-lm .` names an image
                return "xsa-lm", tuple(rest)
        elif word == "-m" and rest and rest[0] in ("xsa_lm.train", "xsa_lm.cli"):
            return "xsa-lm", tuple(rest[1:]) if rest[0] == "xsa_lm.cli" else ("train", *rest[1:])
        elif word == "make" and i == 0 and rest:
            return "make", tuple(rest)
    return None


def shown_in(page: Path) -> list[Shown]:
    markdown, label = page.read_text(), str(page.relative_to(REPO))
    found = []
    for language, block in FENCE.findall(markdown):
        if language in ("text", "python", "yaml"):
            continue
        for line in shell_lines(block, console=language == "console"):
            for words in simple_commands(shlex.split(line, comments=True)):
                if parsed := command_of(words):
                    found.append(Shown(label, " ".join(words), *parsed, fenced=True))
    for span in re.findall(r"`([^`]+)`", FENCE.sub("", markdown)):
        if not re.match(r"(\w+=\S* )*(xsa-lm |python -m xsa_lm\.|torchrun )", span):  # prose, or a message
            continue
        words = shlex.split(" ".join(span.split()))
        parsed = command_of(words)
        if parsed and parsed[0] == "xsa-lm" and len(parsed[1]) > 1:  # `xsa-lm eval` alone names the command
            found.append(Shown(label, " ".join(words), *parsed, fenced=False))
    return found


def all_shown() -> list[Shown]:
    return [shown for page in PAGES for shown in shown_in(page)]


def fenced() -> dict[str, Shown]:
    """Every command of a code block, once (the first page that shows it)."""
    commands: dict[str, Shown] = {}
    for shown in all_shown():
        if shown.fenced:
            commands.setdefault(shown.text, shown)
    return commands


def expand(word: str, tmp: Path) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in VARIABLES, f"${name} in a documented command: give it a value in VARIABLES"
        return VARIABLES[name].format(tmp=tmp)

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, word)


def recipe_commands(target: str) -> list[tuple[str, ...]]:
    """The xsa-lm commands of a Makefile target's recipe, as make would run them (a `$$(date ...)` as a time)."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)*)", makefile, re.M)
    assert recipe, f"no target {target} in the Makefile"
    commands = []
    for line in recipe.group(1).splitlines():
        if "xsa-lm" not in line:
            continue
        line = re.sub(r"\$\$\(date [^)]*\)", "2026-01-01_00-00-00", line.strip()).replace("$(BIN)/", "")
        for words in simple_commands(shlex.split(line)):
            if (parsed := command_of(words)) and parsed[0] == "xsa-lm":
                commands.append(parsed[1])
    return commands


# What is run for real, and what is not and why. A key is a command as the shell sees it (quotes removed).

# Appended to a training command that RUN shrinks: one layer of width 32, 4 steps of 1024 tokens, 8 validation windows,
# a BPE of 512 tokens (the one the other tests train), metrics.csv only (W&B offline costs seconds per run and has
# its own tests, test_wandb_offline.py), no progress bar.
TINY_TRAIN = """model.n_layer=1 model.d_model=32 model.n_head=2 model.head_dim=16 trainer.max_steps=4 val_every_steps=2
global_batch_tokens=1024 micro_batch_size=8 data.val_windows=8 logger=csv progress_bar=false""".split()
VOCAB = ["tokenizer.vocab_size=512"]  # not on shards: their own tokenizer is used, another one would be refused

RUN: list[tuple[str, list[str], str]] = [  # in this order, in one folder: (command, appended, why)
    ("xsa-lm prepare data=local data.files=corpus/*.jsonl data.dir=shards/mine", [], "as written, on corpus/"),
    ("xsa-lm train data=prepared data.dir=shards/mine attention=xsa", TINY_TRAIN, "the shards written just before"),
    ("xsa-lm train experiment=demo hydra.run.dir=runs/sa", TINY_TRAIN + VOCAB, "150 steps of the tiny model"),
    ("xsa-lm train experiment=demo attention=xsa hydra.run.dir=runs/xsa", TINY_TRAIN + VOCAB, "the same with XSA"),
    (
        "xsa-lm train hydra.run.dir=runs/xsa resume=auto trainer.max_steps=400",
        ["trainer.max_steps=6"],
        "2 steps more than the run it continues; a resume takes no other override",
    ),
    (
        "xsa-lm analyze ckpts=[runs/sa/checkpoints/last.ckpt,runs/xsa/checkpoints/last.ckpt] hydra.run.dir=runs/fig1",
        [],
        "as written",
    ),
    (
        "xsa-lm generate ckpt=runs/xsa/checkpoints/last.ckpt prompt=ROMEO: max_new_tokens=200 temperature=0.8 top_k=50",
        [],
        "as written",
    ),
    ("xsa-lm export ckpt=runs/xsa/checkpoints/last.ckpt out=hf/xsa", [], "as written"),
    (
        "xsa-lm plan model=paper_2.7b trainer=fsdp trainer.devices=8 micro_batch_size=8 global_batch_tokens=524288 "
        "device_memory_gb=80",
        [],
        "as written",
    ),
    ("xsa-lm train", TINY_TRAIN + VOCAB, "1000 steps; the run folder is checked: outputs/train/<time>_tiny_sa/"),
    ("xsa-lm train data=local data.files=input.txt", TINY_TRAIN + VOCAB, "1000 steps, on input.txt"),
    (
        "xsa-lm train +callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor "
        "+callbacks.lr.logging_interval=step",
        [*TINY_TRAIN, *VOCAB, "trainer.log_every_n_steps=1", "hydra.run.dir=runs/lr"],
        "a callback Lightning ships, from the command line; its LR columns are checked",
    ),
]

ELSEWHERE_SWEEP = "the whole protocol of a sweep runs in test_sweep.py (long)"
ON_SLURM = "test_slurm_sweep.py runs a demo-size sweep with launcher=slurm on a real SLURM (long)"
GPU = "needs a GPU"
VARIANT = "a lab's variant from its folder (relative to the repository): test_variants.py trains it (long)"
NOT_RUN = {  # command -> why it does not run here, and where what it does is tested
    "make demo": "the demo sweep, 7 trials, ~7 min: its recipe's command passes the up-front checks; "
    + ELSEWHERE_SWEEP,
    "make test": "the suite itself; CI runs it",
    "make test-long": "the suite itself; CI runs it",
    "make test-all": "the suite itself",
    "make test-fast": "the suite itself",
    "make test-torch-floor": "a second environment with torch 2.11 (~4.5 GB, ~2.5 min to install); CI runs it",
    "make lint": "CI runs it",
    "make typecheck": "CI runs it",
    "make docs": "CI runs it (mkdocs build --strict)",
    "make format": "rewrites the working tree",
    "make lock": "resolves the newest releases in a scratch venv: the package index, minutes",
    "make bench": "bench's rounds from a pilot (up to ~10 min) and the data benchmark; test_bench.py runs smoke",
    "make gpu-bundle": "builds a wheel and a site (~10 s); test_gpu_check.py builds it (long)",
    "make gpu-check": GPU + "; test_gpu_check.py rehearses it on CPU (long)",
    "xsa-lm sweep experiment=demo sweep=demo": "7 trials, ~7 min; " + ELSEWHERE_SWEEP,
    "xsa-lm sweep ... sweep.eval_tasks=paper": "`...`: the overrides of a GPU recipe; the hub's task data",
    "xsa-lm sweep ... sweep.lr_range={min:1e-4,max:1e-2,num:5}": "`...`: the overrides of a GPU recipe",
    "xsa-lm sweep ... sweep.tune_xsa=true": "`...`: the overrides of a GPU recipe",
    "xsa-lm sweep ... sweep.baseline=xsa sweep.candidates=[sa]": "`...`: the overrides of a GPU recipe; arms by "
    "name, three of them from a --config-dir: test_arms.py (long)",
    "xsa-lm sweep ... sweep.search_seeds=[0,10,20] sweep.seeds=[1,2,3]": "`...`: the overrides of a GPU recipe",
    "xsa-lm sweep ... hydra.run.dir=sweeps/gpt2": "`...`: the overrides of a GPU recipe; resuming: test_sweep.py",
    "xsa-lm sweep experiment=stalls_toy": "50 runs, ~1 h; the stall table of a search-only sweep: test_sweep.py (long)",
    "xsa-lm sweep experiment=null_toy": "49 runs, ~45 min; both nulls end to end: test_sweep.py (long)",
    "xsa-lm sweep experiment=null_calibration": "97 runs, 97 min; both nulls end to end: test_sweep.py (long)",
    "xsa-lm sweep model=gpt2_124m trainer=gpu trainer.max_steps=5000 sweep.lrs=[1e-4,2e-4,4e-4,6e-4] "
    "sweep.seeds=[1,2,3] hydra.run.dir=sweeps/gpt2": GPU,
    "xsa-lm sweep experiment=paper_0.7b data=prepared data.dir=$DATA/fw100b": GPU + "s and FineWeb shards",
    "xsa-lm sweep model=paper_0.7b global_batch_tokens=524288 micro_batch_size=16 trainer=ddp trainer.devices=8 "
    "launcher=slurm launcher.gpus_per_node=8 launcher.cpus_per_task=8 launcher.partition=gpu "
    "hydra.run.dir=$SCRATCH/sweeps/paper_0.7b": "SLURM and GPUs; launcher=slurm end to end: test_slurm_sweep.py",
    "xsa-lm sweep experiment=paper_0.7b data=prepared data.dir=$DATA/fw100b trainer=ddp trainer.devices=8 "
    "launcher=slurm launcher.partition=gpu launcher.gpus_per_node=8 launcher.cpus_per_task=12 "
    "launcher.timeout_min=1440 hydra.run.dir=$SCRATCH/sweeps/paper_0.7b": "SLURM, GPUs and FineWeb shards; " + ON_SLURM,
    "xsa-lm sweep experiment=demo sweep=demo launcher=slurm launcher.partition=debug launcher.cpus_per_task=1": "7 "
    "trials, ~7 min, and root for make slurm-up; " + ON_SLURM,
    "xsa-lm train --multirun hydra/launcher=submitit_slurm hydra.launcher.partition=gpu hydra.launcher.gpus_per_node=1 "
    "hydra.launcher.timeout_min=240 +hydra.launcher.additional_parameters.requeue=true trainer=gpu resume=auto "
    "hydra.sweep.dir=$SCRATCH/multirun/sa_xsa attention=sa,xsa seed=0,1,2": "SLURM and GPUs; test_slurm.py runs a "
    "submitit_slurm multirun of 2, one run preempted and requeued (long)",
    "xsa-lm train --multirun hydra/launcher=submitit_local attention=sa,xsa seed=0,1": "4 runs of 1000 steps; "
    "test_slurm.py runs a submitit_local multirun of 2 (long)",
    "make slurm-up": "root; installs packages and starts daemons: the slurm tests' fixture runs it (CI: .ci/run)",
    "make slurm-down": "stops the SLURM every engineer's tests share; CI runs it when it ends (.ci/run)",
    "xsa-lm scale experiment=scale_toy hydra.run.dir=outputs/scale_toy": "36 runs; test_scale.py runs a study (long)",
    "xsa-lm scale experiment=tokens_toy hydra.run.dir=outputs/tokens_toy": "86 min; test_token_axis.py runs a "
    "token study (long)",
    "xsa-lm scale experiment=tokens_tuned hydra.run.dir=outputs/tokens_tuned": "130 runs, ~70 min; "
    "test_token_axis.py runs it at test size (long)",
    "xsa-lm scale scale.models=[paper_0.7b,paper_1.4b,paper_2.7b] trainer=fsdp global_batch_tokens=524288 "
    "micro_batch_size=8 data=prepared data.dir=$DATA/fw100b scale.seeds=[1,2,3] hydra.run.dir=$SCRATCH/scale": GPU
    + "s, FineWeb shards and days",
    "xsa-lm scale scale.axis=tokens scale.models=[gpt2_124m,paper_0.7b] trainer=ddp global_batch_tokens=524288 "
    "micro_batch_size=8 data=prepared data.dir=$DATA/fw100b sweep.search_seeds=[0,1] scale.seeds=[2,3,4,5,6] "
    "sweep.null_arm=true hydra.run.dir=$SCRATCH/tokens": GPU + "s, FineWeb shards and days",
    "xsa-lm plan experiment=gpu_pilot": "the up-front checks compute it; its GPU-hours: test_gpu_study.py",
    "xsa-lm plan experiment=gpu_decisive": "the up-front checks compute it; its GPU-hours: test_gpu_study.py",
    "xsa-lm sweep experiment=gpu_pilot sweep.dry_run=true": "test_gpu_study.py dry-runs it with the tiny model",
    "xsa-lm sweep experiment=gpu_decisive sweep.expected_sd=0.01 sweep.dry_run=true": "test_gpu_study.py dry-runs it "
    "with the tiny model",
    "xsa-lm sweep experiment=gpu_pilot data=prepared data.dir=shards/fw10b launcher.max_parallel=8": GPU
    + "s and FineWeb shards",
    "xsa-lm sweep experiment=gpu_decisive sweep.expected_sd=... data=prepared data.dir=$DATA/fw100b trainer=ddp "
    "trainer.devices=8": GPU + "s and FineWeb shards",
    "xsa-lm prepare data=fineweb_100bt tokenizer=gpt2 data.dir=$DATA/fw100b data.prepare_workers=32": "the hub "
    "(FineWeb); hub datasets offline: test_data.py",
    "xsa-lm prepare data=local data.files=corpus/*.jsonl data.text_field=text tokenizer=bpe tokenizer.vocab_size=4096 "
    "data.dir=shards/mine": "the README's prepare (run) with its defaults spelled out",
    "xsa-lm prepare data=fineweb data.subset=sample-10BT tokenizer=gpt2 data.dir=shards/fw10b "
    "data.prepare_workers=16": "the hub (FineWeb); hub datasets offline: test_data.py",
    "xsa-lm prepare data=fineweb data.subset=sample-100BT tokenizer=gpt2 data.dir=$DATA/fw100b": "the hub (FineWeb); "
    "hub datasets offline: test_data.py",
    "xsa-lm train data=local data.files=corpus/*.txt": "data.files=input.txt (run) with a glob: test_data.py",
    "xsa-lm train model=tiny attention=xsa optim.lr=3e-3 trainer.max_steps=200 seed=1 logger=wandb": "a plain train "
    "(run) with other values; W&B offline: test_wandb_offline.py",
    "xsa-lm train attention=xsa": "a plain train (run) with XSA; W&B offline: test_wandb_offline.py",
    "xsa-lm train +logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger +logger.tb.save_dir=tb_logs": "needs "
    "tensorboard, no dependency of xsa-lm; a lab's own logger trains in test_callbacks_config.py",
    "WANDB_API_KEY=... xsa-lm train attention=xsa logger.wandb.project=my-xsa logger.wandb.group=lr-3e-3": "a W&B "
    "key and the network",
    "xsa-lm train --multirun attention=sa,xsa seed=0,1,2": "6 runs; test_train_cli.py runs a multirun of 2",
    "xsa-lm train attention=xsa --cfg job": "test_train_cli.py runs --cfg job and --help (long)",
    "xsa-lm train --help": "test_train_cli.py runs it (long)",
    "python -m xsa_lm.train attention=xsa": "a plain train (run); test_train_cli.py compares the entry points (long)",
    "xsa-lm train experiment=demo attention=xsa diagnostics.every_n_steps=50": "diagnostics during training: "
    "test_analyze_cli.py",
    "xsa-lm analyze ckpts=[runs/sa/checkpoints/last.ckpt,runs/xsa/checkpoints/last.ckpt] sequences=64 "
    "hydra.run.dir=fig1": "the README's analyze (run) with sequences=64 and another folder",
    "xsa-lm eval ckpts=[runs/sa/checkpoints/last.ckpt,runs/xsa/checkpoints/last.ckpt] tasks=paper "
    "hydra.run.dir=runs/eval": "the hub's task data; test_eval.py runs eval on a local task",
    "xsa-lm eval ckpts=[...] tasks=[hellaswag,piqa] limit=200": "the hub's task data",
    "xsa-lm eval ckpts=[...] tasks=[tasks/shakespeare_cloze.yaml]": "`[...]`: checkpoints; test_eval.py runs a local "
    "task YAML",
    "xsa-lm consolidate ckpt=RUN/checkpoints/last.ckpt out=RUN/last-full.ckpt": "a sharded checkpoint of a 2-process "
    "trainer=fsdp run: test_sharded_checkpoints.py",
    "xsa-lm plan model=paper_0.7b trainer=ddp trainer.devices=8 micro_batch_size=16 data.block_size=2048 "
    "global_batch_tokens=524288 tokenizer=gpt2 device_memory_gb=80": "the README's plan (run) with other keys; the "
    "up-front checks compute it",
    "xsa-lm bench model=tiny out=bench.json": "rounds from a pilot, up to ~10 min; test_bench.py runs smoke=true",
    "xsa-lm bench smoke=true out=smoke.json": "~50 s of fresh processes; test_bench.py runs it",
    "xsa-lm bench model=gpt2_124m context=2048 micro_batch=8 compile=true out=bench_gpu.json": GPU,
    "xsa-lm train trainer=gpu model=gpt2_124m attention=xsa": GPU,
    "xsa-lm train trainer=ddp model=paper_0.7b global_batch_tokens=524288 micro_batch_size=8": GPU + "s",
    "xsa-lm train trainer=fsdp model=paper_2.7b global_batch_tokens=524288 micro_batch_size=8": GPU + "s",
    "srun xsa-lm train trainer=ddp trainer.num_nodes=4 model=paper_0.7b attention=xsa global_batch_tokens=524288 "
    "micro_batch_size=8 hydra.run.dir=runs/xsa resume=auto": "SLURM, 4 nodes of GPUs",
    "PYTHONPATH=docs/examples/gated_attention xsa-lm train --config-dir docs/examples/gated_attention/configs "
    "attention=gated": VARIANT,
    "PYTHONPATH=docs/examples/gated_attention xsa-lm train --config-dir docs/examples/gated_attention/configs "
    "attention=gated attention.granularity=headwise hydra.run.dir=runs/gated": VARIANT,
    "PYTHONPATH=docs/examples/gated_attention xsa-lm generate ckpt=runs/gated/checkpoints/last.ckpt prompt=ROMEO:": (
        "the checkpoint of the run above; test_variants.py generates from one (long)"
    ),
    "PYTHONPATH=docs/examples/gated_attention xsa-lm sweep --config-dir docs/examples/gated_attention/configs "
    "sweep.candidates=[xsa,gated]": "a three-arm sweep, ~10 min; test_arms.py runs this example's (long)",
    "docker run --gpus all --rm -v $PWD/runs:/work/runs -v $PWD/data:/work/data -e WANDB_API_KEY xsa-lm train "
    "trainer=gpu compile=true attention=xsa hydra.run.dir=runs/xsa": "Docker and a GPU",
}

# The up-front checks: the CLI's, then each job's own checks before it writes anything.


def task_overrides(overrides: list[str]) -> list[str]:
    """What Hydra passes a job as its task overrides: all but hydra.*."""
    return [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]


def check_train(cfg: DictConfig, overrides: list[str]) -> None:
    """What `xsa-lm train` checks before it reads data or writes (a GPU trainer's settings: on a GPU machine)."""
    import torch

    from xsa_lm.config.builders import check_trainer
    from xsa_lm.train.run import trainer_strategy

    spec = parse(TrainSpec, cfg)
    if spec.trainer.accelerator not in ("gpu", "cuda") or torch.cuda.is_available():
        check_trainer(spec.trainer, strategy=trainer_strategy(spec.trainer))
    spec.gpt_config(vocab_size=spec.model.vocab_size or spec.tokenizer.vocab_size or 50257)


def check_sweep(cfg: DictConfig, overrides: list[str]) -> None:
    from xsa_lm.sweep import run as sweep
    from xsa_lm.sweep.settings import SweepSpec

    sweep.train_overrides(task_overrides(overrides))
    sweep.check_sweep(parse(TrainSpec, cfg), parse(SweepSpec, cfg.sweep, at="sweep."), None)
    check_train(cfg, overrides)  # what every trial, an `xsa-lm train` process, checks


def check_scale(cfg: DictConfig, overrides: list[str]) -> None:
    from xsa_lm.scale.run import load_bench, sweep_overrides
    from xsa_lm.sweep.run import train_overrides
    from xsa_lm.sweep.settings import ScaleSpec

    kept = sweep_overrides(task_overrides(overrides))
    models = parse(ScaleSpec, cfg.scale, at="scale.").models  # the sizes, the budgets
    load_bench(cfg.scale.get("bench"))
    if cfg.scale.axis == "tokens":  # each size's runs are `xsa-lm train` processes
        for model in models:
            check_train(compose_train([*train_overrides(kept), f"model={model}"]), [])
        return
    assert cfg.scale.axis == "size", f"scale.axis={cfg.scale.axis}"
    seeds = [] if cfg.scale.seeds is None else [f"sweep.seeds=[{','.join(map(str, cfg.scale.seeds))}]"]
    for model in models:  # each size is an `xsa-lm sweep` process: what it checks before it starts
        size = [*kept, f"model={model}", *seeds]
        check_sweep(compose_train(size, config_name="sweep"), size)


def check_prepare(cfg: DictConfig, overrides: list[str]) -> None:
    assert parse(PrepareSpec, cfg).data.source is not None, "xsa-lm prepare needs a source"


CHECKS: dict[str, Callable[[DictConfig, list[str]], object]] = {  # command -> what it checks before it writes
    "train": check_train,
    "sweep": check_sweep,
    "scale": check_scale,
    "prepare": check_prepare,
    "analyze": lambda cfg, _: parse(AnalyzeOptions, cfg),
    "eval": lambda cfg, _: (require_harness(), parse(EvalOptions, cfg)),
    "generate": lambda cfg, _: parse(GenerateOptions, cfg),
    "export": lambda cfg, _: require_transformers(),
    "plan": lambda cfg, _: run_shape(parse(TrainSpec, cfg, VALUES_ONLY)).estimate(),
    "bench": lambda cfg, _: cfg.device == "cuda" or resolve_device(cfg.device),  # cuda is refused without a GPU
    "consolidate": lambda cfg, _: None,  # its checks are of the checkpoint files it reads
}


def overrides_of(argv: tuple[str, ...], tmp: Path) -> list[str]:
    """The Hydra overrides of a command line (flags left out), variables expanded, elisions as stand-ins."""
    words, overrides, flag = list(argv[1:]), [], None  # flag: the one whose value is the next word
    for word in words:
        if flag == "--config-dir":  # a folder of the repository (docs/examples), searched as the flag has Hydra do
            overrides.append(f"hydra.searchpath=[file://{REPO / word}]")
            flag = None
        elif flag:
            assert word in ("job", "hydra", "all"), f"--cfg {word}"
            flag = None
        elif word.startswith("-"):
            assert word in HYDRA_FLAGS, f"{word}: not a Hydra flag the docs may show"
            flag = word if word in ("--cfg", "-c", "--config-dir") else None
        elif word != "...":
            overrides.append(expand(word, tmp).replace("=[...]", f"=[{ELIDED}]").replace("=...", f"={ELIDED}"))
    return overrides


def combinations(overrides: list[str]) -> list[list[str]]:
    """A --multirun's runs, one list of overrides each (Hydra's own parser splits `attention=sa,xsa`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combination) for combination in itertools.product(*choices)]


def upfront_error(argv: tuple[str, ...], tmp: Path, elided: bool, capsys: pytest.CaptureFixture) -> str | None:
    """What the command refuses before it writes anything (None: nothing): the command line, Hydra's composition of
    each job, then every job's checks and the command's own (not for an elided command's stand-in values)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from xsa_lm.errors import UserError

    command, overrides = argv[0], overrides_of(argv, tmp)
    multirun = {"--multirun", "-m"} & set(argv)
    problem = check_command_line([*(["-m"] if multirun else []), *overrides])
    if problem:
        return f"xsa-lm: error: {problem}"
    for run in combinations(overrides) if multirun else [overrides]:
        try:
            with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
                cfg = compose(config_name=command, overrides=run, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as e:
            return f"xsa-lm: error: {hydra_problem(command, e, run)}"
        if elided:
            continue
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]  # ${now:...} and the like resolve only inside Hydra
        try:
            check_job(command, choices, OmegaConf.to_container(cfg, resolve=False), None)
            CHECKS[command](cfg, run)
        except (UserError, AssertionError) as e:
            return f"xsa-lm: error: {e}"
    return None


def test_the_extraction_finds_every_kind_of_command_and_each_is_run_or_listed():
    """The patterns above find what the pages show (a rewrite of the extraction that finds nothing fails here)."""
    shown = fenced()
    commands = {s.argv[0] for s in shown.values() if s.program == "xsa-lm"}
    assert commands >= {"train", "prepare", "sweep", "scale", "analyze", "eval", "generate", "export", "plan", "bench"}
    assert "xsa-lm train --multirun attention=sa,xsa seed=0,1,2" in shown  # continuation and comment dropped
    assert "python -m xsa_lm.train attention=xsa" in shown
    srun = next(s for s in shown.values() if s.text.startswith("srun xsa-lm train"))
    assert srun.argv[-1] == "resume=auto"  # its continuation line joined
    plan = next(s for s in shown.values() if s.page == "docs/gpus.md" and s.argv[0] == "plan")  # a ```console block
    assert plan.argv[-1] == "device_memory_gb=80"
    assert {"demo", "test", "docs"} <= {s.argv[0] for s in shown.values() if s.program == "make"}
    assert any(not s.fenced for s in all_shown())  # inline ones too
    # a command of a code block is run below (RUN) or listed with why not (NOT_RUN); no entry is stale
    texts, run = set(shown), [text for text, _, _ in RUN]
    assert len(run) == len(set(run)) and not set(run) & set(NOT_RUN), set(run) & set(NOT_RUN)
    assert sorted(texts - set(run) - set(NOT_RUN)) == [], "new in the docs: add each to RUN, or to NOT_RUN with why"
    assert sorted((set(run) | set(NOT_RUN)) - texts) == [], "no page shows these any more: remove them"


@pytest.mark.slow  # composes and checks every command of the README and docs, one by one
def test_every_documented_command_passes_its_up_front_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "bin").mkdir()
    for stub in (tmp_path / "bin" / program for program in STUBS):
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    for path in {path for s in all_shown() for path in re.findall(r"(?:^| )PYTHONPATH=(\S+) ", s.text)}:
        monkeypatch.syspath_prepend(str(REPO / path))  # a lab's package, put on the path as the command does
    commands = {s.text: s for s in all_shown() if s.program == "xsa-lm"}
    for target in sorted({s.argv[0] for s in all_shown() if s.program == "make"}):
        for argv in recipe_commands(target):
            text = f"make {target}: xsa-lm {' '.join(argv)}"
            commands[text] = Shown("Makefile", text, "xsa-lm", argv, fenced=False)
    start, refused = time.perf_counter(), []
    for text, shown in commands.items():
        if (error := upfront_error(shown.argv, tmp_path, shown.elided, capsys)) is not None:
            refused.append(f"{shown.page}: {text}\n    {error}")
    seconds = time.perf_counter() - start
    assert len(commands) >= 60  # the extraction found them
    assert not refused, "documented commands refused before they start:\n" + "\n".join(refused)
    print(f"{len(commands)} documented commands through their up-front checks in {seconds:.1f} s")


def test_a_stale_example_would_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """The check can fail: a removed option, a typo'd key, a value the job refuses, a size the scale refuses."""
    monkeypatch.chdir(tmp_path)
    for argv in (
        ("train", "experiment=no_such_recipe"),
        ("train", "optim.lrr=1e-3"),
        ("train", "model=tiny", "global_batch_tokens=1000"),
        ("generate", "ckpt=x.ckpt", "top_k=0"),
        ("scale", "scale.axis=tokens", "scale.models=[gpt2_124m,gpt2_124m]"),
        ("scale", "scale.models=[paper_0.7b,paper_1.4b]"),  # a size's sweep: the default batch does not divide
        ("sweep", "launcher=slurm", "launcher.setup=[A=1]"),  # Hydra's grammar: an element with `=` needs quotes
        ("train", "--multirun", "attention=sa,nope"),
    ):
        assert upfront_error(argv, tmp_path, False, capsys), argv


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The shown commands' folder: input.txt (a play), corpus/*.jsonl (three plays, a paragraph per line)."""
    from xsa_lm.data.sources import ShakespeareCorpus

    plays = dict(itertools.islice(ShakespeareCorpus(val_plays=[]).documents(), 4))
    texts = list(plays.values())
    (tmp_path / "input.txt").write_text(texts[0])
    (tmp_path / "corpus").mkdir()
    for i, text in enumerate(texts[1:]):
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        lines = "".join(json.dumps({"text": paragraph}) + "\n" for paragraph in paragraphs)
        (tmp_path / "corpus" / f"part-{i}.jsonl").write_text(lines)
    return tmp_path


def exported_model_stops_at_block_size(folder: Path, out: str) -> bool:
    """As docs/evaluation.md says: in transformers the exported model refuses a sequence past its block_size."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder / "hf" / "xsa", trust_remote_code=True)
    block_size = model.config.block_size
    prompt, new = torch.ones((1, 1), dtype=torch.long), block_size + 1  # the model reads all but the last new token
    try:  # min_new_tokens: greedy from a tiny model may say <|endoftext|> at once, which ends a generation
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    except ValueError as e:
        return f"sequence length {block_size + 1} exceeds block_size {block_size}" in str(e)
    return False


AFTERWARDS: dict[str, Callable[[Path, str], object]] = {  # what a command of RUN must have done, beyond exit code 0
    "xsa-lm train experiment=demo hydra.run.dir=runs/sa": lambda d, out: (d / "runs/sa/checkpoints/last.ckpt").exists(),
    "xsa-lm train": lambda d, out: re.search(r"run dir \S*outputs/train/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_tiny_sa\b", out),
    "xsa-lm analyze ckpts=[runs/sa/checkpoints/last.ckpt,runs/xsa/checkpoints/last.ckpt] hydra.run.dir=runs/fig1": (
        lambda d, out: (d / "runs/fig1/diagnostics.csv").exists()
    ),
    "xsa-lm generate ckpt=runs/xsa/checkpoints/last.ckpt prompt=ROMEO: max_new_tokens=200 temperature=0.8 top_k=50": (
        lambda d, out: "ROMEO:" in out
    ),
    "xsa-lm export ckpt=runs/xsa/checkpoints/last.ckpt out=hf/xsa": exported_model_stops_at_block_size,
    "xsa-lm train +callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor "
    "+callbacks.lr.logging_interval=step": lambda d, out: "lr-AdamW" in (d / "runs/lr/metrics.csv").read_text(),
}


@pytest.mark.slow
@pytest.mark.long
def test_documented_commands_run(workdir: Path, data_cache: Path):
    """RUN's commands through the CLI, one after another in one folder, each shrunk as RUN says."""
    commands, failed, times = fenced(), [], []
    for text, appended, _why in RUN:
        args = [expand(word, workdir) for word in commands[text].argv] + appended
        start = time.perf_counter()
        proc = run_cli(args, data_cache, workdir, timeout=300)
        times.append(f"{time.perf_counter() - start:5.1f} s  {text}")
        out = proc.stdout + proc.stderr
        check = AFTERWARDS.get(text, lambda d, out: True)
        if proc.returncode != 0 or "Traceback" in out or not check(workdir, out):
            failed.append(f"{text} + {appended}: exit {proc.returncode}\n{out[-1500:]}")
    print("\n".join(times))
    assert not failed, "\n\n".join(failed)
