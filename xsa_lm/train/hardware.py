"""What the device can do: its peak FLOP/s (a datasheet table for GPUs, a measured matmul on CPU) and its memory."""

import functools
import re
import timeit

import torch

# Dense (no sparsity) peak FLOP/s from NVIDIA datasheets (which print the sparse numbers, 2x these): bf16 and tf32
# tensor cores. Keyed by the part and its board where the board changes the clocks or the power: "H100" is the SXM
# board (torch names it "NVIDIA H100 80GB HBM3"), "H100 PCIe" and "H100 NVL" the PCIe cards. A100 40GB and 80GB peak
# alike, as do an A100's SXM and PCIe boards. Not lightning.fabric's get_available_flops (checked in 2.6.6): it
# knows no "NVIDIA H200" (torch's name for one) and reads an "NVIDIA L40S" as an L4.
PEAK_FLOPS = {
    "B200": {"bf16": 2250e12, "tf32": 1100e12},
    "H200": {"bf16": 989.5e12, "tf32": 494.5e12},
    "H200 NVL": {"bf16": 835.5e12, "tf32": 417.5e12},
    "H100": {"bf16": 989.5e12, "tf32": 494.5e12},
    "H100 NVL": {"bf16": 835.5e12, "tf32": 417.5e12},
    "H100 PCIe": {"bf16": 756.5e12, "tf32": 378e12},
    "GH200": {"bf16": 989.5e12, "tf32": 494.5e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
    "A100 PCIe": {"bf16": 312e12, "tf32": 156e12},
    "L40S": {"bf16": 362.05e12, "tf32": 183e12},
    "L40": {"bf16": 181.05e12, "tf32": 90.5e12},
    "L4": {"bf16": 121e12, "tf32": 60e12},
}
BOARDS = {"PCIE": "PCIe", "NVL": "NVL"}  # SXM (SXM4, SXM5 or unnamed) is the part's own entry
UNKNOWN_WORDS = ("MIG",)  # a MIG slice has a fraction of the SMs: no datasheet number applies


def datasheet_key(name: str) -> str | None:
    """PEAK_FLOPS's key for a CUDA device name, matched word by word: "NVIDIA A100-SXM4-40GB" -> "A100",
    "NVIDIA H100 NVL" -> "H100 NVL", "NVIDIA L40" -> "L40" (never "L4"); None when the table has no such part."""
    words = [w for w in re.split(r"[\s\-_]+", name.strip()) if w]
    if words and words[0].upper() == "NVIDIA":
        words = words[1:]
    if not words or any(w.upper() in UNKNOWN_WORDS for w in words):
        return None
    boards = {BOARDS[w.upper()] for w in words[1:] if w.upper() in BOARDS}
    if len(boards) > 1:
        return None
    key = " ".join([words[0].upper(), *boards])
    return key if key in PEAK_FLOPS else None


def datasheet_peak(name: str, precision: str) -> tuple[float | None, str]:
    """A CUDA device's dense peak FLOP/s for this precision from PEAK_FLOPS, and where the number comes from."""
    kind = "bf16" if precision.startswith("bf16") else "tf32"
    key = datasheet_key(name)
    if key is None:
        return None, f"{name} is not in xsa_lm.train.hardware.PEAK_FLOPS: add its dense {kind} FLOP/s for MFU"
    return PEAK_FLOPS[key][kind], f"datasheet: {key} dense {kind}"


def synchronize(device: torch.device) -> None:
    """Wait for queued work, so that a host clock measures the device's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache
def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """The device's peak FLOP/s for this precision, and where the number comes from: where no datasheet applies (on
    CPU), the best of 20 n x n x n matmuls (about a second: measured once per process)."""
    if device.type == "cpu":
        dtype, n = torch.bfloat16 if precision.startswith("bf16") else torch.float32, 1024
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        best = min(timeit.repeat(lambda: a @ b, number=1, repeat=20))
        return 2 * n**3 / best, f"measured: best {dtype} {n}^3 matmul on this CPU"
    return datasheet_peak(torch.cuda.get_device_name(device), precision)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, torch {torch.__version__})"
    return f"cpu ({torch.get_num_threads()} threads, torch {torch.__version__})"
