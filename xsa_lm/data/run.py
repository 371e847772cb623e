"""`xsa-lm prepare`: a corpus and a tokenizer -> token shards in data.dir, for `xsa-lm train data=prepared`.
`xsa-lm train` calls prepare_data too: it prepares (or reuses) shards in the data cache, or opens data.dir's."""

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from xsa_lm.config.builders import build
from xsa_lm.config.command_line import pasteable
from xsa_lm.config.spec import DataSpec, PrepareSpec, TokenizerSpec, parse
from xsa_lm.data.prepare import PreparedData, choose_split, load_prepared, prepare
from xsa_lm.data.sources import once
from xsa_lm.data.tokenizer import file_sha256
from xsa_lm.errors import UserError, one_line_errors

# Tokenizers whose vocabulary is given, not learned from the corpus: data.tokenizer_documents does not change them.
FIXED_TOKENIZERS = ("xsa_lm.data.tokenizer.load_tokenizer_file", "xsa_lm.data.tokenizer.load_gpt2")


def prepare_data(
    data: DataSpec, tokenizer: TokenizerSpec, explicit_tokenizer: bool = False, progress: bool = False
) -> PreparedData:
    """The prepared shards of `data` tokenized by `tokenizer` (prepared now, or found in the cache)."""
    if data.source is None:  # data=prepared
        if not data.dir:
            raise UserError("data=prepared needs data.dir=<the directory `xsa-lm prepare` wrote>")
        prepared = load_prepared(Path(data.dir).expanduser())
        recorded = prepared.meta["tokenizer"]["config"]
        if explicit_tokenizer and recorded != tokenizer.node:
            raise UserError(
                f"data.dir={data.dir} was prepared with the tokenizer {recorded}, not the requested "
                f"{tokenizer.node}: drop the tokenizer override (the shards' own tokenizer is used) or prepare again"
            )
        return prepared
    source, build_tokenizer = build(data.source), build(tokenizer.node)
    split, val_fraction, note = choose_split(source, data.val_split, data.val_fraction)
    if hasattr(source, "val_plays") and split == "document" and data.val_fraction is not None:
        raise UserError(
            f"data.val_fraction={data.val_fraction} does not apply here: this corpus validates on whole plays "
            f"(data.source.val_plays={source.val_plays}); drop it, or hold out that share of each play with "
            "data.val_split=tail"
        )
    if note:
        once(note)
    # What decides the tokens: the source (its files with sizes and times), the split, the tokenizer's settings, a
    # given tokenizer file by its resolved path and its bytes, or the documents a trained one learns from.
    settings: dict[str, Any] = {"split": split, "val_fraction": val_fraction, "split_seed": data.split_seed}
    settings["shard_documents"] = data.shard_documents
    identity = {"source": source.identity(), "tokenizer": tokenizer.node, **settings}
    if tokenizer.path:
        path = identity["tokenizer"]["path"] = os.path.realpath(os.path.expanduser(tokenizer.path))
        identity["tokenizer_sha256"] = file_sha256(path, "tokenizer.path")
    if not (fixed := tokenizer.target in FIXED_TOKENIZERS):
        identity["tokenizer_documents"] = data.tokenizer_documents
    out = Path(data.dir or data.cache_dir).expanduser()
    if not data.dir:  # a folder of the cache, which the environment variable XSA_LM_DATA_DIR may have set
        if not (blocking := next((p for p in (out, *out.parents) if p.exists()), out)).is_dir():
            from_env = (env := os.environ.get("XSA_LM_DATA_DIR")) and Path(env).expanduser() == out
            named = " (from the environment variable XSA_LM_DATA_DIR)" if from_env else ""
            raise UserError(f"data.cache_dir={out}{named}: {blocking} is a file, not a folder; choose a folder")
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
        out = out / f"{source.name}-{digest[:12]}"
    if fixed and not (out / "meta.json").exists():
        # A given tokenizer (a file, GPT-2's) is read before anything is written: a bad one leaves no folder.
        given = build_tokenizer()
        build_tokenizer = lambda train_texts: given
    how = {"workers": data.prepare_workers, "tokenizer_documents": data.tokenizer_documents}
    return prepare(source, build_tokenizer, out, identity, **settings | how, progress=progress)


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="prepare")
@one_line_errors
def main(cfg: DictConfig) -> None:
    t0 = time.perf_counter()
    spec = parse(PrepareSpec, cfg)
    if spec.data.source is None:
        raise UserError("xsa-lm prepare needs a source: data=local, data=hf, data=fineweb or data=shakespeare")
    data = prepare_data(spec.data, spec.tokenizer, progress=spec.progress_bar)
    seconds, m = time.perf_counter() - t0, data.meta
    val = "val document tails" if m["split"] == "tail" else "val documents"
    print(
        f"prepared {data.dir}: {m['train_documents']:,} train documents / {m['train_tokens']:,} tokens, "
        f"{m['val_documents']:,} {val} / {m['val_tokens']:,} tokens, {len(m['shards'])} shard(s), {m['dtype']}, "
        f"vocab {m['vocab_size']} | {seconds:.1f} s this run "
        f"({(m['train_tokens'] + m['val_tokens']) / max(seconds, 1e-9):,.0f} tokens/s if all were new)\n"
        f"train on it: xsa-lm train data=prepared {pasteable('data.dir', data.dir)}"
    )
