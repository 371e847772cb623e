"""Corpora, tokenizer, token packing and the deterministic, resumable sampling order."""

import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from xsa_lm.data.datamodule import PackedWindows, ShuffledBatches
from xsa_lm.data.prepare import prepare
from xsa_lm.data.sources import ShakespeareCorpus, TextFilesCorpus
from xsa_lm.data.tokenizer import EOT, load_gpt2, load_tokenizer_file, train_bpe
from xsa_lm.errors import UserError

DOCS = ["the quick brown fox jumps over the lazy dog. " * 20, "to be or not to be, that is the question. " * 20]


def write_docs(folder: Path, texts: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (folder / f"doc{i}.txt").write_text(text)


def test_bpe_roundtrip_and_eot_special(tmp_path: Path):
    tok = train_bpe(DOCS * 5, vocab_size=300)
    assert tok.get_vocab_size() <= 300
    text = "to be or not to be, the lazy fox"
    assert tok.decode(tok.encode(text).ids) == text
    eot = tok.token_to_id(EOT)
    assert tok.encode(f"dog{EOT}to").ids.count(eot) == 1
    tok.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer_file(str(tmp_path / "tokenizer.json"))
    assert again.encode(text).ids == tok.encode(text).ids


def test_shakespeare_validation_is_whole_plays():
    corpus = ShakespeareCorpus(val_plays=["macbeth", "the-tempest"])
    val, train = list(corpus.documents("val")), list(corpus.documents("train"))
    assert len(val) == 2 and len(train) == 36
    assert any("MACBETH" in doc for doc in val) and not any("MACBETH" in doc for doc in train)
    assert not any("**" in doc or "_Enter" in doc for doc in val)  # markdown stripped
    with pytest.raises(UserError, match="val_plays"):
        ShakespeareCorpus(val_plays=["no-such-play"])


def test_prepare_packs_documents_with_eot_and_caches(tmp_path: Path):
    write_docs(tmp_path / "corpus", DOCS * 3)
    source = TextFilesCorpus(files=str(tmp_path / "corpus" / "*.txt"), val_fraction=0.34)
    assert len(source.val_files) == 2 and len(source.train_files) == 4
    data = prepare(source, partial(train_bpe, vocab_size=300), str(tmp_path / "cache"), {"tok": "bpe300"})
    train = np.asarray(data.tokens("train"))
    eot = data.meta["eot_id"]
    assert data.dtype == np.uint16 and data.meta["train_documents"] == 4
    assert (train == eot).sum() == 4 and train[-1] == eot
    first_doc = train[: np.argmax(train == eot)].tolist()
    assert data.tokenizer.decode(first_doc) == (tmp_path / "corpus" / source.train_files[0]).read_text()
    assert data.meta["train_tokens"] == len(train)
    # A second call reuses the prepared directory instead of rebuilding it.
    stamp = (data.dir / "train.bin").stat().st_mtime_ns
    again = prepare(source, partial(train_bpe, vocab_size=300), str(tmp_path / "cache"), {"tok": "bpe300"})
    assert again.dir == data.dir and (again.dir / "train.bin").stat().st_mtime_ns == stamp
    other = prepare(source, partial(train_bpe, vocab_size=280), str(tmp_path / "cache"), {"tok": "bpe280"})
    assert other.dir != data.dir


def test_empty_corpus_is_a_user_error(tmp_path: Path):
    write_docs(tmp_path / "corpus", ["", "", ""])
    source = TextFilesCorpus(files=str(tmp_path / "corpus" / "*.txt"), val_fraction=0.34)
    with pytest.raises(UserError, match="no text"):
        prepare(source, partial(train_bpe, vocab_size=300), str(tmp_path / "cache"), {})
    assert not any(p.name.startswith("text-") for p in (tmp_path / "cache").iterdir())  # nothing half-written


def test_missing_files_are_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match="data.source.files"):
        TextFilesCorpus(files=str(tmp_path / "nope" / "*.txt"))


def test_windows_are_shifted_by_one():
    windows = PackedWindows(np.arange(100, dtype=np.uint16), block_size=8)
    assert len(windows) == 12
    x, y = windows[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    assert x.dtype == torch.int64


def stream_batches(stream: ShuffledBatches, n: int) -> list[torch.Tensor]:
    it = iter(stream)
    return [next(it)[0] for _ in range(n)]


def test_sampling_order_is_a_function_of_seed_and_position():
    windows = PackedWindows(np.arange(1000, dtype=np.uint16), block_size=10)  # 99 windows
    a = stream_batches(ShuffledBatches(windows, 4, seed=1), 60)  # > 2 epochs
    b = stream_batches(ShuffledBatches(windows, 4, seed=1), 60)
    c = stream_batches(ShuffledBatches(windows, 4, seed=2), 60)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # every window once per epoch
    firsts = torch.cat(a)[:99, 0].tolist()
    assert sorted(firsts) == [10 * i for i in range(99)]
    # resuming at batch 25 continues exactly
    resumed = stream_batches(ShuffledBatches(windows, 4, seed=1, start_batch=25), 10)
    assert all(torch.equal(x, y) for x, y in zip(resumed, a[25:35], strict=True))


def test_ranks_get_disjoint_interleaved_batches():
    windows = PackedWindows(np.arange(1000, dtype=np.uint16), block_size=10)
    single = stream_batches(ShuffledBatches(windows, 4, seed=0), 8)
    rank0 = stream_batches(ShuffledBatches(windows, 4, seed=0, rank=0, world_size=2), 4)
    rank1 = stream_batches(ShuffledBatches(windows, 4, seed=0, rank=1, world_size=2), 4)
    assert all(torch.equal(x, y) for x, y in zip(rank0, single[0::2], strict=True))
    assert all(torch.equal(x, y) for x, y in zip(rank1, single[1::2], strict=True))


def test_workers_do_not_change_the_order():
    windows = PackedWindows(np.arange(2000, dtype=np.uint16), block_size=10)
    stream = ShuffledBatches(windows, 4, seed=3)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    it = iter(loader)
    with_workers = [next(it)[0] for _ in range(6)]
    assert all(torch.equal(x, y) for x, y in zip(with_workers, stream_batches(stream, 6), strict=True))


def test_gpt2_tokenizer_offline_fails_fast_with_the_alternative(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    start = time.monotonic()
    with pytest.raises(UserError, match="tokenizer.path"):
        load_gpt2()
    assert time.monotonic() - start < 5


def test_gpt2_tokenizer_from_a_local_file(tmp_path: Path):
    train_bpe(DOCS, vocab_size=300).save(str(tmp_path / "tokenizer.json"))
    assert load_gpt2(path=str(tmp_path / "tokenizer.json")).token_to_id(EOT) is not None
    with pytest.raises(UserError, match="not found"):
        load_gpt2(path=str(tmp_path / "missing.json"))
