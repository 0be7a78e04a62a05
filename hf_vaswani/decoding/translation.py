"""Translating sentences: `Translator`, the decoding engine, which owns what decoding keeps and is shared by any
number of threads; sentences sorted by length, decoded in batches, returned in input order; n-best lists with the
scores beam search ranked them by.

Shaped as CTranslate2's Translator, an object that owns its weights and is used by many threads: built from a model
folder (or a model) with its precision, device, step compilation and shortlist, it holds the model's decoding weights
packed for the CPU (once, at construction), its decoding steps compiled and captured on an accelerator (a code object
of its own: kernels/graphs.py) and their static caches, until `close()` or the end of its `with` block releases them.
A call takes what it uses at its start and sets nothing on the model's modules: threads decoding at once each get
what they would get alone.
"""

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..data.tokenization import encode_padded
from ..gpu_policy import default_device
from ..kernels.cpu import multiplying_by, pack_decoder_weights, packed_weights
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import check_generation_settings
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..text_io import alignment_text, as_one_line
from .search import SearchState, model_name, model_search_state, search
from .shortlist import Shortlist


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


ModelSource = str | os.PathLike | PreTrainedModel  # a model folder or Hub id, or a model


class Translator:
    """A model ready to decode, for any number of threads at once: `generate` (what `model.generate` returns, by the
    package's search), `translate` and `translate_nbest` (sentences in, text out).

    `model`: a model folder or Hub id (loaded by decoding/loading.py's `load_model_folder` with `device`, `dtype` and
    `int8`, its tokenizer with it), or a model (used as it is: `device`, `dtype` and `int8` are for folders); or a
    list of them, an ensemble: this package's models sharing one vocabulary, decoded together from the mean of their
    probabilities (decoding/search.py's `EnsembleDecoder`) with the first one's tokenizer and decoding settings.
    `compile`: the decoding steps on an accelerator compiled and, on CUDA, captured in CUDA graphs (True, the
    default), run eagerly (False), or compiled with these torch.compile options (a dict); CPU steps run eagerly.
    `shortlist`: a Shortlist, or a folder holding one (True: the (first) model folder's), used by every call unless
    the call gives its own. `frozen`: the models' weights do not change while the engine is open, so it packs them
    once; False (a model still training) packs them for each call and shares each model's steps and caches with
    `hf_vaswani.generate`.
    """

    def __init__(
        self,
        model: ModelSource | Sequence[ModelSource],
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        int8: bool = False,
        compile: bool | dict = True,
        shortlist: Shortlist | str | os.PathLike | bool | None = None,
        trust_remote_code: bool = False,
        frozen: bool = True,
    ):
        sources = [model] if isinstance(model, (str, os.PathLike, PreTrainedModel)) else list(model)
        if not sources:
            raise UsageError("an ensemble needs at least one model")
        given_models = any(isinstance(source, PreTrainedModel) for source in sources)
        if given_models and (device is not None or dtype is not None or int8):
            raise UsageError("device, dtype and int8 apply to a model folder: move, cast or quantize a model first")
        members = [loaded(source, device, dtype, int8, trust_remote_code) for source in sources]
        models = [member_model for member_model, _ in members]
        check_ensemble(models, [member_tokenizer for _, member_tokenizer in members])
        if shortlist is True:
            shortlist = getattr(models[0], "name_or_path", "")
        if isinstance(shortlist, (str, os.PathLike)):
            shortlist = Shortlist.load(shortlist, models[0].config.vocab_size)
        self.models = tuple(member_model.eval() for member_model in models)
        self.model = self.models[0]  # whose tokenizer and decoding settings the engine uses
        self.tokenizer = tokenizer or members[0][1]
        self.shortlist = shortlist or None
        self.frozen = frozen
        self._states = [
            SearchState(model_name(member_model), compile) if frozen else model_search_state(member_model)
            for member_model in self.models
        ]
        self._packed = pack_decoder_weights(*self.models) if frozen else None
        self._tokenizing = threading.Lock()  # a fast tokenizer's settings are the Rust object's: one call at a time
        self._closed = False

    def __enter__(self) -> "Translator":
        return self

    def __exit__(self, *exception) -> None:
        self.close()

    def close(self) -> None:
        """Releases the packed weights, the compiled steps and the static caches (an unfrozen engine's are the
        model's, kept for `hf_vaswani.generate`); the engine then refuses calls. Calls already running finish."""
        self._closed = True
        self._packed = None
        if self.frozen:
            for state in self._states:
                state.clear()

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        shortlist: Shortlist | None = None,
        **kwargs,
    ):
        """`hf_vaswani.generate` on the engine's model: what `model.generate(inputs, generation_config, **kwargs)`
        returns, by the package's search where it covers the call; `shortlist` (default: the engine's) scores only
        the tokens it lists."""
        with self._decoding():
            return search(self.models, self._states, inputs, generation_config, shortlist or self.shortlist, kwargs)

    def _decoding(self) -> AbstractContextManager[None]:
        """The packed weights in use in this thread for the block: the engine's, or packed for it."""
        packed = self._packed
        if self._closed:
            raise UsageError("this Translator is closed: make a new one to decode")
        return packed_weights(*self.models) if packed is None else multiplying_by(packed)

    def translate(
        self, sentences: Sequence[str], batch_size: int = 64, progress: bool = False, **generate_kwargs
    ) -> list[str]:
        """Translate `sentences` by the package's search (the model's generation config, overridable by
        `generate_kwargs`, `shortlist=` among them). A blank sentence translates to "" without decoding (there is
        nothing to translate, and a model would invent text)."""
        check_generation_settings(generate_kwargs)
        translations: list[str] = [""] * len(sentences)
        with self._decoding():
            for indices, generated in self._decoded_batches(sentences, batch_size, progress, generate_kwargs):
                with self._tokenizing:
                    texts = self.tokenizer.batch_decode(generated, skip_special_tokens=True)
                for i, text in zip(indices, texts, strict=True):
                    translations[i] = text
        return translations

    def translate_nbest(
        self, sentences: Sequence[str], k: int, batch_size: int = 64, progress: bool = False, **generate_kwargs
    ) -> list[list["Hypothesis"]]:
        """The `k` best finished hypotheses of beam search for each sentence, best first, with their scores.

        `generate(num_return_sequences=k, output_scores=True, return_dict_in_generate=True)`: `sequences_scores` is
        the final score (the model's length penalty, GNMT's by default), `compute_transition_scores` gives the token
        log-probabilities. `num_beams` defaults to the larger of `k` and the model's own (paper: 4); a smaller one is
        refused. A blank sentence gets an empty list (nothing to translate).
        """
        num_beams = generate_kwargs.pop("num_beams", None)
        check_nbest(k, num_beams)
        if num_beams is None:
            num_beams = max(k, self.model.generation_config.num_beams or 1, 2)
        check_generation_settings(generate_kwargs)
        options = dict(num_beams=num_beams, num_return_sequences=k, output_scores=True, return_dict_in_generate=True)
        nbest: list[list[Hypothesis]] = [[] for _ in sentences]
        with self._decoding():
            for indices, output in self._decoded_batches(
                sentences, batch_size, progress, {**options, **generate_kwargs}
            ):
                token_log_probs = self.model.compute_transition_scores(
                    output.sequences, output.scores, output.beam_indices
                )
                generated = output.beam_indices >= 0  # a hypothesis' own steps; after its end come fill tokens
                outputs = output.sequences[:, output.sequences.shape[1] - generated.shape[1] :]
                with self._tokenizing:
                    texts = self.tokenizer.batch_decode(output.sequences, skip_special_tokens=True)
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

    def _decoded_batches(
        self, sentences: Sequence[str], batch_size: int, progress: bool, generate_kwargs: dict
    ) -> Iterator[tuple[list[int], Any]]:
        """Each batch of the non-blank `sentences`, sorted by length, as (their indices, the search's output for
        them): the one batching loop of translations and n-best lists, run where the packed weights are in use."""
        check_batch(sentences, batch_size)
        if self.tokenizer is None:
            raise UsageError("this Translator has no tokenizer: give one with the model, or use generate")
        batches = length_sorted_batches(
            (i for i, sentence in enumerate(sentences) if sentence.strip()), lambda i: len(sentences[i]), batch_size
        )
        for indices in tqdm(batches, desc="Translating", disable=not progress, unit="batch"):
            with self._tokenizing:
                batch = encode_padded(self.tokenizer, [sentences[i] for i in indices])
            batch = batch.to(self.model.device)
            with torch.inference_mode():
                yield indices, self.generate(**batch, **generate_kwargs)


def loaded(
    source: ModelSource, device: str | None, dtype: str | None, int8: bool, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A model and its folder's tokenizer (None for a model given as it is)."""
    if isinstance(source, PreTrainedModel):
        return source, None
    from .loading import load_model_folder

    return load_model_folder(source, device or default_device(), int8, trust_remote_code, dtype or "fp32")


def check_ensemble(models: Sequence[PreTrainedModel], tokenizers: Sequence[PreTrainedTokenizerBase | None]) -> None:
    """Refuse (UsageError) an ensemble whose models are not all this package's, on one device, with one vocabulary
    (the size and special ids of their configs; their folders' tokenizers' vocabularies)."""
    if len(models) == 1:
        return
    first, names = models[0], [model_name(model) for model in models]
    for model, tokenizer, name in zip(models, tokenizers, names, strict=True):
        if not isinstance(model, VaswaniForConditionalGeneration):
            raise UsageError(
                "an ensemble decodes by the package's loop, which takes only its own models: "
                f"{name} is a {type(model).__name__}"
            )
        if model.device != first.device:
            raise UsageError(
                f"an ensemble's models must be on one device: {names[0]} is on {first.device}, {name} on {model.device}"
            )
        differing = [key for key in VOCABULARY_SETTINGS if getattr(model.config, key) != getattr(first.config, key)]
        if (
            not differing
            and None not in (tokenizer, tokenizers[0])
            and tokenizer.get_vocab() != tokenizers[0].get_vocab()
        ):
            differing = ["their tokenizers' vocabularies"]
        if differing:
            raise UsageError(
                f"an ensemble's models must share one vocabulary: {names[0]} and {name} differ in "
                + ", ".join(differing)
            )


# What an ensemble's models must agree on: their outputs are averaged column by column.
VOCABULARY_SETTINGS = ("vocab_size", "pad_token_id", "eos_token_id", "decoder_start_token_id")


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int = 64,
    progress: bool = True,
    **generate_kwargs,
) -> list[str]:
    """`Translator.translate` with `model` as it is now (a model still training among them: `frozen=False`)."""
    return Translator(model, tokenizer, frozen=False).translate(sentences, batch_size, progress, **generate_kwargs)


def translate_nbest(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    k: int,
    batch_size: int = 64,
    progress: bool = False,
    **generate_kwargs,
) -> list[list["Hypothesis"]]:
    """`Translator.translate_nbest` with `model` as it is now (`frozen=False`)."""
    translator = Translator(model, tokenizer, frozen=False)
    return translator.translate_nbest(sentences, k, batch_size, progress, **generate_kwargs)


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
