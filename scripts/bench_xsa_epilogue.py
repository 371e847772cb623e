"""What XSA's epilogue costs on CPU: the kernels and the allocations a compiled (inductor) XSA attention layer adds to
a compiled SA layer of the same shape, against the least any XSA step adds; and the same for eager layers.

    .venv/bin/python scripts/bench_xsa_epilogue.py [--batch 2 --seq 64 --heads 4 --kv-heads 2 --head-dim 16] [--gate]
        [--mode both|compiled|eager] [--out xsa_epilogue.json]

Each arm is one attention layer with bf16 parameters and input (as FSDP2's bf16 parameters run it), compiled with
fullgraph=True or eager, then one forward and one backward under torch.profiler (profile_memory=True, inductor's
kernels recorded as ops). Per arm and pass:
- kernels: compiled, the generated kernels run plus the library kernels the compiled code calls (matmuls, SDPA);
  eager, the aten ops that compute;
- allocated: bytes the CPU allocator hands out; peak: the most it holds at once above what it held when the pass
  began; held_after: what it still holds when the pass ends (after the forward: its output and what the backward
  keeps).

The least XSA adds compiled (the bound column; E_y = B T H D bf16 elements, y's bytes): the forward one kernel, which
reads y and v and writes z, allocating z (E_y, W_o's input); the backward one kernel, which reads grad_z, y and v and
writes grad_y (E_y: SDPA's backward takes it beside the matmul's grad_z), the gradient of v summed into the kernel that
writes the qkv gradient, which SA runs too. z is kept for W_o's weight gradient (E_y held after the forward: recomputing
it would cost the backward a write of E_y). Each pass may add up to two fp32 numbers per token and head (8 B T H bytes:
the coefficients (y . v) / n and 1 / n kept for the backward, (g . v) / n in it). Inductor can fuse XSA's kernel with
a neighbour that SA runs alone, so XSA may add less. Nothing else: no fp32 copy of y, v or a gradient. Eager has no
bound here. A compile takes ~10-25 s per arm on 2 cores.
"""

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from xsa_lm.model import GPTConfig
from xsa_lm.model.attention import attention_layer, rope_tables

BYTES = 2  # bf16
LIBRARY_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")
GENERATED_KERNEL = ("cpp_fused_", "triton_")
NOT_KERNELS = set(  # eager ops that compute nothing: views and allocations
    "aten::empty aten::empty_strided aten::empty_like aten::view aten::as_strided aten::reshape aten::_unsafe_view "
    "aten::_reshape_alias aten::transpose aten::t aten::unsqueeze aten::squeeze aten::permute aten::expand "
    "aten::slice aten::split aten::split_with_sizes aten::unflatten aten::flatten aten::select aten::detach "
    "aten::alias aten::lift_fresh aten::result_type aten::resolve_conj aten::resolve_neg".split()
)


def walk(nodes: list) -> Iterator:
    for node in nodes:
        yield node
        yield from walk(node.children)


def pass_counts(prof: profile, name: str, *, compiled: bool) -> dict[str, int]:
    """Kernels run inside the record_function `name`, the bytes the CPU allocator handed out there, the most it held
    at once beyond what it held when the pass began, and what it still held when the pass ended."""
    root = next(n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.name == name)
    kernels = allocated = held = peak = 0
    for node in walk(root.children):
        if node.typed[0] == _EventType.Allocation:
            size = node.typed[1].alloc_size
            allocated += max(size, 0)
            held += size
            peak = max(peak, held)
        elif is_kernel(node, compiled=compiled):
            kernels += 1
    return {"kernels": kernels, "allocated": allocated, "peak": peak, "held_after": held}


def is_kernel(node, *, compiled: bool) -> bool:
    """Compiled: a generated kernel, or a library kernel the compiled code calls. Eager: an aten op that computes (a
    leaf that is neither a view nor an allocation)."""
    name = node.name
    if compiled:
        return any(k in name for k in GENERATED_KERNEL) or name.startswith(LIBRARY_KERNELS)
    leaf = not any(child.name.startswith("aten::") for child in node.children)
    return leaf and name.startswith("aten::") and name not in NOT_KERNELS


def measure(attention: str, shape: dict, *, gate: bool, compiled: bool) -> dict[str, dict[str, int]]:
    """One forward and backward of a bf16 attention layer, compiled or eager: kernels and allocations per pass."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    B, T, H, H_kv, D = (shape[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
    config = GPTConfig(
        d_model=H * D, n_head=H, n_kv_head=H_kv, head_dim=D, block_size=T, attention=attention, xsa_gate=gate
    )
    layer = attention_layer(config, 0).to(torch.bfloat16)
    if getattr(layer, "gate", None) is not None:  # XSA with gate=tanh
        torch.nn.init.normal_(layer.gate)  # a nonzero gate, so its gradient is not trivially zero
    run = torch.compile(layer, fullgraph=True) if compiled else layer
    cos, sin = rope_tables(T, D)
    x = torch.randn(B, T, H * D, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, T, H * D, dtype=torch.bfloat16)

    def step() -> None:
        with torch.profiler.record_function("forward"):
            out = run(x, cos, sin)
        with torch.profiler.record_function("backward"):
            out.backward(grad)

    # Each generated kernel shows in the profile as an op.
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        step()  # compiles the forward, then the backward
        for t in (x, *layer.parameters()):
            t.grad = None  # so that the profiled step writes its gradients instead of adding to them
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    return {name: pass_counts(prof, name, compiled=compiled) for name in ("forward", "backward")}


def bound(shape: dict) -> dict[str, dict[str, int | None]]:
    """The most a compiled XSA layer should add to SA's, per pass (derived in the module docstring): one kernel each
    way; z (E_y) allocated in the forward and kept for the backward, grad_y (E_y) beside grad_z in the backward; and
    per token and query head up to two fp32 numbers (the coefficients (y . v) / n and 1 / n, and in the backward
    (g . v) / n)."""
    tokens, heads = shape["batch"] * shape["seq"], shape["heads"]
    e_y = BYTES * tokens * heads * shape["head_dim"]
    rows = 2 * 4 * tokens * heads
    return {
        "forward": {"kernels": 1, "allocated": e_y + rows, "peak": None, "held_after": e_y + rows},
        "backward": {"kernels": 1, "allocated": e_y + rows, "peak": None, "held_after": None},
    }


METRICS = ("kernels", "allocated", "peak", "held_after")


def compare(shape: dict, *, gate: bool, modes: tuple[str, ...]) -> dict:
    """SA and XSA of the same shape, compiled and/or eager: each metric, what XSA adds, and (compiled) its bound."""
    rows = []
    for mode in modes:
        compiled = mode == "compiled"
        sa = measure("sa", shape, gate=False, compiled=compiled)
        xsa = measure("xsa", shape, gate=gate, compiled=compiled)
        most = bound(shape)
        for phase in ("forward", "backward"):
            for metric in METRICS:
                rows.append(
                    {
                        "mode": mode,
                        "pass": phase,
                        "metric": metric,
                        "sa": sa[phase][metric],
                        "xsa": xsa[phase][metric],
                        "added": xsa[phase][metric] - sa[phase][metric],
                        "bound": most[phase][metric] if compiled else None,
                    }
                )
    return {"shape": shape, "gate": gate, "torch": torch.__version__, "rows": rows}


def print_table(report: dict) -> None:
    s = report["shape"]
    gated = ", gated" if report["gate"] else ""
    print(
        f"XSA epilogue on CPU, bf16{gated}: B {s['batch']} T {s['seq']} H {s['heads']} H_kv {s['kv_heads']} "
        f"D {s['head_dim']} (bytes; kernels: generated + library, eager: aten ops)"
    )
    print(f"{'mode':<9} {'pass':<9} {'metric':<11} {'SA':>10} {'XSA':>10} {'XSA adds':>10} {'bound':>10}")
    for r in report["rows"]:
        most = "-" if r["bound"] is None else r["bound"]
        print(
            f"{r['mode']:<9} {r['pass']:<9} {r['metric']:<11} {r['sa']:>10} {r['xsa']:>10} {r['added']:>10} {most:>10}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--gate", action="store_true", help="the gated variant (z = y - tanh(alpha) x projection)")
    parser.add_argument("--mode", choices=("both", "compiled", "eager"), default="both")
    parser.add_argument("--out", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    shape = {
        "batch": args.batch,
        "seq": args.seq,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
    }
    report = compare(shape, gate=args.gate, modes=("compiled", "eager") if args.mode == "both" else (args.mode,))
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
