"""Batched translation with a saved model: sentences sorted by length, decoded in batches, returned in input order."""

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .metrics import corpus_scores, tokenized_bleu


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


def translate_and_score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[str],
    references: Sequence[str],
    target_lang: str,
    batch_size: int = 64,
) -> tuple[list[str], dict]:
    """Translate a test set and score it: sacreBLEU, chrF2 and the paper's tokenized BLEU (unrounded)."""
    hypotheses = translate(model, tokenizer, sources, batch_size=batch_size)
    scores = corpus_scores(hypotheses, references)
    report = {name: scores[name] for name in ("bleu", "chrf", "bleu_signature")}
    report["tokenized_bleu"] = tokenized_bleu(hypotheses, references, lang=target_lang)
    return hypotheses, report
