"""Decoding steps compiled and, on a CUDA GPU, replayed from CUDA graphs, applied from outside the model.

A decoding step of a small model is a few hundred kernels of little work each: on a GPU its time is the host's,
launching them one by one. `compiled_step(step, options, owner)` compiles `step` (one graph: it reads nothing on the
host, tests/kernels/test_graphs.py) with torch.compile's `options`; on CUDA "reduce-overhead" records its kernels once
per shape in a CUDA graph (CUDA graph trees), each later step one replay. Where the graphs read a cache, it must keep
its tensors' addresses: transformers' StaticCache does (its tensors are marked static and written in place).

dynamo keeps compiled graphs, and counts recompilations against its `recompile_limit`, per code object. Each
`compiled_step` compiles a code object of its own, so the steps of each model (each decoding engine) compile on their
own: no model uses up the limit of another's. Not fullgraph: past the limit (one model meeting many shapes) a step runs
eagerly rather than failing, and says so once, naming its owner.
"""

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch


def compiled_step(step: Callable, options: dict[str, Any], owner: str) -> Callable:
    """`step` compiled by torch.compile with `options` on a code object of its own, captured in CUDA graphs where the
    options say so. Each call is a new step of CUDA graph trees: the last step's outputs are read by then, and their
    memory is the next step's to reuse. A call that dynamo runs eagerly warns, once for `owner` (the warning's text
    names it)."""

    def step_and_whether_compiled(*args, **kwargs):
        return step(*args, **kwargs), torch.compiler.is_compiling()  # a constant True in a compiled graph

    code = step_and_whether_compiled.__code__.replace()  # equal, but another object: a cache and a count of its own
    own = types.FunctionType(code, step_and_whether_compiled.__globals__, step.__name__, None,
                             step_and_whether_compiled.__closure__)  # fmt: skip
    compiled = torch.compile(own, **options)

    def replayed(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        output, was_compiled = compiled(*args, **kwargs)
        if not was_compiled:
            warnings.warn(
                f"{owner}: its decoding step runs eagerly, not compiled (torch.compile gave up on it: see "
                "torch.compiler.config.recompile_limit); it is slower on an accelerator",
                RuntimeWarning,
                stacklevel=2,
            )
        return output

    return replayed
