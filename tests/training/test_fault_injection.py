"""A `vaswani train` run interrupted anywhere, by SIGKILL or Ctrl-C, once or many times, and resumed with `--resume`
each time, ends with the same files as a run never interrupted: bit for bit under `--full-determinism`."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import toy_train_options, write_corpus_files

TESTS = Path(__file__).parents[1]
# 8 steps of two accumulated batches, a checkpoint every 2 steps, the last 2 kept and averaged: checkpoint-6 and -8.
# 24-token batches make 5 batches an epoch, 3 steps: the run ends mid-epoch, the last step of an epoch has one batch.
SCHEDULE = dict(max_steps=8, save_steps=2, average_last=2, update_freq=2, max_tokens=24)
# Every phase of a run, in the order a run passes them: before the first checkpoint, between checkpoints, while
# writing a checkpoint, inside the averaging window (after checkpoint-6), while averaging, while writing the model.
PHASES = ("step-1", "step-3", "saving-4", "step-7", "averaging", "model-save")
# What the run writes at the end; the model card (README.md) and results.json also carry wall-clock times.
COMPARED = ("model", "checkpoints/averaged")


def run(phase: str, signal_name: str, options: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TESTS / "interrupted_train.py"), phase, signal_name, *options],
        capture_output=True,
        text=True,
        cwd=TESTS,
        env=os.environ | {"OMP_NUM_THREADS": "1"},  # one thread: every run sums in the same order
        timeout=600,
    )


def digests(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != "README.md"
    }


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(path.name.split("-")[1]) for path in (run_dir / "checkpoints").glob("checkpoint-*"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[str]]:
    """The corpus options and the folder of the run never interrupted."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    options = [*write_corpus_files(folder / "corpus"), *toy_train_options(**SCHEDULE), "--full-determinism"]
    finished = run("none", "KILL", ["--output-dir", str(folder / "run"), *options])
    assert finished.returncode == 0, finished.stderr[-2000:]
    return folder / "run", options


@pytest.mark.parametrize("signal_name", ["KILL", "INT"])
def test_a_run_interrupted_at_every_phase_resumes_to_the_uninterrupted_result(
    uninterrupted, tmp_path, signal_name
) -> None:
    reference, options = uninterrupted
    run_dir = tmp_path / "run"
    options = ["--output-dir", str(run_dir), *options]
    for index, phase in enumerate(PHASES):  # each interruption after the first hits a resumed run
        interrupted = run(phase, signal_name, options + ["--resume"] * (index > 0))
        killed_by = -interrupted.returncode if interrupted.returncode < 0 else None
        # Python ends on an unhandled KeyboardInterrupt by re-raising SIGINT: either way the signal ended the run
        assert killed_by == getattr(signal, "SIG" + signal_name), f"{phase}: {interrupted.stderr[-2000:]}"
    finished = run("none", signal_name, options + ["--resume"])
    assert finished.returncode == 0, finished.stderr[-2000:]
    for folder in COMPARED:
        assert digests(run_dir / folder) == digests(reference / folder), folder
    results, expected = (json.loads((path / "results.json").read_text()) for path in (run_dir, reference))
    assert results["steps"] == SCHEDULE["max_steps"]
    assert results["averaged_checkpoints"] == expected["averaged_checkpoints"] == ["checkpoint-6", "checkpoint-8"]
    assert results["final_training_loss"] == expected["final_training_loss"]
    assert checkpoint_steps(run_dir) == checkpoint_steps(reference) == [6, 8]

    # Resuming the finished run changes nothing: no step past --max-steps, no checkpoint rotated away.
    checkpoints = digests(run_dir / "checkpoints")
    again = run("none", signal_name, options + ["--resume"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert digests(run_dir / "checkpoints") == checkpoints
    assert digests(run_dir / "model") == digests(reference / "model")
    assert json.loads((run_dir / "results.json").read_text())["steps"] == SCHEDULE["max_steps"]
