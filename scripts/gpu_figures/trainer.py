"""Section trainer: `trainer.train()` of the recipe's pieces on token batches of a synthetic corpus, base and big,
eager, and base with Trainer's torch_compile (on CUDA): tokens/s, padding, MFU."""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from datasets import Dataset
from speed_comparison import EOS, FIRST_WORD, synchronize, word_tokenizer
from transformers import DataCollatorForSeq2Seq, TrainerCallback

from hf_vaswani.training.recipe import build_model, training_arguments
from hf_vaswani.training.settings import RecipeSettings
from hf_vaswani.training.trainer import VaswaniTrainer

from .device import mfu, peak_memory_gib
from .names import MFU, TRAINER, TRAINING_FIGURE, item
from .run import Run, Section
from .sizes import PRESETS, Sizes
from .training import training_flops_per_step


def body(section: Section) -> None:
    run = section.run
    for preset in PRESETS:
        measurement = partial(trainer_throughput, run, preset, False)
        section.measure(item(preset, TRAINER, "eager"), 60 if preset == "big" else 45, measurement)
    name = item("base", TRAINER, "torch_compile")
    if run.device.type != "cuda":  # Trainer compiles with inductor, whose C++ build would take minutes here
        section.record(name, {"skipped": "Trainer's torch_compile is timed on CUDA"})
        return
    section.measure(name, 240, partial(trainer_throughput, run, "base", True))


class TokenCountingTrainer(VaswaniTrainer):
    """VaswaniTrainer noting each training batch: its real source and target tokens as a device tensor (read once,
    after the timed steps, so that no step waits for it) and its padded shape."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[torch.Tensor, tuple[int, int, int]]] = []

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        real = inputs["attention_mask"].sum() + (inputs["labels"] != -100).sum()
        sentences, source_length = inputs["input_ids"].shape
        self.batches.append((real, (sentences, source_length, inputs["labels"].shape[1])))
        return super().training_step(model, inputs, num_items_in_batch)


class StepClock(TrainerCallback):
    """The time at the end of step `first` and of step `last`, each read once the device has finished (the only waits
    it adds); no checkpoint saved at the end."""

    def __init__(self, device: torch.device, first: int, last: int) -> None:
        self.device, self.first, self.last = device, first, last
        self.times: dict[int, float] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in (self.first, self.last):
            synchronize(self.device)
            self.times[state.global_step] = time.perf_counter()
        if state.global_step >= self.last:
            control.should_save = False


def synthetic_pairs(sizes: Sizes, vocab_size: int) -> Dataset:
    """Tokenized sentence pairs of random tokens, their lengths log-normal around the median (a target 0.8 to 1.25
    times its source), each sentence ending in </s>: what tokenize_corpus makes of a corpus."""
    rng = np.random.default_rng(0)
    shortest, median, longest = sizes.trainer_lengths
    count = sizes.trainer_pairs
    source = np.clip(np.rint(rng.lognormal(np.log(median), 0.5, count)), shortest, longest).astype(int)
    target = np.clip(np.rint(source * rng.uniform(0.8, 1.25, count)), shortest, longest).astype(int)

    def sentences(lengths: np.ndarray) -> list[list[int]]:
        tokens = rng.integers(FIRST_WORD, vocab_size, int(lengths.sum()))
        return [np.append(row[:-1], EOS).tolist() for row in np.split(tokens, np.cumsum(lengths)[:-1])]

    input_ids = sentences(source)
    return Dataset.from_dict(
        {"input_ids": input_ids, "attention_mask": [[1] * len(ids) for ids in input_ids], "labels": sentences(target)}
    )


def trainer_throughput(run: Run, preset: str, compiled: bool) -> dict[str, Any]:
    """`trainer.train()` of the recipe's pieces (build_model, training_arguments, DataCollatorForSeq2Seq, token
    batches of max_tokens) on a synthetic corpus: its steps after the warm-up, timed between two synchronisations."""
    sizes = run.sizes
    vocab_size = run.model_config().vocab_size
    warmup = sizes.trainer_warmup_steps * (2 if compiled else 1)
    steps = warmup + sizes.trainer_timed_steps
    settings = RecipeSettings(
        preset=preset,
        model_overrides={name: value for name, value in sizes.model.items() if name != "vocab_size"},
        vocab_size=vocab_size,
        max_tokens=sizes.trainer_max_tokens,
        max_steps=steps,
        save_steps=steps,
        logging_steps=steps,
        average_last=1,
        torch_compile=compiled,
    )
    tokenizer = word_tokenizer(vocab_size)
    transformers.set_seed(settings.seed)
    model = build_model(settings, tokenizer)
    clock = StepClock(run.device, warmup, steps)
    with tempfile.TemporaryDirectory() as folder:
        arguments = training_arguments(settings, Path(folder), "bf16" if run.bf16 else "fp32")
        trainer = TokenCountingTrainer(
            model=model,
            args=arguments,
            train_dataset=synthetic_pairs(sizes, vocab_size),
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
            processing_class=tokenizer,
            max_tokens=settings.max_tokens,
            callbacks=[clock],
        )
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)
        try:
            trainer.train()
        finally:
            torch._dynamo.reset()
    if len(clock.times) != 2 or len(trainer.batches) != steps:
        raise RuntimeError(f"{len(trainer.batches)} of {steps} steps ran (an epoch shorter than the steps?)")
    seconds = (clock.times[steps] - clock.times[warmup]) / sizes.trainer_timed_steps
    timed = trainer.batches[warmup:]
    real = int(torch.stack([tokens for tokens, _ in timed]).sum())
    padded = sum(sentences * (source + target) for _, (sentences, source, target) in timed)
    flops = sum(training_flops_per_step(model.config, *shape) for _, shape in timed)
    achieved = flops / (seconds * len(timed)) / 1e12
    return {
        "precision": "bf16" if run.bf16 else "fp32",
        "max_tokens": settings.max_tokens,
        "steps timed": len(timed),
        "sentences a batch": round(sum(shape[0] for _, shape in timed) / len(timed), 1),
        "seconds a step": round(seconds, 4),
        TRAINING_FIGURE: round(real / (seconds * len(timed))),
        "padded source+target tokens/s": round(padded / (seconds * len(timed))),
        "padding %": round(100 * (1 - real / padded), 1),
        "model TFLOP/s (padded)": float(f"{achieved:.4g}"),
        MFU: mfu(run, achieved),
        "peak memory GiB": peak_memory_gib(run.device),
        "data loader workers": arguments.dataloader_num_workers,
    }
