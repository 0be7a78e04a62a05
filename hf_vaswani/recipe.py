"""From a parallel corpus to a trained, averaged, scored and Hub-ready model folder with the paper's recipe."""

import difflib
import hashlib
import inspect
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, GenerationConfig, PreTrainedTokenizerBase, set_seed

from . import save_model_folder
from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import paper_generation_config
from .inference import translate_and_score
from .modeling_vaswani import VaswaniForConditionalGeneration
from .plots import plot_training_curves
from .tokenization import train_shared_bpe_from_dataset
from .training import (
    BF16_MIN_SPEEDUP,
    BpeDropoutPairs,
    CheckpointAveragingCallback,
    TrainingTimeBudgetCallback,
    ValidationBleuCallback,
    VaswaniTrainer,
    best_validation,
    bf16_training_seconds,
    cpu_bf16_matmul_works,
    newest_complete_checkpoint,
    paper_training_arguments,
    replace_folder,
    tokenize_corpus,
    write_text_atomically,
)

PRESETS = {"base": VaswaniConfig.base, "big": VaswaniConfig.big}
# VaswaniConfig fields the recipe takes from the tokenizer it trains, with the setting that controls them (None: none).
TOKENIZER_FIELDS = {
    "vocab_size": "vocab_size",
    "source_vocab_size": "vocab_size",  # the recipe trains one shared vocabulary
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "decoder_start_token_id": None,
}
# What a model override may set: VaswaniConfig's own fields (not transformers' generic ones) but the tokenizer's.
OVERRIDABLE_FIELDS = tuple(name for name in inspect.get_annotations(VaswaniConfig) if name not in TOKENIZER_FIELDS)


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
            "help": "set a VaswaniConfig field of the preset, e.g. d_model=256 or label_smoothing=0.2; VALUE is read "
            "as JSON when it parses (repeatable; a later KEY wins)",
        },
    )
    vocab_size: int = field(default=37000, metadata={"help": "size of the shared BPE vocabulary trained (§5.1)"})
    max_tokens: int = field(
        default=25000, metadata={"help": "tokens of one process's batch on each side, padding included (§5.1)"}
    )
    update_freq: int = field(default=1, metadata={"help": "batches accumulated into one optimizer step"})
    warmup_steps: int = field(default=4000, metadata={"help": "warmup steps of the learning rate, Eq. 3 (§5.3)"})
    learning_rate_scale: float = field(
        default=1.0,
        metadata={
            "help": "factor on Eq. 3's learning rate (1.0: the paper's; a small d_model makes Eq. 3's peak high, a "
            "short run may want it higher still)"
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
            "help": "end training after about this many minutes: the last step is projected from the step rate so far "
            "(at most --max-steps), so the cooldown still ends there; once the cooldown has begun, a slower rate "
            "brings the end sooner, the learning rate falling more steeply; one process; None: --max-steps alone"
        },
    )
    average_last: int = field(default=5, metadata={"help": "checkpoints averaged into the final model (§6.1)"})
    save_steps: int = field(default=1000, metadata={"help": "optimizer steps between checkpoints"})
    logging_steps: int = field(
        default=100, metadata={"help": "optimizer steps between logged training losses; at most --max-steps"}
    )
    num_beams: int | None = field(
        default=None, metadata={"help": "beam size in generation_config.json; None means the paper's (4, §6.1)"}
    )
    length_penalty: float | None = field(
        default=None, metadata={"help": "GNMT alpha in generation_config.json; None means the paper's (0.6, §6.1)"}
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
            "help": "stop when validation BLEU has not improved for this many evaluations; the averaged checkpoints "
            "then end at the best validated step; None: never"
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
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision"})
    bf16_if_faster: bool = field(
        default=False,
        metadata={
            "help": "bf16 mixed precision if a few training steps of the model measure it at least "
            "1.1x faster than fp32 on this machine's CPU (as with AVX512-BF16 or AMX), else fp32; one process"
        },
    )
    fp16: bool = field(default=False, metadata={"help": "fp16 mixed precision with loss scaling (GPU)"})
    bpe_dropout: float | None = field(
        default=None,
        metadata={
            "help": "segment the training pairs afresh every epoch, skipping each BPE merge with this probability "
            "(BPE-dropout, Provilkov et al., 2020; not in the paper: a regulariser for small corpora; unseeded); None: "
            "the fixed segmentation"
        },
    )

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"{setting_flag('preset')} must be one of {sorted(PRESETS)}, got {self.preset!r}")
        for name in (
            "vocab_size",
            "max_tokens",
            "update_freq",
            "warmup_steps",
            "max_steps",
            "cooldown_steps",
            "max_train_minutes",
            "average_last",
            "save_steps",
            "logging_steps",
            "num_beams",
            "eval_batch_size",
            "learning_rate_scale",
            "eval_bleu_steps",
            "eval_bleu_sample",
            "eval_bleu_num_beams",
            "early_stopping_patience",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{setting_flag(name)} must be positive, got {value}")
        if self.early_stopping_patience is not None and self.eval_bleu_steps is None:
            raise ValueError(
                f"{setting_flag('early_stopping_patience')} needs validation BLEU: set "
                f"{setting_flag('eval_bleu_steps')}"
            )
        if self.cooldown_steps is not None and self.cooldown_steps > self.max_steps:
            raise ValueError(
                f"{setting_flag('cooldown_steps')} ({self.cooldown_steps}) is larger than {setting_flag('max_steps')} "
                f"({self.max_steps})"
            )
        precisions = [name for name in ("bf16", "bf16_if_faster", "fp16") if getattr(self, name)]
        if len(precisions) > 1:
            raise ValueError(f"{' and '.join(map(setting_flag, precisions))} exclude each other")
        if self.bpe_dropout is not None and not 0 < self.bpe_dropout < 1:
            raise ValueError(f"{setting_flag('bpe_dropout')} must be in (0, 1), got {self.bpe_dropout}")
        if self.full_determinism and self.bpe_dropout is not None:
            raise ValueError(
                f"{setting_flag('bpe_dropout')} draws from tokenizers' unseeded generator: a run with it cannot repeat "
                f"bit for bit ({setting_flag('full_determinism')})"
            )
        if self.full_determinism and self.bf16_if_faster:
            raise ValueError(
                f"{setting_flag('bf16_if_faster')} chooses the precision by timing, which a machine's load can change: "
                f"with {setting_flag('full_determinism')} choose {setting_flag('bf16')} or float32"
            )
        if self.logging_steps > self.max_steps:
            raise ValueError(
                f"{setting_flag('logging_steps')} ({self.logging_steps}) is larger than {setting_flag('max_steps')} "
                f"({self.max_steps}): no training loss would be logged for the training curves"
            )
        if self.max_steps // self.save_steps < self.average_last:
            raise ValueError(
                f"averaging the last {self.average_last} checkpoints ({setting_flag('average_last')}) needs "
                f"{setting_flag('max_steps')} ({self.max_steps}) >= {setting_flag('average_last')} * "
                f"{setting_flag('save_steps')} ({self.average_last * self.save_steps})"
            )
        for key in self.model_overrides:
            if key in TOKENIZER_FIELDS:
                setting = TOKENIZER_FIELDS[key]
                instead = f"set it with {setting_flag(setting)}" if setting else "it cannot be overridden"
                raise ValueError(
                    f"{setting_flag('model_overrides')} {key}: the recipe takes it from the tokenizer it trains; "
                    + instead
                )
            if key not in OVERRIDABLE_FIELDS:
                close = difflib.get_close_matches(key, OVERRIDABLE_FIELDS, n=1)
                hint = f"did you mean {close[0]}?" if close else f"the fields are {', '.join(OVERRIDABLE_FIELDS)}"
                raise ValueError(f"{setting_flag('model_overrides')} {key}: VaswaniConfig has no such field ({hint})")
        model_config(self)  # the preset with the overrides, its vocabulary a placeholder: refuses bad values now


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
        raise ValueError(f"VaswaniConfig refuses the settings: {message}") from error


VALIDATION_SCORES = ("eval_bleu", "eval_lowercased_tokenized_bleu")  # what ValidationBleuCallback logs
RUN_RECORD = "run.json"  # the settings and training corpus that define the run in an output folder
TOKENIZER_FOLDER = "tokenizer"  # the run's vocabulary, saved before training so that a resumed run keeps its ids
# What a run leaves in its output folder: any of them means the folder holds one.
RUN_ENTRIES = (RUN_RECORD, TOKENIZER_FOLDER, "checkpoints", "model", "results.json", "training_curves.png")
# Settings a resumed run may change: more steps continue the same trajectory (Eq. 3 and the data order do not depend
# on the total), and decoding and evaluation come after training. Fewer steps could end before the last checkpoint.
RESUMABLE_SETTINGS = ("max_steps", "num_beams", "length_penalty", "eval_batch_size", "eval_bleu_sample")


def is_main_process() -> bool:
    """Whether this is the process that judges and writes the output folder (torchrun and accelerate set RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


def check_output_dir(
    output_dir: str | Path, settings: RecipeSettings, resume: bool = False, overwrite: bool = False
) -> dict | None:
    """Refuse, in one ValueError line, an output folder that cannot be written or would mix or lose runs; reads only.

    A folder holding a previous run is continued with `resume` (its corpus, checked later, and settings must be the
    same but RESUMABLE_SETTINGS, max_steps only growing and only without a cooldown) or replaced with `overwrite`, never
    reused silently. `resume` on a folder without a run starts one. Returns the previous run's record when resuming one,
    else None. Only the main process judges a run in the folder: the others would see what it has just written.
    """
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    output_dir = Path(output_dir)
    check_writable_folder(output_dir)
    found = [name for name in RUN_ENTRIES if (output_dir / name).exists()]
    if not found or overwrite or not is_main_process():
        return None
    if not resume:
        raise ValueError(
            f"{output_dir} holds a previous run ({', '.join(found)}): continue it with --resume, replace it with "
            "--overwrite, or choose another --output-dir"
        )
    if not (output_dir / RUN_RECORD).is_file():
        raise ValueError(
            f"--resume: {output_dir} holds no {RUN_RECORD} (a run of an older version, or killed before it started), "
            "so its corpus and settings cannot be checked; start again with --overwrite"
        )
    record, previous = read_run_record(output_dir / RUN_RECORD)
    differences = settings_differences(previous, settings)
    if differences:
        raise ValueError(f"--resume: {'; '.join(differences)} (only --max-steps may grow and decoding change)")
    return record


def check_writable_folder(folder: Path) -> None:
    """Refuse, in one ValueError line, an output folder that could not be created or written into.

    Checked up front because the first write comes after the corpus is read and the tokenizer trained. The nearest
    existing folder of the path must be a folder (not a file) that this process may write into.
    """
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        problem = "is a file, not a folder" if existing == folder else f"cannot be created: {existing} is a file"
        raise ValueError(f"--output-dir {folder} {problem}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output-dir {folder}: {existing} is not writable")


def read_run_record(path: Path) -> tuple[dict, RecipeSettings]:
    """The run record at `path` and its settings, refused in one ValueError line naming the file and what is wrong.

    A record cut short by a full disk or edited by hand would otherwise be a traceback far from its cause.
    """
    remedy = "so the run cannot be checked; restore it or start again with --overwrite"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON (empty or cut short)
        raise ValueError(f"--resume: {path} cannot be read ({error}), {remedy}") from None
    kinds = {"settings": dict, "train_corpus_sha256": str}
    if not isinstance(record, dict) or any(not isinstance(record.get(key), kind) for key, kind in kinds.items()):
        raise ValueError(
            f"--resume: {path} is not a run record (a JSON object with 'settings', an object, and "
            f"'train_corpus_sha256', a string), {remedy}"
        )
    try:  # an unknown setting (a missing one takes its default), a value of the wrong type or range fails here
        previous = RecipeSettings(**record["settings"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"--resume: the settings in {path} are not valid ({error}), {remedy}") from None
    return record, previous


def settings_differences(previous: RecipeSettings, current: RecipeSettings) -> list[str]:
    """What a resumed run changes that it may not: model config fields by name, other settings by option."""
    previous_config, current_config = model_config(previous).to_dict(), model_config(current).to_dict()
    differences = [
        f"{name} was {previous_config.get(name)}, now {current_config.get(name)}"
        for name in sorted(previous_config.keys() | current_config.keys())
        if previous_config.get(name) != current_config.get(name)
    ]
    for setting in fields(RecipeSettings):
        name = setting.name
        before, now = getattr(previous, name), getattr(current, name)
        if name in ("preset", "model_overrides") or before == now:  # the config covers them
            continue
        # A cooldown ends at max_steps: a longer run would raise a learning rate that has already fallen. A time
        # budget's run ends where its schedule says, which a new max_steps would not move.
        ends_fixed = current.cooldown_steps is not None or current.max_train_minutes is not None
        refused_length = name == "max_steps" and (now < before or ends_fixed)
        if name not in RESUMABLE_SETTINGS or refused_length:
            differences.append(f"{setting_flag(name)} was {before}, now {now}")
    return differences


def corpus_fingerprint(split: Dataset) -> str:
    """sha256 over the split's source and target lines in order: the same text gives the same value in any process."""
    digest = hashlib.sha256()
    for batch in split.select_columns(["source", "target"]).iter(batch_size=10_000):
        for source, target in zip(batch["source"], batch["target"], strict=True):
            digest.update(f"{source}\0{target}\0".encode())  # NUL ends each line: no two corpora hash alike
    return digest.hexdigest()


def remove_run(output_dir: Path) -> None:
    """Delete what a run wrote into `output_dir` (RUN_ENTRIES), leaving anything else there alone."""
    for name in RUN_ENTRIES:
        path = output_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


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


def build_model(settings: RecipeSettings, tokenizer: PreTrainedTokenizerBase) -> VaswaniForConditionalGeneration:
    """The configured model with the tokenizer's vocabulary and special ids, and the settings' decoding.

    The model's generation config is the paper's (§6.1; a new model has transformers' defaults), with the decoding
    settings given on top; the checkpoints and the final model folder carry it.
    """
    config = model_config(
        settings,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = VaswaniForConditionalGeneration(config)
    decoding = {
        name: value for name in ("num_beams", "length_penalty") if (value := getattr(settings, name)) is not None
    }
    model.generation_config = paper_generation_config(config, **decoding)
    return model


def run_recipe(
    corpus: DatasetDict,
    output_dir: str | Path,
    settings: RecipeSettings,
    source_lang: str = "en",
    target_lang: str = "de",
    dataset_name: str = "custom",
    resume: bool = False,
    overwrite: bool = False,
    command: str = "hf_vaswani.recipe.run_recipe",
) -> dict:
    """Train tokenizer and model, average the last checkpoints, translate the test split and write everything.

    Writes `output_dir/run.json` (settings and corpus fingerprint) and `output_dir/tokenizer` first, the checkpoints
    under `output_dir/checkpoints`, then `output_dir/model` (Hub-ready: weights, tokenizer, generation config, model
    card, remote code), `output_dir/results.json` and `output_dir/training_curves.png`; the model folder, results and
    averaged weights each appear whole or not at all. A folder holding a previous run is refused unless `resume` or
    `overwrite` says what to do with it (`check_output_dir`). With `resume`, training continues from the newest complete
    checkpoint there (weights, optimizer, schedule, data position and random state) with the run's tokenizer, ending
    where an uninterrupted run would; a different training corpus is refused.
    """
    for split in ("train", "test") + (("validation",) if settings.eval_bleu_steps else ()):
        if split not in corpus:
            raise ValueError(f"the corpus has no {split!r} split (has {sorted(corpus)})")
    output_dir = Path(output_dir)
    started = time.perf_counter()
    previous_run = check_output_dir(output_dir, settings, resume, overwrite)
    fingerprint = corpus_fingerprint(corpus["train"])
    if previous_run and previous_run["train_corpus_sha256"] != fingerprint:
        raise ValueError(
            f"--resume: the training corpus is not the one the run in {output_dir} started with (sha256 "
            f"{previous_run['train_corpus_sha256'][:12]}... then, {fingerprint[:12]}... now)"
        )
    if settings.max_train_minutes is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"{setting_flag('max_train_minutes')} times one process; with several, use --max-steps")
    if settings.bpe_dropout is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(f"{setting_flag('bpe_dropout')} segments in one process; with several, train without it")
    precision = training_precision(settings)
    # Before the tokenizer and the model: the arguments check the machine (bf16 on this CPU) without training anything.
    args = paper_training_arguments(
        output_dir / "checkpoints",
        max_steps=settings.max_steps,
        warmup_steps=settings.warmup_steps,
        learning_rate=settings.learning_rate_scale,  # VaswaniTrainer multiplies Eq. 3 by it
        gradient_accumulation_steps=settings.update_freq,
        save_steps=settings.save_steps,
        save_total_limit=checkpoints_to_keep(settings),
        logging_steps=settings.logging_steps,
        seed=settings.seed,
        data_seed=settings.seed,
        full_determinism=settings.full_determinism,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        dataloader_num_workers=0,
    )
    if overwrite and is_main_process():
        remove_run(output_dir)
    tokenizer_dir = output_dir / TOKENIZER_FOLDER
    if resume and tokenizer_dir.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # retrained BPE could give the weights other ids
    else:
        tokenizer = train_shared_bpe_from_dataset(corpus["train"], vocab_size=settings.vocab_size)
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        # The record first: a run killed before its tokenizer is saved resumes by training the same one again.
        record = {"settings": asdict(settings), "train_corpus_sha256": fingerprint, "train_pairs": len(corpus["train"])}
        write_text_atomically(output_dir / RUN_RECORD, json.dumps(record, indent=2) + "\n")
        if not tokenizer_dir.is_dir():
            replace_folder(tokenizer_dir, tokenizer.save_pretrained)
    set_seed(settings.seed)  # the initial weights too are a function of the seed
    model = build_model(settings, tokenizer)
    if settings.bpe_dropout is None:
        tokenized = tokenize_corpus(corpus["train"], tokenizer)
    else:
        tokenized = BpeDropoutPairs(
            corpus["train"]["source"], corpus["train"]["target"], tokenizer, settings.bpe_dropout
        )
    averaging = CheckpointAveragingCallback(
        settings.average_last, end_at_best_validation=settings.early_stopping_patience is not None
    )
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        max_tokens=settings.max_tokens,
        cooldown_steps=settings.cooldown_steps,
        callbacks=[averaging],
    )
    if settings.max_train_minutes is not None:
        trainer.add_callback(TrainingTimeBudgetCallback(settings.max_train_minutes))
    validation = None
    if settings.eval_bleu_steps:
        pairs = corpus["validation"]
        if settings.eval_bleu_sample:
            pairs = pairs.select(range(min(settings.eval_bleu_sample, len(pairs))))
        validation = ValidationBleuCallback(
            tokenizer,
            pairs["source"],
            pairs["target"],
            target_lang,
            settings.eval_bleu_steps,
            log=trainer.log,
            num_beams=settings.eval_bleu_num_beams,
            batch_size=settings.eval_batch_size,
            early_stopping_patience=settings.early_stopping_patience,
        )
        trainer.add_callback(validation)
    # Only the main process moves incomplete checkpoints aside; the others skip them where it has not yet.
    checkpoint = newest_complete_checkpoint(args.output_dir, move_aside=is_main_process()) if resume else None
    train_output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    train_seconds = time.perf_counter() - started
    if not trainer.is_world_process_zero():
        return {}

    # The averaged folder carries the last checkpoint's generation config (the paper's decoding).
    model = VaswaniForConditionalGeneration.from_pretrained(averaging.averaged_path).to(trainer.args.device)
    sources, references = corpus["test"]["source"], corpus["test"]["target"]
    hypotheses, scores = translate_and_score(
        model, tokenizer, sources, references, target_lang, batch_size=settings.eval_batch_size
    )

    results = {
        "bleu": round(scores["bleu"], 2),
        "chrf": round(scores["chrf"], 2),
        "tokenized_bleu": round(scores["tokenized_bleu"], 2),
        "lowercased_tokenized_bleu": round(scores["lowercased_tokenized_bleu"], 2),
        "bleu_signature": scores["bleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        "lowercased_tokenized_bleu_signature": scores["lowercased_tokenized_bleu_signature"],
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "steps": train_output.global_step,
        "final_training_loss": round(train_output.training_loss, 4),
        "training_precision": precision,
        "parameters": model.num_parameters(),
        "test_sentences": len(sources),
        "averaged_checkpoints": [checkpoint.name for checkpoint in averaging.checkpoints],
        "validation": validation_summary(trainer.state.log_history) if validation else None,
        "settings": asdict(settings),
        # scores of a seeded run differ slightly between CPU models (kernels differ in the last bits): say which one
        "cpu": cpu_model_name(),
        "command": command,
        # what the settings left to the preset and the paper, as the saved config and generation config hold it
        "label_smoothing": model.config.label_smoothing,
        "num_beams": model.generation_config.num_beams,
        "length_penalty": model.generation_config.length_penalty,
        "examples": [
            {"source": s, "reference": r, "translation": h}
            for s, r, h in list(zip(sources, references, hypotheses, strict=True))[:5]
        ],
    }
    model_dir = output_dir / "model"

    def write_model_folder(folder: Path) -> None:
        save_model_folder(model, tokenizer, folder)
        card_fields = (model.config, settings, results, source_lang, target_lang, dataset_name, sources[0])
        write_model_card(folder, *card_fields, model_name=model_dir.name)

    replace_folder(model_dir, write_model_folder)
    write_text_atomically(output_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    plot_training_curves(trainer.state.log_history, output_dir / "training_curves.png")
    return results


def training_precision(settings: RecipeSettings) -> str:
    """ "fp32", "bf16" or "fp16": as set, or with `bf16_if_faster` as measured here (one line on stderr says which)."""
    if not settings.bf16_if_faster:
        return "bf16" if settings.bf16 else "fp16" if settings.fp16 else "fp32"
    flag = setting_flag("bf16_if_faster")
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        raise ValueError(f"{flag} measures CPU training; on an accelerator pass {setting_flag('bf16')} or nothing")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would measure, and they could disagree
        raise ValueError(f"{flag} measures in one process; with several, pass {setting_flag('bf16')} or nothing")
    if not cpu_bf16_matmul_works():
        print(f"{flag}: fp32 (a bfloat16 matmul traps on this CPU)", file=sys.stderr)
        return "fp32"
    config = model_config(settings, vocab_size=settings.vocab_size)
    seconds = bf16_training_seconds(config, settings.max_tokens)
    precision = "bf16" if seconds["fp32"] >= BF16_MIN_SPEEDUP * seconds["bf16"] else "fp32"
    print(
        f"{flag}: {precision} (a training step {seconds['bf16']:.3f} s in bf16, {seconds['fp32']:.3f} s in fp32 on "
        f"{cpu_model_name()})",
        file=sys.stderr,
    )
    return precision


def validation_summary(log_history: list[dict]) -> dict:
    """Validation BLEU (greedy unless eval_bleu_num_beams) at every evaluation and the step where it was best."""
    curve = [
        {key: round(entry[key], 2) for key in ("step", "elapsed_minutes", *VALIDATION_SCORES)}
        for entry in log_history
        if VALIDATION_SCORES[0] in entry
    ]
    best = best_validation(log_history)
    return {
        "best_step": best["step"] if best else None,
        "best_bleu": round(best[VALIDATION_SCORES[0]], 2) if best else None,
        "curve": curve,
    }


def checkpoints_to_keep(settings: RecipeSettings) -> int:
    """Checkpoints the run keeps on disk (Trainer's `save_total_limit`): those averaged, and with early stopping also
    those saved after the best step until training stops (`patience` evaluations, each a checkpoint every
    `save_steps`, plus the one saved at the stop), so that the average can end at the best step."""
    if settings.early_stopping_patience is None:
        return settings.average_last
    saves_per_evaluation = -(-settings.eval_bleu_steps // settings.save_steps)
    return settings.average_last + settings.early_stopping_patience * saves_per_evaluation + 1


def cpu_model_name() -> str:
    """The CPU's model name as lscpu prints it (from /proc/cpuinfo on Linux), else what the platform reports."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def write_model_card(
    model_dir: Path,
    config: VaswaniConfig,
    settings: RecipeSettings,
    results: dict,
    source_lang: str,
    target_lang: str,
    dataset_name: str,
    example_source: str,
    model_name: str | None = None,
) -> Path:
    """Fill the package's model_card.md template into `model_dir/README.md` (the Hub's model card).

    The decoding it describes is the one saved in `model_dir/generation_config.json`. `model_name` defaults to the
    folder's name (give it when writing into a temporary folder).
    """
    decoding = GenerationConfig.from_pretrained(model_dir)
    rows = [
        ("layers N (encoder / decoder)", "6 / 6", f"{config.encoder_layers} / {config.decoder_layers}"),
        ("d_model / d_ff / heads h", "512 / 2048 / 8", f"{config.d_model} / {config.d_ff} / {config.num_heads}"),
        ("d_k / d_v", "64 / 64", f"{config.d_k} / {config.d_v}"),
        ("dropout P_drop / label smoothing", "0.1 / 0.1", f"{config.dropout} / {config.label_smoothing}"),
        ("shared BPE vocabulary", "~37000", str(config.vocab_size)),
        ("BPE-dropout in training", "none", str(settings.bpe_dropout or "none")),
        ("batch (tokens per side)", "~25000", f"{settings.max_tokens} x update_freq {settings.update_freq}"),
        ("optimizer", "Adam(0.9, 0.98, 1e-9)", "Adam(0.9, 0.98, 1e-9)"),
        ("warmup steps / training steps", "4000 / 100000", f"{settings.warmup_steps} / {results['steps']}"),
        ("checkpoints averaged", "last 5", f"last {settings.average_last}"),
        ("beam size / length penalty alpha", "4 / 0.6", f"{decoding.num_beams} / {decoding.length_penalty}"),
    ]
    deviations = [name for name, paper, ours in rows if paper != ours]
    template = Template(resources.files("hf_vaswani").joinpath("model_card.md").read_text())
    card = template.substitute(
        source_lang=source_lang,
        target_lang=target_lang,
        dataset=dataset_name,
        dataset_title=dataset_name,
        model_name=model_name or model_dir.name,
        bleu=results["bleu"],
        chrf=results["chrf"],
        tokenized_bleu=results["tokenized_bleu"],
        bleu_signature=results["bleu_signature"],
        example_source=example_source.replace('"', '\\"'),
        measured_on=(
            f"Measured with `{results['command']}` on {results['cpu']} (a seeded run's scores differ slightly between "
            "CPU models)."
            if "cpu" in results
            else ""
        ),
        settings_table="\n".join(f"| {name} | {paper} | {ours} |" for name, paper, ours in rows),
        deviations=", ".join(deviations) + "." if deviations else "none.",
        decoding=(
            f"beam {decoding.num_beams}, GNMT length penalty ((5 + |Y|) / 6)^alpha with alpha "
            f"{decoding.length_penalty}, at most source length + 50 output tokens, early termination (§6.1), all "
            "in generation_config.json. transformers' own penalty (score / |Y|^alpha) instead: "
            '`model.generate(..., length_penalty_type="power")`.'
        ),
    )
    path = model_dir / "README.md"
    path.write_text(card)
    return path
