"""The paper's decoding (§6.1) as a loop of the package's own: greedy and beam search computing what transformers'
`generate` computes for the requests it covers, with less work a step.

transformers' beam search, each step: copies the last position's logits, log-softmaxes them into a new tensor, applies
the processors (copies again), adds the beams' scores into a third beams x vocabulary tensor, takes the top 2k over
it, then gathers whole sequence buffers; its loop around the model adds input preparation and bookkeeping per step.
Here each step is one call of the decoder and output projection, then:
- the log-softmax written over the logits the projection just made (in place), the banned columns, minimum lengths and
  the source-length cap written into them in place;
- the top 2k of each row (one read; adding a row's score keeps its order, so the best 2k overall are among them), the
  beams' scores added to those 2k candidates only, the top 2k of the k x 2k;
- the self-attention cache reordered, the encoder states shared by a sentence's beams and never reordered;
- each step's tokens and back-pointers kept, sequences built once at the end.

Which candidates finish, the early-stopping rules and the returned scores are transformers' (`GenerationMixin`'s beam
search, transformers 5), computed by the same float32 operations, so the sequences and scores are equal
(tests/decoding/test_search.py). A request it does not cover (sampling, constraints, custom processors or stopping
criteria, streamers, attention or hidden-state outputs, a given cache) goes to the model's own `generate`, transformers'
loop: `covered_request` says which. The loop runs where it is called: `hf_vaswani.generate(model, ...)`, or the
decoding engine (decoding/translation.py's `Translator`), through which the package's commands decode; `model.generate`
is transformers' loop however the model was built or loaded.

An ensemble of models sharing one vocabulary decodes by this loop alone (transformers' has none): each step scores a
token by the log of the models' mean probability for it, as fairseq's ensemble does (`EnsembleDecoder`), under the
first model's decoding settings.
"""

import copy
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from weakref import WeakKeyDictionary

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
)
from transformers.generation.utils import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput

from ..gpu_policy import step_compilation
from ..kernels.cpu import packed_weights
from ..kernels.graphs import compiled_step
from ..model.checks_vaswani import values_wait_for_device
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import (
    BannedColumnsLogitsProcessor,
    SourceLengthCapLogitsProcessor,
    copy_shared_cross_attention_cache,
    penalty_exponent,
)
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from .shortlist import Shortlist

# Every GenerationConfig setting falls in one of three groups (tests/decoding/test_search.py checks that none is new):
READ_SETTINGS = {  # what this loop does with them is what transformers' greedy and beam search do
    "num_beams", "num_return_sequences", "max_new_tokens", "max_length", "min_length", "min_new_tokens",
    "bad_words_ids", "length_penalty", "early_stopping", "output_scores", "return_dict_in_generate",
    "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "do_sample", "use_cache",
}  # fmt: skip
UNREAD_SETTINGS = {  # settings of sampling, assisted decoding, static caches or bookkeeping: unused by these searches
    "temperature", "top_k", "top_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p", "top_h",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
    "target_lookbehind", "max_matching_ngram_size", "assistant_ensemble_weight", "max_cache_len", "cache_config",
    "compile_config", "disable_compile", "continuous_batching_config", "transformers_version", "_from_model_config",
}  # fmt: skip
INACTIVE_VALUES = {  # settings this loop covers only at these values, where they change nothing
    "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0), "guidance_scale": (None, 1.0),
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "remove_invalid_values": (None, False),
    "renormalize_logits": (None, False), "token_healing": (None, False), "low_memory": (None, False),
    "output_attentions": (None, False), "output_hidden_states": (None, False), "output_logits": (None, False),
    "is_assistant": (None, False), "use_mtp": (None, False),
    **dict.fromkeys((
        "sequence_bias", "forced_bos_token_id", "forced_eos_token_id", "exponential_decay_length_penalty",
        "suppress_tokens", "begin_suppress_tokens", "watermarking_config", "constraints", "force_words_ids",
        "stop_strings", "max_time", "dola_layers", "penalty_alpha", "prompt_lookup_num_tokens", "assistant_early_exit",
        "cache_implementation", "prefill_chunk_size", "speculation_type",
    ), (None,)),
}  # fmt: skip
COVERED_ARGUMENTS = {"input_ids", "attention_mask", "logits_processor"}  # other generate arguments: transformers' loop
# An accelerator's self-attention cache holds a multiple of this many positions: fewer shapes for captured steps.
CACHE_LENGTH_MULTIPLE = 32


@dataclass
class Request:
    """One `generate` call that this loop covers, resolved as transformers resolves it."""

    source_ids: torch.Tensor
    source_mask: torch.Tensor | None
    config: GenerationConfig
    banned: BannedColumnsLogitsProcessor | None
    cap: SourceLengthCapLogitsProcessor | None
    vocab_size: int
    max_length: int  # of an output, the start token included
    columns: torch.Tensor | None = None  # the vocabulary ids scored (a shortlist's, sorted), or None: all


def generate(
    model: VaswaniForConditionalGeneration,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    *,
    shortlist: Shortlist | None = None,
    **kwargs,
):
    """What `model.generate(inputs, generation_config, **kwargs)` returns, computed by this loop where it covers the
    call (`search`), its CPU decoding weights packed for the call, its compiled steps and static caches the model's
    (`model_search_state`). Any number of threads may call it at once, with one model or many. A decoding engine
    that owns these and packs its weights once: decoding/translation.py's `Translator`."""
    with packed_weights(model):
        return search([model], [model_search_state(model)], inputs, generation_config, shortlist, kwargs)


# The SearchState of each model that `generate` decodes, kept as long as the model lives (a Translator has its own).
MODEL_SEARCH_STATES: WeakKeyDictionary = WeakKeyDictionary()
MODEL_SEARCH_STATES_LOCK = threading.Lock()


def model_search_state(model: VaswaniForConditionalGeneration) -> "SearchState":
    """`model`'s SearchState for `generate`: its step compiled on an accelerator as gpu_policy says."""
    with MODEL_SEARCH_STATES_LOCK:
        if model not in MODEL_SEARCH_STATES:
            MODEL_SEARCH_STATES[model] = SearchState(model_name(model), compile=True)
        return MODEL_SEARCH_STATES[model]


def model_name(model: torch.nn.Module) -> str:
    """How warnings name `model`: its folder or Hub id, else its class and address."""
    return getattr(model, "name_or_path", "") or f"{type(model).__name__} at {id(model):#x}"


def search(
    models: Sequence[VaswaniForConditionalGeneration],
    states: Sequence["SearchState"],
    inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    shortlist: Shortlist | None,
    kwargs: dict,
):
    """What `model.generate(inputs, generation_config, **kwargs)` returns for the one model of `models`, computed by
    this loop where it covers the call (`covered_request`), with what its `states` entry keeps between calls, else by
    `model.generate`; for several models, the ensemble's output by this loop, the call read by the first model's
    settings. The CPU decoding weights multiply packed where the caller packed them (kernels/cpu.py's
    `multiplying_by`).

    `shortlist` scores only the tokens it lists for the batch's sources (and </s>); a call this loop does not cover is
    then refused, since transformers' loop scores the whole vocabulary.
    """
    model = models[0]
    request = covered_request(model, inputs, generation_config, kwargs)
    if not isinstance(request, Request):
        if shortlist is not None:
            raise UsageError(f"a shortlist needs the package's decoding loop, which does not cover {request}")
        if len(models) > 1:
            raise UsageError(f"an ensemble decodes by the package's loop only, which does not cover {request}")
        return model.generate(inputs, generation_config, **kwargs)
    if shortlist is not None:
        columns = shortlist.columns(request.source_ids, request.source_mask)
        eos = torch.tensor([request.config.eos_token_id], device=columns.device)
        request = dataclasses.replace(request, columns=torch.unique(torch.cat((columns, eos))))
    return decode(models, request, states)


def covered_request(
    model: VaswaniForConditionalGeneration, inputs: torch.Tensor | None, generation_config, kwargs: dict
) -> Request | str:
    """The call resolved as transformers' `generate` resolves it, or why this loop does not cover it."""
    generation_config, kwargs = model.paper_decoding_request(inputs, generation_config, kwargs)
    # transformers' merge of the call's arguments, its generation config and the model's (a private helper of
    # GenerationMixin, checked by tests/interop/test_private_api.py)
    config, arguments = model._prepare_generation_config(generation_config, **kwargs)
    if set(arguments) - COVERED_ARGUMENTS:
        return f"arguments {sorted(set(arguments) - COVERED_ARGUMENTS)}"
    source = inputs if inputs is not None else arguments.get("input_ids")
    if source is None or (inputs is not None and "input_ids" in arguments):
        return "a source other than input_ids"
    processors = list(arguments.get("logits_processor") or [])
    if any(type(processor) is not SourceLengthCapLogitsProcessor for processor in processors) or len(processors) > 1:
        return "logits processors of the caller"
    for name, inactive in INACTIVE_VALUES.items():
        if getattr(config, name, None) not in inactive:
            return f"{name}={getattr(config, name)!r}"
    eos = config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if len(eos) == 1 else None
    unmet = {
        "do_sample=True": config.do_sample,
        "use_cache=False": config.use_cache is False,
        "eos_token_id: none or several": eos is None,
        "pad_token_id=None": config.pad_token_id is None,
    }
    if any(unmet.values()):
        return next(reason for reason, holds in unmet.items() if holds)
    if config.num_beams == 1 and config.num_return_sequences != 1:
        return "greedy decoding with num_return_sequences > 1"
    if config.bad_words_ids is not None and any(len(words) != 1 for words in config.bad_words_ids):
        return "bad_words_ids of several tokens"
    config = copy.copy(config)
    config.eos_token_id = eos
    max_length = generated_length_cap(model, generation_config, kwargs, config)
    if max_length < 2:
        return f"max_length={max_length}: no token to generate"
    # without a mask transformers attends to the whole source of an encoder-decoder model, padding included
    mask = arguments.get("attention_mask")
    vocab_size = model.config.vocab_size
    banned = banned_columns(config, vocab_size)
    return Request(source, mask, config, banned, next(iter(processors), None), vocab_size, max_length)


def generated_length_cap(
    model: VaswaniForConditionalGeneration, generation_config: GenerationConfig | None, kwargs: dict, config
) -> int:
    """The longest output, the start token included, as transformers' `generate` sets it: max_new_tokens + 1, else a
    max_length that the call, its config or the model's set, else the default 20 new tokens within the model's
    max_position_embeddings."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens + 1
    set_somewhere = (
        kwargs.get("max_length") is not None
        or (generation_config is not None and generation_config.max_length is not None)
        or model.generation_config.max_length is not None
    )
    if set_somewhere:
        return config.max_length
    limit = getattr(model.config, "max_position_embeddings", None)
    return config.max_length + 1 if limit is None else min(config.max_length + 1, limit)


def banned_columns(config: GenerationConfig, vocab_size: int) -> BannedColumnsLogitsProcessor | None:
    """The bans and minimum lengths transformers' `generate` makes processors of for `config`, as one
    BannedColumnsLogitsProcessor, or None when there are none."""
    processors = LogitsProcessorList()
    if config.bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(config.bad_words_ids, config.eos_token_id))
    min_length = config.min_length if config.min_new_tokens is None else config.min_new_tokens + 1
    if min_length is not None and min_length > 0:
        processors.append(MinLengthLogitsProcessor(min_length, config.eos_token_id))
    if config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(1, config.min_new_tokens, config.eos_token_id))
    merged = BannedColumnsLogitsProcessor.merging(processors, vocab_size)
    return merged[0] if merged else None


class Decoder:
    """The decoder and output projection of `model` attending to one encoded batch, a step at a time; the projection
    over the request's columns only where it lists them (a shortlist)."""

    def __init__(self, model: VaswaniForConditionalGeneration, request: Request, state: "SearchState"):
        self.model = model
        self.state = state
        self.source_mask = request.source_mask
        self.encoder_states = model.get_encoder()(
            input_ids=request.source_ids, attention_mask=request.source_mask
        ).last_hidden_state
        # On an accelerator the self-attention cache is allocated once for the longest output (rounded up, so that
        # calls of nearby lengths share a shape) and written in place, its tensors keeping their addresses: each step
        # after the first (which fills the cross-attention cache) is then one compiled graph, replayed from a CUDA graph
        # on CUDA (`SearchState.step`). On the CPU the cache grows a position a step, so that reordering beams copies
        # only the positions made so far, and the steps run eagerly.
        self.steps_captured = values_wait_for_device(self.encoder_states)
        if self.steps_captured:
            rows = request.source_ids.shape[0] * request.config.num_beams
            cache_length = -(-request.max_length // CACHE_LENGTH_MULTIPLE) * CACHE_LENGTH_MULTIPLE
            self_attention = state.static_cache(model.config, rows, cache_length, self.encoder_states)
        else:
            self_attention = DynamicCache(config=model.config)
        self.cache = EncoderDecoderCache(self_attention, DynamicCache(config=model.config))
        self.projection = (
            model.lm_head if request.columns is None else state.projection_over(model.lm_head, request.columns)
        )
        self.steps_taken = 0

    def next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits (rows x columns) of the next token after each row's `tokens`: a tensor of their own, or on an
        accelerator the captured step's output, valid until the next step."""
        first = self.steps_taken == 0  # fills the cross-attention cache: eager
        compiled = self.state.step(self.encoder_states.device.type) if self.steps_captured and not first else None
        self.steps_taken += 1
        step = compiled or next_token_logits
        return step(self.model, self.projection, tokens, self.encoder_states, self.source_mask, self.cache)

    def reorder(self, rows: torch.Tensor) -> None:
        """The self-attention cache's rows in the order of `rows` (those continued), a static cache's in place."""
        cache = self.cache.self_attention_cache
        if not isinstance(cache, StaticCache):
            cache.reorder_cache(rows)
            return
        for layer in cache.layers:  # StaticLayer.reorder_cache would replace the tensors, and read their length
            if layer.is_initialized:
                layer.keys.copy_(layer.keys.index_select(0, rows))
                layer.values.copy_(layer.values.index_select(0, rows))


class EnsembleDecoder:
    """The Decoders of several models on one request, stepped together: a step's scores are the log of the models'
    mean probability of each token (fairseq's ensemble), log-probabilities already, which a log-softmax leaves as they
    are. Its `cache`, returned by a call that returns one, is the first model's."""

    def __init__(self, members: Sequence[Decoder]):
        self.members = members
        self.cache = members[0].cache

    def next_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 log of the members' mean probability (rows x columns) of the next token after each row's `tokens`."""
        log_probs = torch.stack([torch.log_softmax(member.next_logits(tokens), -1) for member in self.members])
        return torch.logsumexp(log_probs, 0).sub_(math.log(len(self.members)))

    def reorder(self, rows: torch.Tensor) -> None:
        """Every member's self-attention cache in the order of `rows`."""
        for member in self.members:
            member.reorder(rows)


def next_token_logits(
    model: VaswaniForConditionalGeneration,
    projection: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    encoder_states: torch.Tensor,
    source_mask: torch.Tensor | None,
    cache: EncoderDecoderCache,
) -> torch.Tensor:
    """One decoding step: float32 logits of the next token after each row's `tokens`, the caches updated."""
    hidden = model.model.decoder(
        input_ids=tokens[:, None],
        encoder_hidden_states=encoder_states,
        encoder_attention_mask=source_mask,
        cache=cache,
        use_cache=True,
    ).last_hidden_state
    return projection(hidden)[:, -1].float()


def projection_over(
    projection: torch.nn.Module, columns: torch.Tensor, int8_weights: tuple[torch.Tensor, torch.Tensor | None] | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output projection's product for `columns` only (its rows of those tokens), of its own kind: an int8
    projection (torch.ao's dynamically quantized Linear, whose weights unpacked are `int8_weights`) gives an int8
    product of the same values."""
    if isinstance(projection, torch.ao.nn.quantized.dynamic.Linear):
        weight, bias = int8_weights
        # index_select: indexing a quantized tensor with [] dequantizes it whole first. Then the ops torch.ao's
        # Linear runs, without building one: its constructor packs a placeholder weight as large as the listed rows
        rows = weight.index_select(0, columns)
        packed = torch.ops.quantized.linear_prepack(rows, None if bias is None else bias[columns])
        return partial(torch.ops.quantized.linear_dynamic, W_prepack=packed, reduce_range=True)
    bias = None if projection.bias is None else projection.bias[columns]
    return partial(torch.nn.functional.linear, weight=projection.weight[columns], bias=bias)


@dataclass(frozen=True)
class StepRules:
    """The request's rules as a step applies them, made once a call on the device of its scores, so that no step reads
    anything on the host for them: the banned columns at each hypothesis length (None: none), and where </s> is among
    the scored columns."""

    banned: list[torch.Tensor | None]
    eos_column: torch.Tensor

    @classmethod
    def of(cls, request: Request, device: torch.device) -> "StepRules":
        banned: list[torch.Tensor | None] = []
        columns_of_rules: dict[tuple[bool, ...], torch.Tensor | None] = {}  # the rules bar alike while alike in force
        for length in range(request.max_length + 1):
            if request.banned is None:
                banned.append(None)
                continue
            in_force = request.banned.in_force(length)
            if in_force not in columns_of_rules:
                ids = request.banned.banned_ids(length, request.vocab_size)
                columns_of_rules[in_force] = None if ids is None else column_positions(request, ids.to(device))
            banned.append(columns_of_rules[in_force])
        eos = torch.tensor([request.config.eos_token_id], device=device)
        return cls(banned, column_positions(request, eos))


def apply_rules(request: Request, rules: StepRules, scores: torch.Tensor, length: int) -> torch.Tensor:
    """`scores` (changed in place) with the request's banned columns and source-length cap at a step whose hypotheses
    hold `length` tokens, in transformers' order (its own processors, then the caller's)."""
    if rules.banned[length] is not None:
        scores.index_fill_(1, rules.banned[length], -math.inf)
    if request.cap is None:
        return scores
    if values_wait_for_device(scores):  # finding the rows at their cap would wait for the device: every row masked
        at_cap = request.cap.at_cap(scores.shape[0], length)[:, None]
        eos_scores = scores.index_select(1, rules.eos_column).masked_fill_(at_cap, 0.0)
        scores.masked_fill_(at_cap, -math.inf).index_copy_(1, rules.eos_column, eos_scores)
    else:  # on the CPU most steps find no row at its cap, and skip the vocabulary-sized work
        rows = request.cap.rows_at_cap(scores.shape[0], length)
        if rows.numel():
            request.cap.force_end(scores, rows, rules.eos_column)
    return scores


def column_positions(request: Request, ids: torch.Tensor) -> torch.Tensor:
    """Where vocabulary `ids` are among the scored columns (those not among them left out)."""
    if request.columns is None:
        return ids
    positions = torch.searchsorted(request.columns, ids).clamp_(max=request.columns.numel() - 1)
    return positions[request.columns[positions] == ids]


SPARE_STATIC_CACHES_KEPT = 4  # a SearchState's; the oldest goes first


class SearchState:
    """What the search keeps for one model between calls, safe for any number of threads decoding at once:

    - its decoding step on an accelerator, compiled (and captured in CUDA graphs on CUDA) on a code object of its own
      (kernels/graphs.py) as `compile` says (gpu_policy.py's `step_compilation`: True, False or torch.compile's
      options);
    - the static caches of its last calls on an accelerator, for the next call of the same shape: a captured step
      reads a cache at the addresses it was recorded with, and a new cache each call would record its graphs again.
      A call takes its cache out, so that two calls at once never share one, and puts it back unless it returns it;
    - an int8 output projection's weights, unpacked: torch.ao's int8 Linear unpacks its weight from fbgemm's layout at
      every weight() call, a pass over the whole matrix, and a shortlist's product takes rows of it every call.

    `owner` names the model in the warning of a step that falls back to eager. `clear()` releases all of it.
    """

    def __init__(self, owner: str, compile: bool | dict):
        self.owner = owner
        self.compile = compile
        self.lock = threading.Lock()
        self.steps: dict[str, Callable] = {}  # per device type
        self.spare_static_caches: dict[tuple, StaticCache] = {}
        self.int8_weights: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def step(self, device_type: str) -> Callable | None:
        """The compiled decoding step for `device_type`'s devices, or None: the step runs eagerly."""
        options = step_compilation(self.compile, device_type)
        if options is None:
            return None
        with self.lock:
            if device_type not in self.steps:
                self.steps[device_type] = compiled_step(next_token_logits, options, self.owner)
            return self.steps[device_type]

    def static_cache(self, config, rows: int, length: int, encoder_states: torch.Tensor) -> StaticCache:
        """A self-attention cache of `rows` x `length` positions: a spare one, emptied, or a new one."""
        key = (rows, length, encoder_states.dtype, encoder_states.device)
        with self.lock:
            spare = self.spare_static_caches.pop(key, None)
        if spare is None:
            return StaticCache(config=config, max_cache_len=length)
        spare.reset()
        return spare

    def keep_static_cache(self, cache: DynamicCache | StaticCache) -> None:
        """`cache` kept as a spare, if static."""
        if not isinstance(cache, StaticCache) or not cache.layers[0].is_initialized:
            return
        keys = cache.layers[0].keys
        with self.lock:
            self.spare_static_caches[(keys.shape[0], cache.layers[0].max_cache_len, keys.dtype, keys.device)] = cache
            while len(self.spare_static_caches) > SPARE_STATIC_CACHES_KEPT:
                del self.spare_static_caches[next(iter(self.spare_static_caches))]

    def projection_over(self, projection: torch.nn.Module, columns: torch.Tensor) -> Callable:
        """`projection_over` with the int8 weights unpacked once."""
        int8_weights = None
        if isinstance(projection, torch.ao.nn.quantized.dynamic.Linear):
            with self.lock:
                if projection not in self.int8_weights:
                    self.int8_weights[projection] = (projection.weight(), projection.bias())
                int8_weights = self.int8_weights[projection]
        return projection_over(projection, columns, int8_weights)

    def clear(self) -> None:
        """Releases the compiled steps, the spare caches and the unpacked weights."""
        with self.lock:
            self.steps.clear()
            self.spare_static_caches.clear()
            self.int8_weights.clear()


@torch.no_grad()
def decode(models: Sequence[VaswaniForConditionalGeneration], request: Request, states: Sequence[SearchState]):
    """What `model.generate` returns for `request` with the one model of `models`, or the ensemble's output for
    several, with what `states` keep between calls."""
    decoders = [Decoder(model, request, state) for model, state in zip(models, states, strict=True)]
    search = greedy_search if request.config.num_beams == 1 else beam_search
    output = search(request, decoders[0] if len(decoders) == 1 else EnsembleDecoder(decoders))
    if not request.config.return_dict_in_generate:
        for decoder, state in zip(decoders, states, strict=True):
            state.keep_static_cache(decoder.cache.self_attention_cache)
        return output.sequences
    copy_shared_cross_attention_cache(output.cache)
    return output


def greedy_search(request: Request, decoder: Decoder | EnsembleDecoder) -> GenerateEncoderDecoderOutput:
    """transformers' greedy decoding: the processed logits' argmax; finished rows get padding until all finish."""
    config = request.config
    rows = request.source_ids.shape[0]
    start = torch.full((rows,), config.decoder_start_token_id, device=request.source_ids.device)
    rules = StepRules.of(request, start.device)
    tokens, scores = [start], []
    unfinished = torch.ones(rows, dtype=torch.bool, device=start.device)
    while True:
        logits = apply_rules(request, rules, decoder.next_logits(tokens[-1]), len(tokens))
        if config.output_scores:
            scores.append(vocabulary_scores(request, logits))
        next_tokens = vocabulary_ids(request, logits.argmax(-1)).masked_fill_(~unfinished, config.pad_token_id)
        tokens.append(next_tokens)
        unfinished &= next_tokens != config.eos_token_id
        if len(tokens) >= request.max_length or not unfinished.any():  # the step's one read on the host
            break
    return GenerateEncoderDecoderOutput(
        sequences=torch.stack(tokens, 1), scores=tuple(scores) if config.output_scores else None, cache=decoder.cache
    )


def beam_search(request: Request, decoder: Decoder | EnsembleDecoder) -> GenerateBeamEncoderDecoderOutput:
    """transformers' beam search: of the best 2k continuations of a sentence's k beams, those among the first k that
    end go to its finished hypotheses (score / length penalty) if among the best k there, the best k that do not end
    continue; it stops as transformers' does (early_stopping True, False or "never")."""
    config = request.config
    beams, keep = config.num_beams, 2 * config.num_beams
    sentences = request.source_ids.shape[0]
    device = request.source_ids.device
    rules = StepRules.of(request, device)
    tokens = torch.full((sentences * beams,), config.decoder_start_token_id, device=device)
    max_length = request.max_length
    running_scores = torch.zeros((sentences, beams), device=device)
    running_scores[:, 1:] = -1.0e9  # the first step continues beam 0 only: the beams start alike
    finished_scores = torch.full((sentences, beams), -1.0e9, device=device)
    finished = torch.zeros((sentences, beams), dtype=torch.bool, device=device)
    finished_step = torch.full((sentences, beams), -1, device=device)  # -1: an empty slot
    finished_candidate = torch.zeros((sentences, beams), dtype=torch.long, device=device)
    improvable = torch.ones((sentences, 1), dtype=torch.bool, device=device)
    first_beams = torch.arange(keep, device=device) < beams
    row_offsets = torch.arange(sentences, device=device)[:, None] * beams
    candidates = torch.arange(keep, device=device).expand(sentences, keep)
    history: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per step: tokens, parents, continued
    all_scores = []
    while True:
        length = len(history) + 1  # tokens of each hypothesis, the start token included
        log_probs = decoder.next_logits(tokens)
        log_probs = apply_rules(request, rules, torch.log_softmax(log_probs, -1, out=log_probs), length)
        if config.output_scores:
            all_scores.append(vocabulary_scores(request, log_probs))
        row_best = min(keep, log_probs.shape[-1])
        best_log_probs, best_columns = log_probs.view(sentences, beams, -1).topk(row_best, dim=-1)
        best_tokens = vocabulary_ids(request, best_columns)
        totals = (best_log_probs + running_scores[:, :, None]).view(sentences, -1)
        candidate_scores, positions = totals.topk(keep, dim=-1)
        candidate_parents = positions // row_best
        candidate_tokens = best_tokens.view(sentences, -1).gather(1, positions)
        ends = candidate_tokens == config.eos_token_id
        if length + 1 >= max_length:
            ends.fill_(True)

        continuing_scores = candidate_scores + ends.to(torch.float32) * -1.0e9
        continued = continuing_scores.topk(beams)[1]
        running_scores = continuing_scores.gather(1, continued)

        # the start token is the prompt: hypotheses ending here hold `length` generated tokens, </s> included
        penalized = candidate_scores / (length ** penalty_exponent(length, config.length_penalty))
        full = torch.all(finished, dim=-1, keepdim=True) & (config.early_stopping is True)
        penalized += full.to(torch.float32) * -1.0e9
        penalized += (~improvable).to(torch.float32) * -1.0e9
        just_finished = ends & first_beams[None, :]
        penalized += (~just_finished) * -1.0e9
        merged_scores = torch.cat((finished_scores, penalized), dim=1)
        merged = torch.topk(merged_scores, k=beams)[1]
        finished_scores = merged_scores.gather(1, merged)
        finished = picked(finished, just_finished, merged)
        finished_step = picked(finished_step, torch.full_like(candidate_tokens, len(history)), merged)
        finished_candidate = picked(finished_candidate, candidates, merged)
        history.append((candidate_tokens, candidate_parents, continued))

        continued_rows = candidate_parents.gather(1, continued) + row_offsets
        decoder.reorder(continued_rows.view(-1))
        tokens = candidate_tokens.gather(1, continued).view(-1)

        # transformers' bound on what a running beam could still score (GenerationMixin._check_early_stop_heuristic)
        bound_length = length
        if config.early_stopping == "never" and config.length_penalty > 0.0:
            bound_length = max_length - 1
        best_possible = running_scores[:, :1] / (bound_length ** penalty_exponent(bound_length, config.length_penalty))
        worst_finished = torch.where(finished, torch.min(finished_scores, dim=1, keepdim=True)[0], -1.0e9)
        improvable = improvable & torch.any(best_possible > worst_finished, dim=-1, keepdim=True)
        open_beams = ~finished.all() | (config.early_stopping is not True)
        going_on = improvable.any() & open_beams & ~ends.all()
        # the step's one read on the host: whether to go on, and the longest hypothesis returned so far
        going_on, steps = torch.stack((going_on.long(), finished_step[:, : config.num_return_sequences].max())).tolist()
        if not going_on:
            break

    returned = config.num_return_sequences
    sequences, beam_indices = backtrack(
        history, finished_step[:, :returned], finished_candidate[:, :returned], row_offsets, fill_value(config), steps
    )
    start = torch.full((sequences.shape[0], 1), config.decoder_start_token_id, device=device)
    return GenerateBeamEncoderDecoderOutput(
        sequences=torch.cat((start, sequences), dim=1),
        sequences_scores=finished_scores[:, :returned].reshape(-1) if config.output_scores else None,
        scores=tuple(all_scores) if config.output_scores else None,
        beam_indices=beam_indices,
        cache=decoder.cache,
    )


def picked(kept: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Of `kept` (sentences x k) and `new` (sentences x 2k) side by side, the `columns` of each row."""
    return torch.cat((kept, new), dim=1).gather(1, columns)


def vocabulary_ids(request: Request, columns: torch.Tensor) -> torch.Tensor:
    """The vocabulary ids of positions among the scored columns."""
    return columns if request.columns is None else request.columns[columns]


def vocabulary_scores(request: Request, scores: torch.Tensor) -> torch.Tensor:
    """A copy of a step's scores over the whole vocabulary, -inf in the columns a shortlist left out (what `generate`
    returns as `scores`)."""
    if request.columns is None:
        return scores.clone()
    whole = scores.new_full((scores.shape[0], request.vocab_size), -math.inf)
    return whole.index_copy_(1, request.columns, scores)


def fill_value(config: GenerationConfig) -> int:
    """What transformers' beam search writes after a hypothesis' end: the padding id unless it is 0, then </s>."""
    return config.pad_token_id or config.eos_token_id


def backtrack(
    history: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    end_step: torch.Tensor,
    end_candidate: torch.Tensor,
    row_offsets: torch.Tensor,
    fill: int,
    last_end_step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of the hypotheses ending at candidate `end_candidate` of step `end_step` (sentences x returned, the
    last of them `last_end_step`), as rows (sentences * returned) x longest, `fill` after each end; and transformers'
    `beam_indices` (the decoder row each token continued, -1 after the end)."""
    length = last_end_step + 1
    sentences, returned = end_step.shape
    tokens = torch.full((sentences, returned, length), fill, dtype=torch.long, device=end_step.device)
    rows = torch.full((sentences, returned, length), -1, dtype=torch.int32, device=end_step.device)
    candidate = end_candidate.clone()
    for step in reversed(range(length)):
        step_tokens, parents, _ = history[step]
        candidate = torch.where(end_step == step, end_candidate, candidate)
        active = end_step >= step
        parent = parents.gather(1, candidate)
        tokens[:, :, step] = torch.where(active, step_tokens.gather(1, candidate), fill)
        rows[:, :, step] = torch.where(active, parent + row_offsets, -1)
        if step > 0:
            candidate = history[step - 1][2].gather(1, parent)
    return tokens.flatten(0, 1), rows.flatten(0, 1)
