"""Generation with a KV cache equals generation without one, for SA and XSA (and GQA, sinks, gates)."""

from types import SimpleNamespace

import pytest
import torch

from xsa_lm.eval.sample import GenerateOptions
from xsa_lm.model import GPT, GPTConfig, KVCache, generate

TINY = dict(n_layer=2, d_model=32, n_head=4, head_dim=8, vocab_size=64, block_size=24)
VARIANTS = {
    "sa": dict(attention="sa"),
    "xsa": dict(attention="xsa"),
    "xsa-gqa-sinks": dict(attention="xsa", n_kv_head=2, n_sinks=2),
    "xsa-gated-last-layer": dict(attention="xsa", xsa_gate=True, xsa_layers=(1,)),
}


def ids_tokenizer(vocab: int) -> SimpleNamespace:
    """A tokenizer of `vocab` tokens for `xsa-lm generate`'s sample(): a character's code modulo vocab; ids as text."""
    return SimpleNamespace(
        encode=lambda text, add_special_tokens=False: SimpleNamespace(ids=[ord(c) % vocab for c in text]),
        decode=lambda ids: " " + " ".join(map(str, ids)),
        get_vocab_size=lambda: vocab,
    )


def model_for(variant: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, **VARIANTS[variant]))
    for p in model.parameters():  # sharper distributions than at init: greedy choices are not near-ties
        p.data.mul_(3.0) if p.dim() >= 2 else None
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_forward_and_generation_equal_uncached(variant: str):
    model = model_for(variant).eval()
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    caches = [KVCache() for _ in model.blocks]
    pieces = [model(idx[:, :12], caches=caches)] + [model(idx[:, t : t + 1], caches=caches) for t in range(12, 20)]
    assert torch.allclose(torch.cat(pieces, dim=1), model(idx), atol=1e-5)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    # 30 new tokens: past block_size (24), so the sliding window is exercised too
    cached = generate(model, prompt, max_new_tokens=30, use_cache=True)
    uncached = generate(model, prompt, max_new_tokens=30, use_cache=False)
    assert torch.equal(cached, uncached) and cached.shape == (2, 35)
    sampled = [
        generate(model, prompt, 10, temperature=0.8, top_k=5, use_cache=c, generator=torch.Generator().manual_seed(3))
        for c in (True, False)
    ]
    assert torch.equal(*sampled)


def test_greedy_generation_is_deterministic_and_sampling_follows_the_seed():
    model = model_for("xsa")
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(4))
    assert torch.equal(generate(model, prompt, 12), generate(model, prompt, 12))
    draw = lambda seed: generate(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw(5), draw(5)) and not torch.equal(draw(5), draw(6))
    top1 = generate(model, prompt, 12, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(7))
    assert torch.equal(top1, generate(model, prompt, 12))  # top_k=1 is greedy
    assert model.training  # generation leaves the mode as it found it
    # A tiny temperature: logits / 1e-39 overflowed to +-inf, and softmax(inf - inf) to NaN; 1e-300 is 0 in fp32
    prompt = torch.zeros(2, 3, dtype=torch.long)
    for temperature in (1e-39, 1e-300):
        drawn = generate(model, prompt, 8, temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert torch.equal(drawn, generate(model, prompt, 8)), temperature


def padded_model() -> GPT:
    """A table padded past a 48-token tokenizer's vocabulary, whose padding rows dominate the logits."""
    model = model_for("sa").eval()
    with torch.no_grad():
        model.lm_head.weight[48:].mul_(20.0)  # tied: the inputs too
    return model


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
    """Ids past the tokenizer's vocabulary decode to nothing, and were drawn where their logits were high."""
    model = padded_model()
    idx = torch.randint(0, 48, (2, 4), generator=torch.Generator().manual_seed(1))
    unmasked = generate(model, idx, 12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert (unmasked[:, 4:] >= 48).any()  # the case this guards against happens here
    for temperature, top_k in ((0.0, None), (1.0, None), (2.0, 60)):
        generator = torch.Generator().manual_seed(0)
        out = generate(model, idx, 12, temperature=temperature, top_k=top_k, generator=generator, vocab_size=48)
        assert (out[:, 4:] < 48).all(), (temperature, top_k, out)


def test_generate_takes_greedy_the_whole_vocabulary_and_an_empty_or_quoted_prompt():
    fine = dict(ckpt="x.ckpt", max_new_tokens=1, temperature=0, top_k=None, num_samples=1, seed=0)
    for prompt in (None, "1e3", ""):  # null: start from <|endoftext|>; "1e3": quoted for Hydra
        assert GenerateOptions.model_validate({**fine, "prompt": prompt}).prompt == prompt


def test_xsa_lm_generate_draws_the_tokenizers_ids_and_sample_i_whatever_num_samples(monkeypatch: pytest.MonkeyPatch):
    """`xsa-lm generate seed=3 num_samples=4` repeats the sample of num_samples=1 as its first, and draws 4 texts,
    of the tokenizer's ids only (48 tokens onto the padded table's 64 ids)."""
    from xsa_lm.eval import sample as sampling

    monkeypatch.setattr(sampling, "load_model", lambda path, key: padded_model())
    monkeypatch.setattr(sampling, "load_tokenizer", lambda path, key: ids_tokenizer(48))
    options = dict(max_new_tokens=12, temperature=1.0, top_k=None, seed=3)
    four = sampling.sample("run.ckpt", "ab", num_samples=4, **options)
    assert sampling.sample("run.ckpt", "ab", num_samples=1, **options) == four[:1]
    assert len(set(four)) == 4 and all(text.startswith("ab ") for text in four)
    assert all(int(i) < 48 for text in four for i in text.split()[1:]), four
