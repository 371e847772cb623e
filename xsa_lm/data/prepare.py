"""Corpus + tokenizer -> token shards on disk, in bounded memory, resumable at shard granularity.

A prepared directory holds:
  prepare.json            what is being prepared (source, tokenizer, split): a rerun must match it
  tokenizer.json          the tokenizer (trained BPE, GPT-2's, or a given file)
  train-000000.bin ...    flat token arrays (uint16 when the vocabulary fits, else uint32), EOT after each document
  val-000000.bin ...      the validation documents (or document tails) of the same chunk of the corpus
  shard-000000.json ...   written last per shard: its document and token counts (a shard without it is redone)
  meta.json               written last: every shard's counts, totals, tokenizer identity and hash
The corpus is read as a stream and cut into chunks of `shard_documents` documents; a chunk is one shard. Chunks are
tokenized in parallel worker processes, at most two per worker in flight, so memory stays bounded.

Two validation splits: `document` holds out whole documents (a seeded hash of each key below val_fraction), `tail`
holds out the end of every document (its last val_fraction of text), for a corpus of a few documents such as one
.txt file. `auto` (choose_split) takes the document split when it can expect MIN_VAL_DOCUMENTS validation documents.
"""

import fcntl
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import islice
from multiprocessing import get_context
from pathlib import Path
from typing import Any, cast

import numpy as np
from tokenizers import Tokenizer

from xsa_lm.data.tokenizer import EOT, eot_id, file_sha256, read_tokenizer
from xsa_lm.errors import UserError
from xsa_lm.files import atomic_file, write_json, write_text

LOCK = ".prepare.lock"  # held while preparing: a second process waits, then reuses the result
ShardCounts = dict[str, int]  # a shard's index, and each split's documents and tokens (shard-NNNNNN.json)


# How the documents are split: val_fraction, split_seed, shard_documents, and split (tail; absent for the document
# split). Part of a preparation's identity, whose hash names its folder.
SplitSettings = dict[str, Any]
# meta.json as prepare() writes it: identity, tokenizer (its sha256, vocab_size, config), vocab_size, eot_id, dtype,
# split (document: whole documents held out; tail: the end of each document), train_documents, train_tokens,
# val_documents, val_tokens, shards (ShardCounts each), created.
PreparedMeta = dict[str, Any]


@dataclass
class PreparedData:
    dir: Path
    tokenizer: Tokenizer
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def tokenizer_sha256(self) -> str:
        """The identity of the tokenizer the shards were made with (checkpoints record it)."""
        return self.meta["tokenizer"]["sha256"]

    def shards(self, split: str) -> list[np.memmap]:
        """The split's non-empty shards, memory-mapped; a shard whose size disagrees with meta.json is an error."""
        arrays: list[np.memmap] = []
        for shard in self.meta["shards"]:
            n_tokens = shard[f"{split}_tokens"]
            if n_tokens == 0:
                continue
            path = self.dir / f"{split}-{shard['index']:06d}.bin"
            expected = n_tokens * self.dtype.itemsize
            if not path.exists():
                raise _damaged(path, f"is missing (expected {expected} bytes)")
            if (size := path.stat().st_size) != expected:
                raise _damaged(path, f"is truncated or corrupt ({size} bytes, expected {expected})")
            arrays.append(np.memmap(path, dtype=self.dtype, mode="r"))
        return arrays


SPLITS = ("auto", "document", "tail")
DOCUMENT_VAL_FRACTION = 0.0005  # the paper's 0.05% of the documents
TAIL_VAL_FRACTION = 0.1  # nanoGPT's 90/10 cut of input.txt
MIN_VAL_DOCUMENTS = 10  # the document split's expected validation documents: fewer would be a noisy, or empty, set


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def is_val_document(key: str, val_fraction: float, split_seed: int) -> bool:
    """A document's split from its key alone: stable under re-preparation, order and worker count."""
    digest = hashlib.sha256(f"{split_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def tail_start(text: str, val_fraction: float) -> int:
    """Where a document's held-out tail begins: its last val_fraction of characters, moved on to the next line start
    when one is near (200 characters), so that no word is cut in two."""
    cut = len(text) - round(len(text) * val_fraction)
    newline = text.find("\n", cut, cut + 200)
    return newline + 1 if newline >= 0 else cut


def choose_split(source, split: str = "auto", val_fraction: float | None = None) -> tuple[str, float, str | None]:
    """The split (document or tail) and its fraction for `source`, and a line for the user when `auto` chose the
    tail split. auto: the document split when documents x val_fraction >= MIN_VAL_DOCUMENTS (20,000 documents at
    the default 0.0005), else the tail split. An unset val_fraction is DOCUMENT_VAL_FRACTION of the documents, or
    TAIL_VAL_FRACTION of each document's text."""
    chosen, note = split, None
    if split == "auto":
        document_fraction = val_fraction or DOCUMENT_VAL_FRACTION
        needed = math.ceil(MIN_VAL_DOCUMENTS / document_fraction)
        # None: a source with its own split (Shakespeare's plays) or one that cannot count its documents (a hub
        # dataset: large); both keep the document split.
        count = None if hasattr(source, "is_val") else getattr(source, "count_documents", lambda stop_at: None)(needed)
        chosen = "tail" if count is not None and count < needed else "document"
        if chosen == "tail":
            documents = "1 document is" if count == 1 else f"{count:,} documents are"
            held_out = val_fraction or TAIL_VAL_FRACTION
            note = (
                f"data: {documents} too few for a document-level split ({MIN_VAL_DOCUMENTS} validation documents "
                f"at {100 * document_fraction:g}% need {needed:,}); holding out the last {100 * held_out:g}% of "
                "each document for validation (data.val_split=tail)"
            )
    if val_fraction is None:
        val_fraction = TAIL_VAL_FRACTION if chosen == "tail" else DOCUMENT_VAL_FRACTION
    return chosen, val_fraction, note


def split_settings(split: str, val_fraction: float, split_seed: int, shard_documents: int) -> SplitSettings:
    """The settings that decide the shards besides the source and the tokenizer (prepare.json and the cache
    name). The document split is implicit: directories prepared before there was a tail split are reused."""
    settings: SplitSettings = {
        "val_fraction": val_fraction,
        "split_seed": split_seed,
        "shard_documents": shard_documents,
    }
    return settings if split == "document" else {**settings, "split": split}


def cache_path(cache_dir: str, source_name: str, identity: Mapping[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / f"{source_name}-{digest}"


def prepare(
    source,
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
    """Tokenize `source` into shards in `out`, resuming an interrupted preparation, or load a finished one.
    `split` is document or tail, and val_fraction as choose_split checked and resolved them."""
    identity = {**identity, **split_settings(split, val_fraction, split_seed, shard_documents)}
    pieces = partial(_split_documents, source, split=split, val_fraction=val_fraction, split_seed=split_seed)
    made = not out.exists()
    held = _open_folder(out)
    with open(out / LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process (a parallel sweep trial) waits, then reuses the result
        try:
            _check_identity(out, identity)
            if (out / "meta.json").exists():
                return load_prepared(out)
            tokenizer = _tokenizer(pieces, build_tokenizer, out, tokenizer_documents)
            shards, has_text = _write_shards(
                pieces(),
                out,
                tokenizer,
                shard_documents=shard_documents,
                workers=workers,
                progress=progress,
                total_documents=getattr(source, "count_documents", lambda: None)(),
            )
            if not has_text:
                raise UserError("data: the corpus has no text: every document is empty or whitespace only")
            meta = _meta(identity, tokenizer, out, shards=shards, split=split)
            _check_split(meta, split, val_fraction)
            write_text(out / "meta.json", json.dumps(meta, indent=2, default=str))
        except UserError:
            _remove_unstarted(out, held, made)
            raise
    return load_prepared(out)


def _open_folder(out: Path) -> set[str]:
    """Make the folder, refusing a file or a folder of other files than a preparation (the shards would mix with
    them): the names it held before."""
    if out.exists() and not out.is_dir():
        raise UserError(f"data.dir={out} is a file, not a folder: choose a folder for the shards")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.dir={out} cannot be created ({e.strerror or e}): choose another") from None
    held = {p.name for p in out.iterdir()}
    others = sorted(held - {LOCK}) if "prepare.json" not in held else []
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(
            f"data.dir={out} is not empty and holds no preparation of xsa-lm (no prepare.json; it holds {shown}): "
            "choose a new or empty data.dir"
        )
    return held


def _remove_unstarted(out: Path, held: set[str], made: bool) -> None:
    """A refused preparation that wrote no shard leaves nothing behind (its prepare.json would refuse the corrected
    command as other inputs): the files this call wrote go, and the folder if it made it. Shards stay: they resume."""
    if any(out.glob("*.bin")):
        return
    for path in out.iterdir():
        if path.name not in held and path.is_file():
            path.unlink()
    if made and not any(out.iterdir()):
        out.rmdir()


def _check_split(meta: PreparedMeta, split: str, val_fraction: float) -> None:
    """Both splits need text (the token counts include one EOT per document or piece); the corpus has some."""
    n = meta["train_documents"] + meta["val_documents"]
    if meta["train_tokens"] <= meta["train_documents"]:
        raise UserError(
            f"data: every document with text fell into the validation split ({n} documents, "
            f"data.val_fraction={val_fraction}): lower data.val_fraction, or hold out the end of each document "
            "with data.val_split=tail"
        )
    if meta["val_documents"] == 0 and split == "document":
        raise UserError(
            f"data: no document fell into the validation split ({n} documents, data.val_fraction={val_fraction}): "
            "raise data.val_fraction, or hold out the end of each document with data.val_split=tail"
        )
    if meta["val_documents"] == 0:
        raise UserError(
            f"data: the documents are too short to hold out {100 * val_fraction:g}% of each: raise data.val_fraction"
        )


def load_prepared(out: Path) -> PreparedData:
    if not out.exists():
        where = "" if out.is_absolute() else f" (in {Path.cwd()})"
        raise UserError(f"data.dir={out} does not exist{where}: restore it, or run `xsa-lm prepare ... data.dir={out}`")
    if not (out / "meta.json").exists():
        raise UserError(
            f"data.dir={out} holds no finished preparation (no meta.json): run `xsa-lm prepare ... data.dir={out}` "
            "(again, with the same arguments, to finish an interrupted one)"
        )
    meta = _read_json(out / "meta.json", "delete it and run the same `xsa-lm prepare` command (shards are kept)")
    if not isinstance(meta, dict) or not {"shards", "dtype", "vocab_size", "tokenizer"} <= meta.keys():
        raise UserError(f"data: {out / 'meta.json'} is not the meta.json of `xsa-lm prepare`: prepare the data again")
    recorded = meta["tokenizer"].get("sha256")
    if recorded and file_sha256(out / "tokenizer.json", "data") != recorded:
        raise UserError(
            f"data: {out / 'tokenizer.json'} is not the tokenizer the shards were made with (its sha256 differs from "
            "meta.json's): restore it, or prepare the data again in a new folder"
        )
    data = PreparedData(dir=out, tokenizer=read_tokenizer(out / "tokenizer.json", "data"), meta=meta)
    # A truncated, missing or overwritten shard is found now, before a run starts: every token id inside the
    # vocabulary (one pass over each file, a max over the memory map), not an error steps later in the embedding.
    vocab_size = meta["vocab_size"]
    for tokens in data.shards("train") + data.shards("val"):
        if (largest := int(tokens.max())) >= vocab_size:
            raise _damaged(
                out / Path(str(tokens.filename)).name,
                f"holds token id {largest}, outside the vocabulary of {vocab_size} (overwritten?)",
            )
    return data


def _damaged(shard: Path, what: str) -> UserError:
    """The one line for a shard file of a prepared directory that is not as prepare() wrote it."""
    index = shard.stem.split("-")[-1]
    return UserError(
        f"data: shard {shard} {what}: delete it, its shard-{index}.json and meta.json, then run the same "
        "`xsa-lm prepare` command to rebuild it"
    )


def _read_json(path: Path, fix: str) -> object:
    """A JSON file of a prepared directory, or one line naming it and `fix` when it is truncated or overwritten."""
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"data: {path} is not valid JSON ({e}; truncated or overwritten?): {fix}") from None


def _check_identity(out: Path, identity: dict) -> None:
    recorded = out / "prepare.json"
    wanted = json.loads(json.dumps(identity, default=str))
    if not recorded.exists():
        if any(out.glob("*.bin")) or (out / "meta.json").exists():
            raise UserError(f"data.dir={out} holds files that xsa-lm did not prepare: choose another data.dir")
        write_json(recorded, wanted)
        return
    if _read_json(recorded, "delete its folder to prepare it again") != wanted:
        raise UserError(
            f"data.dir={out} was prepared from other inputs (source, tokenizer or split settings; see "
            f"{recorded}): choose another data.dir, or delete that one to prepare it again"
        )


def _tokenizer(pieces: Callable[[], Iterator[tuple]], build_tokenizer, out: Path, n_docs: int) -> Tokenizer:
    path = out / "tokenizer.json"
    if path.exists():  # an interrupted preparation: its shards were written with this tokenizer
        return read_tokenizer(path, "data")
    train_texts = (train for train, _ in pieces() if train is not None)  # never the validation text
    tokenizer = build_tokenizer(train_texts=islice(train_texts, n_docs))
    eot_id(tokenizer)  # refuses a tokenizer without EOT
    write_text(path, tokenizer.to_str(pretty=True))
    return tokenizer


def _split_documents(source, *, split: str, val_fraction: float, split_seed: int) -> Iterator[tuple]:
    """(train text, val text) for every document, in the source's order; None where a document has no part in
    a split. A source may define its own document split (is_val)."""
    if split == "tail":
        for _, text in source.documents():
            cut = tail_start(text, val_fraction)
            yield text[:cut] or None, text[cut:] or None
        return
    is_val = getattr(source, "is_val", None) or (lambda key: is_val_document(key, val_fraction, split_seed))
    for key, text in source.documents():
        yield (None, text) if is_val(key) else (text, None)


def _write_shards(
    pieces: Iterator[tuple],
    out: Path,
    tokenizer: Tokenizer,
    *,
    shard_documents: int,
    workers: int,
    progress: bool,
    total_documents: int | None,
) -> tuple[list[ShardCounts], bool]:
    """The shards' counts, sorted, and whether any document has text (more than whitespace)."""
    job = (str(out), eot_id(tokenizer), token_dtype(tokenizer.get_vocab_size()))
    shards: list[ShardCounts] = []
    has_text = False
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else None
    pending: dict[Future, int] = {}  # a chunk being tokenized -> its number of documents
    with _progress_bar(progress, total_documents) as finished:

        def collect(until: int) -> None:
            while len(pending) > until:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                shards.extend(finished(pending.pop(future), future.result()) for future in done)

        try:
            chunks = iter(lambda: list(islice(pieces, shard_documents)), [])  # until an empty chunk
            for index, chunk in enumerate(chunks):
                has_text = has_text or any(text and not text.isspace() for pair in chunk for text in pair)
                done_file = out / f"shard-{index:06d}.json"
                args = (*job, index, [train for train, _ in chunk], [val for _, val in chunk])
                if done_file.exists():  # finished by an earlier run: never rewritten
                    shard = cast(ShardCounts, _read_json(done_file, "delete it to tokenize that shard again"))
                elif pool is None:
                    shard = _encode_shard(*args)
                else:
                    pending[pool.submit(_encode_shard, *args)] = len(chunk)
                    collect(until=2 * workers - 1)  # bounded: at most two chunks per worker held in memory
                    continue
                shards.append(finished(len(chunk), shard))
            collect(until=0)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    if not shards:
        raise UserError("data: the corpus has no documents")
    return sorted(shards, key=lambda s: s["index"]), has_text


_WORKER_TOKENIZERS: dict[str, Tokenizer] = {}


def _encode_shard(
    out: str, eot: int, dtype: str, index: int, train: list[str | None], val: list[str | None]
) -> ShardCounts:
    """Tokenize one chunk into its train and val shard files (runs in a worker process)."""
    if out not in _WORKER_TOKENIZERS:
        _WORKER_TOKENIZERS[out] = Tokenizer.from_file(str(Path(out) / "tokenizer.json"))
    tokenizer = _WORKER_TOKENIZERS[out]
    shard = {"index": index}  # and each split's documents and tokens
    for split, texts in (("train", train), ("val", val)):
        encodings = tokenizer.encode_batch([text for text in texts if text is not None], add_special_tokens=False)
        ids = [enc.ids for enc in encodings]
        tokens = np.empty(sum(len(doc) + 1 for doc in ids), dtype=dtype)
        end = 0
        for doc in ids:  # slice assignment converts each list in C; EOT after every document
            tokens[end : end + len(doc)] = doc
            tokens[end + len(doc)] = eot
            end += len(doc) + 1
        with atomic_file(Path(out) / f"{split}-{index:06d}.bin", "wb") as f:
            tokens.tofile(f)
        shard[f"{split}_documents"], shard[f"{split}_tokens"] = len(ids), len(tokens)
    write_text(Path(out) / f"shard-{index:06d}.json", json.dumps(shard))
    return shard


def _meta(identity: dict, tokenizer: Tokenizer, out: Path, *, shards: list[ShardCounts], split: str) -> PreparedMeta:
    tokenizer_bytes = (out / "tokenizer.json").read_bytes()
    return {
        "identity": identity,
        "tokenizer": {
            "sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
            "vocab_size": tokenizer.get_vocab_size(),
            "config": identity.get("tokenizer"),
        },
        "vocab_size": tokenizer.get_vocab_size(),
        "eot_id": tokenizer.token_to_id(EOT),
        "dtype": token_dtype(tokenizer.get_vocab_size()),
        "split": split,
        "train_documents": sum(shard["train_documents"] for shard in shards),
        "train_tokens": sum(shard["train_tokens"] for shard in shards),
        "val_documents": sum(shard["val_documents"] for shard in shards),
        "val_tokens": sum(shard["val_tokens"] for shard in shards),
        "shards": shards,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


@contextmanager
def _progress_bar(enabled: bool, total_documents: int | None) -> Iterator[Callable[[int, ShardCounts], ShardCounts]]:
    """Documents, tokens/s and (when the corpus size is known) ETA, on the terminal (rich): yields the function
    that counts a finished shard of that many documents (and returns the shard)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("prepare"), BarColumn(), MofNCompleteColumn(), TextColumn("documents")]
    t0, tokens = time.perf_counter(), 0
    with Progress(*columns, TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), disable=not enabled) as bar:
        task = bar.add_task("prepare", total=total_documents, rate="")

        def finished(documents: int, shard: ShardCounts) -> ShardCounts:
            nonlocal tokens
            tokens += shard["train_tokens"] + shard["val_tokens"]
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(task, advance=documents, rate=f"{tokens:,} tokens, {rate:,.0f} tokens/s")
            return shard

        yield finished
