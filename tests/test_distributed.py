"""Scaling out: 2-process CPU training through accelerate equals 1 process with the same global batch; exact resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import reversal_pairs

SCRIPT = Path(__file__).with_name("tiny_training_run.py")
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    path.write_text("".join(f"{source}\t{target}\n" for source, target in reversal_pairs(96, seed=3)))
    return path


def run(command: list[str], timeout: int = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


def test_two_processes_through_accelerate_equal_one_process_with_the_same_global_batch(tmp_path, data_file) -> None:
    steps = 4
    run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "29533",
            str(SCRIPT),
            str(data_file),
            str(tmp_path / "ddp"),
            str(MAX_TOKENS),
            "1",
            str(steps),
            "0",
            "0.0",
        ]
    )
    run(
        [
            sys.executable,
            str(SCRIPT),
            str(data_file),
            str(tmp_path / "single"),
            str(MAX_TOKENS),
            "2",
            str(steps),
            "0",
            "0.0",
        ]
    )

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
    steps, save_every = 8, 2
    # Dropout on: the checkpoint must carry the random state too, not just weights, optimizer and data position.
    run(
        [
            sys.executable,
            str(SCRIPT),
            str(data_file),
            str(tmp_path / "straight"),
            str(MAX_TOKENS),
            "1",
            str(steps),
            str(save_every),
            "0.1",
        ]
    )

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            str(data_file),
            str(killed),
            str(MAX_TOKENS),
            "1",
            str(steps),
            str(save_every),
            "0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoint-4" / "trainer_state.json").exists():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "state_rank0.pt").exists()  # it really died mid-way
    run(
        [
            sys.executable,
            str(SCRIPT),
            str(data_file),
            str(killed),
            str(MAX_TOKENS),
            "1",
            str(steps),
            str(save_every),
            "0.1",
            "resume",
        ]
    )

    straight, resumed = torch.load(tmp_path / "straight" / "state_rank0.pt"), torch.load(killed / "state_rank0.pt")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], atol=0, rtol=0, msg=name)
