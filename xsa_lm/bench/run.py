"""`xsa-lm bench`: one process, interleaved comparisons, a table on the terminal and a JSON file.

1. SA vs XSA: two persistent models from the same seed, alternating in short rounds: step time ratio; then the
   peak memory of a training step of each.
2. Lightning vs plain: fresh fits of LMModule against the hand-written loop, alternating: throughput ratio.
3. tokens/s and MFU of the trainer (Lightning, SA): FLOPs per token from the model's formula (torch's flop
   counter next to it) over the device's peak (datasheet for GPUs, a measured matmul on CPU).
"""

import json
import logging
import os
import time
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from xsa_lm.bench.hardware import device_name, peak_flops
from xsa_lm.bench.loops import (
    PlainTrainer,
    Setup,
    compare,
    counted_flops_per_token,
    fit_lightning,
    make_batches,
    peak_memory,
    step_times,
)
from xsa_lm.errors import UserError, build, exit_on_user_error
from xsa_lm.train.host_memory import reuse_freed_host_memory
from xsa_lm.train.run import model_config, resolve_precision
from xsa_lm.train.runinfo import run_info

TARGETS = {  # issue 7: XSA within noise of SA; Lightning as fast as a hand-written loop
    "xsa_over_sa_step_time": {"cpu": 1.02, "cuda": 1.01},
    "lightning_over_plain_throughput": 0.97,
}
SMOKE = {"rounds": 2, "steps": 2, "loop_rounds": 2, "loop_steps": 2, "warmup": 1}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but torch sees no CUDA device: use device=cpu (or auto)")
    if device not in ("cpu", "cuda"):
        raise UserError(f"device must be auto, cpu or cuda; got {device!r}")
    return torch.device(device)


def bench(cfg: DictConfig) -> dict:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in ("does not have many workers", "no `val_dataloader`", "isinstance.treespec, LeafSpec"):
        warnings.filterwarnings("ignore", f".*{message}.*")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    host_memory_reuse = bool(cfg.reuse_host_memory) and reuse_freed_host_memory()
    n = {k: cfg[k] for k in ("rounds", "steps", "loop_rounds", "loop_steps", "warmup")} | (SMOKE if cfg.smoke else {})
    device = resolve_device(cfg.device)
    # auto: bf16 on a GPU that has it; on CPU fp32, even where torch would offer bf16
    precision = "32-true" if cfg.precision == "auto" and device.type == "cpu" else resolve_precision(cfg.precision)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    xsa = model_config(cfg, cfg.vocab_size)
    if xsa.attention != "xsa":
        raise UserError("bench compares SA with the XSA variant given by attention=xsa (its layers and gate)")
    xsa = replace(xsa, block_size=cfg.context)
    sa = replace(xsa, attention="sa", xsa_layers=None, xsa_gate=False)
    setup = Setup(device, precision, cfg.compile, build(cfg.optim), build(cfg.scheduler))
    batches = make_batches(8, cfg.micro_batch, cfg.context, xsa.vocab_size, cfg.seed, pin=device.type == "cuda")
    tokens, w = cfg.micro_batch * cfg.context, n["warmup"]
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]

    # 1. SA vs XSA: persistent models, warmed up (and compiled) once, then many short interleaved rounds.
    models = {"sa": PlainTrainer(sa, setup, cfg.seed, 10**6), "xsa": PlainTrainer(xsa, setup, cfg.seed, 10**6)}
    for m in models.values():
        m.run(batches, w)
    runs = {k: partial(lambda m: step_times(m.run(batches, n["steps"])), m) for k, m in models.items()}
    attn = compare(runs, n["rounds"], tokens)
    flops_per_token = models["sa"].model.flops_per_token(cfg.context)
    del models
    memory = {k: peak_memory(c, setup, batches, cfg.seed) for k, c in (("sa", sa), ("xsa", xsa))}

    # 2. Plain loop vs Lightning: fresh SA models from the same seed each round; steps w..w+loop_steps-1 timed
    # start-to-start (Lightning runs one extra step whose start closes the last timed one).
    total = w + n["loop_steps"] + 1
    plain_run = lambda: step_times(PlainTrainer(sa, setup, cfg.seed, total).run(batches, total - 1)[w:])
    fit_run = lambda: step_times(fit_lightning(sa, setup, batches, total, cfg.seed).starts[w:])
    loop = compare({"plain": plain_run, "lightning": fit_run}, n["loop_rounds"], tokens)

    # 3. MFU.
    peak, peak_source = peak_flops(device, precision)
    counted = counted_flops_per_token(sa, setup, batches[0])
    xsa_ratio, lit_ratio = attn["ratio"], 1.0 / loop["ratio"]  # step-time ratio -> throughput ratio
    mfu = lambda tokens_per_s: None if peak is None else tokens_per_s * flops_per_token / peak
    xsa_target = TARGETS["xsa_over_sa_step_time"][device.type]
    result = {
        "device": device_name(device), "precision": precision, "compile": cfg.compile, "model": cfg.model.name,
        "context": cfg.context, "micro_batch": cfg.micro_batch, "tokens_per_step": tokens,
        "vocab_size": xsa.vocab_size, "smoke": cfg.smoke, "host_memory_reuse": host_memory_reuse, **n,
        # The headline: the trainer `xsa-lm train` runs (Lightning, SA), not the in-process SA/XSA pair.
        "tokens_per_s": loop["lightning_tokens_per_s"], "step_time_ms": loop["lightning_step_ms"],
        "sa_step_ms": attn["sa_step_ms"], "xsa_step_ms": attn["xsa_step_ms"],
        "sa_tokens_per_s": attn["sa_tokens_per_s"], "xsa_tokens_per_s": attn["xsa_tokens_per_s"],
        "xsa_over_sa_step_time": xsa_ratio, "xsa_over_sa_step_time_pooled": attn["ratio_pooled"],
        "xsa_over_sa_step_time_rounds": attn["ratio_rounds"],
        "sa_peak_memory_bytes": memory["sa"][0], "xsa_peak_memory_bytes": memory["xsa"][0],
        "peak_memory_source": memory["sa"][1],
        "xsa_over_sa_peak_memory": memory["xsa"][0] / memory["sa"][0],
        "plain_step_ms": loop["plain_step_ms"], "lightning_step_ms": loop["lightning_step_ms"],
        "plain_tokens_per_s": loop["plain_tokens_per_s"], "lightning_tokens_per_s": loop["lightning_tokens_per_s"],
        "lightning_over_plain_throughput": lit_ratio,
        "lightning_over_plain_throughput_pooled": 1.0 / loop["ratio_pooled"],
        "lightning_over_plain_throughput_rounds": [1.0 / r for r in loop["ratio_rounds"]],
        "flops_per_token": flops_per_token, "flops_per_token_flop_counter": counted,
        "peak_flops": peak, "peak_flops_source": peak_source,
        "mfu": mfu(loop["lightning_tokens_per_s"]), "mfu_sa_pair": mfu(attn["sa_tokens_per_s"]),
        "mfu_xsa_pair": mfu(attn["xsa_tokens_per_s"]),
        "targets": {"xsa_over_sa_step_time": xsa_target,
                    "lightning_over_plain_throughput": TARGETS["lightning_over_plain_throughput"]},
        "targets_met": {"xsa_over_sa_step_time": xsa_ratio <= xsa_target,
                        "lightning_over_plain_throughput": lit_ratio >= TARGETS["lightning_over_plain_throughput"]},
        "runtime_s": time.perf_counter() - t_start,
        "load_avg_1min": [load_before, os.getloadavg()[0]],  # before, after: above the thread count = noisy run
        "config": OmegaConf.to_container(cfg, resolve=True), "run_info": run_info(),
    }  # fmt: skip
    return result


def print_table(r: dict) -> None:
    table = Table(title=f"xsa-lm bench: {r['model']}, context {r['context']} x {r['micro_batch']}, {r['precision']}"
                        f"{', compiled' if r['compile'] else ''}, {r['device']}")  # fmt: skip
    for col in ("run", "step ms", "tokens/s", "peak memory", "ratio", "pooled", "target"):
        table.add_column(col, justify="left" if col == "run" else "right")
    met = lambda key: "[green]met[/]" if r["targets_met"][key] else "[red]missed[/]"
    mib = lambda key: f"{r[key] / 2**20:,.1f} MiB"
    table.add_row("SA", f"{r['sa_step_ms']:.1f}", f"{r['sa_tokens_per_s']:,.0f}", mib("sa_peak_memory_bytes"))
    table.add_row("XSA", f"{r['xsa_step_ms']:.1f}", f"{r['xsa_tokens_per_s']:,.0f}", mib("xsa_peak_memory_bytes"))
    table.add_row("XSA/SA step time", "", "", "", f"{r['xsa_over_sa_step_time']:.3f}",
                  f"{r['xsa_over_sa_step_time_pooled']:.3f}",
                  f"<={r['targets']['xsa_over_sa_step_time']} {met('xsa_over_sa_step_time')}")  # fmt: skip
    table.add_row("XSA/SA peak memory", "", "", "", f"{r['xsa_over_sa_peak_memory']:.3f}", "", "")
    table.add_row("plain loop (SA)", f"{r['plain_step_ms']:.1f}", f"{r['plain_tokens_per_s']:,.0f}", "")
    table.add_row("Lightning (SA)", f"{r['lightning_step_ms']:.1f}", f"{r['lightning_tokens_per_s']:,.0f}", "")
    table.add_row("Lightning/plain tokens/s", "", "", "", f"{r['lightning_over_plain_throughput']:.3f}",
                  f"{r['lightning_over_plain_throughput_pooled']:.3f}",
                  f">={r['targets']['lightning_over_plain_throughput']} "
                  f"{met('lightning_over_plain_throughput')}")  # fmt: skip
    Console(width=max(Console().width, 110)).print(table)
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    peak = "unknown" if r["peak_flops"] is None else f"{r['peak_flops'] / 1e12:.3f} TFLOP/s"
    print(
        f"MFU (Lightning, SA) {mfu} = {r['tokens_per_s']:,.0f} tokens/s x {r['flops_per_token'] / 1e6:.2f} MFLOP/token "
        f"(flop counter: {r['flops_per_token_flop_counter'] / 1e6:.2f}) / {peak} ({r['peak_flops_source']})"
    )
    load = r["load_avg_1min"]
    smoke = " (smoke: a few steps, numbers not meaningful)" if r["smoke"] else ""
    print(f"runtime {r['runtime_s']:.0f} s; 1-min load average {load[0]:.1f} -> {load[1]:.1f}{smoke}")


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="bench")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        out = Path(cfg.out)
        if out.exists() and not cfg.overwrite:
            raise UserError(f"out={out} exists: choose another path or add overwrite=true")
        result = bench(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
