"""`xsa-lm bench`: an attention option vs its baseline (XSA vs SA by default, their steps interleaved) under each SDPA
kernel and Lightning vs a plain loop (loops.py), over rounds that run each phase in a fresh process; each ratio's 95%
interval and verdict (stats.py). Prints tables, writes `out`."""

import contextlib
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from pydantic import Field, model_validator
from rich.console import Console
from rich.table import Column, Table

from xsa_lm.bench.loops import Arms, Kernels, Phase, Probe, Setup, TimedPhase, round_order, run_fresh
from xsa_lm.bench.stats import MEETS, MIN_ROUNDS, MISSES, NO_TARGET, Round, plan_rounds, step, summarize_rounds
from xsa_lm.compat import lightning_precision_name
from xsa_lm.config.builders import build
from xsa_lm.config.spec import AttentionSpec, Count, ModelSpec, OptimSpec, SchedulerSpec, Seed, Spec, parse, rule
from xsa_lm.errors import UserError, one_line_errors
from xsa_lm.files import check_new_file, write_json
from xsa_lm.model import GPTConfig
from xsa_lm.model.sdpa import config_problem
from xsa_lm.train import memory
from xsa_lm.train.plan import loss_chunk_line, micro_batch_fit
from xsa_lm.train.runinfo import run_info

SMOKE = {"rounds": 2, "steps": 2, "warmup": 1}
# What the hand-written loop reproduces (autocast to bf16, or none): under another precision Lightning would train in
# another one (16-mixed: fp16 with a grad scaler; *-true: weights cast), and the report compare two under one name.
BOTH_LOOPS = ("32-true", "bf16-mixed")
Rounds = Annotated[int, Field(ge=MIN_ROUNDS)]  # the fewest with a 95% interval


def _out(value: Any) -> str | None:
    return "must be the file bench writes its results to, e.g. out=bench.json" if value in (None, "") else None


def _precision(value: Any) -> str | None:
    with contextlib.suppress(ValueError):
        if value == "auto" or lightning_precision_name(value) in BOTH_LOOPS:
            return None
    return "must be auto, 32-true or bf16-mixed: what both the Lightning loop and the hand-written loop train in"


def _backends(value: Any) -> str | None:
    problem = None if value in ("auto", "train") else config_problem(value)
    return problem and problem.replace("auto", "auto, train")


class BenchSpec(Spec):
    """configs/bench.yaml: the bench's own options, and the model it times with its optimizer and schedule."""

    out: Annotated[str, rule(_out)]
    overwrite: bool
    device: Literal["auto", "cpu", "cuda"]
    precision: Annotated[str | int, rule(_precision)]
    context: Count
    micro_batch: Count
    vocab_size: Count
    compile: bool
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
    reuse_host_memory: bool
    backends: Annotated[str | list[str], rule(_backends)]
    rounds: Rounds | Literal["auto"]
    pilot_rounds: Annotated[int, Field(ge=2)]  # a spread needs 2
    budget_s: float = Field(gt=0, allow_inf_nan=False)  # inf would fail after the pilot
    max_rounds: Rounds
    steps: Count
    warmup: int = Field(ge=0)
    comparisons: list[Literal["attention_over_baseline", "lightning_over_plain"]]
    threads: Count | Literal["auto"] | None
    seed: Seed
    smoke: bool
    model: ModelSpec
    attention: AttentionSpec  # the candidate
    baseline: AttentionSpec  # what it is compared with (configs/bench.yaml's attention@baseline)
    optim: OptimSpec
    scheduler: SchedulerSpec

    @model_validator(mode="after")
    def _two_arms(self) -> "BenchSpec":
        if self.attention.name == self.baseline.name:
            raise ValueError(
                f"bench compares attention={self.attention.name} with its baseline, attention@baseline="
                f"{self.baseline.name}: choose another option for one of them"
            )
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode={self.compile_mode} acts only on a compiled step: add compile=true")
        if self.context > self.model.block_size:
            raise ValueError(f"context={self.context} is above model.block_size={self.model.block_size}: lower it")
        self.models  # noqa: B018 - GPTConfig's own check and attention.layers', before any phase starts
        return self

    @property
    def arms(self) -> Arms:
        return Arms(self.baseline.name, self.attention.name)

    @property
    def models(self) -> tuple[GPTConfig, GPTConfig]:
        """(baseline, candidate) at the bench's context: the same model with each attention option."""
        base, cand = (self.model.gpt_config(a, self.vocab_size) for a in (self.baseline, self.attention))
        return replace(base, block_size=self.context), replace(cand, block_size=self.context)

    def setup_on(self, device: torch.device) -> Setup:
        """precision auto: bf16 on a GPU, without asking it (a CUDA context here would outlive the phases)."""
        auto = "bf16-mixed" if device.type == "cuda" else "32-true"
        precision = lightning_precision_name(auto if self.precision == "auto" else self.precision)
        scheduler = build(self.scheduler.model_dump(by_alias=True))
        mode = None if self.compile_mode == "default" else self.compile_mode
        return Setup(device, precision, self.compile, build(self.optim.node), scheduler, mode)


def resolve_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but torch sees no CUDA device: use device=cpu (or auto)")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


Phases = dict[tuple[str, ...], Phase]  # each process's phase, by the names of its results (e.g. sa_flash, xsa_flash)


def phases_to_time(spec: BenchSpec, base: Phase, candidate: GPTConfig) -> tuple[Probe, Kernels, Phases]:
    """The probe, in a fresh process: the device, train's kernel order and kernel here, which kernels of `backends`
    take the model's attention alone (`train`: train's). The phases: per timed kernel, both arms' plain loops in one
    process, their steps interleaved (`<arm>_<kernel>`, e.g. sa_flash and xsa_flash), and `lightning` (the headline,
    training the baseline) under train's order."""
    backends, comparisons = spec.backends, spec.comparisons
    names = () if backends in ("auto", "train") else (backends,) if isinstance(backends, str) else tuple(backends)
    probe = cast(Probe, run_fresh(replace(base, kind="probe", sdpa=names), "probe"))
    found = probe.kernels
    timed = [found.used] if backends == "train" else [k for k in found.candidates if found.takes[k]]
    if not timed:
        raise UserError(
            f"backends={backends}: none of {', '.join(found.candidates)} takes this model's attention in "
            f"{base.setup.precision} on {base.setup.device}; add math (it takes every shape)"
        )
    kernels, phases = replace(found, timed=timed, primary=found.used if found.used in timed else timed[0]), Phases()
    for kernel in kernels.timed:
        baseline, other = spec.arms.phases(kernel)
        if "attention_over_baseline" in comparisons:
            phases[baseline, other] = replace(base, candidate=candidate, sdpa=(kernel,))
        elif "lightning_over_plain" in comparisons and kernel == kernels.primary:
            phases[(baseline,)] = replace(base, sdpa=(kernel,))
    phases[("lightning",)] = replace(base, kind="lightning", sdpa=tuple(kernels.order))
    return probe, kernels, phases


def run_round(phases: Phases, r: int, of: str) -> Round:
    """Round r: each phase in a fresh process, in round_order; a line on its medians."""
    t0, result, units = time.perf_counter(), Round(), {"+".join(names): names for names in phases}
    for unit in round_order(list(units), r):
        names = units[unit]
        label = f"{unit} (round {r + 1})"
        result |= zip(names, cast(list[TimedPhase], run_fresh(phases[names], label)), strict=True)
    ms = [f"{k} {1e3 * step(v, 'wall'):.1f} ms ({1e3 * step(v, 'cpu'):.1f} CPU)" for k, v in result.items()]
    print(f"round {r + 1}{of} ({time.perf_counter() - t0:.0f} s): {', '.join(ms)}", flush=True)
    return result


def bench(spec: BenchSpec, *, model: str, config: dict) -> dict[str, Any]:
    """The report (bench.json); `model`: the model's label, `config`: the composed config, kept in it."""
    spec = spec.model_copy(update=SMOKE) if spec.smoke else spec
    device, (baseline, candidate), tokens = resolve_device(spec.device), spec.models, spec.micro_batch * spec.context
    # threads=auto: one per phase on CPU, where a second thread spins while it waits for a core on a shared machine
    # and the spinning counts as CPU time (docs/benchmark.md); torch's default on a GPU.
    threads = (1 if device.type == "cpu" else None) if isinstance(spec.threads, str) else spec.threads
    same = spec.model_dump(include={"micro_batch", "warmup", "steps", "seed", "reuse_host_memory"})
    base = Phase("plain", baseline, spec.setup_on(device), threads=threads, **same)  # the plain loop, the baseline
    t_start, load_before, arms = time.perf_counter(), os.getloadavg()[0], spec.arms
    probe, kernels, phases = phases_to_time(spec, base, candidate)
    print(kernel_line(asdict(kernels), arms), flush=True)
    plan, total, rounds, t_rounds = None, spec.rounds, list[Round](), time.perf_counter()
    if isinstance(total, str):  # auto: as many as the pilot's spread asks for
        rounds = [run_round(phases, r, " (pilot)") for r in range(spec.pilot_rounds)]
        elapsed = time.perf_counter() - t_rounds
        plan = plan_rounds(rounds, kernels, elapsed, spec.budget_s, spec.max_rounds, device.type, arms)
        print(plan_line(asdict(plan)), flush=True)
        total = plan.rounds
    rounds += [run_round(phases, r, f"/{total}") for r in range(len(rounds), total)]
    summary, ratios = summarize_rounds(
        rounds, probe, kernels, model=model, device_type=device.type, tokens=tokens, arms=arms
    )
    return {
        **{key: value for key, value in asdict(probe).items() if key not in ("pid", "kernels")},  # device, peak FLOP/s
        "precision": base.setup.precision,
        "model": model,
        "arms": arms._asdict(),
        **spec.model_dump(include={"compile", "compile_mode", "context", "micro_batch", "smoke", "steps", "warmup"}),
        "tokens_per_step": tokens,
        "vocab_size": candidate.vocab_size,
        "rounds": len(rounds),
        "rounds_setting": spec.rounds,
        "rounds_plan": None if plan is None else asdict(plan),
        "sdpa": asdict(kernels),
        "xsa_memory": xsa_memory(candidate, tokens=tokens, precision=base.setup.precision),
        "micro_batch_fit": fit_on(device, candidate, spec, precision=base.setup.precision),
        "phases": [name for names in phases for name in names],
        "fresh_process_per_phase": True,
        "interleaved": [list(names) for names in phases if len(names) > 1],  # each step beside the other's
        "clocks": {
            "wall": "CUDA events, one synchronisation per phase" if device.type == "cuda" else "time.perf_counter",
            "cpu": "time.process_time: all its threads",
        },
        # The headline: the trainer `xsa-lm train` runs (Lightning, the baseline).
        "tokens_per_s": summary["lightning_tokens_per_s"],
        "step_time_ms": summary["lightning_step_ms"],
        **summary,
        "peak_memory_source": rounds[0][next(iter(rounds[0]))].peak_memory_source,
        # Point estimates (the median of the per-round ratios) as top-level keys; the statistics beside them.
        **{key: s.median for key, s in ratios.items()},
        "ratios": {key: s.to_json() for key, s in ratios.items()},
        "targets": {key: s.target for key, s in ratios.items()},
        "verdicts": {key: s.verdict for key, s in ratios.items()},
        "per_round": [{name: asdict(phase) for name, phase in r.items()} for r in rounds],
        "runtime_s": time.perf_counter() - t_start,
        "load_avg_1min": [load_before, os.getloadavg()[0]],  # before, after: above the thread count = noisy run
        "model_config": asdict(phases[("lightning",)].model),
        "config": config,
        "run_info": run_info(attention={"order": kernels.order, "used": kernels.used}),
    }


def xsa_memory(model: GPTConfig, *, tokens: int, precision: str) -> dict[str, int]:
    """What one XSA layer adds at this step's size as `xsa-lm plan` counts it: saved, and backward temporaries."""
    (compute, weights), shape = memory.dtype_bytes(precision), asdict(model)
    saved = memory.block_saved_per_token(shape, compute=compute, residual=weights, exclusive=True)["xsa"]
    return {
        "saved_per_layer": tokens * saved,
        "temporaries_eager": tokens * memory.xsa_transient_per_token(shape, compute=compute),
        "temporaries_compiled": tokens * memory.xsa_transient_per_token(shape, compute=compute, compiled=True),
    }


def fit_on(device: torch.device, model: GPTConfig, spec: BenchSpec, *, precision: str) -> dict[str, Any]:
    """The largest micro-batch of this model and context in the device's free memory, with the whole logits and with
    the chunked loss, as `xsa-lm plan` counts it (one device, DDP)."""
    available, where = memory.available_bytes(device.type)
    args = dict(model=asdict(model), vocab_size=model.vocab_size, block_size=spec.context, precision=precision)
    fit = micro_batch_fit(available, **args, compiled=spec.compile, exclusive=model.attention_class.exclusive_memory)
    return {**fit, "available_bytes": available, "available_from": where}


def kernel_line(kernels: dict, arms: Arms) -> str:
    not_taken = [k for k in kernels["candidates"] if not kernels["takes"][k]]
    skipped = f" (not taking this model's attention: {', '.join(not_taken)})" if not_taken else ""
    return (
        f"SDPA kernels: xsa-lm train's order here (sdpa_backends=auto) {', '.join(kernels['order'])} runs "
        f"{kernels['used']} for this model; timing {' and '.join(labels(arms))} under {', '.join(kernels['timed'])}"
        f"{skipped}"
    )


def plan_line(plan: dict) -> str:
    needed = "no finite number (the pilot's centre is on the target)" if plan["needed"] is None else plan["needed"]
    return (
        f"rounds: the pilot's spread ({plan['clock']} clock) needs {needed} rounds for the 95% interval to decide the "
        f"target; {plan['affordable']} fit in budget_s={plan['budget_s']:g} ({plan['round_s']:.0f} s a round), "
        f"max_rounds={plan['max_rounds']}: running {plan['rounds']}"
    )


COLOURS = {MEETS: "green", MISSES: "red", NO_TARGET: "dim"}


def labels(arms: Arms) -> tuple[str, str]:
    """The arms as the tables name them, e.g. (SA, XSA)."""
    return arms.baseline.upper(), arms.candidate.upper()


def print_tables(r: dict) -> None:
    compiled, mib, arms = ", compiled" if r["compile"] else "", 2**20, Arms(**r["arms"])
    base, cand = labels(arms)
    phase_labels = {"lightning": f"{base} (Lightning)"}
    for kernel in r["sdpa"]["timed"]:
        phase_labels |= dict(zip(arms.phases(kernel), (f"{base} (plain loop)", f"{cand} (plain loop)"), strict=True))
    ratio_labels = {arms.ratio: f"{cand}/{base} step time", "lightning": "Lightning/plain tokens/s"}
    ratio_labels["mfu"] = f"MFU (Lightning, {base})"
    phases = [["phase", "SDPA kernel", "step ms (wall)", "step ms (CPU time)", "tokens/s", "peak memory"]]
    for name in r["phases"]:
        memory = r[f"{name}_peak_memory_bytes"]
        cells = [f"{r[f'{name}_step_ms']:.1f}", f"{r[f'{name}_cpu_ms']:.1f}", f"{r[f'{name}_tokens_per_s']:,.0f}"]
        cells.append("" if memory is None else f"{memory / mib:,.1f} MiB")
        phases.append([phase_labels[name], r["phase_kernels"][name], *cells])
    ratios = [["ratio", "kernel", "clock", "median", "mean", "sd", "min - max", "95% interval", "target", "verdict"]]
    for key, s in r["ratios"].items():
        f = (lambda v: f"{100 * v:.1f}%") if key == "mfu" else (lambda v: f"{v:.3f}")
        target = "" if s["target"] is None else f"{'<=' if s['at_most'] else '>='} {f(s['target'])}"
        bounds = "n/a" if s["interval"] is None else f"{f(s['interval'][0])} - {f(s['interval'][1])}"
        label = next(text for start, text in ratio_labels.items() if key.startswith(start))
        clock = {"wall": "wall", "cpu": "CPU time"}[s["clock"]]
        cells = [f(s["median"]), f(s["mean"]), f(s["sd"]), f"{f(s['min'])} - {f(s['max'])}", bounds, target]
        ratios.append([label, s["kernel"], clock, *cells, f"[{COLOURS.get(s['verdict'], 'yellow')}]{s['verdict']}[/]"])
    if memory_ratio := r.get(f"{arms.ratio}_peak_memory"):
        ratios.append([f"{cand}/{base} peak memory", r["sdpa"]["primary"], "", f"{memory_ratio:.3f}", *[""] * 6])
    heading = (
        f"xsa-lm bench: {r['model']}, context {r['context']} x {r['micro_batch']}, {r['precision']}{compiled}, "
        f"{r['device']}; {r['rounds']} rounds x {r['steps']} steps, a fresh process per phase"
    )
    spread = "per-round ratios: median, geometric mean, spread, 95% Hodges-Lehmann interval"
    for title, (columns, *rows), left in ((heading, phases, 2), (spread, ratios, 3)):  # names left, numbers right
        table = Table(*[Column(c, justify="left" if i < left else "right") for i, c in enumerate(columns)], title=title)
        for row in rows:
            table.add_row(*row)
        Console(width=max(Console().width, 140)).print(table)
    peak = "unknown" if r["peak_flops"] is None else f"{r['peak_flops'] / 1e12:.3f} TFLOP/s"
    print(
        f"MFU = tokens/s x {r['flops_per_token'] / 1e6:.2f} MFLOP/token (flop counter: "
        f"{r['flops_per_token_flop_counter'] / 1e6:.2f}) / {peak} ({r['peak_flops_source']})"
    )
    print(kernel_line(r["sdpa"], arms))
    x = {key: value / mib for key, value in r["xsa_memory"].items()}
    print(
        f"XSA's memory per layer (the plan's count): saves {x['saved_per_layer']:.2f} MiB for the backward; backward "
        f"temporaries {x['temporaries_eager']:.2f} MiB eager, {x['temporaries_compiled']:.2f} MiB compiled"
    )
    fit = r["micro_batch_fit"]
    print(f"{loss_chunk_line(fit)}, in {fit['available_bytes'] / 2**30:.1f} GiB ({fit['available_from']})")
    if r["rounds_plan"]:
        print(plan_line(r["rounds_plan"]))
    load, smoke = r["load_avg_1min"], " (smoke: a few steps, numbers not meaningful)" if r["smoke"] else ""
    print(f"runtime {r['runtime_s']:.0f} s; 1-min load average {load[0]:.1f} -> {load[1]:.1f}{smoke}")


@hydra.main(version_base="1.3", config_path="pkg://xsa_lm.configs", config_name="bench")
@one_line_errors
def main(cfg: DictConfig) -> None:
    spec = parse(BenchSpec, cfg)
    out = Path(spec.out)
    check_new_file(out, overwrite=spec.overwrite, example="bench.json")
    # The model's label: the preset's name, with the fields set apart from the preset's, e.g. `tiny (n_layer=6)`
    preset = hydra.compose(config_name="bench", overrides=[f"model={HydraConfig.get().runtime.choices['model']}"]).model
    given = parse(ModelSpec, preset, at="model.").model_dump()
    changed = [f"{key}={value}" for key, value in spec.model.model_dump().items() if value != given[key]]
    label = f"{spec.model.name} ({', '.join(changed)})" if changed else spec.model.name
    result = bench(spec, model=label, config=cast(dict, OmegaConf.to_container(cfg, resolve=True)))
    try:  # exclusive creation unless overwrite: a file another run wrote meanwhile is never replaced
        write_json(out, result, replace=spec.overwrite)
    except FileExistsError:
        raise UserError(f"out={out} appeared during the run: not overwritten; choose another path") from None
    print_tables(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
