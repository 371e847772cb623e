"""Shapes, presets and initialisation of the GPT."""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from xsa_lm.model import GPT, GPTConfig

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "model"


def preset(name: str, **overrides) -> GPTConfig:
    """The preset as Hydra composes it (a preset may build on another through its defaults list)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="xsa_lm.configs", version_base="1.3"):
        fields = OmegaConf.to_container(compose(config_name="train", overrides=[f"model={name}"]).model)
    fields.pop("name")
    fields["vocab_size"] = fields["vocab_size"] or 50304
    return GPTConfig(**{**fields, **overrides})


@pytest.mark.parametrize("name, expected_billions", [("paper_0.7b", 0.68), ("paper_1.4b", 1.41), ("paper_2.7b", 2.68)])
def test_paper_presets_match_table_1(name: str, expected_billions: float):
    config = preset(name)
    with torch.device("meta"):  # no memory is allocated for billions of parameters
        model = GPT(config)
    n = model.num_params()
    assert round(n / 1e9, 2) == expected_billions
    # the paper's formula: per layer 4 d (n_head head_dim) + 8 d^2, plus LayerNorm weights
    d, inner = config.d_model, config.n_head * config.head_dim
    norms = (2 * config.n_layer + 2) * d
    assert n == config.n_layer * (4 * d * inner + 8 * d * d) + norms


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESETS.glob("[!_]*.yaml")))
def test_every_preset_builds_with_expected_shapes(name: str):
    config = preset(name)
    with torch.device("meta"):
        model = GPT(config)
        logits, loss = model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, config.vocab_size)
    assert loss.shape == ()


def test_gpt2_124m_has_124m_parameters_with_the_gpt2_vocab():
    with torch.device("meta"):
        model = GPT(preset("gpt2_124m"))
    assert round(model.num_params(non_embedding=False) / 1e6) == 124


@pytest.mark.parametrize("attention", ["sa", "xsa"])
def test_forward_returns_logits_or_logits_and_loss(attention: str):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=128, block_size=16, attention=attention)
    )
    idx = torch.randint(0, 128, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 128)
    logits2, loss = model(idx, torch.randint(0, 128, (3, 16)))
    torch.testing.assert_close(logits, logits2)
    assert abs(loss.item() - math.log(128)) < 0.5  # near-uniform predictions at init
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tied_embeddings_no_biases_and_init():
    config = GPTConfig(n_layer=8, d_model=256, n_head=4, head_dim=64, vocab_size=1024, block_size=32)
    model = GPT(config)
    assert model.lm_head.weight is model.wte.weight
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert abs(model.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert abs(model.blocks[0].attn.proj.weight.std().item() - residual) < 0.001
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - residual) < 0.001
    assert model.blocks[0].mlp.fc.weight.shape == (4 * 256, 256)
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 4 * 64, 256)


def test_sa_and_xsa_share_parameters_and_differ_in_output():
    """XSA adds no parameters: the same state dict loads into both; only the attention step differs."""
    torch.manual_seed(0)
    sa = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=8))
    xsa = GPT(GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=8, attention="xsa"))
    xsa.load_state_dict(sa.state_dict())
    idx = torch.randint(0, 64, (2, 8))
    assert not torch.allclose(sa(idx), xsa(idx))


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="attention"):
        GPTConfig(attention="foo")
    with pytest.raises(ValueError, match="head_dim"):
        GPTConfig(head_dim=33)


@pytest.mark.parametrize(
    "changes",
    [dict(attention="sa"), dict(attention="xsa"), dict(attention="xsa", n_kv_head=2, n_sinks=2)],
    ids=["sa", "xsa", "xsa-gqa-sinks"],
)
def test_flops_per_token_match_torch_flop_counter(changes: dict):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, head_dim=16, vocab_size=256, block_size=32, **changes))
    x = torch.randint(0, 256, (3, 32))
    # The math backend: its matmuls are counted (the fused CPU kernel is not known to the counter).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    assert counter.get_total_flops() == pytest.approx(model.flops_per_token(32) * x.numel(), rel=1e-9)
