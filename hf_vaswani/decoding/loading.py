"""Loading a saved model folder (or Hub id) and its tokenizer safely: no code the folder ships is run unless asked,
and weights that do not match the config are refused rather than filled with random values."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError, StrictDataclassError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as transformers_logging

from ..data.tokenization import read_tokenizer_file
from ..kernels.cpu import kernelize
from ..kernels.cpu_features import cpu_float_type_problem
from ..kernels.quantization import quantize_int8
from ..model.configuration_vaswani import VaswaniConfig
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import check_generation_settings
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from ..sharded_weights import has_sharded_weights, read_sharded_weights


def check_device(device: str) -> torch.device:
    """`device` as a torch.device, refused (ValueError) when malformed or when its backend is not available here."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise UsageError(f"device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1): {error}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r}: CUDA is not available on this machine")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UsageError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"device {device!r}: MPS is not available on this machine")
    return parsed


def read_config_dict(path: str | Path) -> dict:
    """config.json of a model folder or Hub repo as plain JSON: nothing it names is imported or run.

    A path that exists here is a local folder; anything else is tried as a Hub id, if it has the form of one.
    """
    if Path(path).exists():
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise UsageError(f"{path} is not a model folder: it holds no config.json")
        try:
            return json.loads(config_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise UsageError(f"{config_file} is not valid JSON: {error}") from None
    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise UsageError(f"no model folder at {path}") from None
    try:
        return PretrainedConfig.get_config_dict(str(path))[0]
    except OSError as error:  # transformers wraps every Hub failure (not found, offline, gated) in an OSError
        first_line = str(error).splitlines()[0]
        raise UsageError(
            f"no model folder at {path}, and no Hub model of that id could be read: {first_line}"
        ) from None


def one_line(error: Exception) -> str:
    """The message of `error` on one line."""
    return " ".join(str(error).split())


def check_config(path: str | Path, config_dict: dict) -> None:
    """Refuses a config.json whose values VaswaniConfig refuses, in one line naming the file."""
    try:
        VaswaniConfig.from_dict(config_dict)
    except (ValueError, StrictDataclassError) as error:  # strict's type errors are no ValueErrors
        raise UsageError(f"{Path(path) / 'config.json'}: {one_line(error)}") from None


def check_generation_config(path: str | Path) -> None:
    """Refuses a generation_config.json that `generate` would crash on or silently misuse, in one line naming the file.

    transformers' own loading would fall back to defaults silently for a file that is not JSON, and report its values
    without naming the file. Its `validate(strict=True)` is not used: it also refuses settings that are merely unused
    (a length penalty with one beam), which `vaswani train --num-beams 1` writes.
    """
    file = Path(path) / "generation_config.json"
    try:
        config = GenerationConfig.from_pretrained(path)  # runs transformers' `validate`
    except OSError as error:
        if file.is_file():
            raise UsageError(f"{file} is not valid JSON: {one_line(error)}") from None
        return  # none: transformers builds the defaults from config.json
    except ValueError as error:
        raise UsageError(f"{file}: {one_line(error)}") from None
    try:
        check_generation_settings(config.to_dict())
    except ValueError as error:
        raise UsageError(f"{file}: {error}") from None


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
        raise UsageError(f"the weights of {path} do not match its config.json: tensors {'; '.join(found)}")


# The float types a model folder may be loaded in for inference, by the names the commands take.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model_folder(
    path: str | Path,
    device: str = "cpu",
    int8: bool = False,
    trust_remote_code: bool = False,
    dtype: str = "fp32",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A saved model folder (or Hub id) and its tokenizer, loaded without running any code the folder ships.

    config.json is read as plain JSON first. Model type "vaswani" loads with this package's classes, whatever Python
    files lie in the folder; another model type is refused unless `trust_remote_code`, which hands the folder to the
    Auto classes and so runs its code. Weights are read from safetensors only (a pickle can run code too), or, in a
    Trainer checkpoint of weights sharded by FSDP, through torch's distributed checkpoint API; they must match the
    config exactly. Every refusal is a ValueError naming the folder and the cause in one line. This
    package's model gets its CPU kernels (`kernelize`). `dtype` (a DTYPES name) is the float type of its weights and
    computation, refused on a CPU without instructions for it; int8 quantizes float32 weights.
    """
    check_device(device)
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if int8 and torch.device(device).type != "cpu":
        raise UsageError(f"int8 inference runs on CPU, not on {device}")
    if int8 and dtype != "fp32":
        raise UsageError(f"int8 quantizes float32 weights: it goes with dtype fp32, not {dtype}")
    if torch.device(device).type == "cpu" and (problem := cpu_float_type_problem(DTYPES[dtype])):
        raise UsageError(f"dtype {dtype} on the CPU: {problem}; use fp32")
    config_dict = read_config_dict(path)
    model_type = config_dict.get("model_type")
    if model_type != VaswaniConfig.model_type and not trust_remote_code:
        raise UsageError(
            f"{path} holds a model of type {model_type!r}, not {VaswaniConfig.model_type!r}; loading it would run "
            "code from the folder (allow that with trust_remote_code)"
        )
    if model_type == VaswaniConfig.model_type:
        with transformers_reports_silenced():  # as for the loading below, which reads both files again
            check_config(path, config_dict)
            check_generation_config(path)
    model_class = VaswaniForConditionalGeneration if model_type == VaswaniConfig.model_type else AutoModelForSeq2SeqLM
    sharded = Path(path).is_dir() and has_sharded_weights(Path(path))
    try:
        with transformers_reports_silenced():
            source = {}
            if sharded:  # its config and its sharded weights read whole, in the place of a weights file
                config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
                source = {"config": config, "state_dict": read_sharded_weights(Path(path))}
            model, loading_info = model_class.from_pretrained(
                None if sharded else path,
                **source,
                trust_remote_code=trust_remote_code,
                use_safetensors=True,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported in loading_info and refused below, instead of a traceback
            )
            if sharded:  # given no folder, from_pretrained names none and makes transformers' generation config
                model.name_or_path = model.config.name_or_path = str(path)
                if (Path(path) / "generation_config.json").is_file():
                    model.generation_config = GenerationConfig.from_pretrained(path)
    except SafetensorError as error:
        raise UsageError(f"the weights of {path} (model.safetensors) are damaged: {error}") from None
    except OSError as error:  # no weights file, or not a safetensors one
        raise UsageError(f"cannot load the weights of {path}: {str(error).splitlines()[0]}") from None
    check_loading_info(path, loading_info)
    if (Path(path) / "tokenizer.json").is_file():
        read_tokenizer_file(Path(path) / "tokenizer.json")  # damage as one line naming it, not tokenizers' Exception
    try:
        # Explicitly False rather than the default None: a folder with a custom tokenizer then raises instead of
        # asking "run the custom code? [y/N]" on the terminal, which would read a line of the data on stdin.
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the tokenizer of {path}: {str(error).splitlines()[0]}") from None
    model = model.to(device=device, dtype=DTYPES[dtype])
    if isinstance(model, VaswaniForConditionalGeneration):
        kernelize(model)
    return quantize_int8(model) if int8 else model, tokenizer
