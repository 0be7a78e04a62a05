"""Decoding steps compiled and, on a CUDA GPU, replayed from CUDA graphs, applied from outside the model.

A decoding step of a small model is a few hundred kernels of little work each: on a GPU its time is the host's,
launching them one by one. `captured(step, device_type)` compiles `step` (one graph: it reads nothing on the host,
tests/kernels/test_graphs.py) and on CUDA records its kernels once per shape in a CUDA graph (torch.compile's
"reduce-overhead": CUDA graph trees), each later step one replay. Where the graphs read a cache, it must keep its
tensors' addresses: transformers' StaticCache does (its tensors are marked static and written in place). Not
fullgraph: past dynamo's recompilation limit (many models or shapes in one process) a step then runs eagerly rather
than failing.
"""

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

# torch.compile's options for a step on each kind of device (a kind not listed: its defaults)
STEP_COMPILATION: dict[str, dict[str, Any]] = {"cuda": {"mode": "reduce-overhead"}}


@cache
def captured(step: Callable, device_type: str) -> Callable:
    """`step` compiled for `device_type`'s devices, captured in CUDA graphs there. Each call is a new step
    of CUDA graph trees: the last step's outputs are read by then, and their memory is the next step's to reuse."""
    compiled = torch.compile(step, **STEP_COMPILATION.get(device_type, {}))

    def replayed(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return replayed
