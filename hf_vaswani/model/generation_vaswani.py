"""The paper's decoding (§6.1) on top of transformers' `generate`: GNMT length penalty and source-relative lengths.

Beam 4, length penalty alpha = 0.6 in GNMT's form lp(Y) = ((5 + |Y|) / 6)^alpha, at most input length + 50 output
tokens, early termination. transformers' beam search divides scores by |Y|^length_penalty and knows only absolute
maximum lengths, so both are added here; everything else (greedy, sampling, caches, compile) is stock `generate`.

Generation-config keys read here (saved in generation_config.json):
- `length_penalty_type`: "gnmt" (default for this model: `length_penalty` is GNMT's alpha) or "power" (transformers'
  score / |Y|^length_penalty).
- `max_new_tokens_over_source`: each sentence stops after (its source length + this many) new tokens, </s> included;
  None turns the cap off. An explicit `max_new_tokens` / `max_length` still applies on top.

The one `generate` override of the model is here, and the overrides of transformers' private hooks that it relies on
(tests/interop/test_private_api.py checks each against the installed transformers). Each call's choices travel with the
call: the penalty's form in the type of the `length_penalty` that transformers hands to its beam-search hooks, sharing
the encoder states in the inputs it hands to `_expand_inputs_for_generation`. This file travels to the Hub with
`trust_remote_code`: it imports only torch, transformers and the checks beside it (checks_vaswani.py).
"""

import copy
import math
import numbers

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import EncoderDecoderCache, StaticLayer
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
)
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils.deprecation import deprecate_kwarg

from .checks_vaswani import check_source
from .errors_vaswani import UsageError


class GnmtLengthPenalty(float):
    """A `length_penalty` that is GNMT's alpha: hypotheses are divided by ((5 + |Y|) / 6)^alpha, not |Y|^alpha.

    `generate` hands the length penalty of its call to the beam-search hooks below in this form when the call's
    `length_penalty_type` is "gnmt"; a plain float keeps transformers' power form.
    """


def equivalent_power(length: int, alpha: float) -> float:
    """The exponent p with length^p = lp_GNMT(length) = ((5 + length) / 6)^alpha (Wu et al. 2016, Eq. 14; §6.1).

    What transformers' `score / length^p` needs so that it divides by GNMT's penalty instead.
    """
    return alpha if length <= 1 else alpha * math.log((5.0 + length) / 6.0) / math.log(length)


def penalty_exponent(length: int, length_penalty: float) -> float:
    """The exponent of `length` that transformers' beam search divides by: GNMT's equivalent for a GnmtLengthPenalty,
    the penalty itself otherwise."""
    return equivalent_power(length, length_penalty) if isinstance(length_penalty, GnmtLengthPenalty) else length_penalty


class SourceLengthCapLogitsProcessor(LogitsProcessor):
    """Forces </s> once a hypothesis has (its source length + `extra_tokens` - 1) tokens, so none is longer (§6.1)."""

    def __init__(self, source_lengths: torch.Tensor, extra_tokens: int, eos_token_id: int, start_length: int = 1):
        self.source_lengths = source_lengths
        self.extra_tokens = extra_tokens
        self.eos_token_id = eos_token_id
        self.start_length = start_length  # the decoder prompt (start token) is not output

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows_at_cap = self.rows_at_cap(*input_ids.shape)
        if rows_at_cap.numel() == 0:  # most steps: no vocabulary-sized work at all
            return scores
        return self.force_end(scores.clone(), rows_at_cap)

    def rows_at_cap(self, rows: int, length: int) -> torch.Tensor:
        """Which of `rows` hypotheses of `length` tokens (the prompt included) must end at the next token."""
        return self.at_cap(rows, length).nonzero().squeeze(1)

    def at_cap(self, rows: int, length: int) -> torch.Tensor:
        """For each of `rows` hypotheses of `length` tokens (the prompt included), whether it must end at the next
        token."""
        # Beam search and num_return_sequences repeat each sentence's rows consecutively.
        rows_per_sentence = rows // self.source_lengths.shape[0]
        caps = self.source_lengths.repeat_interleave(rows_per_sentence) + self.extra_tokens
        generated = length - self.start_length
        return generated + 1 >= caps

    def force_end(self, scores: torch.FloatTensor, rows: torch.Tensor, eos_column: int | torch.Tensor | None = None):
        """`scores` (changed in place) with </s> the only choice in `rows`; </s> in column `eos_column` where the
        scores cover part of the vocabulary only (its id otherwise)."""
        rows = rows.to(scores.device)
        scores.index_fill_(0, rows, -math.inf)
        scores[rows, self.eos_token_id if eos_column is None else eos_column] = 0.0
        return scores


class BannedColumnsLogitsProcessor(LogitsProcessor):
    """Whole vocabulary columns set to -inf, in one pass for all of its rules: what transformers'
    NoBadWordsLogitsProcessor does for banned single tokens (`bad_words_ids`), and MinLengthLogitsProcessor
    (`min_length`, prompt included) and MinNewTokensLengthLogitsProcessor (`min_new_tokens`) do for the end tokens
    below a length.

    Each rule is (token ids, minimum length, prompt length to skip): its tokens score -inf while a hypothesis has fewer
    than the minimum tokens after the prompt; a ban is a rule with an infinite minimum. Theirs each pass over the whole
    vocabulary at every step: the ban builds a zero bias, adds the banned columns' -inf to it and adds it to the scores;
    each minimum copies the scores, searches the vocabulary for the end tokens and, below the length, rewrites every
    score. With a ban and `min_new_tokens` (which sets `min_length` too), seven vocabulary-sized passes a step; here one
    copy. Like them, this never changes the scores in place.
    """

    def __init__(self, rules: list[tuple[torch.Tensor, float, int]]):
        self.rules = rules

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids = self.banned_ids(input_ids.shape[-1], scores.shape[-1])
        return scores if ids is None else scores.index_fill(1, ids.to(scores.device), -math.inf)

    def in_force(self, length: int) -> tuple[bool, ...]:
        """For each rule, whether it bars its tokens at a step whose hypotheses hold `length` tokens."""
        return tuple(length - skipped < min_length for _, min_length, skipped in self.rules)

    def banned_ids(self, length: int, vocab_size: int) -> torch.Tensor | None:
        """The columns barred at a step whose hypotheses hold `length` tokens, or None when no rule bars any."""
        in_force = zip(self.rules, self.in_force(length), strict=True)
        banned = [ids.reshape(-1) for (ids, _, _), barring in in_force if barring]
        if not banned:
            return None
        ids = torch.cat(banned)
        return ids[(ids >= 0) & (ids < vocab_size)]  # theirs match only ids inside the vocabulary

    @staticmethod
    def rules_of(processor: LogitsProcessor, vocab_size: int) -> list[tuple[torch.Tensor, float, int]] | None:
        """`processor`'s rules if this class can do its work, else None."""
        if isinstance(processor, NoBadWordsLogitsProcessor):
            sequences = list(processor.sequence_bias)  # the bad words, end tokens already left out
            if any(len(sequence) != 1 for sequence in sequences):
                return None  # multi-token bad words depend on the tokens before: theirs handles them
            out_of_vocabulary = [token for (token,) in sequences if token >= vocab_size]
            if out_of_vocabulary:  # theirs raises this at its first call
                raise UsageError(
                    f"The model vocabulary size is {vocab_size}, but the following tokens were being biased: "
                    f"{out_of_vocabulary}"
                )
            return [(torch.tensor([token for (token,) in sequences]), math.inf, 0)]
        if isinstance(processor, MinNewTokensLengthLogitsProcessor):
            ids = torch.as_tensor(processor.eos_token_id)
            return [(ids, processor.min_new_tokens, processor.prompt_length_to_skip)]
        if isinstance(processor, MinLengthLogitsProcessor):
            return [(torch.as_tensor(processor.eos_token_id), processor.min_length, 0)]
        return None

    @classmethod
    def merging(cls, processors: LogitsProcessorList, vocab_size: int) -> LogitsProcessorList:
        """`processors` with each run of adjacent processors whose work this class can do replaced by one of it (they
        only set columns to -inf, so their order within a run does not matter)."""
        merged, current = LogitsProcessorList(), None
        for processor in processors:
            rules = cls.rules_of(processor, vocab_size)
            if rules is None:
                merged.append(processor)
                current = None
            elif current is not None:
                current.rules.extend(rules)
            else:
                current = cls(rules)  # a new one: a caller's own instance is never changed
                merged.append(current)
        return merged


# Settings that generate would crash on or silently misuse below these values: num_beams 0 divides by zero.
LEAST_COUNTS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "max_new_tokens": 1,
    "max_length": 1,
    "min_length": 0,
    "min_new_tokens": 0,
    "max_new_tokens_over_source": 0,
}
CHECKED_SETTINGS = (*LEAST_COUNTS, "length_penalty")
LENGTH_PENALTY_TYPES = ("gnmt", "power")  # the paper's (GNMT's, this model's default) and transformers' own


def check_generation_settings(settings: dict, names: dict[str, str] | None = None) -> None:
    """Refuses (UsageError naming the setting, as `names` calls it where given) values of a generation config, or of a
    `generate` call, that generate would crash on or silently misuse; a setting that is absent or None takes its
    default. transformers' own `GenerationConfig.validate` checks others (early_stopping) as a config is built. The one
    check of these values: the package's commands and settings check theirs here too."""
    names = names or {}
    for name, least in LEAST_COUNTS.items():
        value = settings.get(name)
        if value is not None and not (isinstance(value, numbers.Integral) and value >= least):
            raise UsageError(f"{names.get(name, name)} must be an integer of at least {least}, got {value!r}")
    penalty = settings.get("length_penalty")
    # NaN compares False with every score: every hypothesis would rank alike
    if penalty is not None and not (isinstance(penalty, numbers.Real) and math.isfinite(penalty)):
        raise UsageError(f"{names.get('length_penalty', 'length_penalty')} must be a finite number, got {penalty!r}")
    if settings.get("length_penalty_type") not in (None, *LENGTH_PENALTY_TYPES):
        name = names.get("length_penalty_type", "length_penalty_type")
        forms = " or ".join(repr(form) for form in LENGTH_PENALTY_TYPES)
        raise UsageError(f"{name} must be {forms}, got {settings['length_penalty_type']!r}")


BEAM_ONLY_SETTINGS = ("length_penalty", "length_penalty_type")


def check_given_beam_settings(given: dict, names: dict[str, str]) -> None:
    """Refuses (UsageError naming both, as `names` calls them) a beam-only setting that a user gave beside num_beams 1,
    greedy decoding, which ignores it. Only for settings given explicitly: a generation config keeps the paper's
    penalty when a call asks for greedy decoding."""
    if given.get("num_beams") != 1:
        return
    for name in BEAM_ONLY_SETTINGS:
        if given.get(name) is not None:
            raise UsageError(
                f"{names[name]} has no effect with {names['num_beams']} 1 (greedy decoding): leave one of them out"
            )


def length_penalty_type(config: GenerationConfig) -> str:
    """The form of length penalty `config` asks for: its `length_penalty_type`, GNMT's (§6.1) where it sets none."""
    value = getattr(config, "length_penalty_type", None)
    return LENGTH_PENALTY_TYPES[0] if value is None else value


class PaperDecodingMixin:
    """`generate` with §6.1's length penalty and source-relative maximum length; mixed into the generating model."""

    # as transformers' own generate: a cache given under its old name is read below under the new one
    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs):
        generation_config, kwargs = self.paper_decoding_request(inputs, generation_config, kwargs)
        output = super().generate(inputs, generation_config, **kwargs)
        if isinstance(getattr(output, "cache", None), EncoderDecoderCache):
            copy_shared_cross_attention_cache(output.cache)
        return output

    def paper_decoding_request(
        self, inputs: torch.Tensor | None, generation_config: GenerationConfig | None, kwargs: dict
    ) -> tuple[GenerationConfig | None, dict]:
        """A `generate` call's generation config and arguments as transformers' `generate` gets them: checked, the
        source-length cap as a logits processor and `max_new_tokens`, a GNMT penalty as a GnmtLengthPenalty."""
        kwargs = dict(kwargs)
        config = generation_config if generation_config is not None else self.generation_config
        source_ids = inputs if inputs is not None else kwargs.get("input_ids")
        check_source(source_ids, kwargs.get("inputs_embeds"), self.get_input_embeddings())
        extra = kwargs.pop("max_new_tokens_over_source", getattr(config, "max_new_tokens_over_source", None))
        penalty_type = kwargs.pop("length_penalty_type", None)
        penalty_type = length_penalty_type(config) if penalty_type is None else penalty_type
        settings = {name: self._call_setting(name, generation_config, kwargs) for name in CHECKED_SETTINGS}
        settings.update(max_new_tokens_over_source=extra, length_penalty_type=penalty_type)
        check_generation_settings(settings)
        source_lengths = self._source_lengths(inputs, kwargs) if extra is not None else None
        if source_lengths is not None:
            if kwargs.get("max_new_tokens") is None and kwargs.get("max_length") is None:
                kwargs["max_new_tokens"] = int(source_lengths.max()) + extra
            cap = SourceLengthCapLogitsProcessor(source_lengths, extra, self._eos_id(config))
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), cap])
        if penalty_type == "gnmt" and (self._call_setting("num_beams", generation_config, kwargs) or 1) > 1:
            alpha = self._call_setting("length_penalty", generation_config, kwargs)
            alpha = GnmtLengthPenalty(1.0 if alpha is None else alpha)  # None: transformers' default, 1.0
            if generation_config is None or "length_penalty" in kwargs:
                kwargs["length_penalty"] = alpha
            else:  # into a copy of the given config: an argument beside it would make transformers warn
                generation_config = copy.copy(generation_config)
                generation_config.length_penalty = alpha
        return generation_config, kwargs

    def _get_logits_processor(self, *args, **kwargs) -> LogitsProcessorList:
        processors = super()._get_logits_processor(*args, **kwargs)
        return BannedColumnsLogitsProcessor.merging(processors, self.config.vocab_size)

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, **model_kwargs):
        # transformers copies the encoder states and source mask num_beams times; the beams of a sentence share them
        # instead (cross-attention groups their queries), which saves the copies and reordering them every step. A
        # cache given to the call whose cross-attention part is filled already holds a row per beam: copies then.
        given_cache = model_kwargs.get("cache")
        if (
            getattr(given_cache, "cross_attention_cache", None) is not None
            and given_cache.cross_attention_cache.is_initialized
        ):
            return super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, **model_kwargs)
        shared = {key: model_kwargs.pop(key) for key in ("encoder_outputs", "attention_mask") if key in model_kwargs}
        input_ids, model_kwargs = super()._expand_inputs_for_generation(expand_size, False, **model_kwargs)
        return input_ids, {**model_kwargs, **shared}

    def _reorder_cache(self, cache: EncoderDecoderCache, beam_idx: torch.LongTensor):
        # Beam search moves hypotheses only among the beams of one sentence, whose cross-attention keys and values are
        # the same (shared or copied): only the self-attention cache needs reordering.
        cache.self_attention_cache.reorder_cache(beam_idx)
        return cache

    def _call_setting(self, name: str, generation_config: GenerationConfig | None, kwargs: dict):
        """A generation setting of one `generate` call as transformers resolves it: the argument, else the given
        generation config's, else the model's; None where none sets it (transformers' default applies)."""
        settings = (
            kwargs.get(name),
            getattr(generation_config, name, None),
            getattr(self.generation_config, name, None),
        )
        return next((value for value in settings if value is not None), None)

    @staticmethod
    def _source_lengths(inputs: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
        """Tokens per source sentence, padding excluded; None when generate gets no source to measure."""
        mask = kwargs.get("attention_mask")
        if mask is not None:
            return mask.sum(-1)
        source = inputs if inputs is not None else kwargs.get("input_ids")
        if source is None and isinstance(kwargs.get("encoder_outputs"), BaseModelOutput):
            source = kwargs["encoder_outputs"].last_hidden_state[..., 0]
        if source is None:
            return None
        return torch.full((source.shape[0],), source.shape[1], device=source.device)

    def _eos_id(self, config: GenerationConfig) -> int:
        eos = config.eos_token_id if config.eos_token_id is not None else self.config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos

    # transformers divides a finished hypothesis' log-probability by length ** length_penalty in these two places;
    # handing them, for a GNMT penalty, the exponent whose power equals lp_GNMT makes them apply GNMT's instead.
    def _update_finished_beams(self, *, cur_len: int, decoder_prompt_len: int, length_penalty: float, **kwargs):
        exponent = penalty_exponent(cur_len + 1 - decoder_prompt_len, length_penalty)
        return super()._update_finished_beams(
            cur_len=cur_len, decoder_prompt_len=decoder_prompt_len, length_penalty=exponent, **kwargs
        )

    def _check_early_stop_heuristic(
        self, *, cur_len: int, max_length: int, decoder_prompt_len: int, early_stopping, length_penalty: float, **kwargs
    ):
        # the length at which transformers bounds the best running score (see GenerationMixin)
        bound_length = max_length if early_stopping == "never" and length_penalty > 0.0 else cur_len
        exponent = penalty_exponent(bound_length - decoder_prompt_len, length_penalty)
        return super()._check_early_stop_heuristic(
            cur_len=cur_len,
            max_length=max_length,
            decoder_prompt_len=decoder_prompt_len,
            early_stopping=early_stopping,
            length_penalty=exponent,
            **kwargs,
        )


def copy_shared_cross_attention_cache(cache: EncoderDecoderCache) -> None:
    """Gives the cross-attention cache one row per decoder row, as stock tools expect of a cache `generate` returns.

    While generating, the beams (or returned sequences) of a sentence share one row of encoder keys and values
    (attend_with_shared_source); the cache handed back to the caller holds the copies transformers would have made.
    """
    batch_size = cache.self_attention_cache.layers[0].keys.shape[0] if cache.self_attention_cache.layers else 0
    for layer in cache.cross_attention_cache.layers:
        if getattr(layer, "keys", None) is None or not 0 < layer.keys.shape[0] < batch_size:
            continue
        if isinstance(layer, StaticLayer):  # fixed storage: allocated anew for the rows, as its first update does
            group = batch_size // layer.keys.shape[0]
            keys, values = layer.keys.repeat_interleave(group, 0), layer.values.repeat_interleave(group, 0)
            layer.lazy_initialization(keys, values)
            layer.keys.copy_(keys)
            layer.values.copy_(values)
        else:
            layer.batch_repeat_interleave(batch_size // layer.keys.shape[0])


def paper_generation_config(config, **overrides) -> GenerationConfig:
    """§6.1: beam 4, GNMT alpha 0.6, max output = input length + 50, early termination; special ids from `config`.

    With `num_beams=1` (greedy) the paper's penalty and early termination are left out: they act on beams only, and
    transformers refuses to save a greedy config that sets them."""
    settings = dict(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        num_beams=4,
        length_penalty=0.6,
        length_penalty_type="gnmt",
        max_new_tokens_over_source=50,
        early_stopping=True,
    )
    if overrides.get("num_beams") == 1:
        del settings["length_penalty"], settings["early_stopping"]
    return GenerationConfig(**{**settings, **overrides})
