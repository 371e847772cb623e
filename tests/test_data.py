"""Corpora, tokenizers, sharded preparation (formats, split, resume) and the deterministic, resumable loading order."""

import json
import os
import re
import subprocess
import sys
import time
from functools import partial
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.helpers import FAST, compose_train
from tests.leftovers import nothing_left_behind
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.data.datamodule import PackedWindows, ShuffledBatches, TokenDataModule
from xsa_lm.data.prepare import choose_split, is_val_document, load_prepared, prepare, tail_start
from xsa_lm.data.run import prepare_data
from xsa_lm.data.sources import HFDataset, LocalFiles, ShakespeareCorpus
from xsa_lm.data.tokenizer import EOT, load_gpt2, load_tokenizer_file, train_bpe
from xsa_lm.errors import UserError

DOCS = ["the quick brown fox jumps over the lazy dog. " * 20, "to be or not to be, that is the question. " * 20]
BPE = partial(train_bpe, vocab_size=300)


def many_docs(n: int) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    return [" ".join(words[(i * 7 + j) % 10] for j in range(5 + i % 13)) + f" doc {i}." for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def decode_documents(data, split: str) -> list[str]:
    tokens = np.concatenate([np.asarray(s) for s in data.shards(split)]) if data.shards(split) else np.array([])
    ends = np.flatnonzero(tokens == data.meta["eot_id"])
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [data.tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def shakespeare_text(n_chars: int) -> str:
    """Deterministic plain text: the bundled plays' first n_chars (at most 240,000) or a little less (whole lines)."""
    text = "".join(play for _, play in islice(ShakespeareCorpus(val_plays=[]).documents(), 2))
    return text[: text.rindex("\n", 0, n_chars) + 1]


class KeyedDocuments(dict):
    """A source with chosen document keys (LocalFiles keys hold the temporary path: their split varies)."""

    def documents(self):
        yield from self.items()


def prepare_local(tmp_path: Path, files: str, out: str = "out", **kwargs):
    source = LocalFiles(files)
    identity = {"source": source.identity(), "tokenizer": "bpe300"}
    return prepare(source, BPE, tmp_path / out, identity, **{"val_fraction": 0.2, **kwargs})


def prepared_from(tmp_path: Path, *overrides: str):
    """`xsa-lm train data=local <overrides>`'s data (a BPE of 300 tokens unless the overrides choose another)."""
    bpe = [] if any(o.startswith("tokenizer=") for o in overrides) else ["tokenizer.vocab_size=300"]
    spec = parse(TrainSpec, compose_train(["data=local", f"data.cache_dir={tmp_path / 'cache'}", *bpe, *overrides]))
    return prepare_data(spec.data, spec.tokenizer)


def test_bpe_roundtrip_and_eot_special(tmp_path: Path):
    tok = train_bpe(DOCS * 5, vocab_size=300)
    assert tok.get_vocab_size() <= 300
    text = "to be or not to be, the lazy fox"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode(f"dog{EOT}to").ids.count(tok.token_to_id(EOT)) == 1
    tok.save(str(tmp_path / "tokenizer.json"))
    for read in (load_tokenizer_file, load_gpt2):  # tokenizer=file, and tokenizer=gpt2 tokenizer.path=...
        assert read(str(tmp_path / "tokenizer.json")).encode(text).ids == tok.encode(text).ids


def test_the_hub_offline_fails_fast_naming_the_alternative(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    start = time.monotonic()
    with pytest.raises(UserError, match="^tokenizer=gpt2 needs the Hugging Face hub.*pass tokenizer.path="):
        load_gpt2()
    with pytest.raises(UserError, match="^data: the Hugging Face dataset .* use data=local data.files="):
        HFDataset(path="HuggingFaceFW/fineweb", subset="sample-10BT")
    assert time.monotonic() - start < 5


NO_TOKENIZER = {
    "missing": (None, "file not found"),
    "plain text": (b"hello world\n", "is not a tokenizer.json: invalid JSON at line 1, column 1"),
    "not UTF-8": ("caf\xe9".encode("latin-1"), "not UTF-8 text: invalid byte at offset 3"),
    "truncated": (b"half", "is not a tokenizer.json: invalid JSON"),
    "other JSON": (b'{"model": "gpt2", "vocab_size": 50257}', "is JSON but no tokenizer of the `tokenizers` library"),
    "without EOT": (b"", f"has no {EOT} token"),
}


@pytest.mark.parametrize(("content", "message"), NO_TOKENIZER.values(), ids=NO_TOKENIZER.keys())
def test_a_tokenizer_file_that_is_no_tokenizer_is_one_line(tmp_path: Path, content: bytes | None, message: str):
    real = train_bpe(DOCS, vocab_size=300).to_str().encode()
    content = {b"half": real[: len(real) // 2], b"": real.replace(EOT.encode(), b"<|other|>")}.get(content, content)
    if content is not None:
        (tmp_path / "t.json").write_bytes(content)
    for read in (load_tokenizer_file, load_gpt2):
        with pytest.raises(UserError, match=f"^tokenizer.path: .*{re.escape(message)}"):
            read(str(tmp_path / "t.json"))


def test_gpt2_tokenizer_with_an_unusable_hugging_face_cache_is_one_line(tmp_path: Path):
    """HF_HOME below a regular file: the hub client's NotADirectoryError becomes one line naming HF_HOME. In a
    fresh process: huggingface_hub reads HF_HOME once, when it is imported."""
    (tmp_path / "file").write_text("")
    env = {**os.environ, "HF_HOME": str(tmp_path / "file" / "hf"), "HF_HUB_OFFLINE": "1"}
    probe = "from xsa_lm.data.tokenizer import load_gpt2; load_gpt2()"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("xsa_lm.errors.UserError: tokenizer=gpt2: the Hugging Face cache cannot be used (")
    assert "point HF_HOME at a writable folder" in last


def test_shakespeare_validation_is_whole_plays():
    corpus = ShakespeareCorpus(val_plays=["macbeth", "the-tempest"])
    docs = dict(corpus.documents())
    assert len(docs) == 38 and [k for k in docs if corpus.is_val(k)] == ["macbeth", "the-tempest"]
    assert "MACBETH" in docs["macbeth"] and "**" not in docs["macbeth"]  # markdown stripped
    with pytest.raises(UserError, match="^data.source.val_plays: unknown plays"):
        ShakespeareCorpus(val_plays=["no-such-play"])


def test_every_local_format_reads_the_same_documents(tmp_path: Path):
    texts = many_docs(6)
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i}.txt").write_text(t)
    write_jsonl(tmp_path / "a.jsonl", texts, field="body")
    (tmp_path / "b.json").write_text(json.dumps([{"body": t} for t in texts]))
    pq.write_table(pa.table({"body": texts, "n": list(range(6))}), tmp_path / "c.parquet")
    assert [t for _, t in LocalFiles(str(tmp_path / "txt" / "*.txt")).documents()] == texts
    for name in ("a.jsonl", "b.json", "c.parquet"):
        source = LocalFiles(str(tmp_path / name), text_field="body")
        assert [t for _, t in source.documents()] == texts and source.count_documents() == 6, name
    both = LocalFiles([str(tmp_path / "a.jsonl"), str(tmp_path / "c.*")], text_field="body")  # a list of globs
    keys = [k for k, _ in both.documents()]
    assert len(keys) == 12 and len(set(keys)) == 12  # document keys are unique across files
    # A HF dataset with local files: its builder reads them through `datasets`, as far as max_documents.
    hf = HFDataset(path="json", data_files=str(tmp_path / "a.jsonl"), text_field="body")
    assert [t for _, t in hf.documents()] == texts
    first_two = HFDataset(path="json", data_files=str(tmp_path / "a.jsonl"), text_field="body", max_documents=2)
    assert [t for _, t in first_two.documents()] == texts[:2]


BAD_FILES = {  # the files (None: a folder) and the one line
    "empty": ({"a.txt": b""}, "is empty"),
    "not UTF-8": ({"a.txt": "caf\xe9".encode("latin-1")}, "is not UTF-8 text (invalid byte at offset 3)"),
    "no field": ({"a.jsonl": b'{"body": "x"}\n'}, "a.jsonl line 1 has no field 'text' (fields: ['body'])"),
    "not text": ({"a.jsonl": b'{"text": 3}\n'}, "'text' is int, not text"),
    "bad JSON": ({"a.jsonl": b'{"text": "x"\n'}, "a.jsonl line 1 is not valid JSON"),
    "bad JSON array": ({"a.json": b'[{"text": "a"}, {"text": '}, "a.json at line 1, column 26 is not valid JSON"),
    "no column": ({"a.parquet": None}, "a.parquet has no column 'text' (columns: ['body'])"),
    "not Parquet": ({"a.parquet": b"text\nx\n"}, "a.parquet is not a Parquet file (Parquet file size is 7 bytes"),
    "not text in Parquet": ({"a.parquet": pa.table({"text": [0, 1]})}, "a.parquet row 1: 'text' is int, not text"),
    "other type": ({"a.csv": b"text\nx\n"}, "a.csv: unsupported file type"),
    "a folder": ({"a.d": None}, "matches only a directory"),
    "no match": ({}, "no file matches"),
}


@pytest.mark.parametrize(("files", "message"), BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_local_files_are_one_line_errors(tmp_path: Path, files: dict, message: str):
    for name, content in files.items():
        if name.endswith(".parquet") and not isinstance(content, bytes):
            pq.write_table(pa.table({"body": ["x"]}) if content is None else content, tmp_path / name)
        elif content is None:
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=f"^data.(files|text_field): .*{re.escape(message)}"):
        list(LocalFiles(str(tmp_path / "a.*")).documents())


def test_shards_read_back_equal_direct_tokenization(tmp_path: Path, capsys):
    texts = many_docs(50)
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    data = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"), shard_documents=7, progress=True)
    out = capsys.readouterr().out
    assert "50/50" in out and "tokens/s" in out  # the progress bar: documents done / total (for the ETA), tokens/s
    assert len(data.meta["shards"]) == 8 and data.meta["dtype"] == "uint16"
    keys = [f"{tmp_path / 'corpus.jsonl'}:{n}" for n in range(1, 51)]
    expected_val = [t for k, t in zip(keys, texts, strict=True) if is_val_document(k, 0.2, 0)]
    expected_train = [t for k, t in zip(keys, texts, strict=True) if not is_val_document(k, 0.2, 0)]
    assert decode_documents(data, "train") == expected_train and decode_documents(data, "val") == expected_val
    # token for token: the shards hold exactly tokenizer.encode(document) + [EOT] for each document, in order
    eot = data.meta["eot_id"]
    direct = [t for text in expected_train for t in [*data.tokenizer.encode(text).ids, eot]]
    assert np.concatenate([np.asarray(s) for s in data.shards("train")]).tolist() == direct
    assert data.meta["train_tokens"] == len(direct) and data.meta["val_documents"] == len(expected_val)
    assert data.meta["tokenizer"]["sha256"] and data.meta["identity"]["split_seed"] == 0  # meta.json's
    assert sum(s["train_documents"] + s["val_documents"] for s in data.meta["shards"]) == 50


def test_split_is_disjoint_and_stable_under_re_preparation(tmp_path: Path):
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(200))
    a = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"), "a", shard_documents=13)
    b = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"), "b", shard_documents=50, workers=2)
    val_a, train_a = decode_documents(a, "val"), decode_documents(a, "train")
    assert set(val_a).isdisjoint(train_a) and len(val_a) + len(train_a) == 200
    assert 20 < len(val_a) < 60  # ~20% of 200
    assert decode_documents(b, "val") == val_a and decode_documents(b, "train") == train_a  # shards/workers: same
    c = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"), "c", shard_documents=13, split_seed=1)
    assert decode_documents(c, "val") != val_a  # the seed chooses the split


class StopAfter(KeyedDocuments):
    """A source whose second pass (the first trains the tokenizer) is stopped by Ctrl-C after n documents."""

    def __init__(self, source: LocalFiles, n: int) -> None:
        super().__init__(source.documents())
        self.n, self.passes = n, 0

    def documents(self):
        self.passes += 1
        for i, doc in enumerate(super().documents()):
            if i == self.n and self.passes == 2:
                raise KeyboardInterrupt
            yield doc


def test_an_interrupted_preparation_resumes_and_a_finished_one_is_reused(tmp_path: Path):
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(100))
    source, out = LocalFiles(str(tmp_path / "corpus.jsonl")), tmp_path / "resumed"
    identity = {"source": source.identity(), "tokenizer": "bpe300"}
    run = partial(prepare, build_tokenizer=BPE, identity=identity, val_fraction=0.2, shard_documents=10)
    whole = run(source, out=tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        run(StopAfter(source, 45), out=out)
    work = tmp_path / "resumed.partial"  # renamed to `out` when whole
    assert not out.exists() and len(list(work.glob("shard-*.json"))) == 4
    stamps = {p.name: p.stat().st_mtime_ns for p in work.glob("*-00000[0-3].*")}
    with pytest.raises(UserError, match="is not finished .* run the same `xsa-lm prepare"):
        load_prepared(out)
    resumed = run(source, out=out)
    assert run(source, out=out).meta == resumed.meta  # finished: reused
    for other in ({"split_seed": 3}, {"split": "tail"}):
        with pytest.raises(UserError, match="prepared from other inputs"):
            run(source, out=out, **other)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*-00000[0-3].*")} == stamps  # never rewritten
    for split in ("train", "val"):
        for x, y in zip(whole.shards(split), resumed.shards(split), strict=True):
            assert np.array_equal(x, y)
    assert resumed.meta["shards"] == whole.meta["shards"]


OTHER_TOKENIZER = "tokenizer.json is not the tokenizer the shards were made with"
DAMAGE = {  # a file of the prepared folder, what becomes of its bytes, the one line
    "truncated tokenizer.json": ("tokenizer.json", lambda b: b[:500], OTHER_TOKENIZER),
    "other JSON as tokenizer.json": ("tokenizer.json", lambda b: b'{"vocab_size": 300}', OTHER_TOKENIZER),
    "truncated meta.json": ("meta.json", lambda b: b[:50], "meta.json is not valid JSON"),
    "other JSON as meta.json": ("meta.json", lambda b: b"[]", "is not the meta.json of"),
    "overwritten shard bytes": (
        "val-000000.bin",
        lambda b: b[:10] + b"\xff" * 8 + b[18:],
        "val-000000.bin holds token id 65535, outside the vocabulary of",
    ),
}


@pytest.mark.parametrize(("name", "damage", "message"), DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_prepared_directory_is_one_line_at_load(tmp_path: Path, name, damage, message: str, monkeypatch):
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(40))
    monkeypatch.chdir(tmp_path)  # a document's split hashes its key, the path as given: not the test's folder's name
    data = prepare_local(tmp_path, "corpus.jsonl")
    (data.dir / name).write_bytes(damage((data.dir / name).read_bytes()))
    with pytest.raises(UserError, match=re.escape(message)):
        load_prepared(data.dir)


def test_the_advice_for_a_damaged_shard_rebuilds_it(tmp_path: Path):
    """Following the one line's advice literally (meta.json included) makes the same shard again; a missing shard
    says so (not `-1 bytes`)."""
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(40))
    data = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"))
    shard = data.dir / "train-000000.bin"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    advice = "delete it, its shard-000000.json and meta.json, then run the same `xsa-lm prepare` command"
    with pytest.raises(UserError, match=re.escape(f"is truncated or corrupt (100 bytes, expected {len(whole)}): ")):
        load_prepared(data.dir)
    shard.unlink()
    with pytest.raises(UserError, match=re.escape(f"is missing (expected {len(whole)} bytes): {advice}")):
        load_prepared(data.dir)
    for name in ("shard-000000.json", "meta.json"):
        (data.dir / name).unlink()
    again = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"))
    assert shard.read_bytes() == whole and again.meta["shards"] == data.meta["shards"]


def test_the_data_cache_is_keyed_by_every_input_that_changes_the_tokens(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(shakespeare_text(20_000))
    default = prepared_from(tmp_path, "data.files=a.txt")
    bytes_only = prepared_from(tmp_path, "data.files=a.txt", "data.tokenizer_documents=1")  # the same text
    assert default.meta["vocab_size"] == bytes_only.meta["vocab_size"] == 300
    assert prepared_from(tmp_path, "data.files=a.txt").dir == default.dir  # each is reused, in both orders
    assert prepared_from(tmp_path, "data.files=a.txt", "data.tokenizer_documents=1").dir == bytes_only.dir
    others = [prepared_from(tmp_path, "data.files=a.txt", "data.tokenizer_documents=5").dir]
    others.append(prepared_from(tmp_path, "data.files=a.txt", "tokenizer.vocab_size=280").dir)
    assert len({default.dir, bytes_only.dir, *others}) == 4
    # The same file by another name is the same input: the same folder.
    assert prepared_from(tmp_path, f"data.files={tmp_path / 'a.txt'}").dir == default.dir
    # A given tokenizer file is known by its bytes, not its path.
    train_bpe(DOCS, vocab_size=280).save(str(tmp_path / "t.json"))
    given = prepared_from(tmp_path, "data.files=a.txt", "tokenizer=file", "tokenizer.path=t.json")
    train_bpe(DOCS, vocab_size=260).save(str(tmp_path / "t.json"))
    changed = prepared_from(tmp_path, "data.files=a.txt", "tokenizer=file", "tokenizer.path=t.json")
    assert changed.dir != given.dir and changed.meta["vocab_size"] < given.meta["vocab_size"]


def test_a_file_matched_twice_is_read_once(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(shakespeare_text(20_000))
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    once = prepared_from(tmp_path, "data.files=a.txt", f"data.dir={tmp_path / 'once'}")
    capsys.readouterr()
    for i, files in enumerate(["[a.txt,a.txt]", f"[*.txt,{tmp_path / 'a.txt'}]", "[a.txt,link.txt]"]):
        again = prepared_from(tmp_path, f"data.files={files}", f"data.dir={tmp_path / str(i)}")
        assert again.meta["train_tokens"] == once.meta["train_tokens"], files  # not twice the tokens
        assert "matched more than once, read once" in capsys.readouterr().out
    assert LocalFiles(["a.txt", "*.txt", "link.txt"]).files == ["a.txt"]


def test_vocabularies_above_65536_get_uint32_shards(tmp_path: Path):
    vocab = {f"w{i}": i for i in range(70_000)} | {EOT: 70_000, "[UNK]": 70_001}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    texts = [" ".join(f"w{(i * 997 + j) % 70_000}" for j in range(50)) for i in range(40)]
    write_jsonl(tmp_path / "corpus.jsonl", texts)
    source = LocalFiles(str(tmp_path / "corpus.jsonl"))
    data = prepare(source, lambda train_texts: big, tmp_path / "out", {"tokenizer": "big"}, val_fraction=0.2)
    assert data.meta["dtype"] == "uint32" and data.shards("train")[0].dtype == np.uint32
    assert sorted(decode_documents(data, "train") + decode_documents(data, "val")) == sorted(texts)
    tokens = np.concatenate([np.asarray(s) for s in data.shards("train")])
    assert tokens.max() >= 2**16 and (data.dir / "train-000000.bin").stat().st_size == 4 * len(tokens)


VAL_KEY = next(key for key in map(str, range(99)) if is_val_document(key, 0.5, 0))
TRAIN_KEY = next(key for key in map(str, range(99)) if not is_val_document(key, 0.5, 0))
NO_SPLIT = {  # documents, split, the one line (val_fraction=0.5)
    "empty": (["", "", "", ""], "document", "the corpus has no text: every document is empty or whitespace only"),
    "whitespace": ([" ", "\n\n", "\t \n", "   "], "document", "the corpus has no text"),
    "whitespace tails": ([" \n\t\n", " \n" * 5000], "tail", "the corpus has no text"),  # not `raise val_fraction`
    "all in validation": ({VAL_KEY: "t"}, "document", "every document with text fell into the validation split (1"),
    "none in validation": ({TRAIN_KEY: "t"}, "document", "no document fell into the validation split"),
    "too short for a tail": (["a"], "tail", "the documents are too short to hold out 50% of each"),
}


@pytest.mark.parametrize(("documents", "split", "message"), NO_SPLIT.values(), ids=NO_SPLIT.keys())
def test_a_corpus_without_both_splits_is_one_line(tmp_path: Path, documents, split: str, message: str):
    if isinstance(documents, dict):  # whole documents of text, with chosen keys
        documents = {key: shakespeare_text(3000) for key in documents}
    source = KeyedDocuments(documents if isinstance(documents, dict) else {str(i): d for i, d in enumerate(documents)})
    with pytest.raises(UserError, match=f"^data: {re.escape(message)}"):
        prepare(source, BPE, tmp_path / "out", {}, val_fraction=0.5, split=split)


def test_auto_split_takes_the_document_split_only_with_enough_documents(tmp_path: Path):
    (tmp_path / "input.txt").write_text(shakespeare_text(5000))
    one_file = LocalFiles(str(tmp_path / "input.txt"))
    split, fraction, note = choose_split(one_file)
    assert (split, fraction) == ("tail", 0.1)
    assert note == (
        "data: 1 document is too few for a document-level split (10 validation documents at 0.05% need 20,000); "
        "holding out the last 10% of each document for validation (data.val_split=tail)"
    )
    assert choose_split(one_file, val_fraction=0.05)[:2] == ("tail", 0.05)  # an explicit fraction is kept
    assert choose_split(one_file, "document") == ("document", 0.0005, None)  # an explicit split is obeyed
    many = LocalFiles(str(write_jsonl(tmp_path / "many.jsonl", many_docs(200))))
    assert choose_split(many, val_fraction=0.05) == ("document", 0.05, None)  # 200 x 0.05 = 10 expected
    assert choose_split(many, val_fraction=0.04)[0] == "tail"
    assert choose_split(many)[0] == "tail"  # 200 x 0.0005: no validation document to expect
    assert choose_split(ShakespeareCorpus(val_plays=["macbeth"])) == ("document", 0.0005, None)  # its own split
    assert many.count_documents(stop_at=30) == 30 and many.count_documents() == 200  # counting stops early
    # Through the command's path: data.val_split=document is obeyed; auto expects 200 x 0.04 < 10 documents.
    files = [f"data.files={tmp_path / 'many.jsonl'}", "data.val_fraction=0.04"]
    assert prepared_from(tmp_path, *files, "data.val_split=document").meta["split"] == "document"
    assert prepared_from(tmp_path, *files).meta["split"] == "tail"


SPEC_REFUSALS = [
    *[(f"data.val_fraction={v}", f"data.val_fraction={v} must be in (0, 0.5]: it is") for v in ("0", "1", "-0.1")],
    (
        "data.val_fraction=0.9",
        "data.val_fraction=0.9 must be in (0, 0.5]: it is the share held out for validation (nanoGPT's 90/10 split is "
        "data.val_fraction=0.1)",
    ),
    ("data.val_split=random", "data.val_split=random must be one of auto, document, tail"),
]


@pytest.mark.parametrize(("override", "message"), SPEC_REFUSALS)
def test_bad_split_settings_are_refused(override: str, message: str):
    with pytest.raises(UserError, match=f"^{re.escape(message)}"):
        parse(TrainSpec, compose_train([override]))


def test_tail_split_holds_out_the_end_of_every_document(tmp_path: Path):
    texts = [shakespeare_text(20_000), shakespeare_text(8000).replace("\n", " ")]  # with and without lines
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    data = prepare_local(tmp_path, str(tmp_path / "*.txt"), split="tail", val_fraction=0.1)
    heads, tails = decode_documents(data, "train"), decode_documents(data, "val")
    assert [h + t for h, t in zip(heads, tails, strict=True)] == texts  # nothing lost, nothing in both
    assert heads[0].endswith("\n") and 0.09 < len(tails[0]) / len(texts[0]) <= 0.1  # from the next line start
    assert len(tails[1]) == round(0.1 * len(texts[1]))  # no line: the last 10% of the characters
    n_val = sum(len(data.tokenizer.encode(t).ids) for t in tails)
    assert n_val + 2 == data.meta["val_tokens"]  # each document's tail tokens and an EOT
    assert 0.08 < data.meta["val_tokens"] / (data.meta["train_tokens"] + data.meta["val_tokens"]) < 0.12
    assert data.meta["split"] == "tail" and data.meta["identity"]["split"] == "tail"
    assert tail_start("abc", 0.1) == 3 and tail_start("", 0.1) == 0  # too short to hold out anything
    other = prepare_local(
        tmp_path, str(tmp_path / "*.txt"), "b", split="tail", val_fraction=0.1, shard_documents=1, workers=2
    )
    assert decode_documents(other, "train") == heads and decode_documents(other, "val") == tails


def test_windows_are_shifted_by_one_and_never_cross_shards():
    windows = PackedWindows([np.arange(100, dtype=np.uint16)], block_size=8)
    assert len(windows) == 12
    x, y = windows[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    assert x.dtype == torch.int64
    two = PackedWindows([np.arange(20, dtype=np.uint16), np.arange(100, 120, dtype=np.uint16)], block_size=8)
    assert len(two) == 4 and two[2][0].tolist() == list(range(100, 108))


def stream_batches(stream, n: int) -> list[torch.Tensor]:
    it = iter(stream)
    return [next(it)[0] for _ in range(n)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_sampling_order_is_a_function_of_seed_and_position():
    windows = PackedWindows([np.arange(1000, dtype=np.uint16)], block_size=10)  # 99 windows
    a = stream_batches(ShuffledBatches(windows, 4, seed=1), 60)  # > 2 epochs
    assert same(a, stream_batches(ShuffledBatches(windows, 4, seed=1), 60))
    assert not same(a, stream_batches(ShuffledBatches(windows, 4, seed=2), 60))
    assert sorted(torch.cat(a)[:99, 0].tolist()) == [10 * i for i in range(99)]  # every window once per epoch
    assert same(stream_batches(ShuffledBatches(windows, 4, seed=1, start_batch=25), 10), a[25:35])  # a resume
    # Rank r of W takes the global micro-batches r, r + W, ...: distinct windows per rank.
    rank0 = stream_batches(ShuffledBatches(windows, 4, seed=1, rank=0, world_size=2), 4)
    rank1 = stream_batches(ShuffledBatches(windows, 4, seed=1, rank=1, world_size=2), 4)
    assert same(rank0, a[0:8:2]) and same(rank1, a[1:8:2])
    starts0, starts1 = ({int(w[0]) for b in rank for w in b} for rank in (rank0, rank1))
    assert starts0.isdisjoint(starts1) and len(starts0) == len(starts1) == 16
    # Data-loader workers do not change the order.
    loader = torch.utils.data.DataLoader(ShuffledBatches(windows, 4, seed=1), batch_size=None, num_workers=2)
    assert same(stream_batches(loader, 6), a[:6])


def test_validation_windows_are_the_same_for_every_run(tmp_path: Path):
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(400))
    data = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"), val_fraction=0.3)
    a = TokenDataModule(data, block_size=16, micro_batch_size=4, seed=0, val_windows=10)
    b = TokenDataModule(data, block_size=16, micro_batch_size=8, seed=7, val_windows=10)  # other seed and batch
    assert len(a.val_set) == 10 and a.val_available > 10
    assert all(torch.equal(a.val_set[i][0], b.val_set[i][0]) for i in range(10))
    assert torch.equal(torch.cat([x for x, _ in a.val_dataloader()]), torch.cat([x for x, _ in b.val_dataloader()]))
    # A resume on data of another tokenizer is refused.
    a.load_state_dict({"global_micro_batches": 8, "micro_batch_size": 4, "tokenizer_sha256": data.tokenizer_sha256})
    with pytest.raises(UserError, match="^resume: the checkpoint was trained with another tokenizer"):
        a.load_state_dict({"global_micro_batches": 8, "tokenizer_sha256": "0" * 64})


def test_too_few_windows_for_a_batch_or_validation_are_one_line(tmp_path: Path):
    (tmp_path / "input.txt").write_text(shakespeare_text(5000))
    data = prepare_local(tmp_path, str(tmp_path / "input.txt"), split="tail", val_fraction=0.1)
    n_train = (data.meta["train_tokens"] - 1) // 16
    TokenDataModule(data, block_size=16, micro_batch_size=n_train, seed=0)
    with pytest.raises(UserError, match=f"training split has {n_train} windows of 17 tokens .*micro_batch_size="):
        TokenDataModule(data, block_size=16, micro_batch_size=n_train + 1, seed=0)
    with pytest.raises(UserError, match="validation split has no window of 1025 tokens"):
        TokenDataModule(data, block_size=1024, micro_batch_size=1, seed=0)


@pytest.mark.parametrize(
    ("there", "message"),
    [
        ("out", "is a file, not a folder"),
        ("out/summary.json", "holds no preparation of xsa-lm (no prepare.json; it holds summary.json)"),
    ],
)
def test_prepare_refuses_a_data_dir_it_did_not_make(there: str, message: str, tmp_path: Path):
    """The shards would mix with another command's files: nothing is written there, not even the lock."""
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(40))
    (tmp_path / there).parent.mkdir(exist_ok=True)
    (tmp_path / there).write_text("{}")
    with pytest.raises(UserError, match=f"^data.dir={tmp_path / 'out'} .*{re.escape(message)}"):
        prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"))
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted({"corpus.jsonl", "out", Path(there).name})


REFUSED_PREPARATIONS = {  # the corpus, prepare's settings, the line; each refusal comes after files were made
    "a tokenizer too small": ("corpus.jsonl", {"build_tokenizer": partial(train_bpe, vocab_size=10)}, "at least 257"),
    # a fraction no hash of 40 documents reaches (0.001 held one out about 4% of the time)
    "no validation document": ("corpus.jsonl", {"val_fraction": 1e-9}, "no document fell into the validation"),
    "a bad JSON array": ("corpus.json", {"shard_documents": 5}, "corpus.json at line 2, column 1 is not valid"),
}


@pytest.mark.parametrize(("corpus", "settings", "message"), REFUSED_PREPARATIONS.values(), ids=REFUSED_PREPARATIONS)
def test_a_refused_preparation_leaves_nothing_that_blocks_the_corrected_one(
    corpus: str, settings: dict, message: str, tmp_path: Path
):
    """Refused after its tokenizer or shards were written: its folder, <out>.partial, and the parent folders made for
    it go; the corrected command then prepares the same data.dir."""
    write_jsonl(tmp_path / "corpus.jsonl", many_docs(40))
    (tmp_path / "corpus.json").write_text("[" + (tmp_path / "corpus.jsonl").read_text())  # cut short: not JSON
    source, out = LocalFiles(str(tmp_path / corpus)), tmp_path / "new" / "out"
    with nothing_left_behind(tmp_path), pytest.raises(UserError, match=message):
        prepare(source, **{"build_tokenizer": BPE, "out": out, "identity": {}, "val_fraction": 0.2, **settings})
    data = prepare_local(tmp_path, str(tmp_path / "corpus.jsonl"), "new/out")  # the corrected settings
    assert data.dir == out and (out / "meta.json").exists() and sorted(p.name for p in out.parent.iterdir()) == ["out"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.val_fraction=0.1", "data.val_fraction=0.1 does not apply here: this corpus validates on whole plays"),
        ("data.split_seed=0", "data.cache_dir={a} (from the environment variable XSA_LM_DATA_DIR): {a} is a file"),
    ],
)
def test_a_refused_command_writes_no_data(override: str, message: str, tmp_path: Path, monkeypatch):
    """The bundled corpus validates on whole plays: a val_fraction there would be recorded but not used. A cache
    folder that is a file is named with where it came from."""
    (tmp_path / "a").write_text("{}\n")
    monkeypatch.setenv("XSA_LM_DATA_DIR", str(tmp_path / "a"))
    spec = parse(TrainSpec, compose_train([*FAST, override]))
    with pytest.raises(UserError, match=f"^{re.escape(message.format(a=tmp_path / 'a'))}"):
        prepare_data(spec.data, spec.tokenizer)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
