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

MEASUREMENTS = "measurements.json"
RUN_KEYS = ("status", "error", "steps", "final_val_loss", "best_val_loss", "tokens_per_s", "wall_time_s", "val_history")
LAST_LINES = 5  # of a failed step's output, in the summary


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
    """A training run's summary.json (the keys the check reads) and where its last resume started."""
    summary = read_json(run_dir / "summary.json") or {"status": "no summary.json"}
    resumes = run_dir / "resumes.jsonl"
    lines = resumes.read_text().splitlines() if resumes.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    return {k: summary.get(k) for k in RUN_KEYS} | {"resumed_from_step": last.get("from_step")}


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


def checks(m: dict, mode: str) -> list[dict]:
    """What must hold, from what was measured: XSA orthogonal under autocast, a fused SDPA kernel on a GPU, a train
    that ends with a finite loss and a resume that continues it. Only what was measured is checked."""
    out = []
    for shape in (m.get("xsa_orthogonality") or {}).get("shapes", []):
        cos = shape["max_abs_cos"]
        detail = f"max abs cos(z, v): fused {cos['fused']:.2e}, reference {cos['reference']:.2e} ({shape['dtype']})"
        out.append({"check": f"XSA orthogonal, head_dim {shape['shape'][-1]}", "ok": shape["holds"], "detail": detail})
    for key, bench in m.items():
        if not key.startswith("bench_"):
            continue
        for phase in ("kernels_eager", "kernels_compiled"):
            for name, kernels in (bench.get(phase) or {}).items():
                fused = bool(kernels["backends"]) and "math" not in kernels["backends"]
                ok = fused or mode == "cpu"
                detail = f"backends {kernels['backends']}; {kernels['kernel_count']} attention kernels"
                out.append({"check": f"SDPA kernel {key[6:]} {name} ({phase[8:]})", "ok": ok, "detail": detail})
    train, resume = m.get("train"), m.get("resume")
    if train:
        ok = train["status"] == "completed" and finite(train["final_val_loss"])
        detail = f"{train['status']}, {train['steps']} steps, val loss {train['final_val_loss']}"
        out.append({"check": "FSDP2 train", "ok": ok, "detail": detail})
    if resume:
        continued = train is not None and train["steps"] is not None and resume["resumed_from_step"] == train["steps"]
        ok = continued and resume["status"] == "completed" and finite(resume["final_val_loss"])
        detail = (
            f"{resume['status']}, from step {resume['resumed_from_step']} to {resume['steps']}, "
            f"val loss {resume['final_val_loss']}"
        )
        out.append({"check": "resume=auto continues it", "ok": ok, "detail": detail})
    return out


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
    device = next((v["device"] for v in measurements.values() if isinstance(v, dict) and "device" in v), None)
    return {
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


def fmt(value: object, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def interval_text(s: dict, scale: float = 1.0, spec: str = ".3f") -> str:
    if s is None:
        return ""
    bounds = (
        "n/a" if s["interval"] is None else f"{s['interval'][0] * scale:{spec}} - {s['interval'][1] * scale:{spec}}"
    )
    return f"{s['median'] * scale:{spec}} ({bounds}; {s['verdict']})"


def bench_lines(key: str, b: dict) -> list[str]:
    """One model's step times, tokens/s, MFU and memory, eager and compiled."""
    lines = [
        "",
        f"## {key}: {b.get('model')}, context {b.get('context')} x {b.get('micro_batch')}, {b.get('precision')}",
        "",
        f"{b.get('rounds')} rounds x {b.get('steps')} steps per model, one process, SA and XSA alternating; "
        f"peak {fmt(b.get('peak_flops'), '.3g')} FLOP/s ({b.get('peak_flops_source')})",
        "",
        "| phase | model | step ms | tokens/s | MFU % (95% interval) | peak memory GiB | planned GiB |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for phase in ("eager", "compiled"):
        timing, memory = b.get(phase) or {}, b.get(f"memory_{phase}") or {}
        for name in ("sa", "xsa"):
            t, mem = timing.get(name) or {}, memory.get(name) or {}
            measured = (mem.get("measured") or {}).get("bytes")
            planned = (mem.get("planned") or {}).get("total")
            lines.append(
                f"| {phase} | {name} | {fmt(t.get('step_ms'), '.1f')} | {fmt(t.get('tokens_per_s'), ',.0f')} | "
                f"{interval_text(t.get('mfu'), 100, '.1f')} | {fmt(measured and measured / 2**30, '.2f')} | "
                f"{fmt(planned and planned / 2**30, '.2f')} |"
            )
    for phase in ("eager", "compiled"):
        ratio = (b.get(phase) or {}).get("xsa_over_sa_step_time")
        if ratio:
            lines.append(f"\nXSA/SA step time, {phase}: {interval_text(ratio)}")
    if b.get("compile_s"):
        lines.append(f"\ncompile (first steps) s: {b['compile_s']}")
    return lines


def markdown(s: dict) -> str:
    state = "all checks passed" if s["ok"] else "FAILED" if s["finished"] else "in progress"
    lines = [
        f"# GPU check ({s['mode']}): {state}",
        "",
        f"{s['device']}; {s['seconds']} s of a {s['budget_s']} s budget.",
        "",
        "| step | status | seconds | limit s |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {t['name']} | {t['status']} | {t['seconds']} | {t['limit_s']} |" for t in s["steps"]]
    lines += [f"| {name} | pending | | |" for name in s["pending"]]
    lines += ["", "| check | ok | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['ok']} | {c['detail']} |" for c in s["checks"]]
    for key, value in s["measurements"].items():
        if key.startswith("bench_") and isinstance(value, dict):
            lines += bench_lines(key, value)
    for key in ("train", "resume"):
        r = s["measurements"].get(key)
        if r:
            lines.append(
                f"\n{key}: {r.get('status')}, {r.get('steps')} steps, final val loss {r.get('final_val_loss')}, "
                f"{fmt(r.get('tokens_per_s'), ',.0f')} tokens/s"
            )
    if s["failures"]:
        lines += ["", "## failures", ""] + [f"- {f}" for f in s["failures"]]
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
