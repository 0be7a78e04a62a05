"""Section multi30k_published: scripts/multi30k.sh --recipe published end to end, stopped at the time limit: wall time,
BLEU, the validation losses of epochs 1 and 5."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from .run import Run, Section, Skipped

MULTI30K_FILES = ("train", "val", "test_2016_flickr")


def body(section: Section, data: Path | None, run_folder: Path | None) -> None:
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
            str(Path(__file__).parents[1] / "multi30k.sh"),
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
