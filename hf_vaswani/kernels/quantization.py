"""int8 weights for CPU inference."""

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from ..model.errors_vaswani import UsageError
from .cpu import fastest, map_inputs, measured_once

# torch's quantized engines for a dynamic int8 linear layer, the first the default: fbgemm (AVX2, AVX-512 VNNI) and
# oneDNN (which also runs AMX's int8 tiles). The engine packs the weights, and the packed weights pick the kernel.
INT8_ENGINES = ("fbgemm", "onednn")


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` for CPU inference whose Linear layers hold int8 weights and quantize their inputs on the fly.

    Dynamic quantization (per-tensor int8 weights, activations scaled per batch, int32 accumulation) from torch's
    `torch.ao.quantization`, packed by the process's int8 engine (`process_int8_engine`); embeddings and layer norms
    stay float32. Its speed and BLEU against float32: docs/performance.md.
    """
    if model.device.type != "cpu":
        raise UsageError(f"int8 inference runs on CPU; the model is on {model.device}")
    process_int8_engine()
    with deprecation_silenced():
        quantized = copy.deepcopy(model).eval()
        for module in quantized.modules():
            if isinstance(module, nn.Linear):
                module.__class__ = nn.Linear  # torch.ao swaps exact nn.Linear only (kernelize's linears are subclasses)
        return torch.ao.quantization.quantize_dynamic(quantized, {nn.Linear}, dtype=torch.qint8, inplace=True)


@contextmanager
def deprecation_silenced() -> Iterator[None]:
    # torch.ao's eager quantization is deprecated in favour of torchao, whose CPU int8 kernels need torch.compile
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        yield


@contextmanager
def quantized_engine(engine: str) -> Iterator[None]:
    """torch's quantized engine set to `engine` for the block (a process-wide setting), then restored: for measuring
    the engines, once in a process (`fastest_int8_engine`)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


@measured_once
def process_int8_engine() -> str:
    """torch's quantized engine for this process, set once (`torch.backends.quantized.engine`, a process-wide setting)
    at the first int8 model to the engine measured fastest then (`fastest_int8_engine`), and never changed by the
    package after: int8 weights are packed by it, and a shortlist's int8 product packs its rows by it at each call,
    so it must not change under a decoding thread."""
    engine = fastest_int8_engine(torch.get_num_threads())
    torch.backends.quantized.engine = engine
    return engine


@measured_once
def fastest_int8_engine(threads: int) -> str:
    """The INT8_ENGINES entry whose dynamic int8 linear is fastest on this CPU, measured once per process and thread
    count on a d_model 512 FFN's weight (512 x 2048) for 8 and 32 rows (greedy and beam-4 steps of 8 sentences); the
    first entry unless another beats it by kernels/cpu.py's MIN_SPEEDUP. Which wins depends on the CPU (AMX's int8
    tiles are oneDNN's alone), so it is measured where the model runs."""
    engines = [engine for engine in INT8_ENGINES if engine in torch.backends.quantized.supported_engines]
    if len(engines) < 2:  # nothing to choose from: a CPU other than x86's has neither
        return engines[0] if engines else torch.backends.quantized.engine
    random = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 512, generator=random)
    inputs = [torch.randn(rows, 512, generator=random) for rows in (8, 32)]
    products = {}
    for engine in engines:
        with quantized_engine(engine), deprecation_silenced():
            layer = torch.ao.nn.quantized.dynamic.Linear(512, 2048)
            layer.set_weight_bias(
                torch.quantize_per_tensor(weight, weight.abs().max().item() / 127, 0, torch.qint8), None
            )
        products[None if engine == engines[0] else engine] = partial(map_inputs, layer, inputs)
    with torch.inference_mode():
        return fastest(products) or engines[0]
