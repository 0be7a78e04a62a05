"""Section training: bf16 mixed-precision training steps on a fixed batch of ~25k tokens a side, hf_vaswani against
MarianMTModel of the same size and weights, each eager, compiled and captured: tokens/s, MFU, peak memory."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from speed_comparison import TrainingStep, model_pair, random_tokens, time_calls

from hf_vaswani import VaswaniConfig

from .compilation import VARIANTS, compile_options, described, unavailable
from .device import mfu, peak_memory_gib
from .names import MARIAN, MFU, OURS, TRAINING_FIGURE, item
from .run import Run, Section
from .sizes import PRESETS

LABEL_SMOOTHING = 0.1  # §5.4, as VaswaniTrainer passes it to the model
# seconds a measurement needs at full size on an H100, compilation included
ESTIMATE_S = {
    "base": {"eager": 20, "compiled": 120, "captured": 150},
    "big": {"eager": 40, "compiled": 150, "captured": 180},
}


def body(section: Section) -> None:
    run = section.run
    for preset in PRESETS:
        for variant in VARIANTS if preset in run.sizes.compiled_presets else VARIANTS[:1]:
            for system in (OURS, MARIAN):
                name = item(preset, system, variant)
                if why_not := unavailable(variant, run.device):
                    section.record(name, {"skipped": why_not})
                    continue
                measurement = partial(training_throughput, run, preset, system, variant)
                section.measure(name, ESTIMATE_S[preset][variant], measurement)


def training_flops_per_step(config: VaswaniConfig, sentences: int, source_length: int, target_length: int) -> float:
    """Matmul FLOPs of one training step, 2 per multiply-add, backward twice the forward (so 3x the forward).

    Counted: each attention's Q, K, V and output projections, the FFN, the products QK^T and AV (causal
    self-attention at half, the products' useful part), the output projection. Not counted: embeddings, softmax,
    LayerNorm, dropout and the loss, small beside those.
    """
    d, heads, d_k, d_v = config.d_model, config.num_heads, config.d_k, config.d_v
    projections = 2 * d * heads * (2 * d_k + d_v) + 2 * heads * d_v * d  # per position: Q, K, V in, W^O out
    ffn = 2 * 2 * d * config.d_ff
    source, target = source_length, target_length
    encoder_layer = source * (projections + ffn + 2 * source * heads * (d_k + d_v))
    decoder_self = target * (projections + 2 * (target + 1) / 2 * heads * (d_k + d_v))
    decoder_cross = (
        target * (2 * d * heads * d_k + 2 * heads * d_v * d)  # queries and output
        + source * 2 * d * heads * (d_k + d_v)  # keys and values of the encoder output
        + target * 2 * source * heads * (d_k + d_v)
    )
    decoder_layer = decoder_self + decoder_cross + target * ffn
    output = target * 2 * d * config.vocab_size
    forward = config.encoder_layers * encoder_layer + config.decoder_layers * decoder_layer + output
    return 3.0 * sentences * forward


def training_throughput(run: Run, preset: str, system: str, variant: str) -> dict[str, Any]:
    """Training steps (speed_comparison.TrainingStep: bf16 autocast where bf16 runs, fp32 weights, fused AdamW) on a
    fixed batch of ~25k tokens a side, sdpa attention."""
    config = run.model_config(PRESETS[preset])
    ours, marian = model_pair(config)
    model = (ours if system == OURS else marian).to(run.device)
    length = run.sizes.train_length
    sentences = run.sizes.train_tokens // length
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": random_tokens(generator, sentences, length, config.vocab_size).to(run.device),
        "labels": random_tokens(generator, sentences, length, config.vocab_size).to(run.device),
    }
    options = compile_options(variant, run.device)
    torch._dynamo.reset()
    step = TrainingStep(model, batch, run.bf16, LABEL_SMOOTHING, options)
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    try:
        seconds = time_calls(step, run.sizes.warmup_steps, run.sizes.timed_steps, run.device)
    finally:
        torch._dynamo.reset()  # compiled graphs hold the model
    achieved = training_flops_per_step(config, sentences, length, length) / seconds / 1e12
    return {
        "precision": "bf16" if run.bf16 else "fp32",
        "attention": model.config._attn_implementation,
        **(described(options) if options is not None else {}),
        "sentences x length": f"{sentences} x {length}",
        "steps timed": run.sizes.timed_steps,
        "seconds a step": round(seconds, 4),
        TRAINING_FIGURE: round(step.tokens / seconds),
        "model TFLOP/s": float(f"{achieved:.4g}"),
        MFU: mfu(run, achieved),
        "peak memory GiB": peak_memory_gib(run.device),
    }
