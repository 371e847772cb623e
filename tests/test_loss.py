"""The chunked cross-entropy (model.loss_chunk, xsa_lm/model/loss.py) against the plain one over the whole logits:
the same loss and gradients, the same per-token losses, and the memory the plan counts for it, measured."""

import sys
from dataclasses import asdict

import pytest
import torch

from tests.helpers import REPO
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.train import memory

sys.path.insert(0, str(REPO / "scripts"))
from calibrate_memory import allocator_peak  # noqa: E402 - a script's, imported from its folder

SMALL = dict(n_layer=1, d_model=32, n_head=2, head_dim=16, vocab_size=320, block_size=24)


def plain_and_chunked(chunk: int, **shape) -> tuple[GPT, GPT]:
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**{**SMALL, **shape}))
    chunked = GPT(GPTConfig(**{**SMALL, **shape}, loss_chunk=chunk))
    chunked.load_state_dict(plain.state_dict())
    return plain, chunked


def batch(vocab_size: int = SMALL["vocab_size"]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, vocab_size, (3, 24), generator=g), torch.randint(0, vocab_size, (3, 24), generator=g)
    y[0, :5], y[2, -1] = -1, -1  # ignored targets, in a chunk of their own and beside counted ones
    return x, y


def loss_and_grads(model: GPT, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits, loss = model(x, y)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


# 72 tokens: chunks of 5 (the last one of 2), of 24, and of all of them at once
@pytest.mark.parametrize("chunk", [5, 24, 100])
@pytest.mark.parametrize(("bf16", "tolerance"), [(False, 1e-6), (True, 1e-2)])
def test_chunked_loss_and_gradients_are_the_plain_ones(chunk: int, bf16: bool, tolerance: float):
    """fp32: within 1e-6 (the order of the sums differs); bf16: the 16-bit rounding of the logits and gradients."""
    plain, chunked = plain_and_chunked(chunk)
    x, y = batch()
    expected, expected_grads = loss_and_grads(plain, x, y, bf16)
    loss, grads = loss_and_grads(chunked, x, y, bf16)
    assert abs(loss - expected) <= 1e-6
    for name, grad in expected_grads.items():
        assert (grads[name] - grad).abs().max() <= tolerance * grad.abs().max(), name


def test_chunked_loss_returns_no_logits_and_gives_the_same_token_losses():
    plain, chunked = plain_and_chunked(7, n_sinks=2)
    x, y = batch()
    logits, _ = plain(x, y)
    assert logits.shape == (3, 24, SMALL["vocab_size"]) and chunked(x, y)[0] is None  # never formed whole
    expected = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1, reduction="none")
    for model in (plain, chunked):
        assert torch.allclose(model.token_losses(x, y), expected, rtol=0, atol=1e-6)  # 0 where ignored, too


@pytest.mark.long  # 7 s: the first compile in a process
def test_chunked_loss_compiles_whole():
    _, chunked = plain_and_chunked(16)
    x, y = batch()
    expected, expected_grads = loss_and_grads(chunked, x, y, bf16=False)
    chunked.zero_grad()
    chunked.logits_and_loss = torch.compile(chunked.logits_and_loss, backend="aot_eager", fullgraph=True)
    loss, grads = loss_and_grads(chunked, x, y, bf16=False)
    assert torch.equal(loss, expected) and all(torch.equal(grads[n], g) for n, g in expected_grads.items())


def test_a_second_backward_is_refused_not_scaled_twice():
    _, chunked = plain_and_chunked(16)
    _, loss = chunked(*batch())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def measured_step(config: GPTConfig, precision: str, x: torch.Tensor, y: torch.Tensor) -> int:
    """The bytes a training step's forward and backward hold at their peak, gradients and weights included."""
    torch.manual_seed(0)
    model = GPT(config)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the gradients exist: an accumulating step

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model(x, y)[1]
        loss.backward()

    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), x, y])
    return held + sum(p.grad.numel() * 4 for p in model.parameters()) + allocator_peak(step)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("chunk", [0, 5, 24, 200])
def test_the_plan_counts_the_chunked_loss_as_the_allocator_does(chunk: int, precision: str):
    """A small model's step, with chunks smaller and larger than d_model and than the batch: the plan's bytes."""
    config = GPTConfig(**SMALL, loss_chunk=chunk)
    x, y = batch()
    plan = memory.estimate(asdict(config), config.vocab_size, 3, 24, precision)
    assert 0 <= measured_step(config, precision, x, y) - (plan.total - plan.optimizer) <= 1024


@pytest.mark.long  # 6 s
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_chunked_loss_lowers_the_measured_peak_at_tiny_with_gpt2s_vocabulary(precision: str):
    """model=tiny, vocabulary 50,304, two sequences of 128 tokens: the allocator's peak of a training step's forward
    and backward, whole logits and 64 tokens at a time, each as the plan counts it. (The chunked loss holds the
    output weight's fp32 gradient from its forward on: it pays where the tokens outnumber d_model.)"""
    x, y = (torch.randint(0, 50304, (2, 128), generator=torch.Generator().manual_seed(i)) for i in range(2))
    peaks = {}
    for chunk in (0, 64):
        config = GPTConfig(vocab_size=50304, loss_chunk=chunk)  # model=tiny: GPTConfig's defaults
        peaks[chunk] = measured_step(config, precision, x, y)
        plan = memory.estimate(asdict(config), 50304, 2, 128, precision)
        assert 0 <= peaks[chunk] - (plan.total - plan.optimizer) <= 1024, (chunk, peaks[chunk], plan)
    assert peaks[64] < 0.75 * peaks[0], peaks  # fp32: 0.58, bf16: 0.70
