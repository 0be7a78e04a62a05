"""Shared test helpers."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

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


WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "house", "river"]


def timing_forbidden(products: dict) -> None:
    """Stands in for fast_paths_vaswani.fastest where no kernel may be chosen by timing (full_determinism)."""
    raise RuntimeError("a kernel was chosen by timing under deterministic algorithms")


def reversal_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """A toy translation task: the target is the source in capitals (a new vocabulary, aligned word by word)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        pairs.append((" ".join(words), " ".join(w.upper() for w in words)))
    return pairs


# The sentences tests translate and compare with their capitalised form (test_generation, test_fast_paths, test_cli,
# test_hub): the trained fixture (conftest.py) is checked on each of them, and on a sample that training never sees,
# so that the check is about the task rather than a list.
SENTENCES_TESTS_TRANSLATE = [
    "red cat sun",
    "blue dog moon tree",
    "green tree",
    "sun moon",
    "moon river",
    "blue dog",
    "green tree moon",
    "red cat sun moon",
]
PROBE_SENTENCES = list(dict.fromkeys(SENTENCES_TESTS_TRANSLATE + [source for source, _ in reversal_pairs(64, seed=1)]))

# How far int8 dynamic quantization may move the trained fixture's logits, in root mean square (test_fast_paths checks
# it). Each weight is rounded to a step of max|W| / 127 per tensor, each activation to a step of its batch's range / 127
# (7 bits, torch's reduce_range on x86): about 1% rms error per operand, ~1.5% per projection, and the ~12 projections
# between the embeddings and a logit add up to ~5% of the logit scale (|logit| <= ~14): ~0.7. Measured: 0.05. The
# largest single move, over the ~10^5 logits, is an extreme value of that spread and depends on the fixture's
# trajectory (0.33-0.57 in most runs, 1.52 once on a loaded machine), so it is not what the test bounds.
INT8_LOGIT_RMS_TOLERANCE = 0.7
# The trained fixture's margin: teacher-forced on every probe sentence, each right next token's logit exceeds every
# wrong one's by at least this. fp32 rounding differences between kernels, thread counts and processes move logits by
# ~1e-5, so no argmax along a right translation can flip: greedy decoding gives the same translations in every process,
# on every CPU (and in int8, whose model keeps every right token ahead: test_fast_paths checks it).
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


# A toy English -> German corpus for the recipe's and the trainer's tests, and a model small enough to train on it in
# seconds.
PAIRS = [
    ("the dog sleeps .", "der Hund schläft ."),
    ("the cat sleeps .", "die Katze schläft ."),
    ("the dog sees the cat .", "der Hund sieht die Katze ."),
    ("the cat sees the dog .", "die Katze sieht den Hund ."),
    ("today the dog sleeps .", "heute schläft der Hund ."),
    ("today the cat sees the dog .", "heute sieht die Katze den Hund ."),
    ("the man sees the woman .", "der Mann sieht die Frau ."),
    ("the woman sees the man .", "die Frau sieht den Mann ."),
]
TINY_OVERRIDES = dict(d_model=32, d_ff=64, num_heads=4, encoder_layers=1, decoder_layers=1)
