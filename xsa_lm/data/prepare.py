"""Corpus + tokenizer -> token files on disk, cached by content so every run reuses them.

Layout of a prepared directory: tokenizer.json, train.bin, val.bin (flat token arrays, EOT after each
document) and meta.json, which is written last and marks the directory complete.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from xsa_lm.data.tokenizer import EOT
from xsa_lm.errors import UserError

ENCODE_BATCH_DOCS = 64  # encode_batch parallelises across documents; one huge string would be slow


@dataclass
class PreparedData:
    dir: Path
    tokenizer: Tokenizer
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.memmap:
        return np.memmap(self.dir / f"{split}.bin", dtype=self.dtype, mode="r")


def prepare(
    source,
    build_tokenizer: Callable[..., Tokenizer],
    cache_dir: str,
    key_material: dict,
) -> PreparedData:
    """Tokenize `source` into `cache_dir/<name>-<hash>/`, or reuse what an earlier run prepared."""
    identity = {"source": source.identity(), **key_material}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    out = Path(cache_dir).expanduser() / f"{source.name}-{digest}"
    if (out / "meta.json").exists():
        return _load(out)

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private temporary directory and rename it into place: concurrent runs (a sweep) never
    # see half-written files, and an interrupted preparation leaves nothing that looks finished.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tokenizer = build_tokenizer(train_texts=source.documents("train"))
        eot = tokenizer.token_to_id(EOT)
        dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
        counts = {split: _encode_to_file(tokenizer, source.documents(split), eot, dtype, tmp / f"{split}.bin")
                  for split in ("train", "val")}  # fmt: skip
        for split, (n_docs, n_tokens) in counts.items():
            if n_tokens <= n_docs:  # only EOT separators: every document was empty
                raise UserError(f"data.source: the {split} split has no text ({n_docs} documents, all empty)")
        tokenizer.save(str(tmp / "tokenizer.json"))
        meta = {
            "identity": identity,
            "vocab_size": tokenizer.get_vocab_size(),
            "eot_id": eot,
            "dtype": np.dtype(dtype).name,
            **{f"{split}_documents": c[0] for split, c in counts.items()},
            **{f"{split}_tokens": c[1] for split, c in counts.items()},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished the same preparation first: use theirs
            if not (out / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load(out)


def _encode_to_file(tokenizer: Tokenizer, docs: Iterator[str], eot: int, dtype, path: Path) -> tuple[int, int]:
    n_docs = n_tokens = 0
    with open(path, "wb") as f:
        for batch in _batched(docs, ENCODE_BATCH_DOCS):
            for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                ids = np.array(enc.ids + [eot], dtype=dtype)
                f.write(ids.tobytes())
                n_docs, n_tokens = n_docs + 1, n_tokens + len(ids)
    if n_docs == 0:
        raise UserError(f"data.source: the {path.stem} split has no documents")
    return n_docs, n_tokens


def _batched(items: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _load(out: Path) -> PreparedData:
    meta = json.loads((out / "meta.json").read_text())
    return PreparedData(dir=out, tokenizer=Tokenizer.from_file(str(out / "tokenizer.json")), meta=meta)
