"""The JSON files one layer writes and another reads (summary.json, a trial's record, results.json): frozen
dataclasses deriving from Record; a file of another `schema` version, or lacking a key, is refused in one line."""

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import TypeAdapter, ValidationError

from xsa_lm.errors import UserError

R = TypeVar("R", bound="Record")
JsonObject = dict[str, Any]  # what a record's file holds: json.loads of it


class Record:
    """Base of the record dataclasses; SCHEMA: the version this xsa-lm writes and reads."""

    SCHEMA: ClassVar[int] = 1

    def to_json(self) -> JsonObject:
        return TypeAdapter(type(self)).dump_python(self, mode="json")  # type: ignore[no-any-return]

    @classmethod
    def from_json(cls: type[R], data: Any, *, source: str = "") -> R:
        """The record of `data` (a dict as to_json made it); `source` names the file in an error."""
        where = source or cls.__name__
        if not isinstance(data, dict):
            raise UserError(f"{where}: not a {cls.__name__} record (a JSON object); write it again")
        versioned = any(f.name == "schema" for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        missing = ["schema"] if versioned and "schema" not in data else []
        try:
            record = TypeAdapter(cls).validate_python(data)
        except ValidationError as e:
            missing += [".".join(map(str, error["loc"])) for error in e.errors() if error["type"] == "missing"]
            if not missing:
                first = e.errors()[0]
                raise UserError(
                    f"{where}: {'.'.join(map(str, first['loc']))}: {first['msg']}; run the command that wrote it again"
                ) from None
        if missing:
            raise UserError(
                f"{where}: no {', '.join(missing)} in it: not written by xsa-lm, or cut short; run the command that "
                "wrote it again"
            )
        if versioned and data["schema"] != cls.SCHEMA:
            raise UserError(
                f"{where}: schema {data['schema']!r}, but this xsa-lm reads schema {cls.SCHEMA}: run the command "
                "that wrote it again with this xsa-lm"
            )
        return record

    @classmethod
    def read(cls: type[R], path: Path, then: str = "run the command that wrote it again") -> R:
        """The record in a JSON file; one that is not JSON (cut short, edited) is refused in one line ending `then`."""
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: not JSON ({e}); {then}") from None
        return cls.from_json(data, source=str(path))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeVersion(Record):
    """The code that trained a run (xsa_lm.train.runinfo.code_version); `source_sha256` and `torch` identify it."""

    package: str | None  # the installed xsa-lm version
    commit: str | None  # None: not run from a git checkout
    dirty: bool | None
    source_sha256: str  # of the package's .py files and bundled config .yaml files
    torch: str

    @property
    def identity(self) -> tuple[str, str]:
        return self.source_sha256, self.torch

    def __str__(self) -> str:
        commit = f"commit {self.commit[:12]}{'+dirty' if self.dirty else ''}" if self.commit else "no git commit"
        return f"xsa-lm {self.package} {commit} (source {self.source_sha256[:8]}, torch {self.torch})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunInfo(Record):
    """The part of run_info.json (xsa_lm.train.runinfo.run_info) a study reads: the code that started the run."""

    code: CodeVersion | None = None  # None: a run from before xsa-lm recorded it


@dataclasses.dataclass(frozen=True, kw_only=True)
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
    final_val_loss_by_position: list[float | None] = dataclasses.field(default_factory=list)  # equal spans
    steps: int
    data_epochs: float | None = None  # tokens trained / the training split's tokens: above 1, data repeats
    tokens_seen: int
    tokens_per_s: float | None = None  # of the last start or resume alone (resumes.jsonl lists each)
    wall_time_s: float | None = None  # of the last start or resume alone
    non_embedding_params: int = 0
    diverged_at_step: int | None = None
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    val_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    run_dir: str
    checkpoints: dict[str, str | None] = dataclasses.field(default_factory=dict)
    model_config: dict[str, Any]
    code: CodeVersion | None = None  # None: a run from before xsa-lm recorded it
    cpu_threads: int | None = None  # torch's intra-op threads: on CPU another count sums in another order
    schema: int = 1
