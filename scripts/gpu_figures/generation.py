"""Section generation: greedy and beam 4 at two batch sizes, random weights at base size, the output length forced;
the package's loop and MarianMTModel's generate each eager, compiled and captured, and transformers' loop on the same
model eager: output tokens/s."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from speed_comparison import (
    EOS,
    PAD,
    SEARCH_AS_TRANSFORMERS,
    forced_length,
    model_pair,
    produced_tokens,
    random_tokens,
    time_calls,
    transformers_loop,
)

from hf_vaswani import Translator, VaswaniForConditionalGeneration
from hf_vaswani.decoding.search import covered_request

from .compilation import STATIC_COMPILED, VARIANTS, compile_options, compiled_forward, described, unavailable
from .names import DECODING_FIGURE, MARIAN, PACKAGE_LOOP, TRANSFORMERS_LOOP, item, shape_name
from .run import Run, Section, first_line
from .sizes import Sizes


def body(section: Section) -> None:
    """Each shape's eager systems, then its compiled and captured ones (each compiled afresh for the shape)."""
    run = section.run
    ours, marian = decoding_models(run)
    ids, mask = decoding_sources(run, ours.config.vocab_size)
    compiled_shapes = run.sizes.compiled_shapes or decoding_shapes(run.sizes)
    for batch, beams in decoding_shapes(run.sizes):
        shape, inputs = shape_name(batch, beams), decoding_inputs(run, ids[:batch], mask[:batch], beams)
        eager = {
            PACKAGE_LOOP: partial(package_loop_speed, run, ours, inputs, "eager"),
            TRANSFORMERS_LOOP: partial(transformers_loop, ours, **inputs, **SEARCH_AS_TRANSFORMERS),
            MARIAN: partial(transformers_loop, marian, **inputs),
        }
        for system, decode in eager.items():
            measurement = decode if system == PACKAGE_LOOP else partial(decoding_figures, run, system, decode)
            section.measure(item(shape, system, "eager"), 10 if system == PACKAGE_LOOP else 20, measurement)
        if (batch, beams) not in compiled_shapes:
            continue
        for variant in VARIANTS[1:]:
            compiled = (
                (PACKAGE_LOOP, partial(package_loop_speed, run, ours, inputs, variant), 60),
                (MARIAN, partial(compiled_transformers_speed, run, marian, inputs, variant), 90),
            )
            for system, measurement, estimate in compiled:
                name = item(shape, system, variant)
                if why_not := unavailable(variant, run.device, system == PACKAGE_LOOP):
                    section.record(name, {"skipped": why_not})
                else:
                    section.measure(name, estimate, partial(skipped_if_it_fails, measurement))


def decoding_shapes(sizes: Sizes) -> list[tuple[int, int]]:
    return [(batch, beams) for batch in sizes.generation_batches for beams in (1, 4)]


def decoding_models(run: Run) -> tuple[VaswaniForConditionalGeneration, torch.nn.Module]:
    """The seeded base model and MarianMTModel with its weights, bf16 on the device (fp32 where bf16 does not run)."""
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    ours, marian = model_pair(run.model_config())
    return ours.to(run.device, dtype), marian.to(run.device, dtype)


def decoding_sources(run: Run, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of random lengths ending in </s>, padded: ids and mask of the largest batch (the smaller batches are
    its first rows)."""
    generator = torch.Generator().manual_seed(0)
    rows, (shortest, longest) = max(run.sizes.generation_batches), run.sizes.source_lengths
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=generator)
    ids = random_tokens(generator, rows, longest, vocab_size)
    mask = torch.arange(longest) < lengths[:, None]
    ids[~mask] = PAD
    ids[torch.arange(rows), lengths - 1] = EOS
    return ids, mask.long()


def decoding_inputs(run: Run, ids: torch.Tensor, mask: torch.Tensor, beams: int) -> dict[str, Any]:
    return dict(
        input_ids=ids.to(run.device),
        attention_mask=mask.to(run.device),
        num_beams=beams,
        do_sample=False,
        **forced_length(run.sizes.new_tokens),
    )


def decoding_speed(
    run: Run, system: str, decode: Callable[[], torch.Tensor], warmup: int = 1
) -> tuple[dict[str, Any], torch.Tensor]:
    """Output tokens/s of `decode`, timed over calls between two synchronisations, and its last output."""
    outputs: list[torch.Tensor] = []

    def call() -> None:
        outputs[:] = [decode()]

    seconds = time_calls(call, warmup, run.sizes.repeats, run.device)
    rows, produced = len(outputs[-1]), produced_tokens(outputs[-1], run.sizes.new_tokens, system)
    figures = {
        DECODING_FIGURE: round(rows * produced / seconds, 1),
        "seconds a batch": round(seconds, 4),
        "output length": produced,
    }
    return figures, outputs[-1]


def decoding_figures(run: Run, system: str, decode: Callable[[], torch.Tensor]) -> dict[str, Any]:
    return decoding_speed(run, system, decode)[0]


def package_loop(translator: Translator, inputs: dict[str, Any]) -> torch.Tensor:
    """The engine's generate, refusing a call its loop would hand to transformers' (which would time the wrong loop)."""
    request = covered_request(translator.model, None, None, {**inputs, **SEARCH_AS_TRANSFORMERS})
    if isinstance(request, str):
        raise RuntimeError(f"the package loop does not cover this call: {request}")
    return translator.generate(**inputs, **SEARCH_AS_TRANSFORMERS)


# How each variant runs the package loop's steps after each call's first on an accelerator (kernels/graphs.py), as
# the engine's `compile`: eager, not compiled; compiled by inductor without CUDA graphs; or captured, the package's
# default (CUDA graphs).
PACKAGE_STEPS: dict[str, bool | dict] = {"eager": False, "compiled": {}, "captured": True}


def package_loop_speed(
    run: Run, model: VaswaniForConditionalGeneration, inputs: dict[str, Any], variant: str
) -> dict[str, Any]:
    """The package loop with its steps as `variant` runs them (an engine of its own, compiled afresh), checked
    against the eager loop."""
    with Translator(model, compile=False) as translator:
        eager = package_loop(translator, inputs)
    with Translator(model, compile=PACKAGE_STEPS[variant]) as translator:
        figures, output = decoding_speed(run, PACKAGE_LOOP, partial(package_loop, translator, inputs), warmup=2)
    figures["equal to the eager loop"] = output.shape == eager.shape and torch.equal(output, eager)
    return {**figures, "steps": variant}


def compiled_transformers_speed(
    run: Run, model: torch.nn.Module, inputs: dict[str, Any], variant: str
) -> dict[str, Any]:
    """transformers' usual compiled decoding: generate with a static cache and the model's forward compiled."""
    options = compile_options(variant, run.device)
    with compiled_forward(model, options):
        decode = partial(transformers_loop, model, **inputs, **STATIC_COMPILED)
        figures, _ = decoding_speed(run, MARIAN, decode, warmup=2)
    return {**figures, **described(options)}


def skipped_if_it_fails(measurement: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measurement()`, or skipped with its error's first line: compiled decoding is tried, not assumed to work."""
    try:
        return measurement()
    except Exception as error:
        traceback.print_exc()
        return {"skipped": f"compiled decoding failed: {type(error).__name__}: {first_line(error)}"}
