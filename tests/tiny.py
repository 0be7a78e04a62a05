"""The tests' tiny corpora, model sizes and toy training settings: each as small as the tests using it allow."""

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, save_model_folder
from hf_vaswani.data.tokenization import train_shared_bpe
from hf_vaswani.training.settings import DEMO_SETTINGS, RecipeSettings, setting_flag

# --- Model sizes: VaswaniConfig keywords -----------------------------------------------------------------------------

TINY_MODEL: dict[str, Any] = dict(
    vocab_size=61, d_model=24, d_ff=40, num_heads=3, d_k=6, d_v=10, encoder_layers=2, decoder_layers=2, dropout=0.0
)
"""For tests of what the model computes: small for CPU, d_k != d_v so both paths of §3.2.2 run, two layers a side."""

SMALLEST_MODEL: dict[str, Any] = dict(
    vocab_size=50, d_model=16, d_ff=32, num_heads=2, encoder_layers=1, decoder_layers=1, dropout=0.0
)
"""For tests that need a model to exist (saved, loaded, averaged, decoded at random), not to compute anything given."""

UNEVEN_MODEL: dict[str, Any] = dict(
    vocab_size=53, d_model=32, d_ff=48, num_heads=4, encoder_layers=2, decoder_layers=3, dropout=0.0
)
"""For comparisons with another implementation: more decoder than encoder layers, so that a mixed-up stack shows."""

TRAINABLE_MODEL: dict[str, Any] = dict(d_model=32, d_ff=64, num_heads=4, encoder_layers=1, decoder_layers=1)
"""For tests that train on the toy corpus: a few steps take a second. Sizes only: the vocabulary is the tokenizer's."""

CAPITALISER_MODEL: dict[str, Any] = dict(
    d_model=64, d_ff=128, num_heads=4, encoder_layers=2, decoder_layers=2, dropout=0.0, label_smoothing=0.0
)
"""The trained fixture's (conftest.py): learns the capitalisation task in seconds; no dropout or label smoothing, which
would only slow so short a run. Sizes only: the vocabulary is the tokenizer's."""

CAPITALISER_TRAINING: dict[str, int] = dict(
    check_every=25,
    # The criterion holds after fewer than 800 steps under every kernel selection; by 2000 the learning rate has
    # halved 9 times, so a run that misses it is broken, not slow.
    max_steps=2000,
)
"""How the trained fixture (conftest.py) trains: its criterion checked every `check_every` steps, up to `max_steps`."""


MARIAN_SMALL: dict[str, Any] = dict(
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=24,
    decoder_ffn_dim=24,
    dropout=0.0,
    activation_function="relu",
)
"""MarianMTModel keywords of a small model that converts exactly (relu, no dropout): for tests of conversion."""


def random_model(
    seed: int = 0, sizes: dict[str, Any] = SMALLEST_MODEL, **changes: Any
) -> VaswaniForConditionalGeneration:
    """An untrained model of `sizes` with `changes`, its weights drawn from `seed`, in eval mode."""
    torch.manual_seed(seed)
    return VaswaniForConditionalGeneration(VaswaniConfig(**(sizes | changes))).eval()


def tiny_marian(**overrides: Any) -> MarianMTModel:
    """A random MARIAN_SMALL MarianMTModel of 30 tokens (</s> 0, padding and decoder start 29), in eval mode."""
    settings = {**MARIAN_SMALL, "vocab_size": 30, "pad_token_id": 29, "decoder_start_token_id": 29, "eos_token_id": 0}
    return MarianMTModel(MarianConfig(**{**settings, **overrides})).eval()


def save_random_checkpoints(folder: Path, steps: tuple[int, ...]) -> dict[Path, dict[str, torch.Tensor]]:
    """`folder`/checkpoint-STEP for each step, a random model seeded with the step: each path and its weights."""
    saved = {}
    for step in steps:
        model = random_model(step)
        model.save_pretrained(folder / f"checkpoint-{step}")
        saved[folder / f"checkpoint-{step}"] = model.state_dict()
    return saved


# --- The toy English -> German corpus, for the trainer, the recipe and `vaswani train` -------------------------------

TOY_SOURCES = [
    "the dog sleeps .",
    "the cat sleeps .",
    "the dog sees the cat .",
    "the cat sees the dog .",
    "today the dog sleeps .",
    "today the cat sees the dog .",
    "the man sees the woman .",
    "the woman sees the man .",
]
TOY_TARGETS = [
    "der Hund schläft .",
    "die Katze schläft .",
    "der Hund sieht die Katze .",
    "die Katze sieht den Hund .",
    "heute schläft der Hund .",
    "heute sieht die Katze den Hund .",
    "der Mann sieht die Frau .",
    "die Frau sieht den Mann .",
]
"""Eight pairs sharing their words: enough for a BPE vocabulary, batches of several sentences, and a BLEU score."""

TOY_VOCAB_SIZE = 300
"""The byte-level alphabet and the 4 special tokens, and up to 40 merges: the toy corpora's words become few tokens."""


def toy_tokenizer() -> PreTrainedTokenizerFast:
    """The shared BPE of the toy corpus."""
    return train_shared_bpe(TOY_SOURCES + TOY_TARGETS, vocab_size=TOY_VOCAB_SIZE, min_frequency=1)


def toy_dataset(repeats: int = 1) -> Dataset:
    """The toy corpus `repeats` times over, as a split: the columns source and target."""
    return Dataset.from_dict({"source": TOY_SOURCES * repeats, "target": TOY_TARGETS * repeats})


def toy_corpus(validation: bool = False) -> DatasetDict:
    """The toy corpus 6 times over for training (several epochs of batches), its first 3 pairs as test split (a quick
    score) and, if asked, all of it once as validation split."""
    splits = {"train": toy_dataset(6), "test": toy_dataset().select(range(3))}
    if validation:
        splits["validation"] = toy_dataset()
    return DatasetDict(splits)


def write_corpus_files(folder: Path, targets: list[str] = TOY_TARGETS) -> list[str]:
    """The toy corpus (other targets if given) as train.en and train.de in `folder`: the `vaswani train` options that
    read them, the training split doubling as test split."""
    folder.mkdir(exist_ok=True)
    (folder / "train.en").write_text("\n".join(TOY_SOURCES) + "\n")
    (folder / "train.de").write_text("\n".join(targets) + "\n")
    files = [str(folder / "train.en"), str(folder / "train.de")]
    return ["--data", "files", "--train", *files, "--test", *files]


TOY_RECIPE: dict[str, Any] = dict(
    model_overrides=TRAINABLE_MODEL,
    vocab_size=TOY_VOCAB_SIZE,
    max_tokens=64,
    warmup_steps=4,
    logging_steps=2,
    num_beams=2,
)
"""RecipeSettings fields of a run on the toy corpus that takes seconds; each test adds its schedule (max_steps, ...)."""


def toy_settings(**schedule: Any) -> RecipeSettings:
    """TOY_RECIPE with `schedule` as RecipeSettings."""
    return RecipeSettings(**(TOY_RECIPE | schedule))


def toy_train_options(**schedule: Any) -> list[str]:
    """TOY_RECIPE with `schedule` as `vaswani train` options."""
    options = []
    for name, value in (TOY_RECIPE | schedule).items():
        if name == "model_overrides":
            options += [
                word for key, size in value.items() for word in (setting_flag(name), f"{key}={json.dumps(size)}")
            ]
        else:
            options += [setting_flag(name), str(value)]
    return options


# --- The capitalisation task, for the trained fixture (conftest.py) and the tests that translate with it -------------

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "house", "river"]
"""Ten words: their 2- to 4-word sentences number over 10^4, and the capitaliser's BPE holds each word as one token."""


def capitalised_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """A toy translation task: the target is the source in capitals (a new vocabulary, aligned word by word)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        pairs.append((" ".join(words), " ".join(w.upper() for w in words)))
    return pairs


# The sentences tests translate with the trained fixture and compare with their capitalised form: the fixture is checked
# on each of them, and on a sample that training never sees, so that the check is about the task rather than a list.
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
PROBE_SENTENCES = list(
    dict.fromkeys(SENTENCES_TESTS_TRANSLATE + [source for source, _ in capitalised_pairs(64, seed=1)])
)


def save_untrained_folder(folder: Path) -> Path:
    """A TINY_MODEL at random with a BPE of the task's sentences, saved as a model folder: what loads, not what
    translates (decoding stops after 3 tokens)."""
    texts = SENTENCES_TESTS_TRANSLATE + [sentence.upper() for sentence in SENTENCES_TESTS_TRANSLATE]
    tokenizer = train_shared_bpe(texts, vocab_size=TOY_VOCAB_SIZE, min_frequency=1)
    model = random_model(0, TINY_MODEL, vocab_size=len(tokenizer))
    model.generation_config.max_new_tokens = 3
    save_model_folder(model, tokenizer, folder)
    return folder


# For tests/interop/test_export_demo.py: the demo's model, corpus and decoding on a schedule that fits the default
# suite: more, smaller batches learn faster per second than the demo's; Eq. 3 x 0.8 keeps them from collapsing into a
# unigram model; no dropout, a regulariser for long runs that only slows a short one.
SHORT_DEMO_SETTINGS = replace(
    DEMO_SETTINGS,
    model_overrides={**DEMO_SETTINGS.model_overrides, "dropout": 0.0},
    max_tokens=768,
    learning_rate_scale=0.8,
    max_steps=550,
    save_steps=25,  # the last 5 checkpoints, averaged, span the last 100 steps (the demo's: the last 400 of 1500)
)
