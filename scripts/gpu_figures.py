"""GPU figures: correctness on the device, training and decoding speed against MarianMTModel and CTranslate2, and the
published Multi30k recipe end to end, each section alone or several in one command that keeps to a time limit.

    python scripts/gpu_figures.py [--only SECTION ...] [--time-limit 8] [--output-dir DIR]
    python scripts/gpu_figures.py --only multi30k_published --multi30k DIR --time-limit 9.5
    python scripts/gpu_figures.py --merge A/gpu_figures.json B/gpu_figures.json --output-dir DIR
    python scripts/gpu_figures.py --tiny --time-limit 1        # tiny sizes on the CPU, well under a minute

Runs on CUDA where available, else on the CPU. Writes gpu_figures.json and gpu_figures.md into --output-dir (default:
$OUT where set, else gpu_figures/) after every measurement, so a killed run keeps what it measured; what does not run
is recorded with its reason (no GPU, too little time left, a package missing). The summary (ratios of the recorded
figures) is recomputed at every write; --merge joins the reports of several runs (one per device call) into one and
recomputes it. A device machine gets no ../shared: copy the Multi30k corpus into an ignored folder of the repository
and pass that folder as --multi30k.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast, TrainerCallback

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani import generate as package_generate
from hf_vaswani.decoding.search import covered_request
from hf_vaswani.files import write_text
from hf_vaswani.interop.export import to_marian, write_ctranslate2
from hf_vaswani.training.recipe import build_model, training_arguments
from hf_vaswani.training.settings import RecipeSettings
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments

# The sections, in the order a run without --only takes them: the quick figures first, then what compiles.
SECTIONS = {
    "correctness": "bf16 attention implementations, decoding on the device = on the CPU, compiled = eager, a bf16 step",
    "training": "a fixed ~25k-token batch, base and big, hf_vaswani and MarianMT, eager: tokens/s, MFU",
    "trainer": "the recipe's VaswaniTrainer on token batches of a synthetic corpus, base and big, eager: tokens/s, MFU",
    "generation": "greedy and beam 4 at two batch sizes: the package loop, transformers' loop, MarianMT: tokens/s",
    "ctranslate2": "the same decoding by CTranslate2 (float16 and int8_float16 on CUDA) in a child process: tokens/s",
    "training_compiled": "the training section's measurements under torch.compile, and VaswaniTrainer's torch_compile",
    "generation_compiled": "the package loop with a compiled decoder step, MarianMT with a compiled static cache",
    "multi30k_published": "scripts/multi30k.sh --recipe published end to end: wall time, BLEU, epoch 1 and 5 losses",
    "distributed": "on 2+ GPUs: a DDP and an FSDP2 step of two processes against one process's",
}
PAD, EOS = 0, 2  # VaswaniConfig's default special ids (bos 1); content tokens start at 4, after <unk> 3
PRESETS = {"base": VaswaniConfig.base, "big": VaswaniConfig.big}
LABEL_SMOOTHING = 0.1  # §5.4, as VaswaniTrainer passes it to the model

OURS, MARIAN = "hf_vaswani", "MarianMT"
PACKAGE_LOOP = "hf_vaswani package loop"
TRANSFORMERS_LOOP = "hf_vaswani transformers loop"
PACKAGE_LOOP_COMPILED = "hf_vaswani package loop, compiled step"
MARIAN_COMPILED = "MarianMT, static cache + compiled"
TRAINER = "VaswaniTrainer"
TRAINING_FIGURE, DECODING_FIGURE, MFU = "source+target tokens/s", "output tokens/s", "MFU %"
CT2_COMPUTE_TYPES = {"cuda": ("float16", "int8_float16"), "cpu": ("float32", "int8")}
CUBLAS12 = ("libcublasLt.so.12", "libcublas.so.12")  # in load order: libcublas needs libcublasLt

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
    train_length: int  # source = target length of the fixed training batch
    train_tokens: int  # tokens a side of the fixed training batch (the paper's ~25k)
    warmup_steps: int  # untimed steps (or calls) before the timed ones: kernels chosen, memory allocated, compiled
    timed_steps: int
    compiled_presets: tuple[str, ...]  # the sizes trained compiled
    trainer_pairs: int  # sentence pairs of the synthetic corpus
    trainer_lengths: tuple[int, int, int]  # its shortest, median and longest sentence, in tokens
    trainer_max_tokens: int  # VaswaniTrainer's max_tokens
    trainer_warmup_steps: int  # twice as many compiled: shapes vary, and the second shape compiles a dynamic graph
    trainer_timed_steps: int
    generation_batches: tuple[int, ...]
    source_lengths: tuple[int, int]  # shortest and longest source of the decoding batches
    new_tokens: int  # output tokens each system is made to produce (min = max)
    compiled_shapes: tuple[tuple[int, int], ...] | None  # (batch, beams) decoded compiled; None: every shape
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


# --- The run: device, time limit, report ----------------------------------------------------------------------------


class Report:
    """The results so far with their summary, written whole to JSON and Markdown after every measurement."""

    def __init__(self, output_dir: Path, data: dict[str, Any], started: float | None = None) -> None:
        self.output_dir = output_dir
        self.data = data
        self.started = started  # None: a merged report, whose elapsed time is its parts'

    def save(self) -> None:
        if self.started is not None:
            self.data["elapsed_seconds"] = round(time.monotonic() - self.started, 1)
        self.data["summary"] = summary(self.data)
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
                gc.collect()  # a Trainer's reference cycles would hold its model and optimizer on the device
                torch.cuda.empty_cache()
            outcome.setdefault("seconds", round(time.monotonic() - started, 2))
        self.record(item, outcome)

    def record(self, item: str, outcome: dict[str, Any]) -> None:
        self.results[item] = outcome
        self.run.report.save()


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
    entry.update(status="running", device=run.report.data["device"]["name"], results=section.results)
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
    except Exception:  # not installed, or its libraries do not load here
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


def time_calls(device: torch.device, work: Callable[[], object], warmup: int, repeats: int) -> float:
    """Seconds a call of `work`: `warmup` calls, then `repeats` calls between two synchronisations of the device, so
    that the host queues each call's work while the device runs the last one's, as in a training or decoding loop."""
    for _ in range(warmup):
        work()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    synchronize(device)
    return (time.perf_counter() - started) / repeats


def model_config(run: Run, preset: Callable[..., VaswaniConfig] = VaswaniConfig.base, **changes: Any) -> VaswaniConfig:
    return preset(**{**run.sizes.model, **changes})


def random_tokens(generator: torch.Generator, vocab_size: int, rows: int, length: int) -> torch.Tensor:
    """Content tokens ending in </s>, as a tokenizer gives sources."""
    tokens = torch.randint(4, vocab_size, (rows, length), generator=generator)
    tokens[:, -1] = EOS
    return tokens


def relative_difference(value: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / scale.float().norm()).item()


def peak_memory_gib(device: torch.device) -> float | str:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else "n/a"


def mfu(run: Run, tflops: float) -> float | str:
    peak = peak_bf16_tflops(run.device)
    return round(100 * tflops / peak, 1) if peak and run.bf16 else "n/a"


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


def compile_options(device: torch.device) -> dict[str, Any]:
    """inductor on CUDA; on a CPU aot_eager, which checks the graphs (forward and backward) but builds no code, since
    inductor's C++ compilation would take most of a tiny run."""
    return {} if device.type == "cuda" else {"backend": "aot_eager"}


def training(section: Section) -> None:
    for preset in PRESETS:
        for system in (OURS, MARIAN):
            measurement = partial(training_throughput, section.run, preset, system, False)
            section.measure(f"{preset}, {system}, eager", 40 if preset == "big" else 20, measurement)


def trainer(section: Section) -> None:
    for preset in PRESETS:
        measurement = partial(trainer_throughput, section.run, preset, False)
        section.measure(f"{preset}, {TRAINER}, eager", 60 if preset == "big" else 45, measurement)


def training_model(run: Run, config: VaswaniConfig, system: str) -> torch.nn.Module:
    """The seeded model of `config`, or MarianMTModel with the same weights (to_marian), on the CPU; sdpa attention."""
    torch.manual_seed(0)
    ours = VaswaniForConditionalGeneration(config)
    model = ours if system == OURS else to_marian(ours)
    model.set_attn_implementation("sdpa")
    return model


def training_throughput(run: Run, preset: str, system: str, compiled: bool) -> dict[str, Any]:
    """Steps of bf16 mixed precision training (autocast, fp32 weights, fused AdamW) on a fixed batch of ~25k tokens a
    side; hf_vaswani called as VaswaniTrainer.compute_loss calls it, MarianMTModel with its own loss."""
    config = model_config(run, PRESETS[preset])
    model = training_model(run, config, system).to(run.device).train()
    length = run.sizes.train_length
    sentences = run.sizes.train_tokens // length
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": random_tokens(generator, config.vocab_size, sentences, length).to(run.device),
        "labels": random_tokens(generator, config.vocab_size, sentences, length).to(run.device),
    }
    options: dict[str, Any] = {}
    if system == OURS:
        tokens = (batch["labels"] != -100).sum()  # Trainer's num_items_in_batch: a device tensor
        options = dict(return_logits=False, smoothing=LABEL_SMOOTHING, num_items_in_batch=tokens)
    torch._dynamo.reset()
    forward = torch.compile(model, **compile_options(run.device)) if compiled else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, fused=True
    )
    dtype = torch.bfloat16 if run.bf16 else torch.float32

    def step() -> None:
        with torch.autocast(run.device.type, dtype=dtype, enabled=run.bf16):
            loss = forward(**batch, **options).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    try:
        seconds = time_calls(run.device, step, run.sizes.warmup_steps, run.sizes.timed_steps)
    finally:
        torch._dynamo.reset()  # compiled graphs hold the model
    achieved = training_flops_per_step(config, sentences, length, length) / seconds / 1e12
    outcome = {
        "precision": "bf16" if run.bf16 else "fp32",
        "attention": model.config._attn_implementation,
        "sentences x length": f"{sentences} x {length}",
        "steps timed": run.sizes.timed_steps,
        "seconds a step": round(seconds, 4),
        TRAINING_FIGURE: round(2 * sentences * length / seconds),
        "model TFLOP/s": float(f"{achieved:.4g}"),
        MFU: mfu(run, achieved),
        "peak memory GiB": peak_memory_gib(run.device),
    }
    if compiled:
        outcome["backend"] = compile_options(run.device).get("backend", "inductor")
    return outcome


def training_compiled(section: Section) -> None:
    run = section.run
    for preset in run.sizes.compiled_presets:
        for system in (OURS, MARIAN):
            measurement = partial(training_throughput, run, preset, system, True)
            section.measure(f"{preset}, {system}, compiled", 150 if preset == "big" else 120, measurement)
    if run.device.type != "cuda":  # Trainer compiles with inductor, whose C++ build would take minutes here
        section.record(f"base, {TRAINER}, torch_compile", {"skipped": "Trainer's torch_compile is timed on CUDA"})
        return
    section.measure(f"base, {TRAINER}, torch_compile", 240, partial(trainer_throughput, run, "base", True))


# --- The recipe's Trainer ------------------------------------------------------------------------------------------


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
        tokens = rng.integers(4, vocab_size, int(lengths.sum()))
        return [np.append(row[:-1], EOS).tolist() for row in np.split(tokens, np.cumsum(lengths)[:-1])]

    input_ids = sentences(source)
    return Dataset.from_dict(
        {"input_ids": input_ids, "attention_mask": [[1] * len(ids) for ids in input_ids], "labels": sentences(target)}
    )


def trainer_throughput(run: Run, preset: str, compiled: bool) -> dict[str, Any]:
    """`trainer.train()` of the recipe's pieces (build_model, training_arguments, DataCollatorForSeq2Seq, token
    batches of max_tokens) on a synthetic corpus: its steps after the warm-up, timed between two synchronisations."""
    sizes = run.sizes
    vocab_size = model_config(run).vocab_size
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
            data_collator=DataCollatorForSeq2Seq(
                tokenizer, model=model, pad_to_multiple_of=8 if run.device.type == "cuda" else None
            ),
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


# --- Decoding speed ------------------------------------------------------------------------------------------------

# ours scores beams as transformers and CTranslate2 do (the paper's GNMT penalty is its default) and has no source cap
OUR_DECODING = dict(length_penalty_type="power", max_new_tokens_over_source=None)


def decoding_shapes(sizes: Sizes) -> list[tuple[int, int]]:
    return [(batch, beams) for batch in sizes.generation_batches for beams in (1, 4)]


def shape_name(batch: int, beams: int) -> str:
    return f"{'greedy' if beams == 1 else f'beam {beams}'}, batch {batch}"


def decoding_models(run: Run) -> tuple[VaswaniForConditionalGeneration, torch.nn.Module]:
    """The seeded base model and MarianMTModel with its weights, bf16 on the device (fp32 where bf16 does not run)."""
    torch.manual_seed(0)
    ours = VaswaniForConditionalGeneration(model_config(run)).eval()
    marian = to_marian(ours).eval()
    marian.set_attn_implementation("sdpa")
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    return ours.to(run.device, dtype), marian.to(run.device, dtype)


def decoding_sources(run: Run, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of random lengths ending in </s>, padded: ids and mask of the largest batch (the smaller batches are
    its first rows)."""
    generator = torch.Generator().manual_seed(0)
    rows, (shortest, longest) = max(run.sizes.generation_batches), run.sizes.source_lengths
    lengths = torch.randint(shortest, longest + 1, (rows,), generator=generator)
    ids = random_tokens(generator, vocab_size, rows, longest)
    mask = torch.arange(longest) < lengths[:, None]
    ids[~mask] = PAD
    ids[torch.arange(rows), lengths - 1] = EOS
    return ids, mask.long()


def decoding_inputs(run: Run, ids: torch.Tensor, mask: torch.Tensor, beams: int) -> dict[str, Any]:
    new_tokens = run.sizes.new_tokens
    return dict(
        input_ids=ids.to(run.device),
        attention_mask=mask.to(run.device),
        num_beams=beams,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # every system decodes the same number of steps
    )


def decoding_speed(
    run: Run, decode: Callable[[], torch.Tensor], rows: int, warmup: int = 1
) -> tuple[dict[str, Any], torch.Tensor]:
    """Output tokens/s of `decode` (a batch of `rows` sentences), timed over calls between two synchronisations, and
    its last output."""
    outputs: list[torch.Tensor] = []

    def call() -> None:
        outputs[:] = [decode()]

    seconds = time_calls(run.device, call, warmup, run.sizes.repeats)
    produced = outputs[-1].shape[1] - 1  # after the start token
    figures = {
        DECODING_FIGURE: round(rows * produced / seconds, 1),
        "seconds a batch": round(seconds, 4),
        "output length": produced,
    }
    return figures, outputs[-1]


def package_loop(model: VaswaniForConditionalGeneration, inputs: dict[str, Any]) -> torch.Tensor:
    """hf_vaswani.generate, refusing a call its loop would hand to transformers' (which would time the wrong loop)."""
    request = covered_request(model, None, None, {**inputs, **OUR_DECODING})
    if isinstance(request, str):
        raise RuntimeError(f"the package loop does not cover this call: {request}")
    return package_generate(model, **inputs, **OUR_DECODING)


def transformers_loop(model: torch.nn.Module, inputs: dict[str, Any], **options: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**inputs, **options)


def generation(section: Section) -> None:
    """Greedy and beam 4, random weights at base size, the output length forced: the package's loop, transformers'
    loop for the same model, and MarianMTModel's generate."""
    run = section.run
    ours, marian = decoding_models(run)
    ids, mask = decoding_sources(run, ours.config.vocab_size)
    for batch, beams in decoding_shapes(run.sizes):
        inputs = decoding_inputs(run, ids[:batch], mask[:batch], beams)
        systems = (
            (PACKAGE_LOOP, partial(package_loop, ours, inputs), 10),
            (TRANSFORMERS_LOOP, partial(transformers_loop, ours, inputs, **OUR_DECODING), 20),
            (MARIAN, partial(transformers_loop, marian, inputs), 20),
        )
        for system, decode, estimate in systems:
            measurement = partial(decoding_figures, run, decode, batch)
            section.measure(f"{shape_name(batch, beams)}, {system}", estimate, measurement)


def decoding_figures(run: Run, decode: Callable[[], torch.Tensor], rows: int) -> dict[str, Any]:
    return decoding_speed(run, decode, rows)[0]


@contextmanager
def compiled_decoder_step(model: VaswaniForConditionalGeneration, device: torch.device) -> Iterator[str]:
    """The decoder's forward under torch.compile, for the package loop (which calls the decoder a token at a time);
    yields the backend. Each call's first step stays eager: it fills the cross-attention cache and creates the static
    cache's tensors (marked as static addresses only outside a compiled region, which CUDA graphs need). On CUDA
    inductor with CUDA graphs (reduce-overhead); on a CPU dynamo alone ("eager"), where the cache grows a step at a
    time."""
    decoder = model.model.decoder
    original = decoder.forward
    torch._dynamo.reset()
    if device.type == "cuda":
        backend, compiled = "inductor", torch.compile(original, mode="reduce-overhead", dynamic=False)
    else:
        backend, compiled = "eager", torch.compile(original, backend="eager")

    def forward(*args: Any, cache: Any = None, **kwargs: Any) -> Any:
        if cache is None or not cache.self_attention_cache.is_initialized:
            return original(*args, cache=cache, **kwargs)
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read already
        return compiled(*args, cache=cache, **kwargs)

    decoder.forward = forward
    try:
        yield backend
    finally:
        del decoder.forward
        torch._dynamo.reset()


def compiled_package_loop_speed(
    run: Run, model: VaswaniForConditionalGeneration, inputs: dict[str, Any]
) -> dict[str, Any]:
    eager = package_loop(model, inputs)
    with compiled_decoder_step(model, run.device) as backend:
        figures, output = decoding_speed(run, partial(package_loop, model, inputs), len(eager), warmup=2)
    figures["backend"] = backend if run.device.type == "cuda" else f"{backend} (a check of the code: no speed-up)"
    figures["equal to the eager loop"] = output.shape == eager.shape and torch.equal(output, eager)
    return figures


def compiled_transformers_speed(run: Run, model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    with compiled_forward(model, run.device):
        decode = partial(transformers_loop, model, inputs, **STATIC_COMPILED)
        figures, _ = decoding_speed(run, decode, len(inputs["input_ids"]), warmup=2)
    figures["backend"] = "inductor" if run.device.type == "cuda" else "aot_eager (a check of the code: no speed-up)"
    return figures


def generation_compiled(section: Section) -> None:
    """The package loop with its decoder step compiled, then MarianMTModel's generate with a static cache and its
    forward compiled (transformers' usual compiled decoding): each shape compiled afresh."""
    run = section.run
    ours, marian = decoding_models(run)
    ids, mask = decoding_sources(run, ours.config.vocab_size)
    shapes = run.sizes.compiled_shapes or decoding_shapes(run.sizes)
    for system, model, measurement, estimate in (
        (PACKAGE_LOOP_COMPILED, ours, compiled_package_loop_speed, 60),
        (MARIAN_COMPILED, marian, compiled_transformers_speed, 90),
    ):
        for batch, beams in shapes:
            inputs = decoding_inputs(run, ids[:batch], mask[:batch], beams)
            attempt = partial(skipped_if_it_fails, partial(measurement, run, model, inputs))
            section.measure(f"{shape_name(batch, beams)}, {system}", estimate, attempt)


def skipped_if_it_fails(measurement: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measurement()`, or skipped with its error's first line: compiled decoding is tried, not assumed to work."""
    try:
        return measurement()
    except Exception as error:
        traceback.print_exc()
        return {"skipped": f"compiled decoding failed: {type(error).__name__}: {first_line(error)}"}


# --- CTranslate2 ---------------------------------------------------------------------------------------------------

WORDS = ("<pad>", "<s>", "</s>", "<unk>")  # our special ids 0-3; one made-up word for each other id


def ids_to_tokens(ids: list[int]) -> list[str]:
    return [WORDS[i] if i < len(WORDS) else f"w{i}" for i in ids]


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary is exactly the model's, which the CTranslate2 export and the recipe's model need."""
    words = ids_to_tokens(list(range(vocab_size)))
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def ctranslate2_section(section: Section, wheel: Path | None) -> None:
    """The generation section's model and sources decoded by CTranslate2 in a child process, which on CUDA first loads
    cuBLAS 12 (CTranslate2's wheel links libcublas.so.12; a CUDA 13 machine has libcublas.so.13)."""
    run = section.run
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise Skipped("ctranslate2 is not installed") from None
    except Exception as error:  # its libraries do not load in this process
        raise Skipped(f"ctranslate2 does not import: {type(error).__name__}: {first_line(error)}") from None
    compute_types = CT2_COMPUTE_TYPES[run.device.type]
    items = {
        (compute_type, batch, beams): f"{shape_name(batch, beams)}, CTranslate2 {compute_type}"
        for compute_type in compute_types
        for batch, beams in decoding_shapes(run.sizes)
    }
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / "ct2"
        section.measure("export: write_ctranslate2, float16", 30, partial(ctranslate2_export, run, model_dir))
        libraries: list[str] = []
        why_not = "" if model_dir.is_dir() else "no exported model (see the export item)"
        if not why_not and run.device.type == "cuda":
            section.measure("cuBLAS 12", 60, partial(cublas12_measurement, wheel, libraries))
            why_not = "" if libraries else "no cuBLAS 12 to load (see the cuBLAS 12 item)"
        if not why_not:
            child = partial(ctranslate2_child_run, run, model_dir, compute_types, libraries, measured)
            section.measure("child process", 90, child)
            why_not = "not measured by the child process (see its item)"
    for (compute_type, batch, beams), item in items.items():
        section.record(item, measured.get(f"{compute_type} {batch} {beams}", {"skipped": why_not}))


def ctranslate2_export(run: Run, model_dir: Path) -> dict[str, Any]:
    """The generation section's model (same seed, fp32 on the CPU) by hf_vaswani's CTranslate2 export, in float16;
    CTranslate2 converts it to each compute type as it loads it."""
    config = model_config(run)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).eval()
    write_ctranslate2(model, word_tokenizer(config.vocab_size), model_dir, "float16")
    return {"quantization": "float16", "vocabulary": config.vocab_size}


def cublas12_folders() -> list[Path]:
    """Folders that hold cuBLAS 12 already: the nvidia-cublas-cu12 wheel's in this Python's paths, a CUDA 12 toolkit's,
    or where the loader's cache has it."""
    candidates = [Path(entry) / "nvidia" / name / "lib" for entry in sys.path if entry for name in ("cublas", "cu12")]
    candidates += sorted(Path("/usr/local").glob("cuda-12*/lib64")) + sorted(
        Path("/usr/local").glob("cuda-12*/targets/*/lib")
    )
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        cache = ""
    candidates += [Path(line.split("=>")[-1].strip()).parent for line in cache.splitlines() if CUBLAS12[1] in line]
    return [folder for folder in dict.fromkeys(candidates) if all((folder / name).is_file() for name in CUBLAS12)]


def cublas12_libraries(wheel: Path | None, cache: Path, pip: bool = True) -> tuple[list[str], str]:
    """The paths of libcublasLt.so.12 and libcublas.so.12, in load order, and where they came from: found installed,
    else extracted from `wheel` (an nvidia-cublas-cu12 wheel file) into `cache`, else installed into `cache` by pip
    (where `pip`); LookupError with each way's failure otherwise."""
    failures = []
    earlier = [cache / way / "nvidia" / "cublas" / "lib" for way in ("wheel", "pip")]  # an earlier run's
    for folder in cublas12_folders() + earlier:
        if all((folder / name).is_file() for name in CUBLAS12):
            return [str(folder / name) for name in CUBLAS12], f"found in {folder}"
    if wheel is None:
        failures.append("none installed")
    elif not wheel.is_file():
        failures.append(f"--cublas12-wheel {wheel}: no such file")
    elif not zipfile.is_zipfile(wheel):
        failures.append(f"--cublas12-wheel {wheel} is not a wheel file")
    else:
        folder = cache / "wheel" / "nvidia" / "cublas" / "lib"
        with zipfile.ZipFile(wheel) as archive:
            members = [f"nvidia/cublas/lib/{name}" for name in CUBLAS12]
            absent = [member for member in members if member not in archive.namelist()]
            if absent:
                failures.append(f"--cublas12-wheel {wheel.name} lacks {', '.join(absent)}")
            else:
                for member in members:
                    archive.extract(member, cache / "wheel")
                return [str(folder / name) for name in CUBLAS12], f"extracted from {wheel}"
    if pip:
        target = cache / "pip"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check"]
        command += ["--retries", "0", "--timeout", "15", "--target", str(target), "nvidia-cublas-cu12"]
        try:
            installed = subprocess.run(command, capture_output=True, text=True, timeout=300)
            lines = installed.stderr.strip().splitlines()
            folder = target / "nvidia" / "cublas" / "lib"
            if installed.returncode == 0 and all((folder / name).is_file() for name in CUBLAS12):
                return [str(folder / name) for name in CUBLAS12], "installed by pip install nvidia-cublas-cu12"
            failures.append(f"pip install nvidia-cublas-cu12: {lines[-1] if lines else installed.returncode}")
        except subprocess.TimeoutExpired:
            failures.append("pip install nvidia-cublas-cu12: no answer in 300 s")
    raise LookupError("; ".join(failures))


def cublas12_measurement(wheel: Path | None, libraries: list[str]) -> dict[str, Any]:
    try:
        paths, source = cublas12_libraries(wheel, Path(tempfile.gettempdir()) / "gpu_figures_cublas12")
    except LookupError as failures:
        return {"skipped": f"no libcublas.so.12: {failures}"}
    libraries[:] = paths
    return {"source": source}


def ctranslate2_child(job_file: str) -> None:
    """CTranslate2's decoding speeds, in a process of its own (run from this function's source): the job's libraries
    loaded first, globally, so that CTranslate2's libcublas.so.12 resolves to them; the results written after each
    measurement, so that a crash keeps the ones before it."""
    import ctypes
    import json
    import os
    import time

    with open(job_file) as handle:
        job = json.load(handle)
    for library in job["libraries"]:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    import ctranslate2

    deadline = time.monotonic() + job["seconds"]
    results: dict = {"ctranslate2": ctranslate2.__version__, "loaded": {}, "items": {}}

    def save() -> None:
        with open(job["results"] + ".partial", "w") as handle:
            json.dump(results, handle)
        os.replace(job["results"] + ".partial", job["results"])

    save()
    for compute_type in job["compute_types"]:
        try:
            translator = ctranslate2.Translator(
                job["model"], device=job["device"], compute_type=compute_type, intra_threads=job["threads"]
            )
        except Exception as error:
            results["loaded"][compute_type] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
            save()
            continue
        results["loaded"][compute_type] = "yes"
        for batch, beams in job["shapes"]:
            key = f"{compute_type} {batch} {beams}"
            if time.monotonic() > deadline:
                results["items"][key] = {"skipped": "time limit"}
                continue
            sources = job["sources"][:batch]
            options = dict(
                beam_size=beams,
                min_decoding_length=job["new_tokens"],
                max_decoding_length=job["new_tokens"],
                max_batch_size=batch,
            )
            try:
                for _ in range(job["warmup"]):
                    translator.translate_batch(sources, **options)
                started = time.perf_counter()
                for _ in range(job["repeats"]):  # each call returns once decoded: the host waits for the device
                    output = translator.translate_batch(sources, **options)
                seconds = (time.perf_counter() - started) / job["repeats"]
            except Exception as error:
                results["items"][key] = {
                    "error": f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
                }
                save()
                continue
            produced = len(output[0].hypotheses[0])
            results["items"][key] = {
                "output tokens/s": round(batch * produced / seconds, 1),
                "seconds a batch": round(seconds, 4),
                "output length": produced,
            }
            save()
        del translator


def ctranslate2_child_run(
    run: Run,
    model_dir: Path,
    compute_types: tuple[str, ...],
    libraries: list[str],
    measured: dict[str, Any],
) -> dict[str, Any]:
    """Run ctranslate2_child on the generation section's sources (padding left out) and collect what it measured."""
    ids, mask = decoding_sources(run, model_config(run).vocab_size)
    sources = [ids_to_tokens(row[:length]) for row, length in zip(ids.tolist(), mask.sum(1).tolist(), strict=True)]
    program = textwrap.dedent(inspect.getsource(ctranslate2_child)) + "\nimport sys\nctranslate2_child(sys.argv[1])\n"
    with tempfile.TemporaryDirectory() as folder:
        job = {
            "model": str(model_dir),
            "device": run.device.type,
            "compute_types": list(compute_types),
            "libraries": libraries,
            "shapes": decoding_shapes(run.sizes),
            "sources": sources,
            "new_tokens": run.sizes.new_tokens,
            "warmup": 1,
            "repeats": run.sizes.repeats,
            "threads": int(os.environ.get("OMP_NUM_THREADS") or 0),
            "seconds": max(1.0, run.seconds_left() - 10),
            "results": str(Path(folder) / "results.json"),
        }
        write_text(Path(folder) / "job.json", json.dumps(job))
        command = [sys.executable, "-c", program, str(Path(folder) / "job.json")]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=max(1.0, run.seconds_left()))
            status, lines = child.returncode, child.stderr.strip().splitlines()
        except subprocess.TimeoutExpired:
            status, lines = "stopped at the time limit", []
        results_file = Path(job["results"])
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
    measured.update(results.get("items", {}))
    outcome: dict[str, Any] = {"exit status": status, "ctranslate2": results.get("ctranslate2")}
    outcome.update({f"loaded {compute_type}": loaded for compute_type, loaded in results.get("loaded", {}).items()})
    if status != 0 and lines:
        outcome["last error line"] = lines[-1]
    return outcome


# --- The published Multi30k recipe ---------------------------------------------------------------------------------

MULTI30K_FILES = ("train", "val", "test_2016_flickr")


def multi30k_published(section: Section, data: Path | None, run_folder: Path | None) -> None:
    """scripts/multi30k.sh --recipe published, whole: stopped at the time limit (its epoch losses so far recorded)."""
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
    needed = run.sizes.multi30k_minimum_s * run.sizes.time_scale
    if run.seconds_left() < needed:
        raise Skipped(f"time limit: {run.seconds_left():.0f} s left, the run needs at least {needed:.0f} s")
    section.measure("scripts/multi30k.sh --recipe published", 0, partial(published_run, run, data, run_folder))


def published_run(run: Run, data: Path, run_folder: Path | None) -> dict[str, Any]:
    log = run.report.output_dir / "multi30k_published.log"
    # multi30k.sh runs `vaswani`: the one installed beside this Python, whatever PATH says
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with tempfile.TemporaryDirectory() as scratch:
        folder = run_folder if run_folder is not None else Path(scratch) / "run"
        if (folder / "results.json").exists():
            return {"note": f"{folder} holds a finished run: not run again", **published_run_figures(folder)}
        resumed = (folder / "run.json").exists()  # a run started there before, and stopped
        command = [
            "bash",
            str(Path(__file__).with_name("multi30k.sh")),
            str(data),
            str(folder),
            "--recipe",
            "published",
        ]
        started = time.monotonic()
        status = run_logged(command + (["--resume"] if resumed else []), log, run.seconds_left() - 5, environment)
        outcome: dict[str, Any] = {"wall seconds": round(time.monotonic() - started, 1), "resumed": resumed}
        keep_tail(log, 256 * 1024)  # progress bars make a long log
        if status is None:
            outcome["stopped"] = f"at the time limit (log: {log.name})"
        elif status != 0:
            lines = log.read_text(errors="replace").strip().splitlines()
            outcome["error"] = f"exit status {status}: {lines[-1] if lines else ''} (log: {log.name})"
        return {**outcome, **published_run_figures(folder)}


def run_logged(command: list[str], log: Path, timeout: float, environment: dict[str, str]) -> int | None:
    """`command`'s exit status, its output in `log`; None where it ran past `timeout` seconds and was stopped: its
    process group, so that its data loader workers stop with it."""
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
        try:
            return process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            for stop, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
                try:
                    os.killpg(process.pid, stop)
                    process.wait(timeout=grace)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None


def keep_tail(path: Path, size: int) -> None:
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - size))
        tail = handle.read()
    path.write_bytes(tail)


def published_run_figures(folder: Path) -> dict[str, Any]:
    """From a run folder: results.json's scores (a finished run) and the validation loss and NLL at epochs 1 and 5 from
    the newest checkpoint's trainer_state.json log history (else results.json's validation curve)."""
    figures: dict[str, Any] = {}
    results: dict[str, Any] = {}
    if (folder / "results.json").exists():
        results = json.loads((folder / "results.json").read_text())
        figures.update(
            {
                "whitespace BLEU": results.get("whitespace_bleu"),
                "sacreBLEU": results.get("bleu"),
                "steps": results.get("steps"),
                "train seconds": results.get("train_seconds"),
                "total seconds": results.get("total_seconds"),
                "precision": results.get("training_precision"),
            }
        )
    states = sorted(folder.glob("**/checkpoint-*/trainer_state.json"), key=lambda path: checkpoint_step(path.parent))
    if states:
        history = json.loads(states[-1].read_text())["log_history"]
        figures["log history of"] = str(states[-1].parent.relative_to(folder))
    else:
        history = (results.get("validation_loss") or {}).get("curve", [])
    validations = [entry for entry in history if "eval_loss" in entry and "eval_nll_loss" in entry]
    figures["validations"] = len(validations)
    for epoch in (1, 5):
        nearest = min(validations, key=lambda entry: abs(entry["epoch"] - epoch), default=None)
        if nearest is not None and abs(nearest["epoch"] - epoch) < 0.5:
            figures[f"epoch {epoch} eval_loss"] = round(nearest["eval_loss"], 4)
            figures[f"epoch {epoch} eval_nll_loss"] = round(nearest["eval_nll_loss"], 4)
    return figures


def checkpoint_step(folder: Path) -> int:
    suffix = folder.name.removeprefix("checkpoint-")
    return int(suffix) if suffix.isdigit() else -1


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
        seconds = time_calls(device, partial(step, wrapped, half, optimizer), 1, 3)
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


# --- Summary: ratios of the recorded figures -----------------------------------------------------------------------


def recorded_figures(data: dict[str, Any]) -> dict[str, tuple[dict[str, Any], str]]:
    """Every recorded item of every section (names are unique across sections), with the device it ran on."""
    figures = {}
    for entry in data["sections"].values():
        for item, outcome in entry.get("results", {}).items():
            figures[item] = (outcome, entry.get("device", data["device"]["name"]))
    return figures


def best_item(figures: dict[str, tuple[dict[str, Any], str]], candidates: list[str], key: str) -> str | None:
    """The candidate with the highest positive figure `key`, None where none has one."""

    def value(item: str) -> float:
        figure = figures[item][0].get(key) if item in figures else None
        is_number = isinstance(figure, int | float) and not isinstance(figure, bool)
        return figure if is_number and figure > 0 else -math.inf

    best = max(candidates, key=value, default=None)
    return best if best is not None and value(best) > -math.inf else None


def summary_entry(
    figures: dict[str, tuple[dict[str, Any], str]], key: str, of: list[str], over: list[str] | None = None
) -> dict[str, Any]:
    """The best of the `of` items' figure `key`, divided by the best of the `over` items' of the same device where
    given; `value` None and what is `missing` where a side has no such figure."""
    numerator = best_item(figures, of, key)
    if numerator is None:
        return {"value": None, "missing": f"no {key} for {' or '.join(of)}"}
    if over is None:
        return {"value": figures[numerator][0][key], "figure": key, "of": numerator}
    device = figures[numerator][1]
    denominator = best_item(figures, [item for item in over if item in figures and figures[item][1] == device], key)
    if denominator is None:
        others = best_item(figures, over, key)
        why = f"on {figures[others][1]}, not {device}" if others is not None else f"for {' or '.join(over)}"
        return {"value": None, "missing": f"no {key} {why}"}
    value = figures[numerator][0][key] / figures[denominator][0][key]
    return {"value": round(value, 3), "figure": key, "of": numerator, "over": denominator}


def summary(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ratios the figures are for, each system at its best (eager or compiled; the package loop eager or with a
    compiled step), and whether compiling pays."""
    figures = recorded_figures(data)
    entries = {}
    for preset in PRESETS:
        ours = [f"{preset}, {OURS}, {mode}" for mode in ("eager", "compiled")]
        marian = [f"{preset}, {MARIAN}, {mode}" for mode in ("eager", "compiled")]
        entries[f"{preset} training tokens/s, hf_vaswani / MarianMT, each at its best"] = summary_entry(
            figures, TRAINING_FIGURE, ours, marian
        )
    entries["big training MFU %, hf_vaswani at its best"] = summary_entry(
        figures, MFU, [f"big, {OURS}, {mode}" for mode in ("eager", "compiled")]
    )
    for preset in PRESETS:
        for system in (OURS, MARIAN):
            entries[f"{preset} training tokens/s, {system}, compiled / eager"] = summary_entry(
                figures, TRAINING_FIGURE, [f"{preset}, {system}, compiled"], [f"{preset}, {system}, eager"]
            )
    entries["base VaswaniTrainer tokens/s, torch_compile / eager"] = summary_entry(
        figures, TRAINING_FIGURE, [f"base, {TRAINER}, torch_compile"], [f"base, {TRAINER}, eager"]
    )
    for batch in data.get("sizes", {}).get("generation batches", []):
        shape = shape_name(batch, 4)
        ours = [f"{shape}, {PACKAGE_LOOP}", f"{shape}, {PACKAGE_LOOP_COMPILED}"]
        others = {
            "CTranslate2 float16": [f"{shape}, CTranslate2 float16"],
            "CTranslate2 int8_float16": [f"{shape}, CTranslate2 int8_float16"],
            "MarianMT at its best": [f"{shape}, {MARIAN}", f"{shape}, {MARIAN_COMPILED}"],
            "transformers' loop": [f"{shape}, {TRANSFORMERS_LOOP}"],
        }
        for other, items in others.items():
            name = f"{shape} tokens/s, hf_vaswani package loop at its best / {other}"
            entries[name] = summary_entry(figures, DECODING_FIGURE, ours, items)
    return entries


# --- Output --------------------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: a header line on the device, the summary, then a table per section."""
    device = data["device"]
    peak = device["dense_bf16_peak_tflops"]
    lines = [
        "# GPU figures",
        "",
        f"{device['name']} ({device['type']}, {device['gpus']} GPUs; dense bf16 peak "
        f"{f'{peak} TFLOP/s' if peak else 'unknown'}); torch {device['torch']}, CUDA {device['cuda']}, transformers "
        f"{device['transformers']}, CTranslate2 {device['ctranslate2']}. {'Tiny sizes. ' if data['tiny'] else ''}"
        f"Time limit {data['time_limit_minutes']} min, {data.get('elapsed_seconds', 0)} s used."
        + (f" Merged from {', '.join(data['merged from'])}." if "merged from" in data else ""),
        "",
        "## Summary",
        "",
        "| figure | value | from |",
        "|---|---|---|",
    ]
    for name, entry in data.get("summary", {}).items():
        if entry["value"] is None:
            lines.append(f"| {name} | n/a | {cell(entry['missing'])} |")
        else:
            source = entry["of"] + (f" / {entry['over']}" if "over" in entry else "")
            lines.append(f"| {name} | {cell(entry['value'])} | {cell(source)} |")
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


UNRUN = ("not selected", "not reached")


def merged_reports(paths: list[Path]) -> dict[str, Any]:
    """One report of several runs' (each device call's): each section from the last report that ran it."""
    reports = [json.loads(path.read_text()) for path in paths]
    data = copy.deepcopy(reports[0])
    for report in reports[1:]:
        for name, entry in report["sections"].items():
            if entry.get("status") not in UNRUN or name not in data["sections"]:
                data["sections"][name] = entry
    data["merged from"] = [str(path) for path in paths]
    data["elapsed_seconds"] = round(sum(report.get("elapsed_seconds", 0) for report in reports), 1)
    return data


# --- Main ----------------------------------------------------------------------------------------------------------


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    sections = "\n".join(f"  {name:<20} {description}" for name, description in SECTIONS.items())
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog=f"sections, in the order a run without --only takes them:\n{sections}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path(os.environ.get("OUT") or "gpu_figures"),
        help="default: $OUT or gpu_figures",
    )
    parser.add_argument("--time-limit", type=float, default=8.0, metavar="MINUTES", help="for the whole run")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        metavar="SECTION",
        help="run this section (repeatable; in the order given); default: every section",
    )
    parser.add_argument(
        "--multi30k", type=Path, metavar="DIR", help="Multi30k's train, val, test_2016_flickr .en/.de.gz"
    )
    parser.add_argument(
        "--multi30k-run",
        type=Path,
        metavar="DIR",
        help="keep the published run's folder here (default: a temporary one); a run stopped there is resumed",
    )
    parser.add_argument(
        "--cublas12-wheel",
        type=Path,
        metavar="PATH",
        help="an nvidia-cublas-cu12 wheel file for CTranslate2 on CUDA, where cuBLAS 12 is not installed (else pip)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a quick check of the script itself")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="measure nothing: join these gpu_figures.json (later ones win a section) into --output-dir",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    if args.merge:
        Report(args.output_dir, merged_reports(args.merge)).save()
        print(f"[gpu_figures] {args.output_dir / 'gpu_figures.json'}", file=sys.stderr)
        return
    started = time.monotonic()
    deadline = started + 60 * args.time_limit
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
    else:
        from hf_vaswani.training.precision import cpu_bf16_matmul_works

        bf16 = cpu_bf16_matmul_works()
    sizes = TINY if args.tiny else FULL
    selected = list(dict.fromkeys(args.only or SECTIONS))
    data = {
        "device": device_description(device),
        "bf16": bf16,
        "tiny": args.tiny,
        "time_limit_minutes": args.time_limit,
        "only": selected if args.only else None,  # the sections run, in this order
        "sizes": {
            "fixed training batch": f"{sizes.train_tokens // sizes.train_length} x {sizes.train_length}",
            "generation batches": list(sizes.generation_batches),
            "source lengths": list(sizes.source_lengths),
            "new tokens": sizes.new_tokens,
        },
        "sections": {name: {"status": "not reached" if name in selected else "not selected"} for name in SECTIONS},
    }
    run = Run(device, sizes, bf16, deadline, Report(args.output_dir, data, started))
    run.report.save()
    bodies: dict[str, Callable[[Section], None]] = {
        "correctness": correctness,
        "training": training,
        "trainer": trainer,
        "generation": generation,
        "ctranslate2": partial(ctranslate2_section, wheel=args.cublas12_wheel),
        "training_compiled": training_compiled,
        "generation_compiled": generation_compiled,
        "multi30k_published": partial(multi30k_published, data=args.multi30k, run_folder=args.multi30k_run),
        "distributed": distributed,
    }
    # The sections before the published Multi30k run leave it the time it takes.
    published = "multi30k_published" in selected and args.multi30k is not None
    reserve_until = selected.index("multi30k_published") if published else 0
    for index, name in enumerate(selected):
        reserve = sizes.multi30k_estimate_s * sizes.time_scale if index < reserve_until else 0.0
        run_section(replace(run, deadline=run.deadline - reserve), name, bodies[name])
    print(
        f"[gpu_figures] {args.output_dir / 'gpu_figures.json'}, {args.output_dir / 'gpu_figures.md'}", file=sys.stderr
    )


if __name__ == "__main__":
    main()
