"""Checks shared by the tests: the trained fixture's criterion, refused commands, code run without hf_vaswani, reads
on the host counted, transformers' example script's options."""

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from weakref import WeakKeyDictionary

import pytest
import torch
from tiny import random_model
from transformers import HfArgumentParser, Seq2SeqTrainingArguments

from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.decoding import search
from hf_vaswani.model import checks_vaswani, loss_vaswani, modeling_vaswani

REFUSE_HF_VASWANI = """
import sys


class RefuseHfVaswani:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_vaswani":
            raise ImportError("hf_vaswani is deliberately not importable here")


sys.meta_path.insert(0, RefuseHfVaswani())
"""


def run_without_hf_vaswani(script: str, args: list[str], workdir: Path) -> dict:
    """Run `script` in a fresh interpreter that cannot import hf_vaswani (as on a machine without it), offline.

    Returns the JSON object that the script prints on its last line.
    """
    path = workdir / "without_hf_vaswani.py"
    path.write_text(REFUSE_HF_VASWANI + textwrap.dedent(script))
    env = {**os.environ, "HF_HOME": str(workdir / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, str(path), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {result.stderr[-3000:]}"
    return json.loads(lines[-1])


RUN_TRANSLATION_OPTIONS = {
    "model_name_or_path",
    "trust_remote_code",
    "source_lang",
    "target_lang",
    "train_file",
    "validation_file",
    "test_file",
    "num_beams",
}
"""The options of transformers' run_translation.py that are its own (its ModelArguments and DataTrainingArguments)
and that docs/training.md gives: tests/interop/test_example_scripts.py runs the script's flow with each."""


def run_translation_options(arguments: list[str]) -> tuple[Seq2SeqTrainingArguments, dict[str, str]]:
    """run_translation.py's `arguments` as its parser takes them: the training arguments, by transformers' own parser,
    and the script's own options (each of RUN_TRANSLATION_OPTIONS, with a value) by name."""
    parser = HfArgumentParser(Seq2SeqTrainingArguments)
    training, rest = parser.parse_args_into_dataclasses(arguments, return_remaining_strings=True)
    flags, values = rest[::2], rest[1::2]
    assert len(flags) == len(values) and all(flag.startswith("--") for flag in flags), f"not option and value: {rest}"
    options = {flag.removeprefix("--"): value for flag, value in zip(flags, values, strict=True)}
    unknown = sorted(set(options) - RUN_TRANSLATION_OPTIONS)
    assert not unknown, (
        f"neither a training argument nor an option the tests run run_translation.py's flow with: {unknown}"
    )
    return training, options


def refused(capture: pytest.CaptureFixture, argv: list[str], *named: str) -> str:
    """Run `vaswani ARGV`, which must stop with exit code 2 and one line on stderr naming each of `named`: that line."""
    capture.readouterr()  # what the test's own set-up printed
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    error = capture.readouterr().err
    assert error.startswith(f"vaswani {argv[0]}: error: ") and error.count("\n") == 1, error
    for name in named:
        assert name in error, (name, error)
    return error


def timing_forbidden(products: dict) -> None:
    """Stands in for kernels/cpu.py's fastest where no kernel may be chosen by timing (full_determinism)."""
    raise RuntimeError("a kernel was chosen by timing under deterministic algorithms")


# How far int8 dynamic quantization may move the trained fixture's logits, in root mean square
# (tests/kernels/test_cpu.py): a rounding step of 1/127 of each operand's range is ~1% error, and the ~12 projections
# between the embeddings and a logit add up to ~5% of the logit scale (|logit| <= ~14). The largest single move
# varies with training: not bounded.
INT8_LOGIT_RMS_TOLERANCE = 0.7
# The trained fixture's margin: teacher-forced on every probe sentence, each right next token's logit exceeds every
# wrong one's by at least this. fp32 rounding differences between kernels, thread counts and processes move logits by
# ~1e-5, so no argmax along a right translation can flip: greedy decoding gives the same translations in every process,
# on every CPU (and in int8, whose model keeps every right token ahead: tests/kernels/test_cpu.py checks it).
LOGIT_MARGIN = 4.0


# The decoding paths the trained fixture is checked with, and tests compare: greedy, 4 beams with transformers' other
# defaults, and the model's generation config (§6.1: 4 beams, GNMT length penalty 0.6, early stopping).
DECODING_PATHS = {"greedy": dict(num_beams=1), "beam 4": dict(num_beams=4), "default": dict()}


def teacher_forced_logits(model, tokenizer, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of `model` fed the capitalised sentences as targets, and those targets (-100 at padding)."""
    inputs = tokenizer(sentences, text_target=[s.upper() for s in sentences], return_tensors="pt", padding=True)
    labels = inputs.pop("labels")
    labels = labels.masked_fill(labels == tokenizer.pad_token_id, -100)
    with torch.no_grad():
        return model(**inputs, labels=labels).logits, labels


def smallest_logit_margin(model, tokenizer, sentences: list[str]) -> float:
    """Teacher-forced on the capitalised sentences: the least, over target tokens, of right logit - best wrong logit."""
    logits, labels = teacher_forced_logits(model, tokenizer, sentences)
    targets = labels.clamp(min=0).unsqueeze(-1)
    right = logits.gather(-1, targets).squeeze(-1)
    best_wrong = logits.scatter(-1, targets, -torch.inf).amax(-1)
    return (right - best_wrong)[labels != -100].min().item()


def mistranslations(model, tokenizer, sentences: list[str], **generate_options) -> list[tuple[str, str]]:
    """(sentence, translation) for each sentence that `model.generate` does not translate to its capitalised form."""
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    translations = tokenizer.batch_decode(model.generate(**batch, **generate_options), skip_special_tokens=True)
    return [(s, t) for s, t in zip(sentences, translations, strict=True) if t != s.upper()]


def padded_batch(
    vocab_size: int, lengths: list[int], seed: int = 1, pad_token_id: int = 0, eos_token_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (never special ids 0-3) right-padded to the longest length, with the attention mask; each
    sentence ends in `eos_token_id` where one is given."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (len(lengths), max(lengths)), generator=generator)
    if eos_token_id is not None:
        ids[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = eos_token_id
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, pad_token_id), mask.long()


# --- Untrained models whose decoding is checked by exhaustive search or against transformers' loop -------------------

EOS = 2


def peaked_model(seed: int, vocab_size: int = 6, **overrides) -> VaswaniForConditionalGeneration:
    """Untrained, with an untied output layer scaled up so that next-token distributions are far from uniform."""
    untied = dict(share_embeddings=False, tie_word_embeddings=False)
    model = random_model(seed, vocab_size=vocab_size, **untied, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def offset_eos_logit(model: VaswaniForConditionalGeneration, offset: float) -> None:
    """Add exactly `offset` to the </s> logit at every step: one model dimension becomes a constant 1 feature."""
    with torch.no_grad():
        final_norm = model.model.decoder.layers[-1].feed_forward_norm
        final_norm.weight[0], final_norm.bias[0] = 0.0, 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[EOS, 0] = offset


def exhaustive_scores(models: list, source: torch.Tensor, max_new_tokens: int, alpha: float) -> dict:
    """Every possible output up to max_new_tokens, scored by teacher forcing: log P(Y|X) / lp(|Y|) in both forms, P
    the product over Y's tokens of the models' mean probability of each (one model's own for a list of one)."""
    model = models[0]
    vocab = model.config.vocab_size
    non_eos = [t for t in range(vocab) if t != EOS]
    candidates = [(*prefix, EOS) for n in range(max_new_tokens) for prefix in itertools.product(non_eos, repeat=n)]
    candidates += list(itertools.product(non_eos, repeat=max_new_tokens))  # stopped by the length limit
    scores = {}
    with torch.no_grad():
        encoded = [member.get_encoder()(input_ids=source) for member in models]
        for candidate in candidates:
            decoder_input = torch.tensor([[model.config.decoder_start_token_id, *candidate[:-1]]])
            probabilities = [
                member(encoder_outputs=encoder_outputs, decoder_input_ids=decoder_input).logits.softmax(-1)
                for member, encoder_outputs in zip(models, encoded, strict=True)
            ]
            log_probs = torch.stack(probabilities).mean(0).log()
            total = sum(float(log_probs[0, i, token]) for i, token in enumerate(candidate))
            length = len(candidate)
            scores[candidate] = {
                "gnmt": total / ((5 + length) / 6) ** alpha,  # Wu et al. 2016 / §6.1
                "power": total / length**alpha,  # transformers' form
            }
    return scores


def best(scores: dict, form: str) -> tuple[tuple, float]:
    ranked = sorted(scores, key=lambda c: scores[c][form], reverse=True)
    return ranked[0], scores[ranked[0]][form] - scores[ranked[1]][form]


def strip(sequence: torch.Tensor) -> tuple:
    tokens = sequence.tolist()[1:]  # drop the decoder start token
    return tuple(tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens)


def sharpened(model):
    """`model` with its output layer scaled up: untrained models spread probability evenly, and beams then end at
    similar lengths; peaked distributions give hypotheses of many lengths, ends among them."""
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


# --- What the model must not do on an accelerator, counted on the CPU -----------------------------------------------

# The Python-level calls that hand a tensor's values to the host: on an accelerator each waits for the device.
HOST_READS = ("item", "__bool__", "__int__", "__float__", "tolist", "nonzero")


def take_tensors_as_on_an_accelerator(
    monkeypatch: pytest.MonkeyPatch, step_backend: str | Callable = "aot_eager"
) -> None:
    """Every tensor taken for one on an accelerator by the code that asks (`values_wait_for_device`); decoding steps,
    captured there, compiled as on an accelerator but by `step_backend` (not inductor: its CPU compilation takes long),
    as one graph (fullgraph: a break fails) and without dynamic shapes, so that each recompilation shows."""
    for module in (checks_vaswani, loss_vaswani, modeling_vaswani, search):
        monkeypatch.setattr(module, "values_wait_for_device", lambda tensor: True)
    emulated = {"backend": step_backend, "dynamic": False, "fullgraph": True}
    monkeypatch.setattr(
        search,
        "step_compilation",
        lambda compile, device_type: compile if isinstance(compile, dict) else emulated if compile else None,
    )
    # the models' steps compiled afresh with these options: the states kept before are back after the test
    monkeypatch.setattr(search, "MODEL_SEARCH_STATES", WeakKeyDictionary())


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """From now on, the count of each HOST_READS call."""
    counts: Counter = Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts
