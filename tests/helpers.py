"""Checks shared by the tests: the trained fixture's criterion, refused commands, code run without hf_vaswani."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_vaswani.cli import main

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
    """Stands in for cpu_kernels.fastest where no kernel may be chosen by timing (full_determinism)."""
    raise RuntimeError("a kernel was chosen by timing under deterministic algorithms")


# How far int8 dynamic quantization may move the trained fixture's logits, in root mean square (test_cpu_kernels): a
# rounding step of 1/127 of each operand's range is ~1% error, and the ~12 projections between the embeddings and a
# logit add up to ~5% of the logit scale (|logit| <= ~14). The largest single move varies with training: not bounded.
INT8_LOGIT_RMS_TOLERANCE = 0.7
# The trained fixture's margin: teacher-forced on every probe sentence, each right next token's logit exceeds every
# wrong one's by at least this. fp32 rounding differences between kernels, thread counts and processes move logits by
# ~1e-5, so no argmax along a right translation can flip: greedy decoding gives the same translations in every process,
# on every CPU (and in int8, whose model keeps every right token ahead: test_cpu_kernels checks it).
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
