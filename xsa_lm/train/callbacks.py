"""Callbacks: throughput and tokens seen, the validation history kept for summary.json, periodic diagnostics, and a
clean stop with a checkpoint on preemption (SIGTERM / SIGUSR1 / SIGUSR2) or Ctrl-C."""

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.utilities import rank_zero_only

from xsa_lm.compat import should_update_logs
from xsa_lm.model import GPT
from xsa_lm.model.sdpa import resolve, sdpa_backends
from xsa_lm.train.hardware import peak_flops

log = logging.getLogger("xsa_lm.train")


class Throughput(L.Callback):
    """Tokens seen, tokens/s, step time and MFU over the last 10 optimizer steps, CUDA's peak memory: at logging steps.
    Not Lightning's ThroughputMonitor: it synchronizes CUDA after every micro-batch and counts micro-batches."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step, self.counted_from = tokens_per_step, (0, 0)  # (step, tokens by then): a resume's
        self._marks: list[tuple[int, float]] = []
        self.tokens_per_s: float | None = None  # none before the first optimizer step
        self.step_time_s = 0.0
        self.flops_per_token: float | None = None
        self.peak_flops: float | None = None  # all devices together

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        context = getattr(getattr(trainer, "datamodule", None), "block_size", None)
        self.flops_per_token = cast(GPT, pl_module.model).flops_per_token(context)
        peak, _ = peak_flops(pl_module.device, str(trainer.precision))
        self.peak_flops = peak * trainer.world_size if peak else None  # None: a GPU missing from the table
        self._marks = [(trainer.global_step, time.perf_counter())]  # so the first step counts whole, micro-batches too

    def tokens_seen(self, step: int) -> int:
        """The checkpoint's count, then this run's tokens per step (which a new run from it may change)."""
        start, tokens = self.counted_from
        return tokens + (step - start) * self.tokens_per_step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen(trainer.global_step)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.counted_from = (checkpoint["global_step"], checkpoint["tokens_seen"])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if self._marks and self._marks[-1][0] == step:
            return  # still accumulating gradients for this step
        self._marks = (self._marks + [(step, time.perf_counter())])[-11:]  # 11 marks: 10 steps
        if len(self._marks) > 1:
            (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
            self.step_time_s = (t1 - t0) / (s1 - s0)
            self.tokens_per_s = self.tokens_per_step / self.step_time_s
        if should_update_logs(trainer):  # a logged float is copied to the device, which waits
            pl_module.log_dict(self.metrics(step, pl_module.device), on_step=True)

    def metrics(self, step: int, device: torch.device) -> dict[str, float]:
        values = {"train/tokens_seen": float(self.tokens_seen(step))}
        if self.tokens_per_s is not None:
            values |= {"train/tokens_per_s": self.tokens_per_s, "train/step_time_s": self.step_time_s}
            if self.flops_per_token and self.peak_flops:
                values["train/mfu"] = self.flops_per_token * self.tokens_per_s / self.peak_flops
        if device.type == "cuda":
            values["train/max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            values["train/max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        return values


class AttentionKernels(L.Callback):
    """The run's SDPA kernel order (`sdpa_backends`) from setup to teardown: compiled blocks are traced inside it."""

    def __init__(self, sdpa_backends_value: str | Sequence[str]) -> None:
        self.value = sdpa_backends_value
        self._inside: contextlib.ExitStack | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._inside is None:
            self._inside = contextlib.ExitStack()
            self._inside.enter_context(sdpa_backends(resolve(self.value, trainer.strategy.root_device)))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._inside is not None:
            self._inside.close()
            self._inside = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, stage="")  # Lightning skips teardown after an exception


class Profiler(L.Callback):
    """A Chrome trace of optimizer steps [start_step, start_step + steps) in <run dir>/profile/.
    Not Lightning's PyTorchProfiler: its schedule counts micro-batches since the process started."""

    def __init__(self, run_dir: str, start_step: int, steps: int = 3) -> None:
        self.dir, self.start_step, self.end_step = Path(run_dir) / "profile", start_step, start_step + steps
        self._profiler: torch.profiler.profile | None = None
        self._first = self._step = start_step
        self.path: Path | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self._profiler is None and self.path is None and self.start_step <= trainer.global_step < self.end_step:
            # the CPU's activity, and CUDA's where torch has it
            self._profiler = torch.profiler.profile(record_shapes=True, profile_memory=True)
            self._profiler.start()
            self._first = self._step = trainer.global_step  # a resumed run may start inside the range

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self._profiler is None or trainer.global_step == self._step:
            return  # not tracing, or still accumulating this step's micro-batches
        self._profiler.step()  # marks the optimizer step in the trace
        self._step = trainer.global_step
        if self._step >= self.end_step:
            self.on_train_end(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is None:
            return
        self._profiler.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        last = max(self._first, self._step - 1)
        self.path = self.dir / f"steps_{self._first}-{last}_rank{trainer.global_rank}.json"
        self._profiler.export_chrome_trace(str(self.path))
        self._profiler = None


class ProgressBar(RichProgressBar):
    """Lightning's rich bar counting optimizer steps (its own counts micro-batches); values read at logging steps."""

    KEYS = {"train/loss": ("loss", "{:.4f}"), "train/tokens_per_s": ("tokens/s", "{:,.0f}")}
    shown: dict[str, str] = {}  # replaced at logging steps, never changed in place

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps

    def _get_train_description(self, current_epoch: int) -> str:
        return "step"

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        return dict(self.shown)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if should_update_logs(trainer):
            logged = trainer.callback_metrics
            self.shown = {name: fmt.format(float(logged[k])) for k, (name, fmt) in self.KEYS.items() if k in logged}
        # Lightning's bar shows batch_idx + 1 done: here, the optimizer steps done
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)


class ValHistory(L.Callback):
    """Each validation's step, tokens, loss, bits per byte and loss by position; a checkpoint's history measured on
    another `val_set` (the prepared data, window count and length) is not continued. A non-finite loss is left out:
    it ends the run as diverged (LMModule), which summary.json says."""

    def __init__(self, tokens_seen: Callable[[int], int], val_set: dict[str, object] | None = None) -> None:
        self.tokens_seen, self.val_set = tokens_seen, val_set  # tokens_seen: Throughput's
        self.history: list[dict] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or loss is None or not torch.isfinite(loss):
            return
        step, bpb = trainer.global_step, trainer.callback_metrics.get("val/bpb")
        by_position = list(getattr(pl_module, "val_by_position", []))
        entry: dict[str, object] = {"step": step, "tokens": self.tokens_seen(step), "val_loss": float(loss)}
        entry |= {"val_bpb": float(bpb) if bpb is not None else None, "val_loss_by_position": by_position}
        self.history = [e for e in self.history if e["step"] != step] + [entry]  # a repeated step's entry is replaced

    # Kept in checkpoints, so that a resumed run's summary.json still holds the whole curve.
    def state_dict(self) -> dict[str, object]:
        return {"history": self.history, "val_set": self.val_set}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.val_set is not None and state_dict["val_set"] != self.val_set:
            rank_zero_only(log.warning)(
                f"WARNING: the checkpoint's validation history ({len(state_dict['history'])} points) was measured "
                "on another validation set than this run's: val_history and best_val_loss start afresh"
            )
            return
        self.history = list(state_dict["history"])


class EveryNSteps(L.Callback):
    """`work` on global rank 0 once every `every_n_steps` optimizer steps (not per micro-batch)."""

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if step and not step % self.every_n_steps and step != self._last_step and trainer.is_global_zero:
            self._last_step = step
            self.work(trainer, pl_module, step)

    work: Callable[[L.Trainer, L.LightningModule, int], None]  # the subclass's


class Diagnostics(EveryNSteps):
    """The paper's Figure 1 diagnostics per layer on the first validation windows, as diag/<metric>/layer_<l>."""

    def __init__(self, every_n_steps: int, sequences: int, chunk: int) -> None:
        super().__init__(every_n_steps)
        self.sequences, self.chunk = sequences, chunk  # chunk: query positions per block when computing a_ii

    def work(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        from xsa_lm.analysis.diagnostics import METRICS, diagnose

        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's fit, not declared
        val = datamodule.val_set
        windows = torch.stack([val[i][0] for i in range(min(self.sequences, len(val)))]).to(pl_module.device)
        model = cast(GPT, pl_module.model)
        with torch.compiler.set_stance("force_eager"):  # a few batches, observed layer by layer: not worth compiling
            rows = diagnose(model, windows.split(datamodule.micro_batch_size), self.chunk)
        # Straight to the loggers, once (self.log would repeat the value on every later step's row).
        metrics = {f"diag/{m}/layer_{row['layer']}": row[m] for row in rows for m in METRICS if row[m] is not None}
        columns = ["step", "layer", "attention", *METRICS]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if hasattr(logger, "log_table"):  # W&B
                logger.log_table(key="diag/table", columns=columns, data=[[step, *row.values()] for row in rows])


class Samples(EveryNSteps):
    """Text sampled from the model, appended to <run dir>/samples.txt and logged to W&B as a table."""

    def __init__(
        self, every_n_steps: int, run_dir: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None
    ) -> None:
        super().__init__(every_n_steps)
        self.path, self.prompt, self._rows = f"{run_dir}/samples.txt", prompt, list[list]()
        self.settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)

    def work(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        from xsa_lm.data.tokenizer import eot_id
        from xsa_lm.model import generate

        tokenizer = trainer.datamodule.data.tokenizer  # type: ignore[attr-defined]  # set by Lightning's fit
        ids = tokenizer.encode(self.prompt, add_special_tokens=False).ids or [eot_id(tokenizer)]
        generator = torch.Generator(device=pl_module.device).manual_seed(step)  # the same draw on a resumed run
        context = torch.tensor([ids], device=pl_module.device)
        try:  # eagerly, compiled or not
            tokens = generate(pl_module.model, context, generator=generator, **self.settings)
        except FloatingPointError:  # diverging: the run ends as diverged at its next check of the updates
            log.warning(f"WARNING: no sample at step {step}: the model's logits are NaN or infinite")
            return
        text = self.prompt + tokenizer.decode(tokens[0, len(ids) :].tolist())
        with open(self.path, "a") as f:
            f.write(f"=== step {step}\n{text}\n")
        self._rows.append([step, text])
        for logger in trainer.loggers:
            if hasattr(logger, "log_text"):  # W&B: the whole table so far
                logger.log_text(key="samples", columns=["step", "text"], data=self._rows)


class Preemption(L.Callback):
    """SIGTERM / SIGUSR1 / SIGUSR2 (preempted, exit 0) / SIGINT (interrupted, 130; twice: abort): stop at the next
    optimizer step with a checkpoint. Not Lightning's signal handling: it stops without one (SLURM's requeue aside);
    nor submitit's (SIGUSR2, its preemption signal): it checkpoints and exits in the middle of a step."""

    def __init__(self, last_checkpoint: Path, val_every_steps: int) -> None:
        self.last_checkpoint, self.val_every_steps = last_checkpoint, val_every_steps
        self.received: str | None = None  # the signal's name
        self.preempted_at: int | None = None
        self._seen_step = -1

    def _handle(self, signum: int, frame: object) -> None:
        say = partial(print, file=sys.stderr, flush=True)
        if signum == signal.SIGINT and self.received == "SIGINT":  # a second Ctrl-C: the user will not wait
            say("\nsecond Ctrl-C: aborted without a checkpoint; resume=auto continues from the last one")
            os._exit(130)
        if signum == signal.SIGINT:
            say("\nCtrl-C: finishing this optimizer step, then writing a checkpoint (Ctrl-C again to abort now)")
        self.received = signal.Signals(signum).name

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning's own handlers are installed (they would end the run without a checkpoint).
        from submitit import JobEnvironment

        for sig in {signal.SIGTERM, signal.SIGUSR1, JobEnvironment._usr_sig(), signal.SIGINT}:  # submitit's: USR2
            signal.signal(sig, self._handle)
        self._seen_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step == self._seen_step:  # still accumulating micro-batches of this step
            return
        self._seen_step = trainer.global_step
        stop = self.received is not None
        if trainer.world_size > 1:  # every rank stops at the same step, or none does
            every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning, not declared
            if trainer.global_step % max(every, 1):
                return  # agreeing is a collective that waits for the device: at logging steps only
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop and self.preempted_at is None:
            self.preempted_at = trainer.global_step
            trainer.should_stop = True  # the loop ends after this batch; the checkpoint follows in on_train_end
            if trainer.global_step % self.val_every_steps:
                # Lightning validates a run that stops early: the grace period is the checkpoint's, and a resumed
                # run validates at the steps an uninterrupted one does
                trainer.limit_val_batches = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Written once the loop has closed the step (its counters complete), so a resume logs the same step numbers.
        if self.preempted_at is not None:
            trainer.save_checkpoint(self.last_checkpoint)
            if trainer.is_global_zero:
                log.info(
                    f"{self.received or 'signal'} received: checkpoint at step {trainer.global_step} written to "
                    f"{self.last_checkpoint}; resume with resume=auto"
                )


class SavedConfig(L.Callback):
    """The run's config travels in each checkpoint, so that a resume can tell a hand-edited config.yaml."""

    def __init__(self, config: dict[str, object]) -> None:
        self.config = config

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["run_config"] = self.config


@dataclass
class RunCallbacks:
    """A run's callbacks: the ones it reads back after the fit, by name, and the list the trainer gets."""

    history: ValHistory
    throughput: Throughput
    best: ModelCheckpoint  # best.ckpt, and last.ckpt
    preemption: Preemption
    all: list[L.Callback]
