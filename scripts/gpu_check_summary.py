"""Assemble scripts/gpu_check.sh's results into summary.json and summary.md: every step's outcome, the benchmarks'
ratios with their intervals and verdicts, peak memory against `xsa-lm plan`, the SA and XSA training losses, the eval
and generate smoke. Exit code 1 when a step failed or a check did not hold (the targets are reported, not enforced).

    python scripts/gpu_check_summary.py DIR --mode gpu --seconds 412
"""

import argparse
import json
import math
import sys
from pathlib import Path

LOSS_CLOSE = 0.10  # |XSA - SA| / SA of the final validation loss after 100 steps: same data, same LR, same seed
MEMORY_WITHIN = 0.20  # measured peak memory within 20% of the planner's estimate
PLAN_KEYS = ("per_device_bytes", "max_micro_batch_size", "micro_batch_size", "precision")
BENCH_KEYS = (
    "device",
    "model",
    "context",
    "micro_batch",
    "precision",
    "compile",
    "rounds",
    "steps",
    "tokens_per_s",
    "step_time_ms",
    "lightning_peak_memory_bytes",
    "sa_peak_memory_bytes",
    "xsa_peak_memory_bytes",
    "runtime_s",
)
TRAIN_KEYS = ("status", "steps", "final_val_loss", "best_val_loss", "tokens_per_s", "wall_time_s")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_steps(directory: Path) -> list[dict]:
    path = directory / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    steps = [json.loads(line) for line in lines if line.strip()]
    for step in steps:  # the last line of a failed step's log says why
        log = directory / step["log"]
        if step["status"] != "ok" and log.exists():
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            step["last_line"] = tail[-1][:300] if tail else ""
    return steps


def bench_summary(report: dict | None) -> dict | None:
    if report is None:
        return None
    ratio_keys = ("median", "mean", "sd", "interval", "target", "at_most", "verdict")
    ratios = {key: {k: s[k] for k in ratio_keys} for key, s in report["ratios"].items()}
    return {k: report.get(k) for k in BENCH_KEYS} | {"ratios": ratios}


def memory_check(bench: dict | None, plan: dict | None) -> dict | None:
    """The Lightning step's allocator peak against the planner's per-device total for the same shape."""
    if bench is None or plan is None or not bench.get("lightning_peak_memory_bytes"):
        return None
    measured, planned = bench["lightning_peak_memory_bytes"], plan["per_device_bytes"]["total"]
    ratio = measured / planned
    return {
        "measured_bytes": measured,
        "planned_bytes": planned,
        "measured_over_planned": ratio,
        "within": MEMORY_WITHIN,
        "ok": abs(ratio - 1) <= MEMORY_WITHIN,
    }


def train_check(directory: Path) -> dict:
    runs = {a: read_json(directory / f"train_{a}" / "summary.json") for a in ("sa", "xsa")}
    out: dict = {a: None if s is None else {k: s.get(k) for k in TRAIN_KEYS} for a, s in runs.items()}
    losses = [None if r is None else r["final_val_loss"] for r in out.values()]
    finite = all(isinstance(v, int | float) and math.isfinite(v) for v in losses)
    out["finite"] = finite
    out["relative_difference"] = abs(losses[1] - losses[0]) / losses[0] if finite else None
    out["close"] = finite and out["relative_difference"] <= LOSS_CLOSE
    out["close_within"] = LOSS_CLOSE
    return out


def assemble(directory: Path, mode: str, seconds: int) -> dict:
    benches = {name: bench_summary(read_json(directory / f"bench_{name}.json")) for name in ("gpt2_124m", "paper_0.7b")}
    plan = read_json(directory / "plan_paper_0.7b.json")
    generated = directory / "generate.txt"
    evaluation = read_json(directory / "eval" / "eval.json")
    summary = {
        "mode": mode,
        "seconds": seconds,
        "device": next((b["device"] for b in benches.values() if b), None),
        "steps": read_steps(directory),
        "bench": benches,
        "plan_paper_0.7b": None if plan is None else {k: plan[k] for k in PLAN_KEYS},
        "memory_vs_plan": memory_check(benches["paper_0.7b"], plan),
        "train": train_check(directory),
        "eval": None if evaluation is None else {"rows": evaluation.get("rows"), "limit": evaluation.get("limit")},
        "generate": generated.read_text().strip() if generated.exists() else None,
    }
    failures = [f"step {s['name']}: {s['status']}" for s in summary["steps"] if s["status"] != "ok"]
    if not summary["train"]["finite"]:
        failures.append("training losses are not finite (or missing)")
    elif not summary["train"]["close"]:
        failures.append(f"SA and XSA losses differ by more than {LOSS_CLOSE:.0%}")
    if not summary["generate"]:
        failures.append("generate wrote no text")
    return summary | {"failures": failures, "ok": not failures}


def fmt_ratio(key: str, s: dict) -> str:
    f = (lambda v: f"{100 * v:.1f}%") if key == "mfu" else (lambda v: f"{v:.3f}")
    interval = "n/a" if s["interval"] is None else f"{f(s['interval'][0])} - {f(s['interval'][1])}"
    target = "" if s["target"] is None else f"{'<=' if s['at_most'] else '>='} {f(s['target'])}"
    return f"| {key} | {f(s['median'])} | {f(s['sd'])} | {interval} | {target} | {s['verdict']} |"


def bench_lines(name: str, b: dict | None) -> list[str]:
    """One benchmark's shape, headline throughput and ratios."""
    if b is None:
        return ["", f"## bench {name}: no result"]
    lines = [
        "",
        f"## bench {b['model']} (context {b['context']} x {b['micro_batch']}, {b['precision']}, "
        f"compile {b['compile']}, {b['rounds']} rounds x {b['steps']} steps)",
        "",
        f"tokens/s (Lightning, SA) {b['tokens_per_s']:,.0f}, step {b['step_time_ms']:.1f} ms",
        "",
        "| ratio | median | sd | 95% interval | target | verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    return lines + [fmt_ratio(key, r) for key, r in b["ratios"].items()]


def train_lines(t: dict) -> list[str]:
    """The SA and XSA training runs and how close their losses are."""
    lines = [
        "",
        "## train (FSDP2 on one device)",
        "",
        "| attention | status | steps | final val loss | tokens/s |",
        "|---|---|---:|---:|---:|",
    ]
    for a in ("sa", "xsa"):
        r = t[a] or {}
        loss = r.get("final_val_loss")
        loss_cell = "" if loss is None else f"{loss:.4f}"
        lines.append(
            f"| {a} | {r.get('status')} | {r.get('steps')} | {loss_cell} | {r.get('tokens_per_s') or 0:,.0f} |"
        )
    diff = t["relative_difference"]
    diff_text = "n/a" if diff is None else f"{diff:.3f}"
    lines.append(
        f"\nlosses finite: {t['finite']}; |XSA - SA| / SA = {diff_text} (close: within {t['close_within']:.0%})"
    )
    return lines


def markdown(s: dict) -> str:
    lines = [
        f"# GPU check ({s['mode']}): {'all steps passed' if s['ok'] else 'FAILED'}",
        "",
        f"{s['device']}; {s['seconds']} s in all.",
        "",
        "| step | status | seconds | note |",
        "|---|---|---:|---|",
    ]
    lines += [f"| {t['name']} | {t['status']} | {t['seconds']} | {t.get('last_line', '')} |" for t in s["steps"]]
    for name, b in s["bench"].items():
        lines += bench_lines(name, b)
    m = s["memory_vs_plan"]
    if m:
        lines += [
            "",
            f"peak memory paper_0.7b (Lightning step): {m['measured_bytes'] / 2**30:.2f} GiB measured, "
            f"{m['planned_bytes'] / 2**30:.2f} GiB planned: {m['measured_over_planned']:.2f}x "
            f"({'within' if m['ok'] else 'outside'} {m['within']:.0%})",
        ]
    lines += train_lines(s["train"])
    if s["eval"]:
        lines += ["", "## eval smoke", ""]
        lines += [f"- {r.get('run')}: average {r.get('average')}" for r in s["eval"]["rows"]]
    lines += ["", "## generate (XSA, greedy)", "", "```", s["generate"] or "(nothing)", "```"]
    if s["failures"]:
        lines += ["", "## failures", ""] + [f"- {f}" for f in s["failures"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    parser.add_argument("--seconds", type=int, default=0)
    args = parser.parse_args()
    summary = assemble(args.directory, args.mode, args.seconds)
    (args.directory / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.directory / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"wrote {args.directory / 'summary.json'} and {args.directory / 'summary.md'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
