"""Wu et al. (2021)'s fairseq recipe on Multi30k (scripts/multi30k.sh --recipe published): its schedule against
fairseq's inverse_sqrt, an update of two accumulated batches against one computed on both, checkpoints at the ends of
epochs and their average, the validation loss per token against torch's cross_entropy, patience on it (also across a
resume), and fairseq's whitespace BLEU."""

import copy
import gzip
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path

import pytest
import sacrebleu
import torch
from safetensors.torch import load_file
from tiny import TOY_SOURCES, TOY_TARGETS, TRAINABLE_MODEL, toy_corpus, toy_dataset, toy_settings, toy_tokenizer
from torch import nn
from transformers import DataCollatorForSeq2Seq, TrainerCallback, TrainerControl, TrainerState

import hf_vaswani.training.callbacks
from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.cli import build_parser, settings_from_args
from hf_vaswani.data.batching import TokenBatchSampler
from hf_vaswani.data.tokenization import load_trained_bpe
from hf_vaswani.decoding.metrics import whitespace_bleu
from hf_vaswani.training.callbacks import CheckpointAveragingCallback, ValidationLossCallback, validation_loss
from hf_vaswani.training.checkpoints import TRAINER_STATE, training_ended
from hf_vaswani.training.recipe import build_model, run_recipe, training_arguments
from hf_vaswani.training.schedule import paper_lr_scheduler
from hf_vaswani.training.settings import RecipeSettings
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments, tokenize_corpus

SCRIPT = Path(__file__).parents[2] / "scripts" / "multi30k.sh"
SPLITS = ("train", "val", "test_2016_flickr")


# --- scripts/multi30k.sh --recipe published -------------------------------------------------------------------------


def run_script(tmp_path: Path, data: Path, output: Path, *options: str) -> list[str]:
    """scripts/multi30k.sh with a `vaswani` that only records its arguments: those arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorded = tmp_path / "vaswani_arguments"
    fake = bin_dir / "vaswani"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$@\" > {recorded}\n")
    fake.chmod(0o755)
    # The interpreter running the tests, with this package's dependencies, called by its own path: a symlink to it
    # elsewhere would start Python without the virtual environment it belongs to (found beside the executable's path).
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(SCRIPT), str(data), str(output), *options],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return recorded.read_text().split("\0")[:-1]


def write_raw_corpus(folder: Path) -> None:
    folder.mkdir()
    for split in SPLITS:
        for lang, lines in (("en", TOY_SOURCES), ("de", TOY_TARGETS)):
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.writelines(line.capitalize() + "\n" for line in lines)


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[RecipeSettings, list[str], Path]:
    """The settings `vaswani train` gets from the published recipe, its arguments and the script's output folder."""
    tmp_path = tmp_path_factory.mktemp("published")
    write_raw_corpus(tmp_path / "raw")
    arguments = run_script(tmp_path, tmp_path / "raw", tmp_path / "out", "--recipe", "published", "--resume")
    parsed = build_parser().parse_args(arguments)
    return settings_from_args(parsed), arguments, tmp_path


def test_the_byte_level_variant_undoes_the_count_of_merges(tmp_path) -> None:
    # docs/results.md's side by side: the recipe with GPT-2's BPE, the merges' count undone by `none`
    write_raw_corpus(tmp_path / "raw")
    options = ("--recipe", "published", "--bpe", "byte_level", "--bpe-merges", "none", "--vocab-size", "10260")
    arguments = run_script(tmp_path, tmp_path / "raw", tmp_path / "out", *options)
    settings = settings_from_args(build_parser().parse_args(arguments))
    assert (settings.bpe, settings.bpe_merges, settings.vocab_size) == ("byte_level", None, 10260)


def test_published_command_is_the_anchors_recipe(published) -> None:
    settings, arguments, tmp_path = published
    model = build_model(settings, toy_tokenizer())
    transformer_tiny = dict(  # and fairseq's LayerNorm epsilon and sinusoids
        d_model=128,
        d_ff=256,
        num_heads=4,
        encoder_layers=4,
        decoder_layers=4,
        dropout=0.3,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layer_norm_eps=1e-5,
        positional_encoding="fairseq_sinusoidal",
    )
    assert {name: getattr(model.config, name) for name in transformer_tiny} == transformer_tiny
    # fairseq's peak 0.005 at 2,000 warmup updates, as a factor on Eq. 3's at d_model 128
    assert settings.learning_rate_scale == pytest.approx(0.005 / (128**-0.5 * 2000**-0.5), rel=1e-15)
    args = training_arguments(settings, tmp_path / "checkpoints", "fp32")
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (0.9, 0.98, 1e-8, 0.0)
    assert (args.max_grad_norm, args.label_smoothing_factor, args.gradient_accumulation_steps) == (25, 0.1, 2)
    assert (args.max_steps, args.save_strategy, args.seed, args.bf16, args.fp16) == (8000, "epoch", 1, False, False)
    # subword-nmt's BPE with their 10,000 merges (fairseq's BPE of that era)
    assert (settings.bpe, settings.bpe_merges, settings.max_tokens, settings.average_last) == (
        "subword_nmt",
        10000,
        3800,
        10,
    )
    assert (settings.early_stopping_metric, settings.early_stopping_patience) == ("loss", 10)
    generation = model.generation_config
    assert (generation.num_beams, generation.length_penalty, generation.length_penalty_type) == (5, 1.0, "power")
    assert "--resume" in arguments  # passed through, for a restart
    prepared = tmp_path / "out" / "prepared"
    assert arguments[arguments.index("--train") + 1 :][:2] == [
        str(prepared / "train.en.gz"),
        str(prepared / "train.de.gz"),
    ]
    with gzip.open(prepared / "val.de.gz", "rt", encoding="utf-8") as handle:
        assert handle.readline() == "der hund schläft .\n"  # lowercased and tokenized


def test_prepared_text_is_made_once_whole(published) -> None:
    _, _, tmp_path = published
    prepared = tmp_path / "out" / "prepared"
    before = {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()}
    # A later run uses the prepared text as it is: the raw corpus is no longer read.
    run_script(tmp_path, tmp_path / "missing", tmp_path / "out", "--recipe", "published")
    assert {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()} == before
    # What a run killed while preparing leaves is not the prepared folder: the next run prepares afresh.
    other = tmp_path / "other"
    (other / "prepared.partial").mkdir(parents=True)
    (other / "prepared.partial" / "train.en.gz").write_bytes(b"cut short")
    run_script(tmp_path, tmp_path / "raw", other, "--recipe", "published")
    assert sorted(path.name for path in (other / "prepared").iterdir()) == sorted(before)
    assert not (other / "prepared.partial").exists()


def test_the_default_recipe_is_the_published_one_on_a_time_budget(published, tmp_path) -> None:
    # The same text, model, regularisation, optimiser, batches and beam; what a 28-minute budget changes, and no more.
    published_settings, _, _ = published
    write_raw_corpus(tmp_path / "raw")
    arguments = run_script(tmp_path, tmp_path / "raw", tmp_path / "out")
    assert arguments[arguments.index("--train") + 1] == str(tmp_path / "out" / "prepared" / "train.en.gz")
    default = settings_from_args(build_parser().parse_args(arguments))
    differences = {
        field.name: (getattr(published_settings, field.name), getattr(default, field.name))
        for field in fields(RecipeSettings)
        if getattr(published_settings, field.name) != getattr(default, field.name)
    }
    initialization = differences.pop("model_overrides")
    assert initialization[1] == {**initialization[0], "initialization": "fairseq"}
    assert differences == {
        "max_train_minutes": (None, 28.0),
        "cooldown_steps": (None, 1000),
        "save_steps": (published_settings.save_steps, 250),
        "save_every_epoch": (True, False),
        "average_last": (10, 1),
        "logging_steps": (published_settings.logging_steps, 50),
        "bf16_if_faster": (False, True),
        "eval_bleu_steps": (None, 1000),
        "eval_bleu_sample": (None, 500),
        "early_stopping_metric": ("loss", RecipeSettings().early_stopping_metric),
        "early_stopping_patience": (10, None),
        "seed": (1, RecipeSettings().seed),
    }


def run_ensemble_script(tmp_path: Path, fake_vaswani: str, *options: str) -> subprocess.CompletedProcess:
    """scripts/multi30k.sh --recipe ensemble on a toy corpus, `vaswani` being the shell script `fake_vaswani`, run with
    $CALLS, a folder in which to record its calls."""
    write_raw_corpus(tmp_path / "raw")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "calls").mkdir()
    (bin_dir / "vaswani").write_text(f"#!/bin/sh\nCALLS={tmp_path / 'calls'}\n{fake_vaswani}")
    (bin_dir / "vaswani").chmod(0o755)
    python = bin_dir / "python3"  # as in run_script
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    command = ["bash", str(SCRIPT), str(tmp_path / "raw"), str(tmp_path / "out"), "--recipe", "ensemble", *options]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)


# Each call's threads and arguments, NUL-separated, in a file of its own (the members run at once).
RECORDING = 'printf "%s\\0" "$OMP_NUM_THREADS" "$@" > "$(mktemp "$CALLS/call.XXXXXX")"\n'


def test_the_ensemble_recipe_trains_two_seeds_of_the_default_side_by_side_and_decodes_them_as_one(
    published, tmp_path
) -> None:
    fake = RECORDING + 'if [ "$1" = evaluate ]; then echo \'{"bleu": 1.0}\'; fi\n'
    result = run_ensemble_script(tmp_path, fake, "--seed", "5")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text()) == {"bleu": 1.0}
    calls = [path.read_text().split("\0")[:-1] for path in (tmp_path / "calls").iterdir()]
    trainings = sorted((call for call in calls if call[1] == "train"), key=lambda call: call[call.index("--seed") + 1])
    (evaluation,) = [call for call in calls if call[1] == "evaluate"]
    default = settings_from_args(
        build_parser().parse_args(run_script(tmp_path, tmp_path / "raw", tmp_path / "default"))
    )
    for member, call in enumerate(trainings):
        assert call[0] == str(max(1, os.cpu_count() // 2))  # OMP_NUM_THREADS: half the cores each
        parsed = build_parser().parse_args(call[1:])
        assert parsed.output_dir == out / f"member-{member}"
        settings = settings_from_args(parsed)
        differences = {
            field.name: getattr(settings, field.name)
            for field in fields(RecipeSettings)
            if getattr(settings, field.name) != getattr(default, field.name)
        }
        assert differences == {
            "max_train_minutes": 85.0,
            "length_penalty": 1.4,
            "seed": 5 + member,
        }
    test = [str(out / "prepared" / f"test_2016_flickr.{lang}.gz") for lang in ("en", "de")]
    assert evaluation[1:] == [
        "evaluate",
        str(out / "member-0" / "model"),
        str(out / "member-1" / "model"),
        "--target-lang",
        "de",
        "--source",
        test[0],
        "--reference",
        test[1],
    ]


def test_a_failed_member_stops_the_ensemble_recipe_and_the_other_member(tmp_path) -> None:
    # seed 1 fails once seed 0 is training (it would for a minute): the script stops on the failure, ending seed 0, with
    # one line. seed 1 waits (10 s at most) for seed 0's pid, written whole, or the script could stop seed 0 unstarted.
    fake = RECORDING + (
        'case "$*" in *"--seed 1"*) i=0; while [ ! -e "$CALLS/../sleeper" ] && [ $i -lt 200 ]; do sleep 0.05; '
        "i=$((i + 1)); done; exit 3 ;; "
        '*--seed*) echo $$ > "$CALLS/../sleeper.partial"; mv "$CALLS/../sleeper.partial" "$CALLS/../sleeper"; '
        "exec sleep 60 ;; esac\n"
    )
    started = time.monotonic()
    result = run_ensemble_script(tmp_path, fake)
    assert time.monotonic() - started < 50
    assert result.returncode == 1
    last = result.stderr.splitlines()[-1]  # after preparation's report of the text it wrote
    assert last.startswith("scripts/multi30k.sh: error: ") and "member-0.log" in last, result.stderr
    assert not (tmp_path / "out" / "results.json").exists()
    assert len(list((tmp_path / "calls").iterdir())) == 2  # no evaluation
    status = Path(f"/proc/{(tmp_path / 'sleeper').read_text().strip()}/status")
    deadline = time.monotonic() + 10
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)  # the signal sent, not yet taken
    assert not status.exists() or "State:\tZ" in status.read_text(), "the other member was left running"


# --- Schedule and update ---------------------------------------------------------------------------------------------


def fairseq_inverse_sqrt(num_updates: int, lr: float = 0.005, warmup: int = 2000, warmup_init: float = 1e-7) -> float:
    """fairseq's inverse_sqrt scheduler (inverse_square_root_schedule.py) after `num_updates` updates; fairseq's update
    k (1-based) runs with the value after k - 1 updates."""
    if num_updates < warmup:
        return warmup_init + num_updates * (lr - warmup_init) / warmup
    return lr * math.sqrt(warmup) * num_updates**-0.5


def test_schedule_is_fairseqs_inverse_sqrt_one_update_ahead(published) -> None:
    settings, _, tmp_path = published
    args = training_arguments(settings, tmp_path / "checkpoints", "fp32")
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=args.learning_rate)
    scheduler = paper_lr_scheduler(optimizer, d_model=128, warmup_steps=args.warmup_steps)
    ours = []  # the learning rate of update k = 1 .. max_steps
    for _ in range(settings.max_steps):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    theirs = [fairseq_inverse_sqrt(k - 1) for k in range(1, settings.max_steps + 1)]
    # Our update k runs with what fairseq gives its update k + 1 (the warmup from 0, not from 1e-7, aside)...
    ahead = [fairseq_inverse_sqrt(k) for k in range(1, settings.max_steps + 1)]
    assert ours == pytest.approx(ahead, rel=1e-12, abs=1e-7)
    # ... which is one update's change off fairseq's update k: 2.5e-6 in the warmup, nothing at the end.
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) == pytest.approx(0.005 / 2000, rel=1e-4)
    assert ours[1999] == pytest.approx(0.005, rel=1e-12) and theirs[2000] == pytest.approx(0.005, rel=1e-12)
    assert (ours[-1], theirs[-1]) == pytest.approx((0.0025, 0.0025002), abs=1e-7)


def test_an_update_of_two_token_batches_is_one_step_on_both(tmp_path) -> None:
    """--update-freq 2: the gradient of the update equals that of the label-smoothed cross-entropy summed over both
    batches' target tokens divided by their number (fairseq's normalisation over its 2 GPUs)."""
    tokenizer = toy_tokenizer()
    torch.manual_seed(0)
    config = VaswaniConfig(vocab_size=len(tokenizer), **(TRAINABLE_MODEL | {"dropout": 0.0}))
    model = VaswaniForConditionalGeneration(config)
    initial = copy.deepcopy(model)
    batches, gradients = [], {}

    class Recorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
            gradients.update({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})

    class RecordingTrainer(VaswaniTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            batches.append({name: tensor.clone() for name, tensor in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    args = paper_training_arguments(
        tmp_path, max_steps=1, warmup_steps=1, gradient_accumulation_steps=2, save_strategy="no", disable_tqdm=True
    )
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=tokenize_corpus(toy_dataset(), tokenizer),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        max_tokens=24,
        callbacks=[Recorder()],
    )
    trainer.train()
    assert len(batches) == 2 and all(len(batch["labels"]) < len(TOY_SOURCES) for batch in batches)
    total, tokens = 0.0, 0
    for batch in batches:
        logits = initial(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=batch["decoder_input_ids"],
        ).logits
        labels = batch["labels"].flatten()
        total = total + nn.functional.cross_entropy(
            logits.flatten(0, 1), labels, label_smoothing=0.1, reduction="sum", ignore_index=-100
        )
        tokens += int((labels != -100).sum())
    (total / tokens).backward()
    expected = {name: p.grad for name, p in initial.named_parameters() if p.grad is not None}
    assert gradients.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


# --- Validation loss and patience ----------------------------------------------------------------------------------


def test_validation_loss_is_cross_entropy_summed_over_every_token_divided_by_their_number() -> None:
    tokenizer = toy_tokenizer()
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL, dropout=0.3))
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    validation = tokenize_corpus(toy_dataset(), tokenizer)
    logged = []
    callback = ValidationLossCallback(validation, collator, max_tokens=40, label_smoothing=0.1, log=logged.append)
    assert len(callback.batches) > 1  # so that batches of different sizes are summed
    model.train()
    state, control = TrainerState(global_step=7), TrainerControl(should_save=True)
    callback.on_epoch_end(None, state, control, model=model)
    assert model.training  # dropout back on for training
    everything = collator([validation[i] for i in range(len(validation))])
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in everything.items() if k != "labels"}).logits.flatten(0, 1)
    labels = everything["labels"].flatten()
    tokens = (labels != -100).sum()
    expected_loss = nn.functional.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum") / tokens
    expected_nll = nn.functional.cross_entropy(logits, labels, reduction="sum") / tokens
    assert logged == [
        {
            "eval_loss": pytest.approx(expected_loss.item(), rel=1e-5),
            "eval_nll_loss": pytest.approx(expected_nll.item(), rel=1e-5),
        }
    ]
    # without label smoothing, both are the cross-entropy
    assert validation_loss(model, callback.batches, 0.0) == pytest.approx((expected_nll.item(),) * 2, rel=1e-5)
    callback.on_epoch_end(None, state, TrainerControl(should_save=False), model=model)
    assert len(logged) == 1  # only where a checkpoint is saved


class FedValidations:
    """A ValidationLossCallback whose validations return given losses in turn, on a TrainerState of its own."""

    def __init__(self, monkeypatch, losses: list[float], patience: int | None, history: list[dict] = ()) -> None:
        tokenizer = toy_tokenizer()
        collator = DataCollatorForSeq2Seq(tokenizer)
        validation = tokenize_corpus(toy_dataset().select(range(2)), tokenizer)
        values = iter(losses)
        monkeypatch.setattr(hf_vaswani.training.callbacks, "validation_loss", lambda *_: (next(values), 0.0))
        self.state = TrainerState(log_history=list(history), global_step=history[-1]["step"] if history else 0)
        log = self.state.log_history.append
        self.callback = ValidationLossCallback(
            validation, collator, 64, 0.1, lambda entry: log({**entry, "step": self.state.global_step}), patience
        )
        self.callback.on_train_begin(None, self.state, TrainerControl())

    def stop_step(self, validations: int, steps_per_validation: int = 10) -> int | None:
        """Feed `validations` checkpoints; the step at which training is stopped, None if it is not."""
        for _ in range(validations):
            self.state.global_step += steps_per_validation
            control = TrainerControl(should_save=True)
            self.callback.on_epoch_end(None, self.state, control, model=None)
            if control.should_training_stop:
                return self.state.global_step
        return None


LOSSES = [5.0, 4.0, 4.5, 4.0, 3.9, 4.2, 3.9, 3.95, 4.1, 5.0]  # best 3.9 at step 50; none lower at 60, 70 (equal), 80


def test_patience_stops_after_that_many_validations_without_a_strictly_lower_loss(monkeypatch) -> None:
    # fairseq's should_stop_early: an equal loss (3.9 at 70) does not improve
    fed = FedValidations(monkeypatch, LOSSES, patience=3)
    assert fed.stop_step(len(LOSSES)) == 80
    assert (fed.callback.best_step, fed.callback.best_loss) == (50, 3.9)
    assert FedValidations(monkeypatch, LOSSES, patience=4).stop_step(len(LOSSES)) == 90
    assert FedValidations(monkeypatch, LOSSES, patience=None).stop_step(len(LOSSES)) is None


@pytest.mark.parametrize("interrupted_at", [1, 4, 6, 7])
def test_a_resumed_run_stops_where_an_uninterrupted_one_would(monkeypatch, interrupted_at: int) -> None:
    first = FedValidations(monkeypatch, LOSSES, patience=3)
    assert first.stop_step(interrupted_at) is None
    history = [{"loss": 1.0, "step": 1}, *first.state.log_history]  # as the checkpoint saved it, training logs too
    resumed = FedValidations(monkeypatch, LOSSES[interrupted_at:], patience=3, history=history)
    assert resumed.stop_step(len(LOSSES) - interrupted_at) == 80
    assert (resumed.callback.best_step, resumed.callback.best_loss) == (50, 3.9)


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def test_patience_on_a_loss_that_never_improves_stops_and_averages_the_last_epochs(tmp_path, tokenizer) -> None:
    """Learning rate 0: the weights, so the validation loss, never change; patience 2 stops at the end of the third
    epoch, and the average is of the last 2 epoch checkpoints at the stop (the best, the first epoch, not in it)."""
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL))
    train = tokenize_corpus(toy_dataset(4), tokenizer)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    args = paper_training_arguments(
        tmp_path, max_steps=1000, warmup_steps=4, learning_rate=0.0, save_strategy="epoch", disable_tqdm=True
    )
    averaging = CheckpointAveragingCallback(2)
    trainer = VaswaniTrainer(
        model=model, args=args, train_dataset=train, data_collator=collator, max_tokens=64, callbacks=[averaging]
    )
    validation = tokenize_corpus(toy_dataset(), tokenizer)
    trainer.add_callback(ValidationLossCallback(validation, collator, 64, 0.1, trainer.log, early_stopping_patience=2))
    trainer.train()
    lengths = [len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]]
    sampler = TokenBatchSampler(*lengths, max_tokens=64, seed=args.seed)
    epoch_ends = [len(sampler) * epoch for epoch in (1, 2, 3)]
    validated = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert (
        [entry["step"] for entry in validated] == epoch_ends == [entry["epoch"] * len(sampler) for entry in validated]
    )
    assert len({entry["eval_loss"] for entry in validated}) == 1
    assert trainer.state.global_step == epoch_ends[-1]
    assert [path.name for path in averaging.checkpoints] == [f"checkpoint-{step}" for step in epoch_ends[1:]]
    stop = tmp_path / f"checkpoint-{epoch_ends[-1]}"
    assert training_ended(stop)  # a resumed run only averages and scores
    saved_history = json.loads((stop / TRAINER_STATE).read_text())["log_history"]
    assert saved_history[-1]["step"] == epoch_ends[-1] and "eval_loss" in saved_history[-1]  # its validation saved


# --- The recipe: epoch checkpoints, their average, results -----------------------------------------------------------


def test_recipe_saves_at_epoch_ends_averages_the_last_and_reports_the_validation_loss(tmp_path) -> None:
    settings = toy_settings(
        max_steps=17, update_freq=2, save_every_epoch=True, average_last=3, early_stopping_metric="loss"
    )
    results = run_recipe(toy_corpus(validation=True), tmp_path, settings, dataset_name="toy")
    tokenizer = load_trained_bpe(tmp_path / "tokenizer")
    train = tokenize_corpus(toy_corpus()["train"], tokenizer)
    sampler = TokenBatchSampler(
        [len(ids) for ids in train["input_ids"]], [len(ids) for ids in train["labels"]], settings.max_tokens, seed=0
    )
    updates = []  # the updates of each epoch: its batches, two to an update, the last maybe one
    for epoch in range(settings.max_steps):
        updates.append(math.ceil(len(sampler.all_batches(epoch)) / settings.update_freq))
    ends = [step for step in itertools.accumulate(updates) if step < settings.max_steps] + [settings.max_steps]
    assert len(ends) >= 4  # more epochs than averaged: Trainer's rotation keeps the last 3
    curve = results["validation_loss"]["curve"]
    assert [point["step"] for point in curve] == ends
    assert [point["epoch"] for point in curve[:-1]] == list(range(1, len(ends)))
    kept = [f"checkpoint-{step}" for step in ends[-3:]]
    assert sorted(path.name for path in (tmp_path / "checkpoints").glob("checkpoint-*")) == sorted(kept)
    assert results["averaged_checkpoints"] == kept
    saved = [load_file(tmp_path / "checkpoints" / name / "model.safetensors") for name in kept]
    averaged = load_file(tmp_path / "model" / "model.safetensors")
    assert averaged.keys() == saved[0].keys()
    for key, tensor in averaged.items():
        torch.testing.assert_close(tensor, sum(weights[key] for weights in saved) / 3, msg=key)
    best = min(curve, key=lambda point: point["eval_loss"])
    assert (results["validation_loss"]["best_step"], results["validation_loss"]["best_loss"]) == (
        best["step"],
        best["eval_loss"],
    )
    assert results["validation"] is None and results["label_smoothing"] == 0.1
    pairs = results["examples"]  # the whole 3-sentence test split
    expected = sacrebleu.corpus_bleu(
        [pair["translation"] for pair in pairs],
        [[pair["reference"] for pair in pairs]],
        tokenize="none",
        smooth_method="none",
        force=True,
    ).score
    assert len(pairs) == 3 and results["whitespace_bleu"] == round(expected, 2)


def test_epoch_checkpoints_fewer_than_averaged_are_one_line_before_training(tmp_path) -> None:
    settings = toy_settings(max_steps=4, save_every_epoch=True, average_last=3)  # 9 updates an epoch: 1 epoch
    with pytest.raises(ValueError, match=r"^averaging the last 3 checkpoints \(--average-last\) with "):
        run_recipe(toy_corpus(), tmp_path, settings)
    assert not list(tmp_path.glob("checkpoints/checkpoint-*"))


def test_settings_of_the_published_recipe() -> None:
    # counted in epochs, checked once their length is known, not against --save-steps
    assert RecipeSettings(max_steps=8000, save_every_epoch=True, average_last=10, save_steps=1000).average_last == 10
    with pytest.raises(ValueError, match=r"--average-last\) needs --max-steps"):
        RecipeSettings(max_steps=8000, average_last=10, save_steps=1000)
    # patience on the loss needs no validation BLEU
    assert RecipeSettings(early_stopping_metric="loss", early_stopping_patience=10).eval_bleu_steps is None
    with pytest.raises(ValueError, match=r"--early-stopping-metric must be one of \('bleu', 'loss'\), got 'ppl'"):
        RecipeSettings(early_stopping_metric="ppl")
    with pytest.raises(ValueError, match="--length-penalty-type must be 'gnmt' or 'power', got 'linear'"):
        RecipeSettings(length_penalty_type="linear")
    with pytest.raises(ValueError, match=r"--bpe must be one of \('byte_level', 'subword_nmt'\), got 'wordpiece'"):
        RecipeSettings(bpe="wordpiece")
    for name in ("adam_epsilon", "max_grad_norm"):
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be positive and finite"):
            RecipeSettings(**{name: 0.0})
    defaults = training_arguments(RecipeSettings(), Path("unused"), "fp32")
    assert (defaults.adam_epsilon, defaults.max_grad_norm, defaults.save_strategy) == (1e-9, 0.0, "steps")
    assert training_arguments(RecipeSettings(label_smoothing=0.2), Path("unused"), "fp32").label_smoothing_factor == 0.2


# --- fairseq's BLEU --------------------------------------------------------------------------------------------------


def bleu_by_hand(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU on whitespace tokens written out (Papineni et al.; fairseq's Scorer): clipped n-gram precisions,
    their geometric mean, the brevity penalty, no smoothing."""
    matches, totals, hypothesis_length, reference_length = [0] * 4, [0] * 4, 0, 0
    for hypothesis, reference in zip(hypotheses, references, strict=True):
        h, r = hypothesis.split(), reference.split()
        hypothesis_length, reference_length = hypothesis_length + len(h), reference_length + len(r)
        for n in range(1, 5):
            h_grams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_grams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(count, r_grams[gram]) for gram, count in h_grams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    precision = math.exp(sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4)
    return 100 * precision * min(1.0, math.exp(1 - reference_length / hypothesis_length))


def test_whitespace_bleu_is_fairseqs_bleu_on_the_tokens_as_given() -> None:
    references = ["ein mann mit einem hut &apos;s .", "zwei hunde spielen im schnee .", "eine frau liest ein buch ."]
    hypotheses = ["ein mann mit hut &apos;s .", "zwei hunde spielen im schnee .", "eine frau liest ."]
    score = whitespace_bleu(hypotheses, references)
    assert score == pytest.approx(bleu_by_hand(hypotheses, references), rel=1e-9)
    expected = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none", smooth_method="none", force=True)
    assert score == expected.score
    # no tokenization of its own: "hut." is one token here, as the prepared text would never have it
    assert whitespace_bleu(["ein mann mit hut."], ["ein mann mit hut ."]) < 100
    assert sacrebleu.corpus_bleu(["ein mann mit hut."], [["ein mann mit hut ."]]).score == pytest.approx(100)
