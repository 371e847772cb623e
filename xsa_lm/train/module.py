"""The LightningModule: loss, optimizer groups, LR schedule and what gets logged."""

import json
import math
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import cast

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.types import STEP_OUTPUT, OptimizerLRSchedulerConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from xsa_lm import compat
from xsa_lm.analysis.losses import loss_sums, read_sums
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.gpt import Block
from xsa_lm.train.schedule import continue_schedule


def compile_model(model: GPT, backend: str | Callable = "inductor") -> None:
    """torch.compile as torchtitan applies it: each block, and the head with the loss, in place (the state-dict keys
    stay an eager model's); under FSDP2 compiling the whole model left the head and the cross-entropy eager."""
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    model.logits_and_loss = torch.compile(  # type: ignore[method-assign]  # in place, on purpose
        model.logits_and_loss, backend=backend, fullgraph=True
    )


def shard_model(model: GPT, mesh: DeviceMesh) -> None:
    """FSDP2 over `mesh`: one unit per transformer block and the root. No mixed-precision policy, on purpose: fp32
    parameters and autocast as under DDP (bf16 parameters would round the LayerNorm gains and the embedding); the
    price is fp32 all-gathers."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "token_losses")  # validation's: gathers the root's weights as forward does


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear weights, embeddings); never norms or biases."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]


class LMModule(L.LightningModule):
    def __init__(
        self,
        model_config: GPTConfig,
        optimizer: partial[torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler],
        total_steps: int,
        compile: bool = False,
        skip_nonfinite_batches: int = 0,
        spike_factor: float | None = 3.0,
        nan_at_step: int | None = None,
        nan_on_rank: int | None = None,
        activation_checkpointing: bool = False,
        position_buckets: int = 8,
        token_bytes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.model_config, self.total_steps = model_config, total_steps
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.model = GPT(model_config)
        for block in self.model.blocks:  # before compile and before FSDP2 wraps each block (configure_model)
            cast(Block, block).activation_checkpointing = activation_checkpointing
        if compile:
            compile_model(self.model)
        self.diverged_at: int | None = None
        self.skip_budget, self.spike_factor = skip_nonfinite_batches, spike_factor
        self.nan_at_step, self.nan_on_rank = nan_at_step, nan_on_rank  # nan_on_rank None: every rank
        self.events: list[dict] = []  # skipped batches and loss / grad-norm spikes, kept in summary.json
        self._typical: dict[str, float] = {}  # running averages at log steps, for spike detection
        self._nonfinite: list[tuple[int, torch.Tensor]] = []  # (step, device flag) not yet read by the host
        self._step_loss: torch.Tensor | None = None  # the sum of the current step's micro-batch losses
        # Validation sums on this rank: token losses, tokens and their bytes, then the losses and tokens of each span
        # of positions (position_buckets equal spans of the window, earliest first).
        self._val_sum: torch.Tensor | None = None
        self.position_buckets = position_buckets
        self.val_by_position: list[float | None] = []  # the last validation's mean loss per span of positions
        # The UTF-8 bytes of each token id (data/tokenizer.token_byte_lengths), for bits per byte; not saved.
        self.register_buffer("token_bytes", torch.tensor(token_bytes or [], dtype=torch.float64), persistent=False)

    def configure_model(self) -> None:
        """trainer=fsdp: FSDP2, one unit per transformer block and the root, over the data-parallel mesh."""
        # isinstance: a second fit or validate of this module calls this hook again
        if self.device_mesh is None or isinstance(self.model, FSDPModule):
            return
        shard_model(self.model, self.device_mesh["data_parallel"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """The micro-batch count realigned to this run's accumulation, when a trainer resumes it."""
        try:
            accumulate = self.trainer.accumulate_grad_batches
        except RuntimeError:  # not attached to a Trainer: LMModule.load_from_checkpoint
            accumulate = None
        if accumulate is not None and (step := checkpoint.get("global_step")) is not None:
            compat.resume_after_the_step(checkpoint, global_step=step, accumulate=accumulate)
            faults = json.loads(checkpoint["faults"])
            self.events, self._typical = faults["events"], dict(faults["spike_averages"])
            self._nonfinite = [(step, torch.tensor(True)) for step in faults["skipped_unread"]]

    def on_train_start(self) -> None:
        for config in self.trainer.lr_scheduler_configs:  # restored from a checkpoint: at its step of this schedule
            continue_schedule(config.scheduler)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["model_config"] = asdict(self.model_config)  # `xsa-lm analyze` rebuilds the model from the file
        # What a resume needs to go on where the run was, as JSON text, which every checkpoint format keeps as it is.
        pending = [step for step, flag in self._nonfinite if bool(flag)]
        faults = {"events": self.events, "spike_averages": self._typical, "skipped_unread": pending}
        checkpoint["faults"] = json.dumps(faults)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One micro-batch's forward; Lightning sums the backward over accumulate_grad_batches of them, then clips
        (configure_gradient_clipping: a non-finite norm skips the update), steps fused AdamW and the LR schedule."""
        x, y = batch
        if isinstance(self.model, FSDPModule):  # DDP's counterpart is Lightning's no_sync
            # One reduce-scatter per step, after its last micro-batch, at the cost of holding the unsharded fp32
            # gradients while accumulating.
            self.model.set_requires_gradient_sync(not compat.accumulating(self.trainer))
        _, loss = self.model(x, y)
        if self.nan_at_step is not None and self.global_step == self.nan_at_step:  # faults.inject_nan_at_step
            if self.nan_on_rank in (None, self.global_rank):
                loss = loss * float("nan")  # one bad micro-batch
            self.nan_at_step = None
        self.watch_for_spike("loss_spike", loss)
        detached = loss.detach()
        self._step_loss = detached if self._step_loss is None else self._step_loss + detached
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:  # the optimizer step's last micro-batch
            self.log_step_loss()
        # Not LearningRateMonitor: it names the column lr-AdamW/pg1 and logs it on rows of its own, per micro-batch.
        if compat.should_update_logs(self.trainer):  # self.log(float) copies to the device, which waits: only if kept
            lr = cast(LightningOptimizer, self.optimizers()).param_groups[0]["lr"]  # one optimizer: not a list
            self.log("train/lr", lr, on_step=True)
        return loss

    def log_step_loss(self) -> None:
        """train/loss: the mean over the step's micro-batches and, at logging steps, over every rank. A device tensor,
        read only when written out (not prog_bar=True: Lightning reads those back after every batch)."""
        assert self._step_loss is not None  # training_step has just added to it
        loss = self._step_loss / self.trainer.accumulate_grad_batches
        self._step_loss = None
        if compat.should_update_logs(self.trainer) and self.trainer.world_size > 1:  # a collective, no host-device sync
            loss = self.trainer.strategy.reduce(loss, reduce_op="mean")
        self.log("train/loss", loss, on_step=True)

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros(3 + 2 * self.position_buckets, device=self.device, dtype=torch.float64)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        assert self._val_sum is not None  # set at the epoch's start
        token_bytes = cast(torch.Tensor, self.token_bytes)
        token_loss = self.model.token_losses(x, y)
        self._val_sum += loss_sums(token_loss, y, token_bytes=token_bytes, buckets=self.position_buckets)

    def on_validation_epoch_end(self) -> None:
        """The mean over every validation token of every rank, the same on any device count (sync_dist would average
        each rank's mean, and ranks hold different numbers of windows); bits per byte: over the tokens' bytes."""
        assert self._val_sum is not None
        sums = self.trainer.strategy.reduce(self._val_sum, reduce_op="sum").tolist()
        value, bpb, self.val_by_position = read_sums(sums, self.position_buckets)
        loss = torch.tensor(value, device=self.device)
        if not math.isfinite(value) and not self.trainer.sanity_checking and self.diverged_at is None:
            self.diverged_at, self.trainer.should_stop = self.global_step, True  # its weights give NaN/inf
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss.clamp(max=50.0)))
        if bpb is not None:
            self.log("val/bpb", torch.tensor(bpb, device=self.device))

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        # Clip ourselves so the pre-clip norm can be logged (max_norm=inf only measures it).
        max_norm = gradient_clip_val if gradient_clip_val else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):  # sharded (FSDP2): the norm over every shard, the same on every rank
            grad_norm = grad_norm.full_tensor()
        self.skip_update_if_nonfinite(optimizer, grad_norm)
        self.watch_for_spike("grad_norm_spike", grad_norm)
        self.log("train/grad_norm", grad_norm, on_step=True)

    def skip_update_if_nonfinite(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """A NaN/inf gradient never reaches the weights. Fused AdamW skips its update on the device (`found_inf`), so
        no step waits for the host: the flags are read at logging steps (check_nonfinite). Unfused: read now."""
        nonfinite = ~torch.isfinite(grad_norm)
        if optimizer.defaults.get("fused"):
            compat.skip_fused_update(optimizer, nonfinite)
        elif nonfinite:  # a host-device sync per step, only for optimizers that cannot skip on the device
            optimizer.zero_grad(set_to_none=True)  # the optimizer leaves parameters without a gradient untouched
        else:
            return
        self._nonfinite.append((self.global_step, nonfinite))

    def on_train_batch_start(self, batch: tuple, batch_idx: int) -> None:
        if self.global_step + 1 >= self.trainer.max_steps and not compat.accumulating(self.trainer):
            # The run's last micro-batch: a stop, which Lightning's loop logs and validates before it ends (as at
            # val_every_steps), so the last step gets its logged row, validation and checkpoints in the loop.
            self.trainer.should_stop = True

    def on_train_batch_end(self, outputs: STEP_OUTPUT, batch: tuple, batch_idx: int) -> None:
        every = self.trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning, not declared
        if self.global_step % max(every, 1) == 0 or self.trainer.should_stop:  # the last step: before its checkpoints
            self.check_nonfinite()

    def check_nonfinite(self) -> None:
        """Skipped updates are `skipped_batch` events while the budget lasts; the next stops the run as diverged."""
        if not self._nonfinite:
            return
        flags = torch.stack([flag.to(self.device) for _, flag in self._nonfinite]).tolist()  # one sync for all
        steps = [step for (step, _), bad in zip(self._nonfinite, flags, strict=True) if bad]
        self._nonfinite = []
        for step in steps:
            if self.diverged_at is not None:
                break
            if self.count("skipped_batch") < self.skip_budget:
                self.record_event("skipped_batch", None, step)
            else:
                self.diverged_at = step
                self.trainer.should_stop = True

    on_train_end = check_nonfinite  # the last steps' flags

    def count(self, event: str) -> int:
        return sum(e["event"] == event for e in self.events)

    def record_event(self, event: str, value: float | None, step: int | None = None) -> None:
        self.events.append({"event": event, "step": self.global_step if step is None else step, "value": value})
        self.log(f"events/{event}", float(self.count(event)), on_step=True)

    def watch_for_spike(self, event: str, value: torch.Tensor) -> None:
        """A value above spike_factor x its running average is an event; at logging steps only (reading it syncs)."""
        if self.spike_factor is None or not compat.should_update_logs(self.trainer):
            return
        current = float(value.detach())
        if not math.isfinite(current):  # a skipped update (check_nonfinite), not a spike; keeps the average finite
            return
        typical = self._typical.get(event)
        if typical is not None and self.global_step > 0 and current > self.spike_factor * typical:
            self.record_event(event, current)
        self._typical[event] = current if typical is None else 0.9 * typical + 0.1 * current

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        groups = param_groups(self.model, self.optimizer_factory.keywords.get("weight_decay", 0.0))
        kwargs: dict[str, bool] = {}
        if "fused" not in self.optimizer_factory.keywords and self.device.type in ("cpu", "cuda"):
            kwargs["fused"] = True  # one kernel for all parameters (~8x faster on CPU too), and found_inf skipping
        optimizer = self.optimizer_factory(groups, **kwargs)
        scheduler = self.scheduler_factory(optimizer, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
