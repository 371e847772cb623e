"""The JSON files one layer writes and another reads (summary.json, a trial's record, a sweep's or a study's
results.json), each a dataclass deriving from Record: to_json() gives what the file holds, from_json() reads it back.

A record carries a `schema` version. A file without one is of version 1; keys a record has gained since default to
their field's default, keys it no longer has are ignored; a file of a newer schema, or one that lacks a key without a
default, is refused in one line naming the file.
"""

import dataclasses
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from xsa_lm.errors import UserError

R = TypeVar("R", bound="Record")
JsonObject = dict[str, Any]  # what a record's file holds: json.loads of it


class Record:
    """A dataclass record of a JSON file: a subclass is a dataclass whose last field is `schema: int = 1` (its
    version, SCHEMA), but for a record nested in another."""

    SCHEMA: ClassVar[int] = 1

    def to_json(self) -> JsonObject:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[R], data: Any, *, source: str = "") -> R:
        """The record of `data` (a dict as to_json made it); `source` names the file in an error."""
        where = source or cls.__name__
        if not isinstance(data, dict):
            raise UserError(f"{where}: not a {cls.__name__} record (a JSON object); write it again")
        version = data.get("schema", 1)
        if not isinstance(version, int) or version > cls.SCHEMA:
            raise UserError(
                f"{where}: schema {version!r} is newer than this xsa-lm reads ({cls.SCHEMA}): upgrade xsa-lm to read it"
            )
        data = cls.upgraded(data)
        hints = get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        missing = [f.name for f in fields if f.name not in data and not has_default(f)]
        if missing:
            raise UserError(
                f"{where}: no {', '.join(missing)} in it: not written by xsa-lm, or cut short; run the command "
                "that wrote it again"
            )
        values = {f.name: convert(hints[f.name], data[f.name], where) for f in fields if f.name in data}
        if any(f.name == "schema" for f in fields):  # read, it is of this version (a nested record has none)
            values["schema"] = cls.SCHEMA
        return cls(**values)

    @classmethod
    def upgraded(cls, data: JsonObject) -> JsonObject:
        """An older file's keys as this version names them (a subclass says how); to_json writes the new names."""
        return data

    @classmethod
    def read(cls: type[R], path: Path, then: str = "run the command that wrote it again") -> R:
        """The record in a JSON file; one that is not JSON (cut short, edited) is refused in one line ending `then`."""
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not JSON ({e}); {then}") from None
        return cls.from_json(data, source=str(path))


def has_default(field: dataclasses.Field) -> bool:
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def convert(hint: Any, value: Any, where: str) -> Any:
    """A JSON value as the type hint wants it: records (also inside lists, dicts and `| None`) and tuples."""
    if value is None:
        return None
    origin, args = get_origin(hint), get_args(hint)
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, source=where)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return convert(kinds[0], value, where) if len(kinds) == 1 else value
    if origin is list and args:
        return [convert(args[0], v, where) for v in value]
    if origin is dict and len(args) == 2:
        return {k: convert(args[1], v, where) for k, v in value.items()}
    if origin is tuple:
        return tuple(value)
    return value


def plain(value: Any) -> Any:
    """A value as JSON holds it: records as dicts, tuples as lists, paths as strings."""
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass(frozen=True, kw_only=True)
class RunSummary(Record):
    """summary.json: how a run ended and what it was (the sweep's trials and the scaling study read it)."""

    status: str
    error: str | None = None
    attention: str
    model: str
    lr: float
    peak_lr: float | None = None  # the highest LR it stepped with: below lr while the warmup has not ended
    precision: str | None = None  # as Lightning trains it (trainer.precision=auto resolved)
    seed: int
    final_val_loss: float | None = None  # of a completed run only
    final_val_ppl: float | None = None
    best_val_loss: float | None = None
    final_val_bpb: float | None = None  # bits per byte: the final loss over the bytes its tokens stand for
    final_val_loss_by_position: list[float | None] = field(default_factory=list)  # per equal span of positions
    steps: int
    data_epochs: float | None = None  # tokens trained / the training split's tokens: above 1, data repeats
    tokens_seen: int
    tokens_per_s: float | None = None  # of the last start or resume alone (resumes.jsonl lists each)
    wall_time_s: float | None = None  # of the last start or resume alone
    non_embedding_params: int = 0
    diverged_at_step: int | None = None
    events: list[dict] = field(default_factory=list)
    val_history: list[dict] = field(default_factory=list)
    run_dir: str
    checkpoints: dict[str, str | None] = field(default_factory=dict)
    model_config: dict[str, Any]
    schema: int = 1
