"""The variants each system is measured in, so that each is compared at its best: eager; compiled (torch.compile,
inductor); captured (inductor with CUDA graphs, mode="reduce-overhead", which replays a step's kernels in one launch:
on CUDA only). On a CPU a compiled variant checks the code, not its speed: inductor's C++ build of these graphs would
take most of a tiny run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

VARIANTS = ("eager", "compiled", "captured")
# generate's options for transformers' compiled decoding: a static cache, compiled by the caller (transformers would
# compile a static-cache step on its own on CUDA)
STATIC_COMPILED = dict(cache_implementation="static", disable_compile=True)


def unavailable(variant: str, device: torch.device, package_loop: bool = False) -> str | None:
    """Why `variant` does not run on `device` (of the package loop, where `package_loop`); None where it does."""
    if variant == "captured" and device.type != "cuda":
        return 'mode="reduce-overhead" captures CUDA graphs: CUDA only'
    if package_loop and variant != "eager" and device.type == "cpu":
        return "the package loop compiles its steps on an accelerator only"
    return None


def compile_options(variant: str, device: torch.device) -> dict[str, Any] | None:
    """torch.compile's options for `variant` on `device`, None for eager. On a CPU aot_eager: it traces the forward and
    backward graphs and builds no code."""
    if variant == "eager":
        return None
    if device.type == "cpu":
        return {"backend": "aot_eager"}
    return {"backend": "inductor", **({"mode": "reduce-overhead"} if variant == "captured" else {})}


def described(options: dict[str, Any]) -> dict[str, str]:
    """The compilation as the report records it."""
    return {"backend": options["backend"], "mode": options.get("mode", "default")}


@contextmanager
def compiled_forward(model: torch.nn.Module, options: dict[str, Any]) -> Iterator[None]:
    """The model's forward under torch.compile with `options`, one graph, compiled afresh (far from dynamo's recompile
    limit however many shapes came before)."""
    torch._dynamo.reset()
    original = model.forward
    model.forward = torch.compile(original, fullgraph=True, **options)
    try:
        yield
    finally:
        model.forward = original
        torch._dynamo.reset()  # compiled graphs hold the model
