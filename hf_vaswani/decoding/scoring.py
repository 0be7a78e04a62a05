"""Scoring with a model: given translations by forced decoding (log-probabilities, normalised as beam search ranks
them), and a test set's translations by corpus metrics."""

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..model.configuration_vaswani import VaswaniConfig
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import equivalent_power, length_penalty_type
from .translation import Translator, check_batch, length_sorted_batches

NORMALIZATIONS = ("none", "mean", "length_penalty")


@dataclass(frozen=True)
class PairScore:
    """What the model gives a target sentence as the translation of a source sentence (forced decoding)."""

    token_log_probs: tuple[float, ...]  # log P(y_t | y_<t, source) for each target token, </s> included
    log_probability: float  # log P(target | source): their sum
    score: float  # log_probability normalised as asked: as is, per token, or by the model's length penalty


def length_penalty(model: PreTrainedModel, length: int) -> float:
    """What beam search divides a finished hypothesis' log-probability by: the model's generation config's penalty.

    GNMT's ((5 + length) / 6)^alpha for this package's models (`length_penalty_type` "gnmt", their default), else
    transformers' length^alpha.
    """
    config = model.generation_config
    alpha = config.length_penalty
    if model.config.model_type == VaswaniConfig.model_type and length_penalty_type(config) == "gnmt":
        alpha = equivalent_power(length, alpha)
    return float(length**alpha)


def position_limit(config: PretrainedConfig) -> int | None:
    """How many positions a sequence may have; None when unbounded (sinusoids are computed for any position)."""
    if config.model_type == VaswaniConfig.model_type:
        return config.max_position_embeddings if config.positional_encoding == "learned" else None
    return getattr(config, "max_position_embeddings", None)  # other types (Marian: a fixed table of sinusoids)


def padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one right-padded tensor, and the mask of the real tokens."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[*row, *[pad_token_id] * (width - len(row))] for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def encode_pairs(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sources: Sequence[str], targets: Sequence[str]
) -> tuple[list[list[int]], list[list[int]]]:
    """Source and target token ids of each pair, refused (ValueError) when a side needs more positions than the model
    has: learned position embeddings stop at max_position_embeddings, and beyond them there is no right number."""
    if isinstance(targets, str):
        raise UsageError("targets must be a list of strings, not one string: pass [text]")
    if len(sources) != len(targets):
        raise UsageError(f"{len(sources)} sources but {len(targets)} targets: each source needs one target")
    if not sources:  # a fast tokenizer fails on an empty batch
        return [], []
    source_ids = tokenizer(list(sources))["input_ids"]
    target_ids = tokenizer(text_target=list(targets))["input_ids"]
    limit = position_limit(model.config)
    for number, pair in enumerate(zip(source_ids, target_ids, strict=True), start=1):
        for side, ids in zip(("source", "target"), pair, strict=True):
            if limit is not None and len(ids) > limit:
                raise UsageError(
                    f"pair {number}: the {side} needs {len(ids)} positions (tokens, </s> included), more than the "
                    f"model's max_position_embeddings={limit} learned positions"
                )
    return source_ids, target_ids


def score_pairs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[str],
    targets: Sequence[str],
    batch_size: int = 64,
    normalize: str = "none",
    progress: bool = False,
) -> list[PairScore]:
    """log P(target | source) of each pair under the model, by forced decoding (one teacher-forced forward pass).

    The target is tokenized as a label sequence (ending with </s>, whose probability counts); the decoder is fed it
    shifted right behind the start token. `normalize`: "none" (the sum), "mean" (divided by the number of target
    tokens), "length_penalty" (divided by the model's length penalty, as beam search ranks finished hypotheses, so
    comparable with `translate_nbest` scores). Pairs are batched by length with padding.
    """
    check_batch(sources, batch_size, "sources")
    if normalize not in NORMALIZATIONS:
        raise UsageError(f"normalize must be one of {', '.join(NORMALIZATIONS)}; got {normalize!r}")
    source_ids, target_ids = encode_pairs(model, tokenizer, sources, targets)
    batches = length_sorted_batches(range(len(sources)), lambda i: len(target_ids[i]), batch_size)
    token_log_probs: list[tuple[float, ...]] = [()] * len(sources)
    model.eval()
    for indices in tqdm(batches, desc="Scoring", disable=not progress, unit="batch"):
        input_ids, attention_mask = padded([source_ids[i] for i in indices], tokenizer.pad_token_id)
        labels, _ = padded([target_ids[i] for i in indices], tokenizer.pad_token_id)
        with torch.inference_mode():
            logits = model(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels.to(model.device)),
            ).logits
            chosen = logits.float().log_softmax(-1).gather(-1, labels.to(model.device).unsqueeze(-1)).squeeze(-1)
        for row, i in enumerate(indices):  # causal decoder: padding after a target cannot change its positions
            token_log_probs[i] = tuple(chosen[row, : len(target_ids[i])].tolist())
    return [
        PairScore(scores, sum(scores), sum(scores) / normalizer(model, normalize, len(scores)))
        for scores in token_log_probs
    ]


def score_lines(scores: Iterable[PairScore]) -> Iterator[str]:
    """`vaswani score`'s output: "score<TAB>log_probability<TAB>token log-probabilities separated by spaces"."""
    for pair in scores:
        tokens = " ".join(f"{value:.6f}" for value in pair.token_log_probs)
        yield f"{pair.score:.6f}\t{pair.log_probability:.6f}\t{tokens}"


def normalizer(model: PreTrainedModel, normalize: str, length: int) -> float:
    """What `score_pairs` divides a log-probability of `length` target tokens by (see its `normalize`)."""
    if normalize == "mean":
        return float(length)
    return length_penalty(model, length) if normalize == "length_penalty" else 1.0


def translate_and_score(
    translator: Translator,
    sources: Sequence[str],
    references: Sequence[str],
    target_lang: str,
    batch_size: int = 64,
    progress: bool = True,
    **generate_kwargs,
) -> tuple[list[str], dict]:
    """Translate a test set (`generate_kwargs` go to `generate`; `progress`: a progress bar on stderr) and score it
    (unrounded): sacreBLEU and chrF2 with their signatures, the paper's tokenized BLEU, BLEU on lowercased
    Moses-tokenized text (the Multi30k literature's number) with its signature, and BLEU on the text's whitespace
    tokens (fairseq's scorer: the published Multi30k number on prepared text)."""
    # Here, not at the top: evaluate and sacrebleu take seconds to import, which forced decoding and the CLI's parser
    # (NORMALIZATIONS) do without.
    from .metrics import corpus_scores, lowercased_tokenized_bleu, tokenized_bleu, whitespace_bleu

    hypotheses = translator.translate(sources, batch_size=batch_size, progress=progress, **generate_kwargs)
    scores = corpus_scores(hypotheses, references)
    report = {name: scores[name] for name in ("bleu", "chrf", "bleu_signature", "chrf_signature")}
    report["tokenized_bleu"] = tokenized_bleu(hypotheses, references, lang=target_lang)
    lowercased = lowercased_tokenized_bleu(hypotheses, references, lang=target_lang)
    report["lowercased_tokenized_bleu"] = lowercased["bleu"]
    report["lowercased_tokenized_bleu_signature"] = lowercased["signature"]
    report["whitespace_bleu"] = whitespace_bleu(hypotheses, references)
    return hypotheses, report
