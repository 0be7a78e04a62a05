"""Serving throughput and latency of `vaswani serve` beside CTranslate2 behind the same HTTP layer, on CPU.

A random model (Table 3 base by default) with a word-level tokenizer is saved as a model folder whose generation config
forces every output to --output-length tokens (beam 4, length penalty 0.6 in transformers' and CTranslate2's form), and
exported to CTranslate2 (`hf_vaswani.interop.export.write_ctranslate2`). Each server is a process of its own on
127.0.0.1: `vaswani serve` (requests batched together by its batcher), and CTranslate2 served by the same application
(`hf_vaswani.serving.app`) with `translate_batch` called for each request from a thread pool, once for each
inter_threads x intra_threads split of --threads (its best split is reported). Both decode in the same precision: fp32,
or int8 with --int8 (torch's dynamic int8; CTranslate2's int8). Closed-loop clients in this process send
single-sentence LibreTranslate JSON requests of --source-length tokens (about a Multi30k English sentence), at each
concurrency: throughput in sentences/s, p50 and p99 latency. Every answer is checked to hold the forced length.

    python scripts/serve_benchmark.py --threads 2                 # fp32, base size, concurrency 1, 4, 16, 64
    python scripts/serve_benchmark.py --threads 2 --int8          # int8
    python scripts/serve_benchmark.py --threads 2 --processes 2   # two 1-thread servers, clients spread over both
    python scripts/serve_benchmark.py --preset tiny --requests 24 --concurrency 1 4   # a quick check

The clients share the CPU with the server measured, the same for both systems. Results: docs/performance.md (Serving).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import httpx
import torch
from speed_comparison import FIRST_WORD, SEARCH_AS_TRANSFORMERS, forced_length, word_tokenizer

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, save_model_folder
from hf_vaswani.interop.export import write_ctranslate2
from hf_vaswani.machine import cpu_model_name
from hf_vaswani.model.generation_vaswani import paper_generation_config
from hf_vaswani.serving.batcher import Decoded

PRESETS = {
    "base": lambda vocab: VaswaniConfig.base(vocab_size=vocab),
    "tiny": lambda vocab: VaswaniConfig(
        vocab_size=vocab, d_model=64, d_ff=256, num_heads=4, d_k=16, d_v=16, encoder_layers=2, decoder_layers=2
    ),
}
BEAMS, LENGTH_PENALTY = 4, 0.6
STARTUP_SECONDS = 600  # loading the model and torch's or CTranslate2's first calls
REQUEST_SECONDS = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary size of the random model")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (torch's; CTranslate2's split)")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="`vaswani serve` processes sharing --threads, the clients spread over them in turn (as a load balancer "
        "would spread them); CTranslate2 as before",
    )
    parser.add_argument("--int8", action="store_true", help="both systems in int8 (default: fp32)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], help="clients at once")
    parser.add_argument("--requests", type=int, default=400, help="timed requests at each concurrency")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests per client before them")
    parser.add_argument("--source-length", type=int, default=13, help="source tokens of a sentence, </s> included")
    parser.add_argument("--output-length", type=int, default=14, help="forced output tokens of a sentence")
    parser.add_argument("--output", type=Path, default=Path("serve_benchmark.json"))
    # The CTranslate2 server, run by this script in a process of its own
    parser.add_argument("--serve-ctranslate2", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--inter-threads", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class CTranslate2Service:
    """The serving application's translation service, by CTranslate2: each request's sentences one `translate_batch`
    call from a pool of `inter_threads` threads, as a web app around CTranslate2 serves; no batching across requests."""

    def __init__(self, folder: Path, compute_type: str, inter_threads: int, intra_threads: int, output_length: int):
        import ctranslate2
        from transformers import PreTrainedTokenizerFast

        self.translator = ctranslate2.Translator(
            str(folder),
            device="cpu",
            compute_type=compute_type,
            inter_threads=inter_threads,
            intra_threads=intra_threads,
        )
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        self.pool = ThreadPoolExecutor(inter_threads)
        self.output_length = output_length
        self.queued_sentences = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.pool.shutdown()

    async def translate(self, sentences: list[str], nbest: int = 1) -> Decoded:
        tokens = [self.tokenizer.convert_ids_to_tokens(ids) for ids in self.tokenizer(sentences)["input_ids"]]
        decode = partial(
            self.translator.translate_batch,
            tokens,
            beam_size=BEAMS,
            num_hypotheses=nbest,
            length_penalty=LENGTH_PENALTY,
            min_decoding_length=self.output_length,
            max_decoding_length=self.output_length,
        )
        started = time.perf_counter()
        results = await asyncio.get_running_loop().run_in_executor(self.pool, decode)
        texts = [
            [self.tokenizer.convert_tokens_to_string(tokens) for tokens in result.hypotheses] for result in results
        ]
        return Decoded(texts, 0.0, time.perf_counter() - started)


def serve_ctranslate2(args: argparse.Namespace) -> None:
    from hf_vaswani.serving.app import create_app
    from hf_vaswani.serving.languages import LanguagePair
    from hf_vaswani.serving.server import listening_socket, serve
    from hf_vaswani.serving.settings import ServingSettings

    intra_threads = args.threads // args.inter_threads
    compute_type = "int8" if args.int8 else "float32"
    service = CTranslate2Service(
        args.serve_ctranslate2, compute_type, args.inter_threads, intra_threads, args.output_length
    )
    settings = ServingSettings()
    serve(create_app(service, LanguagePair("en", "de"), settings), listening_socket("127.0.0.1", 0))


def write_models(args: argparse.Namespace, workdir: Path) -> tuple[Path, Path]:
    """The random model as a model folder decoding to the forced length, and its CTranslate2 export."""
    config = PRESETS[args.preset](args.vocab)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).eval()
    model.generation_config = paper_generation_config(
        config,
        num_beams=BEAMS,
        length_penalty=LENGTH_PENALTY,
        **SEARCH_AS_TRANSFORMERS,
        **forced_length(args.output_length),
    )
    tokenizer = word_tokenizer(args.vocab)
    save_model_folder(model, tokenizer, workdir / "model")
    write_ctranslate2(model, tokenizer, workdir / "ctranslate2")
    return workdir / "model", workdir / "ctranslate2"


def sentences(args: argparse.Namespace, count: int) -> list[str]:
    """`count` random sentences of --source-length tokens: made-up words and </s>, as the tokenizer reads them."""
    generator = torch.Generator().manual_seed(1)
    words = torch.randint(FIRST_WORD, args.vocab, (count, args.source_length - 1), generator=generator)
    return [" ".join(f"w{i}" for i in row) + " </s>" for row in words.tolist()]


@dataclass(frozen=True)
class Measurement:
    concurrency: int
    sentences_per_second: float
    p50_ms: float
    p99_ms: float


async def load(urls: list[str], texts: list[str], concurrency: int, warmup: int, output_length: int) -> Measurement:
    """`concurrency` clients sending one sentence a request, each as soon as its last is answered, client i to server
    i mod len(urls): `warmup` requests each untimed, then `texts` between them, timed."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_SECONDS) as client:

        async def translate(url: str, text: str) -> float:
            started = time.perf_counter()
            response = await client.post(f"{url}/translate", json={"q": text, "source": "en", "target": "de"})
            seconds = time.perf_counter() - started
            response.raise_for_status()
            words = len(response.json()["translatedText"].split())
            if not output_length - 1 <= words <= output_length:  # the forced length; a final </s> is not text
                raise RuntimeError(f"{url} answered {words} words, not the forced {output_length} tokens")
            return seconds

        async def client_loop(url: str, queue: list[str], record: bool) -> None:
            while queue:
                seconds = await translate(url, queue.pop())
                if record:
                    latencies.append(seconds)

        clients = [urls[i % len(urls)] for i in range(concurrency)]
        await asyncio.gather(*(client_loop(url, texts[:warmup], False) for url in clients))
        remaining = list(texts)
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(url, remaining, True) for url in clients))
        seconds = time.perf_counter() - started
    percentiles = statistics.quantiles(latencies, n=100, method="inclusive")
    return Measurement(concurrency, len(latencies) / seconds, percentiles[49] * 1000, percentiles[98] * 1000)


def started_server(command: list[str], environment: dict[str, str], log: Path) -> tuple[subprocess.Popen, str]:
    """A server process and its address, once it answers /health."""
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=output, env=environment)
    deadline = time.monotonic() + STARTUP_SECONDS
    while not (listening := re.search(r"serving on (http://127\.0\.0\.1:\d+)", log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{shlex.join(command)} did not start:\n{log.read_text()}")
        time.sleep(0.1)
    url = listening.group(1)
    httpx.get(f"{url}/health", timeout=STARTUP_SECONDS).raise_for_status()
    return process, url


def measured(
    command: list[str], environment: dict[str, str], log: Path, args: argparse.Namespace, processes: int = 1
) -> list[Measurement]:
    """Each concurrency's figures of `processes` servers run by `command` (each logging to `log` numbered)."""
    servers = [started_server(command, environment, log.with_suffix(f".{i}.log")) for i in range(processes)]
    urls = [url for _, url in servers]
    try:
        results = []
        for concurrency in args.concurrency:
            results.append(
                asyncio.run(load(urls, sentences(args, args.requests), concurrency, args.warmup, args.output_length))
            )
            print(f"  {results[-1]}", flush=True)
        return results
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(STARTUP_SECONDS)


def table(systems: dict[str, list[Measurement]], best_split: list[tuple[str, Measurement]]) -> str:
    lines = [
        "| concurrency | hf_vaswani sentences/s | p50 ms | p99 ms | CTranslate2 sentences/s (inter x intra) | p50 ms "
        "| p99 ms | hf_vaswani / CTranslate2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ours, (split, theirs) in zip(systems["hf_vaswani"], best_split, strict=True):
        lines.append(
            f"| {ours.concurrency} | {ours.sentences_per_second:.1f} | {ours.p50_ms:.0f} | {ours.p99_ms:.0f} "
            f"| {theirs.sentences_per_second:.1f} ({split}) | {theirs.p50_ms:.0f} | {theirs.p99_ms:.0f} "
            f"| {ours.sentences_per_second / theirs.sentences_per_second:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.serve_ctranslate2:
        serve_ctranslate2(args)
        return
    if args.processes < 1 or args.threads % args.processes:
        raise SystemExit(f"--processes must divide --threads ({args.threads}), got {args.processes}")
    command_line = shlex.join([sys.executable, *sys.argv])
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        model_folder, ct2_folder = write_models(args, workdir)
        precision = ["--int8"] if args.int8 else []
        systems: dict[str, list[Measurement]] = {}
        print(f"hf_vaswani (vaswani serve, {args.processes} x {args.threads // args.processes} threads)", flush=True)
        command = [sys.executable, "-m", "hf_vaswani.cli", "serve", str(model_folder), "--port", "0", "--device", "cpu"]
        systems["hf_vaswani"] = measured(
            [*command, "--source-lang", "en", "--target-lang", "de", *precision],
            {**environment, "OMP_NUM_THREADS": str(args.threads // args.processes)},
            workdir / "ours.log",
            args,
            args.processes,
        )
        for inter_threads in (i for i in range(1, args.threads + 1) if args.threads % i == 0):
            split = f"{inter_threads} x {args.threads // inter_threads}"
            print(f"CTranslate2, inter_threads x intra_threads {split}", flush=True)
            ct2 = [sys.executable, __file__, "--serve-ctranslate2", str(ct2_folder), "--threads", str(args.threads)]
            options = ["--inter-threads", str(inter_threads), "--output-length", str(args.output_length), *precision]
            systems[f"CTranslate2 {split}"] = measured([*ct2, *options], environment, workdir / "ct2.log", args)
    splits = [name for name in systems if name != "hf_vaswani"]
    best_split = [
        max(
            ((name.removeprefix("CTranslate2 "), systems[name][i]) for name in splits),
            key=lambda pair: pair[1].sentences_per_second,
        )
        for i in range(len(args.concurrency))
    ]
    report = {
        "command": command_line,
        "cpu": cpu_model_name(),
        "threads": args.threads,
        "processes": args.processes,
        "precision": "int8" if args.int8 else "fp32",
        "settings": {key: str(value) for key, value in vars(args).items()},
        "results": {name: [asdict(measurement) for measurement in results] for name, results in systems.items()},
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{cpu_model_name()}, {args.threads} threads, {report['precision']}: {command_line}\n")
    print(table(systems, best_split))
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
