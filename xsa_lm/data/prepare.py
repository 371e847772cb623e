"""Corpus + tokenizer -> token shards, in bounded memory, resumable by shard. Written into <out>.partial, renamed to
<out> when whole: prepare.json (the inputs: a rerun must match them), tokenizer.json, per `shard_documents` documents
train-NNNNNN.bin, val-NNNNNN.bin (tokens, EOT after each document) and shard-NNNNNN.json (last: a shard without it
is redone), then meta.json."""

import hashlib
import json
import math
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from itertools import chain, islice
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from xsa_lm.config.command_line import pasteable
from xsa_lm.data.sources import once
from xsa_lm.data.tokenizer import eot_id, file_sha256, read_tokenizer
from xsa_lm.errors import UserError, WriteError
from xsa_lm.files import atomic_file, undo_new_folders, write_json, write_text
from xsa_lm.locking import hold_directory

DOCUMENT_VAL_FRACTION = 0.0005  # the paper's 0.05% of the documents
TAIL_VAL_FRACTION = 0.1  # nanoGPT's 90/10 cut of input.txt
MIN_VAL_DOCUMENTS = 10  # the document split's expected validation documents: fewer would be a noisy, or empty, set


@dataclass(frozen=True)
class PreparedData:
    dir: Path
    tokenizer: Tokenizer
    meta: dict[str, Any]  # meta.json: identity, tokenizer (sha256, config), dtype, split, the counts, shards

    @property
    def tokenizer_sha256(self) -> str:  # the identity of the shards' tokenizer (checkpoints record it)
        return self.meta["tokenizer"]["sha256"]

    def shards(self, split: str) -> list[np.memmap]:
        """The split's non-empty shards, memory-mapped; a shard whose size disagrees with meta.json is an error."""
        arrays: list[np.memmap] = []
        dtype = np.dtype(self.meta["dtype"])
        for shard in (s for s in self.meta["shards"] if s[f"{split}_tokens"]):
            path = self.dir / f"{split}-{shard['index']:06d}.bin"
            expected = shard[f"{split}_tokens"] * dtype.itemsize
            if not path.exists():
                raise _damaged(path, f"is missing (expected {expected} bytes)")
            if (size := path.stat().st_size) != expected:
                raise _damaged(path, f"is truncated or corrupt ({size} bytes, expected {expected})")
            arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        return arrays


def is_val_document(key: str, val_fraction: float, split_seed: int) -> bool:
    """The document split: a seeded hash of the key, stable under re-preparation, order and worker count."""
    return int.from_bytes(hashlib.sha256(f"{split_seed}:{key}".encode()).digest()[:8], "big") / 2**64 < val_fraction


def tail_start(text: str, val_fraction: float) -> int:
    """Where the tail split's held-out end begins: at the next line start within 200 characters, so no word is cut."""
    cut = len(text) - round(len(text) * val_fraction)
    newline = text.find("\n", cut, cut + 200)
    return newline + 1 if newline >= 0 else cut


def choose_split(source: Any, split: str = "auto", val_fraction: float | None = None) -> tuple[str, float, str | None]:
    """The split, its fraction (None: the split's default) and a note when `auto` took `tail` over `document`."""
    note = None
    if split == "auto":
        needed = math.ceil(MIN_VAL_DOCUMENTS / (fraction := val_fraction or DOCUMENT_VAL_FRACTION))
        # None: a source with its own split (the plays) or an uncounted one (a hub dataset: large) keeps documents.
        count = None if hasattr(source, "is_val") else source.count_documents(needed)
        split = "tail" if count is not None and count < needed else "document"
        if split == "tail":
            note = (
                f"data: {'1 document is' if count == 1 else f'{count:,} documents are'} too few for a document-level "
                f"split ({MIN_VAL_DOCUMENTS} validation documents at {100 * fraction:g}% need {needed:,}); holding out "
                f"the last {100 * (val_fraction or TAIL_VAL_FRACTION):g}% of each document for validation "
                "(data.val_split=tail)"
            )
    return split, val_fraction or (TAIL_VAL_FRACTION if split == "tail" else DOCUMENT_VAL_FRACTION), note


def prepare(
    source: Any,
    build_tokenizer: Callable[..., Tokenizer],
    out: Path,
    identity: Mapping[str, object],
    val_fraction: float = DOCUMENT_VAL_FRACTION,
    split: str = "document",
    split_seed: int = 0,
    shard_documents: int = 10_000,
    workers: int = 1,
    tokenizer_documents: int = 100_000,
    progress: bool = False,
) -> PreparedData:
    """Tokenize `source` into shards in `out` (split: document or tail), resuming an interrupted preparation."""
    # What decides the shards besides the source and the tokenizer: prepare.json records it.
    identity = {**identity, "split": split, "val_fraction": val_fraction, "split_seed": split_seed}
    identity["shard_documents"] = shard_documents
    pieces = partial(_split_documents, source, split, val_fraction, split_seed)
    with _preparing(out, identity) as work:
        if work is not None:  # None: finished, by an earlier command or by another process meanwhile
            if (work / "tokenizer.json").exists():  # an interrupted preparation: its shards were made with it
                tokenizer = read_tokenizer(work / "tokenizer.json", "data")
            else:
                train_texts = (train for train, _ in pieces() if train is not None)  # never the validation text
                tokenizer = build_tokenizer(train_texts=islice(train_texts, tokenizer_documents))
                eot_id(tokenizer)  # refuses a tokenizer without EOT
                write_text(work / "tokenizer.json", tokenizer.to_str(pretty=True))
            vocab_size, eot = tokenizer.get_vocab_size(), eot_id(tokenizer)
            dtype = "uint16" if vocab_size <= 2**16 else "uint32"
            documents, total = pieces(), source.count_documents() if progress else None  # the progress bar's total
            chunks = iter(lambda: list(islice(documents, shard_documents)), [])  # until an empty one
            encode = partial(_encode_shard, str(work), eot, dtype)
            shards = _write_shards(chunks, work, encode, workers, progress, total)
            meta: dict[str, Any] = {key: sum(shard[key] for shard in shards) for key in shards[0] if key != "index"}
            sha256 = file_sha256(work / "tokenizer.json", "data")
            meta["tokenizer"] = {"sha256": sha256, "vocab_size": vocab_size, "config": identity.get("tokenizer")}
            meta |= {"vocab_size": vocab_size, "eot_id": eot, "dtype": dtype, "identity": identity, "split": split}
            meta |= {"shards": shards, "created": time.strftime("%F %T")}
            _check_split(meta, split, val_fraction)
            write_text(work / "meta.json", json.dumps(meta, indent=2, default=str))
    return load_prepared(out)


def _check_out(out: Path, wanted: Any) -> None:
    """`out` is new, empty, or a preparation of the same inputs (checked before anything is written)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"data.dir={out} is a file, not a folder: choose a folder for the shards")
    if (out / "prepare.json").exists():
        if _read_json(out / "prepare.json", "delete its folder to prepare it again") != wanted:
            raise UserError(
                f"data.dir={out} was prepared from other inputs (source, tokenizer or split settings; see "
                f"{out / 'prepare.json'}): choose another data.dir, or delete that one to prepare it again"
            )
    elif out.is_dir() and (held := sorted(p.name for p in out.iterdir())):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(
            f"data.dir={out} is not empty and holds no preparation of xsa-lm (no prepare.json; it holds {shown}): "
            "choose a new or empty data.dir"
        )


@contextmanager
def _preparing(out: Path, identity: dict[str, Any]) -> Iterator[Path | None]:
    """A folder beside `out`, <out>.partial, locked, that becomes `out` when the block ends (None: `out` is finished).
    A refusal removes it and the folders made for it; an interrupt or a failed write keeps it: the same command
    resumes from its finished shards."""
    wanted = json.loads(json.dumps(identity, default=str))
    _check_out(out, wanted)
    if (out / "meta.json").exists():
        yield None
        return
    work = out.with_name(f"{out.name}.partial")
    # A second process waits for the lock, then finds `out` finished and reuses it.
    with undo_new_folders(out.parent), hold_directory(out.parent, f"{out.name}.lock", "prepare", "data.dir", wait=True):
        _check_out(out, wanted)
        if (out / "meta.json").exists():
            yield None
            return
        if (work / "prepare.json").exists() and _read_json(work / "prepare.json", f"delete {work}") != wanted:
            once(f"data: {work} was an unfinished preparation of other inputs: starting again")
            shutil.rmtree(work)
        if (out / "prepare.json").exists() and not work.exists():  # unfinished in place: a damaged shard deleted
            out.rename(work)
        work.mkdir(exist_ok=True)
        write_json(work / "prepare.json", wanted)
        try:
            yield work
        except WriteError:  # a full disk: the shards written so far resume
            raise
        except UserError:  # refused inputs: the same command would be refused again
            shutil.rmtree(work)
            raise
        work.rename(out)  # `out` as a whole, or not at all (an empty `out` is replaced)


def _check_split(meta: dict[str, Any], split: str, val_fraction: float) -> None:
    """Both splits need text (the token counts include one EOT per document or piece)."""
    n = f"{meta['train_documents'] + meta['val_documents']} documents, data.val_fraction={val_fraction}"
    tail = "hold out the end of each document with data.val_split=tail"
    if meta["train_tokens"] <= meta["train_documents"]:
        why = f"every document with text fell into the validation split ({n}): lower data.val_fraction, or {tail}"
    elif meta["val_documents"] > 0:
        return
    elif split == "document":
        why = f"no document fell into the validation split ({n}): raise data.val_fraction, or {tail}"
    else:
        why = f"the documents are too short to hold out {100 * val_fraction:g}% of each: raise data.val_fraction"
    raise UserError(f"data: {why}")


def load_prepared(out: Path) -> PreparedData:
    if (work := out.with_name(f"{out.name}.partial")).is_dir() and not (out / "meta.json").exists():
        raise UserError(
            f"data.dir={out} is not finished (an interrupted preparation is in {work}): run the same "
            f"`xsa-lm prepare ... {pasteable('data.dir', out)}` again to finish it"
        )
    if not out.exists():
        where = "" if out.is_absolute() else f" (in {Path.cwd()})"
        raise UserError(
            f"data.dir={out} does not exist{where}: restore it, or run "
            f"`xsa-lm prepare ... {pasteable('data.dir', out)}`"
        )
    if not (out / "meta.json").exists():
        raise UserError(
            f"data.dir={out} holds no finished preparation (no meta.json): run `xsa-lm prepare ... "
            f"{pasteable('data.dir', out)}`"
        )
    meta = _read_json(out / "meta.json", "delete it and run the same `xsa-lm prepare` command (shards are kept)")
    if not isinstance(meta, dict) or not {"shards", "dtype", "vocab_size", "tokenizer"} <= meta.keys():
        raise UserError(f"data: {out / 'meta.json'} is not the meta.json of `xsa-lm prepare`: prepare the data again")
    if file_sha256(out / "tokenizer.json", "data") != meta["tokenizer"]["sha256"]:
        raise UserError(
            f"data: {out / 'tokenizer.json'} is not the tokenizer the shards were made with (its sha256 differs from "
            "meta.json's): restore it, or prepare the data again in a new folder"
        )
    data = PreparedData(dir=out, tokenizer=read_tokenizer(out / "tokenizer.json", "data"), meta=meta)
    # A truncated, missing or overwritten shard is found now, before a run starts, not steps later in the embedding.
    for tokens in data.shards("train") + data.shards("val"):
        if (largest := int(tokens.max())) >= (vocab_size := meta["vocab_size"]):
            what = f"holds token id {largest}, outside the vocabulary of {vocab_size} (overwritten?)"
            raise _damaged(out / Path(str(tokens.filename)).name, what)
    return data


def _damaged(shard: Path, what: str) -> UserError:
    return UserError(
        f"data: shard {shard} {what}: delete it, its shard-{shard.stem.split('-')[-1]}.json and meta.json, then run "
        "the same `xsa-lm prepare` command to rebuild it"
    )


def _read_json(path: Path, fix: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"data: {path} is not valid JSON ({e}; truncated or overwritten?): {fix}") from None


def _split_documents(source: Any, split: str, val_fraction: float, split_seed: int) -> Iterator[tuple]:
    """(train text, val text) of every document in order (None: no part)."""
    is_val = getattr(source, "is_val", None) or (lambda key: is_val_document(key, val_fraction, split_seed))
    for key, text in source.documents():
        if split == "tail":
            cut = tail_start(text, val_fraction)
            yield text[:cut] or None, text[cut:] or None
        else:
            yield (None, text) if is_val(key) else (text, None)


def _write_shards(
    chunks: Iterator[list[tuple]], out: Path, encode: Callable, workers: int, progress: bool, total: int | None
) -> list[dict[str, int]]:
    """The shards' counts, by index; with `progress`, a bar of documents, tokens/s and ETA."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    # One worker: a thread, so that reading the corpus and tokenizing overlap; more: processes.
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else ThreadPoolExecutor(1)
    pending: deque[tuple[int, Future]] = deque()  # chunks being tokenized (their number of documents), in order
    shards: list[dict[str, int]] = []
    has_text, start = False, time.perf_counter()  # has_text: more than whitespace in some document
    columns = ("prepare", BarColumn(), MofNCompleteColumn(), "documents {task.fields[rate]}", TimeRemainingColumn())
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("prepare", total=total, rate="")

        def finished(documents: int, shard: dict[str, int] | Future) -> None:
            shards.append(shard if isinstance(shard, dict) else shard.result())
            tokens = sum(s["train_tokens"] + s["val_tokens"] for s in shards)
            rate = f"{tokens:,} tokens, {tokens / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s"
            bar.update(task, advance=documents, rate=rate)

        try:
            for index, chunk in enumerate(chunks):
                has_text = has_text or any(text and not text.isspace() for pair in chunk for text in pair)
                if (done := out / f"shard-{index:06d}.json").exists():  # finished by an earlier run: never rewritten
                    finished(len(chunk), _read_json(done, "delete it to tokenize that shard again"))
                    continue
                pending.append((len(chunk), pool.submit(encode, index, chunk)))
                if len(pending) == 2 * workers:  # bounded: at most two chunks per worker held in memory
                    finished(*pending.popleft())
            for documents, future in pending:
                finished(documents, future)
        finally:
            pool.shutdown(cancel_futures=True)
    if not shards:
        raise UserError("data: the corpus has no documents")
    if not has_text:
        raise UserError("data: the corpus has no text: every document is empty or whitespace only")
    return sorted(shards, key=lambda s: s["index"])


_worker_tokenizer = cache(Tokenizer.from_file)  # once per worker process


def _encode_shard(out: str, eot: int, dtype: str, index: int, chunk: list[tuple]) -> dict[str, int]:
    shard, tokenizer = {"index": index}, _worker_tokenizer(f"{out}/tokenizer.json")
    for i, split in enumerate(("train", "val")):
        texts = [pair[i] for pair in chunk if pair[i] is not None]
        ids = [e.ids + [eot] for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        tokens = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids)))
        with atomic_file(Path(out) / f"{split}-{index:06d}.bin", "wb") as f:
            tokens.tofile(f)
        shard[f"{split}_documents"], shard[f"{split}_tokens"] = len(ids), len(tokens)
    write_text(Path(out) / f"shard-{index:06d}.json", json.dumps(shard))
    return shard
