"""Which float types this CPU multiplies in hardware. Elsewhere torch emulates bfloat16 and float16 by converting to
float32, slower than float32 itself, so the package refuses them there rather than run slowly and round more.

torch reports the instruction sets, and what oneDNN may use of them, through private functions only (torch.cpu._is_*,
torch.ops.mkldnn._is_*): they are read here and nowhere else, and tests/kernels/test_cpu_features.py names each, so
that a rename fails there.
"""

import subprocess
import sys
from functools import cache

import torch

# What the CPU needs for each reduced float type, as the refusal names it
NATIVE_INSTRUCTIONS = {torch.bfloat16: "AVX512-BF16 or AMX-BF16", torch.float16: "AVX512-FP16 or AMX-FP16"}


@cache
def cpu_bf16_matmul_works() -> bool:
    """Whether a bfloat16 matmul runs on this CPU, tried in a child process since the failure is a crash (SIGILL):
    some virtual machines advertise AMX that they do not enable."""
    probe = "import torch; torch.randn(8, 64, dtype=torch.bfloat16) @ torch.randn(64, 64, dtype=torch.bfloat16)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def has_native_instructions(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions multiplying `dtype` (float32 always; bfloat16 with AVX512-BF16 or AMX, which
    brings AMX-BF16 on every CPU that has it; float16 with AVX512-FP16 or AMX-FP16, as oneDNN reports them, which
    ONEDNN_MAX_CPU_ISA can lower: torch has no report of AVX512-FP16 of its own)."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()  # AVX512-FP16 or AMX-FP16, as oneDNN needs
    return dtype == torch.float32


def onednn_runs_bf16() -> bool:
    """Whether oneDNN takes bfloat16 products here: on a CPU with AVX-512 (or AVX-NE-CONVERT), unless
    ONEDNN_MAX_CPU_ISA holds it below that."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_float_type_problem(dtype: torch.dtype) -> str | None:
    """Why `dtype` cannot compute on this CPU at its speed, in a phrase, or None where it can."""
    if dtype in NATIVE_INSTRUCTIONS and not has_native_instructions(dtype):
        name = str(dtype).removeprefix("torch.")
        return f"this CPU has no {NATIVE_INSTRUCTIONS[dtype]}, so torch would emulate {name}, slower than float32"
    if dtype == torch.bfloat16 and not onednn_runs_bf16():
        return "oneDNN is held below the CPU's bfloat16 instructions (ONEDNN_MAX_CPU_ISA)"
    if dtype == torch.bfloat16 and not cpu_bf16_matmul_works():
        return "a bfloat16 matmul stops the process with an illegal instruction (AMX advertised, not enabled)"
    return None
