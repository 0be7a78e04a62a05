"""The settings of a training run (§5, §6.1), one `vaswani train` option each, checked before any work starts."""

import difflib
import inspect
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from huggingface_hub.errors import StrictDataclassError

from ..data.tokenization import BPE_KINDS, VOCAB_SIZE
from ..model.configuration_vaswani import VaswaniConfig
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import LENGTH_PENALTY_TYPES, check_generation_settings, check_given_beam_settings
from .schedule import paper_learning_rate

PRESETS = {"base": VaswaniConfig.base, "big": VaswaniConfig.big}
# Settings that another decides to leave unused: (that other, whether it must be set for them to count). Given a value
# of their own where they do not count, they are refused: one of the two would be silently ignored.
UNUSED_UNLESS = {
    "save_steps": ("save_every_epoch", False),
    "eval_bleu_sample": ("eval_bleu_steps", True),
    "eval_bleu_num_beams": ("eval_bleu_steps", True),
}
EARLY_STOPPING_METRICS = ("bleu", "loss")
# Numeric settings with a range of their own, checked in RecipeSettings; every other number must be positive.
OWN_RANGES = ("label_smoothing", "length_penalty", "num_beams", "eval_bleu_num_beams", "seed", "bpe_dropout")
# torch's tensors and the tokenizers' Rust code take 64-bit integers: a larger count fails inside them, after work.
INTEGER_LIMIT = 2**63
# numpy's generator takes seeds of [0, 2**32) (transformers' set_seed seeds it, torch's and Python's).
SEED_LIMIT = 2**32
# The highest peak learning rate accepted: Adam moves each weight by about the learning rate an update, and at 1 one
# update moves the weights (of size ~0.1) by ten times their size. Recipes that train peak 200 times lower.
MAX_PEAK_LEARNING_RATE = 1.0
# How a refused type's message names the types a setting takes.
TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "None"}
# VaswaniConfig fields the recipe takes from the tokenizer it trains, with the setting that controls them (None: none).
TOKENIZER_FIELDS = {
    "vocab_size": "vocab_size",
    "source_vocab_size": "vocab_size",  # the recipe trains one shared vocabulary
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "decoder_start_token_id": None,
}
# VaswaniConfig fields that a training setting decides instead, with that setting: the model's own default stays.
TRAINING_FIELDS = {"label_smoothing": "label_smoothing"}
# What a model override may set: VaswaniConfig's own fields (not transformers' generic ones) but the tokenizer's and
# those of training.
OVERRIDABLE_FIELDS = tuple(
    name for name in inspect.get_annotations(VaswaniConfig) if name not in TOKENIZER_FIELDS | TRAINING_FIELDS
)


@dataclass
class RecipeSettings:
    """The knobs of §5 and §6.1; defaults are the paper's base model on WMT14 En-De.

    Each field is one `vaswani train` option, generated from it: `--` and the name with dashes (or the metadata's
    "flag"), the field's type and default, and the rest of its metadata as argparse keywords (help, choices, metavar).
    Invalid values and combinations that could not finish are refused here, before any work starts.
    """

    preset: str = field(default="base", metadata={"help": "Table 3's model", "choices": sorted(PRESETS)})
    model_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "flag": "--model-override",
            "metavar": "KEY=VALUE",
            "help": "set a VaswaniConfig field of the preset, e.g. d_model=256 or dropout=0.3; VALUE is read as JSON "
            "when it parses (repeatable; a later KEY wins)",
        },
    )
    vocab_size: int = field(default=VOCAB_SIZE, metadata={"help": "size of the shared BPE vocabulary trained (§5.1)"})
    bpe: str = field(
        default="byte_level",
        metadata={
            "help": "the BPE trained: byte_level, GPT-2's, which encodes any text and decodes it exactly; or "
            "subword_nmt, Sennrich et al.'s on whitespace-separated words with an end-of-word mark, as fairseq-era "
            "recipes prepared tokenized text (unseen characters become <unk>, words are joined by single spaces)",
            "choices": BPE_KINDS,
        },
    )
    bpe_merges: int | None = field(
        default=None,
        metadata={
            "help": "for --bpe subword_nmt: learn this many merges, as subword-nmt's learn-bpe -s counts them, in "
            "place of --vocab-size (the vocabulary is then the special tokens, the characters seen and the merges); "
            "None: --vocab-size"
        },
    )
    label_smoothing: float = field(
        default=0.1,
        metadata={
            "help": "epsilon of the label-smoothed training loss (§5.4; 0: the cross-entropy); the logs carry the "
            "cross-entropy beside it as nll_loss, and the saved model returns the cross-entropy"
        },
    )
    max_tokens: int = field(
        default=25000, metadata={"help": "tokens of one process's batch on each side, padding included (§5.1)"}
    )
    update_freq: int = field(default=1, metadata={"help": "batches accumulated into one optimizer step"})
    warmup_steps: int = field(default=4000, metadata={"help": "warmup steps of the learning rate, Eq. 3 (§5.3)"})
    learning_rate_scale: float = field(
        default=1.0,
        metadata={
            "help": "factor on Eq. 3's learning rate (1.0: the paper's; a small d_model makes Eq. 3's peak high, a "
            "short run may want it higher still); a peak above 1 is refused"
        },
    )
    adam_epsilon: float = field(
        default=1e-9, metadata={"help": "Adam's epsilon (1e-9: §5.3's; fairseq's default is 1e-8)"}
    )
    max_grad_norm: float | None = field(
        default=None,
        metadata={
            "help": "clip the gradient of each update to this norm (fairseq's default: 25); None: no clipping, the "
            "paper's"
        },
    )
    max_steps: int = field(default=100000, metadata={"help": "optimizer steps to train"})
    cooldown_steps: int | None = field(
        default=None,
        metadata={
            "help": "last steps over which the learning rate falls linearly to zero (not in the paper, whose Eq. 3 "
            "never reaches zero; helps a short run); None: Eq. 3 to the end"
        },
    )
    max_train_minutes: float | None = field(
        default=None,
        metadata={
            "help": "end training after about this many minutes: the last step is projected from the step rate over "
            "the later half of the steps so far (at most --max-steps; the first steps' one-time costs left out), so "
            "the cooldown still ends there; once the cooldown has begun, a slower rate brings the end sooner, the "
            "learning rate falling more steeply; one process; None: --max-steps alone"
        },
    )
    average_last: int = field(default=5, metadata={"help": "checkpoints averaged into the final model (§6.1)"})
    save_steps: int = field(default=1000, metadata={"help": "optimizer steps between checkpoints"})
    save_every_epoch: bool = field(
        default=False,
        metadata={
            "help": "save a checkpoint at the end of every epoch (and at the last step) instead of every "
            "--save-steps, as fairseq does; --average-last then counts these"
        },
    )
    build_shortlist: bool = field(
        default=False,
        metadata={
            "help": "also write the model folder's vocabulary shortlist, built from the training corpus with the "
            "default sizes (`vaswani shortlist`; used by translate --shortlist); the test is scored without it"
        },
    )
    logging_steps: int = field(
        default=100, metadata={"help": "optimizer steps between logged training losses; at most --max-steps"}
    )
    num_beams: int | None = field(
        default=None, metadata={"help": "beam size in generation_config.json; None means the paper's (4, §6.1)"}
    )
    length_penalty: float | None = field(
        default=None,
        metadata={
            "help": "length penalty in generation_config.json, in the form --length-penalty-type names; None means "
            "the paper's (GNMT alpha 0.6, §6.1)"
        },
    )
    length_penalty_type: str | None = field(
        default=None,
        metadata={
            "help": "form of --length-penalty: gnmt divides a hypothesis' log-probability by ((5 + |Y|) / 6)^alpha, "
            "power by |Y|^alpha (fairseq's and transformers'), |Y| counting </s>; None means the paper's (gnmt)",
            "choices": LENGTH_PENALTY_TYPES,
        },
    )
    eval_batch_size: int = field(
        default=64, metadata={"help": "sentences per batch when translating the test and validation splits"}
    )
    eval_bleu_steps: int | None = field(
        default=None,
        metadata={
            "help": "optimizer steps between validation BLEU scores (logged as eval_bleu, plotted; needs a validation "
            "split); None: no validation"
        },
    )
    eval_bleu_sample: int | None = field(
        default=None, metadata={"help": "validate on the first this many pairs of the validation split; None: all"}
    )
    eval_bleu_num_beams: int = field(
        default=1, metadata={"help": "beam size of validation translations (1: greedy, the fastest)"}
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={
            "help": "stop when the --early-stopping-metric has not improved for this many validations (fairseq's "
            "--patience); with bleu the averaged checkpoints then end at the best validated step, with loss at the "
            "stop (fairseq's); None: never"
        },
    )
    early_stopping_metric: str = field(
        default="bleu",
        metadata={
            "help": "what --early-stopping-patience watches: bleu, the validation BLEU of --eval-bleu-steps; or loss, "
            "the validation split's label-smoothed loss per target token (fairseq's validation), computed at every "
            "checkpoint and logged as eval_loss and eval_nll_loss (also without patience)",
            "choices": EARLY_STOPPING_METRICS,
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the initial weights, data order and dropout (and the embedded corpus)"}
    )
    full_determinism: bool = field(
        default=False,
        metadata={
            "help": "repeat a seeded run bit for bit on this machine: torch's deterministic algorithms, and its own "
            "kernels rather than those measured fastest here (a machine's load can change that choice)"
        },
    )
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 mixed precision (the default on a CUDA GPU that supports it, unless --fp32)"},
    )
    bf16_if_faster: bool = field(
        default=False,
        metadata={
            "help": "bf16 mixed precision if a few training steps of the model measure it at least "
            "1.1x faster than fp32 on this machine's CPU (as with AVX512-BF16 or AMX), else fp32; one process; on a "
            "CUDA GPU, bf16 where it supports it"
        },
    )
    fp16: bool = field(default=False, metadata={"help": "fp16 mixed precision with loss scaling (GPU)"})
    fp32: bool = field(
        default=False, metadata={"help": "float32 throughout, also on a CUDA GPU, where bf16 is the default"}
    )
    torch_compile: bool | None = field(
        default=None,
        metadata={
            "help": "train the model compiled by torch.compile (Trainer's torch_compile; the first steps compile it), "
            "its batches padded to few shapes, and on a CUDA GPU its steps captured in CUDA graphs; None: compiled on "
            "a CUDA GPU, eager elsewhere"
        },
    )
    bpe_dropout: float | None = field(
        default=None,
        metadata={
            "help": "segment the training pairs afresh every epoch, skipping each BPE merge with this probability "
            "(BPE-dropout, Provilkov et al., 2020; not in the paper: a regulariser for small corpora; unseeded); None: "
            "the fixed segmentation"
        },
    )

    def __post_init__(self) -> None:
        # First the types and ranges every setting of its type must have, so that later checks compare numbers
        # with numbers: each field by its declared type, a field added later too.
        for setting in fields(self):
            value = getattr(self, setting.name)
            check_setting_type(setting.name, value, setting.type)
            if isinstance(value, int | float) and not isinstance(value, bool):
                check_number(setting.name, value)
        if self.preset not in PRESETS:
            raise UsageError(f"{setting_flag('preset')} must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise UsageError(f"{setting_flag('seed')} must be in [0, 2**32) (numpy's generator), got {self.seed}")
        decoding = ("num_beams", "length_penalty", "length_penalty_type")
        given = {name: getattr(self, name) for name in decoding}
        flags = {name: setting_flag(name) for name in decoding}
        check_generation_settings(given, flags)
        check_given_beam_settings(given, flags)
        check_generation_settings(
            {"num_beams": self.eval_bleu_num_beams}, {"num_beams": setting_flag("eval_bleu_num_beams")}
        )
        for name, choices in (
            ("early_stopping_metric", EARLY_STOPPING_METRICS),
            ("bpe", BPE_KINDS),
        ):
            if getattr(self, name) not in choices:
                raise UsageError(f"{setting_flag(name)} must be one of {choices}, got {getattr(self, name)!r}")
        if self.bpe_merges is not None and self.bpe != "subword_nmt":
            raise UsageError(f"{setting_flag('bpe_merges')} sizes {setting_flag('bpe')} subword_nmt's BPE only")
        if self.bpe_merges is not None and self.vocab_size != VOCAB_SIZE:
            raise UsageError(
                f"{setting_flag('bpe_merges')} and {setting_flag('vocab_size')} both size the vocabulary: pass one"
            )
        defaults = {setting.name: setting.default for setting in fields(self)}
        for setting, (other, needs) in UNUSED_UNLESS.items():
            if getattr(self, setting) != defaults[setting] and bool(getattr(self, other)) != needs:
                condition = "without" if needs else "with"
                raise UsageError(
                    f"{setting_flag(setting)} has no effect {condition} {setting_flag(other)}: leave one of them out"
                )
        bleu_patience = self.early_stopping_patience is not None and self.early_stopping_metric == "bleu"
        if bleu_patience and self.eval_bleu_steps is None:
            raise UsageError(
                f"{setting_flag('early_stopping_patience')} needs validation BLEU: set "
                f"{setting_flag('eval_bleu_steps')}"
            )
        if self.cooldown_steps is not None and self.cooldown_steps > self.max_steps:
            raise UsageError(
                f"{setting_flag('cooldown_steps')} ({self.cooldown_steps}) is larger than {setting_flag('max_steps')} "
                f"({self.max_steps})"
            )
        precisions = [name for name in ("bf16", "bf16_if_faster", "fp16", "fp32") if getattr(self, name)]
        if len(precisions) > 1:
            raise UsageError(f"{' and '.join(map(setting_flag, precisions))} exclude each other")
        if not 0 <= self.label_smoothing < 1:
            raise UsageError(f"{setting_flag('label_smoothing')} must be in [0, 1), got {self.label_smoothing}")
        if self.bpe_dropout is not None and not 0 < self.bpe_dropout < 1:
            raise UsageError(f"{setting_flag('bpe_dropout')} must be in (0, 1), got {self.bpe_dropout}")
        if self.full_determinism and self.bpe_dropout is not None:
            raise UsageError(
                f"{setting_flag('bpe_dropout')} draws from tokenizers' unseeded generator: a run with it cannot repeat "
                f"bit for bit ({setting_flag('full_determinism')})"
            )
        if self.full_determinism and self.bf16_if_faster:
            raise UsageError(
                f"{setting_flag('bf16_if_faster')} chooses the precision by timing, which a machine's load can change: "
                f"with {setting_flag('full_determinism')} choose {setting_flag('bf16')} or float32"
            )
        if self.logging_steps > self.max_steps:
            raise UsageError(
                f"{setting_flag('logging_steps')} ({self.logging_steps}) is larger than {setting_flag('max_steps')} "
                f"({self.max_steps}): no training loss would be logged for the training curves"
            )
        # With --save-every-epoch the count of checkpoints depends on the epoch's length: checked once it is known.
        if not self.save_every_epoch and self.max_steps // self.save_steps < self.average_last:
            raise UsageError(
                f"averaging the last {self.average_last} checkpoints ({setting_flag('average_last')}) needs "
                f"{setting_flag('max_steps')} ({self.max_steps}) >= {setting_flag('average_last')} * "
                f"{setting_flag('save_steps')} ({self.average_last * self.save_steps})"
            )
        for key in self.model_overrides:
            if key in TRAINING_FIELDS:
                raise UsageError(
                    f"{setting_flag('model_overrides')} {key}: a training setting, not the model's: set it with "
                    f"{setting_flag(TRAINING_FIELDS[key])}"
                )
            if key in TOKENIZER_FIELDS:
                setting = TOKENIZER_FIELDS[key]
                instead = f"set it with {setting_flag(setting)}" if setting else "it cannot be overridden"
                raise UsageError(
                    f"{setting_flag('model_overrides')} {key}: the recipe takes it from the tokenizer it trains; "
                    + instead
                )
            if key not in OVERRIDABLE_FIELDS:
                close = difflib.get_close_matches(key, OVERRIDABLE_FIELDS, n=1)
                hint = f"did you mean {close[0]}?" if close else f"the fields are {', '.join(OVERRIDABLE_FIELDS)}"
                raise UsageError(f"{setting_flag('model_overrides')} {key}: VaswaniConfig has no such field ({hint})")
        config = model_config(self)  # the preset with the overrides, a placeholder vocabulary: refuses bad values now
        peak = self.learning_rate_scale * paper_learning_rate(self.warmup_steps, config.d_model, self.warmup_steps)
        if peak > MAX_PEAK_LEARNING_RATE:
            raise UsageError(
                f"{setting_flag('learning_rate_scale')} {self.learning_rate_scale} makes Eq. 3's peak learning rate "
                f"{peak:.3g} (d_model {config.d_model}, {setting_flag('warmup_steps')} {self.warmup_steps}), far above "
                f"anything that trains (at most {MAX_PEAK_LEARNING_RATE})"
            )


def check_setting_type(name: str, value: object, annotation: object) -> None:
    """Refuses (UsageError) a value that is not of the field's declared type: `X | None` takes X or None, a float
    field an int too, and a dict's keys must be of its key type. A bool is no integer here, nor an integer a bool:
    True would pass as the count 1, and 1 as a flag."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = tuple(typing.get_origin(member) or member for member in members)
    if isinstance(value, bool):
        valid = bool in kinds
    elif isinstance(value, int):
        valid = int in kinds or float in kinds
    else:
        valid = isinstance(value, kinds)
    if valid and isinstance(value, dict):  # dict[K, V]: its keys are K's
        (key_type,) = {typing.get_args(member)[0] for member in members if typing.get_origin(member) is dict}
        valid = all(isinstance(key, key_type) for key in value)
    if not valid:
        takes = " or ".join(TYPE_NAMES.get(kind, f"a {kind.__name__}") for kind in kinds)
        raise UsageError(f"{setting_flag(name)} must be {takes}, got {value!r}")


def check_number(name: str, value: int | float) -> None:
    """Refuses (UsageError) a number that is not positive and finite, but for the settings of OWN_RANGES (checked in
    RecipeSettings), and an integer beyond 64 bits."""
    if name not in OWN_RANGES and not 0 < value < math.inf:  # NaN fails every comparison, so `value <= 0` too
        raise UsageError(f"{setting_flag(name)} must be positive and finite, got {value}")
    if isinstance(value, int) and abs(value) >= INTEGER_LIMIT:
        raise UsageError(f"{setting_flag(name)} must fit in 64 bits (torch's and tokenizers' integers), got {value}")


def setting_flag(name: str) -> str:
    """The `vaswani train` option of the RecipeSettings field `name`."""
    metadata = next(setting.metadata for setting in fields(RecipeSettings) if setting.name == name)
    return metadata.get("flag", "--" + name.replace("_", "-"))


def model_config(settings: RecipeSettings, **tokenizer_fields: int) -> VaswaniConfig:
    """The preset with the settings' overrides and the tokenizer's fields; a config error as one ValueError line."""
    try:
        return PRESETS[settings.preset](**tokenizer_fields, **settings.model_overrides)
    except (ValueError, StrictDataclassError) as error:  # strict's type errors are no ValueErrors
        message = " ".join(str(error).split())
        raise UsageError(f"VaswaniConfig refuses the settings: {message}") from error


# The main job on the embedded corpus: a small model that reaches BLEU > 90 within minutes on a 2-core CPU.
DEMO_SETTINGS = RecipeSettings(
    preset="base",
    model_overrides=dict(d_model=128, d_ff=512, num_heads=4, encoder_layers=3, decoder_layers=3),
    vocab_size=2000,
    max_tokens=2048,
    warmup_steps=400,
    max_steps=1500,
    save_steps=100,
    logging_steps=25,
    average_last=5,
    eval_batch_size=100,
)
