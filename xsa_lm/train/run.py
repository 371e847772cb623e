"""One training run: config -> data, model, trainer -> fit -> summary.json, everything in `hydra.run.dir`."""

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import NamedTuple, cast

import hydra
import lightning as L
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from xsa_lm.checkpoints.atomic import AsyncSave, AtomicCheckpointIO, AtomicDDPStrategy, FolderCheckpoint
from xsa_lm.checkpoints.discovery import checkpoint_step, furthest_step, newest_valid_checkpoint
from xsa_lm.checkpoints.load import check_tokenizer, model_config_mismatch, settings_as_started
from xsa_lm.checkpoints.sharded import META, is_sharded
from xsa_lm.compat import quiet_third_party, skip_sigterm_broadcast
from xsa_lm.config.builders import build, check_trainer
from xsa_lm.config.command_line import full_command_line, override_key, pasteable
from xsa_lm.config.resume import Config, continuation_config, edited_since, with_hand_edits
from xsa_lm.config.spec import DataSpec, TokenizerSpec, TrainerSpec, TrainSpec, parse
from xsa_lm.data.datamodule import TokenDataModule
from xsa_lm.data.run import prepare_data
from xsa_lm.data.tokenizer import token_byte_lengths
from xsa_lm.errors import UserError, WriteError, one_line_errors
from xsa_lm.files import write_json, write_text
from xsa_lm.locking import hold_directory
from xsa_lm.model import GPTConfig
from xsa_lm.tracking import resolve_mode
from xsa_lm.train import memory
from xsa_lm.train.callbacks import (
    AttentionKernels,
    Diagnostics,
    Preemption,
    Profiler,
    ProgressBar,
    RunCallbacks,
    Samples,
    SavedConfig,
    Throughput,
    ValHistory,
)
from xsa_lm.train.cluster import ClusterChecks, check_slurm_tasks
from xsa_lm.train.devices import compile_enabled, loader_workers, set_device, uses_cuda
from xsa_lm.train.host_memory import reuse_freed_host_memory
from xsa_lm.train.module import LMModule
from xsa_lm.train.plan import run_shape
from xsa_lm.train.runinfo import SdpaKernels, attention_kernels, run_info
from xsa_lm.train.summary import RunStart, RunSummary, completed, print_summary

log = logging.getLogger("xsa_lm.train")  # the console and <run dir>/train.log (configs/train.yaml: hydra.job_logging)


def check_memory(spec: TrainSpec) -> None:
    """Refuse a run estimated not to fit its device's free memory (on CPU: the host's, for all its processes)."""
    if not spec.check_memory:
        return
    need = run_shape(spec).estimate()
    have, where = memory.available_bytes(spec.trainer.accelerator)
    processes = spec.trainer.world_size if where.endswith("host memory") else 1  # CPU ranks share the host
    if need.total * processes > have:
        per = f" per process x {processes}" if processes > 1 else ""
        raise UserError(
            f"this run needs about {memory.describe(need)}{per}, but {have / memory.GIB:.1f} GiB is {where}: lower "
            "micro_batch_size or the model size, or pass check_memory=false to try anyway"
        )


class ResumePoint(NamedTuple):
    """The checkpoint a run continues from, its step and the config it was trained with (None: from scratch)."""

    path: str | None
    step: int | None
    trained: dict[str, object] | None = None


FROM_SCRATCH = ResumePoint(path=None, step=None)


def find_resume_checkpoint(
    resume: str | None, run_dir: Path, mcfg: GPTConfig, *, config: Config | None = None
) -> ResumePoint:
    """The checkpoint to resume from and its step; one of another model, or trained with another config than
    `config` (config.yaml and the free changes), is refused naming each difference."""
    if resume is None:
        holds_a_run = (run_dir / "summary.json").exists() or (run_dir / "checkpoints").exists()
        # DDP ranks > 0 start after rank 0 has written. rank_zero_only.rank: a function attribute Lightning sets.
        if holds_a_run and rank_zero_only.rank == 0:  # type: ignore[attr-defined]
            raise UserError(
                f"hydra.run.dir={run_dir} already holds a run: pass resume=auto to continue it, "
                "or choose a new hydra.run.dir"
            )
        return FROM_SCRATCH
    if resume == "auto":
        newest, step, skipped = newest_valid_checkpoint(run_dir / "checkpoints")
        for path in skipped:
            rank_zero_only(log.warning)(f"resume=auto: WARNING: {path} is truncated or corrupt; skipped")
        summary = run_dir / "summary.json"
        if newest is None and summary.exists():  # a new run here would replace the results of one that did not fail
            try:
                ended = RunSummary.read(summary)
                what = f"a {ended.status} run of {ended.steps} steps" if ended.status != "failed" else None
            except (UserError, OSError):
                what = "a run"
            if what:
                files = ", ".join(
                    p.name for p in (summary, run_dir / "metrics.csv", run_dir / "config.yaml") if p.exists()
                )
                raise UserError(
                    f"resume=auto: hydra.run.dir={run_dir} holds the results of {what} ({files}) but no usable "
                    "checkpoint to continue from: a new run there would replace them; choose a new hydra.run.dir, "
                    "or move the old run aside"
                )
        if newest is None:
            held = "holds no run yet" if not (run_dir / "config.yaml").exists() else "has no usable checkpoint"
            rank_zero_only(log.info)(f"resume=auto: {run_dir} {held}: starting a new run from scratch")
            return FROM_SCRATCH
        path = newest
    else:
        path = Path(resume)
        if path.exists() and not path.is_file() and not path.is_dir():
            raise UserError(f"resume: {resume} is not a regular file (a device, pipe or socket), not a checkpoint")
        if (path / "checkpoints").is_dir():
            raise UserError(
                f"resume: {resume} is a run folder, not a checkpoint: continue it with "
                f"{pasteable('hydra.run.dir', resume)} resume=auto, or start a new run from one of its checkpoints "
                f"({pasteable('resume', path / 'checkpoints' / 'last.ckpt')})"
            )
        if not path.is_file() and not is_sharded(path):
            raise UserError(f"resume: checkpoint not found: {resume}")
        step = checkpoint_step(path)
        if step is None:
            raise UserError(f"resume: {resume} is truncated or not a checkpoint")
        in_place = (run_dir / "config.yaml").exists()  # into a run's own folder: read its checkpoints' steps
        if in_place and step < (furthest := furthest_step(run_dir / "checkpoints")):  # a rewind would mix histories
            raise UserError(
                f"resume: {resume} is at step {step}, but the run in {run_dir} has gone on to step {furthest}: "
                "continuing it from an earlier step would replace its later results and leave the discarded "
                f"steps' checkpoints beside the new ones; start a new run from it in another hydra.run.dir "
                f"({pasteable('resume', resume)}), or continue the run with resume=auto"
            )
    meta = path / META if path.is_dir() else path  # a sharded checkpoint keeps its model config in meta.pt
    saved = torch.load(meta, map_location="cpu", weights_only=True, mmap=True)
    differences = model_config_mismatch(saved["model_config"], asdict(mcfg)) if "model_config" in saved else []
    if differences:
        raise UserError(f"resume: {path} holds another model than this run's ({'; '.join(differences)})")
    trained = saved.get("run_config")
    edited = edited_since(trained, config) if trained is not None and config is not None else []
    if edited and (run_dir / "config.yaml").exists():  # a new run from a checkpoint may train it otherwise
        raise UserError(
            f"resume: {run_dir / 'config.yaml'} differs from the config {path} was trained with ({'; '.join(edited)}):"
            " a resume continues the run as it was trained: put back its values, or start a new run from the "
            "checkpoint in another hydra.run.dir (resume=<checkpoint>)"
        )
    optimizer = [change for change in edited if change.startswith("optim.")]
    if optimizer:  # the checkpoint's optimizer state (and the schedule's base LR) would set them back
        raise UserError(
            f"resume: a new run from {path} takes its optimizer state, which holds other settings than the given "
            f"({'; '.join(optimizer)}): the run would train with the checkpoint's; drop these overrides"
        )
    return ResumePoint(path=str(path), step=step, trained=trained)


def make_loggers(spec: TrainSpec, config: Config, run_dir: Path, resume_step: int | None) -> list:
    """metrics.csv, W&B, then a lab's own: a resume from step S keeps the rows before S and the W&B run."""
    loggers: list = []
    if spec.logger.csv:
        keep_before = resume_step if resume_step is not None else (0 if spec.resume is not None else None)
        loggers.append(build(spec.logger.csv, save_dir=str(run_dir), resume_step=keep_before))
    wandb = spec.logger.wandb
    # One W&B run, from global rank 0 (rank_zero_only.rank: a function attribute Lightning sets).
    if wandb and rank_zero_only.rank == 0:  # type: ignore[attr-defined]
        id_file = run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
        # The run's config holds _target_ keys of its own: pass it after instantiation, not through it.
        tags = [spec.attention.name, spec.model.name, *wandb.tags]
        wb = build(wandb.node, _partial_=True)(str(run_dir), spec.run_label, config, tags=tags, run_id=run_id)
        write_text(id_file, wb.experiment.id)
        loggers.append(wb)
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # like W&B's: a lab's logger sees rank 0 alone
        loggers += [build(lab.node) for lab in spec.logger.labs.values()]
    return loggers


def train(
    spec: TrainSpec,
    config: Config,
    run_dir: Path,
    resume_notes: list[str] | None = None,
    explicit_tokenizer: bool = False,
) -> RunSummary | None:
    """Check what this machine decides, then train holding the run directory; the summary on rank 0, else None.
    `config`: what config.yaml, the checkpoints and W&B keep; `explicit_tokenizer`: chosen on the command line."""
    trainer = spec.trainer
    set_device(accelerator=trainer.accelerator, devices=trainer.devices)  # before any CUDA call
    sys.argv = full_command_line()  # the DDP ranks Lightning starts re-run sys.argv; run_info.json records it
    check_slurm_tasks(devices=trainer.world_size // trainer.num_nodes, num_nodes=trainer.num_nodes)
    check_trainer(trainer, strategy=trainer_strategy(trainer))  # as Lightning will take it
    if spec.logger.wandb:
        resolve_mode(spec.logger.wandb.mode)  # WANDB_MODE fails now, before the run directory is written
    # config.yaml keeps the settled LR schedule: a resume that extends trainer.max_steps keeps it (TrainSpec.schedule)
    settled = {k: spec.scheduler_node[k] for k in ("total_steps", "warmup_steps")}
    config = {**config, "scheduler": {**config["scheduler"], **settled}}
    check_memory(spec)
    data_spec, tokenizer_spec = spec.data, spec.tokenizer
    if spec.resume is not None and (run_dir / "config.yaml").exists():  # its saved config, paths and all
        data_cfg, tokenizer_cfg = settings_as_started(config["data"], config["tokenizer"], run_dir)
        data_spec, tokenizer_spec = parse(DataSpec, data_cfg, at="data."), parse(TokenizerSpec, tokenizer_cfg)
    data = prepare_data(data_spec, tokenizer_spec, explicit_tokenizer=explicit_tokenizer)
    mcfg = spec.gpt_config(data.meta["vocab_size"])
    kernels = attention_kernels(
        spec.sdpa_backends,
        model=mcfg,
        context=spec.block_size,
        precision=trainer.resolved_precision,
        accelerator=trainer.accelerator,
    )
    datamodule = TokenDataModule(
        data=data,
        block_size=spec.block_size,
        micro_batch_size=spec.micro_batch_size,
        seed=spec.seed,
        val_windows=spec.data.val_windows,
        num_workers=loader_workers(
            spec.data.num_workers,
            accelerator=trainer.accelerator,
            ranks_per_node=trainer.world_size // trainer.num_nodes,
        ),
    )
    if rank_zero_only.rank != 0:  # type: ignore[attr-defined]  # a function attribute Lightning sets
        # Rank 0 alone picks the checkpoint; its choice reaches this rank once the process group exists (ClusterChecks).
        return fit(spec, config, run_dir, datamodule=datamodule, mcfg=mcfg, resume=FROM_SCRATCH, kernels=kernels)
    with hold_directory(run_dir, ".xsa-lm.lock", "xsa-lm train run"):
        resume = find_resume_checkpoint(spec.resume, run_dir, mcfg, config=config)
        if resume.path is not None:  # before the run's files change: the data must be what the checkpoint saw
            where = data.dir / "tokenizer.json"
            check_tokenizer(Path(resume.path), data.tokenizer, data.tokenizer_sha256, where, "resume")
        continuing, max_steps = (run_dir / "config.yaml").exists(), spec.trainer.max_steps
        if resume.step is not None and resume.step >= max_steps:
            if not continuing:  # it would record the checkpoint's result as a run of trainer.max_steps
                raise UserError(
                    f"resume: {resume.path} is at step {resume.step}, at or past trainer.max_steps={max_steps}: "
                    "a new run from it would train nothing; raise trainer.max_steps"
                )
            if completed(run_dir):
                print(
                    f"resume: the run in {run_dir} completed step {resume.step} of trainer.max_steps={max_steps}: "
                    "nothing to train (raise trainer.max_steps to continue it); its files are left as they are"
                )
                return None
            if resume.step > max_steps:  # it would record more steps than its config.yaml and summary.json say
                raise UserError(
                    f"resume: the run in {run_dir} has reached step {resume.step}, past trainer.max_steps="
                    f"{max_steps}: raise trainer.max_steps to {resume.step} or more, or leave it out"
                )
        notes = resume_notes or []
        if resume.trained is not None and continuing:
            notes = with_hand_edits(notes, trained=resume.trained, config=config)
        for warning in [spec.schedule.warning, *fewer_windows(spec, datamodule)]:
            if warning:
                log.warning(warning)
        # config.yaml (what the next resume continues), run_info.json (the first start), resumes.jsonl (each resume)
        write_text(run_dir / "config.yaml", OmegaConf.to_yaml(config))
        info = {**run_info(attention=kernels), "data_dir": str(data.dir)}
        if not (run_dir / "run_info.json").exists():
            write_json(run_dir / "run_info.json", info)
        if resume.path is not None:
            record = dict(time=time.time(), from_step=resume.step, checkpoint=resume.path, changes=notes, run_info=info)
            with open(run_dir / "resumes.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            what = f"{spec.attention.name}, {spec.model.name}, lr {spec.optim.lr:g}, seed {spec.seed}"
            log.info(
                f"resume: continuing the run in {run_dir} ({what}) from step {resume.step} ({resume.path}) with its "
                "saved config.yaml" + "".join(f"; {note}" for note in notes)
                if continuing
                else f"resume: a new run in {run_dir} ({what}) starts from {resume.path} (step {resume.step}): its "
                "weights, optimizer state, LR schedule position and data position"
            )
        return fit(spec, config, run_dir, datamodule=datamodule, mcfg=mcfg, resume=resume, kernels=kernels)


def fewer_windows(spec: TrainSpec, datamodule: TokenDataModule) -> list[str]:
    """Settings asking for more validation windows than there are: the run takes what there is, and says so."""
    window, notes, asked = spec.block_size + 1, [], spec.data.val_windows
    if asked is not None and asked > datamodule.val_available:
        notes.append(
            f"WARNING: data.val_windows={asked} but the validation split holds "
            f"{datamodule.val_available} windows of {window} tokens: validating on all of them"
        )
    used, diagnostics = datamodule.val_set.n, spec.diagnostics
    if diagnostics.every_n_steps and diagnostics.sequences > used:
        notes.append(
            f"WARNING: diagnostics.sequences={diagnostics.sequences} but validation uses {used} windows: "
            f"the diagnostics measure {used}"
        )
    return notes


def fit(
    spec: TrainSpec,
    config: Config,
    run_dir: Path,
    *,
    datamodule: TokenDataModule,
    mcfg: GPTConfig,
    resume: ResumePoint,
    kernels: SdpaKernels,
) -> RunSummary | None:
    """Build the module and trainer, train, write summary.json (a failed run's too, then re-raised)."""
    summary = RunStart(spec, run_dir=run_dir, model_config=mcfg)
    set_up_process(spec)
    module = make_module(spec, mcfg, token_bytes=token_byte_lengths(datamodule.data.tokenizer, mcfg.vocab_size))
    summary.non_embedding_params = module.model.num_params()
    summary.train_tokens = int(datamodule.data.meta["train_tokens"])
    rank_zero_only(log.info)(header(spec, run_dir=run_dir, data=datamodule, module=module, kernels=kernels))
    val_set = dict(data=datamodule.data.meta.get("identity"), windows=datamodule.val_set.n, block_size=spec.block_size)
    callbacks = make_callbacks(spec, config, run_dir, val_set=val_set)

    loggers = make_loggers(spec, config, run_dir=run_dir, resume_step=resume.step)
    trainer = make_trainer(spec, run_dir, callbacks=callbacks.all, loggers=loggers)
    is_rank_zero = rank_zero_only.rank == 0  # type: ignore[attr-defined]  # a function attribute Lightning sets
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume.path, weights_only=False)  # our own files
        status = "completed" if module.diverged_at is None else "diverged"
        if status == "completed" and callbacks.preemption.preempted_at is not None:
            status = "interrupted" if callbacks.preemption.received == "SIGINT" else "preempted"
    except Exception as e:
        if is_rank_zero:
            with contextlib.suppress(WriteError):  # a full disk: the error that stopped the run says what to do
                summary.write("failed", trainer=trainer, module=module, callbacks=callbacks, error=e)
        raise
    if not is_rank_zero:
        return None
    return summary.write(status, trainer=trainer, module=module, callbacks=callbacks)


def set_up_process(spec: TrainSpec) -> None:
    """Seeds, malloc's reuse of freed memory (CPU runs: tensors live on the host) and TF32, before anything is built."""
    L.seed_everything(spec.seed, workers=True, verbose=False)
    if spec.reuse_host_memory and not uses_cuda(spec.trainer.accelerator):
        reuse_freed_host_memory()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def make_module(spec: TrainSpec, mcfg: GPTConfig, token_bytes: list[int] | None = None) -> LMModule:
    """The module, its weights drawn from `init_seed` when set and perturbed by `init_perturbation`: the data order
    stays the one `seed` gives."""
    init_seed, faults = spec.init_seed, spec.faults
    with torch.random.fork_rng(devices=[], enabled=init_seed is not None):
        if init_seed is not None:
            torch.manual_seed(init_seed)
        module = LMModule(
            model_config=mcfg,
            optimizer=build(spec.optim.node),
            scheduler=build(spec.scheduler_node),
            total_steps=spec.schedule.total_steps,
            compile=compile_enabled(spec.compile, accelerator=spec.trainer.accelerator),
            skip_nonfinite_batches=faults.skip_nonfinite_batches,
            spike_factor=faults.spike_factor,
            nan_at_step=faults.inject_nan_at_step,
            nan_on_rank=faults.inject_nan_on_rank,
            activation_checkpointing=spec.trainer.activation_checkpointing,
            position_buckets=spec.val_position_buckets,
            token_bytes=token_bytes,
        )
    if spec.init_perturbation:
        perturb(module.model, spec.init_perturbation, spec.seed)
    return module


def perturb(model: torch.nn.Module, scale: float, seed: int) -> None:
    """w += scale * rms(w) * N(0, 1) for every weight tensor (a zero one stays zero), drawn from a generator of its
    own: the global stream, hence the data order and dropout, is untouched. Offset from `seed` so that the noise is
    not the weights' own draws (which would only rescale them)."""
    generator = torch.Generator().manual_seed(seed + 2**32)
    with torch.no_grad():
        for weight in model.parameters():
            noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype)
            weight.add_(noise.to(weight.device) * scale * weight.pow(2).mean().sqrt())


def header(spec: TrainSpec, run_dir: Path, data: TokenDataModule, module: LMModule, kernels: SdpaKernels) -> str:
    """The run's first line: model, data, a step's tokens, the attention kernel, the run folder."""
    non_embedding, total, meta = module.model.num_params(), module.model.num_params(False), data.data.meta
    device = torch.cuda.get_device_name() if uses_cuda(spec.trainer.accelerator) else "cpu"  # set_device's
    epochs = (
        spec.trainer.max_steps * spec.global_batch_tokens / meta["train_tokens"] if meta["train_tokens"] else math.nan
    )
    return (
        f"xsa-lm train | {spec.run_label} | model {spec.model.name}, attention={spec.attention.name}: "
        f"{non_embedding / 1e6:.2f}M non-embedding parameters ({total / 1e6:.2f}M total) | "
        f"data {data.data.dir.name}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, "
        f"vocab {meta['vocab_size']} (model {module.model_config.vocab_size}) | "
        f"{spec.global_batch_tokens:,} tokens/step = {spec.micro_batch_size} x {spec.block_size} x "
        f"{spec.accumulate} accumulation x {spec.trainer.world_size} device(s) "
        f"({device}), {spec.trainer.max_steps} steps ({epochs:.2f} epochs) | "
        f"attention kernel {kernels['used']} (sdpa_backends: "
        f"{', '.join(kernels['order'])}) | run dir {run_dir}"
    )


def make_callbacks(spec: TrainSpec, config: Config, run_dir: Path, *, val_set: dict[str, object]) -> RunCallbacks:
    """Checkpoints, what summary.json reports, the clean stop on a signal, and the optional ones."""
    ckpt_dir = run_dir / "checkpoints"
    # The last K step checkpoints (resume=auto's fallback), by default after each validation: the step's metrics.csv
    # row is then on disk, so a kill right after the checkpoint cannot lose a row the resumed run will not log again.
    checkpoint = partial(FolderCheckpoint, dirpath=ckpt_dir, save_last=True)
    periodic = checkpoint(
        filename="step-{step:06d}",
        monitor="step",
        mode="max",
        save_top_k=spec.checkpoint.keep_last,
        every_n_train_steps=spec.checkpoint.every_n_steps,
        auto_insert_metric_name=False,
    )
    # At each validation, saved before the step checkpoint, which links to it when it improved.
    best = checkpoint(filename="best", monitor="val/loss", mode="min", save_top_k=1, every_n_epochs=1)
    throughput = Throughput(spec.global_batch_tokens)
    history = ValHistory(throughput.tokens_seen, val_set=val_set)
    preemption = Preemption(ckpt_dir / "last.ckpt", val_every_steps=spec.val_every_steps)
    cluster = ClusterChecks(planned_world_size=spec.trainer.world_size, checkpoint_dir=ckpt_dir)
    kernels = AttentionKernels(spec.sdpa_backends)
    callbacks = [cluster, kernels, best, periodic, history, throughput, preemption, SavedConfig(config)]
    if spec.checkpoint.async_save:
        callbacks.append(AsyncSave())
    if spec.diagnostics.every_n_steps:
        callbacks.append(Diagnostics(**spec.diagnostics.model_dump()))
    if spec.samples.every_n_steps:
        callbacks.append(Samples(run_dir=str(run_dir), **spec.samples.model_dump()))
    if spec.profile.start_step is not None:
        callbacks.append(Profiler(run_dir=str(run_dir), **spec.profile.model_dump()))
    if spec.progress_bar:
        callbacks.append(ProgressBar())
    callbacks += [build(c.node) for c in spec.callbacks.values()]  # a lab's own, after ours
    return RunCallbacks(history=history, throughput=throughput, best=best, preemption=preemption, all=callbacks)


def make_trainer(spec: TrainSpec, run_dir: Path, *, callbacks: list[L.Callback], loggers: list) -> L.Trainer:
    trainer = build(
        spec.trainer.model_dump(by_alias=True, exclude={"activation_checkpointing"}),  # that one is the module's
        strategy=trainer_strategy(spec.trainer),
        precision=spec.trainer.resolved_precision,
        default_root_dir=str(run_dir),
        logger=loggers or False,
        callbacks=callbacks,
        accumulate_grad_batches=spec.accumulate,
        val_check_interval=spec.val_every_steps * spec.accumulate,
        check_val_every_n_epoch=None,
        enable_progress_bar=spec.progress_bar,  # ours (ProgressBar), which counts optimizer steps
        plugins=[AtomicCheckpointIO()],
    )
    skip_sigterm_broadcast(trainer)  # Preemption handles signals, without a sync per micro-batch
    return trainer


def trainer_strategy(trainer: TrainerSpec) -> object:
    """trainer.strategy as the Trainer gets it: `auto` or `ddp` over several devices is Lightning's DDP failing
    checkpoints together, an FSDP `data_parallel_size: auto` is every device (Lightning's auto means one per node)."""
    strategy = trainer.strategy
    if strategy in ("auto", "ddp") and trainer.world_size > 1:
        return AtomicDDPStrategy()
    if isinstance(strategy, dict) and strategy.get("data_parallel_size") == "auto":
        return {**strategy, "data_parallel_size": trainer.world_size}
    return strategy


def refuse_a_folder_new_each_time(run_dir: Path) -> None:
    """resume=auto continues the run in hydra.run.dir: the default folder, named by the time, never holds one."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    pattern = cast(dict, OmegaConf.to_container(hydra_cfg.sweep if multirun else hydra_cfg.run))["dir"]  # unresolved
    if "${now:" not in str(pattern):
        return
    runs = [p for p in run_dir.parent.glob("*/config.yaml") if p.parent != run_dir]
    newest = max(runs, key=lambda p: p.stat().st_mtime, default=None)
    hint = f", e.g. the newest here: {pasteable(key, newest.parent)}" if newest and key == "hydra.run.dir" else ""
    raise UserError(
        f"resume=auto continues the run in {key}, which was not given: its default ({pattern}) is a new folder each "
        f"time; pass {key}=<the run's folder>{hint}"
    )


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="train")
@one_line_errors
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    quiet_third_party()
    try:  # a UserError ends in one line (one_line_errors)
        notes: list[str] = []
        spec = parse(TrainSpec, cfg)  # every value checked, before anything is read or written
        config = cast(Config, OmegaConf.to_container(cfg, resolve=True))
        if cfg.resume == "auto":
            refuse_a_folder_new_each_time(run_dir)
        if cfg.resume is not None:
            defaults = cast(Config, OmegaConf.to_container(compose(config_name="train"), resolve=True))
            overrides = list(HydraConfig.get().overrides.task)
            config, notes = continuation_config(config, defaults, overrides, run_dir)
            spec = parse(TrainSpec, config)
        spec.refuse_idle_options(list(HydraConfig.get().overrides.task))
        # A tokenizer chosen on the command line: prepared shards must have been made with it.
        explicit = any(override_key(o).split(".")[0] == "tokenizer" for o in HydraConfig.get().overrides.task)
        summary = train(spec, config, run_dir, resume_notes=notes, explicit_tokenizer=explicit)
    except KeyboardInterrupt:  # before training started (the first Ctrl-C during training stops it cleanly)
        print("xsa-lm: interrupted before training started; nothing to resume from this attempt", file=sys.stderr)
        sys.exit(130)
    if summary is not None:
        print_summary(summary)
        if summary.status == "interrupted":
            sys.exit(130)
