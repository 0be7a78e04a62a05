"""Word alignments from the encoder-decoder attention: which source word each target word attends to most."""

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data.tokenization import encode_padded
from ..model.errors_vaswani import UsageError
from .scoring import encode_pairs
from .translation import Hypothesis, check_batch, length_sorted_batches


def token_words(offsets: Sequence[tuple[int, int]], text: str) -> list[int | None]:
    """For each token, the 0-based index of the whitespace-separated word of `text` it belongs to: the word its
    characters lie in, or for a token of spaces the word after it (byte-level BPE attaches a space to the following
    word, "Ġword", and keeps it alone when the vocabulary lacks the merge). None for special tokens and padding (empty
    offsets) and for spaces after the last word."""
    word_ends = [match.end() for match in re.finditer(r"\S+", text)]
    return [
        None if start == stop else next((word for word, end in enumerate(word_ends) if end > start), None)
        for start, stop in offsets
    ]


@contextlib.contextmanager
def eager_attention(model: PreTrainedModel) -> Iterator[None]:
    """The eager attention implementation for the block: the only one that returns attention weights (sdpa does not)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def check_alignment_layer(model: PreTrainedModel, layer: int) -> None:
    """Refuse (ValueError) a decoder layer index the model does not have, naming the valid ones."""
    layers = model.config.decoder_layers
    if not -layers <= layer < layers:
        raise UsageError(f"layer {layer} does not exist: the decoder has layers 0 to {layers - 1} (or -1 to -{layers})")


def align_pairs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[str],
    targets: Sequence[str],
    layer: int = -1,
    batch_size: int = 64,
) -> list[list[tuple[int, int]]]:
    """Word alignments of each (source, target) pair from the encoder-decoder attention, as (source word, target
    word) pairs of 0-based indices, one per target word, in target order.

    The rule: the target is teacher-forced (one forward pass, eager attention); the attention of `layer`'s
    encoder-decoder attention (default: the last layer), averaged over its heads, is taken at the decoder position
    that predicts each target token. Words are whitespace-separated; tokens map to words by their character offsets
    (so the tokenizer must be a fast one; a token of spaces belongs to the word after it), special tokens to none.
    A target word's attention is the mean over its tokens' rows; a source word's share of it is the sum over its
    tokens. Each target word is aligned to the source word with the highest share (the first on a tie). A pair with
    no word on either side has no alignment.
    """
    check_batch(sources, batch_size, "sources")
    if not tokenizer.is_fast:
        raise UsageError("word alignments need a fast tokenizer: its character offsets map tokens to words")
    check_alignment_layer(model, layer)
    encode_pairs(model, tokenizer, sources, targets)  # refuses what the positions cannot hold, before any work
    batches = length_sorted_batches(range(len(sources)), lambda i: len(sources[i]) + len(targets[i]), batch_size)
    alignments: list[list[tuple[int, int]]] = [[] for _ in sources]
    model.eval()
    for indices in batches:
        source_texts, target_texts = [sources[i] for i in indices], [targets[i] for i in indices]
        source = encode_padded(tokenizer, source_texts, return_offsets_mapping=True)
        target = encode_padded(tokenizer, text_target=target_texts, return_offsets_mapping=True)
        with torch.inference_mode(), eager_attention(model):
            attentions = model(
                input_ids=source["input_ids"].to(model.device),
                attention_mask=source["attention_mask"].to(model.device),
                decoder_input_ids=model.prepare_decoder_input_ids_from_labels(target["input_ids"].to(model.device)),
                output_attentions=True,
            ).cross_attentions[layer]
        for row, i in enumerate(indices):
            source_words = token_words(source["offset_mapping"][row].tolist(), source_texts[row])
            target_words = token_words(target["offset_mapping"][row].tolist(), target_texts[row])
            alignments[i] = word_alignment(attentions[row].mean(0).float().cpu(), source_words, target_words)
    return alignments


def align_nbest(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    nbest: Sequence[Sequence[Hypothesis]],
    layer: int = -1,
    batch_size: int = 64,
) -> list[list[list[tuple[int, int]]]]:
    """`align_pairs` for every hypothesis of `translate_nbest`'s lists: one alignment per hypothesis, in their order."""
    pairs = [
        (sentence, hypothesis.text)
        for sentence, hypotheses in zip(sentences, nbest, strict=True)
        for hypothesis in hypotheses
    ]
    aligned = iter(align_pairs(model, tokenizer, [s for s, _ in pairs], [t for _, t in pairs], layer, batch_size))
    return [[next(aligned) for _ in hypotheses] for hypotheses in nbest]


def word_alignment(
    attention: torch.Tensor, source_words: Sequence[int | None], target_words: Sequence[int | None]
) -> list[tuple[int, int]]:
    """The rule of `align_pairs` on one pair's head-averaged attention (target tokens x source tokens)."""
    source_count = 1 + max((word for word in source_words if word is not None), default=-1)
    target_count = 1 + max((word for word in target_words if word is not None), default=-1)
    if source_count == 0 or target_count == 0:
        return []
    source_membership = torch.zeros(len(source_words), source_count)  # token -> word, to sum a word's columns
    for token, word in enumerate(source_words):
        if word is not None:
            source_membership[token, word] = 1.0
    target_membership = torch.zeros(target_count, len(target_words))  # word -> token, to average a word's rows
    for token, word in enumerate(target_words):
        if word is not None:
            target_membership[word, token] = 1.0
    target_membership /= target_membership.sum(-1, keepdim=True)
    word_attention = target_membership @ attention @ source_membership
    return [(int(source_word), target_word) for target_word, source_word in enumerate(word_attention.argmax(-1))]
