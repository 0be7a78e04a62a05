"""Every size the sections use: the paper's at full size (FULL), a quick check of the code on a CPU (TINY, --tiny)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_vaswani import VaswaniConfig

PRESETS = {"base": VaswaniConfig.base, "big": VaswaniConfig.big}


@dataclass(frozen=True)
class Sizes:
    model: dict[str, Any]  # VaswaniConfig overrides on top of the Table 3 presets (none at full size)
    check_batch: tuple[int, int, int]  # sentences, source and target length of the correctness checks
    reverse_task: dict[str, Any]  # the trained model of the decoding checks (correctness.train_reverse_model)
    compile_checks: tuple[tuple[torch.dtype, int], ...]  # dtype and beams of compiled_decoding_matches, each compiled
    train_length: int  # source = target length of the fixed training batch
    train_tokens: int  # tokens a side of the fixed training batch (the paper's ~25k)
    warmup_steps: int  # untimed steps (or calls) before the timed ones: kernels chosen, memory allocated, compiled
    timed_steps: int
    compiled_presets: tuple[str, ...]  # the sizes trained compiled and captured as well as eager
    trainer_pairs: int  # sentence pairs of the synthetic corpus
    trainer_lengths: tuple[int, int, int]  # its shortest, median and longest sentence, in tokens
    trainer_max_tokens: int  # VaswaniTrainer's max_tokens
    trainer_warmup_steps: int  # twice as many compiled: shapes vary, and the second shape compiles a dynamic graph
    trainer_timed_steps: int
    generation_batches: tuple[int, ...]
    source_lengths: tuple[int, int]  # shortest and longest source of the decoding batches
    new_tokens: int  # output tokens each system is made to produce (min = max)
    compiled_shapes: tuple[tuple[int, int], ...] | None  # (batch, beams) decoded compiled and captured; None: every one
    repeats: int  # timed decoding calls
    multi30k_minimum_s: float  # the least time left with which the published run starts
    multi30k_estimate_s: float  # what the sections before it leave it
    time_scale: float  # multiplies each measurement's time estimate, given in seconds at full size on an H100


FULL = Sizes(
    model={},
    check_batch=(8, 48, 40),
    reverse_task=dict(vocab=24, lengths=(4, 10), d_model=64, layers=2, batch=128, lr=3e-3, max_steps=3000),
    compile_checks=((torch.float32, 1), (torch.bfloat16, 4)),
    train_length=32,
    train_tokens=25_000,
    warmup_steps=3,
    timed_steps=10,
    compiled_presets=("base", "big"),
    trainer_pairs=40_000,
    trainer_lengths=(3, 25, 128),  # about WMT14 En-De's in a 37k BPE vocabulary
    trainer_max_tokens=25_000,
    trainer_warmup_steps=5,
    trainer_timed_steps=20,
    generation_batches=(32, 128),
    source_lengths=(16, 48),
    new_tokens=32,
    compiled_shapes=None,
    repeats=3,
    multi30k_minimum_s=120.0,
    multi30k_estimate_s=570.0,
    time_scale=1.0,
)
TINY = Sizes(
    model=dict(vocab_size=100, d_model=32, d_ff=64, num_heads=4, encoder_layers=2, decoder_layers=2),
    check_batch=(4, 12, 10),
    reverse_task=dict(vocab=12, lengths=(3, 6), d_model=32, layers=2, batch=64, lr=3e-3, max_steps=1000),
    compile_checks=((torch.float32, 4),),
    train_length=8,
    train_tokens=256,
    warmup_steps=1,
    timed_steps=2,
    compiled_presets=("base",),
    trainer_pairs=200,
    trainer_lengths=(2, 6, 16),
    trainer_max_tokens=256,
    trainer_warmup_steps=1,
    trainer_timed_steps=2,
    generation_batches=(2, 4),
    source_lengths=(3, 8),
    new_tokens=6,
    compiled_shapes=((4, 4),),
    repeats=1,
    multi30k_minimum_s=120.0,
    multi30k_estimate_s=570.0,
    time_scale=0.02,
)
