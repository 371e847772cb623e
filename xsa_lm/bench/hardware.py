"""What the device can do: its peak FLOP/s (a datasheet table for GPUs, a measured matmul on CPU) and its memory."""

import time

import torch

# Dense (no sparsity) peak FLOP/s from NVIDIA datasheets, SXM parts unless named: bf16 and tf32 tensor cores.
# Names are matched against torch.cuda.get_device_name(), longest first ("H100 PCIe" before "H100").
PEAK_FLOPS = {
    "B200": {"bf16": 2250e12, "tf32": 1100e12},
    "H200": {"bf16": 989e12, "tf32": 495e12},
    "H100 PCIe": {"bf16": 756e12, "tf32": 378e12},
    "H100": {"bf16": 989e12, "tf32": 495e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
    "L40S": {"bf16": 362e12, "tf32": 183e12},
    "L4": {"bf16": 121e12, "tf32": 60e12},
}


def synchronize(device: torch.device) -> None:
    """Wait for queued work, so that a host clock measures the device's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of the best of `repeats` n x n x n matmuls: the denominator of MFU where no datasheet applies."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """The device's peak FLOP/s for this precision, and where the number comes from."""
    if device.type == "cpu":
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
        return measured_matmul_peak(device, dtype), f"measured: best {dtype} 1024^3 matmul on this CPU"
    name = torch.cuda.get_device_name(device)
    kind = "bf16" if precision.startswith("bf16") else "tf32"
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key][kind], f"datasheet: {key} dense {kind}"
    return None, f"{name} is not in xsa_lm.bench.hardware.PEAK_FLOPS: add its dense {kind} FLOP/s for MFU"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, torch {torch.__version__})"
    return f"cpu ({torch.get_num_threads()} threads, torch {torch.__version__})"
