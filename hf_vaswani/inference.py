"""Loading a saved model folder safely, and batched translation with it: sentences sorted by length, decoded in batches,
returned in input order."""

import contextlib
import copy
import json
import math
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
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
from .metrics import corpus_scores, tokenized_bleu
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
    if isinstance(sentences, str):  # a str is a Sequence[str] too: each character would be translated on its own
        raise ValueError("sentences must be a list of strings, not one string: translate(model, tokenizer, [text])")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    check_generation_options(
        generate_kwargs.get("num_beams"), generate_kwargs.get("length_penalty"), generate_kwargs.get("max_new_tokens")
    )
    # Sorting by length keeps padding, and so wasted computation, small; results go back to the input order.
    order = sorted((i for i, sentence in enumerate(sentences) if sentence.strip()), key=lambda i: len(sentences[i]))
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
