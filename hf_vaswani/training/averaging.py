"""Checkpoint averaging, as in §6.1 of "Attention Is All You Need".

"For the base models, we used a single model obtained by averaging the last 5 checkpoints, which were written at
10-minute intervals. For the big models, we averaged the last 20 checkpoints."

Works on the ``checkpoint-<step>`` folders that ``transformers.Trainer`` writes, their weights whole or sharded by FSDP
(or on any ``save_pretrained`` folder):

    from hf_vaswani.training.averaging import average_checkpoints, last_checkpoints

    average_checkpoints(last_checkpoints("runs/base", 5), "runs/base/averaged")
"""

from __future__ import annotations

import fnmatch
import json
import numbers
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..model.errors_vaswani import UsageError
from ..sharded_weights import SHARDED_WEIGHTS, has_sharded_weights, read_sharded_weights, sharded_weight_shapes
from .checkpoints import MODEL_CONFIG

__all__ = ["average_checkpoints", "last_checkpoints"]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)")

# Training state and weights are not copied: the averaged weights replace the latter, and resuming training from an
# averaged model with the last checkpoint's optimizer moments would silently mix two different trajectories.
_NOT_COPIED = (
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "optimizer*",
    "scheduler*",
    "scaler*",
    "rng_state*",
    "trainer_state.json",
    "training_args.bin",
    "*.pt",
    "*.pth",
    # DeepSpeed's pointer to its own sharded state and the script that consolidates it.
    "latest",
    "zero_to_fp32.py",
)

# The files that define a tokenizer: checkpoints trained with different tokenizers give token ids different meanings,
# so their weights must not be averaged.
_TOKENIZER_FILES = (
    "tokenizer*.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.spm",
)

# tokenizer.json entries that hold the encoding settings of the tokenizer's last call, not its vocabulary: a call with
# padding outside `encode_padded` (a caller's own validation) leaves it there, in every checkpoint saved after it.
_TOKENIZER_CALL_KEYS = ("padding", "truncation")

# config.json entries that describe how a checkpoint was saved, not the model.
_IRRELEVANT_CONFIG_KEYS = ("transformers_version", "_name_or_path")


def last_checkpoints(output_dir: str | Path, n: int, up_to_step: int | None = None) -> list[Path]:
    """The ``checkpoint-<step>`` subfolders of ``output_dir`` with the ``n`` highest steps, oldest first.

    With ``up_to_step``, only checkpoints of that step or earlier count (the average that ends at the best validated
    step rather than at the last one).

    Steps are compared as numbers (``checkpoint-100`` is later than ``checkpoint-20``). The latest checkpoint comes
    last, which is the one :func:`average_checkpoints` takes its config and tokenizer from. If fewer than ``n`` exist,
    all of them are returned with a warning, since averaging fewer checkpoints still gives a usable model.

    Raises:
        FileNotFoundError: ``output_dir`` is not a directory.
        ValueError: ``n`` is not a whole number of at least 1, or there is no checkpoint folder at all (at or before
            ``up_to_step``).
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise UsageError(f"n must be a whole number of checkpoints, at least 1, got {n!r}")
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise FileNotFoundError(f"{output_dir} is not a directory")
    steps = []
    for child in output_dir.iterdir():
        match = _CHECKPOINT_DIR.fullmatch(child.name)
        if match and child.is_dir():
            steps.append((int(match.group(1)), child))
    if not steps:
        raise UsageError(f"no checkpoint-<step> folder in {output_dir}")
    if up_to_step is not None:
        steps = [(step, path) for step, path in steps if step <= up_to_step]
        if not steps:
            raise UsageError(f"no checkpoint-<step> folder of step {up_to_step} or earlier in {output_dir}")
    steps.sort()
    if len(steps) < n:
        warnings.warn(f"asked for the last {n} checkpoints but {output_dir} holds only {len(steps)}", stacklevel=2)
    return [path for _, path in steps[-n:]]


@contextmanager
def _opened(path: Path) -> Iterator:
    """`safe_open(path)`, refusing a truncated or corrupt file with an error that names it."""
    try:
        handle = safe_open(path, framework="pt")
    except SafetensorError as error:
        raise UsageError(f"{path} is not a readable safetensors file (truncated?): {error}") from error
    with handle:
        yield handle


def _tokenizer_definition(path: Path) -> bytes | dict:
    """A tokenizer file's content, for tokenizer.json without the settings of its last call."""
    if path.name == "tokenizer.json":
        try:
            definition = json.loads(path.read_text())
        except ValueError:  # not JSON: compared as it is
            return path.read_bytes()
        if isinstance(definition, dict):
            return {key: value for key, value in definition.items() if key not in _TOKENIZER_CALL_KEYS}
    return path.read_bytes()


def _check_same_model_files(first: Path, checkpoint: Path) -> None:
    """Refuses checkpoints whose tokenizers or configs differ: their weights belong to different models."""
    for source in sorted(first.iterdir()):
        other = checkpoint / source.name
        if not any(fnmatch.fnmatch(source.name, pattern) for pattern in _TOKENIZER_FILES) or not other.is_file():
            continue
        if _tokenizer_definition(source) != _tokenizer_definition(other):
            raise UsageError(f"checkpoints {first} and {checkpoint} have different tokenizers: {source.name} differs")
    if (first / "config.json").is_file() and (checkpoint / "config.json").is_file():
        configs = [json.loads((path / "config.json").read_text()) for path in (first, checkpoint)]
        for config in configs:
            for key in _IRRELEVANT_CONFIG_KEYS:
                config.pop(key, None)
        differing = sorted(
            key for key in configs[0].keys() | configs[1].keys() if configs[0].get(key) != configs[1].get(key)
        )
        if differing:
            raise UsageError(f"checkpoints {first} and {checkpoint} have different configs: {differing} differ")


def _weight_files(checkpoint: Path) -> dict[str, Path]:
    """Maps each tensor name of a checkpoint of whole weights to the safetensors file holding it."""
    single = checkpoint / WEIGHTS_NAME
    index = checkpoint / WEIGHTS_INDEX_NAME
    if single.is_file():
        with _opened(single) as handle:
            return dict.fromkeys(handle.keys(), single)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint / shard for name, shard in weight_map.items()}
    raise FileNotFoundError(f"{checkpoint} holds neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME} nor {SHARDED_WEIGHTS}")


def _headers(checkpoint: Path) -> tuple[dict[str, tuple[list[int], str]], dict[str, str]]:
    """Shape and dtype of every tensor, and the file metadata, read from the headers without loading any tensor."""
    if has_sharded_weights(checkpoint):
        shapes = sharded_weight_shapes(checkpoint)
        return {name: (list(shape), str(dtype).removeprefix("torch.")) for name, (shape, dtype) in shapes.items()}, {}
    files = _weight_files(checkpoint)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    headers: dict[str, tuple[list[int], str]] = {}
    metadata: dict[str, str] = {}
    for path, names in by_file.items():
        with _opened(path) as handle:
            metadata = metadata or (handle.metadata() or {})
            for name in names:
                tensor_slice = handle.get_slice(name)
                headers[name] = (list(tensor_slice.get_shape()), tensor_slice.get_dtype())
    return headers, metadata


def _check_compatible(
    reference: dict[str, tuple[list[int], str]],
    headers: dict[str, tuple[list[int], str]],
    first: Path,
    checkpoint: Path,
) -> None:
    missing = sorted(reference.keys() - headers.keys())
    if missing:
        raise UsageError(f"checkpoint {checkpoint} lacks tensor {missing[0]!r} present in {first}")
    extra = sorted(headers.keys() - reference.keys())
    if extra:
        raise UsageError(f"checkpoint {checkpoint} has tensor {extra[0]!r} absent from {first}")
    for name in sorted(reference):
        if headers[name] != reference[name]:
            (shape, dtype), (ref_shape, ref_dtype) = headers[name], reference[name]
            raise UsageError(
                f"checkpoint {checkpoint}: tensor {name!r} has shape {shape} and dtype {dtype}, "
                f"but shape {ref_shape} and dtype {ref_dtype} in {first}"
            )


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    if has_sharded_weights(checkpoint):
        return read_sharded_weights(checkpoint)
    files = _weight_files(checkpoint)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    tensors = {}
    for path, names in by_file.items():
        with _opened(path) as handle:
            for name in names:
                tensors[name] = handle.get_tensor(name)
    return tensors


def _clear_weights(output_dir: Path) -> None:
    # A stale shard index left in output_dir could make loaders read old weights next to the new model.safetensors.
    index = output_dir / WEIGHTS_INDEX_NAME
    if index.is_file():
        for shard in set(json.loads(index.read_text()).get("weight_map", {}).values()):
            (output_dir / shard).unlink(missing_ok=True)
        index.unlink()
    (output_dir / WEIGHTS_NAME).unlink(missing_ok=True)


def average_checkpoints(checkpoints: Sequence[str | Path], output_dir: str | Path) -> Path:
    """Writes the element-wise mean of the checkpoints' weights to ``output_dir`` as a loadable model folder.

    Each checkpoint is a ``save_pretrained`` folder with ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``, or a Trainer checkpoint of weights sharded by FSDP (FSDP1's SHARDED_STATE_DICT,
    FSDP2's default; accelerate's ``pytorch_model_fsdp_0`` folder), read through torch's distributed checkpoint API in
    this process alone; the last of those must hold the model's config.json (CheckpointAveragingCallback writes it).
    All must hold the same tensor names, shapes and dtypes. Floating-point tensors are
    summed in float64 and the mean is cast back to the original dtype, so averaging many bf16/fp16 checkpoints loses no
    precision on the way; integer and boolean tensors (counters, masks) have no meaningful mean and must be identical.
    Tied weights are stored once by ``save_pretrained`` and so stay tied after loading; sharded checkpoints hold them
    under each of their names, and so does an average of them, each name the same values.

    The result is a single ``model.safetensors`` with the first file's metadata (``{"format": "pt"}``), plus every other
    file of the *last* checkpoint that makes the folder loadable (config, generation config, tokenizer, remote-code
    modules, model card); optimizer, scheduler, scaler, RNG and trainer state are left out. Subfolders are not copied.

    Returns:
        ``output_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: no checkpoints (or one path instead of a list), mismatched tensors (naming the checkpoint and
            the tensor), differing integer tensors, differing tokenizer files or configs, a truncated weights file
            (naming it), or ``output_dir`` is one of the checkpoints.
        FileNotFoundError: a checkpoint has neither safetensors weights nor sharded ones.
    """
    if isinstance(checkpoints, (str, os.PathLike)):  # a str is a Sequence too: each character would be a folder
        raise UsageError(f"checkpoints must be a list of checkpoint folders, not one path: pass [{str(checkpoints)!r}]")
    if not checkpoints:
        raise UsageError("average_checkpoints needs at least one checkpoint")
    paths = [Path(checkpoint) for checkpoint in checkpoints]
    output_dir = Path(output_dir)
    if any(output_dir.resolve() == path.resolve() for path in paths):
        raise UsageError(f"output_dir {output_dir} is one of the checkpoints being averaged; choose a new folder")

    sharded = [has_sharded_weights(path) for path in paths]
    if any(sharded) and not all(sharded):
        whole = paths[sharded.index(False)]
        raise UsageError(f"checkpoint {paths[sharded.index(True)]} holds sharded weights and {whole} whole ones")
    if sharded[-1] and not (paths[-1] / MODEL_CONFIG).is_file():
        raise UsageError(
            f"checkpoint {paths[-1]} holds sharded weights and no {MODEL_CONFIG} (Trainer writes none beside them; "
            "CheckpointAveragingCallback does): their average would be no model folder"
        )

    # Check every header before reading any tensor, so a mismatch fails fast on large checkpoints.
    reference, metadata = _headers(paths[0])
    for path in paths[1:]:
        _check_compatible(reference, _headers(path)[0], paths[0], path)
        _check_same_model_files(paths[0], path)

    # Streaming one checkpoint at a time keeps memory at one float64 copy plus one checkpoint, whatever their number.
    first = _tensors(paths[0])
    dtypes = {name: tensor.dtype for name, tensor in first.items()}
    sums = {name: tensor.to(torch.float64) if tensor.is_floating_point() else tensor for name, tensor in first.items()}
    del first
    for path in paths[1:]:
        for name, tensor in _tensors(path).items():
            if dtypes[name].is_floating_point:
                sums[name] += tensor.to(torch.float64)
            elif not torch.equal(sums[name], tensor):
                raise UsageError(
                    f"checkpoint {path}: non-floating tensor {name!r} ({dtypes[name]}) differs from {paths[0]}; "
                    "integer tensors cannot be averaged"
                )
    averaged = {
        name: (total / len(paths)).to(dtypes[name]) if dtypes[name].is_floating_point else total
        for name, total in sums.items()
    }

    output_dir.mkdir(parents=True, exist_ok=True)
    _clear_weights(output_dir)
    tensors = {name: tensor.contiguous() for name, tensor in averaged.items()}
    save_file(tensors, output_dir / WEIGHTS_NAME, metadata={"format": "pt", **metadata})
    for source in sorted(paths[-1].iterdir()):
        if source.is_file() and not any(fnmatch.fnmatch(source.name, pattern) for pattern in _NOT_COPIED):
            shutil.copy2(source, output_dir / source.name)
    return output_dir
