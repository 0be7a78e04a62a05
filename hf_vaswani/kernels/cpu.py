"""Faster CPU kernels for the plain model of modeling_vaswani.py, attached from outside: same functions, less time.

`kernelize(model)` gives a model's plain modules faster forwards, as transformers' `kernelize` and accelerate's hooks
do: it changes the class of its nn.Linear and nn.Dropout modules to the subclasses below (no new parameters or
buffers, so state dicts and saved folders are unchanged) and gives its `loss_function` the fastest products. It
attaches kernels and nothing else: which search a call runs is the caller's choice (`model.generate`, or the package's
loop, `hf_vaswani.generate`, which packs the decoding weights for its call). The package applies it wherever it builds
or loads a model; a model loaded from the Hub as remote code is the plain one, computing the same.

- `FastestKernelLinear`, `packed`, `multiplying_by`, `packed_weights`: nn.Linear multiplying by packed weights (MKL's
  or oneDNN's, whichever measures fastest on the running CPU) while decoding on a CPU. The packed copies are a
  decoding's own, in a context variable (each thread sees its own): no module holds any.
- `product`, `LinearByFastestProducts`: the float32 CPU products of training and of many-row inference (a linear
  layer's forward and both gradients, the loss's output projection) by oneDNN where it measures faster than torch's
  BLAS on the running CPU.
- `kernels_chosen_by_timing`: whether the kernels above are chosen by measurement. Timings vary with the machine's
  load, so two runs can choose differently and round differently; under `torch.use_deterministic_algorithms` (as
  TrainingArguments' `full_determinism` sets) torch's own kernels run instead, and a seeded run repeats bit for bit.
- `CheapMaskDropout`: nn.Dropout with a cheaper CPU mask.
- `FastestKernelAttention`: multi-head attention whose attention function runs in float32 under CPU autocast (bf16
  mixed precision, `float32_attention`) and, in CPU inference with a few queries (decoding steps), as three plain
  operators where they measure faster than torch's sdpa kernel (`few_query_attention`).

Each choice by timing is measured once in a process, under a lock (`measured_once`, `chosen_once`): threads decoding at
once measure it once and all use that choice. These kernels are torch operators outside its public API (torch.ops.mkl,
torch.ops.mkldnn): package code only.
"""

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache, partial, wraps
from types import MappingProxyType
from typing import NamedTuple, TypeVar

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..model.loss_vaswani import label_smoothed_loss
from ..model.modeling_vaswani import VaswaniForConditionalGeneration, VaswaniMultiHeadAttention
from .cpu_features import onednn_runs_bf16


def kernelize(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with this module's kernels attached (in place; returned for chaining). Applying it twice changes
    nothing more. `quantization.quantize_int8` turns the linear layers back into nn.Linear for torch.ao."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastestKernelLinear
        elif type(module) is nn.Dropout:
            module.__class__ = CheapMaskDropout
        elif type(module) is VaswaniMultiHeadAttention:
            module.__class__ = FastestKernelAttention
    if isinstance(model, VaswaniForConditionalGeneration):
        model.loss_function = partial(label_smoothed_loss, product=product)
    return model


class FastestKernelLinear(nn.Linear):
    """nn.Linear whose float32 CPU products run on the kernel measured fastest, and that multiplies few rows by a
    pre-packed weight (float32 or bfloat16) in CPU inference.

    A plain CPU product packs the weight into the BLAS's blocked layout on every call, which dominates when few rows
    are multiplied, as in each decoding step. Where the decoding running in this thread has a packed copy of the
    layer's weight (`multiplying_by`: a `generate` call, a caller's loop of them, or a decoding engine that packed its
    weights once), CPU inference on at most 256 rows multiplies by it instead: the same product up to float rounding
    (docs/performance.md). Other float32 products go through `LinearByFastestProducts`, which picks each product's
    kernel by measurement.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.numel() // self.in_features
        if (
            torch.compiler.is_compiling()  # first: compiled graphs keep to standard kernels and guard on no copy
            or not kernels_chosen_by_timing()
            or torch.is_autocast_enabled("cpu")
            or self.weight.device.type != "cpu"
        ):
            return super().forward(input)
        packed = PACKED_WEIGHTS.get().get(self)
        if packed is not None and rows <= 256 and not torch.is_grad_enabled():
            flat = input.reshape(rows, self.in_features)
            output = PACKED_KERNELS[packed.kernel].multiply(flat, packed.weight, self.weight, self.bias)
            return output.view(*input.shape[:-1], self.out_features)
        if self.weight.dtype != torch.float32:
            return super().forward(input)
        return LinearByFastestProducts.apply(input, self.weight, self.bias)


def kernels_chosen_by_timing() -> bool:
    """Whether products may run on the kernel measured fastest here: not under torch.use_deterministic_algorithms."""
    return not torch.are_deterministic_algorithms_enabled()


class PackedKernel(NamedTuple):
    available: Callable[[torch.dtype], bool]  # whether it multiplies weights of that type here
    pack: Callable[[torch.Tensor], torch.Tensor]
    multiply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


ROWS_HINT = 32  # the kernels pack for products of about this many rows: a beam-4 step of 8 sentences
PACKED_KERNELS = {
    # MKL's sgemm on its packed format: fastest of the three on Intel CPUs, where MKL runs its AVX-512 kernels
    "mkl": PackedKernel(
        lambda dtype: dtype == torch.float32 and torch.backends.mkl.is_available(),
        lambda weight: torch.ops.mkl._mkl_reorder_linear_weight(weight, ROWS_HINT),
        lambda flat, packed, weight, bias: torch.ops.mkl._mkl_linear(flat, packed, weight, bias, flat.shape[0]),
    ),
    # oneDNN's inner product on its blocked format (what inductor's weight prepacking uses): where MKL, which keeps its
    # AVX-512 kernels for Intel CPUs, is slow (docs/performance.md), and for bfloat16, on AMX or AVX512-BF16
    "onednn": PackedKernel(
        lambda dtype: (
            torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or dtype == torch.bfloat16 and onednn_runs_bf16())
        ),
        lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT),
        lambda flat, packed, weight, bias: torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], ""),
    ),
}
PACKED_DTYPES = frozenset({torch.float32, torch.bfloat16})  # the weight types a PACKED_KERNELS entry may take
MIN_SPEEDUP = 1.1  # below this over the plain product, measurement noise could pick a kernel for nothing
# Held while a kernel choice is measured and kept: concurrent first calls (threads decoding at once) measure once,
# undisturbed by each other, and all use the one choice kept.
MEASURING = threading.RLock()
Choice = TypeVar("Choice")


def measured_once(measure: Callable[..., Choice]) -> Callable[..., Choice]:
    """`measure` run once per arguments in a process, under MEASURING, its result kept (functools.cache's, with its
    cache_info and cache_clear)."""
    kept = cache(measure)

    @wraps(measure)
    def once(*arguments):
        with MEASURING:
            return kept(*arguments)

    once.cache_info, once.cache_clear = kept.cache_info, kept.cache_clear
    return once


def chosen_once(choices: dict, key: tuple, measure: Callable[[], Choice]) -> Choice:
    """`choices[key]`, measured (`measure()`) and kept under MEASURING if not there yet."""
    if key not in choices:
        with MEASURING:
            if key not in choices:
                choices[key] = measure()
    return choices[key]


@measured_once
def fastest_packed_kernel(in_features: int, out_features: int, threads: int, dtype: torch.dtype) -> str | None:
    """The PACKED_KERNELS entry fastest on this CPU for a `dtype` weight of this shape, or None when none beats
    nn.Linear by MIN_SPEEDUP; measured once per process, shape, thread count and dtype on products of 8 and 32 rows
    (greedy and beam-4 steps of 8 sentences).

    Which kernel wins depends on the CPU (docs/performance.md), so it is measured where the model runs.
    """
    random = torch.Generator().manual_seed(0)  # not the global generator: a caller's seeded sampling stays as it was
    weight = torch.randn(out_features, in_features, generator=random).to(dtype)
    bias = torch.randn(out_features, generator=random).to(dtype)
    inputs = [torch.randn(rows, in_features, generator=random).to(dtype) for rows in (8, ROWS_HINT)]
    multiplies: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
        None: partial(nn.functional.linear, weight=weight, bias=bias)
    }
    for name, kernel in PACKED_KERNELS.items():
        if kernel.available(dtype):
            multiplies[name] = partial(kernel.multiply, packed=kernel.pack(weight), weight=weight, bias=bias)
    if len(multiplies) == 1:  # no packed kernel for this type here
        return None
    products = {name: partial(map_inputs, multiply, inputs) for name, multiply in multiplies.items()}
    with torch.inference_mode():
        return fastest(products)


def fastest(products: dict[str | None, Callable[[], object]]) -> str | None:
    """The name of the fastest of `products` (calls computing the same thing), or None, the plain torch call, when
    none beats it by MIN_SPEEDUP. Timed rounds alternate between the candidates, after a warm-up of each (the thread
    pool, the libraries' buffers); the medians decide."""
    start = time.perf_counter()
    for call in products.values():
        call()
    calls = max(1, int(len(products) * 1e-3 / (time.perf_counter() - start)))  # ~1 ms per timing at least
    seconds: dict[str | None, list[float]] = {name: [] for name in products}
    for _ in range(5):
        for name, call in products.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    winner = min(medians, key=medians.get)
    return winner if medians[None] >= MIN_SPEEDUP * medians[winner] else None


def measured_without_gradients(products: dict[str | None, Callable[[], object]]) -> str | None:
    with torch.no_grad():
        return fastest(products)


def map_inputs(multiply: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [multiply(x) for x in inputs]


class PackedWeight(NamedTuple):
    kernel: str  # a PACKED_KERNELS name
    weight: torch.Tensor  # packed for it


PackedWeights = Mapping[nn.Module, PackedWeight]
# The packed weights of the decoding running in this thread (in this asyncio task): a context variable, so that
# decodings in other threads, of the same model or not, neither see nor disturb them; no module holds any.
PACKED_WEIGHTS: ContextVar[PackedWeights] = ContextVar("packed_weights", default=MappingProxyType({}))


def pack_decoder_weights(*models: PreTrainedModel) -> dict[nn.Module, PackedWeight]:
    """Packed copies of the weights of the `models`' decoders and output projections (several: an ensemble's),
    multiplied at every decoding step (`packed`); none for a model without FastestKernelLinear layers."""
    return packed(decoder_linears(*models))


def packed(linears: Iterable[nn.Module]) -> dict[nn.Module, PackedWeight]:
    """Packed copies of the CPU float32 or bfloat16 weights of the FastestKernelLinear `linears`, each in the kernel
    measured fastest on this CPU for its shape and dtype (`fastest_packed_kernel`), where one beats nn.Linear. The
    copies are of the weights as they are now: they stand for them only while the weights do not change."""
    threads = torch.get_num_threads()
    copies = {}
    for linear in linears:
        if (
            linear.weight.device.type == "cpu"
            and linear.weight.dtype in PACKED_DTYPES
            and not torch.compiler.is_compiling()
            and kernels_chosen_by_timing()
            and (kernel := fastest_packed_kernel(linear.in_features, linear.out_features, threads, linear.weight.dtype))
            is not None
        ):
            copies[linear] = PackedWeight(kernel, PACKED_KERNELS[kernel].pack(linear.weight.detach()))
    return copies


@contextmanager
def multiplying_by(packed: PackedWeights) -> Iterator[None]:
    """The FastestKernelLinear layers in `packed` multiply by their packed weights in this thread for the block. Blocks
    nest: a layer an enclosing block packed keeps that block's copy."""
    token = PACKED_WEIGHTS.set(MappingProxyType({**packed, **PACKED_WEIGHTS.get()}))
    try:
        yield
    finally:
        PACKED_WEIGHTS.reset(token)


@contextmanager
def packed_weights(*models: PreTrainedModel) -> Iterator[None]:
    """The `models`' decoding weights packed for the block (`pack_decoder_weights`, `multiplying_by`). The package's
    search packs them for its own call; a loop of its calls over batches holds them packed across the loop with this,
    saving the packing per call. The weights must not change inside the block (an in-place update such as fused
    AdamW's does not even bump a tensor's version counter, so a copy kept longer could silently go stale). Weights an
    enclosing block packed are not packed again."""
    linears = decoder_linears(*models)
    in_use = PACKED_WEIGHTS.get()
    if all(linear in in_use for linear in linears):  # packed by an enclosing block
        yield
        return
    with multiplying_by(packed(linears)):
        yield


def decoder_linears(*models: PreTrainedModel) -> list[nn.Module]:
    """The FastestKernelLinear layers of the `models`' decoders and output projections."""
    return [
        linear
        for model in models
        for layer in (model.get_decoder(), model.get_output_embeddings())
        for linear in layer.modules()
        if isinstance(linear, FastestKernelLinear)
    ]


def onednn_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """a @ b.T + bias by oneDNN's inner product (its operands contiguous)."""
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), bias, "none", [], "")


def shape_class(*sizes: int) -> tuple[int, ...]:
    """Each size rounded up to a power of two: the shapes one timed choice of kernel stands for."""
    return tuple(1 << (size - 1).bit_length() for size in sizes)


PRODUCT_KERNELS: dict[tuple, str | None] = {}  # product's choice per shape class, layout and thread count


def product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T + bias (nn.functional.linear) for 2-d `a` and `b`, by oneDNN where it measured faster on this CPU.

    torch's float32 CPU products run on MKL where torch is built with it, and MKL keeps its AVX-512 kernels for Intel
    CPUs, where oneDNN's inner product can be the faster one (docs/performance.md). So the first float32 CPU product of
    each shape class (each size rounded up to a power of two), operand layout and thread count is timed both ways on its
    own operands and the faster kept, oneDNN only if it beats torch by MIN_SPEEDUP, its time counting the copies that
    make transposed operands contiguous.
    """
    if (
        torch.compiler.is_compiling()  # first: inductor cannot lower oneDNN's op, and compiled graphs keep to torch's
        or a.dtype != torch.float32
        or a.device.type != "cpu"
        or torch.is_autocast_enabled("cpu")
        or not kernels_chosen_by_timing()
        or not torch.backends.mkldnn.is_available()
        or 0 in (*a.shape, *b.shape)
    ):
        return nn.functional.linear(a, b, bias)
    layout = (a.stride(-1) == 1, b.stride(-1) == 1, bias is None)
    key = (*shape_class(*a.shape, b.shape[0]), *layout, torch.get_num_threads())
    kernel = chosen_once(
        PRODUCT_KERNELS,
        key,
        lambda: measured_without_gradients(
            {None: partial(nn.functional.linear, a, b, bias), "onednn": partial(onednn_product, a, b, bias)}
        ),
    )
    return (onednn_product if kernel == "onednn" else nn.functional.linear)(a, b, bias)


class LinearByFastestProducts(torch.autograd.Function):
    """nn.functional.linear whose three products (output, input gradient, weight gradient) each go through `product`,
    so each runs on the kernel measured fastest for its shape on this CPU."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = input.reshape(-1, input.shape[-1])
        ctx.save_for_backward(flat, weight)
        ctx.input_shape, ctx.has_bias = input.shape, bias is not None
        return product(flat, weight, bias).view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable  # oneDNN's op has no derivative of its own: a second derivative fails loudly, not silently
    def backward(ctx, grad_output: torch.Tensor):
        flat, weight = ctx.saved_tensors
        grad_rows = grad_output.reshape(-1, weight.shape[0])
        grad_input = product(grad_rows, weight.T).view(ctx.input_shape) if ctx.needs_input_grad[0] else None
        grad_weight = product(grad_rows.T, flat.T) if ctx.needs_input_grad[1] else None
        grad_bias = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias


class CheapMaskDropout(nn.Dropout):
    """nn.Dropout whose CPU mask comes from 16-bit slices of 64-bit random words.

    torch's CPU bernoulli_ draws one random number per element (its share of a training step: docs/performance.md);
    four elements per draw need a quarter of the draws, and the mask saved for backward is one byte per element. The
    drop probability is rounded to a multiple of 2^-16 (0.1 becomes 0.100006), and kept values are scaled by exactly
    1 / (1 - that).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or input.device.type != "cpu" or self.inplace:
            return super().forward(input)
        dropped = round(self.p * 2**16)  # of the 2^16 values an int16 takes, those below -2^15 + dropped drop
        words = torch.randint(-(2**63), 2**63 - 1, ((input.numel() + 3) // 4,), dtype=torch.int64)
        keep = words.view(torch.int16)[: input.numel()].view(input.shape) >= dropped - 2**15
        return input * keep * (2**16 / (2**16 - dropped))


def float32_attention(
    attention: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attention` on float32 copies of its CPU inputs, with CPU autocast off; the output stays float32 (the output
    projection casts it back under autocast).

    torch's CPU flash attention backward in bfloat16 can take many times its float32 time (docs/performance.md),
    making bf16 training slower than fp32, while attention holds a small share of a step's matmul FLOPs (length / (4
    d_model) of the projections'): float32 costs little anywhere and is what mixed precision keeps for softmax anyway.
    """
    if query.device.type != "cpu":
        return attention(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        return attention(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)


FEW_QUERIES = 16  # queries per sentence and head that `few_query_attention` may take: a step of up to 16 beams
ATTENTION_KERNELS: dict[tuple, str | None] = {}  # sdpa_or_fewer_operators' choice per shape class, dtype and threads


def few_query_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """What torch's scaled_dot_product_attention computes without causal masking (as transformers' sdpa attention
    function returns it, (batch, length, heads, d_v)), by a product, a softmax and a product.

    torch's CPU sdpa runs a flash-attention kernel built for long queries, whose fixed cost dominates a decoding
    step's one query per beam (docs/performance.md).
    """
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores.masked_fill_(~attention_mask, -math.inf)
    elif attention_mask is not None:
        scores += attention_mask
    # in float32 whatever the inputs' type, as sdpa's kernel computes it; a query barred from every key gets zeros
    weights = scores.softmax(-1, dtype=torch.float32).nan_to_num_(0.0).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def sdpa_or_fewer_operators(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention function, or `few_query_attention` where this CPU measured it faster for the
    shape: float32 or bfloat16 CPU inference with at most FEW_QUERIES queries, unmasked causality (one query, or a
    module that is not causal) and no dropout. The first call of each shape class (batch x heads, queries and keys,
    each rounded up to a power of two), dtype, mask kind and thread count is timed both ways, `fastest` deciding."""
    queries = query.shape[2]
    if (
        torch.compiler.is_compiling()
        or query.device.type != "cpu"
        or query.dtype not in (torch.float32, torch.bfloat16)
        or torch.is_grad_enabled()
        or kwargs.get("dropout", 0.0) != 0.0
        or queries > FEW_QUERIES
        or (queries > 1 and module.is_causal)
        or not kernels_chosen_by_timing()
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    mask_kind = None if attention_mask is None else attention_mask.dtype
    sizes = shape_class(query.shape[0] * query.shape[1], queries, key.shape[2])
    shape_key = (*sizes, query.dtype, mask_kind, torch.get_num_threads())
    arguments = (module, query, key, value, attention_mask)
    kernel = chosen_once(
        ATTENTION_KERNELS,
        shape_key,
        lambda: fastest(
            {
                None: partial(sdpa_attention_forward, *arguments, **kwargs),
                "few_query": partial(few_query_attention, *arguments, **kwargs),
            }
        ),
    )
    attention = few_query_attention if kernel == "few_query" else sdpa_attention_forward
    return attention(*arguments, **kwargs)


class FastestKernelAttention(VaswaniMultiHeadAttention):
    """Multi-head attention whose attention function runs in float32 under CPU autocast (`float32_attention`), and
    whose sdpa attention (the default implementation) takes few-query CPU inference to `sdpa_or_fewer_operators`.
    Other attention implementations (eager, flex, one a caller registered) run as configured."""

    def attention_function(self) -> Callable:
        attention = super().attention_function()
        if torch.is_autocast_enabled("cpu"):
            return partial(float32_attention, attention)
        if attention is sdpa_attention_forward:
            return sdpa_or_fewer_operators
        return attention
