"""Loading a saved model folder safely, and batched work with it (sentences sorted by length, processed in batches,
returned in input order): translation, n-best lists with scores, scoring given translations (forced decoding) and
word alignments from the encoder-decoder attention."""

import contextlib
import copy
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from torch import nn
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as transformers_logging

from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import equivalent_power
from .metrics import corpus_scores, lowercased_tokenized_bleu, tokenized_bleu
from .modeling_vaswani import VaswaniForConditionalGeneration

# Characters that str.splitlines (and so text-mode readers and most viewers) treat as line ends. Only "\n" ends a line
# of a translation file; any other one inside a translation would make one input line two output lines.
LINE_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
LINE_BREAKS_TO_SPACES = str.maketrans(dict.fromkeys("\n" + LINE_BREAKS, " "))


def read_sentences(source: BinaryIO, name: str) -> list[str]:
    """The lines of UTF-8 text, split at "\\n" only (and a "\\r" just before it), without their line ends.

    Text-mode reading and str.splitlines also split at a lone "\\r", "\\x0c", "\\u2028" and more, which inside a
    sentence would make one input line two translations.
    """
    try:
        text = source.read().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} is not UTF-8 text: {error}") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the line end of the last line, or an empty input: no line after it
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def as_one_line(text: str) -> str:
    """`text` with every character that some reader takes for a line end replaced by a space."""
    return text.translate(LINE_BREAKS_TO_SPACES)


def write_lines(lines: Iterable[str], target: TextIO) -> None:
    """One line per item, each made one line (`as_one_line`), so that output line i belongs to input line i."""
    target.writelines(as_one_line(line) + "\n" for line in lines)


def current_umask() -> int:
    """The process's file-creation mask (reading it means setting it, so it is set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def write_lines_atomically(lines: Iterable[str], path: str | Path) -> Path:
    """`write_lines` into `path` by way of a temporary file beside it, renamed when complete.

    A failure (disk full, interrupt) then leaves neither a half-written file nor a damaged earlier one.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with open(handle, "w", encoding="utf-8", newline="\n") as target:
            write_lines(lines, target)
        os.chmod(temporary, 0o666 & ~current_umask())  # mkstemp's private 0600, made what open() would have given
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def check_device(device: str) -> torch.device:
    """`device` as a torch.device, refused (ValueError) when malformed or when its backend is not available here."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1): {error}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available on this machine")
    return parsed


def check_generation_options(
    num_beams: int | None = None, length_penalty: float | None = None, max_new_tokens: int | None = None
) -> None:
    """Refuse (ValueError) decoding values that `generate` would crash on or silently misuse; None means the default."""
    if num_beams is not None and num_beams < 1:
        raise ValueError(f"num_beams must be at least 1, got {num_beams}")
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


def read_config_dict(path: str | Path) -> dict:
    """config.json of a model folder or Hub repo as plain JSON: nothing it names is imported or run.

    A path that exists here is a local folder; anything else is tried as a Hub id, if it has the form of one.
    """
    if Path(path).exists():
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path} is not a model folder: it holds no config.json")
        try:
            return json.loads(config_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{config_file} is not valid JSON: {error}") from None
    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise ValueError(f"no model folder at {path}") from None
    try:
        return PretrainedConfig.get_config_dict(str(path))[0]
    except OSError as error:  # transformers wraps every Hub failure (not found, offline, gated) in an OSError
        first_line = str(error).splitlines()[0]
        raise ValueError(
            f"no model folder at {path}, and no Hub model of that id could be read: {first_line}"
        ) from None


@contextlib.contextmanager
def transformers_reports_silenced() -> Iterator[None]:
    # The load report (a table of missing and mismatched weights) is replaced by one error message of our own, and the
    # loading progress bar would stand between the command and that message.
    verbosity = transformers_logging.get_verbosity()
    progress_bar = transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if progress_bar:
            transformers_logging.enable_progress_bar()


def check_loading_info(path: str | Path, loading_info: dict) -> None:
    """Refuse weights that do not match the config: transformers would fill the gaps with random values."""
    problems = {
        "missing": sorted(loading_info["missing_keys"]),
        "unexpected": sorted(loading_info["unexpected_keys"]),
        "of another shape": sorted(
            f"{name} ({list(saved)} saved, {list(expected)} expected)"
            for name, saved, expected in loading_info["mismatched_keys"]
        ),
    }
    found = [f"{len(names)} {kind} (first: {names[0]})" for kind, names in problems.items() if names]
    if found:
        raise ValueError(f"the weights of {path} do not match its config.json: tensors {'; '.join(found)}")


def load_model_folder(
    path: str | Path, device: str = "cpu", int8: bool = False, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A saved model folder (or Hub id) and its tokenizer, loaded without running any code the folder ships.

    config.json is read as plain JSON first. Model type "vaswani" loads with this package's classes, whatever Python
    files lie in the folder; another model type is refused unless `trust_remote_code`, which hands the folder to the
    Auto classes and so runs its code. Weights are read from safetensors only (a pickle can run code too) and must
    match the config exactly. Every refusal is a ValueError naming the folder and the cause in one line.
    """
    check_device(device)
    if int8 and torch.device(device).type != "cpu":
        raise ValueError(f"int8 inference runs on CPU, not on {device}")
    model_type = read_config_dict(path).get("model_type")
    if model_type != VaswaniConfig.model_type and not trust_remote_code:
        raise ValueError(
            f"{path} holds a model of type {model_type!r}, not {VaswaniConfig.model_type!r}; loading it would run "
            "code from the folder (allow that with trust_remote_code)"
        )
    model_class = VaswaniForConditionalGeneration if model_type == VaswaniConfig.model_type else AutoModelForSeq2SeqLM
    try:
        with transformers_reports_silenced():
            model, loading_info = model_class.from_pretrained(
                path,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported in loading_info and refused below, instead of a traceback
            )
    except SafetensorError as error:
        raise ValueError(f"the weights of {path} (model.safetensors) are damaged: {error}") from None
    except OSError as error:  # no weights file, or not a safetensors one
        raise ValueError(f"cannot load the weights of {path}: {str(error).splitlines()[0]}") from None
    check_loading_info(path, loading_info)
    try:
        # Explicitly False rather than the default None: a folder with a custom tokenizer then raises instead of
        # asking "run the custom code? [y/N]" on the terminal, which would read a line of the data on stdin.
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load the tokenizer of {path}: {str(error).splitlines()[0]}") from None
    model = model.to(device)
    return quantize_int8(model) if int8 else model, tokenizer


def quantize_int8(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` for CPU inference whose Linear layers hold int8 weights and quantize their inputs on the fly.

    Dynamic quantization (per-tensor int8 weights, activations scaled per batch, int32 accumulation) from torch's
    `torch.ao.quantization`; embeddings and layer norms stay float32. About twice the beam-search speed of float32 on
    a CPU with AVX-512 VNNI, for a BLEU change within noise (README, "Performance").
    """
    if model.device.type != "cpu":
        raise ValueError(f"int8 inference runs on CPU; the model is on {model.device}")
    with warnings.catch_warnings():
        # torch.ao's eager quantization is deprecated in favour of torchao, whose CPU int8 kernels need torch.compile
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.ao")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        quantized = copy.deepcopy(model).eval()
        for module in quantized.modules():
            if isinstance(module, nn.Linear):
                module.__class__ = nn.Linear  # torch.ao swaps exact nn.Linear only (VaswaniLinear is one)
        return torch.ao.quantization.quantize_dynamic(quantized, {nn.Linear}, dtype=torch.qint8, inplace=True)


def check_batch(sentences: Sequence[str], batch_size: int, name: str = "sentences") -> None:
    """Refuse (ValueError) one string where a list of them is meant, and a batch size below 1."""
    if isinstance(sentences, str):  # a str is a Sequence[str] too: each character would be processed on its own
        raise ValueError(f"{name} must be a list of strings, not one string: pass [text]")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")


def length_sorted_batches(indices: Iterable[int], length: Callable[[int], int], batch_size: int) -> list[list[int]]:
    """`indices` sorted by `length` and cut into batches of `batch_size`: similar lengths keep padding, and so wasted
    computation, small. Callers put results back in input order by these indices."""
    order = sorted(indices, key=length)
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int = 64,
    progress: bool = True,
    **generate_kwargs,
) -> list[str]:
    """Translate `sentences` with `model.generate` (its generation config, overridable by `generate_kwargs`).

    A blank sentence translates to "" without decoding (there is nothing to translate, and a model would invent text).
    """
    check_batch(sentences, batch_size)
    check_generation_options(
        generate_kwargs.get("num_beams"), generate_kwargs.get("length_penalty"), generate_kwargs.get("max_new_tokens")
    )
    batches = length_sorted_batches(
        (i for i, sentence in enumerate(sentences) if sentence.strip()), lambda i: len(sentences[i]), batch_size
    )
    translations: list[str] = [""] * len(sentences)
    model.eval()
    with packed_weights(model):
        for indices in tqdm(batches, desc="Translating", disable=not progress, unit="batch"):
            batch = tokenizer([sentences[i] for i in indices], return_tensors="pt", padding=True).to(model.device)
            with torch.inference_mode():
                generated = model.generate(**batch, **generate_kwargs)
            for i, text in zip(indices, tokenizer.batch_decode(generated, skip_special_tokens=True), strict=True):
                translations[i] = text
    return translations


def packed_weights(model: PreTrainedModel) -> contextlib.AbstractContextManager[None]:
    """The model's decoding weights packed once for a loop of `generate` calls (`packed_weights` of this package's
    models; other models, such as MarianMTModel, have nothing to pack)."""
    pack = getattr(model, "packed_weights", None)
    return pack() if pack is not None else contextlib.nullcontext()


def check_nbest(k: int, num_beams: int | None = None) -> None:
    """Refuse (ValueError) an n-best list size below 1, or one that `num_beams` (None: the default) cannot hold."""
    if k < 1:
        raise ValueError(f"the n-best list size must be at least 1, got {k}")
    if num_beams is not None and num_beams < max(k, 2):  # greedy search (1 beam) gives no sequence scores
        raise ValueError(f"an n-best list of {k} needs beam search with num_beams >= {max(k, 2)}, got {num_beams}")


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
    check_batch(sentences, batch_size)
    num_beams = generate_kwargs.pop("num_beams", None)
    check_nbest(k, num_beams)
    if num_beams is None:
        num_beams = max(k, model.generation_config.num_beams or 1, 2)
    check_generation_options(num_beams, generate_kwargs.get("length_penalty"), generate_kwargs.get("max_new_tokens"))
    batches = length_sorted_batches(
        (i for i, sentence in enumerate(sentences) if sentence.strip()), lambda i: len(sentences[i]), batch_size
    )
    nbest: list[list[Hypothesis]] = [[] for _ in sentences]
    model.eval()
    with packed_weights(model):
        for indices in tqdm(batches, desc="Translating", disable=not progress, unit="batch"):
            batch = tokenizer([sentences[i] for i in indices], return_tensors="pt", padding=True).to(model.device)
            with torch.inference_mode():
                output = model.generate(
                    **batch,
                    num_beams=num_beams,
                    num_return_sequences=k,
                    output_scores=True,
                    return_dict_in_generate=True,
                    **generate_kwargs,
                )
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


def alignment_text(alignment: Sequence[tuple[int, int]]) -> str:
    """Moses/fast_align's form: "i-j" pairs of 0-based source word i and target word j, separated by spaces."""
    return " ".join(f"{source}-{target}" for source, target in alignment)


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
    default_type = "gnmt" if model.config.model_type == VaswaniConfig.model_type else "power"
    alpha = config.length_penalty
    if getattr(config, "length_penalty_type", default_type) == "gnmt":
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
        raise ValueError("targets must be a list of strings, not one string: pass [text]")
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets: each source needs one target")
    if not sources:  # a fast tokenizer fails on an empty batch
        return [], []
    source_ids = tokenizer(list(sources))["input_ids"]
    target_ids = tokenizer(text_target=list(targets))["input_ids"]
    limit = position_limit(model.config)
    for number, pair in enumerate(zip(source_ids, target_ids, strict=True), start=1):
        for side, ids in zip(("source", "target"), pair, strict=True):
            if limit is not None and len(ids) > limit:
                raise ValueError(
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
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZATIONS)}; got {normalize!r}")
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
        raise ValueError(f"layer {layer} does not exist: the decoder has layers 0 to {layers - 1} (or -1 to -{layers})")


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
        raise ValueError("word alignments need a fast tokenizer: its character offsets map tokens to words")
    check_alignment_layer(model, layer)
    encode_pairs(model, tokenizer, sources, targets)  # refuses what the positions cannot hold, before any work
    batches = length_sorted_batches(range(len(sources)), lambda i: len(sources[i]) + len(targets[i]), batch_size)
    alignments: list[list[tuple[int, int]]] = [[] for _ in sources]
    model.eval()
    for indices in batches:
        source_texts, target_texts = [sources[i] for i in indices], [targets[i] for i in indices]
        source = tokenizer(source_texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
        target = tokenizer(text_target=target_texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
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


def translate_and_score(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[str],
    references: Sequence[str],
    target_lang: str,
    batch_size: int = 64,
) -> tuple[list[str], dict]:
    """Translate a test set and score it (unrounded): sacreBLEU and chrF2 with their signatures, the paper's tokenized
    BLEU, and BLEU on lowercased Moses-tokenized text (the Multi30k literature's number) with its signature."""
    hypotheses = translate(model, tokenizer, sources, batch_size=batch_size)
    scores = corpus_scores(hypotheses, references)
    report = {name: scores[name] for name in ("bleu", "chrf", "bleu_signature", "chrf_signature")}
    report["tokenized_bleu"] = tokenized_bleu(hypotheses, references, lang=target_lang)
    lowercased = lowercased_tokenized_bleu(hypotheses, references, lang=target_lang)
    report["lowercased_tokenized_bleu"] = lowercased["bleu"]
    report["lowercased_tokenized_bleu_signature"] = lowercased["signature"]
    return hypotheses, report
