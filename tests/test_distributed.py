"""Scaling out: 2-process CPU training through accelerate equals 1 process with the same global batch; exact resume;
seeded runs in full_determinism repeat bit for bit, no kernel chosen by timing."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import capitalised_pairs

SCRIPT = Path(__file__).with_name("tiny_training_run.py")
ACCELERATE_2_CPU_PROCESSES = [
    "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
    "--mixed_precision", "no", "--dynamo_backend", "no",
]  # fmt: skip


def free_port() -> int:
    """A port nobody listens on now: a fixed one fails whenever another test run on the machine holds it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    path.write_text("".join(f"{source}\t{target}\n" for source, target in capitalised_pairs(96, seed=3)))
    return path


def tiny_run(data: Path, output: Path, update_freq: int, steps: int, save_every: int, dropout: float, *extra: str):
    """Arguments of one tiny training run (see tiny_training_run.py), 48-token batches."""
    return [str(SCRIPT), str(data), str(output), "48", str(update_freq), str(steps), str(save_every), str(dropout),
            *extra]  # fmt: skip


def run(arguments: list[str], **env_overrides: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env_overrides}
    result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


def test_two_processes_through_accelerate_equal_one_process_with_the_same_global_batch(tmp_path, data_file) -> None:
    steps = 4
    launcher = [*ACCELERATE_2_CPU_PROCESSES, "--main_process_port", str(free_port())]
    run(launcher + tiny_run(data_file, tmp_path / "ddp", 1, steps, 0, 0.0))
    run(tiny_run(data_file, tmp_path / "single", 2, steps, 0, 0.0))

    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"state_rank{r}.pt") for r in (0, 1))
    single = torch.load(tmp_path / "single" / "state_rank0.pt")
    # Rank r trains on batches r, r+2, ... of the one-process order, so 2 ranks x 1 batch see what 1 process x 2
    # accumulated batches see; DDP keeps the ranks bit-identical.
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
        torch.testing.assert_close(rank0[name], single[name], atol=2e-5, rtol=1e-4, msg=name)
    ddp_losses = json.loads((tmp_path / "ddp" / "losses.json").read_text())
    single_losses = json.loads((tmp_path / "single" / "losses.json").read_text())
    assert len(ddp_losses) == len(single_losses) == steps
    assert ddp_losses == pytest.approx(single_losses, rel=1e-3)


def test_training_killed_after_a_checkpoint_resumes_to_the_same_weights(tmp_path, data_file) -> None:
    # Dropout on: the checkpoint must carry the random state too, not just weights, optimizer and data position.
    steps, save_every, dropout = 8, 2, 0.1
    run(tiny_run(data_file, tmp_path / "straight", 1, steps, save_every, dropout))

    killed = tmp_path / "killed"
    # The run waits once checkpoint-4 is complete (its callbacks run after the save), so the kill lands there.
    process = subprocess.Popen([sys.executable, *tiny_run(data_file, killed, 1, steps, save_every, dropout)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "HANG_AFTER_SAVE_STEP": "4"})  # fmt: skip
    deadline = time.time() + 300
    while not (killed / "saved").exists():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "state_rank0.pt").exists()  # it really died mid-way
    assert not (killed / "checkpoint-6").exists()
    run(tiny_run(data_file, killed, 1, steps, save_every, dropout, "resume"))

    straight, resumed = torch.load(tmp_path / "straight" / "state_rank0.pt"), torch.load(killed / "state_rank0.pt")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=0, rtol=0, msg=name)


def test_seeded_runs_in_full_determinism_time_no_kernel_and_repeat_bit_for_bit(tmp_path, data_file) -> None:
    # Timing can choose other kernels on a loaded machine than on a quiet one, and they round otherwise.
    for name in ("first", "second"):
        run(tiny_run(data_file, tmp_path / name, 1, 4, 0, 0.1), NO_KERNEL_TIMING="1")
    first, second = (torch.load(tmp_path / name / "state_rank0.pt") for name in ("first", "second"))
    for name in first:
        assert torch.equal(first[name], second[name]), name
