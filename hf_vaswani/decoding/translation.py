"""Translating sentences with a model: sorted by length, decoded in batches, returned in input order; n-best lists
with the scores beam search ranked them by."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..kernels.cpu import packed_weights
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import check_generation_settings
from ..text_io import alignment_text, as_one_line
from .search import generate


def check_batch(sentences: Sequence[str], batch_size: int, name: str = "sentences") -> None:
    """Refuse (UsageError) one string where a list of them is meant, and a batch size below 1."""
    if isinstance(sentences, str):  # a str is a Sequence[str] too: each character would be processed on its own
        raise UsageError(f"{name} must be a list of strings, not one string: pass [text]")
    check_batch_size(batch_size)


def check_batch_size(batch_size: int, name: str = "batch_size") -> None:
    """Refuse (UsageError naming it `name`) a batch size below 1."""
    if batch_size < 1:
        raise UsageError(f"{name} must be at least 1, got {batch_size}")


def length_sorted_batches(indices: Iterable[int], length: Callable[[int], int], batch_size: int) -> list[list[int]]:
    """`indices` sorted by `length` and cut into batches of `batch_size`: similar lengths keep padding, and so wasted
    computation, small. Callers put results back in input order by these indices."""
    order = sorted(indices, key=length)
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def decoded_batches(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int,
    progress: bool,
    **generate_kwargs,
) -> Iterator[tuple[list[int], Any]]:
    """Each batch of the non-blank `sentences`, sorted by length, as (their indices, the package's search's output
    for them): the one batching loop of translations and n-best lists."""
    check_batch(sentences, batch_size)
    batches = length_sorted_batches(
        (i for i, sentence in enumerate(sentences) if sentence.strip()), lambda i: len(sentences[i]), batch_size
    )
    model.eval()
    with packed_weights(model):
        for indices in tqdm(batches, desc="Translating", disable=not progress, unit="batch"):
            batch = tokenizer([sentences[i] for i in indices], return_tensors="pt", padding=True).to(model.device)
            with torch.inference_mode():
                yield indices, generate(model, **batch, **generate_kwargs)


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int = 64,
    progress: bool = True,
    **generate_kwargs,
) -> list[str]:
    """Translate `sentences` by the package's search (`hf_vaswani.generate`: the model's generation config,
    overridable by `generate_kwargs`, `shortlist=` among them).

    A blank sentence translates to "" without decoding (there is nothing to translate, and a model would invent text).
    """
    check_generation_settings(generate_kwargs)
    translations: list[str] = [""] * len(sentences)
    for indices, generated in decoded_batches(model, tokenizer, sentences, batch_size, progress, **generate_kwargs):
        for i, text in zip(indices, tokenizer.batch_decode(generated, skip_special_tokens=True), strict=True):
            translations[i] = text
    return translations


def check_nbest(k: int, num_beams: int | None = None) -> None:
    """Refuse (ValueError) an n-best list size below 1, or one that `num_beams` (None: the default) cannot hold."""
    if k < 1:
        raise UsageError(f"the n-best list size must be at least 1, got {k}")
    if num_beams is not None and num_beams < max(k, 2):  # greedy search (1 beam) gives no sequence scores
        raise UsageError(f"an n-best list of {k} needs beam search with num_beams >= {max(k, 2)}, got {num_beams}")


@dataclass(frozen=True)
class Hypothesis:
    """One entry of an n-best list, with the numbers beam search ranked it by."""

    text: str
    # The output tokens, </s> included; a hypothesis cut by the length cap (max_new_tokens) ends without it.
    token_ids: tuple[int, ...]
    # The sum of the log-probabilities beam search gave its tokens (log-softmax of the model's logits after the logits
    # processors: a </s> forced by the source-length cap counts 0 there, see generation_vaswani.py).
    log_probability: float
    # The final, length-penalised score the n-best list is sorted by: log_probability / lp(len(token_ids)).
    score: float


def translate_nbest(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    k: int,
    batch_size: int = 64,
    progress: bool = False,
    **generate_kwargs,
) -> list[list[Hypothesis]]:
    """The `k` best finished hypotheses of beam search for each sentence, best first, with their scores.

    `generate(num_return_sequences=k, output_scores=True, return_dict_in_generate=True)`: `sequences_scores` is the
    final score (the model's length penalty, GNMT's by default), `compute_transition_scores` gives the token
    log-probabilities. `num_beams` defaults to the larger of `k` and the model's own (paper: 4); a smaller one is
    refused. A blank sentence gets an empty list (nothing to translate).
    """
    num_beams = generate_kwargs.pop("num_beams", None)
    check_nbest(k, num_beams)
    if num_beams is None:
        num_beams = max(k, model.generation_config.num_beams or 1, 2)
    check_generation_settings(generate_kwargs)
    options = dict(num_return_sequences=k, output_scores=True, return_dict_in_generate=True)
    nbest: list[list[Hypothesis]] = [[] for _ in sentences]
    for indices, output in decoded_batches(
        model, tokenizer, sentences, batch_size, progress, num_beams=num_beams, **options, **generate_kwargs
    ):
        token_log_probs = model.compute_transition_scores(output.sequences, output.scores, output.beam_indices)
        generated = output.beam_indices >= 0  # a hypothesis' own steps; after its end come fill tokens
        outputs = output.sequences[:, output.sequences.shape[1] - generated.shape[1] :]
        texts = tokenizer.batch_decode(output.sequences, skip_special_tokens=True)
        for row, text in enumerate(texts):  # generate returns each sentence's k rows together, best first
            nbest[indices[row // k]].append(
                Hypothesis(
                    text=text,
                    token_ids=tuple(outputs[row][generated[row]].tolist()),
                    log_probability=float(token_log_probs[row].sum()),
                    score=float(output.sequences_scores[row]),
                )
            )
    return nbest


def nbest_lines(
    nbest: Sequence[Sequence[Hypothesis]], alignments: Sequence[Sequence[Sequence[tuple[int, int]]]] | None = None
) -> Iterator[str]:
    """Moses' n-best format, one line per hypothesis, best first within each sentence:

    `i ||| hypothesis ||| LogProb= log_probability Tokens= |Y| ||| score`, i the 0-based sentence number, and a fifth
    field `||| 0-0 1-2 ...` with the hypothesis' word alignment when `alignments` (one list per hypothesis) are given.
    """
    for i, hypotheses in enumerate(nbest):
        for rank, hypothesis in enumerate(hypotheses):
            line = (
                f"{i} ||| {as_one_line(hypothesis.text)} ||| LogProb= {hypothesis.log_probability:.6f} "
                f"Tokens= {len(hypothesis.token_ids)} ||| {hypothesis.score:.6f}"
            )
            yield line if alignments is None else f"{line} ||| {alignment_text(alignments[i][rank])}"
