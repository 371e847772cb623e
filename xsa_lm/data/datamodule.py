"""Token windows for training: a deterministic, resumable shuffled stream, and a fixed validation set."""

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from itertools import count
from typing import cast

import lightning as L
import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from xsa_lm.data.prepare import PreparedData
from xsa_lm.errors import UserError


class PackedWindows(Dataset):
    """Windows of block_size + 1 tokens over memory-mapped shards, as (input, target) pairs. Consecutive windows
    share one token (the last target is the next input's first token); no window crosses a shard boundary."""

    def __init__(self, shards: Sequence[np.ndarray], block_size: int) -> None:
        self.shards, self.block_size = list(shards), block_size
        counts = [max(0, (len(s) - 1) // block_size) for s in self.shards]
        self.starts = np.cumsum([0, *counts]).tolist()  # window index where each shard begins
        self.n = self.starts[-1]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        shard = bisect.bisect_right(self.starts, i) - 1
        start = (i - self.starts[shard]) * self.block_size
        window = torch.from_numpy(self.shards[shard][start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


@dataclass
class ShuffledBatches(IterableDataset):
    """Endless micro-batches, a pure function of (seed, batch index): sample g is window perm_e[g mod n], e = g // n,
    perm_e a seeded permutation. Rank r of W takes global micro-batches r, r + W, ...; loader worker w of K every K-th
    of those (the order does not depend on the workers). `start_batch` resumes exactly where a run stopped."""

    windows: PackedWindows
    batch_size: int
    _: KW_ONLY
    seed: int
    start_batch: int = 0
    rank: int = 0
    world_size: int = 1
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)  # epoch -> a permutation

    def window_index(self, g: int) -> int:
        epoch, i = divmod(g, len(self.windows))
        if epoch not in self._perms:  # keep one epoch's permutation: memory stays O(windows)
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(len(self.windows), generator=generator)}
        return int(self._perms[epoch][i])

    def batch(self, b: int) -> list[torch.Tensor]:
        first = (b * self.world_size + self.rank) * self.batch_size
        return default_collate([self.windows[self.window_index(g)] for g in range(first, first + self.batch_size)])

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        yield from map(self.batch, count(self.start_batch + worker, n_workers))


class TokenDataModule(L.LightningDataModule):
    def __init__(
        self,
        data: PreparedData,
        *,
        block_size: int,
        micro_batch_size: int,
        seed: int,
        val_windows: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.data, self.micro_batch_size, self.seed, self.num_workers = data, micro_batch_size, seed, num_workers
        self.train_windows = PackedWindows(data.shards("train"), block_size)
        self.val_set = PackedWindows(data.shards("val"), block_size)
        self.val_available = self.val_set.n  # before data.val_windows takes the first ones (fixed across runs)
        self.val_set.n = min(self.val_set.n, val_windows or self.val_set.n)
        if self.train_windows.n < micro_batch_size:  # else a micro-batch would repeat windows
            raise UserError(
                f"data: the training split has {self.train_windows.n} windows of {block_size + 1} tokens "
                f"({data.meta['train_tokens']:,} tokens), fewer than micro_batch_size={micro_batch_size}: lower "
                "micro_batch_size or data.block_size, or use a larger corpus"
            )
        if self.val_set.n < 1:
            raise UserError(
                f"data: the validation split has no window of {block_size + 1} tokens ({data.meta['val_tokens']:,} "
                "tokens): raise data.val_fraction or lower data.block_size"
            )
        self.served: int | None = None  # the windows the whole stream (every rank) had served, from a checkpoint

    def state_dict(self) -> dict[str, int | str]:
        """In every checkpoint: the micro-batches all ranks served; the tokenizer's sha256 (checkpoints/load.py too)."""
        if (t := self.trainer) is None:
            return {}
        served = t.global_step * t.accumulate_grad_batches * t.world_size
        micro_batches = {"seed": self.seed, "micro_batch_size": self.micro_batch_size, "global_micro_batches": served}
        return {**micro_batches, "tokenizer_sha256": self.data.tokenizer_sha256}

    def load_state_dict(self, state_dict: dict) -> None:
        if (saved := state_dict.get("tokenizer_sha256")) not in (None, self.data.tokenizer_sha256):  # prepared again
            raise UserError(
                f"resume: the checkpoint was trained with another tokenizer (sha256 {saved[:12]}) than the data in "
                f"{self.data.dir} (sha256 {self.data.tokenizer_sha256[:12]}): resume on the data it was trained on"
            )
        if "global_micro_batches" in state_dict:
            self.served = state_dict["global_micro_batches"] * state_dict["micro_batch_size"]

    def train_dataloader(self) -> DataLoader:
        stream = ShuffledBatches(self.train_windows, self.micro_batch_size, seed=self.seed)
        if (trainer := self.trainer) is not None:
            stream.rank, stream.world_size = trainer.global_rank, trainer.world_size
            stream.start_batch = trainer.global_step * trainer.accumulate_grad_batches
            if self.served is not None:  # a multiple of micro_batch_size x devices: a resume keeps the global batch
                stream.start_batch = self.served // (self.micro_batch_size * trainer.world_size)
        return DataLoader(stream, batch_size=None, num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def val_dataloader(self) -> DataLoader:
        windows = padded_for_ranks(self.val_set, self.trainer.world_size if self.trainer is not None else 1)
        pin = torch.cuda.is_available()
        return DataLoader(windows, batch_size=self.micro_batch_size, num_workers=self.num_workers, pin_memory=pin)


def padded_for_ranks(windows: Dataset, world_size: int) -> Dataset:
    """The windows padded to a multiple of the ranks with targets of -1 (ignored by the loss): Lightning's sampler
    would repeat the first windows, and every rank must run as many batches (an FSDP forward is a collective)."""
    n = len(windows)  # type: ignore[arg-type]
    padding, (x, y) = -(-n // world_size) * world_size - n, windows[0]
    return ConcatDataset([windows, cast(Dataset, [(x, torch.full_like(y, -1))] * padding)])  # a list serves as one
