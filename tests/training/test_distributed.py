"""Scaling out: 2-process CPU training through accelerate (DDP, FSDP1, FSDP2) and Trainer's `fsdp` equals 1 process with
the same global batch; exact resume; sharded checkpoints averaged and loaded; seeded runs in full_determinism repeat bit
for bit, no kernel chosen by timing."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import capitalised_pairs

from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.sharded_weights import SHARDED_WEIGHTS
from hf_vaswani.training.checkpoints import checkpoint_problem

SCRIPT = Path(__file__).parents[1] / "tiny_training_run.py"
ACCELERATE_2_CPU_PROCESSES = [
    "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
    "--mixed_precision", "no", "--dynamo_backend", "no",
]  # fmt: skip
# The FSDP line of docs/training.md (FSDP1, accelerate's default), with what a CPU needs besides: accelerate's sync of
# module states and its RAM-efficient loading want an accelerator device, and FSDP1's full state dict crashes torch on
# a CPU, so checkpoints are sharded. tiny_training_run.py puts accelerate on its FSDP path, which it takes only on GPUs.
ACCELERATE_2_CPU_PROCESSES_FSDP = [
    "-m", "accelerate.commands.launch", "--use_fsdp", "--num_processes", "2", "--num_machines", "1",
    "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
    "--fsdp_sync_module_states", "false", "--fsdp_cpu_ram_efficient_loading", "false",
    "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--mixed_precision", "no", "--dynamo_backend", "no",
]  # fmt: skip
# FSDP2 as accelerate's launcher takes it: its sharded checkpoints (DCP) are FSDP2's default, as is the wrapping of the
# model's _no_split_modules. The shared embedding, its module given by get_input_embeddings, goes in one group with the
# output projection, which accelerate finds tied to it.
ACCELERATE_2_CPU_PROCESSES_FSDP2 = [
    "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2", "--num_processes", "2",
    "--num_machines", "1", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
    "--fsdp_cpu_ram_efficient_loading", "false", "--mixed_precision", "no", "--dynamo_backend", "no",
]  # fmt: skip
STEPS, FSDP_SAVE_EVERY = 4, 2
TIED = (
    "model.encoder.embeddings.embed_tokens.weight",
    "model.decoder.embeddings.embed_tokens.weight",
    "lm_head.weight",
)


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


def script_environment(**overrides: str) -> dict[str, str]:
    """The tests' environment, with tests/ on the path of the script's imports (helpers, tiny) however Python starts
    it (under PYTHONSAFEPATH the script's own folder is not on it)."""
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **overrides}


# How a rank of torch's gloo process group now and then dies as the processes set up on a loaded 2-core CPU, before
# their first step: a C++ thread destroyed while running.
SETUP_ABORT = "terminate called without an active exception"
SETUP_ATTEMPTS = 5


def run(arguments: list[str], **env_overrides: str) -> None:
    """The run of `arguments`; one that died of SETUP_ABORT before saving a checkpoint runs again, on a new port, up to
    SETUP_ATTEMPTS runs in all (five in a row, made within seconds, have died so beside the other test worker)."""
    env = script_environment(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env_overrides)
    output = Path(arguments[arguments.index(str(SCRIPT)) + 2])
    checkpoints_before = set(output.glob("checkpoint-*"))
    for attempt in range(SETUP_ATTEMPTS):
        time.sleep(5 * attempt)  # a retry waits out a while of what the other test worker runs
        result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=600, env=env)
        if not (
            result.returncode != 0
            and SETUP_ABORT in result.stderr
            and set(output.glob("checkpoint-*")) == checkpoints_before
        ):
            break
        for flag in ("--main_process_port", "--master_port"):  # accelerate's, torchrun's
            if flag in arguments:
                port = arguments.index(flag) + 1
                arguments = [*arguments[:port], str(free_port()), *arguments[port + 1 :]]
    if result.returncode != 0:  # not an AssertionError: a test expected to fail an assertion must not pass by a crash
        raise RuntimeError(result.stderr[-4000:])


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, data_file) -> Path:
    """One process, 2 batches accumulated a step, no dropout: the global batch of 2 processes of 1 batch each."""
    output = tmp_path_factory.mktemp("single")
    run(tiny_run(data_file, output, 2, STEPS, 0, 0.0))
    return output


def sharded_run(output: Path, data_file: Path, launcher: list[str]) -> Path:
    """The tiny run in 2 processes of 1 batch each under `launcher`, sharded checkpoints every FSDP_SAVE_EVERY steps."""
    run(
        [*launcher, "--main_process_port", str(free_port())]
        + tiny_run(data_file, output, 1, STEPS, FSDP_SAVE_EVERY, 0.0)
    )
    return output


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, data_file) -> Path:
    """Under `accelerate launch --use_fsdp`."""
    return sharded_run(tmp_path_factory.mktemp("fsdp"), data_file, ACCELERATE_2_CPU_PROCESSES_FSDP)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory, data_file) -> Path:
    """Under `accelerate launch --use_fsdp --fsdp_version 2`."""
    return sharded_run(tmp_path_factory.mktemp("fsdp2"), data_file, ACCELERATE_2_CPU_PROCESSES_FSDP2)


def assert_equal_states(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(state) == sorted(expected)
    for name in expected:
        assert torch.equal(state[name], expected[name]), name


def assert_equals_one_process(run_folder: Path, single_process_run: Path) -> None:
    """Both ranks' gathered weights and the logged losses equal one process's, bit for bit, and every row of the tied
    embedding has moved.

    Bit for bit: every gradient element is a sum of two partial gradients either way (two batches accumulated in one
    process, or FSDP's reduce-scatter over two ranks), a sum of two float32 terms does not depend on their order, and
    the scalings by the number of processes are powers of two, exact. (With more processes the order of the sum would
    matter.) Tied weights (source and target embeddings, output projection) equal one process's, which they would not
    had sharding split them into parameters of their own or left a rank's rows of them untrained.
    """
    single = torch.load(single_process_run / "state_rank0.pt")
    for rank in (0, 1):
        assert_equal_states(torch.load(run_folder / f"state_rank{rank}.pt"), single)
    assert json.loads((run_folder / "losses.json").read_text()) == json.loads(
        (single_process_run / "losses.json").read_text()
    )
    # The vocabulary (1,011) is odd, so the second rank holds 505 rows of the shared embedding and the first 506: each
    # row is trained (through the output projection's softmax a step reaches every row), the second rank's included.
    initial, final = torch.load(run_folder / "initial_state.pt"), torch.load(run_folder / "state_rank0.pt")
    embedding = TIED[0]
    assert final[embedding].shape[0] % 2 == 1
    assert (final[embedding] != initial[embedding]).any(dim=1).all()
    assert all(torch.equal(final[name], final[embedding]) for name in TIED)


def assert_average_of_gathered(run_folder: Path) -> None:
    """The run's average of its last 2 checkpoints (made at its end, in its main process) equals the average of the
    weights gathered from the processes at those checkpoints, computed alike (in float64, cast back), and loads."""
    gathered = [torch.load(run_folder / f"state_step{step}.pt") for step in (FSDP_SAVE_EVERY, STEPS)]
    expected = {name: ((gathered[0][name].double() + gathered[1][name].double()) / 2).float() for name in gathered[0]}
    averaged = load_file(run_folder / "averaged" / "model.safetensors")
    for name, tensor in averaged.items():
        assert torch.equal(tensor, expected[name]), name
    model, _ = load_model_folder(run_folder / "averaged")
    assert_equal_states(model.state_dict(), expected)


def test_two_processes_through_accelerate_equal_one_process_with_the_same_global_batch(
    tmp_path, data_file, single_process_run
) -> None:
    launcher = [*ACCELERATE_2_CPU_PROCESSES, "--main_process_port", str(free_port())]
    run(launcher + tiny_run(data_file, tmp_path / "ddp", 1, STEPS, 0, 0.0))

    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"state_rank{r}.pt") for r in (0, 1))
    single = torch.load(single_process_run / "state_rank0.pt")
    # Rank r trains on batches r, r+2, ... of the one-process order, so 2 ranks x 1 batch see what 1 process x 2
    # accumulated batches see; DDP keeps the ranks bit-identical.
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
        torch.testing.assert_close(rank0[name], single[name], atol=2e-5, rtol=1e-4, msg=name)
    ddp_losses = json.loads((tmp_path / "ddp" / "losses.json").read_text())
    single_losses = json.loads((single_process_run / "losses.json").read_text())
    assert len(ddp_losses) == len(single_losses) == STEPS
    assert ddp_losses == pytest.approx(single_losses, rel=1e-3)


def test_two_processes_under_fsdp_shard_the_model_and_equal_one_process(fsdp_run, single_process_run) -> None:
    # Sharded for real: each checkpoint holds one file of parameters per rank and no whole model (DDP writes
    # model.safetensors), and the run's layers were FSDP units of their own (TRANSFORMER_BASED_WRAP reads the model's
    # _no_split_modules).
    checkpoint = fsdp_run / f"checkpoint-{FSDP_SAVE_EVERY}"
    assert sorted(path.name for path in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (checkpoint / "model.safetensors").exists()
    assert (fsdp_run / "fsdp_units.txt").read_text().split() == ["VaswaniEncoderLayer", "VaswaniDecoderLayer"]
    assert_equals_one_process(fsdp_run, single_process_run)


def test_two_processes_under_fsdp2_shard_the_model_and_equal_one_process(fsdp2_run, single_process_run) -> None:
    # FSDP2's sharded checkpoints: one file of parameters per rank, no whole model. Its units: the layers (by the
    # model's _no_split_modules), and the shared embedding (one module, the source's and the target's) with the output
    # projection; the root holds the rest.
    checkpoint = fsdp2_run / f"checkpoint-{FSDP_SAVE_EVERY}"
    assert sorted(path.name for path in (checkpoint / SHARDED_WEIGHTS).glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (checkpoint / "model.safetensors").exists()
    units = (fsdp2_run / "fsdp_units.txt").read_text().split()
    assert units == ["Embedding", "VaswaniEncoderLayer", "VaswaniDecoderLayer", "FastestKernelLinear"]
    assert_equals_one_process(fsdp2_run, single_process_run)


def test_two_processes_under_trainers_fsdp_argument_equal_one_process(tmp_path, data_file, single_process_run) -> None:
    # Trainer's `fsdp` argument alone: FSDP2 (its default version), whole-model checkpoints (its default state dict),
    # each with accelerate's optimizer.bin, which a resume takes for complete
    output = tmp_path / "trainer_fsdp"
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    run(torchrun + tiny_run(data_file, output, 1, STEPS, FSDP_SAVE_EVERY, 0.0), TRAINER_FSDP="1")
    assert_equals_one_process(output, single_process_run)
    assert (output / "fsdp_units.txt").read_text().split()[1:3] == ["VaswaniEncoderLayer", "VaswaniDecoderLayer"]
    for step in (FSDP_SAVE_EVERY, STEPS):
        checkpoint = output / f"checkpoint-{step}"
        assert checkpoint_problem(checkpoint) is None
        # the package's code, as a plain model's checkpoint holds it, not torch's file of the class fully_shard made
        auto_map = json.loads((checkpoint / "config.json").read_text())["auto_map"]
        assert auto_map["AutoModelForSeq2SeqLM"] == "modeling_vaswani.VaswaniForConditionalGeneration"
        assert [path.name for path in checkpoint.glob("*.py") if not path.name.endswith("_vaswani.py")] == []
    assert_average_of_gathered(output)


@pytest.mark.parametrize("version", [1, 2])
def test_sharded_checkpoints_are_averaged_as_the_gathered_weights_and_load(fsdp_run, fsdp2_run, version) -> None:
    run_folder = fsdp_run if version == 1 else fsdp2_run
    assert_average_of_gathered(run_folder)
    checkpoint, _ = load_model_folder(run_folder / f"checkpoint-{STEPS}")
    assert_equal_states(checkpoint.state_dict(), torch.load(run_folder / "state_rank0.pt"))


@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_run_resumed_from_its_sharded_checkpoint_ends_as_the_uninterrupted_run(
    tmp_path, data_file, fsdp_run, fsdp2_run, version
) -> None:
    straight_run, launcher = (fsdp_run, ACCELERATE_2_CPU_PROCESSES_FSDP) if version == 1 else (
        fsdp2_run, ACCELERATE_2_CPU_PROCESSES_FSDP2)  # fmt: skip
    resumed = tmp_path / "resumed"
    # the uninterrupted run as a kill after checkpoint FSDP_SAVE_EVERY leaves it (its callbacks' files written)
    shutil.copytree(straight_run / f"checkpoint-{FSDP_SAVE_EVERY}", resumed / f"checkpoint-{FSDP_SAVE_EVERY}")
    run([*launcher, "--main_process_port", str(free_port())]
        + tiny_run(data_file, resumed, 1, STEPS, FSDP_SAVE_EVERY, 0.0, "resume"))  # fmt: skip

    # resumed from it, as the recipe's --resume finds it (a run started afresh would end on the same weights)
    assert (resumed / "resumed_from.txt").read_text() == f"checkpoint-{FSDP_SAVE_EVERY}"
    assert_equal_states(torch.load(resumed / "state_rank0.pt"), torch.load(straight_run / "state_rank0.pt"))


def test_training_killed_after_a_checkpoint_resumes_to_the_same_weights(tmp_path, data_file) -> None:
    # Dropout on: the checkpoint must carry the random state too, not just weights, optimizer and data position.
    steps, save_every, dropout = 8, 2, 0.1
    run(tiny_run(data_file, tmp_path / "straight", 1, steps, save_every, dropout))

    killed = tmp_path / "killed"
    # The run waits once checkpoint-4 is complete (its callbacks run after the save), so the kill lands there.
    process = subprocess.Popen([sys.executable, *tiny_run(data_file, killed, 1, steps, save_every, dropout)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=script_environment(HANG_AFTER_SAVE_STEP="4"))  # fmt: skip
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
