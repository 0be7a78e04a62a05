"""The training precision: fp32, fp16, bf16, or bf16 where a probe measures it clearly faster on this CPU."""

import os
import statistics
import sys
import time

import torch

from ..gpu_policy import default_training_precision
from ..kernels.cpu import kernelize
from ..kernels.cpu_features import cpu_bf16_matmul_works
from ..machine import cpu_model_name
from ..model.configuration_vaswani import VaswaniConfig
from ..model.errors_vaswani import UsageError
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from .settings import RecipeSettings, model_config, setting_flag

BF16_MIN_SPEEDUP = 1.1  # bf16 rounds more: take it only for a clear win, not for measurement noise


def bf16_training_seconds(config: VaswaniConfig, max_tokens: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds of one training forward and backward pass of a `config` model in float32 ("fp32") and in bf16
    mixed precision ("bf16") on this CPU, for a batch of about `max_tokens` random tokens on each side.

    Which is faster depends on the CPU: bfloat16 matmuls run natively with AVX512-BF16 or AMX and are emulated
    elsewhere, so `vaswani train --bf16-if-faster` measures rather than guesses. Rounds alternate between the two after
    a warm-up. Call only where `cpu_bf16_matmul_works()`.
    """
    generator = torch.Generator().manual_seed(0)
    model = kernelize(VaswaniForConditionalGeneration(config))  # as the recipe builds it
    model.train()
    length = 24
    tokens = torch.randint(4, config.vocab_size, (2, max(1, max_tokens // length), length), generator=generator)
    batch = {"input_ids": tokens[0], "labels": tokens[1]}

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch, return_logits=False).loss  # as VaswaniTrainer trains
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for bf16 in (False, True):  # warm-up: the thread pool, the libraries' buffers, the autocast weight casts
        step(bf16)
    for _ in range(rounds):
        for name in seconds:
            seconds[name].append(step(name == "bf16"))
    return {name: statistics.median(values) for name, values in seconds.items()}


def training_precision(settings: RecipeSettings) -> str:
    """ "fp32", "bf16" or "fp16": as set; else on a CUDA GPU bf16 where it supports it; else with `bf16_if_faster` as
    measured here (one line on stderr says which); else fp32."""
    chosen = [name for name in ("bf16", "fp16", "fp32") if getattr(settings, name)]
    if chosen:
        return chosen[0]
    precision = default_training_precision()
    if precision is not None:
        print(f"training in {precision} on {torch.cuda.get_device_name()}", file=sys.stderr)
        return precision
    if not settings.bf16_if_faster:
        return "fp32"
    flag = setting_flag("bf16_if_faster")
    if torch.backends.mps.is_available():
        raise UsageError(f"{flag} measures CPU training; on MPS pass {setting_flag('bf16')} or nothing")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would measure, and they could disagree
        raise UsageError(f"{flag} measures in one process; with several, pass {setting_flag('bf16')} or nothing")
    if not cpu_bf16_matmul_works():
        print(f"{flag}: fp32 (a bfloat16 matmul traps on this CPU)", file=sys.stderr)
        return "fp32"
    config = model_config(settings, vocab_size=settings.vocab_size)
    seconds = bf16_training_seconds(config, settings.max_tokens)
    precision = "bf16" if seconds["fp32"] >= BF16_MIN_SPEEDUP * seconds["bf16"] else "fp32"
    print(
        f"{flag}: {precision} (a training step {seconds['bf16']:.3f} s in bf16, {seconds['fp32']:.3f} s in fp32 on "
        f"{cpu_model_name()})",
        file=sys.stderr,
    )
    return precision
