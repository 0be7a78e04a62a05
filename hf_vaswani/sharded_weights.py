"""A model's weights as FSDP's sharded state dicts save them (FSDP1's SHARDED_STATE_DICT, FSDP2's default): a folder in
torch's distributed checkpoint format (DCP) as accelerate writes it, a file of each process's shards and the .metadata
of all. Training writes and averages them; loading reads them, in one process."""

import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils.constants import FSDP_MODEL_NAME

from .model.errors_vaswani import UsageError

SHARDED_WEIGHTS = f"{FSDP_MODEL_NAME}_0"  # the folder, inside a checkpoint
SHARDED_WEIGHTS_PREFIX = "model."  # accelerate saves {"model": state_dict}, which DCP names "model.<name>"


def has_sharded_weights(checkpoint: Path) -> bool:
    """Whether the weights of `checkpoint` are sharded (SHARDED_WEIGHTS) rather than whole safetensors."""
    whole = ("model.safetensors", "model.safetensors.index.json")
    return (checkpoint / SHARDED_WEIGHTS).is_dir() and not any((checkpoint / name).is_file() for name in whole)


def sharded_problem(folder: Path) -> str | None:
    """Why the distributed checkpoint `folder` is incomplete, or None. DCP writes its .metadata once every process has
    written its shards, so a readable one vouches for them."""
    try:
        dcp.FileSystemReader(folder).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        return f"{folder.name}/.metadata: {type(error).__name__}"
    return None


def sharded_weight_shapes(checkpoint: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The shape and dtype of each weight of a checkpoint saved sharded (SHARDED_WEIGHTS), by the model's parameter
    names, read from its metadata alone. A tied weight is there under each of its names, as in the model's state
    dict."""
    folder = checkpoint / SHARDED_WEIGHTS
    problem = sharded_problem(folder)
    if problem is not None:
        raise UsageError(f"the sharded weights of {checkpoint} are incomplete or damaged: {problem}")
    entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    outside = [name for name, entry in entries.items() if not isinstance(entry, dcp.TensorStorageMetadata)]
    outside += [name for name in entries if not name.startswith(SHARDED_WEIGHTS_PREFIX)]
    if outside:
        raise UsageError(f"{folder} is not a model's weights as accelerate saves them: it holds {outside[0]!r}")
    return {
        name.removeprefix(SHARDED_WEIGHTS_PREFIX): (entry.size, entry.properties.dtype)
        for name, entry in entries.items()
    }


def read_sharded_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole weights of a checkpoint saved sharded, as `sharded_weight_shapes` names them, read through torch's
    distributed checkpoint API in this process alone."""
    weights = {
        SHARDED_WEIGHTS_PREFIX + name: torch.empty(shape, dtype=dtype)
        for name, (shape, dtype) in sharded_weight_shapes(checkpoint).items()
    }
    # no_dist: no other process joins the read, even where a process group exists (the main process averages the
    # checkpoints at the end of a distributed run); DCP then warns that it reads in one process, as asked
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(weights, storage_reader=dcp.FileSystemReader(checkpoint / SHARDED_WEIGHTS), no_dist=True)
    return {name.removeprefix(SHARDED_WEIGHTS_PREFIX): tensor for name, tensor in weights.items()}
