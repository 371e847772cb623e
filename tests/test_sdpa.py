"""The attention kernel chosen on purpose: config `sdpa_backends` resolved per device, applied around training (and
compiled code), checked in one line, and the kernel actually run recorded in run_info.json and the run's header."""

import json
import logging
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import FAST, compose_train, train_from
from xsa_lm.config.spec import VALUES_ONLY, TrainSpec, parse
from xsa_lm.errors import UserError
from xsa_lm.model import xsa
from xsa_lm.model.sdpa import backend_used, resolve, sdpa_backends
from xsa_lm.train.callbacks import AttentionKernels

CPU = torch.device("cpu")
SHAPE = dict(heads=4, seq=64, head_dim=32, device=CPU)


def used(dtype: torch.dtype = torch.float32, **shape) -> str:
    return backend_used(**{**SHAPE, **shape}, dtype=dtype)


def test_auto_on_cpu_is_the_two_cpu_kernels_and_runs_flash():
    assert resolve("auto", CPU) == ["flash", "math"]
    with sdpa_backends(resolve("auto", CPU)):
        assert used() == "flash" and used(torch.bfloat16, kv_heads=2) == "flash"


def test_math_only_runs_the_math_kernel():
    with sdpa_backends(resolve(["math"], CPU)):
        assert used() == "math" and used(torch.bfloat16, kv_heads=2) == "math"
    assert used() == "flash"  # torch's own choice again after the block


def test_names_the_device_lacks_are_left_out_and_none_is_refused():
    assert resolve(["cudnn", "efficient", "math"], CPU) == ["math"]
    assert resolve("math", CPU) == ["math"]  # one name: that kernel alone
    with pytest.raises(UserError, match=r"none of these kernels exists on cpu \(it has flash, math\)"):
        resolve(["cudnn"], CPU)


def test_the_order_joins_the_compile_cache_key():
    """torch's compile caches would otherwise give a process asking for math the graph traced under flash."""
    before = torch.compiler.config.cache_key_tag
    with sdpa_backends(["math"]):
        math_tag = torch.compiler.config.cache_key_tag
    with sdpa_backends(["flash", "math"]):
        flash_tag = torch.compiler.config.cache_key_tag
    assert "math" in math_tag and math_tag != flash_tag and torch.compiler.config.cache_key_tag == before
    assert f"xsa={xsa.SOURCE_KEY}" in math_tag  # and the version of XSA's ops


def test_a_compiled_call_takes_the_kernel_of_the_order_it_was_traced_in():
    """AOT tracing (as under inductor) picks the kernel: the graph holds flash's op only where flash was allowed."""

    def graph_ops(order: list[str]) -> set[str]:
        torch._dynamo.reset()
        found: set[str] = set()

        def backend(gm, example_inputs):
            from torch._functorch.aot_autograd import aot_module_simplified

            def record(graph, _):
                found.update(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
                return graph

            return aot_module_simplified(gm, example_inputs, fw_compiler=record)

        attend = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend=backend)
        with sdpa_backends(order):
            attend(torch.zeros(1, 2, 8, 16, requires_grad=True))
        torch._dynamo.reset()
        return found

    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in graph_ops(["flash", "math"])
    assert not any("flash" in op for op in graph_ops(["math"]))


def test_the_callback_applies_the_order_from_setup_to_teardown():
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=CPU))
    kernels = AttentionKernels(["math"])
    kernels.setup(trainer, None, stage="fit")  # type: ignore[arg-type]  # the callback reads the strategy's device
    assert used() == "math"
    kernels.teardown(trainer, None, stage="fit")  # type: ignore[arg-type]
    assert used() == "flash"
    kernels.setup(trainer, None, stage="validate")  # type: ignore[arg-type]  # the last step's validation
    kernels.on_exception(trainer, None, RuntimeError())  # type: ignore[arg-type]  # Lightning skips teardown then
    assert used() == "flash"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("[flsh,math]", "sdpa_backends=['flsh', 'math'] names no kernel: flsh (it takes auto or a list of cudnn,"),
        ("[]", "sdpa_backends=[] must be auto or a list of cudnn, flash, efficient, math"),
        ("fast", "sdpa_backends=fast must be auto or a list of cudnn, flash, efficient, math"),
    ],
)
def test_a_bad_name_is_refused_in_one_line(value: str, expected: str):
    """By the config's rules, before the data is prepared or anything is written."""
    with pytest.raises(UserError) as refused:
        parse(TrainSpec, compose_train([*FAST, f"sdpa_backends={value}"]), VALUES_ONLY)
    assert expected in str(refused.value) and "\n" not in str(refused.value), refused.value


@pytest.mark.slow
def test_a_run_records_and_runs_its_kernel(data_cache: Path, tmp_path: Path, monkeypatch, caplog):
    """sdpa_backends=[math]: run_info.json and the header say math, and the profiled training step ran math's ops."""
    monkeypatch.setenv("XSA_LM_DATA_DIR", str(data_cache))
    monkeypatch.setattr(sys, "argv", ["xsa-lm", "train"])
    run_dir = tmp_path / "run"
    steps = ["trainer.max_steps=2", "val_every_steps=2", "profile.start_step=1", "profile.steps=1"]
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="xsa_lm"):
        warnings.simplefilter("ignore")
        train_from(compose_train([*FAST, *steps, "sdpa_backends=[math]"]), run_dir)
    assert json.loads((run_dir / "run_info.json").read_text())["sdpa"] == {"order": ["math"], "used": "math"}
    assert "attention kernel math (sdpa_backends: math)" in caplog.text
    trace = next((run_dir / "profile").glob("*.json")).read_text()
    assert "aten::_scaled_dot_product_attention_math" in trace and "flash_attention_for_cpu" not in trace
