"""Speed and memory of hf_vaswani against transformers' MarianMTModel and CTranslate2, at identical size, on CPU.

A random hf_vaswani model and the MarianMTModel of the same function (`to_marian`; their logits are compared), and
CTranslate2 converted from that Marian model's folder, in float32 and in int8 (its fastest CPU types; it has no bf16 on
a CPU). Repetitions alternate between systems; medians are reported, and each ratio as the median of its ratios within
a repetition.
Measured: training tokens/s (forward, backward, fused AdamW; hf_vaswani with its trainer's chunked loss), peak RSS
growth over the first two training steps, greedy and beam-search output tokens/s at a forced output length in each
decoding precision (fp32; bf16 weights, where the CPU has AVX512-BF16 or AMX; torch's dynamic int8), hf_vaswani by its
own decoding loop and by transformers', and the fp32 decodings' share of the matmul and roofline bounds. With
--shortlist-size N, hf_vaswani also decodes with a vocabulary shortlist of N tokens and CTranslate2 with the same
tokens as its vocabulary map. Results and their reading: docs/performance.md.

    python scripts/benchmark.py --preset base --repeats 3 --train-steps 2
    python scripts/benchmark.py --preset tiny --repeats 2           # a quick check
    python scripts/benchmark.py --preset base --precisions fp32     # decoding in fp32 only
    python scripts/benchmark.py --preset base --train-dtype bf16    # training under autocast(bfloat16)
    python scripts/benchmark.py --preset base --reuse-freed-memory  # glibc keeps freed memory, as `vaswani` runs
    python scripts/benchmark.py --preset base --torch-compile       # training under torch.compile, both models
    python scripts/benchmark.py --preset base --shortlist-size 2000  # decoding with a shortlist, both engines
    python scripts/benchmark.py --preset base --repeats 3 --train-steps 1 --profile  # where a decoding step's time goes
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import math
import multiprocessing
import platform
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch
from speed_comparison import (
    SEARCH_AS_TRANSFORMERS,
    TrainingStep,
    forced_length,
    model_pair,
    produced_tokens,
    random_tokens,
    time_calls,
    transformers_loop,
)
from transformers import MarianMTModel
from transformers.utils import logging as transformers_logging

import hf_vaswani
from hf_vaswani import VaswaniConfig
from hf_vaswani.decoding.shortlist import Shortlist
from hf_vaswani.kernels.allocator import reuse_freed_memory
from hf_vaswani.kernels.cpu import kernelize, onednn_product, packed_weights
from hf_vaswani.kernels.cpu_features import cpu_bf16_matmul_works, cpu_float_type_problem
from hf_vaswani.kernels.quantization import quantize_int8

PRESETS = {
    "base": {"d_model": 512, "layers": 6, "heads": 8, "ffn": 2048, "vocab": 37000},
    "tiny": {"d_model": 64, "layers": 2, "heads": 4, "ffn": 256, "vocab": 1000},
}
EOS, UNK = 0, 1  # token ids; the pad (and decoder start) token is the last vocabulary entry, as CTranslate2 expects
PRECISIONS = ("fp32", "bf16", "int8")  # of decoding: float32, bfloat16 weights, torch's dynamic int8
CT2_TYPES = {"fp32": "float32", "int8": "int8"}  # CTranslate2's compute type of the same precision; no CPU bf16


def vaswani_system(precision: str) -> str:
    return f"hf_vaswani {precision}"


def marian_system(precision: str) -> str:
    return f"MarianMT {precision}"


def loop_system(precision: str) -> str:
    return f"hf_vaswani {precision}, transformers' loop"


def shortlist_system(precision: str) -> str:
    return f"hf_vaswani {precision} + shortlist"


def ct2_system(compute_type: str, vocabulary_map: bool = False) -> str:
    return f"CTranslate2 {compute_type}" + (" + vocabulary map" if vocabulary_map else "")


def ratio_pairs(precisions: list[str], train_dtype: str) -> list[tuple[str, str]]:
    """The ratios the report gives, where both systems ran: each precision's hf_vaswani against MarianMT in it, against
    CTranslate2 in each type, and against transformers' loop; the shortlist against the full vocabulary and against
    CTranslate2's vocabulary map in the nearest type."""
    pairs = [(vaswani_system(train_dtype), marian_system(train_dtype))]
    for precision in precisions:
        pairs += [(vaswani_system(precision), marian_system(precision))] if precision != train_dtype else []
        pairs += [(vaswani_system(precision), ct2_system(compute_type)) for compute_type in CT2_TYPES.values()]
        pairs += [(vaswani_system(precision), loop_system(precision))]
    for precision in precisions:
        nearest = CT2_TYPES["int8" if precision == "int8" else "fp32"]
        pairs += [
            (shortlist_system(precision), vaswani_system(precision)),
            (shortlist_system(precision), ct2_system(nearest, True)),
        ]
    return pairs + [(ct2_system(compute_type, True), ct2_system(compute_type)) for compute_type in CT2_TYPES.values()]


# Before each timed decoding: CTranslate2's OpenMP runtime (Intel's) keeps its threads spinning for 200 ms after each
# parallel region (KMP_BLOCKTIME), which on a 2-core machine would slow whichever system decodes next
SETTLE_SECONDS = 0.3


def machine_description(threads: int) -> dict[str, str | int]:
    """What a figure depends on: CPU model, the ISA torch's kernels use, threads, and the library versions."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.processor() or "unknown CPU"
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    onednn = re.search(r"MKL-DNN v([\w.]+)", config)
    return {
        "cpu": cpu,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "torch": torch.__version__,
        "mkl": mkl.group(1) if mkl else "none",
        "onednn": onednn.group(1) if onednn else "none",
    }


def measured_matmul_gflops(repeats: int = 5, size: int = 2048) -> dict[str, float]:
    """This CPU's fp32 matmul rate by torch's product (MKL where torch has it) and by oneDNN's (which
    `hf_vaswani.kernels.cpu.product` picks where it is faster), best of `repeats` square products each; the
    faster is the bound's denominator."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    kernels = {"torch": lambda: torch.mm(a, b)}
    if torch.backends.mkldnn.is_available():
        kernels["oneDNN"] = lambda: onednn_product(a, b, None)  # a @ b.T: the same FLOPs
    rates = {}
    for name, kernel in kernels.items():
        kernel()  # warm-up: thread pool, the library's buffers
        rates[name] = 2 * size**3 / min(time_calls(kernel) for _ in range(repeats)) / 1e9
    return rates


def measured_memory_gbps(repeats: int = 5, mib: int = 512) -> float:
    """This machine's memory bandwidth: bytes read plus written by copying `mib` MiB into an already-touched buffer
    (best of `repeats`), the memory bound's denominator."""
    source = torch.ones(mib * 2**18)
    target = torch.zeros_like(source)  # touched, so that no page fault is timed
    best = min(time_calls(lambda: target.copy_(source)) for _ in range(repeats))
    return 2 * source.nbytes / best / 1e9


def decoding_matmul_flops(preset: dict, sentences: int, beams: int, source_length: int, output_length: int) -> float:
    """FLOPs of the matmuls decoding cannot avoid: per hypothesis and step, each decoder layer's projections (q, k, v, o
    of self-attention, q and o of encoder-decoder attention), its two FFN matmuls, the attention products over the
    tokens so far and the source, and the output projection to the vocabulary; plus the encoder-side keys and values
    once per sentence. The encoder itself is left out (the same for every system, and small next to decoding)."""
    d, ffn, layers, vocab = preset["d_model"], preset["ffn"], preset["layers"], preset["vocab"]
    total = 0.0
    for step in range(1, output_length + 1):
        per_hypothesis = layers * (2 * 6 * d * d + 2 * 2 * d * ffn + 2 * 2 * d * (step + source_length)) + 2 * d * vocab
        total += sentences * beams * per_hypothesis
    return total + sentences * layers * 2 * 2 * d * d * source_length


def decoding_weight_bytes(preset: dict, output_length: int) -> float:
    """Bytes decoding cannot avoid reading: every decoder weight matrix and the output projection, fp32, once a step
    (all hypotheses of a step share one pass). At base size that is ~176 MB a step, far more than a CPU's caches
    hold, so few-row steps are bound by memory bandwidth before FLOPs."""
    d, ffn, layers, vocab = preset["d_model"], preset["ffn"], preset["layers"], preset["vocab"]
    return output_length * 4 * (layers * (8 * d * d + 2 * d * ffn) + d * vocab)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="training sentences per batch")
    parser.add_argument("--decode-batch-size", type=int, default=8, help="sentences per generate call")
    parser.add_argument("--source-length", type=int, default=24, help="tokens per source (and training target)")
    parser.add_argument("--output-length", type=int, default=24, help="forced number of generated tokens")
    parser.add_argument("--train-steps", type=int, default=3, help="optimizer steps per timed training repetition")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--train-dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: under autocast")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        help="the decoding precisions measured (default: all, bf16 where this CPU has instructions for it)",
    )
    parser.add_argument("--no-ct2", action="store_true", help="skip CTranslate2 even when installed")
    parser.add_argument(
        "--reuse-freed-memory",
        action="store_true",
        help="glibc keeps freed memory for reuse (hf_vaswani.kernels.allocator, as `vaswani` commands run) in this "
        "process, so for both PyTorch systems",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="train both PyTorch models under torch.compile (inductor), as TrainingArguments(torch_compile=True) "
        "does through accelerate; the compilation falls in the first steps, so the peak RSS includes it",
    )
    parser.add_argument(
        "--shortlist-size",
        type=int,
        default=0,
        help="also decode with a vocabulary shortlist of this many tokens (random ones: the speed depends on the "
        "size only), hf_vaswani's search with them as its shortlist and CTranslate2 with them as its vocabulary map",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timings, split a decoding step of each PyTorch decoding into products, vocabulary-sized "
        "passes, attention, other operators and Python (torch.profiler over one more call each, which it slows)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("benchmark_results"))
    return parser.parse_args()


def build_models(preset: dict, seed: int) -> tuple[MarianMTModel, torch.nn.Module]:
    """The pair of `preset`'s size with an OPUS-MT model's special ids and output bias, hf_vaswani's with the package's
    CPU kernels (as the package builds and loads its models)."""
    vocab = preset["vocab"]
    config = VaswaniConfig(
        vocab_size=vocab,
        d_model=preset["d_model"],
        d_ff=preset["ffn"],
        num_heads=preset["heads"],
        encoder_layers=preset["layers"],
        decoder_layers=preset["layers"],
        output_bias=True,
        initialization="fairseq",  # a zero <pad> embedding, from which CTranslate2 starts Marian's decoder
        pad_token_id=vocab - 1,
        bos_token_id=None,
        eos_token_id=EOS,
        decoder_start_token_id=vocab - 1,
    )
    vaswani, marian = model_pair(config, seed)
    for model in (vaswani, marian):  # as OPUS-MT; CTranslate2 drops <pad> anyway
        model.generation_config.bad_words_ids = [[config.pad_token_id]]
    return marian, kernelize(vaswani)


def random_source(batch: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Ordinary tokens (neither eos, unk nor pad) ending with </s>, as Marian tokenizers produce."""
    return random_tokens(generator, batch, length, vocab - 1, words_start=2, eos=EOS)


def max_logit_difference(marian: MarianMTModel, vaswani: torch.nn.Module, source: torch.Tensor) -> float:
    target = source.roll(1, dims=1)
    with torch.no_grad():
        ours = vaswani(input_ids=source, decoder_input_ids=target).logits
        theirs = marian(input_ids=source, decoder_input_ids=target).logits
    return (ours - theirs).abs().max().item()


def trim_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Highest resident set size above the starting one while the block runs, sampled every 5 ms."""

    def __enter__(self) -> PeakRSS:
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.delta_mib = (self.peak - self.start) / 2**20


class TrainingRun:
    """A training copy of a model and its training step (fused AdamW: Seq2SeqTrainer's default optimizer for MarianMT,
    and what paper_training_arguments asks for), kept across repetitions as in one training process."""

    def __init__(self, model: torch.nn.Module, batch: dict, dtype: str, compiled: bool) -> None:
        # accelerate's TorchDynamoPlugin compiles the model with the default backend and dynamic=None: options {}
        self.step = TrainingStep(  # a copy: the decoding models stay untouched
            copy.deepcopy(model), batch, bf16=dtype == "bf16", compile_options={} if compiled else None
        )

    def first_steps(self, steps: int = 2) -> float:
        """Peak RSS growth (MiB) over the first steps: optimizer state, gradients and activations."""
        trim_memory()
        with PeakRSS() as memory:
            for _ in range(steps):
                self.step()
        return memory.delta_mib

    def tokens_per_second(self, steps: int) -> float:
        return self.step.tokens / time_calls(self.step, repeats=steps)


def generate_run(
    model: torch.nn.Module, source: torch.Tensor, beams: int, length: int, search: Callable = transformers_loop, **extra
) -> float:
    """Output tokens/s of `search` (`hf_vaswani.generate` or `transformers_loop`) forced to `length` new tokens per
    sentence."""
    start = time.perf_counter()
    with torch.inference_mode():
        output = search(
            model,
            input_ids=source,
            attention_mask=torch.ones_like(source),
            num_beams=beams,
            do_sample=False,
            length_penalty=1.0,
            **forced_length(length),
            **extra,
        )
    seconds = time.perf_counter() - start
    return source.shape[0] * produced_tokens(output, length, type(model).__name__) / seconds


PRODUCTS = {"mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::addmm", "aten::mm", "quantized::linear_dynamic"}
# the operators of kernels/cpu.py's few_query_attention, attention's only in this model (log_softmax is
# aten::_log_softmax)
FEW_QUERY_ATTENTION = {"aten::bmm", "aten::_softmax", "aten::nan_to_num"}
STEP_PARTS = ("products", "vocabulary passes", "attention", "other operators", "Python and dispatch")


def step_profile(model: torch.nn.Module, source: torch.Tensor, beams: int, length: int, **extra) -> dict[str, float]:
    """Milliseconds a decoding step spends in each of STEP_PARTS, from torch.profiler over one `generate` call (which
    the profiler slows: its own cost per operator lands in the operators' times and the rest), the encoder's side left
    out (products of the source's sentences x length rows, once a call). A vocabulary-sized pass is an operator other
    than a product with an operand whose last dimension is a multiple of the scored columns (the vocabulary or a
    shortlist's, times the beams where a loop flattens them); Python and dispatch is the call's time not spent in
    operators."""
    from torch.profiler import profile

    with profile(record_shapes=True) as profiled:
        seconds_a_call = time_calls(partial(generate_run, model, source, beams, length, **extra))
    encoder_rows = source.numel()
    columns = {model.config.vocab_size}
    if extra.get("shortlist") is not None:  # the listed tokens and </s>
        columns.add(torch.cat((extra["shortlist"].columns(source), torch.tensor([EOS]))).unique().numel())
    totals = dict.fromkeys(STEP_PARTS, 0.0)
    encoder = 0.0
    for event in profiled.key_averages(group_by_input_shape=True):
        shapes = [shape for shape in event.input_shapes if isinstance(shape, list) and shape]
        milliseconds = event.self_cpu_time_total / 1e3
        if event.key in PRODUCTS and math.prod(shapes[0][:-1]) == encoder_rows:
            encoder += milliseconds
        elif event.key in PRODUCTS:
            totals["products"] += milliseconds
        elif any(shape[-1] >= min(columns) and shape[-1] % column == 0 for shape in shapes for column in columns):
            totals["vocabulary passes"] += milliseconds
        elif "attention" in event.key or event.key in FEW_QUERY_ATTENTION:
            totals["attention"] += milliseconds
        else:
            totals["other operators"] += milliseconds
    step = (1e3 * seconds_a_call - encoder) / length
    parts = {part: value / length for part, value in totals.items()}
    parts["Python and dispatch"] = step - sum(parts.values())
    return {"step": step, **parts}


def ct2_serve(
    connection, marian_dir: str, vocab: int, compute_types: list[str], threads: int, vocabulary_map: list[int]
) -> None:
    """CTranslate2 in a process of its own, so that its OpenMP runtime (Intel's) and torch's (GNU) never share one:
    loaded together they slow PyTorch down. Converts the saved Marian folder (with `vocabulary_map`'s token ids, if
    any, as the vocabulary map's always-listed tokens), loads it in each of `compute_types` (sending back the types it
    could not load, with the reason), then answers decoding requests."""
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        connection.send("not installed; `pip install ctranslate2`")
        return
    tokens = {"</s>": EOS, "<unk>": UNK, "<pad>": vocab - 1} | {f"t{i}": i for i in range(2, vocab - 1)}

    class NoTokenizerConverter(TransformersConverter):
        # The converter reads only the vocabulary and the eos/unk tokens from a tokenizer; a random model has none.
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return SimpleNamespace(get_vocab=lambda: tokens, eos_token="</s>", unk_token="<unk>")

    output_dir = str(Path(marian_dir).parent / "ct2")

    def token(i: int) -> str:
        return "</s>" if i == EOS else f"t{i}"

    vmap = None
    if vocabulary_map:  # hf_vaswani.decoding.shortlist's writer would import torch into this process: written here
        vmap = Path(marian_dir).parent / "vmap.txt"
        vmap.write_text("\t" + " ".join(map(token, vocabulary_map)) + "\n")
    NoTokenizerConverter(marian_dir).convert(output_dir, vmap=vmap and str(vmap), force=True)
    translators, refused = {}, {}
    for compute_type in compute_types:
        try:
            translators[compute_type] = ctranslate2.Translator(
                output_dir, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
            )
        except ValueError as error:
            refused[compute_type] = str(error)
    connection.send(refused)
    while (request := connection.recv()) is not None:
        compute_type, rows, beams, length, use_vmap = request
        batch = [[token(i) for i in row] for row in rows]
        start = time.perf_counter()
        results = translators[compute_type].translate_batch(
            batch,
            beam_size=beams,
            min_decoding_length=length,
            max_decoding_length=length,
            length_penalty=1.0,
            use_vmap=use_vmap,
        )
        seconds = time.perf_counter() - start
        ids = [[EOS if token == "</s>" else int(token[1:]) for token in result.hypotheses[0]] for result in results]
        connection.send((seconds, ids))


class CTranslate2Process:
    """Client of `ct2_serve`; `compute_types` are those it loaded (the others' reasons printed), none when CTranslate2
    cannot run here."""

    def __init__(
        self, marian: MarianMTModel, vocab: int, threads: int, workdir: Path, vocabulary_map: list[int]
    ) -> None:
        marian.save_pretrained(workdir / "marian")
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=ct2_serve,
            args=(child, str(workdir / "marian"), vocab, list(CT2_TYPES.values()), threads, vocabulary_map),
            daemon=True,
        )
        self.process.start()
        status = self.connection.recv()
        if isinstance(status, str):  # not installed
            status = dict.fromkeys(CT2_TYPES.values(), status)
        for compute_type, reason in status.items():
            print(f"CTranslate2 {compute_type}: skipped ({reason})")
        self.compute_types = [compute_type for compute_type in CT2_TYPES.values() if compute_type not in status]

    def decode(
        self, compute_type: str, source: torch.Tensor, beams: int, length: int, use_vmap: bool = False
    ) -> tuple[float, list[list[int]]]:
        """Output tokens/s and the best hypotheses' ids, checked to have `length` tokens each."""
        self.connection.send((compute_type, source.tolist(), beams, length, use_vmap))
        seconds, ids = self.connection.recv()
        if {len(row) for row in ids} != {length}:
            raise RuntimeError(f"CTranslate2 generated {sorted({len(row) for row in ids})} tokens instead of {length}")
        return len(ids) * length / seconds, ids

    def close(self) -> None:
        self.connection.send(None)
        self.process.join()


def greedy_agreement(
    decode_models: dict, translator: CTranslate2Process | None, source: torch.Tensor, length: int, extras: dict
) -> None:
    """Print the fraction of greedy output tokens each system shares with MarianMT in fp32 (the same function: close
    to 1 in fp32, lower in the reduced precisions, whose rounding changes near ties)."""
    outputs = {}
    with torch.inference_mode():
        for name, model in decode_models.items():
            options = dict(extras[name])
            ids = options.pop("search", transformers_loop)(
                model, input_ids=source, num_beams=1, do_sample=False, **forced_length(length), **options
            )
            outputs[name] = ids[:, 1:].tolist()
    for compute_type in translator.compute_types if translator else []:
        outputs[ct2_system(compute_type)] = translator.decode(compute_type, source, 1, length)[1]
    reference = torch.tensor(outputs[marian_system("fp32")])
    for name, ids in outputs.items():
        if name != marian_system("fp32"):
            same = (torch.tensor(ids) == reference).float().mean().item()
            print(f"greedy tokens equal to MarianMT fp32's: {name} {same:.1%}")


def write_outputs(
    samples: dict[str, dict[str, list[float]]],
    systems: list[str],
    pairs: list[tuple[str, str]],
    meta: dict,
    output_dir: Path,
    profiles: dict[str, dict[str, float]],
) -> str:
    """benchmark.json, .md and .png: each metric's median per system (a row a system), and the ratios of `pairs`
    measured in both (a row a pair)."""
    results = {
        metric: {s: statistics.median(values[s]) if values.get(s) else None for s in systems}
        for metric, values in samples.items()
    }
    rated = {metric: values for metric, values in samples.items() if "bound" not in metric}  # bounds: same ratios
    ratios = {
        f"{a} / {b}": {metric: paired_ratio(values.get(a, []), values.get(b, [])) for metric, values in rated.items()}
        for a, b in pairs
    }
    ratios = {pair: values for pair, values in ratios.items() if any(value is not None for value in values.values())}
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {"meta": meta, "results": results, "ratios": ratios}
    written |= {"ms a decoding step": profiles} if profiles else {}
    (output_dir / "benchmark.json").write_text(json.dumps(written, indent=2) + "\n")

    def table(corner: str, metrics: list[str], rows: dict[str, dict[str, float | None]], digits: int) -> list[str]:
        lines = ["| " + " | ".join([corner, *metrics]) + " |", "|" + "---|" * (len(metrics) + 1)]
        for row, values in rows.items():
            cells = [f"{values[m]:.{digits}f}" if values.get(m) is not None else "" for m in metrics]
            lines.append("| " + " | ".join([row, *cells]) + " |")
        return lines

    by_system = {system: {metric: results[metric][system] for metric in samples} for system in systems}
    lines = table("system", list(samples), by_system, 1) + [""] + table("ratio", list(rated), ratios, 2)
    settings = ", ".join(f"{key}={value}" for key, value in meta.items())
    if profiles:
        parts = list(next(iter(profiles.values())))
        lines += ["", "| ms a decoding step | " + " | ".join(parts) + " |", "|" + "---|" * (len(parts) + 1)]
        lines += [f"| {name} | " + " | ".join(f"{ms:.1f}" for ms in p.values()) + " |" for name, p in profiles.items()]
    report = "\n".join(lines)
    (output_dir / "benchmark.md").write_text(f"# Benchmark\n\n{settings}\n\n{report}\n")
    plot(results, output_dir / "benchmark.png")
    return report


def paired_ratio(ours: list[float], other: list[float]) -> float | None:
    """The median over repeats of ours / other within each repeat: a repeat runs every system within seconds, so
    drift in the machine's speed over a run (its neighbours' load) cancels, where a ratio of medians would keep it."""
    if not ours or len(ours) != len(other) or not all(other):
        return None
    return statistics.median(a / b for a, b in zip(ours, other, strict=True))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.5))
    for axis, (metric, values) in zip(axes if len(results) > 1 else [axes], results.items(), strict=True):
        names = [name for name, value in values.items() if value is not None]
        axis.bar(names, [values[name] for name in names], color=[f"C{i}" for i in range(len(names))])
        axis.set_title(metric, fontsize=9)
        axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def decoding_copy(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """`model` as it decodes in `precision`: itself (fp32), a bfloat16 copy, or torch's dynamic int8 copy."""
    if precision == "int8":
        return quantize_int8(model)
    return copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else model


def main() -> None:
    args = parse_args()
    transformers_logging.disable_progress_bar()
    bf16_problem = cpu_float_type_problem(torch.bfloat16)
    precisions = args.precisions or [p for p in PRECISIONS if p != "bf16" or bf16_problem is None]
    if bf16_problem and "bf16" in precisions:
        raise SystemExit(f"bf16 decoding: {bf16_problem}")
    if args.train_dtype == "bf16" and not cpu_bf16_matmul_works():  # emulated bf16 trains, as `vaswani train --bf16`
        raise SystemExit(
            "--train-dtype bf16: a bfloat16 matmul crashes this machine (illegal instruction: AMX advertised, not "
            "enabled); run with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 to use AVX-512 BF16 instead"
        )
    if args.reuse_freed_memory and not reuse_freed_memory():
        raise SystemExit("--reuse-freed-memory: the C library is not glibc")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    rates = measured_matmul_gflops()
    gflops = max(rates.values())
    listed = ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items())
    print(f"fp32 matmul rate (2048x2048 products, best of 5): {gflops:.0f} GFLOP/s ({listed})")
    gbps = measured_memory_gbps()
    print(f"memory bandwidth (512 MiB copies, read + write, best of 5): {gbps:.1f} GB/s")
    preset = PRESETS[args.preset]
    generator = torch.Generator().manual_seed(args.seed)
    marian, vaswani = build_models(preset, args.seed)
    vocab = preset["vocab"]

    check = random_source(4, args.source_length, vocab, generator)
    print(f"max |logits(hf_vaswani) - logits(MarianMT)| = {max_logit_difference(marian, vaswani, check):.3e}")

    source = random_source(args.batch_size, args.source_length, vocab, generator)
    train_batch = {
        "input_ids": source,
        "attention_mask": torch.ones_like(source),
        "labels": random_source(args.batch_size, args.source_length, vocab, generator),
    }
    decode_source = random_source(args.decode_batch_size, args.source_length, vocab, generator)

    listed = []  # the shortlist's tokens, </s> among them
    if args.shortlist_size:
        listed = sorted({EOS, *torch.randperm(vocab, generator=generator)[: args.shortlist_size].tolist()})
    translator = None
    if not args.no_ct2:
        with tempfile.TemporaryDirectory() as workdir:
            translator = CTranslate2Process(marian, vocab, args.threads, Path(workdir), listed)
    ct2_systems = {  # name: (compute type, with the vocabulary map)
        ct2_system(compute_type, use_vmap): (compute_type, use_vmap)
        for compute_type in (translator.compute_types if translator else [])
        for use_vmap in ([False, True] if listed else [False])
    }
    print(f"CTranslate2: {', '.join(ct2_systems) or 'not used'}")

    trained = {vaswani_system(args.train_dtype): vaswani, marian_system(args.train_dtype): marian}
    runs = {
        name: TrainingRun(model, train_batch, args.train_dtype, args.torch_compile) for name, model in trained.items()
    }
    memory = {name: [run.first_steps()] for name, run in runs.items()}  # also the warm-up
    for name, mib in memory.items():
        print(f"train  {name:12s} peak RSS growth over the first 2 steps: +{mib[0]:.0f} MiB")
    speed: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, run in runs.items():
            speed[name].append(run.tokens_per_second(args.train_steps))
            print(f"train  repeat {repeat} {name:12s} {speed[name][-1]:9.1f} tok/s")
    del runs
    trim_memory()

    # each precision's copies of both models (int8 quantized the same way for both); transformers' loop and the
    # shortlist decode hf_vaswani's copy
    search = SEARCH_AS_TRANSFORMERS | {"search": hf_vaswani.generate}
    decode_models, extras = {}, {}
    for precision in precisions:
        ours = decoding_copy(vaswani, precision)
        decode_models |= {vaswani_system(precision): ours, marian_system(precision): decoding_copy(marian, precision)}
        decode_models[loop_system(precision)] = ours
        extras |= {vaswani_system(precision): search, marian_system(precision): {}}
        extras[loop_system(precision)] = SEARCH_AS_TRANSFORMERS
        if listed:
            decode_models[shortlist_system(precision)] = ours
            shortlist = Shortlist(torch.tensor(listed), torch.full((vocab, 1), -1))
            extras[shortlist_system(precision)] = search | {"shortlist": shortlist}
    greedy_agreement(decode_models, translator, decode_source, args.output_length, extras)
    # hf_vaswani decodes as `translate` does, its decoding weights packed once for the loop of generate calls (as
    # CTranslate2 holds its converted model); that one packing is timed apart
    packing = ExitStack()
    start = time.perf_counter()
    for model in decode_models.values():
        packing.enter_context(packed_weights(model))
    print(f"decoding weights packed once for all generate calls: {1e3 * (time.perf_counter() - start):.0f} ms")
    decoding: dict[str, dict[str, list[float]]] = {}
    for beams in (1, args.beam_size):
        label = "greedy" if beams == 1 else f"beam-{beams}"
        decoding[label] = {name: [] for name in [*decode_models, *ct2_systems]}
        for name, model in decode_models.items():  # untimed warm-up
            generate_run(model, decode_source[:1], beams, 2, **extras[name])
        for compute_type, _ in ct2_systems.values():
            translator.decode(compute_type, decode_source[:1], beams, 2)
        for repeat in range(args.repeats):
            for name, model in decode_models.items():
                time.sleep(SETTLE_SECONDS)
                value = generate_run(model, decode_source, beams, args.output_length, **extras[name])
                decoding[label][name].append(value)
                print(f"{label:7s} repeat {repeat} {name:12s} {value:9.1f} tok/s")
            for name, (compute_type, use_vmap) in ct2_systems.items():
                time.sleep(SETTLE_SECONDS)
                value = translator.decode(compute_type, decode_source, beams, args.output_length, use_vmap)[0]
                decoding[label][name].append(value)
                print(f"{label:7s} repeat {repeat} {name:12s} {value:9.1f} tok/s")

    profiles = {}
    if args.profile:
        for label in decoding:
            beams = 1 if label == "greedy" else args.beam_size
            for name, model in decode_models.items():
                profile = step_profile(model, decode_source, beams, args.output_length, **extras[name])
                profiles[f"{label}, {name}"] = profile
                listed = ", ".join(f"{part} {value:.1f}" for part, value in profile.items())
                print(f"ms a step, {label:7s} {name:12s} {listed}")
    packing.close()
    if translator is not None:
        translator.close()
    systems = list(dict.fromkeys([*trained, *decode_models, *ct2_systems]))

    # every metric's values per system, one a repetition (memory: one, over the first steps); the table gives medians
    samples: dict[str, dict[str, list[float]]] = {"train tokens/s": speed, "train peak RSS growth (MiB)": memory}
    samples |= {f"{label} output tokens/s": values for label, values in decoding.items()}
    fp32_systems = [name for name in systems if " fp32" in name or " float32" in name]
    # the bounds are fp32 work at the measured fp32 rate and bandwidth: given for the fp32 decodings
    for label, values in decoding.items():
        beams = 1 if label == "greedy" else args.beam_size
        flops = decoding_matmul_flops(preset, args.decode_batch_size, beams, args.source_length, args.output_length)
        weight_bytes = decoding_weight_bytes(preset, args.output_length)
        matmul_seconds, read_seconds = flops / (gflops * 1e9), weight_bytes / (gbps * 1e9)
        # the roofline: the matmul FLOPs at the measured rate or the weights read at the measured bandwidth,
        # whichever takes longer
        bounds = {
            "matmul": (matmul_seconds, f"{flops / 1e9:.1f} GFLOP"),
            "roofline": (max(matmul_seconds, read_seconds), f"{weight_bytes / 1e9:.1f} GB read"),
        }
        for kind, (seconds, work) in bounds.items():
            bound = args.decode_batch_size * args.output_length / seconds
            print(f"{label}: the fp32 {kind} bound is {bound:.0f} output tokens/s ({work})")
            samples[f"{label} % of fp32 {kind} bound"] = {
                name: [100 * value / bound for value in repeats]
                for name, repeats in values.items()
                if name in fp32_systems
            }
    meta = {
        **machine,
        "fp32 GFLOP/s": round(gflops),
        **{f"fp32 GFLOP/s, {name}": round(rate) for name, rate in rates.items()},
        "memory GB/s": round(gbps, 1),
        "preset": args.preset,
        **preset,
        "training dtype": args.train_dtype,
        "decoding precisions": " ".join(precisions),
        "freed memory reused": args.reuse_freed_memory,
        "training compiled": args.torch_compile,
        "train batch": f"{args.batch_size}x{args.source_length}+{args.source_length}",
        "train steps": args.train_steps,
        "decode batch": args.decode_batch_size,
        "output length": args.output_length,
        "repeats": args.repeats,
    }
    pairs = ratio_pairs(precisions, args.train_dtype)
    print(write_outputs(samples, systems, pairs, meta, args.output_dir, profiles))
    print(f"wrote {args.output_dir}/benchmark.json, benchmark.md, benchmark.png")


if __name__ == "__main__":
    main()
