"""GPU memory as the driver counts it, per process (NVML), for the memory metrics and out-of-memory lines.

torch's allocator figures (`torch.cuda.max_memory_allocated` ...) cover one process's tensors;
a GPU shared by a trainer and a vLLM server also holds each process's CUDA context, libraries'
workspaces, CUDA graphs and the allocator's cached blocks. NVML (`nvidia-ml-py`, in the CUDA
images) reports each process's whole use. Every function returns None (or nothing) where NVML is
missing or cannot see the processes (a container may hide other processes' pids).
"""

from __future__ import annotations

import contextlib

__all__ = ["GIB", "device_processes", "device_total_bytes", "process_gpu_bytes"]

GIB = float(2**30)


@contextlib.contextmanager
def _nvml():
    """pynvml, initialised for the block (None without NVML); NVML errors inside the block give None results."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def device_processes(index: int | None = None) -> dict[int, int] | None:
    """{pid: bytes} of the compute processes on GPU `index` (every GPU when None), None without NVML."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            found: dict[int, int] = {}
            for number in range(nvml.nvmlDeviceGetCount()) if index is None else [index]:
                handle = nvml.nvmlDeviceGetHandleByIndex(number)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.usedGpuMemory is not None:
                        found[process.pid] = found.get(process.pid, 0) + int(process.usedGpuMemory)
            return found
        except nvml.NVMLError:
            return None


def process_gpu_bytes(pid: int) -> int | None:
    """The GPU memory the driver counts for process `pid`, None when NVML cannot say."""
    found = device_processes()
    return None if found is None else found.get(pid)


def device_total_bytes(index: int = 0) -> int | None:
    """The memory of GPU `index` as the driver reports it, None without NVML or that GPU."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index)).total)
        except nvml.NVMLError:
            return None
