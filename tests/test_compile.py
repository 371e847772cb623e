"""torch.compile: the model traces as one graph (no graph breaks), XSA becomes one fused kernel each way, and
generation runs a compiled model eagerly."""

import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from xsa_lm.model import GPT, GPTConfig, exclusive_projection, generate

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


def test_generation_runs_a_compiled_model_eagerly():
    """Each generated token is a call of another length: compiling each would cost far more than it saves."""
    torch._dynamo.reset()
    counters.clear()
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, head_dim=16, vocab_size=64, block_size=16, attention="xsa"))
    prompt = torch.randint(0, 64, (1, 4))
    expected = generate(model, prompt, max_new_tokens=4)
    model.compile()  # in place, as LMModule(compile=True) does
    assert torch.equal(generate(model, prompt, max_new_tokens=4), expected)
    assert not counters["stats"]["unique_graphs"]
