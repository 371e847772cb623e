"""Corpus + tokenizer -> token shards on disk, in bounded memory, resumable at shard granularity.

A prepared directory holds:
  prepare.json            what is being prepared (source, tokenizer, split): a rerun must match it
  tokenizer.json          the tokenizer (trained BPE, GPT-2's, or a given file)
  train-000000.bin ...    flat token arrays (uint16 when the vocabulary fits, else uint32), EOT after each document
  val-000000.bin ...      the validation documents of the same chunk of the corpus
  shard-000000.json ...   written last per shard: its document and token counts (a shard without it is redone)
  meta.json               written last: every shard's counts, totals, tokenizer identity and hash
The corpus is read as a stream and cut into chunks of `shard_documents` documents; a chunk is one shard. Chunks are
tokenized in parallel worker processes, at most two per worker in flight, so memory stays bounded.
"""

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from itertools import islice
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from xsa_lm.data.tokenizer import EOT
from xsa_lm.errors import UserError


@dataclass
class PreparedData:
    dir: Path
    tokenizer: Tokenizer
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def shards(self, split: str) -> list[np.ndarray]:
        """The split's non-empty shards, memory-mapped; a shard whose size disagrees with meta.json is an error."""
        arrays = []
        for shard in self.meta["shards"]:
            n_tokens = shard[f"{split}_tokens"]
            if n_tokens == 0:
                continue
            path = self.dir / f"{split}-{shard['index']:06d}.bin"
            size = path.stat().st_size if path.exists() else -1
            if size != n_tokens * self.dtype.itemsize:
                raise UserError(
                    f"data: shard {path} is truncated or corrupt ({size} bytes, expected "
                    f"{n_tokens * self.dtype.itemsize}): delete it and its shard-{shard['index']:06d}.json, then "
                    "run the same `xsa-lm prepare` command to rebuild it"
                )
            arrays.append(np.memmap(path, dtype=self.dtype, mode="r"))
        return arrays


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def is_val_document(key: str, val_fraction: float, split_seed: int) -> bool:
    """A document's split from its key alone: stable under re-preparation, order and worker count."""
    digest = hashlib.sha256(f"{split_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def cache_path(cache_dir: str, source_name: str, identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{source_name}-{digest}"


def prepare(
    source,
    build_tokenizer: Callable[..., Tokenizer],
    out: Path,
    identity: dict,
    val_fraction: float = 0.0005,
    split_seed: int = 0,
    shard_documents: int = 10_000,
    workers: int = 1,
    tokenizer_documents: int = 100_000,
    progress: bool = False,
) -> PreparedData:
    """Tokenize `source` into shards in `out`, resuming an interrupted preparation, or load a finished one."""
    if not 0 <= val_fraction < 1:
        raise UserError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    if shard_documents < 1 or workers < 1:
        raise UserError("data.shard_documents and data.prepare_workers must be at least 1")
    identity = {**identity, "val_fraction": val_fraction, "split_seed": split_seed, "shard_documents": shard_documents}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process (a parallel sweep trial) waits, then reuses the result
        _check_identity(out, identity)
        if (out / "meta.json").exists():
            return load_prepared(out)
        tokenizer = _tokenizer(source, build_tokenizer, out, val_fraction, split_seed, tokenizer_documents)
        shards = _write_shards(source, out, tokenizer, val_fraction, split_seed, shard_documents, workers, progress)
        meta = _meta(identity, tokenizer, out, shards)
        if meta["train_tokens"] <= meta["train_documents"]:
            raise UserError(f"data: the training split has no text ({meta['train_documents']} documents, all empty)")
        if meta["val_documents"] == 0:
            raise UserError(
                f"data: no document fell into the validation split ({meta['train_documents']} documents, "
                f"data.val_fraction={val_fraction}): raise data.val_fraction (and use a new data.dir)"
            )
        _atomic_write(out / "meta.json", json.dumps(meta, indent=2, default=str))
    return load_prepared(out)


def load_prepared(out: Path) -> PreparedData:
    if not (out / "meta.json").exists():
        raise UserError(
            f"data.dir={out} holds no finished preparation (no meta.json): run `xsa-lm prepare ... data.dir={out}` "
            "(again, with the same arguments, to finish an interrupted one)"
        )
    meta = json.loads((out / "meta.json").read_text())
    data = PreparedData(dir=out, tokenizer=Tokenizer.from_file(str(out / "tokenizer.json")), meta=meta)
    for split in ("train", "val"):  # a truncated or missing shard is found now, before a run starts
        data.shards(split)
    return data


def _check_identity(out: Path, identity: dict) -> None:
    recorded = out / "prepare.json"
    wanted = json.loads(json.dumps(identity, default=str))
    if not recorded.exists():
        if any(out.glob("*.bin")) or (out / "meta.json").exists():
            raise UserError(f"data.dir={out} holds files that xsa-lm did not prepare: choose another data.dir")
        _atomic_write(recorded, json.dumps(wanted, indent=2))
        return
    if json.loads(recorded.read_text()) != wanted:
        raise UserError(
            f"data.dir={out} was prepared from other inputs (source, tokenizer or split settings; see "
            f"{recorded}): choose another data.dir, or delete that one to prepare it again"
        )


def _tokenizer(source, build_tokenizer, out: Path, val_fraction: float, split_seed: int, n_docs: int) -> Tokenizer:
    path = out / "tokenizer.json"
    if path.exists():  # an interrupted preparation: its shards were written with this tokenizer
        return Tokenizer.from_file(str(path))
    train_texts = (text for is_val, text in _split_documents(source, val_fraction, split_seed) if not is_val)
    tokenizer = build_tokenizer(train_texts=islice(train_texts, n_docs))
    if tokenizer.token_to_id(EOT) is None:
        raise UserError(f"tokenizer: it has no {EOT} token to separate documents")
    tmp = out / "tokenizer.json.tmp"
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return tokenizer


def _split_documents(source, val_fraction: float, split_seed: int) -> Iterator[tuple[bool, str]]:
    """(is_val, text) for every document, in the source's order. A source may define its own split (is_val)."""
    is_val = getattr(source, "is_val", None) or (lambda key: is_val_document(key, val_fraction, split_seed))
    for key, text in source.documents():
        yield is_val(key), text


def _write_shards(source, out, tokenizer, val_fraction, split_seed, shard_documents, workers, progress) -> list:
    job = (str(out), str(out / "tokenizer.json"), tokenizer.token_to_id(EOT), token_dtype(tokenizer.get_vocab_size()))
    chunks = _batched(_split_documents(source, val_fraction, split_seed), shard_documents)
    shards: list[dict] = []
    bar = _Progress(progress, getattr(source, "count_documents", lambda: None)())
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else None
    pending: set[Future] = set()
    try:
        for index, chunk in enumerate(chunks):
            done_file = out / f"shard-{index:06d}.json"
            if done_file.exists():  # finished by an earlier run: never rewritten
                shards.append(json.loads(done_file.read_text()))
                bar.update(len(chunk), shards[-1]["train_tokens"] + shards[-1]["val_tokens"])
                continue
            args = (*job, index, [is_val for is_val, _ in chunk], [text for _, text in chunk])
            if pool is None:
                shards.append(_encode_shard(*args))
                bar.update(len(chunk), shards[-1]["train_tokens"] + shards[-1]["val_tokens"])
                continue
            pending.add(pool.submit(_encode_shard, *args))
            while len(pending) >= 2 * workers:  # bounded: at most two chunks per worker held in memory
                shards += _collect(pending, bar)
        while pending:
            shards += _collect(pending, bar)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
    if not shards:
        raise UserError("data: the corpus has no documents")
    return sorted(shards, key=lambda s: s["index"])


def _collect(pending: set[Future], bar: "_Progress") -> list[dict]:
    done, _ = wait(pending, return_when=FIRST_COMPLETED)
    pending -= done
    results = [future.result() for future in done]
    for shard in results:
        bar.update(shard["train_documents"] + shard["val_documents"], shard["train_tokens"] + shard["val_tokens"])
    return results


_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


def _encode_shard(out: str, tokenizer_path: str, eot: int, dtype: str, index: int, val: list[bool],
                  texts: list[str]) -> dict:  # fmt: skip
    """Tokenize one chunk into its train and val shard files (runs in a worker process)."""
    if tokenizer_path not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[tokenizer_path] = Tokenizer.from_file(tokenizer_path)
    encodings = _WORKER_TOKENIZERS[tokenizer_path].encode_batch(texts, add_special_tokens=False)
    shard: dict = {"index": index}
    for split in ("train", "val"):
        ids = [enc.ids for enc, is_val in zip(encodings, val, strict=True) if is_val == (split == "val")]
        tokens = np.empty(sum(len(doc) + 1 for doc in ids), dtype=dtype)
        end = 0
        for doc in ids:  # slice assignment converts each list in C; EOT after every document
            tokens[end : end + len(doc)] = doc
            tokens[end + len(doc)] = eot
            end += len(doc) + 1
        path = Path(out) / f"{split}-{index:06d}.bin"
        tmp = path.with_suffix(".bin.tmp")
        tokens.tofile(tmp)
        os.replace(tmp, path)
        shard[f"{split}_documents"], shard[f"{split}_tokens"] = len(ids), len(tokens)
    _atomic_write(Path(out) / f"shard-{index:06d}.json", json.dumps(shard))
    return shard


def _meta(identity: dict, tokenizer: Tokenizer, out: Path, shards: list[dict]) -> dict:
    tokenizer_bytes = (out / "tokenizer.json").read_bytes()
    totals = {f"{s}_{n}": sum(shard[f"{s}_{n}"] for shard in shards) for s in ("train", "val")
              for n in ("documents", "tokens")}  # fmt: skip
    return {
        "identity": identity,
        "tokenizer": {
            "sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
            "vocab_size": tokenizer.get_vocab_size(),
            "config": identity.get("tokenizer"),
        },  # fmt: skip
        "vocab_size": tokenizer.get_vocab_size(),
        "eot_id": tokenizer.token_to_id(EOT),
        "dtype": token_dtype(tokenizer.get_vocab_size()),
        **totals,
        "shards": shards,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _batched(items: Iterator, n: int) -> Iterator[list]:
    while batch := list(islice(items, n)):
        yield batch


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Progress:
    """Documents, tokens/s and (when the corpus size is known) ETA, on the terminal (rich)."""

    def __init__(self, enabled: bool, total_documents: int | None) -> None:
        self.bar = None
        self.t0, self.tokens = time.perf_counter(), 0
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"),
                                TextColumn("{task.fields[rate]}"), TimeRemainingColumn())  # fmt: skip
            self.task = self.bar.add_task("prepare", total=total_documents, rate="")
            self.bar.start()

    def update(self, documents: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.task, advance=documents, rate=f"{self.tokens:,} tokens, {rate:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
