"""Callbacks: throughput and tokens seen, the validation history kept for summary.json, and periodic diagnostics."""

import time

import lightning as L
import torch


class Throughput(L.Callback):
    """Logs tokens seen and tokens/s, measured between optimizer steps over a sliding window."""

    def __init__(self, tokens_per_step: int, window: int = 10) -> None:
        self.tokens_per_step, self.window = tokens_per_step, window
        self._marks: list[tuple[int, float]] = []
        self.tokens_per_s = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if self._marks and self._marks[-1][0] == step:
            return  # still accumulating gradients for this step
        self._marks = (self._marks + [(step, time.perf_counter())])[-(self.window + 1) :]
        if len(self._marks) > 1:
            (s0, t0), (s1, t1) = self._marks[0], self._marks[-1]
            self.tokens_per_s = (s1 - s0) * self.tokens_per_step / (t1 - t0)
            pl_module.log("train/tokens_per_s", self.tokens_per_s, on_step=True, prog_bar=True)
        pl_module.log("train/tokens_seen", float(step * self.tokens_per_step), on_step=True)


class ValHistory(L.Callback):
    """Remembers (step, tokens, val loss) after each validation (not the sanity check)."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.history: list[dict] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or loss is None:
            return
        step = trainer.global_step
        entry = {"step": step, "tokens": step * self.tokens_per_step, "val_loss": float(loss)}
        if self.history and self.history[-1]["step"] == step:
            self.history[-1] = entry
        else:
            self.history.append(entry)

    # Kept in checkpoints, so that a resumed run's summary.json still holds the whole curve.
    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict["history"])


class Diagnostics(L.Callback):
    """Every `every_n_steps` optimizer steps: the paper's Figure 1 diagnostics per layer on the first `sequences`
    validation windows, logged as diag/<metric>/layer_<l> series (W&B and metrics.csv) and as a W&B table."""

    def __init__(self, every_n_steps: int, sequences: int = 8, chunk: int = 256) -> None:
        self.every_n_steps, self.sequences, self.chunk = every_n_steps, sequences, chunk
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or step == self._last_step or not trainer.is_global_zero:
            return
        self._last_step = step  # once per optimizer step, not per accumulated micro-batch
        from xsa_lm.analysis.diagnostics import METRICS, diagnose

        val = trainer.datamodule.val_set
        windows = torch.stack([val[i][0] for i in range(min(self.sequences, len(val)))]).to(pl_module.device)
        model = getattr(pl_module.model, "_orig_mod", pl_module.model)  # the eager model under torch.compile
        rows = diagnose(model, windows.split(trainer.datamodule.micro_batch_size), self.chunk)
        # Straight to the loggers, once (self.log would repeat the value on every later step's row).
        metrics = {f"diag/{metric}/layer_{row['layer']}": row[metric]
                   for row in rows for metric in METRICS if row[metric] is not None}  # fmt: skip
        columns = ["step", "layer", "attention", *METRICS]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if hasattr(logger, "log_table"):  # W&B
                logger.log_table(key="diag/table", columns=columns, data=[[step, *row.values()] for row in rows])
