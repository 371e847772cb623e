"""summary.json: how a run ended and what it was, written by global rank 0 when the fit is over (also on failure)."""

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from xsa_lm.config.command_line import pasteable
from xsa_lm.errors import UserError, first_line
from xsa_lm.files import write_json
from xsa_lm.records import RunSummary

if TYPE_CHECKING:  # the record (RunSummary, in records.py) is read without Lightning
    import lightning as L

    from xsa_lm.config.spec import TrainSpec
    from xsa_lm.model import GPTConfig
    from xsa_lm.train.callbacks import RunCallbacks
    from xsa_lm.train.module import LMModule

log = logging.getLogger("xsa_lm.train")
WANDB_SUMMARY_KEYS = "status final_val_loss final_val_ppl final_val_bpb best_val_loss tokens_per_s diverged_at_step"


@dataclass
class RunStart:
    """What is known of a run when it starts; write() adds how it ended. The clock starts when it is made."""

    spec: "TrainSpec"
    run_dir: Path
    model_config: "GPTConfig"
    non_embedding_params: int = 0
    train_tokens: int = 0  # the training split's tokens, for the epochs a run trains
    started: float = field(default_factory=time.time)

    def write(
        self,
        status: str,
        *,
        trainer: "L.Trainer",
        module: "LMModule",
        callbacks: "RunCallbacks",
        error: Exception | None = None,
    ) -> RunSummary:
        """summary.json: how the run ended, written and returned; then the W&B run's summary, and its end."""
        import torch
        from lightning.pytorch.loggers import WandbLogger

        from xsa_lm.train.runinfo import code_version
        from xsa_lm.train.schedule import peak_lr

        history = callbacks.history.history
        tokens_seen = callbacks.throughput.tokens_seen(trainer.global_step)
        final = history[-1]["val_loss"] if history and status == "completed" else None
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        summary = RunSummary(
            status=status,
            error=f"{type(error).__name__}: {first_line(error)}" if error is not None else None,
            attention=self.spec.attention.name,
            model=self.spec.model.name,
            lr=self.spec.optim.lr,
            peak_lr=peak_lr(scheduler, trainer.global_step) if scheduler is not None else None,
            precision=trainer.precision,
            seed=self.spec.seed,
            final_val_loss=final,
            final_val_ppl=math.exp(final) if final is not None else None,
            best_val_loss=min((h["val_loss"] for h in history), default=None),
            final_val_bpb=history[-1].get("val_bpb") if final is not None else None,
            final_val_loss_by_position=history[-1].get("val_loss_by_position", []) if final is not None else [],
            steps=trainer.global_step,
            data_epochs=tokens_seen / self.train_tokens if self.train_tokens else None,
            tokens_seen=tokens_seen,
            tokens_per_s=callbacks.throughput.tokens_per_s,
            wall_time_s=round(time.time() - self.started, 2),
            non_embedding_params=self.non_embedding_params,
            diverged_at_step=module.diverged_at,
            events=module.events,
            val_history=history,
            run_dir=str(self.run_dir),
            checkpoints={  # only of good states (FolderCheckpoint): none when the run diverged before the first
                "last": str(last) if (last := self.run_dir / "checkpoints" / "last.ckpt").exists() else None,
                "best": callbacks.best.best_model_path or None,
            },
            model_config=asdict(self.model_config),
            code=code_version(),
            cpu_threads=torch.get_num_threads(),
        )
        write_json(
            self.run_dir / "summary.json",
            summary.to_json(),
            intact="the run's checkpoints and metrics.csv are intact",
            then=f"write it with `xsa-lm train {pasteable('hydra.run.dir', self.run_dir)} resume=auto`",
        )
        for logger in trainer.loggers:  # the outcome into the W&B run summary, which a sweep's dashboard compares
            if isinstance(logger, WandbLogger):
                if summary.status == "completed":
                    logger.finalize("success")  # log_model: also the last step's checkpoints
                logger.experiment.summary.update({key: getattr(summary, key) for key in WANDB_SUMMARY_KEYS.split()})
                logger.experiment.finish()
        return summary


def completed(run_dir: Path) -> bool:
    """Whether the run's summary.json says it completed; a damaged one says nothing (a resume writes it again)."""
    summary = run_dir / "summary.json"
    try:
        return summary.exists() and RunSummary.read(summary).status == "completed"
    except UserError:
        return False


def print_summary(s: RunSummary) -> None:
    if s.final_val_loss is not None:
        loss = f"final val loss {s.final_val_loss:.4f} (ppl {s.final_val_ppl:.2f})"
    elif s.val_history:  # a run that has not reached its last step: no final loss yet
        loss = f"last val loss {s.val_history[-1]['val_loss']:.4f} at step {s.val_history[-1]['step']}"
    else:
        loss = "final val loss n/a"
    speed = f"{s.tokens_per_s:,.0f} tokens/s" if s.tokens_per_s is not None else "tokens/s n/a"
    lines = [
        f"\n{s.status.upper()}: {s.attention} {s.model} | {loss} | {s.steps} steps, "
        f"{s.tokens_seen:,} tokens | {speed} | {s.wall_time_s:.1f} s wall",
        f"  summary: {s.run_dir}/summary.json",
    ]
    if s.diverged_at_step is not None:
        good = s.checkpoints["last"] or "none (no step before it validated finite)"
        lines.append(f"  diverged at step {s.diverged_at_step}; last good checkpoint: {good}")
    if s.status in ("preempted", "interrupted"):
        lines.append(f"  {s.status}: continue with `xsa-lm train {pasteable('hydra.run.dir', s.run_dir)} resume=auto`")
    log.info("\n".join(lines))
