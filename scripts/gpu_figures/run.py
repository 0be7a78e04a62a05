"""A run of the command: its device, sizes and time limit, and each section's measurements recorded as they end (the
report saved after each), or why they did not run."""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_vaswani import VaswaniConfig

from .report import Report
from .sizes import Sizes


@dataclass(frozen=True)
class Run:
    device: torch.device
    sizes: Sizes
    bf16: bool  # whether bf16 runs here (a CPU may trap on a bfloat16 matmul: hf_vaswani.training.precision)
    deadline: float  # time.monotonic() at the time limit
    report: Report

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def model_config(self, preset: Callable[..., VaswaniConfig] = VaswaniConfig.base, **changes: Any) -> VaswaniConfig:
        return preset(**{**self.sizes.model, **changes})


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
