"""What validation reports beside the mean loss, through Lightning's validate on a real module: bits per byte (the
loss over the UTF-8 bytes its target tokens stand for) and the loss per equal span of window positions, each
against a hand computation; and the byte table of a byte-level BPE against the text it encodes."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import FAST, compose_train
from xsa_lm.config.spec import TrainSpec, parse
from xsa_lm.data.tokenizer import EOT, token_byte_lengths, train_bpe
from xsa_lm.train.run import make_module, make_trainer, set_up_process

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 40


def test_the_byte_table_adds_up_to_the_utf8_bytes_of_the_text() -> None:
    tokenizer = train_bpe([TEXT, "naïve café, déjà vu: ½ ∞ 🙂 " * 20], 300)
    lengths = token_byte_lengths(tokenizer, 320)  # a padded vocabulary: 0 beyond the tokenizer's
    for text in ("naïve café, déjà vu 🙂", "whether 'tis nobler"):
        assert sum(lengths[i] for i in tokenizer.encode(text).ids) == len(text.encode("utf-8"))
    assert lengths[tokenizer.token_to_id(EOT)] == 0 and lengths[319] == 0


# 64 positions: 4 spans of 16, or spans of 22, 21, 21; the loss whole, or 50 tokens at a time (model.loss_chunk)
@pytest.mark.parametrize(("buckets", "chunk"), [(4, 0), (3, 50)])
def test_validation_reports_bits_per_byte_and_the_loss_per_span_of_positions(
    tmp_path, buckets: int, chunk: int
) -> None:
    tokenizer = train_bpe([TEXT], 300)
    overrides = [*FAST, "logger=none", f"val_position_buckets={buckets}", f"model.loss_chunk={chunk}"]
    spec = parse(TrainSpec, compose_train(overrides))
    set_up_process(spec)
    mcfg = spec.gpt_config(tokenizer.get_vocab_size())
    module = make_module(spec, mcfg, token_bytes=token_byte_lengths(tokenizer, mcfg.vocab_size))
    ids = torch.tensor(tokenizer.encode(TEXT).ids)
    windows = [(ids[i : i + 64], ids[i + 1 : i + 65]) for i in range(0, 64 * 6, 64)]
    loader = torch.utils.data.DataLoader(windows, batch_size=4)  # 6 windows: a full batch and a half one
    trainer = make_trainer(spec, tmp_path, callbacks=[], loggers=[])
    logged = trainer.validate(module, dataloaders=loader, verbose=False)[0]

    with torch.no_grad():
        x, y = torch.stack([w[0] for w in windows]), torch.stack([w[1] for w in windows])
        losses = F.cross_entropy(module.model(x).flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    nbytes = sum(len(tokenizer.decode(w[1].tolist()).encode("utf-8")) for w in windows)  # ASCII: no split chars
    assert logged["val/loss"] == pytest.approx(float(losses.mean()), rel=1e-6)
    assert logged["val/bpb"] == pytest.approx(float(losses.sum()) / (math.log(2) * nbytes), rel=1e-6)
    edges = [p * buckets // 64 for p in range(64)]
    expected = [float(losses[:, [p for p in range(64) if edges[p] == b]].mean()) for b in range(buckets)]
    assert module.val_by_position == pytest.approx(expected, rel=1e-6)
    counts = [edges.count(b) for b in range(buckets)]  # weighted by their positions, the spans give the loss back
    overall = sum(c * v for c, v in zip(counts, module.val_by_position, strict=True)) / 64
    assert overall == pytest.approx(logged["val/loss"], rel=1e-6)  # logged as float32
