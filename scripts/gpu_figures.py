"""GPU figures: correctness on the device, training and decoding speed against MarianMTModel and CTranslate2, a short
Multi30k run and a two-process step, in one command that keeps to a time limit.

    python scripts/gpu_figures.py [--multi30k DIR] [--minutes 2] [--time-limit 8] [--output-dir DIR]
    python scripts/gpu_figures.py --tiny --time-limit 1        # tiny sizes on the CPU, well under a minute

Runs on CUDA where available, else on the CPU. Writes gpu_figures.json and gpu_figures.md into --output-dir (default:
$OUT where set, else gpu_figures/) after every measurement, so a killed run keeps what it measured; what does not run
is recorded with its reason (no GPU, too little time left, a package missing). A device machine gets no ../shared:
copy the Multi30k corpus into a folder of the repository first and pass that folder as --multi30k. The output format
and the figures: docs/performance.md ("GPU figures").
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.files import write_text
from hf_vaswani.interop.export import to_marian, write_ctranslate2

SECTIONS = ("correctness", "training", "generation", "multi30k", "distributed")
PAD, EOS = 0, 2  # VaswaniConfig's default special ids (bos 1); content tokens start at 4, after <unk> 3

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; the first name contained in the
# device's name wins, so the more specific names come first.
DENSE_BF16_TFLOPS = (
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.5),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("GH200", 989.4),
    ("H200 NVL", 835.5),
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)

# bf16 keeps 8 significant bits (7 stored and the implicit one), so one rounding errs by at most u = 2^-8 relative.
# On tensor cores (and in CPU kernels) products accumulate in fp32, so what bf16 adds to a sub-layer is the rounding of
# its inputs and output: O(u). Two implementations of the same bf16 model round in different places (eager attention
# rounds its score matrix to bf16, fused kernels keep it in fp32), and their sub-layer differences, independent, add
# along the residual path like a random walk: sqrt(S) u relative to the logits' norm over S sub-layers (2 per encoder
# layer, 3 per decoder layer, the output projection); both sides carry such an error, hence 2 sqrt(S) u. A wrong mask,
# scale or cache is an O(1) difference. At base size 2 sqrt(31) u = 0.0435; eager and sdpa differ by about 0.01.
BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_tolerance(config: VaswaniConfig) -> float:
    """The largest relative (Frobenius-norm) difference of two bf16 evaluations of `config`'s model, derived above."""
    sublayers = 2 * config.encoder_layers + 3 * config.decoder_layers + 1
    return 2 * math.sqrt(sublayers) * BF16_UNIT_ROUNDOFF


# --- Sizes: the figures' and `--tiny`'s ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Every size a section uses: the paper's at full size (FULL), a quick check on a CPU with `--tiny` (TINY)."""

    model: dict[str, Any]  # VaswaniConfig overrides on top of the Table 3 presets (none at full size)
    check_batch: tuple[int, int, int]  # sentences, source and target length of the correctness checks
    reverse_task: dict[str, Any]  # the trained model of the decoding checks (train_reverse_model)
    compile_checks: tuple[tuple[torch.dtype, int], ...]  # dtype and beams of compiled_decoding_matches, each compiled
    train_length: int  # source = target length of the throughput batches
    train_tokens: int  # tokens a side per throughput batch (the paper's ~25k)
    timed_steps: int
    generation_batches: tuple[int, ...]
    generation_lengths: tuple[int, int]  # source length, forced output length
    repeats: int
    multi30k_reserve_s: float  # the Multi30k run's time outside training: tokenizer, validation, test decoding
    time_scale: float  # multiplies each measurement's time estimate, given in seconds at full size on an H100


FULL = Sizes(
    model={},
    check_batch=(8, 48, 40),
    reverse_task=dict(vocab=24, lengths=(4, 10), d_model=64, layers=2, batch=128, lr=3e-3, max_steps=3000),
    compile_checks=((torch.float32, 1), (torch.bfloat16, 4)),
    train_length=32,
    train_tokens=25_000,
    timed_steps=5,
    generation_batches=(32, 128),
    generation_lengths=(32, 64),
    repeats=3,
    multi30k_reserve_s=90.0,
    time_scale=1.0,
)
TINY = Sizes(
    model=dict(vocab_size=100, d_model=32, d_ff=64, num_heads=4, encoder_layers=2, decoder_layers=2),
    check_batch=(4, 12, 10),
    reverse_task=dict(vocab=12, lengths=(3, 6), d_model=32, layers=2, batch=64, lr=3e-3, max_steps=1000),
    compile_checks=((torch.float32, 4),),
    train_length=8,
    train_tokens=256,
    timed_steps=2,
    generation_batches=(2, 4),
    generation_lengths=(6, 6),
    repeats=1,
    multi30k_reserve_s=30.0,
    time_scale=0.02,
)


# --- The run: device, time limit, report ----------------------------------------------------------------------------


class Report:
    """The results so far, written whole to JSON and Markdown after every measurement."""

    def __init__(self, output_dir: Path, header: dict[str, Any]) -> None:
        self.output_dir = output_dir
        self.data = {**header, "sections": {name: {"status": "not reached"} for name in SECTIONS}}
        self.started = time.monotonic()

    def save(self) -> None:
        self.data["elapsed_seconds"] = round(time.monotonic() - self.started, 1)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.output_dir / "gpu_figures.json", json.dumps(self.data, indent=2) + "\n")
        write_text(self.output_dir / "gpu_figures.md", markdown(self.data))


@dataclass(frozen=True)
class Run:
    device: torch.device
    sizes: Sizes
    bf16: bool  # whether bf16 runs here (a CPU may trap on a bfloat16 matmul: hf_vaswani.training.precision)
    deadline: float  # time.monotonic() at the time limit
    report: Report

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


class Skipped(Exception):
    """A whole section does not run here; the message says why."""


@dataclass(frozen=True)
class Section:
    """One section's measurements, each recorded (and the report saved) as it ends."""

    run: Run
    results: dict[str, Any]

    def measure(self, item: str, estimate_s: float, measurement: Callable[[], dict[str, Any]]) -> None:
        """Record `measurement()` as `item`, or why it did not run: too little time left for the `estimate_s` it needs
        at full size, or the error it raised."""
        run = self.run
        needed = estimate_s * run.sizes.time_scale
        if run.seconds_left() < needed:
            outcome = {"skipped": f"time limit: {max(0.0, run.seconds_left()):.0f} s left, needs about {needed:.0f} s"}
        else:
            print(f"[gpu_figures] {item}", file=sys.stderr, flush=True)
            started = time.monotonic()
            try:
                outcome = measurement()
            except Exception as error:  # one failed measurement must not cost the others
                traceback.print_exc()
                outcome = {"error": f"{type(error).__name__}: {first_line(error)}"}
                if run.device.type == "cuda":
                    torch.cuda.empty_cache()
            outcome.setdefault("seconds", round(time.monotonic() - started, 2))
        self.results[item] = outcome
        run.report.save()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def run_section(run: Run, name: str, body: Callable[[Section], None]) -> None:
    entry = run.report.data["sections"][name]
    entry.clear()
    if run.seconds_left() <= 0:
        entry.update(status="skipped", reason="time limit reached before this section")
        run.report.save()
        return
    section = Section(run, {})
    entry.update(status="running", results=section.results)
    started = time.monotonic()
    try:
        body(section)
        entry["status"] = "measured"
    except Skipped as reason:
        entry.update(status="skipped", reason=str(reason))
    except Exception as error:
        traceback.print_exc()
        entry.update(status="failed", reason=f"{type(error).__name__}: {first_line(error)}")
    entry["seconds"] = round(time.monotonic() - started, 1)
    if not entry["results"]:
        del entry["results"]
    run.report.save()


def peak_bf16_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in DENSE_BF16_TFLOPS if key in name), None)


def device_description(device: torch.device) -> dict[str, Any]:
    try:
        import ctranslate2

        ctranslate2_version = ctranslate2.__version__
    except ImportError:
        ctranslate2_version = None
    cuda = device.type == "cuda"
    return {
        "type": device.type,
        "name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "dense_bf16_peak_tflops": peak_bf16_tflops(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "ctranslate2": ctranslate2_version,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work: Callable[[], object]) -> float:
    synchronize(device)
    started = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - started


def model_config(run: Run, preset: Callable[..., VaswaniConfig] = VaswaniConfig.base, **changes: Any) -> VaswaniConfig:
    return preset(**{**run.sizes.model, **changes})


def random_tokens(generator: torch.Generator, vocab_size: int, rows: int, length: int) -> torch.Tensor:
    """Content tokens ending in </s>, as a tokenizer gives sources."""
    tokens = torch.randint(4, vocab_size, (rows, length), generator=generator)
    tokens[:, -1] = EOS
    return tokens


def relative_difference(value: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / scale.float().norm()).item()


# --- Correctness on the device -------------------------------------------------------------------------------------


def correctness(section: Section) -> None:
    run = section.run
    section.measure("attention implementations, bf16 logits", 30, partial(attention_implementations, run))
    trained: dict[str, VaswaniForConditionalGeneration] = {}

    def train() -> dict[str, Any]:
        trained["model"], outcome = train_reverse_model(run)
        return outcome

    section.measure("reverse task: training until greedy is exact on the CPU", 40, train)
    if "model" in trained:
        model = trained["model"]
        section.measure("reverse task: device decoding = CPU fp32", 20, partial(decoding_matches_cpu, run, model))
        section.measure(
            "reverse task: static cache + compiled = eager", 120, partial(compiled_decoding_matches, run, model)
        )
    section.measure("Trainer step: bf16 loss = fp32 loss", 30, partial(trainer_bf16_step, run))


def attention_implementations(run: Run) -> dict[str, Any]:
    """Logits of each attention implementation in bf16 against eager's, on a batch with padded sources."""
    if not run.bf16:
        return {"skipped": "bf16 does not run on this CPU"}
    from transformers.utils import is_flash_attn_2_available

    config = model_config(run, dropout=0.0)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).eval().to(run.device)
    sentences, source_length, target_length = run.sizes.check_batch
    generator = torch.Generator().manual_seed(0)
    source = random_tokens(generator, config.vocab_size, sentences, source_length)
    mask = torch.ones_like(source)
    mask[::2, source_length // 2 :] = 0  # every other sentence half padding
    source[mask == 0] = PAD
    inputs = dict(
        input_ids=source.to(run.device),
        attention_mask=mask.to(run.device),
        decoder_input_ids=random_tokens(generator, config.vocab_size, sentences, target_length).to(run.device),
    )

    def logits(implementation: str) -> torch.Tensor:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            return model(**inputs).logits

    fp32 = logits("eager")
    model.to(torch.bfloat16)
    eager = logits("eager")
    outcome: dict[str, Any] = {
        "tolerance": round(bf16_tolerance(config), 4),
        "eager bf16 vs fp32": round(relative_difference(eager, fp32, fp32), 5),
    }
    for implementation in ("sdpa", "flex_attention", "flash_attention_2"):
        if implementation == "flash_attention_2" and not is_flash_attn_2_available():
            outcome[implementation] = "skipped: flash_attn is not installed"
            continue
        try:
            difference = relative_difference(logits(implementation), eager, fp32)
        except ValueError as error:  # the model does not declare the implementation
            outcome[implementation] = f"skipped: {str(error).split('.')[0]}"
            continue
        outcome[implementation] = round(difference, 5)
        outcome[f"{implementation} within tolerance"] = difference <= outcome["tolerance"]
    return outcome


def reverse_batch(generator: torch.Generator, task: dict[str, Any], sentences: int) -> dict[str, torch.Tensor]:
    """Sentences of random tokens and their reversals (ending in </s>), padded."""
    low, high = task["lengths"]
    source = torch.full((sentences, high + 1), PAD)
    labels = torch.full((sentences, high + 1), -100)
    for row, length in enumerate(torch.randint(low, high + 1, (sentences,), generator=generator).tolist()):
        tokens = torch.randint(4, task["vocab"], (length,), generator=generator)
        source[row, : length + 1] = torch.cat([tokens, torch.tensor([EOS])])
        labels[row, : length + 1] = torch.cat([tokens.flip(0), torch.tensor([EOS])])
    return {"input_ids": source, "attention_mask": (source != PAD).long(), "labels": labels}


def held_out_reversals(run: Run) -> dict[str, torch.Tensor]:
    return reverse_batch(torch.Generator().manual_seed(1), run.sizes.reverse_task, 32)


def decode(
    model: VaswaniForConditionalGeneration, batch: dict[str, torch.Tensor], beams: int, **options
) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=batch["input_ids"].to(model.device),
            attention_mask=batch["attention_mask"].to(model.device),
            num_beams=beams,
            do_sample=False,
            max_new_tokens=batch["input_ids"].shape[1] + 1,
            **options,
        ).cpu()


def greedy_exact(model: VaswaniForConditionalGeneration, batch: dict[str, torch.Tensor]) -> float:
    """Share of sentences the model reverses exactly, greedy, on the CPU in fp32."""
    cpu_model = copy.deepcopy(model).to("cpu", torch.float32).eval()
    output = decode(cpu_model, batch, beams=1)[:, 1:]  # after the start token
    wanted = batch["labels"].masked_fill(batch["labels"] == -100, PAD)
    width = min(output.shape[1], wanted.shape[1])
    exact = (output[:, :width] == wanted[:, :width]).all(dim=1) & (wanted[:, width:] == PAD).all(dim=1)
    return exact.float().mean().item()


def train_reverse_model(run: Run) -> tuple[VaswaniForConditionalGeneration, dict[str, Any]]:
    """A small model trained on the device to reverse token sequences until its greedy output, on the CPU in fp32, is
    exact on held-out sentences: a confident model, whose decodings should not change with the device or precision."""
    task = run.sizes.reverse_task
    config = VaswaniConfig(
        vocab_size=task["vocab"],
        d_model=task["d_model"],
        d_ff=2 * task["d_model"],
        num_heads=4,
        encoder_layers=task["layers"],
        decoder_layers=task["layers"],
        dropout=0.0,
        label_smoothing=0.0,
    )
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).to(run.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=task["lr"], betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(0)
    held_out = held_out_reversals(run)
    exact, step = 0.0, 0
    while exact < 1.0 and step < task["max_steps"] and run.seconds_left() > 0:
        model.train()
        for _ in range(50):
            batch = {
                name: tensor.to(run.device) for name, tensor in reverse_batch(generator, task, task["batch"]).items()
            }
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step += 50
        exact = greedy_exact(model, held_out)
    return model.eval(), {"steps": step, "greedy exact on CPU": exact}


def decoding_matches_cpu(run: Run, model: VaswaniForConditionalGeneration) -> dict[str, Any]:
    """Greedy and beam-4 outputs on the device, fp32 and bf16, against the CPU's fp32 outputs."""
    held_out = held_out_reversals(run)
    cpu_model = copy.deepcopy(model).to("cpu", torch.float32)
    outcome: dict[str, Any] = {}
    for beams in (1, 4):
        reference = decode(cpu_model, held_out, beams)
        dtypes = (torch.float32, torch.bfloat16) if run.bf16 else (torch.float32,)
        for dtype in dtypes:
            output = decode(copy.deepcopy(model).to(run.device, dtype), held_out, beams)
            name = f"beam {beams} {'fp32' if dtype == torch.float32 else 'bf16'}"
            outcome[f"{name} = CPU fp32"] = output.shape == reference.shape and torch.equal(output, reference)
    return outcome


@contextmanager
def compiled_forward(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """The model's forward under torch.compile, one graph: inductor with CUDA graphs on CUDA; on a CPU aot_eager, which
    checks the graph but builds no code (inductor's vectorized CPU code for this step: docs/decoding.md)."""
    torch._dynamo.reset()  # a fresh compilation for each shape, far from dynamo's recompile limit
    options = dict(backend="inductor", mode="reduce-overhead") if device.type == "cuda" else dict(backend="aot_eager")
    original = model.forward
    model.forward = torch.compile(original, fullgraph=True, **options)
    try:
        yield
    finally:
        model.forward = original


# transformers compiles a static-cache decoding step on its own on CUDA; the scripts compile explicitly instead
STATIC_COMPILED = dict(cache_implementation="static", disable_compile=True)


def compiled_decoding_matches(run: Run, model: VaswaniForConditionalGeneration) -> dict[str, Any]:
    """A static cache and a compiled decoding step against eager decoding with the dynamic cache, on the device."""
    held_out = held_out_reversals(run)
    outcome: dict[str, Any] = {"backend": "inductor" if run.device.type == "cuda" else "aot_eager"}
    for dtype, beams in run.sizes.compile_checks:
        if dtype == torch.bfloat16 and not run.bf16:
            continue
        typed = copy.deepcopy(model).to(run.device, dtype)
        eager = decode(typed, held_out, beams)
        with compiled_forward(typed, run.device):
            compiled = decode(typed, held_out, beams, **STATIC_COMPILED)
        name = f"beam {beams} {'fp32' if dtype == torch.float32 else 'bf16'}"
        outcome[f"{name} equal"] = eager.shape == compiled.shape and torch.equal(eager, compiled)
    return outcome


def trainer_bf16_step(run: Run) -> dict[str, Any]:
    """One step of the recipe's trainer in bf16 mixed precision and in fp32, from the same weights and batch."""
    if not run.bf16:
        return {"skipped": "bf16 does not run on this CPU"}
    from datasets import Dataset

    from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments

    config = model_config(run, dropout=0.0)
    sentences, source_length, target_length = run.sizes.check_batch
    generator = torch.Generator().manual_seed(0)
    pairs = Dataset.from_dict(
        {
            "input_ids": random_tokens(generator, config.vocab_size, sentences, source_length).tolist(),
            "labels": random_tokens(generator, config.vocab_size, sentences, target_length).tolist(),
        }
    )
    losses = {}
    with tempfile.TemporaryDirectory() as folder:
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            arguments = paper_training_arguments(
                folder,
                max_steps=1,
                per_device_train_batch_size=sentences,
                bf16=precision == "bf16",
                save_strategy="no",
                logging_strategy="no",
                disable_tqdm=True,
            )
            trainer = VaswaniTrainer(model=VaswaniForConditionalGeneration(config), args=arguments, train_dataset=pairs)
            losses[precision] = trainer.train().training_loss
    tolerance = bf16_tolerance(config)
    difference = abs(losses["bf16"] - losses["fp32"]) / losses["fp32"]
    return {
        "fp32 loss": round(losses["fp32"], 5),
        "bf16 loss": round(losses["bf16"], 5),
        "relative difference": round(difference, 5),
        "tolerance": round(tolerance, 4),  # the loss is a mean of log-softmax values: relative, as the logits
        "within tolerance": difference <= tolerance,
    }


# --- Training throughput -------------------------------------------------------------------------------------------


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


def training(section: Section) -> None:
    run = section.run
    for name, preset in (("base", VaswaniConfig.base), ("big", VaswaniConfig.big)):
        config = model_config(run, preset)
        torch.manual_seed(0)
        ours = VaswaniForConditionalGeneration(config)
        marian = to_marian(ours)  # the same weights in transformers' implementation
        for system, model, options in (("hf_vaswani", ours, {"return_logits": False}), ("MarianMT", marian, {})):
            measurement = partial(training_throughput, run, model, config, options)
            section.measure(f"{name}, {system}", 60 if name == "big" else 30, measurement)
            model.to("cpu")
            if run.device.type == "cuda":
                torch.cuda.empty_cache()


def training_throughput(
    run: Run, model: torch.nn.Module, config: VaswaniConfig, options: dict[str, Any]
) -> dict[str, Any]:
    """Steps of bf16 mixed precision training (autocast, fp32 weights, fused AdamW) on ~25k-token batches a side, of
    `model` with `config`'s sizes; `options` go to its forward."""
    length = run.sizes.train_length
    sentences = run.sizes.train_tokens // length
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": random_tokens(generator, config.vocab_size, sentences, length).to(run.device),
        "labels": random_tokens(generator, config.vocab_size, sentences, length).to(run.device),
    }
    model.to(run.device).train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, fused=True
    )
    dtype = torch.bfloat16 if run.bf16 else torch.float32

    def step() -> None:
        with torch.autocast(run.device.type, dtype=dtype, enabled=run.bf16):
            loss = model(**batch, **options).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    for _ in range(2):  # warm-up: kernels chosen, optimizer state allocated
        step()
    seconds = statistics.median(timed(run.device, step) for _ in range(run.sizes.timed_steps))
    tokens = 2 * sentences * length
    flops = training_flops_per_step(config, sentences, length, length)
    achieved = flops / seconds / 1e12
    peak = peak_bf16_tflops(run.device)
    return {
        "precision": "bf16" if run.bf16 else "fp32",
        "sentences x length": f"{sentences} x {length}",
        "seconds a step": round(seconds, 4),
        "source+target tokens/s": round(tokens / seconds),
        "model TFLOP/s": float(f"{achieved:.4g}"),
        "MFU %": round(100 * achieved / peak, 1) if peak and run.bf16 else "n/a",
        "peak memory GiB": round(torch.cuda.max_memory_allocated(run.device) / 2**30, 2)
        if run.device.type == "cuda"
        else "n/a",
    }


# --- Generation speed ----------------------------------------------------------------------------------------------

# ours scores beams as transformers and CTranslate2 do (the paper's GNMT penalty is its default) and has no source cap
OUR_DECODING = dict(length_penalty_type="power", max_new_tokens_over_source=None)


def generation(section: Section) -> None:
    """Output tokens/s of greedy and beam-4 decoding at forced output lengths, random weights at base size: each
    system's eager decoding and CTranslate2 first (quick), then the compiled static-cache ones (compiled per shape)."""
    run = section.run
    config = model_config(run)
    torch.manual_seed(0)
    ours = VaswaniForConditionalGeneration(config).eval()
    marian = to_marian(ours).eval()
    sentences, source_length = max(run.sizes.generation_batches), run.sizes.generation_lengths[0]
    sources = random_tokens(torch.Generator().manual_seed(0), config.vocab_size, sentences, source_length)
    with tempfile.TemporaryDirectory() as folder:
        translator: dict[str, Any] = {}

        def export() -> dict[str, Any]:
            translator["model"], outcome = ctranslate2_translator(run, ours, Path(folder))
            return outcome

        section.measure("CTranslate2 float16: export and load", 20, export)  # from the CPU's fp32 weights
        dtype = torch.bfloat16 if run.bf16 else torch.float32
        for model in (ours, marian):
            model.to(run.device, dtype)
        shapes = [(batch, beams) for batch in run.sizes.generation_batches for beams in (1, 4)]
        for batch, beams in shapes:
            name = f"{'greedy' if beams == 1 else f'beam {beams}'}, batch {batch}"
            for system, model, options in (("hf_vaswani", ours, OUR_DECODING), ("MarianMT", marian, {})):
                speed = partial(generation_speed, run, model, sources[:batch], beams, options, compiled=False)
                section.measure(f"{name}, {system} eager", 20, speed)
            tokens = [ids_to_tokens(row) for row in sources[:batch].tolist()]
            speed = partial(ctranslate2_speed, run, translator.get("model"), tokens, beams)
            section.measure(f"{name}, CTranslate2 float16", 10, speed)
        for batch, beams in shapes:
            name = f"{'greedy' if beams == 1 else f'beam {beams}'}, batch {batch}"
            for system, model, options in (("hf_vaswani", ours, OUR_DECODING), ("MarianMT", marian, {})):
                speed = partial(generation_speed, run, model, sources[:batch], beams, options, compiled=True)
                section.measure(f"{name}, {system} static cache + compiled", 90, speed)


def generation_speed(
    run: Run,
    model: torch.nn.Module,
    sources: torch.Tensor,
    beams: int,
    options: dict[str, Any],
    compiled: bool,
) -> dict[str, Any]:
    if compiled and run.device.type != "cuda":
        return {"skipped": "compiled decoding is timed on CUDA: on a CPU it is checked with aot_eager, no speed-up"}
    new_tokens = run.sizes.generation_lengths[1]
    inputs = dict(
        input_ids=sources.to(run.device),
        attention_mask=torch.ones_like(sources, device=run.device),
        num_beams=beams,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # every system decodes the same number of steps
        **options,
        **(STATIC_COMPILED if compiled else {}),
    )
    outputs = []

    def generate() -> None:
        outputs.append(model.generate(**inputs))

    with compiled_forward(model, run.device) if compiled else nullcontext():
        for _ in range(2 if compiled else 1):  # warm-up: compilation, then CUDA graph recording
            generate()
        seconds = statistics.median(timed(run.device, generate) for _ in range(run.sizes.repeats))
    produced = outputs[-1].shape[1] - 1  # after the start token
    return {
        "output tokens/s": round(len(sources) * produced / seconds, 1),
        "seconds a batch": round(seconds, 4),
        "output length": produced,
    }


WORDS = ("<pad>", "<s>", "</s>", "<unk>")  # our special ids 0-3; one made-up word for each other id


def ids_to_tokens(ids: list[int]) -> list[str]:
    return [WORDS[i] if i < len(WORDS) else f"w{i}" for i in ids]


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is exactly the model's, which the CTranslate2 export needs."""
    words = ids_to_tokens(list(range(vocab_size)))
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def ctranslate2_translator(run: Run, model: VaswaniForConditionalGeneration, folder: Path) -> tuple[Any, dict]:
    """`model` exported with hf_vaswani's CTranslate2 export in float16, and a translator of it on CUDA, or None where
    it cannot run here (the reason is in the outcome)."""
    try:
        import ctranslate2
    except ImportError:
        return None, {"skipped": "ctranslate2 is not installed"}
    write_ctranslate2(model, word_tokenizer(model.config.vocab_size), folder / "ct2", "float16")
    if run.device.type != "cuda":
        return None, {"exported": True, "skipped": "float16 decoding runs on CUDA; the device is the CPU"}
    # Tried in a child process first: a CTranslate2 build for another CUDA version can fail to load its libraries, or
    # crash, and would take this process with it.
    probe = (
        "import sys, ctranslate2; translator = ctranslate2.Translator(sys.argv[1], device='cuda', "
        "compute_type='float16'); translator.translate_batch([['w4', '</s>']], max_decoding_length=2)"
    )
    command = [sys.executable, "-c", probe, str(folder / "ct2")]
    tried = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if tried.returncode != 0:
        lines = tried.stderr.strip().splitlines() or [f"exit status {tried.returncode}"]
        return None, {"exported": True, "skipped": f"CTranslate2 does not decode on CUDA here: {lines[-1]}"}
    translator = ctranslate2.Translator(str(folder / "ct2"), device="cuda", compute_type="float16")
    return translator, {"exported": True, "loaded": True}


def ctranslate2_speed(run: Run, translator: Any, tokens: list[list[str]], beams: int) -> dict[str, Any]:
    if translator is None:
        return {"skipped": "no CTranslate2 translator (see its export item)"}
    new_tokens = run.sizes.generation_lengths[1]
    options = dict(
        beam_size=beams, min_decoding_length=new_tokens, max_decoding_length=new_tokens, max_batch_size=len(tokens)
    )
    results = []

    def translate() -> None:
        results.append(translator.translate_batch(tokens, **options))

    translate()  # warm-up
    seconds = statistics.median(timed(run.device, translate) for _ in range(run.sizes.repeats))
    produced = len(results[-1][0].hypotheses[0])
    return {
        "output tokens/s": round(len(tokens) * produced / seconds, 1),
        "seconds a batch": round(seconds, 4),
        "output length": produced,
    }


# --- A short real run ----------------------------------------------------------------------------------------------

MULTI30K_FILES = ("train", "val", "test_2016_flickr")


def multi30k(section: Section, data: Path | None, minutes: float) -> None:
    """scripts/multi30k.sh's recipe with its training time capped at `minutes` (less where the time limit needs)."""
    run = section.run
    if data is None:
        raise Skipped("no --multi30k DIR given")
    missing = [
        name
        for split in MULTI30K_FILES
        for lang in ("en", "de")
        if not (data / (name := f"{split}.{lang}.gz")).exists()
    ]
    if missing:
        raise Skipped(f"{data} lacks {', '.join(missing)}")
    train_minutes = min(minutes, (run.seconds_left() - run.sizes.multi30k_reserve_s) / 60)
    if train_minutes < 0.2:
        raise Skipped(
            f"time limit: {run.seconds_left():.0f} s left, the run needs {run.sizes.multi30k_reserve_s:.0f} s "
            "besides training"
        )
    section.measure("Multi30k quick recipe", 0, partial(multi30k_run, run, data, train_minutes))


def multi30k_run(run: Run, data: Path, train_minutes: float) -> dict[str, Any]:
    log = run.report.output_dir / "multi30k.log"
    # multi30k.sh runs `vaswani`: the one installed beside this Python, whatever PATH says
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with tempfile.TemporaryDirectory() as folder, open(log, "w") as output:
        command = [
            "bash",
            str(Path(__file__).with_name("multi30k.sh")),
            str(data),
            str(Path(folder) / "run"),
            "--max-train-minutes",
            f"{train_minutes:.2f}",
        ]
        started = time.monotonic()
        try:
            status = subprocess.run(
                command, stdout=output, stderr=subprocess.STDOUT, env=environment, timeout=max(1.0, run.seconds_left())
            ).returncode
        except subprocess.TimeoutExpired:
            return {"error": f"stopped at the time limit after {time.monotonic() - started:.0f} s (log: {log.name})"}
        wall = round(time.monotonic() - started, 1)
        if status != 0:
            lines = log.read_text(errors="replace").strip().splitlines()
            return {
                "error": f"exit status {status}: {lines[-1] if lines else ''} (log: {log.name})",
                "wall seconds": wall,
            }
        results = json.loads((Path(folder) / "run" / "results.json").read_text())
    return {
        "training minutes cap": round(train_minutes, 2),
        "wall seconds": wall,
        "train seconds": results["train_seconds"],
        "steps": results["steps"],
        "precision": results["training_precision"],
        "test sacreBLEU": results["bleu"],
        "test chrF2": results["chrf"],
        "test tokenized BLEU": results["tokenized_bleu"],
    }


# --- Several processes ---------------------------------------------------------------------------------------------


def distributed(section: Section) -> None:
    run = section.run
    if run.device.type != "cuda":
        raise Skipped("no CUDA device: the two-process DDP and FSDP steps run on 2+ GPUs")
    if torch.cuda.device_count() < 2:
        raise Skipped(f"one GPU ({torch.cuda.get_device_name(run.device)}): the two-process steps need 2+ GPUs")
    for strategy in ("DDP", "FSDP"):
        section.measure(f"2 processes, {strategy}", 60, partial(two_process_step, strategy, "nccl", run.sizes))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_process_step(strategy: str, backend: str, sizes: Sizes) -> dict[str, Any]:
    """Training steps of two processes (one GPU each with nccl, the CPU with gloo) under DDP or FSDP2."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "rank0.json"
        arguments = (2, free_port(), strategy, backend, sizes.model, sizes.train_length, str(result))
        torch.multiprocessing.spawn(distributed_worker, args=arguments, nprocs=2, join=True)
        return json.loads(result.read_text())


def distributed_worker(
    rank: int, world_size: int, port: int, strategy: str, backend: str, model_sizes: dict, length: int, result: str
) -> None:
    """One rank: a step on its half of a batch, compared with one process's step on the whole batch (SGD, fp32, no
    dropout: the same update up to the order of fp32 sums), then timed steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers.modeling_layers import GradientCheckpointingLayer

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        config = VaswaniConfig.base(**{**model_sizes, "dropout": 0.0})
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(config).to(device)
        reference = copy.deepcopy(model)
        before = {name: weight.detach().clone() for name, weight in reference.named_parameters()}
        sentences = 64  # a rank's
        generator = torch.Generator().manual_seed(0)
        whole = {
            "input_ids": random_tokens(generator, config.vocab_size, world_size * sentences, length).to(device),
            "labels": random_tokens(generator, config.vocab_size, world_size * sentences, length).to(device),
        }
        half = {name: tensor[rank * sentences : (rank + 1) * sentences] for name, tensor in whole.items()}
        if strategy == "DDP":
            wrapped = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
        else:
            from torch.distributed.fsdp import fully_shard

            for module in model.modules():
                if isinstance(module, GradientCheckpointingLayer):  # each encoder and decoder layer
                    fully_shard(module)
            wrapped = fully_shard(model)

        def step(network: torch.nn.Module, batch: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
            network(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        step(wrapped, half, optimizer)
        step(reference, whole, torch.optim.SGD(reference.parameters(), lr=0.1))
        # the largest weight difference, relative to the largest weight change of one process's step (a weight whose
        # gradient is zero in exact arithmetic, such as a key bias, changes by rounding noise alone)
        difference = change = 0.0
        for (name, weight), expected in zip(wrapped.named_parameters(), reference.parameters(), strict=True):
            full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # FSDP's shards gathered
            change = max(change, (expected - before[name.removeprefix("module.")]).abs().max().item())
            difference = max(difference, (full - expected).abs().max().item())
        seconds = statistics.median(timed(device, partial(step, wrapped, half, optimizer)) for _ in range(3))
        if rank == 0:
            Path(result).write_text(
                json.dumps(
                    {
                        "backend": backend,
                        "weights after a step vs one process, relative to the update": difference / change,
                        "equal (1e-3 of the update)": difference <= 1e-3 * change,
                        "seconds a step": round(seconds, 4),
                        "source+target tokens/s": round(2 * world_size * sentences * length / seconds),
                    }
                )
            )
    finally:
        dist.destroy_process_group()


# --- Output --------------------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: a header line on the device, then a table per section."""
    device = data["device"]
    peak = device["dense_bf16_peak_tflops"]
    lines = [
        "# GPU figures",
        "",
        f"{device['name']} ({device['type']}, {device['gpus']} GPUs; dense bf16 peak "
        f"{f'{peak} TFLOP/s' if peak else 'unknown'}); torch {device['torch']}, CUDA {device['cuda']}, transformers "
        f"{device['transformers']}, CTranslate2 {device['ctranslate2']}. {'Tiny sizes. ' if data['tiny'] else ''}"
        f"Time limit {data['time_limit_minutes']} min, {data.get('elapsed_seconds', 0)} s used.",
    ]
    for name, section in data["sections"].items():
        reason = f": {section['reason']}" if "reason" in section else ""
        lines += ["", f"## {name} ({section['status']}{reason})"]
        items = section.get("results", {})
        if not items:
            continue
        fields = [set(values) - {"seconds"} for values in items.values()]
        if all(keys == fields[0] for keys in fields):  # one row per item, one column per field
            columns = list(dict.fromkeys(key for values in items.values() for key in values))
            lines += ["", f"| item | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
            for item, values in items.items():
                lines.append(f"| {item} | {' | '.join(cell(values.get(column, '')) for column in columns)} |")
        else:  # items measure different things: their fields in one cell
            lines += ["", "| item | results |", "|---|---|"]
            for item, values in items.items():
                lines.append(f"| {item} | {'; '.join(f'{key}: {cell(value)}' for key, value in values.items())} |")
    return "\n".join(lines) + "\n"


# --- Main ----------------------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path(os.environ.get("OUT") or "gpu_figures"),
        help="default: $OUT or gpu_figures",
    )
    parser.add_argument("--time-limit", type=float, default=8.0, metavar="MINUTES", help="for the whole run")
    parser.add_argument(
        "--multi30k", type=Path, metavar="DIR", help="Multi30k's train, val, test_2016_flickr .en/.de.gz"
    )
    parser.add_argument("--minutes", type=float, default=2.0, help="cap on the Multi30k run's training time")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a quick check of the script itself")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    deadline = time.monotonic() + 60 * args.time_limit
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
    else:
        from hf_vaswani.training.precision import cpu_bf16_matmul_works

        bf16 = cpu_bf16_matmul_works()
    header = {
        "device": device_description(device),
        "bf16": bf16,
        "tiny": args.tiny,
        "time_limit_minutes": args.time_limit,
    }
    run = Run(device, TINY if args.tiny else FULL, bf16, deadline, Report(args.output_dir, header))
    run.report.save()
    # The sections before the Multi30k run leave it its time: its training minutes and the rest of the run.
    multi30k_time = 60 * args.minutes + run.sizes.multi30k_reserve_s if args.multi30k else 0.0
    sections: dict[str, tuple[Callable[[Section], None], float]] = {
        "correctness": (correctness, multi30k_time),
        "training": (training, multi30k_time),
        "generation": (generation, multi30k_time),
        "multi30k": (partial(multi30k, data=args.multi30k, minutes=args.minutes), 0.0),
        "distributed": (distributed, 0.0),
    }
    for name, (body, time_for_later) in sections.items():
        run_section(replace(run, deadline=run.deadline - time_for_later), name, body)
    print(
        f"[gpu_figures] {args.output_dir / 'gpu_figures.json'}, {args.output_dir / 'gpu_figures.md'}", file=sys.stderr
    )


if __name__ == "__main__":
    main()
