"""torch.compile: the model traces as one graph (no graph breaks), XSA becomes one fused kernel each way, training
compiles each block and the head with the loss (as under FSDP2, tests/test_multi_device.py) without renaming a weight,
and generation runs a compiled model eagerly."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from tests.helpers import GATED_GQA
from xsa_lm.model import GPT, GPTConfig, generate, xsa
from xsa_lm.train.module import LMModule, compile_model

pytestmark = pytest.mark.slow  # every test compiles (seconds of CPU each): kept out of make test-fast


@pytest.mark.parametrize(
    "variant",
    [{"attention": "sa"}, {"attention": "xsa"}, {"attention": "xsa", "xsa_gate": True, "n_kv_head": 2, "n_sinks": 1}],
)
def test_the_model_compiles_without_graph_breaks(variant: dict):
    torch._dynamo.reset()
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, head_dim=16, vocab_size=128, block_size=32, **variant))
    idx = torch.randint(0, 128, (2, 32))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def xsa_model() -> GPT:
    """Gated XSA with grouped heads, the gate away from zero so that its gradient is checked too."""
    torch.manual_seed(0)
    config = GPTConfig(**GATED_GQA)
    model = GPT(config)
    with torch.no_grad():
        model.blocks[0].attn.gate.fill_(0.5)
    return model


def compiled_step(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """One compiled (fullgraph) forward and backward: the loss and the code generated meanwhile."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)

    def step() -> torch.Tensor:
        loss = compiled(idx, idx)[1]
        loss.backward()
        return loss

    return run_and_get_code(step)


@pytest.mark.long  # two compiles of a training step (~30 s on 2 cores); the graph-break test above stays in make test
@pytest.mark.parametrize("compiled_body", [False, True])
def test_xsa_runs_as_opaque_custom_ops_in_the_compiled_graph(compiled_body: bool, monkeypatch):
    """Inductor calls XSA's ops as they are: the model's generated code calls them and none of its kernels computes
    XSA's math (an addcmul). The gradients equal the eager model's, with the ops' bodies eager (CPU's) or compiled
    inside them (CUDA's, forced onto CPU here: a torch.compile within a compiled graph's op)."""
    monkeypatch.setattr(xsa, "COMPILED_ON", ("cuda", "cpu") if compiled_body else ("cuda",))
    eager, model = xsa_model(), xsa_model()
    idx = torch.randint(0, 64, (2, 16))
    loss, codes = compiled_step(model, idx)
    forward, backward = [code for code in codes if "torch.ops.xsa_lm" in code]
    assert "torch.ops.xsa_lm.exclusive_output_projection.default" in forward
    assert "torch.ops.xsa_lm.exclusive_backward.default" in backward
    assert "torch.ops.xsa_lm.exclusive.default" in backward  # z recomputed for W_o's gradient, not kept
    assert "addcmul" not in forward + backward
    bodies = [code for code in codes if "torch.ops.xsa_lm" not in code]
    assert len(bodies) == (2 if compiled_body else 0) and all("addcmul" in code for code in bodies)
    eager_loss = eager(idx, idx)[1]
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss)
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_training_compiles_each_block_and_the_head_with_the_loss_keeping_the_weight_names():
    """The blocks share one graph, the head and the cross-entropy have one of their own; the losses and gradients
    are the eager model's, and a checkpoint's names are the same either way."""
    torch._dynamo.reset()
    graphs: list[set[str]] = []

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append({getattr(node.target, "__name__", str(node.target)) for node in graph.graph.nodes})
        return graph.forward  # runs as traced

    config = GPTConfig(n_layer=3, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=16, attention="xsa")
    eager, compiled = GPT(config), GPT(config)
    compiled.load_state_dict(eager.state_dict())
    compile_model(compiled, backend=recording_backend)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    losses = []
    for model in (eager, compiled):
        _, loss = model(idx, idx)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0])
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert len(graphs) == 2, graphs
    assert "scaled_dot_product_attention" in graphs[0] and "cross_entropy" not in graphs[0]
    assert {"layer_norm", "linear", "cross_entropy"} <= graphs[1]


def test_the_module_compiles_for_training_in_place():
    config = GPTConfig(n_layer=2, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=16)
    module = LMModule(config, optimizer=None, scheduler=None, total_steps=1, compile=True)
    assert all(block._compiled_call_impl is not None for block in module.model.blocks)
    assert "logits_and_loss" in vars(module.model)  # the compiled head and loss, on the instance
    eager = LMModule(config, optimizer=None, scheduler=None, total_steps=1, compile=False)
    assert all(block._compiled_call_impl is None for block in eager.model.blocks)
    assert list(module.state_dict()) == list(eager.state_dict())


def test_generation_runs_a_compiled_model_eagerly():
    """Each generated token is a call of another length: compiling each would cost far more than it saves."""
    torch._dynamo.reset()
    counters.clear()
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=16, attention="xsa"))
    prompt = torch.randint(0, 64, (1, 4))
    expected = generate(model, prompt, max_new_tokens=4)
    compile_model(model)  # in place, as LMModule(compile=True) does
    assert torch.equal(generate(model, prompt, max_new_tokens=4), expected)
    assert not counters["stats"]["unique_graphs"]
