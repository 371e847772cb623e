"""scripts/gpu_check.sh's results as DIR/summary.json and DIR/summary.md, rewritten after every measurement, so that
a check cut short (a step past its limit, the machine taken back) still leaves everything measured until then.

DIR holds check.json (the plan, written first), steps.jsonl (one line per finished step), measurements.json (what
the steps measured, keyed by step; `record` adds to it), check.log (every step's output) and the two summaries.
With --final, exit code 1 when a step failed or never ran, or a check did not hold (performance targets are
reported, not enforced).

    python scripts/gpu_check_summary.py DIR [--final]
    python scripts/gpu_check_summary.py DIR --record-run train RUN_DIR   # a training run's outcome, then the summary
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from gpu_xsa_lm import use_working_tree

MEASUREMENTS = "measurements.json"
RUN_KEYS = (
    "error",
    "steps",
    "final_val_loss",
    "best_val_loss",
    "tokens_per_s",
    "wall_time_s",
    "val_history",
)  # None without a summary
LAST_LINES = 5  # of a failed step's output, in the summary
NO_DEVICE = "device not named (the bench steps name it)"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Readers (and a check killed meanwhile) see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record(directory: Path, key: str, value: object) -> dict:
    """measurements.json[key] = value, then the summaries anew; returns the summary."""
    measurements = read_json(directory / MEASUREMENTS) or {}
    measurements[key] = value
    write_atomic(directory / MEASUREMENTS, json.dumps(measurements, indent=2))
    return write(directory)


def run_outcome(run_dir: Path) -> dict:
    """A training run's summary.json (what the check reads of it) and where its last resume started."""
    use_working_tree()  # the GPU machine has no xsa-lm installed
    from xsa_lm.errors import UserError
    from xsa_lm.train.summary import RunSummary

    resumes = run_dir / "resumes.jsonl"
    lines = resumes.read_text().splitlines() if resumes.exists() else []
    resumed_from_step = json.loads(lines[-1]).get("from_step") if lines else None
    try:
        s = RunSummary.read(run_dir / "summary.json")
    except (OSError, UserError) as e:  # none, or one refused (its line says why)
        status = "no summary.json" if isinstance(e, OSError) else str(e)
        return dict.fromkeys(RUN_KEYS) | {"status": status, "resumed_from_step": resumed_from_step}
    return {
        "status": s.status,
        "error": s.error,
        "steps": s.steps,
        "final_val_loss": s.final_val_loss,
        "best_val_loss": s.best_val_loss,
        "tokens_per_s": s.tokens_per_s,
        "wall_time_s": s.wall_time_s,
        "val_history": s.val_history,
        "resumed_from_step": resumed_from_step,
    }


def read_steps(directory: Path) -> list[dict]:
    """steps.jsonl; a step that did not succeed gets the last lines of its output in check.log."""
    path = directory / "steps.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    log = directory / "check.log"
    for step in steps:
        if step["status"] != "ok" and log.exists():
            with open(log, "rb") as f:
                f.seek(step["log_start"])
                text = f.read(step["log_end"] - step["log_start"]).decode(errors="replace")
            step["last_lines"] = [line[:300] for line in text.splitlines() if line.strip()][-LAST_LINES:]
    return steps


def finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def kernel_name(backend: str) -> str:
    """gpu_check_measure.sdpa_kernels' backend name -> xsa_lm.model.sdpa's ("flash (cpu)" is flash)."""
    return backend.split()[0]


def kernel_check(model: str, name: str, phase: dict, choice: dict, mode: str) -> dict:
    """The kernel that ran in each model's profiled step is the one the order chose; on a GPU `auto` chose a fused
    one. A fused kernel runs as its own aten op, math as plain matmuls (compiled: no SDPA op at all)."""
    expected = choice.get("runs")
    ran = {arm: sorted({kernel_name(b) for b in k["backends"]}) for arm, k in phase["kernels"].items()}
    allowed = [[], ["math"]] if expected == "math" else [[expected]]
    fused_on_gpu = mode == "cpu" or name == "math" or expected != "math"
    ok = fused_on_gpu and all(kernels in allowed for kernels in ran.values())
    ran_text = ", ".join(f"{arm} {'/'.join(k) or 'math'}" for arm, k in ran.items())
    detail = f"{' > '.join(phase['order'])} chose {expected}; ran {ran_text}"
    return {"check": f"SDPA kernel {model} {name}", "ok": ok, "detail": detail}


def checks(m: dict, mode: str) -> list[dict]:
    """What must hold, from what was measured: XSA's bf16 gradients within their bound and its output orthogonal,
    the SDPA kernel each order chose is the one that ran, a train that ends with a finite loss and a resume that
    continues it. Only what was measured is checked; performance targets are reported, not enforced."""
    out = []
    bf16 = m.get("xsa_bf16") or {}
    for g in bf16.get("gradients", []):
        out.append({"check": f"XSA bf16 gradients {shape_text(g['shape'])}", "ok": g["holds"], "detail": grad_text(g)})
    for o in bf16.get("orthogonality", []):
        cos = o["max_abs_cos"]
        detail = f"max |cos(z, v)| fused {cos['fused']:.1e} (compiled {cos['fused_compiled']:.1e}), "
        detail += f"bf16 reference {cos['reference']:.1e}, before XSA {cos['before_xsa']:.2f}"
        out.append({"check": f"XSA bf16 orthogonal {shape_text(o['shape'])}", "ok": o["holds"], "detail": detail})
    for label, bench in bench_items(m):
        for name, phase in (bench.get("compiled") or {}).items():
            out.append(kernel_check(label, name, phase, bench["kernel_choices"][name], mode))
        for name, error in (bench.get("errors") or {}).items():
            out.append({"check": f"SDPA kernel {label} {name}", "ok": False, "detail": f"compiled: {error}"})
        if bench.get("cuda_graphs"):
            error = bench["cuda_graphs"].get("error")
            detail = error or f"{bench['cuda_graphs']['rounds_done']} rounds under {bench['cuda_graphs']['without']}"
            out.append({"check": f"CUDA graphs {label}", "ok": not error, "detail": detail})
    real = (m.get("fsdp_fake") or {}).get("real")
    if real:
        ok = real["recompiles_after_first_step"] == 0
        detail = f"{real['model']} at world size {real['world_size']}: {real['graphs_after_first_step']} graphs after"
        detail += f" the first step, {real['recompiles_after_first_step']} more in the next {real['steps'] - 1}"
        out.append({"check": "FSDP2 compiled under a fake group recompiles nothing", "ok": ok, "detail": detail})
    train, resume = m.get("train"), m.get("resume")
    if train:
        ok = train["status"] == "completed" and finite(train["final_val_loss"])
        detail = f"{train['status']}, {train['steps']} steps, val loss {train['final_val_loss']}"
        out.append({"check": "FSDP2 bf16 compiled train", "ok": ok, "detail": detail})
    if resume:
        continued = train is not None and train["steps"] is not None and resume["resumed_from_step"] == train["steps"]
        ok = continued and resume["status"] == "completed" and finite(resume["final_val_loss"])
        detail = (
            f"{resume['status']}, from step {resume['resumed_from_step']} to {resume['steps']}, "
            f"val loss {resume['final_val_loss']}"
        )
        out.append({"check": "resume=auto continues it", "ok": ok, "detail": detail})
    return out


def bench_items(m: dict) -> list[tuple[str, dict]]:
    """(label, result) of each model measured: the step's model, and the preset run if another (CPU: tiny)."""
    items = []
    for key, bench in m.items():
        if key.startswith("bench_") and isinstance(bench, dict) and "model" in bench:
            name = key.removeprefix("bench_")
            items.append((name if bench["model"] == name else f"{name} ({bench['model']})", bench))
    return items


def shape_text(shape: list[int]) -> str:
    batch, heads, context, head_dim = shape
    return f"{heads}x{head_dim} T{context}"


def grad_text(g: dict) -> str:
    """Each variant's worst relative error (and of what), the gate's error over its bound, the bound."""
    parts = []
    for variant, errors in g["relative_error"].items():
        worst, of = max((e, n) for n, e in errors.items() if n != "scale_over_its_bound")
        parts.append(f"{variant} {worst:.1e} ({of}; gate {errors['scale_over_its_bound']:.2f} of its bound)")
    return f"relative error vs fp64, bound {g['bound']:.1e}: " + ", ".join(parts)


def assemble(directory: Path, final: bool = False) -> dict:
    plan = read_json(directory / "check.json") or {}
    measurements = read_json(directory / MEASUREMENTS) or {}
    steps = read_steps(directory)
    done = {s["name"] for s in steps}
    pending = [name for name in plan.get("steps", {}) if name not in done]
    mode = plan.get("mode", "gpu")
    results = checks(measurements, mode)
    failures = [f"step {s['name']}: {s['status']}" for s in steps if s["status"] != "ok"]
    failures += [f"{c['check']}: {c['detail']}" for c in results if not c["ok"]]
    if final:
        failures += [f"step {name}: never ran" for name in pending]
        # a step's measurements are written by the step (or, for a run, after it): none means that failed
        unrecorded = [s["name"] for s in steps if s["status"] == "ok" and s["name"] not in measurements]
        failures += [f"step {name}: ok, but recorded nothing (check.log says why)" for name in unrecorded]
    device = next((v["device"] for v in measurements.values() if isinstance(v, dict) and "device" in v), None)
    summary = {
        "mode": mode,
        "device": device,
        "finished": final,
        "seconds": round(time.time() - plan["started"]) if "started" in plan else None,
        "budget_s": plan.get("budget_s"),
        "steps": steps,
        "pending": pending,
        "checks": results,
        "failures": failures,
        "ok": final and not failures,
        "measurements": measurements,
    }
    return summary | {"table": table_rows(summary)}


def interval_text(s: dict | None, scale: float = 1.0, spec: str = ".3f") -> str:
    if not s or s.get("interval") is None:
        return "n/a (fewer than 2 rounds)" if s else ""
    low, high = s["interval"]
    return f"{low * scale:{spec}} - {high * scale:{spec}}"


def ratio_row(model: str, label: str, phase: dict, kernel: str | None) -> dict:
    """XSA/SA step time of one phase: median, SA and XSA step times, its interval, whether that resolves 1%, and the
    verdict against the target."""
    ratio = phase["xsa_over_sa_step_time"]
    rounds = f"{phase['rounds_done']} rounds"
    result = (
        f"{ratio['median']:.3f} (SA {phase['sa']['step_ms']:.1f} ms, XSA {phase['xsa']['step_ms']:.1f} ms; {rounds})"
    )
    resolved = "resolves" if ratio.get("resolved") else "does not resolve"
    interval = interval_text(ratio)
    if ratio.get("interval"):
        width = 100 * (ratio["interval"][1] - ratio["interval"][0])
        interval += f" (width {width:.1f}%: {resolved} {100 * ratio['resolution']:.0f}%)"
    verdict = ratio["verdict"]  # meets or misses when the whole interval is on one side of the target, at any width
    target = f" <= {ratio['target']}" if ratio.get("target") else ""
    what = f"XSA/SA step time, {model}, {label}" + (f" ({kernel})" if kernel else "")
    return {"what": what, "result": result, "interval": interval, "verdict": verdict + target}


def cuda_graph_rows(model: str, bench: dict) -> list[dict]:
    """XSA/SA with CUDA graphs, and each arm's step time with them over without (below 1: they win)."""
    graphs = bench["cuda_graphs"]
    without = bench["compiled"][graphs["without"]]
    speed = [
        f"{arm.upper()} {without[arm]['step_ms']:.1f} -> {graphs[arm]['step_ms']:.1f} ms "
        f"({graphs[arm]['step_ms'] / without[arm]['step_ms']:.3f}x)"
        for arm in ("sa", "xsa")
    ]
    what = f"step time with CUDA graphs / without, {model}, compiled, {graphs['without']}"
    return [
        ratio_row(model, f"compiled with CUDA graphs, {graphs['without']}", graphs, None),
        {"what": what, "result": "; ".join(speed), "interval": "", "verdict": ""},
    ]


def mfu_row(model: str, label: str, phase: dict) -> dict | None:
    sa, xsa = phase["sa"].get("mfu"), phase["xsa"].get("mfu")
    if not sa or not xsa:
        return None
    target = sa.get("target")
    verdicts = f"SA {sa['verdict']}, XSA {xsa['verdict']} (>= {100 * target:.0f}%)" if target else ""
    return {
        "what": f"MFU, {model}, {label}",
        "result": f"SA {100 * sa['median']:.1f}%, XSA {100 * xsa['median']:.1f}%",
        "interval": f"SA {interval_text(sa, 100, '.1f')}, XSA {interval_text(xsa, 100, '.1f')}",
        "verdict": verdicts,
    }


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_row(model: str, phase: str, memory: dict) -> dict:
    parts = []
    for arm, m in memory.items():
        measured, planned = size_text(m["measured"]["bytes"]), size_text(m["planned"]["total"])
        parts.append(f"{arm.upper()} {measured} / {planned} ({m['measured_over_planned']:.2f}x)")
    return {
        "what": f"peak memory measured / planned, {model}, {phase}",
        "result": "; ".join(parts),
        "interval": "",
        "verdict": "",
    }


def bench_rows(model: str, bench: dict) -> list[dict]:
    rows: list[dict | None] = []
    for i, (name, phase) in enumerate((bench.get("compiled") or {}).items()):
        rows.append(ratio_row(model, f"compiled, {name}", phase, phase_kernel(bench, name)))
        if i == 0:
            rows.append(mfu_row(model, f"compiled, {name}", phase))
    if bench.get("cuda_graphs", {}).get("xsa_over_sa_step_time"):
        rows += cuda_graph_rows(model, bench)
    if bench.get("eager"):
        rows.append(ratio_row(model, "eager", bench["eager"], None))
    for phase in ("compiled", "eager"):
        if bench.get(f"memory_{phase}"):
            rows.append(memory_row(model, phase, bench[f"memory_{phase}"]))
    unusable = {n: c.get("reason") for n, c in bench.get("kernel_choices", {}).items() if c["runs"] is None}
    for name, reason in unusable.items():
        rows.append({"what": f"SDPA {name}, {model}", "result": f"not run: {reason}", "interval": "", "verdict": ""})
    for skipped in bench.get("skipped", []):
        rows.append({"what": f"skipped, {model}", "result": skipped, "interval": "", "verdict": ""})
    return [r for r in rows if r]


MEMORY_KINDS = {  # FSDPMemTracker's kinds -> the plan's terms they are held against
    "params": ("Sharded Param", "Unsharded Param", "All Gather", "Buffer"),
    "grads": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer": ("OptState",),
    "activations": ("Activation", "Temp", "Inputs"),
}


def fsdp_row(model: str, world: dict, how: str) -> dict:
    """One rank's peak measured / planned, and by kind where measured (the plan's activations count its transient
    buffers and autocast's weight copies, which the tracker sees as activations and temporaries)."""
    measured, planned = world["measured"], world["planned"]
    plan_of = {"activations": planned["activations"] + planned["transient"] + planned["weight_copies"]}
    kinds = [
        f"{kind} {size_text(sum(measured.get(k, 0) for k in names))} / {size_text(plan_of.get(kind, planned[kind]))}"
        for kind, names in MEMORY_KINDS.items()
        if any(k in measured for k in names)
    ]
    total = f"{size_text(measured['Total'])} / {size_text(planned['total'])} ({world['measured_over_planned']:.2f}x)"
    return {
        "what": f"FSDP2 rank memory measured / planned, {model}, world size {world['world_size']} ({how})",
        "result": "; ".join([total, *kinds]),
        "interval": "",
        "verdict": "",
    }


def fsdp_rows(fsdp: dict) -> list[dict]:
    rows = [fsdp_row(name, w, "fake tensors") for name, m in fsdp.get("fake", {}).items() for w in m["world_sizes"]]
    if fsdp.get("real"):
        rows.append(fsdp_row(fsdp["real"]["model"], fsdp["real"], "real tensors, compiled"))
    return rows + [{"what": "skipped, FSDP2", "result": s, "interval": "", "verdict": ""} for s in fsdp["skipped"]]


def phase_kernel(bench: dict, name: str) -> str | None:
    runs = bench.get("kernel_choices", {}).get(name, {}).get("runs")
    return runs if runs != name else None


def table_rows(s: dict) -> list[dict]:
    """The one table: every check, XSA/SA per SDPA kernel with its interval, MFU, memory, the steps."""
    checks_by_name = {c["check"]: c for c in s["checks"]}
    rows = [
        {"what": c["check"], "result": c["detail"], "interval": "", "verdict": "ok" if c["ok"] else "FAILED"}
        for c in s["checks"]
        if not c["check"].startswith("SDPA kernel")
    ]
    for label, bench in bench_items(s["measurements"]):
        rows += bench_rows(label, bench)
        rows += [
            {"what": c["check"], "result": c["detail"], "interval": "", "verdict": "ok" if c["ok"] else "FAILED"}
            for name, c in checks_by_name.items()
            if name.startswith(f"SDPA kernel {label} ")
        ]
    if s["measurements"].get("fsdp_fake"):
        rows += fsdp_rows(s["measurements"]["fsdp_fake"])
    for step in s["steps"]:
        verdict = "ok" if step["status"] == "ok" else "FAILED"
        cpu = f", {step['cpu_seconds']} CPU s" if "cpu_seconds" in step else ""
        result = f"{step['status']} after {step['seconds']} s{cpu} (limit {step['limit_s']} s)"
        if step.get("last_lines"):
            result += ": " + " / ".join(step["last_lines"][-2:])
        rows.append({"what": f"step {step['name']}", "result": result, "interval": "", "verdict": verdict})
    rows += [{"what": f"step {n}", "result": "pending", "interval": "", "verdict": ""} for n in s["pending"]]
    return rows


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(s: dict) -> str:
    state = "all checks passed" if s["ok"] else "FAILED" if s["finished"] else "in progress"
    lines = [
        f"# GPU check ({s['mode']}): {state}",
        "",
        f"{s['device'] or NO_DEVICE}; {s['seconds']} s of a {s['budget_s']} s budget.",
        "",
        "| what | result | 95% interval | verdict |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {cell(r['what'])} | {cell(r['result'])} | {cell(r['interval'])} | {cell(r['verdict'])} |"
        for r in s["table"]
    ]
    if s["failures"]:
        lines += ["", "Failures:"] + [f"- {f}" for f in s["failures"]]
    return "\n".join(lines) + "\n"


def write(directory: Path, final: bool = False) -> dict:
    summary = assemble(directory, final=final)
    write_atomic(directory / "summary.json", json.dumps(summary, indent=2))
    write_atomic(directory / "summary.md", markdown(summary))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--final", action="store_true", help="the check has ended: a step that never ran fails it")
    parser.add_argument("--record-run", nargs=2, metavar=("KEY", "RUN_DIR"), help="add a training run's outcome")
    args = parser.parse_args()
    if args.record_run:
        key, run_dir = args.record_run
        record(args.directory, key, run_outcome(Path(run_dir)))
    summary = write(args.directory, final=args.final)
    if args.final:
        print(markdown(summary))
        print(f"wrote {args.directory / 'summary.json'} and {args.directory / 'summary.md'}")
    return 1 if args.final and summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
