"""One training run: config -> data, model, trainer -> fit -> summary.json.

Everything of a run lands in its directory (`hydra.run.dir`): config.yaml, run_info.json, metrics.csv,
checkpoints/, wandb/ and summary.json.
"""

import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from xsa_lm.checkpoints import model_config_mismatch
from xsa_lm.data.datamodule import TokenDataModule
from xsa_lm.data.run import prepare_data
from xsa_lm.errors import UserError, build, exit_on_user_error
from xsa_lm.locking import exclusive
from xsa_lm.model import GPTConfig
from xsa_lm.sharded import META, is_sharded
from xsa_lm.train import memory
from xsa_lm.train.callbacks import Diagnostics, ProgressBar, Samples, Throughput, ValHistory
from xsa_lm.train.checkpointing import AtomicCheckpointIO, Preemption, checkpoint_step, newest_valid_checkpoint
from xsa_lm.train.checks import check_values
from xsa_lm.train.host_memory import reuse_freed_host_memory
from xsa_lm.train.module import LMModule
from xsa_lm.train.resume import continuation_config
from xsa_lm.train.runinfo import run_info
from xsa_lm.train.tracking import resolve_mode

relaunch_argv: list[str] | None = None  # set by `xsa-lm train`: the command line that DDP ranks re-run
VOCAB_MULTIPLE = 64  # pad the embedding table: matmuls are faster on multiples of 64 (50257 -> 50304)
OUR_TRAINER_KEYS = ("activation_checkpointing",)  # in configs/trainer/, read by the run, not by lightning.Trainer
log = logging.getLogger("xsa_lm.train")  # the console and <run dir>/train.log (configs/train.yaml: hydra.job_logging)


def world_size(trainer_cfg: DictConfig) -> int:
    devices = trainer_cfg.get("devices", 1)
    if devices in ("auto", -1, "-1"):
        devices = torch.cuda.device_count() or 1
    elif isinstance(devices, str):  # "0,1" or "2"
        devices = len(devices.split(",")) if "," in devices else int(devices)
    elif not isinstance(devices, int):
        devices = len(devices)
    return devices * int(trainer_cfg.get("num_nodes", 1))


def check_config(cfg: DictConfig) -> dict:
    """Validate what the user can get wrong; returns derived batch quantities."""
    check_values(cfg)
    if cfg.data.block_size > cfg.model.block_size:
        raise UserError(
            f"data.block_size={cfg.data.block_size} is above model.block_size={cfg.model.block_size}: "
            "lower data.block_size or raise model.block_size"
        )
    devices = world_size(cfg.trainer)
    tokens_per_micro_step = cfg.micro_batch_size * devices * cfg.data.block_size
    if cfg.global_batch_tokens % tokens_per_micro_step:
        raise UserError(
            f"global_batch_tokens={cfg.global_batch_tokens} is not divisible by micro_batch_size x devices x "
            f"data.block_size = {cfg.micro_batch_size} x {devices} x {cfg.data.block_size} = {tokens_per_micro_step}: "
            "choose a multiple"
        )
    sharded = memory.strategy_kind(cfg.trainer.strategy) == "fsdp"
    for group in ("diagnostics", "samples"):  # they run a forward on rank 0 alone: under sharding it would hang
        if sharded and cfg.get(group) and cfg[group].every_n_steps:
            raise UserError(f"{group}.every_n_steps: not available under trainer=fsdp; run `xsa-lm analyze` or "
                            "`xsa-lm generate` on its checkpoints instead")  # fmt: skip
    if cfg.logger and cfg.logger.get("wandb"):
        resolve_mode(cfg.logger.wandb.mode)  # a bad mode fails now, before the run directory is written
    return {"devices": devices, "accumulate": cfg.global_batch_tokens // tokens_per_micro_step}


def check_memory(cfg: DictConfig, devices: int) -> None:
    """Refuse a run whose estimated memory exceeds what its device (or, on CPU, the host for all its processes)
    has free, before the model is built; check_memory=false lets it try anyway."""
    if not cfg.get("check_memory", True):
        return
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    vocab = fields.get("vocab_size") or cfg.tokenizer.get("vocab_size") or 50257  # before the tokenizer exists
    need = memory.estimate(fields, math.ceil(vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE, cfg.micro_batch_size,
                           cfg.data.block_size, resolve_precision(cfg.trainer.precision),
                           strategy=memory.strategy_kind(cfg.trainer.strategy), world_size=devices,
                           activation_checkpointing=cfg.trainer.get("activation_checkpointing", False))  # fmt: skip
    have, where = memory.available_bytes(cfg.trainer.accelerator)
    processes = devices if where.endswith("host memory") else 1  # CPU ranks share the host
    if need.total * processes > have:
        per = f" per process x {processes}" if processes > 1 else ""
        raise UserError(
            f"this run needs about {memory.describe(need)}{per}, but {have / memory.GIB:.1f} GiB is {where}: lower "
            "micro_batch_size or the model size, or pass check_memory=false to try anyway"
        )


def tokenizer_on_command_line() -> bool:
    """Whether the user chose the tokenizer explicitly (then prepared shards must have been made with it)."""
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    return any(o.split("=", 1)[0].lstrip("+~").split(".")[0] == "tokenizer" for o in overrides)


def model_config(cfg: DictConfig, vocab_size: int) -> GPTConfig:
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    fields.pop("name", None)
    padded = math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if fields.get("vocab_size") is None:
        fields["vocab_size"] = padded
    elif fields["vocab_size"] < vocab_size:
        raise UserError(f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    try:
        return GPTConfig(**fields, attention=cfg.attention.name, xsa_eps=cfg.attention.eps,
                         xsa_layers=xsa_layers(cfg.attention.get("layers", "all"), fields["n_layer"]),
                         xsa_gate=gate_enabled(cfg.attention.get("gate", "none")))  # fmt: skip
    except ValueError as e:  # GPTConfig's own checks (n_kv_head, n_sinks, ...) are the user's to fix
        raise UserError(f"model: {e}") from None


def xsa_layers(layers, n_layer: int) -> tuple[int, ...] | None:
    """attention.layers: `all` (None: every layer), N (the last N layers) or a list of 0-based layer indices."""
    if layers in ("all", None):
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        if not 0 <= layers <= n_layer:
            raise UserError(f"attention.layers={layers}: the last N layers needs 0 <= N <= n_layer={n_layer}")
        return tuple(range(n_layer - layers, n_layer))
    if OmegaConf.is_list(layers) or isinstance(layers, list | tuple):
        return tuple(int(i) for i in layers)
    raise UserError(f"attention.layers must be all, a number of last layers, or a list of layers; got {layers!r}")


def gate_enabled(gate: str) -> bool:
    if gate not in ("none", "tanh"):
        raise UserError(f"attention.gate must be none or tanh, got {gate!r}")
    return gate == "tanh"


def device_name(accelerator: str) -> str:
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def resolve_precision(precision: str) -> str:
    if precision != "auto":
        return precision
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def find_resume_checkpoint(resume: str | None, run_dir: Path, mcfg: GPTConfig) -> tuple[str | None, int | None]:
    """The checkpoint to resume from and its step (validating a file reads it whole: done once here). A checkpoint
    of another model is refused, naming each differing field."""
    if resume is None:
        holds_a_run = (run_dir / "summary.json").exists() or (run_dir / "checkpoints").exists()
        if holds_a_run and rank_zero_only.rank == 0:  # DDP ranks > 0 start after rank 0 has written
            raise UserError(
                f"hydra.run.dir={run_dir} already holds a run: pass resume=auto to continue it, "
                "or choose a new hydra.run.dir"
            )
        return None, None
    if resume == "auto":
        newest, step, skipped = newest_valid_checkpoint(run_dir / "checkpoints")
        for path in skipped:
            rank_zero_only(log.warning)(f"resume=auto: WARNING: {path} is truncated or corrupt; skipped")
        if newest is None:
            held = "holds no run yet" if not (run_dir / "config.yaml").exists() else "has no usable checkpoint"
            rank_zero_only(log.info)(f"resume=auto: {run_dir} {held}: starting a new run from scratch")
            return None, None
        path = newest
    else:
        path = Path(resume)
        if not path.is_file() and not is_sharded(path):
            raise UserError(f"resume: checkpoint not found: {resume}")
        step = checkpoint_step(path)
        if step is None:
            raise UserError(f"resume: {resume} is truncated or not a checkpoint")
    meta = path / META if path.is_dir() else path  # a sharded checkpoint keeps its model config in meta.pt
    saved = torch.load(meta, map_location="cpu", weights_only=True, mmap=True).get("model_config")
    differences = model_config_mismatch(saved, asdict(mcfg)) if saved is not None else []
    if differences:
        raise UserError(f"resume: {path} holds another model than this run's ({'; '.join(differences)})")
    return str(path), step


def make_loggers(cfg: DictConfig, run_dir: Path, run_name: str, resume_step: int | None) -> list:
    """metrics.csv and W&B. A resume from the checkpoint of step S keeps metrics.csv's rows before S and continues
    the run's W&B run; a resume=auto that found no checkpoint starts over: no old row is kept, a new W&B run."""
    loggers = []
    if not cfg.logger:
        return loggers
    if cfg.logger.get("csv"):
        keep_before = resume_step if resume_step is not None else (0 if cfg.resume is not None else None)
        loggers.append(build(cfg.logger.csv, save_dir=str(run_dir), resume_step=keep_before))
    if cfg.logger.get("wandb") and rank_zero_only.rank == 0:  # one W&B run, from global rank 0
        id_file = run_dir / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
        # The run's config holds _target_ keys of its own: pass it after instantiation, not through it.
        make_wandb = build(cfg.logger.wandb, _partial_=True)
        wb = make_wandb(
            save_dir=str(run_dir),
            name=run_name,
            run_config=OmegaConf.to_container(cfg, resolve=True),
            tags=[cfg.attention.name, cfg.model.name, *(cfg.logger.wandb.tags or [])],
            run_id=run_id,
        )
        id_file.write_text(wb.experiment.id)
        loggers.append(wb)
    return loggers


def train(cfg: DictConfig, run_dir: Path, resume_notes: list[str] | None = None) -> dict:
    """Check everything, then train while holding the run directory (rank 0; DDP ranks > 0 write nothing)."""
    if relaunch_argv:  # the whole command line (`xsa-lm train ...`): recorded in run_info.json, re-run by DDP ranks
        sys.argv = relaunch_argv
    plan = check_config(cfg)
    if cfg.scheduler.get("total_steps") is None:  # saved resolved: a resume that extends max_steps keeps the schedule
        cfg.scheduler.total_steps = cfg.trainer.max_steps
    check_memory(cfg, plan["devices"])
    data = prepare_data(cfg.data, cfg.tokenizer, explicit_tokenizer=tokenizer_on_command_line())
    mcfg = model_config(cfg, data.meta["vocab_size"])
    datamodule = TokenDataModule(data, cfg.data.block_size, cfg.micro_batch_size, cfg.seed,
                                 cfg.data.val_windows, cfg.data.num_workers)  # fmt: skip
    if rank_zero_only.rank != 0:
        return fit(cfg, run_dir, plan, datamodule, mcfg, *find_resume_checkpoint(cfg.resume, run_dir, mcfg))
    with exclusive(run_dir, ".xsa-lm.lock", "xsa-lm train run"):
        ckpt_path, resume_step = find_resume_checkpoint(cfg.resume, run_dir, mcfg)
        if resume_step is not None and resume_step >= cfg.trainer.max_steps and completed(run_dir):
            print(f"resume: the run in {run_dir} completed step {resume_step} of trainer.max_steps="
                  f"{cfg.trainer.max_steps}: nothing to train (raise trainer.max_steps to continue it); its files "
                  "are left as they are")  # fmt: skip
            return {}
        write_run_files(cfg, run_dir, data.dir, ckpt_path, resume_step, resume_notes or [])
        return fit(cfg, run_dir, plan, datamodule, mcfg, ckpt_path, resume_step)


def completed(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("status") == "completed"


def write_run_files(cfg: DictConfig, run_dir: Path, data_dir: Path, ckpt_path: str | None, resume_step: int | None,
                    resume_notes: list[str]) -> None:  # fmt: skip
    """config.yaml is the run's effective config (what the next resume continues); run_info.json describes the
    first start, resumes.jsonl each resume."""
    continuing = (run_dir / "config.yaml").exists()
    tmp = run_dir / "config.yaml.tmp"
    OmegaConf.save(cfg, tmp, resolve=True)
    os.replace(tmp, run_dir / "config.yaml")
    info = {**run_info(), "data_dir": str(data_dir)}
    if not (run_dir / "run_info.json").exists():
        (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    if ckpt_path is not None:
        record = {"time": time.time(), "from_step": resume_step, "checkpoint": ckpt_path, "changes": resume_notes,
                  "run_info": info}  # fmt: skip
        with open(run_dir / "resumes.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        what = f"{cfg.attention.name}, {cfg.model.name}, lr {cfg.optim.lr:g}, seed {cfg.seed}"
        if continuing:
            log.info(f"resume: continuing the run in {run_dir} ({what}) from step {resume_step} ({ckpt_path}) with "
                     f"its saved config.yaml" + "".join(f"; {note}" for note in resume_notes))  # fmt: skip
        else:
            log.info(f"resume: a new run in {run_dir} ({what}) starts from {ckpt_path} (step {resume_step}): its "
                     "weights, optimizer state, LR schedule position and data position")  # fmt: skip


def fit(cfg: DictConfig, run_dir: Path, plan: dict, datamodule: TokenDataModule, mcfg: GPTConfig,
        ckpt_path: str | None, resume_step: int | None) -> dict:  # fmt: skip
    t_start = time.time()
    is_rank_zero = rank_zero_only.rank == 0

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.get("reuse_host_memory", True):
        reuse_freed_host_memory()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokens_per_step = cfg.global_batch_tokens
    module = LMModule(
        mcfg,
        optimizer=build(cfg.optim),
        scheduler=build(cfg.scheduler),
        total_steps=cfg.scheduler.total_steps,
        compile=cfg.compile,
        skip_nonfinite_batches=cfg.faults.skip_nonfinite_batches,
        spike_factor=cfg.faults.spike_factor,
        nan_at_step=cfg.faults.inject_nan_at_step,
        nan_on_rank=cfg.faults.get("inject_nan_on_rank"),
        activation_checkpointing=cfg.trainer.get("activation_checkpointing", False),
    )
    n_total = sum(p.numel() for p in module.parameters())
    n_params = n_total - mcfg.vocab_size * mcfg.d_model  # the tied token embedding
    run_name = cfg.run_name or f"{cfg.attention.name}-{cfg.model.name}-lr{cfg.optim.lr:g}-s{cfg.seed}"
    rank_zero_only(log.info)(
        f"xsa-lm train | {run_name} | model {cfg.model.name}, attention={cfg.attention.name}: "
        f"{n_params / 1e6:.2f}M non-embedding parameters ({n_total / 1e6:.2f}M total) | "
        f"data {datamodule.data.dir.name}: {datamodule.data.meta['train_tokens']:,} train / "
        f"{datamodule.data.meta['val_tokens']:,} val tokens, vocab {datamodule.data.meta['vocab_size']} "
        f"(model {mcfg.vocab_size}) | "
        f"{tokens_per_step:,} tokens/step = {cfg.micro_batch_size} x {cfg.data.block_size} x "
        f"{plan['accumulate']} accumulation x {plan['devices']} device(s) ({device_name(cfg.trainer.accelerator)}), "
        f"{cfg.trainer.max_steps} steps | run dir {run_dir}"
    )

    history = ValHistory(tokens_per_step)
    throughput = Throughput(tokens_per_step)
    ckpt_dir = run_dir / "checkpoints"
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/loss",
                                 mode="min", save_top_k=1, save_last=True)  # fmt: skip
    # The last K step checkpoints too: if last.ckpt is ever damaged, resume=auto falls back on the newest of these.
    # Written after each validation like last.ckpt, not in on_train_batch_end: by then the step's metrics.csv row
    # is on disk, so a kill right after the checkpoint cannot lose a row that the resumed run will not log again.
    periodic = ModelCheckpoint(dirpath=ckpt_dir, filename="step-{step:06d}", monitor="step", mode="max",
                               save_top_k=cfg.checkpoint.keep_last, auto_insert_metric_name=False)  # fmt: skip
    preemption = Preemption(ckpt_dir / "last.ckpt")
    callbacks = [checkpoint, periodic, history, throughput, preemption]
    if cfg.get("diagnostics") and cfg.diagnostics.every_n_steps:
        callbacks.append(Diagnostics(cfg.diagnostics.every_n_steps, cfg.diagnostics.sequences, cfg.diagnostics.chunk))
    if cfg.get("samples") and cfg.samples.every_n_steps:
        s = cfg.samples
        callbacks.append(Samples(s.every_n_steps, str(run_dir), s.prompt, s.max_new_tokens, s.temperature, s.top_k))
    if cfg.progress_bar:
        callbacks.append(ProgressBar())
    strategy = cfg.trainer.strategy
    if memory.strategy_kind(strategy) == "fsdp" and strategy.get("data_parallel_size") == "auto":
        strategy = {**strategy, "data_parallel_size": plan["devices"]}  # Lightning's auto means one per node
    trainer: L.Trainer = build(
        lightning_trainer_args(cfg.trainer),
        strategy=strategy,
        precision=resolve_precision(cfg.trainer.precision),
        default_root_dir=str(run_dir),
        logger=make_loggers(cfg, run_dir, run_name, resume_step) or False,
        callbacks=callbacks,
        accumulate_grad_batches=plan["accumulate"],
        val_check_interval=cfg.val_every_steps * plan["accumulate"],
        check_val_every_n_epoch=None,
        enable_progress_bar=False,  # ours (ProgressBar) counts optimizer steps, Lightning's counts micro-batches
        plugins=[AtomicCheckpointIO()],
    )

    def summarize(status: str, error: str | None = None) -> dict:
        return write_summary(cfg, run_dir, mcfg, n_params, status, error, trainer, history, throughput, t_start,
                             checkpoint, diverged_at=module.diverged_at)  # fmt: skip

    status = "completed"
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)  # our own files
        if module.diverged_at is not None:
            status = "diverged"
        elif preemption.preempted_at is not None:
            status = "interrupted" if preemption.received == "SIGINT" else "preempted"
        elif not history.history or history.history[-1]["step"] != trainer.global_step:
            validate_last_step(trainer, module, datamodule, checkpoint)
    except Exception as e:  # recorded in summary.json, then re-raised: a sweep must see failed runs
        if is_rank_zero:
            first_line = (str(e).strip().splitlines() or [""])[0][:500]
            finish_wandb(trainer, summarize("failed", f"{type(e).__name__}: {first_line}"))
        raise
    summary = summarize(status) if is_rank_zero else {}
    finish_wandb(trainer, summary)
    return summary


def lightning_trainer_args(trainer_cfg: DictConfig) -> DictConfig:
    """The trainer group without the keys that are ours (the module reads them), for lightning.Trainer."""
    return OmegaConf.masked_copy(trainer_cfg, [key for key in trainer_cfg if key not in OUR_TRAINER_KEYS])


def validate_last_step(trainer: L.Trainer, module: LMModule, datamodule, checkpoint: ModelCheckpoint) -> None:
    """A last step that is no multiple of val_every_steps is validated after the fit, outside the checkpoint
    callbacks: when its loss is the best, best.ckpt must still hold it (and last.ckpt its validation history)."""
    trainer.validate(module, datamodule=datamodule, verbose=False)
    # On every rank: under FSDP2 saving gathers (or writes) every rank's shard. val/loss is synced across ranks,
    # so all take the same decisions.
    loss = trainer.callback_metrics["val/loss"]
    trainer.save_checkpoint(checkpoint.last_model_path or Path(checkpoint.dirpath) / "last.ckpt")
    if checkpoint.best_model_score is None or loss < checkpoint.best_model_score:
        best = Path(checkpoint.dirpath) / "best.ckpt"
        trainer.save_checkpoint(best)
        checkpoint.best_model_path, checkpoint.best_model_score = str(best), loss


def finish_wandb(trainer: L.Trainer, summary: dict) -> None:
    """Put the run's outcome into the W&B run summary (what a sweep's dashboard compares), then close it."""
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            keys = ("status", "final_val_loss", "final_val_ppl", "best_val_loss", "tokens_per_s", "diverged_at_step")
            logger.experiment.summary.update({key: summary[key] for key in keys if key in summary})
            logger.experiment.finish()


def write_summary(cfg, run_dir, mcfg, n_params, status, error, trainer, history, throughput, t_start,
                  checkpoint, diverged_at=None) -> dict:  # fmt: skip
    final = history.history[-1]["val_loss"] if history.history and status == "completed" else None
    summary = {
        "status": status,
        "error": error,
        "attention": cfg.attention.name,
        "model": cfg.model.name,
        "lr": cfg.optim.lr,
        "seed": cfg.seed,
        "final_val_loss": final,
        "final_val_ppl": math.exp(final) if final is not None else None,
        "best_val_loss": min((h["val_loss"] for h in history.history), default=None),
        "steps": trainer.global_step,
        "tokens_seen": trainer.global_step * cfg.global_batch_tokens,
        "tokens_per_s": throughput.tokens_per_s,
        "wall_time_s": round(time.time() - t_start, 2),
        "non_embedding_params": n_params,
        "diverged_at_step": diverged_at,
        "events": getattr(trainer.lightning_module, "events", []) if trainer.lightning_module else [],
        "val_history": history.history,
        "run_dir": str(run_dir),
        "checkpoints": {"last": str(run_dir / "checkpoints" / "last.ckpt"), "best": checkpoint.best_model_path or None},
        "model_config": asdict(mcfg),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(s: dict) -> None:
    loss = f"{s['final_val_loss']:.4f} (ppl {s['final_val_ppl']:.2f})" if s["final_val_loss"] is not None else "n/a"
    lines = [
        f"\n{s['status'].upper()}: {s['attention']} {s['model']} | final val loss {loss} | {s['steps']} steps, "
        f"{s['tokens_seen']:,} tokens | {s['tokens_per_s']:,.0f} tokens/s | {s['wall_time_s']:.1f} s wall",
        f"  summary: {s['run_dir']}/summary.json",
    ]
    if s["diverged_at_step"] is not None:
        lines.append(f"  diverged at step {s['diverged_at_step']}; last good checkpoint: {s['checkpoints']['last']}")
    if s["status"] in ("preempted", "interrupted"):
        lines.append(f"  {s['status']}: continue with `xsa-lm train hydra.run.dir={s['run_dir']} resume=auto`")
    log.info("\n".join(lines))


LIGHTNING_NOISE = (
    "litlogger",  # an advertisement
    "GPU available:",  # the header line says where the run trains
    "TPU available:",
    "HPU available:",
    "`Trainer.fit` stopped",  # the result line follows
    "`weights_only` was not set",  # said at every checkpoint
    "Restoring states from the checkpoint",  # the resume line says it
    "Restored all states from the checkpoint",
)


def quiet_third_party() -> None:
    """Messages that tell a user of this command nothing, dropped; warnings that do are kept."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # inside Lightning
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")  # a resume
    noise = logging.Filter()
    noise.filter = lambda record: not any(text in str(record.msg) for text in LIGHTNING_NOISE)
    for logger in (logging.getLogger("lightning.pytorch"), logging.getLogger()):
        for handler in logger.handlers:
            handler.addFilter(noise)


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="train")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    quiet_third_party()
    try:
        with exit_on_user_error():
            notes = []
            if cfg.resume is not None:
                defaults = compose(config_name="train")
                overrides = list(HydraConfig.get().overrides.task)
                cfg, notes = continuation_config(cfg, defaults, overrides, run_dir)
            summary = train(cfg, run_dir, notes)
    except KeyboardInterrupt:  # before training started (the first Ctrl-C during training stops it cleanly)
        print("xsa-lm: interrupted before training started; nothing to resume from this attempt", file=sys.stderr)
        sys.exit(130)
    if summary:
        print_summary(summary)
        if summary["status"] == "interrupted":
            sys.exit(130)
