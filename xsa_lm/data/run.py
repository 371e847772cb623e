"""`xsa-lm prepare`: a corpus and a tokenizer -> token shards in data.dir, for `xsa-lm train data=prepared`.

`prepare_data` is also what `xsa-lm train` calls: with a source it prepares (or reuses) shards in the data cache,
with data=prepared it opens the shards in data.dir and touches no network.
"""

import os
import shlex
import time
from dataclasses import fields
from pathlib import Path

import hydra
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from xsa_lm.config.builders import build
from xsa_lm.config.checks import field_problems
from xsa_lm.config.schema import DataOptions
from xsa_lm.data.prepare import (
    PreparedData,
    SplitSettings,
    cache_path,
    choose_split,
    load_prepared,
    prepare,
    split_settings,
)
from xsa_lm.data.sources import SourceIdentity
from xsa_lm.data.tokenizer import TokenizerInputs, learns_from_corpus, tokenizer_inputs
from xsa_lm.errors import UserError, exit_on_user_error, one_line_errors

once = rank_zero_only(print)  # a note printed by one process, not by every DDP rank


def prepare_data(
    data_cfg: DictConfig, tokenizer_cfg: DictConfig, explicit_tokenizer: bool = False, progress: bool = False
) -> PreparedData:
    tokenizer_key = OmegaConf.to_container(tokenizer_cfg, resolve=True)
    check_val_windows(data_cfg.get("val_windows"))
    if data_cfg.get("source") is None:  # data=prepared
        if not data_cfg.get("dir"):
            raise UserError("data=prepared needs data.dir=<the directory `xsa-lm prepare` wrote>")
        data = load_prepared(Path(data_cfg.dir).expanduser())
        recorded = data.meta["tokenizer"]["config"]
        if explicit_tokenizer and recorded != tokenizer_key:
            raise UserError(
                f"data.dir={data_cfg.dir} was prepared with the tokenizer {recorded}, not the requested "
                f"{tokenizer_key}: drop the tokenizer override (the shards' own tokenizer is used) or prepare again"
            )
        return data
    source = build(data_cfg.source)
    build_tokenizer = build(tokenizer_cfg)
    # A run's config saved before val_split existed keeps the document split it was trained with.
    split, val_fraction, note = choose_split(source, data_cfg.get("val_split", "document"), data_cfg.val_fraction)
    plays = getattr(source, "val_plays", None)
    if plays is not None and split == "document" and data_cfg.val_fraction is not None:
        raise UserError(
            f"data.val_fraction={data_cfg.val_fraction} does not apply here: this corpus validates on whole plays "
            f"(data.source.val_plays={plays}); drop it, or hold out that share of each play with data.val_split=tail"
        )
    if getattr(source, "dropped", None):  # the same file given twice, or a glob and one of its matches
        repeats = ", ".join(source.dropped[:3]) + (", ..." if len(source.dropped) > 3 else "")
        once(f"data: {len(source.dropped)} file(s) matched more than once, read once: {repeats}")
    if note:
        once(note)
    settings = split_settings(split, val_fraction, data_cfg.split_seed, data_cfg.shard_documents)
    identity = data_identity(source, tokenizer_cfg, data_cfg.tokenizer_documents, settings)
    if not data_cfg.dir:
        check_cache_dir(Path(data_cfg.cache_dir).expanduser())
    out = Path(data_cfg.dir).expanduser() if data_cfg.dir else cache_path(data_cfg.cache_dir, source.name, identity)
    if not learns_from_corpus(tokenizer_cfg) and not (out / "meta.json").exists():
        # A given tokenizer (a file, GPT-2's) is read before anything is written: a bad one leaves no folder.
        tokenizer = build_tokenizer()
        build_tokenizer = lambda train_texts: tokenizer  # noqa: E731
    return prepare(
        source,
        build_tokenizer,
        out,
        identity,
        **settings,
        workers=data_cfg.prepare_workers,
        tokenizer_documents=data_cfg.tokenizer_documents,
        progress=progress,
    )


class DataIdentity(SplitSettings, TokenizerInputs):
    """prepare.json: what decides the tokens of a preparation (its hash names the cache folder)."""

    source: SourceIdentity
    tokenizer: object  # the tokenizer's settings: a mapping of the config's values


def data_identity(source, tokenizer_cfg: DictConfig, tokenizer_documents: int, settings: SplitSettings) -> DataIdentity:
    """Everything that decides the tokens of a preparation: the source (its files resolved, each once, with their
    sizes and times), the tokenizer (its settings, a given file's bytes, the documents a trained one learns from)
    and the split. It names the cache folder and is recorded in prepare.json: other inputs never share shards."""
    return {
        "source": source.identity(),
        "tokenizer": tokenizer_settings(tokenizer_cfg),
        **tokenizer_inputs(tokenizer_cfg, tokenizer_documents),
        **settings,
    }


def tokenizer_settings(tokenizer_cfg: DictConfig) -> dict:
    """The tokenizer's settings, a given file by its resolved path (as the source's files are): the same file named
    from another directory is the same tokenizer."""
    settings = OmegaConf.to_container(tokenizer_cfg, resolve=True)
    assert isinstance(settings, dict)
    if settings.get("path"):
        settings["path"] = os.path.realpath(os.path.expanduser(settings["path"]))
    return settings


def check_cache_dir(cache: Path) -> None:
    """The folder prepared data is cached in, which the environment variable XSA_LM_DATA_DIR may have set."""
    blocking = next((p for p in (cache, *cache.parents) if p.exists()), cache)
    if not blocking.is_dir():
        env = os.environ.get("XSA_LM_DATA_DIR")
        source = " (from the environment variable XSA_LM_DATA_DIR)" if env and Path(env).expanduser() == cache else ""
        raise UserError(f"data.cache_dir={cache}{source}: {blocking} is a file, not a folder; choose a folder")


def check_val_windows(val_windows: int | None) -> None:
    """Before anything is prepared or written: 0 windows would be a run without validation."""
    if val_windows is not None and (type(val_windows) is not int or val_windows < 1):
        raise UserError(f"data.val_windows must be >= 1 (or null: every validation window), got {val_windows}")


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="prepare")
@one_line_errors
def main(cfg: DictConfig) -> None:
    t0 = time.perf_counter()
    with exit_on_user_error():
        if cfg.data.get("source") is None:
            raise UserError("xsa-lm prepare needs a source: data=local, data=hf, data=fineweb or data=shakespeare")
        checked = [f for f in fields(DataOptions) if f.name != "block_size"]  # null in prepare: whole documents
        bad = field_problems(cfg.data, checked, "data.")
        if bad:
            raise UserError("; ".join(bad))
        data = prepare_data(cfg.data, cfg.tokenizer, progress=cfg.progress_bar)
    seconds, m = time.perf_counter() - t0, data.meta
    val = "val document tails" if m.get("split") == "tail" else "val documents"
    print(
        f"prepared {data.dir}: {m['train_documents']:,} train documents / {m['train_tokens']:,} tokens, "
        f"{m['val_documents']:,} {val} / {m['val_tokens']:,} tokens, {len(m['shards'])} shard(s), {m['dtype']}, "
        f"vocab {m['vocab_size']} | {seconds:.1f} s this run "
        f"({(m['train_tokens'] + m['val_tokens']) / max(seconds, 1e-9):,.0f} tokens/s if all were new)\n"
        f"train on it: xsa-lm train data=prepared data.dir={shlex.quote(str(data.dir))}"
    )
