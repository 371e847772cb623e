"""Typed schemas of the `model` and `attention` config groups: a typo'd key or a value of the wrong type fails when
Hydra composes the config (one line from the CLI), and a model preset lists only what differs from GPTConfig."""

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from xsa_lm.errors import UserError
from xsa_lm.model.config import GPTConfig

# GPTConfig fields that the attention group sets (attention.name, .eps, .layers, .gate), not the model group.
ATTENTION_FIELDS = ("attention", "xsa_eps", "xsa_layers", "xsa_gate")


def _model_fields() -> list[tuple]:
    """GPTConfig's architecture fields with its defaults, so the schema cannot drift from the model. vocab_size
    defaults to null: the tokenizer's vocabulary, padded (train/run.py model_config)."""
    own = [("name", str, field(default=MISSING))]
    for f in fields(GPTConfig):
        if f.name == "vocab_size":
            own.append(("vocab_size", int | None, field(default=None)))
        elif f.name not in ATTENTION_FIELDS:
            own.append((f.name, f.type, field(default=f.default)))
    return own


ModelOptions = make_dataclass("ModelOptions", _model_fields())


@dataclass
class AttentionOptions:
    name: str = MISSING  # sa | xsa
    eps: float = 1e-6  # added to ||v_i||^2 in XSA (fp32)
    layers: Any = "all"  # all | N (the last N layers) | a list of 0-based layers: three types, so untyped
    gate: str = "none"  # none | tanh


def register() -> None:
    """The schemas as the configs `_model_schema` and `_attention_schema`, outside the groups (so that no option of
    the group's lists them): each preset names `/_<group>_schema@_here_` first in its defaults."""
    store = ConfigStore.instance()
    store.store(name="_model_schema", node=ModelOptions)
    store.store(name="_attention_schema", node=AttentionOptions)


def check_known_keys(cfg: DictConfig) -> None:
    """`+model.key=...` appends past the schema (Hydra opens the node for `+`): a key the model cannot take is
    refused here, in one line, instead of as a TypeError once the data is prepared."""
    for group, schema in (("model", ModelOptions), ("attention", AttentionOptions)):
        unknown = sorted(set(cfg.get(group) or {}) - {f.name for f in fields(schema)})
        if unknown:
            known = ", ".join(f.name for f in fields(schema))
            raise UserError(f"{group}.{unknown[0]}: not an option of the {group} group (it has {known})")
