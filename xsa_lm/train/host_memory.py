"""CPU memory reuse: glibc returns every large freed block to the OS and maps fresh pages for the next one."""

import ctypes
import ctypes.util

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8


def reuse_freed_host_memory(keep_bytes: int = 256 * 2**20) -> bool:
    """Serve tensors from malloc's heap, keeping up to `keep_bytes` freed, so that a step does not page-fault its
    activations in again (~25% of a CPU step of the tiny model). False where there is no glibc mallopt (macOS, musl)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, keep_bytes) and libc.mallopt(M_ARENA_MAX, 1)
    return bool(ok and libc.mallopt(M_TOP_PAD, 64 * 2**20))
