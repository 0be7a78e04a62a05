"""Batched translation with a saved model: sentences sorted by length, decoded in batches, returned in input order."""

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int = 64,
    progress: bool = True,
    **generate_kwargs,
) -> list[str]:
    """Translate `sentences` with `model.generate` (its generation config, overridable by `generate_kwargs`)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    # Sorting by length keeps padding, and so wasted computation, small; results go back to the input order.
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    translations: list[str] = [""] * len(sentences)
    model.eval()
    for start in tqdm(range(0, len(order), batch_size), desc="Translating", disable=not progress, unit="batch"):
        indices = order[start : start + batch_size]
        batch = tokenizer([sentences[i] for i in indices], return_tensors="pt", padding=True).to(model.device)
        with torch.inference_mode():
            generated = model.generate(**batch, **generate_kwargs)
        for i, text in zip(indices, tokenizer.batch_decode(generated, skip_special_tokens=True), strict=True):
            translations[i] = text
    return translations
