"""Section distributed: on 2+ GPUs, a DDP and an FSDP2 training step of two processes against one process's step on
the whole batch (the same update), and its speed."""

from __future__ import annotations

import copy
import json
import socket
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from speed_comparison import random_tokens, time_calls

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration

from .run import Section, Skipped
from .sizes import Sizes


def body(section: Section) -> None:
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
            "input_ids": random_tokens(generator, world_size * sentences, length, config.vocab_size).to(device),
            "labels": random_tokens(generator, world_size * sentences, length, config.vocab_size).to(device),
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
        seconds = time_calls(partial(step, wrapped, half, optimizer), 1, 3, device)
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
