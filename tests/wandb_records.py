"""Read a W&B offline run file (``wandb/offline-run-*/run-<id>.wandb``): wandb 0.31 ships no Python reader for it.
A LevelDB log behind a 7-byte header (``b":W&B"``, uint16 0xBEE1, uint8 version 0): 32 KiB blocks of chunks (crc32 of
the type byte then the data, uint16 length, uint8 type: 1 full, 2/3/4 first/middle/last; under 7 bytes are padding),
each record a ``wandb_internal_pb2.Record`` (keys in ``nested_key``, values as JSON text)."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import wandb
from wandb.proto.wandb_internal_pb2 import ConfigItem, HistoryItem, Record

BLOCK_LEN = 32768
CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, LAST = 1, 2, 4


def waited(what: str, found: Any, timeout_s: float = 30.0) -> Any:
    """found() once it is truthy. W&B's service writes a run's file on its own, perhaps after ``run.finish()`` and
    ``wandb.teardown()`` have returned (once in CI, a file of 7 bytes)."""
    deadline = time.monotonic() + timeout_s
    while not (result := found()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {timeout_s:g} s")
        time.sleep(0.1)
    return result


def run_files(save_dir: str | Path) -> list[Path]:
    """The offline run files under a run's save dir (``wandb/offline-run-*/run-<id>.wandb``), oldest first."""
    wandb.teardown()
    folders = sorted(Path(save_dir).glob("wandb/offline-run-*"))
    return [waited(f"no W&B run file in {f}", lambda f=f: sorted(f.glob("run-*.wandb")))[0] for f in folders]


def read_records(path: str | Path) -> list[Record]:
    """The records of a finished run's file, once it holds its ``exit`` record."""
    wandb.teardown()

    def whole() -> list[Record] | None:
        records = _records(path)
        return records if any(r.HasField("exit") for r in records) else None

    return waited(f"{path}: no exit record", whole)


def _records(path: str | Path) -> list[Record]:
    data = Path(path).read_bytes()
    if len(data) < 7:  # not yet written
        return []
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    records: list[Record] = []
    payload, pos = b"", 7
    while pos + CHUNK_HEADER.size <= len(data):
        if BLOCK_LEN - pos % BLOCK_LEN < CHUNK_HEADER.size:  # zero padding at the end of a block
            pos += BLOCK_LEN - pos % BLOCK_LEN
            continue
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if pos + CHUNK_HEADER.size + length > len(data):  # the service is still writing this chunk
            break
        chunk = data[pos + CHUNK_HEADER.size : pos + CHUNK_HEADER.size + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: bad chunk checksum at byte {pos}")
        pos += CHUNK_HEADER.size + length
        payload = chunk if kind in (FULL, FIRST) else payload + chunk
        if kind in (FULL, LAST):
            records.append(Record.FromString(payload))
    return records


def _key(item: HistoryItem | ConfigItem) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: str | Path) -> list[dict[str, Any]]:
    """Each logged row as {key: value}, in order (W&B adds _step, _runtime and _timestamp)."""
    return [
        {_key(i): json.loads(i.value_json) for i in r.history.item} for r in read_records(path) if r.HasField("history")
    ]


def config(path: str | Path) -> dict[str, Any]:
    """The run config: the one given at init with later updates and removals applied, without ``_wandb``."""
    cfg: dict[str, Any] = {}
    for r in read_records(path):
        updates = r.run.config.update if r.HasField("run") else r.config.update
        cfg.update({_key(i): json.loads(i.value_json) for i in updates})
        for i in r.config.remove:
            cfg.pop(_key(i), None)
    cfg.pop("_wandb", None)
    return cfg


def run_record(path: str | Path) -> Any:
    """The ``run`` record written at init: display_name, run_group, job_type, tags."""
    return next(r.run for r in read_records(path) if r.HasField("run"))


def summary(path: str | Path) -> dict[str, Any]:
    """The run summary: the last value of every ``run.summary.update`` key (and of logged keys)."""
    out: dict[str, Any] = {}
    for r in read_records(path):
        if r.HasField("summary"):
            out.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
    return out


def records_of(path: str | Path, kind: str) -> list[Any]:
    """The records of one kind, in order: e.g. ``metric`` (run.define_metric's), ``artifact`` (run.log_artifact's:
    name, type, aliases, metadata as JSON text, and manifest.contents' ``path`` and ``local_path``)."""
    return [getattr(r, kind) for r in read_records(path) if r.HasField(kind)]
