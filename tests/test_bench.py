"""The training benchmark runs end to end and writes the keys the README and notes rely on (no timing asserts); its
statistics against hand-computed numbers; its rounds' order and plan; each phase in its own process."""

import contextlib
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from tests.helpers import refused_in_process
from xsa_lm.bench import loops, run, stats
from xsa_lm.bench.loops import (
    Arms,
    Kernels,
    Phase,
    PlainTrainer,
    Probe,
    Setup,
    TimedPhase,
    interleaved,
    measure,
    round_order,
    run_fresh,
)
from xsa_lm.bench.stats import MEETS, MISSES, NO_TARGET, NOT_RESOLVED, Ratio, rounds_needed, summarize
from xsa_lm.errors import UserError
from xsa_lm.model import GPTConfig
from xsa_lm.train.hardware import peak_flops
from xsa_lm.train.schedule import warmup_cosine_scheduler

REPO = Path(__file__).resolve().parents[1]
PAPER = Arms(baseline="sa", candidate="xsa")  # configs/bench.yaml's


def test_a_ratio_is_summarized_by_its_spread_geometric_mean_and_the_hodges_lehmann_interval_of_its_logs():
    """Six rounds: the signed-rank test's tails are 1/64 each, so the 95% interval spans the Walsh averages' range
    (the values' own); ten: its critical rank is 9 of the 55 Walsh averages (tables: T <= 8 rejects at 5%)."""
    logs = [0.0, 0.01, 0.02, 0.03, 0.04, 0.1]
    assert summarize([math.exp(x) for x in logs], None, True).interval == pytest.approx([1.0, math.exp(0.1)])
    ten = np.linspace(0.0, 0.09, 10)
    walsh = sorted((a + b) / 2 for i, a in enumerate(ten) for b in ten[i:])
    expected = [math.exp(walsh[8]), math.exp(walsh[-9])]
    assert summarize(np.exp(ten).tolist(), None, True).interval == pytest.approx(expected, rel=1e-12)
    assert summarize([1.0, 1.04, 1.02, 1.01, 1.0], None, True).interval is None  # 5 rounds: none reaches 95%
    assert summarize([1.01] * 6, None, True).interval == pytest.approx([1.01, 1.01])
    s = summarize([1.0, 1.04, 1.02, 1.01, 1.03, 1.015], target=1.02, at_most=True).to_json()
    assert s["median"] == pytest.approx(1.0175) and s["min"] == 1.0 and s["max"] == 1.04
    assert s["mean"] == pytest.approx((1.0 * 1.04 * 1.02 * 1.01 * 1.03 * 1.015) ** (1 / 6))
    assert s["sd"] == pytest.approx(0.0142887, rel=1e-5)  # sample standard deviation of the six
    assert s["interval"] == pytest.approx([1.0, 1.04]) and s["verdict"] == NOT_RESOLVED
    assert s["rounds"] == [1.0, 1.04, 1.02, 1.01, 1.03, 1.015] and s["confidence"] == 0.95
    assert Ratio.from_json(s) == summarize([1.0, 1.04, 1.02, 1.01, 1.03, 1.015], target=1.02, at_most=True)  # scale's


def drifting_device(rng: np.random.Generator, seconds: float) -> Callable[[float], float]:
    """A GPU's speed factor over time: drift over 0.1-1 s (an AR(1) of the log with 0.3 s memory, sd 3%) and bursts
    where it runs 10% slower, as the H200's bench rounds showed; per-step jitter comes on top."""
    grid = np.arange(0.0, seconds, 0.01)
    keep = math.exp(-0.01 / 0.3)
    walk = np.zeros(len(grid))
    for i in range(1, len(grid)):
        walk[i] = keep * walk[i - 1] + math.sqrt(1 - keep**2) * 0.03 * rng.standard_normal()
    bursts = np.repeat(rng.random(len(grid) // 50) < 0.1, 50)[: len(grid)] * math.log(1.1)
    return lambda t: math.exp(np.interp(t, grid, walk + bursts))


def synthetic_rounds(design: str, rounds: int, seed: int) -> list[float]:
    """Per round, XSA/SA from 40 ms SA steps and XSA steps 1% slower on a drifting device with 0.3% jitter per step:
    `abab` 10 steps of each interleaved (ABBA) in one process, paired; `windows` (the old design) 6 steps of SA, a
    0.25-s gap, 6 of XSA, each window's median."""
    rng = np.random.default_rng(seed)
    speed, t, out = drifting_device(rng, rounds * 2.0 + 1), 0.0, []
    for r in range(rounds):
        times: dict[str, list[float]] = {"sa": [], "xsa": []}
        pattern = [a for i in range(10) for a in (("sa", "xsa") if i % 2 == 0 else ("xsa", "sa"))]
        if design == "windows":
            pattern = ["sa"] * 6 + ["gap"] + ["xsa"] * 6 if r % 2 == 0 else ["xsa"] * 6 + ["gap"] + ["sa"] * 6
        for arm in pattern:
            if arm == "gap":
                t += 0.25
                continue
            step = 0.040 * (1.01 if arm == "xsa" else 1.0) * speed(t) * math.exp(0.003 * rng.standard_normal())
            times[arm].append(step)
            t += step
        pid = 1 if design == "abab" else 2  # interleaved in one process: paired step by step
        sa, xsa = (TimedPhase(p, 1, False, times[a], times[a], "flash", None, "") for p, a in ((1, "sa"), (pid, "xsa")))
        out.append(stats.round_ratio(xsa, sa, "wall"))
        t += 1.0  # the next round's processes start
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interleaved_steps_resolve_a_one_percent_cost_under_drift_that_two_windows_do_not(seed: int):
    """20 rounds: the paired interval holds the true 1.01, is under 1% wide and excludes no cost (1.0), deciding a
    1.02 target; the two windows' rounds spread 4-5% (the H200's 3.3%) and their interval is over 3% wide."""
    abab = summarize(synthetic_rounds("abab", 20, seed), target=1.02, at_most=True)
    low, high = abab.interval
    assert 1.0 < low < 1.01 < high < 1.02 and high - low < 0.01 and abab.verdict == MEETS
    windows = summarize(synthetic_rounds("windows", 20, seed), target=1.02, at_most=True).interval
    assert windows[1] - windows[0] > 0.03


class Recorder:
    """A trainer that records the order of its steps (interleaved() needs only .setup.device and .step)."""

    def __init__(self, name: str, log: list, device: str = "cpu") -> None:
        self.setup, self.name, self.log = Setup(torch.device(device), "32-true", False, None, None), name, log

    def step(self, batch) -> None:
        self.log.append((self.name, batch))


def test_two_loops_step_interleaved_abba_on_the_same_batches_and_each_gets_its_own_times():
    log: list = []
    times = interleaved([Recorder("sa", log), Recorder("xsa", log)], ["b0", "b1", "b2"], 4)
    assert log == [("sa", "b0"), ("xsa", "b0"), ("xsa", "b1"), ("sa", "b1"), ("sa", "b2"), ("xsa", "b2")] + [
        ("xsa", "b0"),
        ("sa", "b0"),
    ]
    assert [len(t) for arm in times for t in arm] == [4, 4, 4, 4]  # per loop: wall and CPU time of each of its steps


@pytest.mark.parametrize(
    ("bounds", "target", "at_most", "expected"),
    [
        ((0.99, 1.015), 1.02, True, MEETS),
        ((1.021, 1.05), 1.02, True, MISSES),
        ((1.00, 1.04), 1.02, True, NOT_RESOLVED),  # straddles the target: more rounds would decide
        ((0.98, 1.01), 0.97, False, MEETS),
        ((0.90, 0.96), 0.97, False, MISSES),
        ((0.95, 0.99), 0.97, False, NOT_RESOLVED),
        (None, 1.02, True, NOT_RESOLVED),
        ((0.4, 0.5), None, False, NO_TARGET),
    ],
)
def test_verdict_needs_the_whole_interval_on_one_side(bounds, target, at_most, expected):
    assert stats.verdict(bounds, target, at_most) == expected


def test_rounds_needed_is_the_fewest_whose_interval_clears_the_target():
    """Logs of the pilot: mean 0, sd 0.02; the target 1.02 is log 0.0198 away. n must satisfy
    t(n - 1) x 0.02 / sqrt(n) < 0.0198: n = 6 gives 2.571 x 0.02 / 2.449 = 0.0210 (not yet), n = 7 gives
    2.447 x 0.02 / 2.646 = 0.0185."""
    pilot = [math.exp(x) for x in (-0.02 * math.sqrt(1.5), 0.0, 0.0, 0.02 * math.sqrt(1.5))]  # sd of the logs 0.02
    assert rounds_needed(pilot, 1.02) == 7
    assert rounds_needed([1.03, 1.03], 1.02) == 6  # no spread: the fewest with an interval
    assert rounds_needed([math.exp(-0.01), math.exp(0.01)], 1.0) > 1e6  # a centre on the target: no number will do
    assert rounds_needed([0.90, 0.92, 0.91], 1.02) == 6  # far below: the fewest with an interval decide


def test_a_rounds_processes_rotate():
    units = ["sa_flash+xsa_flash", "sa_math+xsa_math", "lightning"]
    assert [round_order(units, r)[0] for r in range(4)] == [*units, units[0]]
    assert round_order(units, 1) == ["sa_math+xsa_math", "lightning", "sa_flash+xsa_flash"]


def test_the_phases_and_ratios_are_named_by_the_arms_attention_options():
    """Any two options, e.g. a lab's gated attention against XSA: its phases pair as SA's and XSA's do."""
    arms = Arms(baseline="xsa", candidate="gated_v2")
    assert arms.phases("flash") == ("xsa_flash", "gated_v2_flash")
    rounds = [{"xsa_flash": timed(0.1), "gated_v2_flash": timed(0.12), "lightning": timed(0.1)}] * 2
    kernels = kernel_choice(["flash"], "flash")
    probe = Probe(1, 1, False, kernels, "cpu", None, "", 1.0, 1.0)
    out, ratios = stats.summarize_rounds(rounds, probe, kernels, model="t", device_type="cpu", tokens=100, arms=arms)
    assert ratios["gated_v2_over_xsa_step_time"].median == pytest.approx(1.2) and "gated_v2_over_xsa_cpu_time" in ratios
    assert not any(key.startswith("xsa_over_sa") for key in [*ratios, *out])
    plan = stats.plan_rounds(rounds, kernels, 10.0, budget_s=100, max_rounds=40, device_type="cpu", arms=arms)
    assert plan.needed == 6  # the candidate's ratio over its baseline's: no spread, the fewest with an interval


def timed(step: float, cpu_scale: float = 1.0) -> TimedPhase:
    return TimedPhase(1, 1, False, [step] * 3, [cpu_scale * step] * 3, "flash", None, "")


def pilot_round(sa: float, xsa: float, *, cpu_scale: float = 1.0) -> dict:
    """One round's phases as measure() returns them: SA and XSA under flash, and Lightning."""
    return {"sa_flash": timed(sa, cpu_scale), "xsa_flash": timed(xsa, cpu_scale), "lightning": timed(sa, cpu_scale)}


def kernel_choice(timed: list[str], primary: str) -> Kernels:
    return Kernels(order=timed, used=primary, candidates=timed, takes={}, timed=timed, primary=primary)


def test_rounds_are_planned_from_the_pilots_spread_within_the_budget():
    kernels = kernel_choice(["flash", "math"], "flash")  # flash: the kernel train runs, the headline
    pilot = [pilot_round(0.1, 0.1 * math.exp(x)) for x in (-0.0245, 0.0, 0.0, 0.0245)]  # as in the test above
    for r, x in zip(pilot, (-0.03, 0.05, 0.0, 0.04), strict=True):  # math's XSA/SA near its target: ignored
        r |= {"sa_math": r["sa_flash"], "xsa_math": timed(1.02 * math.exp(x) * 0.1)}
    plan = partial(
        stats.plan_rounds, pilot, kernels=kernels, elapsed_s=40.0, max_rounds=40, device_type="cpu", arms=PAPER
    )
    roomy = plan(budget_s=1000)
    assert roomy.needed == 7 and roomy.rounds == 7 and roomy.clock == "cpu" and roomy.limited_by == "needed"
    tight = plan(budget_s=50)  # 10 s a round: 1 more fits
    assert tight.affordable == 5 and tight.rounds == 5 and tight.limited_by == "budget_s"
    assert plan(budget_s=10).rounds == 4  # the pilot alone took longer than the budget


def test_each_ratio_is_summarized_on_both_clocks_from_its_own_rounds():
    rounds = [pilot_round(0.1, 0.11, cpu_scale=2.0), pilot_round(0.2, 0.2, cpu_scale=2.0)]
    kernels = kernel_choice(["flash"], "flash")
    probe = Probe(1, 1, False, kernels, "cpu", None, "", 1.0, 1.0)
    out, ratios = stats.summarize_rounds(rounds, probe, kernels, model="t", device_type="cpu", tokens=100, arms=PAPER)
    assert ratios["xsa_over_sa_step_time"].rounds == pytest.approx([1.1, 1.0])  # paired within each round
    assert ratios["xsa_over_sa_cpu_time"].rounds == pytest.approx([1.1, 1.0])
    assert ratios["xsa_over_sa_cpu_time"].clock == "cpu" and ratios["xsa_over_sa_step_time"].kernel == "flash"
    assert out["sa_flash_step_ms"] == pytest.approx(150.0) and out["sa_flash_cpu_ms"] == pytest.approx(300.0)
    assert "mfu" not in ratios  # no peak FLOP/s known


@pytest.mark.parametrize(
    ("model", "device", "target"),
    [
        ("paper_0.7b", "cuda (NVIDIA H100 80GB HBM3, torch 2.11)", 0.45),
        ("paper_0.7b", "cuda (NVIDIA H200, torch 2.11)", 0.45),  # whole GPU names
        ("paper_0.7b", "cuda (NVIDIA GH200 480GB, torch 2.11)", None),
        ("paper_0.7b (n_layer=2)", "cuda (NVIDIA H100 80GB HBM3, torch 2.11)", None),  # a changed preset
        ("gpt2_124m", "cuda (NVIDIA H100 80GB HBM3, torch 2.11)", None),
    ],
)
def test_the_mfu_target_is_the_paper_models_on_an_h100_or_h200(model: str, device: str, target: float | None):
    assert stats.mfu_target(model, device) == target


def tiny_phase(**changes) -> Phase:
    config = GPTConfig(n_layer=1, d_model=32, n_head=2, head_dim=16, block_size=16, vocab_size=64)
    scheduler = partial(warmup_cosine_scheduler, warmup_steps=1, min_lr_ratio=0.1)
    setup = Setup(torch.device("cpu"), "32-true", False, partial(torch.optim.AdamW, lr=1e-3), scheduler)
    loop = dict(micro_batch=2, warmup=1, steps=2, seed=0, threads=None, reuse_host_memory=False)
    return replace(Phase("plain", config, setup, **loop), **changes)


@pytest.mark.slow
def test_a_phase_runs_under_its_kernel_and_times_both_clocks_and_a_failing_one_ends_the_bench_in_one_line():
    found = measure(tiny_phase(kind="probe"))
    assert isinstance(found, Probe) and found.kernels.order == ["flash", "math"] and found.kernels.used == "flash"
    assert found.kernels.takes == {"flash": True, "math": True} and found.device.startswith("cpu")
    assert found.flops_per_token == found.flops_per_token_flop_counter  # SDPA counted through math on CPU
    for kernel in ("math", "flash"):
        sa, xsa = measure(tiny_phase(sdpa=(kernel,), candidate=replace(tiny_phase().model, attention="xsa")))
        assert sa.sdpa_used == xsa.sdpa_used == kernel and sa.pid == xsa.pid and xsa.gpu is None  # one process
        for result in (sa, xsa):
            assert len(result.step_times) == len(result.cpu_step_times) == 2 and min(result.cpu_step_times) > 0
        assert sa.peak_memory_bytes > 0 and xsa.peak_memory_bytes > 0
    with pytest.raises(UserError, match=r"bench phase bad \(round 1\) failed: RuntimeError: .*negative dimension"):
        run_fresh(tiny_phase(micro_batch=-1, threads=1), "bad (round 1)")  # in its own process

    # Ctrl-C reaches the bench and its phase's process alike: the phase ignores it and the bench ends it quietly
    # (SIGTERM's default action) before its own one line; a phase that took it would die of a KeyboardInterrupt
    earlier = {p.pid for p in multiprocessing.active_children()}  # the phases above, if not yet reaped

    def ctrl_c() -> None:  # whatever happens, the bench gets its Ctrl-C within a minute: a failure, never a hang
        deadline = time.monotonic() + 60
        while not (started := [p for p in multiprocessing.active_children() if p.pid not in earlier]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        phases.extend(started)
        if started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(started[0].pid, signal.SIGINT)
        time.sleep(0.5)  # time for a phase that took it to die of it (the bench then says so, not interrupted)
        if not started or started[0].is_alive():
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        for phase in started:  # a Ctrl-C the bench never got: its phase ends, and the test fails instead of waiting
            if phase.is_alive():
                phase.kill()

    phases: list = []
    # Ctrl-C as in a terminal: a suite started in the background (nohup, `&`) inherits SIGINT ignored
    interactive = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=ctrl_c, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_fresh(tiny_phase(steps=10**6, threads=1), "long")
    finally:
        signal.signal(signal.SIGINT, interactive)
    assert [p.exitcode for p in phases] == [-signal.SIGTERM]


class FakeEvent:
    """torch.cuda.Event's timing API over a synthetic device clock: each record() reads the next time in ms."""

    clock: list[float] = []
    synchronized = 0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.clock.pop(0)

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert FakeEvent.synchronized, "read before the device finished"
        return end.at - self.at


def test_on_a_gpu_steps_are_timed_by_cuda_events_with_one_synchronisation_and_nvml_state_read(monkeypatch):
    """The device's clock, not the host's: step i's time is event i to event i + 1 (the host queues ahead and its
    stamps say nothing), with a single synchronisation for the whole phase."""
    FakeEvent.clock, FakeEvent.synchronized = [0.0, 40.0, 80.4, 120.8, 160.8], 0  # SA XSA XSA SA: 40, 40.4 ms
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    log: list = []
    sa, xsa = Recorder("sa", log, device="cuda"), Recorder("xsa", log, device="cuda")
    (sa_wall, _), (xsa_wall, _) = interleaved([sa, xsa], ["b0", "b1"], 2)
    assert sa_wall == pytest.approx([0.040, 0.040]) and xsa_wall == pytest.approx([0.0404, 0.0404])
    assert FakeEvent.synchronized == 1 and not FakeEvent.clock
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1980)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 612_000)  # mW
    monkeypatch.setattr(torch.cuda, "temperature", lambda device: 61)
    state = {"sm_clock_mhz": 1980, "power_w": 612.0, "temperature_c": 61}
    assert loops.gpu_state(torch.device("cuda")) == state and loops.gpu_state(torch.device("cpu")) is None

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    assert loops.gpu_state(torch.device("cuda")) is None


class HostReads(TorchFunctionMode):
    """The steps (by the count of Clocks stamps so far) in which a tensor's value was copied to the host: on a GPU each
    such read waits for every kernel queued before it."""

    READS = {Tensor.item, Tensor.tolist, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.cpu, Tensor.numpy}

    def __init__(self) -> None:
        super().__init__()
        self.steps, self.at = 0, set[int]()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.at.add(self.steps)
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore:.*no `val_dataloader`")
def test_no_timed_step_reads_a_value_back_from_the_device(monkeypatch):
    """Neither the plain loops nor Lightning training LMModule (as `xsa-lm train` does) read anything back in a step
    but the last, which logs and checks for skipped updates (as every logging step does): the host queues ahead."""
    reads, stamp = HostReads(), loops.Clocks.stamp

    def counted(clocks: loops.Clocks) -> None:
        reads.steps += 1
        stamp(clocks)

    monkeypatch.setattr(loops.Clocks, "stamp", counted)
    phase = tiny_phase()
    batches = loops.make_batches(phase.model, micro_batch=2, seed=0, device=phase.setup.device)
    with reads:
        loops.fit_lightning(phase.model, phase.setup, batches, n=8, seed=0)
    assert reads.steps == 8 and reads.at <= {0, 8}  # 0: before the first step (the fit's setup)
    trainers = [PlainTrainer(m, phase.setup, 0, 9) for m in (phase.model, replace(phase.model, attention="xsa"))]
    reads.steps, reads.at = 0, set()
    with reads:
        interleaved(trainers, batches, 4)
    assert reads.steps == 9 and reads.at == set()


def test_the_lightning_phase_times_its_steps_without_lightnings_srun_hint(tmp_path: Path, monkeypatch, recwarn):
    """On a machine with srun (a SLURM login node) Lightning's Trainer hints to prepend it: noise for the bench."""
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    (result,) = measure(tiny_phase(kind="lightning"))
    assert len(result.step_times) == len(result.cpu_step_times) == 2 and result.peak_memory_bytes is None
    assert not [w for w in recwarn if "srun" in str(w.message)]


@pytest.mark.slow
@pytest.mark.long
def test_xsa_lm_bench_smoke_writes_the_report_and_never_overwrites(tmp_path: Path):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "xsa_lm.cli", "bench", "smoke=true", "model.n_layer=2", f"out={out}"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("xsa_over_sa_step_time", "xsa_over_sa_peak_memory", "lightning_over_plain_throughput"):
        assert report[key] > 0, key
    # SA and XSA under each CPU kernel, each ratio on both clocks; Lightning under train's order
    assert report["sdpa"]["order"] == report["sdpa"]["timed"] == ["flash", "math"] and report["sdpa"]["used"] == "flash"
    kernels = {"lightning": "flash", "sa_flash": "flash", "xsa_flash": "flash", "sa_math": "math", "xsa_math": "math"}
    assert report["phase_kernels"] == kernels and report["arms"] == PAPER._asdict()
    for key in ("xsa_over_sa_cpu_time", "xsa_over_sa_step_time_math", "xsa_over_sa_cpu_time_math"):
        assert report[key] > 0 and report["ratios"][key]["clock"] in ("wall", "cpu"), key
    assert report["run_info"]["sdpa"] == {"order": ["flash", "math"], "used": "flash"}
    assert report["device"].startswith("cpu") and report["tokens_per_s"] == report["lightning_tokens_per_s"] > 0
    assert 0 < report["mfu"] < 1 and "measured" in report["peak_flops_source"]
    # every ratio: one value per round, no 95% interval from 2 rounds (the fewest is 6), a verdict
    for key, s in report["ratios"].items():
        assert len(s["rounds"]) == report["rounds"] == 2 and s["interval"] is None, key
        assert s["verdict"] in (NOT_RESOLVED, NO_TARGET), key
    assert report["verdicts"]["mfu"] == NO_TARGET  # the MFU target is for paper_0.7b on an H100/H200
    fit = report["micro_batch_fit"]  # the plan's count in the free memory: the chunked loss fits more
    assert fit["chunked_loss"] > fit["whole_logits"] > 0 and fit["available_bytes"] > 0
    # each kernel's SA and XSA in one process, their steps interleaved; each process fresh, in the rounds' order
    units = ["sa_flash+xsa_flash", "sa_math+xsa_math", "lightning"]
    assert report["interleaved"] == [["sa_flash", "xsa_flash"], ["sa_math", "xsa_math"]]
    expected = [[name for unit in round_order(units, r) for name in unit.split("+")] for r in (0, 1)]
    assert [list(r) for r in report["per_round"]] == expected
    for r in report["per_round"]:
        assert r["sa_flash"]["pid"] == r["xsa_flash"]["pid"] and r["sa_math"]["pid"] == r["xsa_math"]["pid"]
        assert len(r["xsa_flash"]["step_times"]) == len(r["sa_flash"]["step_times"]) == 2
        assert r["lightning"]["gpu"] is None  # no NVML reading on CPU
    assert len({phase["pid"] for r in report["per_round"] for phase in r.values()}) == 2 * 3
    # XSA keeps one more activation per layer (z, the output projection's input); SA's is SDPA's own output
    assert 1.0 < report["xsa_over_sa_peak_memory"] < 1.1
    xsa = report["xsa_memory"]  # as `xsa-lm plan` counts it: compiled, fewer temporaries than eager
    assert 0 < xsa["saved_per_layer"] and 0 < xsa["temporaries_compiled"] < xsa["temporaries_eager"]
    assert "XSA/SA step time" in proc.stdout and "95% interval" in proc.stdout and "MFU" in proc.stdout
    assert "CPU time" in proc.stdout and "runs flash for this model" in proc.stdout
    assert "XSA's memory per layer (the plan's count)" in proc.stdout
    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode != 0 and "exists" in again.stderr and json.loads(out.read_text()) == report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no Hydra folder, no log


@pytest.mark.slow
@pytest.mark.long
def test_bench_data_quick_writes_the_report(tmp_path: Path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_data.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("raw_encode_tokens_per_s", "prepare_tokens_per_s", "loader_windows_per_s", "model_windows_per_s"):
        assert report[key] > 0, key
    assert report["prepare_over_raw"] > 0 and report["loader_over_model"] > 0 and report["tokens"] > 1_000_000
    assert "target >= 0.8" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["out=b1.json/x.json"], "out=b1.json/x.json: b1.json is a file, not a folder; choose another path"),
        (["out=bdir", "overwrite=true"], "out=bdir is a directory: give the file to write, e.g. out=bdir/bench.json"),
        (["out=b1.json"], "out=b1.json exists"),
        (["overwrite=no"], "overwrite=no must be true or false"),
        (["compile=no"], "compile=no must be true or false"),
        (["out=null"], "out=null must be the file bench writes its results to, e.g. out=bench.json"),
        (["out="], "out= must be the file bench writes its results to"),
        (["micro_batch=0"], "micro_batch=0 must be >= 1"),
        (["threads=0"], "threads=0 must be >= 1 or auto"),
        (["steps=1.5"], "steps=1.5 must be an integer"),
        (["rounds=5"], "rounds=5 must be >= 6 or auto"),  # the fewest with a 95% interval
        (["pilot_rounds=1"], "pilot_rounds=1 must be >= 2"),
        (["compile_mode=reduce-overhead"], "compile_mode=reduce-overhead acts only on a compiled step: add compile=t"),
        (["context=100000"], "context=100000 is above model.block_size=128: lower it"),
        (["budget_s=0"], "budget_s=0 must be > 0"),
        (["budget_s=inf"], "budget_s=inf must be a finite number"),  # not after the pilot
        (["budget_s=nan"], "budget_s=nan must be a finite number"),
        (
            ["comparisons=[attention_over_baseline,speed]"],
            "comparisons=['attention_over_baseline', 'speed'] must be one of attention_over_baseline, lightning_over_p",
        ),
        (["backends=[flsh]"], "backends=['flsh'] names no kernel: flsh (it takes auto, train or a list of cudnn,"),
        (["backends=fast"], "backends=fast must be auto, train or a list of cudnn, flash, efficient, math"),
        (["device=tpu"], "device=tpu must be one of auto, cpu, cuda"),
        (["attention=sa"], "bench compares attention=sa with its baseline, attention@baseline=sa: choose another"),
        (["attention=sa", "attention@baseline=xsa"], "measuring tiny\n"),  # SA timed against XSA
        (["attention.layers=[9]"], "attention.layers=[9]: each layer is a 0-based index below model.n_layer=4"),
        # 16-mixed on CPU: Lightning would run bf16-mixed, the hand-written loop fp32, the report say 16-mixed
        *[([f"precision={p}"], f"precision={p} must be auto, 32-true or bf16-mixed") for p in ("16-mixed", 16, "fast")],
        (["precision=bf16-true"], "precision=bf16-true must be auto, 32-true or bf16-mixed: what both the Lightning"),
        # A preset with model.* overrides is another model: the report names them (the preset's MFU target is not its)
        (
            ["model=paper_0.7b", "model.n_layer=2", "model.n_head=6", "model.dropout=0.1"],
            "measuring paper_0.7b (n_layer=2, dropout=0.1)\n",  # n_head=6 is the preset's own
        ),
        (["model=tiny", "model.n_layer=4"], "measuring tiny\n"),
    ],
)
def test_bench_refuses_an_out_or_option_before_measuring_and_labels_the_model(
    args: list[str], message: str, tmp_path: Path, monkeypatch, capsys
):
    """Refused up front in one line, not after minutes of rounds (or inside a phase's process, or at the write), and
    inside its job: nothing but its `out` is ever written where it was typed."""
    (tmp_path / "b1.json").write_text("{}")
    (tmp_path / "bdir").mkdir()
    monkeypatch.chdir(tmp_path)

    def measuring(spec, *, model: str, **rest) -> dict:
        raise UserError(f"measuring {model}")

    monkeypatch.setattr(run, "bench", measuring)
    said = refused_in_process(["bench", "out=b.json", *args], monkeypatch, capsys)
    assert said.startswith(f"xsa-lm: error: {message}") and said.count("\n") == 1
    assert (tmp_path / "b1.json").read_text() == "{}" and not any((tmp_path / "bdir").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b1.json", "bdir"]


@pytest.mark.parametrize(
    ("name", "bf16", "source"),
    [
        ("NVIDIA L4", 121e12, "lightning"),
        ("NVIDIA L40", 181.05e12, "L40 dense"),  # Lightning reads it as an L4
        ("NVIDIA L40S", 362.05e12, "L40S dense"),
        ("NVIDIA H100 80GB HBM3", 989.4e12, "lightning"),  # the SXM board
        ("NVIDIA H100 NVL", 835.5e12, "H100 NVL dense"),  # not the sparse number
        ("NVIDIA H100 PCIe", 756e12, "lightning"),
        ("NVIDIA H200", 989.5e12, "H200 dense"),  # unknown to Lightning
        ("NVIDIA H200 NVL", 835.5e12, "H200 NVL dense"),
        ("NVIDIA GH200 480GB", 989.5e12, "GH200 dense"),
        ("NVIDIA A100-SXM4-40GB", 312e12, "lightning"),
        ("NVIDIA A100 80GB PCIe", 312e12, "lightning"),
        ("NVIDIA H20", None, "known neither"),
        ("NVIDIA H800 PCIe", None, "known neither"),
        ("Tesla T4", None, "known neither"),  # no bf16
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None, "MIG slice"),
    ],
)
def test_peak_flops_of_a_gpu_by_its_whole_name(name: str, bf16: float | None, source: str, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, said = peak_flops(torch.device("cuda", 0), "bf16-mixed")
    assert peak == (pytest.approx(bf16) if bf16 else None) and source in said
