"""What the package does differently on a CUDA GPU, decided here once: whether training is compiled and its steps
captured in CUDA graphs, how decoding steps are compiled, the default training precision, the padding of training
batches, TF32 products, the batch loader's workers and the commands' default device. Each decision reads
`torch.cuda.is_available()` when it is made."""

import torch
from transformers.utils import is_torch_tf32_available

# Rows and lengths of a padded training batch are a multiple of this: few shapes for a compiled step to meet, and
# tensor cores' preferred multiple.
PADDING_MULTIPLE = 8


def default_device() -> str:
    """The device the commands use unless told: the GPU where there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def compiles(torch_compile: bool | None) -> bool:
    """Whether training compiles the model: as set (`torch_compile`), else on a CUDA GPU."""
    return torch.cuda.is_available() if torch_compile is None else torch_compile


def compile_mode(compiled: bool, update_freq: int) -> str | None:
    """torch.compile's mode of a compiled run: on a CUDA GPU with one batch an update, "reduce-overhead", each step's
    kernels captured in CUDA graphs and replayed in one launch (a small model's step is otherwise bound by launching
    them one by one; padded batches bound the shapes graphs are kept for); else the default. Not with gradient
    accumulation: CUDA graph trees give the first micro-batch's gradients to `.grad` in the graphs' memory, which the
    next micro-batch's replay overwrites (pytorch#169545), so the accumulated gradients would be wrong."""
    captures = compiled and torch.cuda.is_available() and update_freq == 1
    return "reduce-overhead" if captures else None


def step_compilation(compile: bool | dict, device_type: str) -> dict | None:
    """torch.compile's options for a decoding step on an accelerator of `device_type`, where the package's search
    compiles it (the CPU's steps run eagerly: its cache grows a position a step): `compile` itself where it gives
    options; else (True) on CUDA "reduce-overhead", each step's kernels captured in CUDA graphs and replayed in one
    launch, on another accelerator torch.compile's defaults; None (False): the steps run eagerly."""
    if isinstance(compile, dict):
        return compile
    if not compile:
        return None
    return {"mode": "reduce-overhead"} if device_type == "cuda" else {}


def pads_batches(compiled: bool, device: torch.device) -> bool:
    """Whether training batches are padded to PADDING_MULTIPLE: compiled (each new shape compiles again), or on a CUDA
    GPU (tensor cores); on a CPU padding only adds work."""
    return compiled or device.type == "cuda"


def default_training_precision() -> str | None:
    """The precision training takes unless told, on a CUDA GPU: bf16 where it supports it (its tensor cores are faster
    wherever the GPU has them), else fp32. None off CUDA, where the settings decide."""
    if not torch.cuda.is_available():
        return None
    return "bf16" if torch.cuda.is_bf16_supported() else "fp32"


def uses_tf32() -> bool:
    """Whether training's float32 products run on TF32 tensor cores: on a CUDA GPU that has them."""
    return torch.cuda.is_available() and is_torch_tf32_available()


def batch_loader_workers() -> int:
    """Processes making training batches: two on a GPU, while it computes; none on a CPU, whose cores train."""
    return 2 if torch.cuda.is_available() else 0
