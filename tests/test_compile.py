"""torch.compile: the model traces as one graph (no graph breaks), XSA becomes one fused kernel each way, training
compiles each block and the head with the loss (as under FSDP2, tests/test_multi_device.py) without renaming a weight,
and generation runs a compiled model eagerly."""

import importlib.util
import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from tests.helpers import REPO
from xsa_lm.model import GPT, GPTConfig, exclusive_projection, generate
from xsa_lm.train.module import LMModule, compile_model

pytestmark = pytest.mark.slow  # every test compiles (seconds of CPU each): kept out of make test-fast

# Inductor names its generated kernels cpp_fused_* on CPU and triton_*_fused_* on GPU.
KERNEL = re.compile(r"^(?:cpp_fused_\w+|triton_\w+_fused_\w+) = ", re.MULTILINE)


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


def test_inductor_fuses_xsa_into_one_kernel_forward_and_one_backward():
    torch._dynamo.reset()
    y, v = torch.randn(2, 4, 32, 16, requires_grad=True), torch.randn(2, 4, 32, 16, requires_grad=True)
    grad = torch.randn(2, 4, 32, 16)
    compiled = torch.compile(exclusive_projection)

    def forward_backward() -> torch.Tensor:
        z = compiled(y, v)
        z.backward(grad)
        return z

    z, (forward_code, backward_code) = run_and_get_code(forward_backward)
    assert len(KERNEL.findall(forward_code)) == 1, forward_code
    assert len(KERNEL.findall(backward_code)) == 1, backward_code
    compiled_grads = y.grad.clone(), v.grad.clone()
    y.grad = v.grad = None
    eager = exclusive_projection(y, v)
    eager.backward(grad)
    torch.testing.assert_close(z, eager)
    torch.testing.assert_close(compiled_grads, (y.grad, v.grad))


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


def bench_xsa_epilogue():
    """scripts/bench_xsa_epilogue.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_xsa_epilogue", REPO / "scripts" / "bench_xsa_epilogue.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiled_xsa_adds_no_more_kernels_and_bytes_than_it_needs():
    """A compiled XSA attention layer against a compiled SA layer of the same shape (grouped heads): at most one
    kernel more each way, and no more bytes allocated or kept for the backward than z, grad_y and two fp32 numbers
    per token and head (the bound derived in the script). The forward computed by an op inductor cannot see into (a
    torch.library custom op, as a hand-written kernel would be) allocates 10x the bound and adds no generated kernel:
    this fails."""
    bench = bench_xsa_epilogue()
    shape = {"batch": 1, "seq": 16, "heads": 2, "kv_heads": 1, "head_dim": 16}
    report = bench.compare(shape, gate=False, modes=("compiled",))
    rows = [row for row in report["rows"] if row["bound"] is not None]
    assert len(rows) == 5
    for row in rows:
        assert row["added"] <= row["bound"], row
    kernels = {row["pass"]: row["added"] for row in rows if row["metric"] == "kernels"}
    assert kernels["forward"] == 1  # it did add the XSA kernel: the measurement sees it
