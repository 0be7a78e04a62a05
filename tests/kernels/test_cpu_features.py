"""Which float types the CPU multiplies in hardware: torch's private reports, checked against the kernel's own list of
the CPU's flags (/proc/cpuinfo), and the refusal of the others."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_vaswani.kernels import cpu as cpu_kernels
from hf_vaswani.kernels import cpu_features
from hf_vaswani.kernels.cpu import PACKED_WEIGHTS, FastestKernelLinear, multiplying_by, packed
from hf_vaswani.kernels.cpu_features import cpu_float_type_problem, has_native_instructions


def test_the_private_torch_functions_read_here_still_exist() -> None:
    for report in (
        torch.cpu._is_avx512_bf16_supported,
        torch.cpu._is_amx_tile_supported,
        torch.ops.mkldnn._is_mkldnn_fp16_supported,
        torch.ops.mkldnn._is_mkldnn_bf16_supported,
    ):
        assert isinstance(report(), bool)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="the CPU's flags are read from Linux's /proc/cpuinfo")
def test_native_float_types_agree_with_the_flags_linux_lists() -> None:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = set(next(line for line in lines if line.startswith("flags")).split(":", 1)[1].split())
    assert has_native_instructions(torch.float32)
    assert has_native_instructions(torch.bfloat16) == bool(flags & {"avx512_bf16", "amx_bf16"})
    if "ONEDNN_MAX_CPU_ISA" not in os.environ:  # float16's report is oneDNN's, which that setting lowers
        assert has_native_instructions(torch.float16) == bool(flags & {"avx512_fp16", "amx_fp16"})


def test_a_reduced_float_type_is_refused_without_its_instructions_or_where_its_matmul_traps(monkeypatch) -> None:
    monkeypatch.setattr(cpu_features, "has_native_instructions", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(cpu_features, "cpu_bf16_matmul_works", lambda: True)
    monkeypatch.setattr(cpu_features, "onednn_runs_bf16", lambda: True)
    assert cpu_float_type_problem(torch.float32) is None
    assert "no AVX512-BF16 or AMX-BF16" in cpu_float_type_problem(torch.bfloat16)
    assert "no AVX512-FP16 or AMX-FP16" in cpu_float_type_problem(torch.float16)
    monkeypatch.setattr(cpu_features, "has_native_instructions", lambda dtype: True)
    assert cpu_float_type_problem(torch.bfloat16) is None and cpu_float_type_problem(torch.float16) is None
    monkeypatch.setattr(cpu_features, "cpu_bf16_matmul_works", lambda: False)
    assert "illegal instruction" in cpu_float_type_problem(torch.bfloat16)
    monkeypatch.setattr(cpu_features, "onednn_runs_bf16", lambda: False)
    assert "ONEDNN_MAX_CPU_ISA" in cpu_float_type_problem(torch.bfloat16)


def test_bf16_weights_are_packed_only_where_onednn_takes_them(monkeypatch) -> None:
    """Held below AVX-512 (ONEDNN_MAX_CPU_ISA=AVX2, as CI's second pass runs), oneDNN cannot pack bf16 weights: a bf16
    layer then multiplies unpacked, as nn.Linear."""
    monkeypatch.setattr(cpu_kernels, "onednn_runs_bf16", lambda: False)
    cpu_kernels.fastest_packed_kernel.cache_clear()
    layer = FastestKernelLinear(48, 80).to(torch.bfloat16)
    inputs = torch.randn(4, 48, dtype=torch.bfloat16)
    with multiplying_by(packed([layer])), torch.no_grad():
        assert PACKED_WEIGHTS.get() == {}
        assert torch.equal(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))
    cpu_kernels.fastest_packed_kernel.cache_clear()
