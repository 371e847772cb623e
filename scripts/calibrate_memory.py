"""Calibrate xsa_lm.train.memory against real blocks and a real training step on this CPU under bf16 autocast.

(a) Bytes a paper_0.7b block saves for the backward per token (SA and XSA, eager and compiled): every tensor that
    autograd keeps (saved_tensors_hooks, each storage once, weights and buffers excluded), at two sequence lengths:
    the difference is the per-token part, the rest autocast's bf16 copies of the block's weights.
(b) A whole training step of a small model: its peak from the CPU allocator (allocator_peak: torch.profiler's
    memory events) above the weights, gradients and AdamW state, and its head alone (the cross-entropy's N x V buffers).
(c) One paper_0.7b XSA output projection's forward and backward (eager fp32, eager under bf16 autocast, compiled):
    the allocator's peak above its inputs against XSA's saved coefficients and backward temporaries plus what SA's
    projection makes too (its output, W_o's gradient and, compiled under autocast, W_o's bf16 copy).
    tests/test_memory_peak.py holds model=tiny's whole step and a small XSA layer to the allocator in make test.

Writes <out>.json and <out>.md: each term measured, estimated, and estimated / measured.

    .venv/bin/python scripts/calibrate_memory.py                 # ~1 min on 2 cores, compile included
    .venv/bin/python scripts/calibrate_memory.py --no-compile    # eager only, seconds
"""

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from xsa_lm.bench.loops import saved_for_backward
from xsa_lm.model import GPT, GPTConfig
from xsa_lm.model.xsa import exclusive_output_projection
from xsa_lm.train import memory

PAPER_07B_BLOCK = {"n_layer": 1, "d_model": 1536, "n_head": 6, "head_dim": 256, "mlp_ratio": 4}
SMALL = {"n_layer": 2, "d_model": 256, "n_head": 4, "head_dim": 64, "mlp_ratio": 4}
SMALL_VOCAB, SMALL_BATCH, SMALL_CONTEXT = 4096, 2, 256
BF16_MIXED = {"compute": 2, "residual": 4}


def allocator_peak(run: Callable[[], object]) -> int:
    """The most bytes the CPU allocator held during `run` beyond what it held before (torch.profiler's `[memory]`
    events; frees of blocks allocated before `run` not counted). CUDA has its own counter."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:  # the public form of the events: the Chrome trace
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    live, peak, ours = 0, 0, set()
    for e in (e["args"] for e in sorted(events, key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))):
        if e["Device Type"] != 0:  # 0: CPU
            continue
        if e["Bytes"] > 0:
            ours.add(e["Addr"])
        elif e["Addr"] in ours:  # else freed by `run` but allocated before it: its size may be a stale record
            ours.remove(e["Addr"])
        else:
            continue
        live += e["Bytes"]
        peak = max(peak, live)
    return peak


def autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def compile_model(model: GPT) -> None:
    """As training compiles it: each block on its own, then the head with the loss; static shapes."""
    for block in model.blocks:
        block.compile(fullgraph=True, dynamic=False)
    model.logits_and_loss = torch.compile(model.logits_and_loss, fullgraph=True, dynamic=False)


def model_of(shape: dict, *, vocab: int, context: int, attention: str, compiled: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, vocab_size=vocab, block_size=context, attention=attention))
    if compiled:
        compile_model(model)
    return model


def block_saved(attention: str, compiled: bool, lengths: tuple[int, int] = (128, 256)) -> dict:
    """(a): one paper_0.7b block, batch 1, at two sequence lengths."""
    model = model_of(PAPER_07B_BLOCK, vocab=64, context=2048, attention=attention, compiled=compiled)
    block = model.blocks[0]

    def measure(T: int) -> int:
        x = torch.randn(1, T, PAPER_07B_BLOCK["d_model"], requires_grad=True)
        cos, sin = model.rope_cos[:T], model.rope_sin[:T]
        with autocast():
            return saved_for_backward(lambda: block(x, cos, sin), model)

    measure(lengths[0])  # compiles (or warms up) outside the measurement
    short, long = measure(lengths[0]), measure(lengths[1])
    per_token = (long - short) / (lengths[1] - lengths[0])
    terms = memory.block_saved_per_token(PAPER_07B_BLOCK, exclusive=attention == "xsa", compiled=compiled, **BF16_MIXED)
    copies = memory.autocast_copies(
        {**PAPER_07B_BLOCK, "n_layer": 1},
        0,
        "bf16-mixed",
        exclusive=attention == "xsa",
        compiled=compiled,
        checkpointing=False,
    )
    return {
        "per_token": {"measured": per_token, "estimated": sum(terms.values()), "terms": terms},
        "weight_copies": {"measured": long - per_token * lengths[1], "estimated": copies},
    }


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def training_step(attention: str, compiled: bool) -> dict:
    """(b): the small model's whole step, and its head alone. Gradients stay allocated between steps
    (zero_grad(set_to_none=False)), as in DDP's buckets."""
    model = model_of(SMALL, vocab=SMALL_VOCAB, context=SMALL_CONTEXT, attention=attention, compiled=compiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = (torch.randint(0, SMALL_VOCAB, (SMALL_BATCH, SMALL_CONTEXT)) for _ in range(2))

    def step() -> None:
        with autocast():
            loss = model(x, y)[1]  # the logits are dropped before the backward, as in training_step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()  # compiles; the AdamW state exists from here on
    step()
    static = tensor_bytes(model.parameters()) + tensor_bytes(p.grad for p in model.parameters())
    static += tensor_bytes(t for state in optimizer.state.values() for t in state.values() if t.dim())
    static += tensor_bytes(model.buffers())
    peak = static + allocator_peak(step)

    def forward() -> torch.Tensor:
        with autocast():
            return model(x, y)[1]

    saved = saved_for_backward(forward, model)
    tokens = SMALL_BATCH * SMALL_CONTEXT
    hidden = torch.randn(SMALL_BATCH, SMALL_CONTEXT, SMALL["d_model"], requires_grad=True)

    def head() -> None:
        with autocast():
            loss = model.logits_and_loss(hidden, y)[1]
        loss.backward()

    head()
    head_peak = allocator_peak(head)
    e = memory.estimate(
        SMALL, SMALL_VOCAB, SMALL_BATCH, SMALL_CONTEXT, "bf16-mixed", exclusive=attention == "xsa", compiled=compiled
    )
    outside = memory.head_saved_per_token(SMALL, SMALL_VOCAB, compiled=compiled, **BF16_MIXED)
    transient = memory.cross_entropy_transient_per_token(SMALL_VOCAB, compute=2, compiled=compiled)
    head_estimate = tokens * (outside["cross_entropy"] + transient + 2 * SMALL["d_model"])  # + its bf16 input
    head_estimate += 2 * SMALL_VOCAB * SMALL["d_model"]  # the head's bf16 weight copy
    return {
        "step_peak": {"measured": peak, "estimated": e.total},
        "saved_with_weight_copies": {"measured": saved, "estimated": e.activations + e.weight_copies},
        "head_peak": {"measured": head_peak, "estimated": head_estimate},
        "estimate": e.as_dict(),
    }


def xsa_temporaries(dtype: torch.dtype, compiled: bool, tokens: int = 512) -> dict:
    """(c): one paper_0.7b XSA output projection (6 heads of 256, batch 1), forward and backward."""
    heads, head_dim, width = PAPER_07B_BLOCK["n_head"], PAPER_07B_BLOCK["head_dim"], PAPER_07B_BLOCK["d_model"]
    torch.manual_seed(0)
    y, v = (torch.randn(1, tokens, heads, 1, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    weight = torch.randn(width, heads * head_dim, requires_grad=True)
    grad_out = torch.randn(1, tokens, width, dtype=dtype)

    def project(y: torch.Tensor, v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return exclusive_output_projection(y, v, weight, None, eps=1e-6, scale=None)

    projection = torch.compile(project, fullgraph=True, dynamic=False) if compiled else project

    def forward_and_backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = projection(y, v, weight)
        out.backward(grad_out)
        y.grad = v.grad = weight.grad = None

    forward_and_backward()  # compiles, and first-call allocations outside the measurement
    compute = dtype.itemsize
    terms = memory.block_saved_per_token(
        PAPER_07B_BLOCK, compute=compute, residual=4, exclusive=True, compiled=compiled
    )
    per_token = terms["xsa"] + memory.xsa_transient_per_token(PAPER_07B_BLOCK, compute=compute, compiled=compiled)
    sa_too = tokens * width * compute + weight.numel() * 4  # the output and W_o's fp32 gradient
    return {"measured": allocator_peak(forward_and_backward), "estimated": tokens * per_token + sa_too}


def rows(results: dict) -> list[tuple[str, float, float]]:
    out = []
    for (attention, mode), r in results["block"].items():
        out.append((f"paper_0.7b block, saved bytes per token ({attention}, {mode})", *pick(r["per_token"])))
        out.append((f"paper_0.7b block, bf16 weight copies ({attention}, {mode})", *pick(r["weight_copies"])))
    for (attention, mode), r in results["step"].items():
        small = f"{attention}, {mode}, B{SMALL_BATCH} x T{SMALL_CONTEXT}"
        out.append((f"small model, saved for backward + weight copies ({small})", *pick(r["saved_with_weight_copies"])))
        out.append((f"small model, head + cross-entropy peak ({small})", *pick(r["head_peak"])))
        out.append((f"small model, training step peak ({small})", *pick(r["step_peak"])))
    for (dtype, mode), r in results["xsa"].items():
        name = f"paper_0.7b XSA output projection, forward + backward peak ({dtype}, {mode}, T512)"
        out.append((name, *pick(r)))
    return out


def pick(entry: dict) -> tuple[float, float]:
    return entry["measured"], entry["estimated"]


def markdown(table: list[tuple[str, float, float]]) -> str:
    lines = [
        f"Measured on CPU (torch {torch.__version__}, bf16 autocast) by scripts/calibrate_memory.py against "
        "xsa_lm.train.memory. Bytes.",
        "",
        "| term | measured | estimated | estimated / measured |",
        "|---|---:|---:|---:|",
    ]
    for name, measured, estimated in table:
        ratio = f"{estimated / measured:.4f}" if measured else "n/a"
        lines.append(f"| {name} | {measured:,.0f} | {estimated:,.0f} | {ratio} |")
    worst = max(abs(estimated / measured - 1) for _, measured, estimated in table if measured)
    lines += ["", f"Every estimate is within {100 * worst:.2f}% of its measurement."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/memory_calibration", help="writes OUT.json and OUT.md")
    parser.add_argument("--no-compile", action="store_true", help="eager only (compiling takes ~1 min on 2 cores)")
    args = parser.parse_args()
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    cases = [(attention, mode) for mode in modes for attention in ("sa", "xsa")]
    dtypes = {"fp32": torch.float32, "bf16 autocast": torch.bfloat16}
    results = {
        "block": {case: block_saved(case[0], compiled=case[1] == "compiled") for case in cases},
        "step": {case: training_step(case[0], compiled=case[1] == "compiled") for case in cases},
        "xsa": {
            (name, mode): xsa_temporaries(dtype, compiled=mode == "compiled")
            for mode in modes
            for name, dtype in dtypes.items()
        },
    }
    table = rows(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    as_json = {kind: {f"{a}/{m}": r for (a, m), r in by_case.items()} for kind, by_case in results.items()}
    as_json["table"] = [{"term": n, "measured": m, "estimated": e} for n, m, e in table]
    out.with_suffix(".json").write_text(json.dumps(as_json, indent=2))
    out.with_suffix(".md").write_text(markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
