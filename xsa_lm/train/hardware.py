"""What the device can do: its peak FLOP/s (Lightning's table and ours on GPUs, a measured matmul on CPU)."""

import functools
import re
import timeit
import warnings

import torch
from lightning.fabric.utilities.throughput import get_available_flops

# Dense bf16 and tf32 peak FLOP/s (NVIDIA datasheets) of the GPUs that Lightning's get_available_flops misreads (in
# 2.6.6): it knows no "NVIDIA H200" (torch's name), H200 NVL, GH200 or B200, gives the H100 NVL its sparse (2x) numbers,
# reads "NVIDIA L40S" and "NVIDIA L40" as an L4. Keyed by the part, and its board where that changes clocks or power.
MISREAD = {
    "B200": {"bf16": 2250e12, "tf32": 1100e12},
    "H200": {"bf16": 989.5e12, "tf32": 494.5e12},
    "H200 NVL": {"bf16": 835.5e12, "tf32": 417.5e12},
    "H100 NVL": {"bf16": 835.5e12, "tf32": 417.5e12},
    "GH200": {"bf16": 989.5e12, "tf32": 494.5e12},
    "L40S": {"bf16": 362.05e12, "tf32": 183e12},
    "L40": {"bf16": 181.05e12, "tf32": 90.5e12},
}
BOARDS = {"PCIE": "PCIe", "NVL": "NVL"}  # SXM (SXM4, SXM5 or unnamed) is the part's own entry


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """The device's peak FLOP/s for this precision, and where the number comes from: a measured matmul on CPU
    (Lightning has no CPU number); on a GPU MISREAD's dense number, else Lightning's. The GPU's name is matched word
    by word: "NVIDIA H200 NVL" is "H200 NVL", "NVIDIA L40" is "L40" (never "L4")."""
    if device.type == "cpu":
        return cpu_peak(precision)
    name, kind = torch.cuda.get_device_name(device), "bf16" if precision.startswith("bf16") else "tf32"
    words = [w.upper() for w in re.split(r"[\s\-_]+", name.strip()) if w]
    words = words[1:] if words[:1] == ["NVIDIA"] else words
    if "MIG" in words:  # a fraction of the SMs: no datasheet number applies
        return None, f"{name} is a MIG slice: no peak FLOP/s for MFU"
    boards = {BOARDS[w] for w in words[1:] if w in BOARDS}
    key = " ".join([words[0], *boards]) if words and len(boards) < 2 else ""
    if key in MISREAD:
        return MISREAD[key][kind], f"datasheet: {key} dense {kind}"
    with warnings.catch_warnings():  # its "FLOPs not found" becomes the source below
        warnings.simplefilter("ignore")
        peak = get_available_flops(device, torch.bfloat16 if kind == "bf16" else torch.float32)
    if peak is None:
        return None, f"{name} is known neither to Lightning nor to xsa_lm.train.hardware.MISREAD: add its dense {kind}"
    return float(peak), f"lightning.fabric get_available_flops: {name} {kind}"


def synchronize(device: torch.device) -> None:
    """Wait for queued work, so that a host clock measures the device's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache
def cpu_peak(precision: str) -> tuple[float, str]:
    """The best of 20 n x n x n matmuls (about a second: measured once per process)."""
    dtype, n = torch.bfloat16 if precision.startswith("bf16") else torch.float32, 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = min(timeit.repeat(lambda: a @ b, number=1, repeat=20))
    return 2 * n**3 / best, f"measured: best {dtype} {n}^3 matmul on this CPU"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, torch {torch.__version__})"
    return f"cpu ({torch.get_num_threads()} threads, torch {torch.__version__})"
