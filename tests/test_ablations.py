"""The ablation knobs: XSA on some layers, the tanh gate, grouped-query attention and attention sinks."""

import pytest
import torch

from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.xsa import exclusive_layers

TINY = dict(n_layer=3, d_model=32, n_head=4, head_dim=8, vocab_size=64, block_size=16)


def twin(reference: GPT, **changes) -> GPT:
    """A model with other settings and the reference's weights (state dicts match where parameters exist)."""
    model = GPT(GPTConfig(**{**TINY, **changes}))
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("attn.gate") for k in missing)
    return model


def loss_and_grads(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits, loss = model(idx, idx)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "gate" not in n}
    return logits.detach(), loss.detach(), grads


@pytest.fixture
def idx() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_gate_at_zero_reproduces_sa_outputs_and_gradients_exactly(idx: torch.Tensor):
    torch.manual_seed(0)
    sa = GPT(GPTConfig(**TINY, attention="sa"))
    gated = twin(sa, attention="xsa", xsa_gate=True)
    (l1, loss1, g1), (l2, loss2, g2) = loss_and_grads(sa, idx), loss_and_grads(gated, idx)
    assert torch.equal(l1, l2) and torch.equal(loss1, loss2)
    assert g1.keys() == g2.keys() and all(torch.equal(g1[k], g2[k]) for k in g1)
    gates = [p for n, p in gated.named_parameters() if n.endswith("attn.gate")]
    assert len(gates) == 3 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates)  # it can learn
    with torch.no_grad():
        for p in gates:
            p.fill_(100.0)  # tanh(100) = 1: the full XSA projection
    full = twin(sa, attention="xsa")
    assert torch.allclose(gated(idx), full(idx), atol=1e-5)


def test_xsa_on_some_layers_differs_from_sa_and_its_layers_resolve(idx: torch.Tensor):
    torch.manual_seed(0)
    sa = GPT(GPTConfig(**TINY, attention="sa"))
    last = twin(sa, attention="xsa", xsa_layers=(2,))
    assert [b.attn.exclusive for b in last.blocks] == [False, False, True]
    assert not torch.allclose(sa(idx), last(idx))
    assert exclusive_layers("all", 12) == tuple(range(12)) and exclusive_layers(3, 12) == (9, 10, 11)
    assert exclusive_layers([5, 0], 12) == (0, 5)
    with pytest.raises(ValueError, match="last N layers"):
        exclusive_layers(13, 12)
    with pytest.raises(ValueError, match="puts XSA on no layer"):
        exclusive_layers([], 12)
    with pytest.raises(ValueError, match=r"attention.layers=\[3\]: each layer is a 0-based index below"):
        GPTConfig(**TINY, attention="xsa", xsa_layers=(3,))


@pytest.mark.parametrize("attention", ["sa", "xsa"])
def test_gqa_equals_mha_with_kv_heads_repeated(attention: str, idx: torch.Tensor):
    torch.manual_seed(0)
    gqa = GPT(GPTConfig(**TINY, attention=attention, n_kv_head=2))
    mha = GPT(GPTConfig(**TINY, attention=attention))
    state = gqa.state_dict()
    H, H_kv, D, G = 4, 2, 8, 2
    for layer in range(TINY["n_layer"]):
        w = state[f"blocks.{layer}.attn.qkv.weight"]  # rows: q (H*D), k (H_kv*D), v (H_kv*D)
        q, k, v = w.split([H * D, H_kv * D, H_kv * D])
        repeat = lambda t: t.view(H_kv, D, -1).repeat_interleave(G, dim=0).reshape(H * D, -1)  # noqa: E731
        state[f"blocks.{layer}.attn.qkv.weight"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(state)
    assert torch.allclose(gqa(idx), mha(idx), atol=1e-5)
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())


def test_sinks_keep_output_shape_and_mask_the_loss(idx: torch.Tensor):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="xsa", n_sinks=4))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 64)  # predictions for the tokens only, never for the sinks
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 64), idx.view(-1))
    assert torch.allclose(loss, expected)
    loss.backward()
    assert model.sinks.shape == (4, 32) and model.sinks.grad.abs().sum() > 0  # tokens attend to the sinks
    # the sinks see no token: changing the last token leaves the first tokens' logits unchanged (causality holds)
    other = idx.clone()
    other[:, -1] = (other[:, -1] + 1) % 64
    assert torch.allclose(model(idx)[:, :-1], model(other)[:, :-1], atol=1e-6)
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(**TINY, n_kv_head=3)
