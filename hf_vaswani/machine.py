"""The machine a run ran on, as its results and the model card name it: the CPU's model name and the GPU's."""

import platform
from pathlib import Path

import torch


def cpu_model_name() -> str:
    """The CPU's model name as lscpu prints it (from /proc/cpuinfo on Linux), else what the platform reports."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name where `device` is one (a run's scores then follow its kernels), else None."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
