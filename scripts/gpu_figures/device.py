"""What the report says of the device, and the figures that depend on it: peak memory and MFU."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from .run import Run

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; the first name contained in the
# device's name wins, so the more specific names come first.
DENSE_BF16_TFLOPS = (
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.5),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.4),
    ("H200 NVL", 835.5),
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def peak_bf16_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in DENSE_BF16_TFLOPS if key in name), None)


def device_description(device: torch.device) -> dict[str, Any]:
    try:
        import ctranslate2

        ctranslate2_version = ctranslate2.__version__
    except Exception:  # not installed, or its libraries do not load here
        ctranslate2_version = None
    cuda = device.type == "cuda"
    return {
        "type": device.type,
        "name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "dense_bf16_peak_tflops": peak_bf16_tflops(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "ctranslate2": ctranslate2_version,
    }


def peak_memory_gib(device: torch.device) -> float | str:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else "n/a"


def mfu(run: Run, tflops: float) -> float | str:
    peak = peak_bf16_tflops(run.device)
    return round(100 * tflops / peak, 1) if peak and run.bf16 else "n/a"
