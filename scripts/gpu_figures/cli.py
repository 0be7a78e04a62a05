"""The command line of scripts/gpu_figures.py: the sections in the order a run takes them, each run or skipped within
the time limit, or --merge of several runs' reports."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from . import correctness, ctranslate2, distributed, generation, multi30k_published, trainer, training
from .device import device_description
from .report import Report, merged_reports
from .run import Run, Section, run_section
from .sizes import FULL, TINY

DESCRIPTION = (
    "GPU figures: correctness on the device, training and decoding speed against MarianMTModel and CTranslate2 (each "
    "system eager, compiled and captured, compared at its best), and the published Multi30k recipe end to end, each "
    "section alone or several in one command that keeps to a time limit."
)
# The sections, in the order a run without --only takes them: the quick figures first, then the long run.
SECTIONS = {
    "correctness": "bf16 attention implementations, decoding on the device = on the CPU, compiled = eager, a bf16 step",
    "training": "a fixed ~25k-token batch, base and big, hf_vaswani and MarianMT, eager, compiled and captured",
    "trainer": "the recipe's VaswaniTrainer on token batches of a synthetic corpus, base and big, eager; torch_compile",
    "generation": "greedy and beam 4 at two batch sizes: the package loop and MarianMT eager, compiled and captured, "
    "transformers' loop",
    "ctranslate2": "the same decoding by CTranslate2 (float16 and int8_float16 on CUDA) in a child process",
    "multi30k_published": "scripts/multi30k.sh --recipe published end to end: wall time, BLEU, epoch 1 and 5 losses",
    "distributed": "on 2+ GPUs: a DDP and an FSDP2 step of two processes against one process's",
}


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    sections = "\n".join(f"  {name:<20} {description}" for name, description in SECTIONS.items())
    parser = argparse.ArgumentParser(
        prog="gpu_figures.py",
        description=DESCRIPTION,
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
        from hf_vaswani.kernels.cpu_features import cpu_bf16_matmul_works

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
        "correctness": correctness.body,
        "training": training.body,
        "trainer": trainer.body,
        "generation": generation.body,
        "ctranslate2": partial(ctranslate2.body, wheel=args.cublas12_wheel),
        "multi30k_published": partial(multi30k_published.body, data=args.multi30k, run_folder=args.multi30k_run),
        "distributed": distributed.body,
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
