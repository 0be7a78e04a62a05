"""int8 weights for CPU inference."""

import copy
import warnings

import torch
from torch import nn
from transformers import PreTrainedModel

from ..model.errors_vaswani import UsageError


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` for CPU inference whose Linear layers hold int8 weights and quantize their inputs on the fly.

    Dynamic quantization (per-tensor int8 weights, activations scaled per batch, int32 accumulation) from torch's
    `torch.ao.quantization`; embeddings and layer norms stay float32. Its speed and BLEU against float32:
    docs/performance.md.
    """
    if model.device.type != "cpu":
        raise UsageError(f"int8 inference runs on CPU; the model is on {model.device}")
    with warnings.catch_warnings():
        # torch.ao's eager quantization is deprecated in favour of torchao, whose CPU int8 kernels need torch.compile
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        quantized = copy.deepcopy(model).eval()
        for module in quantized.modules():
            if isinstance(module, nn.Linear):
                module.__class__ = nn.Linear  # torch.ao swaps exact nn.Linear only (kernelize's linears are subclasses)
        return torch.ao.quantization.quantize_dynamic(quantized, {nn.Linear}, dtype=torch.qint8, inplace=True)
