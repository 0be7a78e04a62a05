"""The paper's training recipe (§5) on transformers' Seq2SeqTrainer.

Stock pieces do most of the work: Seq2SeqTrainer runs the loop, `DataCollatorForSeq2Seq` pads, AdamW with zero weight
decay is the paper's Adam (§5.3: beta1 0.9, beta2 0.98, eps 1e-9), the model computes the label-smoothed loss (§5.4)
and `gradient_accumulation_steps` is fairseq's `update_freq`. Written here because transformers lacks them: batches of
about `max_tokens` source and target tokens (§5.1) and the exact learning-rate formula (§5.3, Eq. 3).
"""

import copy
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from torch.optim.lr_scheduler import LambdaLR
from transformers import PreTrainedTokenizerBase, Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

from .averaging import average_checkpoints, last_checkpoints
from .batching import TokenBatchSampler
from .configuration_vaswani import VaswaniConfig
from .inference import translate
from .metrics import corpus_scores, lowercased_tokenized_bleu
from .modeling_vaswani import VaswaniForConditionalGeneration

logger = logging.getLogger(__name__)

# What Trainer needs to continue a run exactly; it silently starts afresh (new Adam moments, schedule from step 0 or
# new random state) where one is missing, so a checkpoint without all of them is not one to resume from.
CHECKPOINT_ARCHIVES = ("optimizer.pt", "scheduler.pt")  # torch.save zip archives
INCOMPLETE_PREFIX = "incomplete-"  # not `checkpoint-*`: Trainer's rotation and the averaging never see these folders


def paper_learning_rate(step: int, d_model: int, warmup_steps: int) -> float:
    """§5.3, Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), steps counted from 1."""
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


class PaperSchedule:
    """Eq. 3's multiplier of the base learning rate for LambdaLR, counting updates from 0 as LambdaLR does.

    With `cooldown_steps` (not in the paper), Eq. 3's rate is also multiplied by a factor falling linearly from 1 to
    0 over the last `cooldown_steps` of `total_steps` (the last update gets 1 / cooldown_steps of Eq. 3): Eq. 3 alone
    never decays to zero, which a run of a fixed, short length can use (Hägele et al., 2024, "Scaling Laws and
    Compute-Optimal Training beyond Fixed Training Durations"). A callable object rather than a closure: LambdaLR
    saves its attributes with the scheduler, so a resumed run keeps a `total_steps` (and a shortened, fractional
    `cooldown_steps`) that `TrainingTimeBudgetCallback` moved.
    """

    def __init__(self, d_model: int, warmup_steps: int, cooldown_steps: int | None, total_steps: int | None) -> None:
        if warmup_steps <= 0:
            raise ValueError(f"warmup_steps must be positive for the paper's schedule, got {warmup_steps}")
        if cooldown_steps is not None and not (total_steps is not None and 0 < cooldown_steps <= total_steps):
            raise ValueError(f"cooldown_steps must be in 1..total_steps ({total_steps}), got {cooldown_steps}")
        self.d_model, self.warmup_steps = d_model, warmup_steps
        self.cooldown_steps, self.total_steps = cooldown_steps, total_steps

    def __call__(self, update: int) -> float:
        # transformers' `inverse_sqrt` is Eq. 3 one update late (its first update has learning rate 0): LambdaLR
        # counts updates from 0, the paper from 1.
        rate = paper_learning_rate(update + 1, self.d_model, self.warmup_steps)
        if self.cooldown_steps is not None:
            rate *= min(1.0, max(0, self.total_steps - update) / self.cooldown_steps)
        return rate


def paper_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    d_model: int,
    warmup_steps: int,
    cooldown_steps: int | None = None,
    total_steps: int | None = None,
) -> LambdaLR:
    """Eq. 3 as a scheduler (`PaperSchedule`); the optimizer's base learning rate multiplies it (1.0: the paper's)."""
    return LambdaLR(optimizer, PaperSchedule(d_model, warmup_steps, cooldown_steps, total_steps))


def paper_training_arguments(output_dir: str | Path, **overrides) -> Seq2SeqTrainingArguments:
    """Seq2SeqTrainingArguments with §5.3's Adam and the paper's schedule multiplier; any argument can be overridden."""
    settings = dict(
        output_dir=str(output_dir),
        optim="adamw_torch_fused",  # one kernel for the whole update, CPU included
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-9,
        weight_decay=0.0,
        learning_rate=1.0,  # multiplies Eq. 3 in VaswaniTrainer
        warmup_steps=4000,
        max_grad_norm=0.0,  # the paper clips nothing
        save_strategy="steps",
        report_to=[],
        # On a machine without an accelerator this also makes several processes (torchrun, accelerate launch) talk
        # over gloo; without it each process would train alone.
        use_cpu=not (torch.cuda.is_available() or torch.backends.mps.is_available()),
        ddp_find_unused_parameters=False,  # every parameter takes part in every step
    )
    arguments = {**settings, **overrides}
    if arguments.get("bf16") and arguments["use_cpu"] and not cpu_bf16_matmul_works():
        raise ValueError(
            "bf16 on this CPU: a bfloat16 matmul stops the process with an illegal instruction (the CPU advertises AMX "
            "that this machine does not enable, as on some virtual machines). Set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "
            "in the environment to use AVX-512 BF16 without AMX, or train in fp32."
        )
    return Seq2SeqTrainingArguments(**arguments)


def cpu_bf16_matmul_works() -> bool:
    """Whether a bfloat16 matmul runs on this CPU, tried in a child process since the failure is a crash (SIGILL)."""
    probe = "import torch; torch.randn(8, 64, dtype=torch.bfloat16) @ torch.randn(64, 64, dtype=torch.bfloat16)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


BF16_MIN_SPEEDUP = 1.1  # bf16 rounds more: take it only for a clear win, not for measurement noise


def bf16_training_seconds(config: VaswaniConfig, max_tokens: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds of one training forward and backward pass of a `config` model in float32 ("fp32") and in bf16
    mixed precision ("bf16") on this CPU, for a batch of about `max_tokens` random tokens on each side.

    Which is faster depends on the CPU: bfloat16 matmuls run at about twice float32's rate with AVX512-BF16 or AMX and
    are emulated elsewhere, so `vaswani train --bf16-if-faster` measures rather than guesses. Rounds alternate between
    the two after a warm-up; a few seconds at Multi30k's model size. Call only where `cpu_bf16_matmul_works()`.
    """
    generator = torch.Generator().manual_seed(0)
    config = copy.deepcopy(config)
    config.loss_without_logits = True  # as VaswaniTrainer trains
    model = VaswaniForConditionalGeneration(config)
    model.train()
    length = 24
    tokens = torch.randint(4, config.vocab_size, (2, max(1, max_tokens // length), length), generator=generator)
    batch = {"input_ids": tokens[0], "labels": tokens[1]}

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for bf16 in (False, True):  # warm-up: the thread pool, the libraries' buffers, the autocast weight casts
        step(bf16)
    for _ in range(rounds):
        for name in seconds:
            seconds[name].append(step(name == "bf16"))
    return {name: statistics.median(values) for name, values in seconds.items()}


def tokenize_corpus(corpus: DatasetDict | Dataset, tokenizer: PreTrainedTokenizerBase) -> DatasetDict | Dataset:
    """`source`/`target` text columns to `input_ids`, `attention_mask` and `labels` (each ending with </s>)."""

    def encode(batch: dict[str, list[str]]) -> dict:
        return tokenizer(batch["source"], text_target=batch["target"])

    columns = corpus.column_names
    if isinstance(columns, dict):
        columns = next(iter(columns.values()))
    return corpus.map(encode, batched=True, remove_columns=columns, desc="Tokenizing")


class BpeDropoutPairs(torch.utils.data.Dataset):
    """Training pairs segmented afresh every epoch with BPE-dropout (Provilkov et al., 2020, "BPE-Dropout: Simple and
    Effective Subword Regularization"): each merge of the BPE model is skipped with probability `dropout`.

    Not in the paper: a regulariser for small corpora, on which one fixed segmentation is seen many times. `tokenizers`'
    BPE model does the dropout, on a copy of `tokenizer`'s backend (so validation and test keep deterministic BPE), and
    draws from its own generator, which cannot be seeded: a run with BPE-dropout does not repeat bit for bit, and a
    resumed run segments its epochs afresh.
    `ResegmentedBatchSampler` packs each epoch's batches on that epoch's lengths (about 15% more tokens at 0.1): packed
    on the deterministic lengths, the resegmented batches would carry half again as much padding.
    """

    def __init__(
        self, sources: Sequence[str], targets: Sequence[str], tokenizer: PreTrainedTokenizerBase, dropout: float
    ) -> None:
        if not 0 < dropout < 1:
            raise ValueError(f"BPE-dropout must be in (0, 1), got {dropout}")
        self.sources, self.targets = list(sources), list(targets)
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())  # model, pre-tokenizer and </s>
        self.backend.model.dropout = dropout
        self.epoch: int | None = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Segment the pairs for `epoch` (once: the sampler and accelerate's data loader both call it)."""
        if epoch != self.epoch:
            self.encoded_sources = self.backend.encode_batch(self.sources)
            self.encoded_targets = self.backend.encode_batch(self.targets)
            self.epoch = epoch

    def lengths(self) -> tuple[list[int], list[int]]:
        """Source and target lengths of this epoch's segmentation, </s> included."""
        return [len(pair.ids) for pair in self.encoded_sources], [len(pair.ids) for pair in self.encoded_targets]

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        source = self.encoded_sources[index]
        return {
            "input_ids": source.ids,
            "attention_mask": source.attention_mask,
            "labels": self.encoded_targets[index].ids,
        }


class ResegmentedBatchSampler(TokenBatchSampler):
    """`TokenBatchSampler` over `BpeDropoutPairs`, packing each epoch on that epoch's segmentation.

    Trainer counts an epoch's steps once, from the first epoch, so every epoch has the same number of batches: the
    first epoch's count plus a margin for the segmentations' variation (on Multi30k, 138 or 139 batches), reached by
    splitting the largest batches as with several replicas.
    """

    def __init__(self, pairs: BpeDropoutPairs, max_tokens: int, seed: int = 0) -> None:
        super().__init__(*pairs.lengths(), max_tokens=max_tokens, seed=seed)
        self.pairs = pairs
        longest = np.maximum(self.source_lengths, self.target_lengths)
        packed = len(self._pack(np.argsort(longest, kind="stable")))  # the first epoch's segmentation
        self.num_batches = math.ceil(1.03 * packed) + 1

    def _batch_count(self, packed: int) -> int:
        if packed > self.num_batches:
            raise RuntimeError(
                f"BPE-dropout: epoch {self.epoch}'s segmentation packs into {packed} batches, more than the "
                f"{self.num_batches} that Trainer counts per epoch; raise max_tokens"
            )
        return self.num_batches

    def _build(self, epoch: int) -> list[list[int]]:
        self.pairs.set_epoch(epoch)
        self.source_lengths, self.target_lengths = (np.asarray(lengths) for lengths in self.pairs.lengths())
        return super()._build(epoch)


def replace_file(path: Path, write: Callable[[Path], object]) -> Path:
    """Let `write` create a temporary file next to `path`, then rename it over `path`: whole or not at all.

    A failed write (disk full, an error, an interrupt) leaves the old file as it was and removes the partial one; the
    temporary name does not end in `path`'s suffix, so a writer that picks its format by the name must be told it.
    """
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (`replace_file`)."""
    replace_file(path, lambda temporary: temporary.write_text(text))


def replace_folder(folder: Path, write: Callable[[Path], object]) -> Path:
    """Let `write` fill a temporary folder next to `folder`, then swap it in: a killed run leaves the old folder whole.

    A directory cannot be renamed over a non-empty one, so the old folder steps aside for the two renames in between.
    A failed `write` removes the partial folder.
    """
    temporary = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        write(temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    previous = folder.with_name(f"{folder.name}.old-{os.getpid()}")
    if folder.exists():
        os.replace(folder, previous)
    os.replace(temporary, folder)
    shutil.rmtree(previous, ignore_errors=True)
    return folder


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from (a file missing or cut short), or None when it is complete.

    Reads headers and archive directories only (cheap at any model size): a save killed midway leaves files missing or
    truncated, which these catch; they do not verify every byte.
    """
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError) as error:
        return f"trainer_state.json: {type(error).__name__}"
    try:
        with safe_open(checkpoint / "model.safetensors", framework="pt") as weights:
            weights.keys()
    except (OSError, SafetensorError) as error:
        return f"model.safetensors: {' '.join(str(error).split()) or type(error).__name__}"
    random_states = sorted(path.name for path in checkpoint.glob("rng_state*.pth"))
    if not random_states:
        return "no rng_state*.pth"
    for name in (*CHECKPOINT_ARCHIVES, *random_states):
        try:
            zipfile.ZipFile(checkpoint / name).close()
        except (OSError, zipfile.BadZipFile) as error:
            return f"{name}: {type(error).__name__}"
    return None


def newest_complete_checkpoint(checkpoint_dir: str | Path, move_aside: bool = True) -> Path | None:
    """The `checkpoint-<step>` folder with the highest step that is complete, or None when there is none.

    Each newer incomplete one (a run killed while saving) is logged in one line naming it, why and the fallback, and
    with `move_aside` renamed to `incomplete-checkpoint-<step>`, where neither Trainer's rotation nor the averaging
    picks it up; it is kept for inspection rather than deleted.
    """
    checkpoints = [path for path in Path(checkpoint_dir).glob("checkpoint-*") if path.name.split("-")[1].isdigit()]
    newest_first = sorted(checkpoints, key=lambda path: int(path.name.split("-")[1]), reverse=True)
    for index, checkpoint in enumerate(newest_first):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        fallback = (
            f"resuming from {newest_first[index + 1].name}" if index + 1 < len(newest_first) else "starting afresh"
        )
        if move_aside:
            aside = checkpoint.with_name(INCOMPLETE_PREFIX + checkpoint.name)
            shutil.rmtree(aside, ignore_errors=True)  # an older broken copy of the same step
            os.replace(checkpoint, aside)
            fallback = f"moved to {aside.name}; {fallback}"
        logger.warning(f"{checkpoint} is incomplete ({problem}); {fallback}")
    return None


class VaswaniTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer with the paper's token-based batches (§5.1) and learning-rate schedule (§5.3, Eq. 3).

    With `max_tokens`, each training batch holds sentence pairs of similar length with at most `max_tokens` (padded)
    source tokens and as many target tokens, sharded over processes so that each pair is seen once per epoch;
    `per_device_train_batch_size` is then unused. The schedule uses `args.warmup_steps` and the model's d_model, scaled
    by `args.learning_rate`, and with `cooldown_steps` falls linearly to zero over the run's last steps
    (`paper_lr_scheduler`).
    """

    def __init__(self, *args, max_tokens: int | None = None, cooldown_steps: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.cooldown_steps = cooldown_steps

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.max_tokens is None:
            return super().get_train_dataloader()
        dataset = self.train_dataset
        if isinstance(dataset, BpeDropoutPairs):
            if self.args.world_size > 1:  # the processes' segmentations, and so their batches, would differ
                raise ValueError("BPE-dropout segments in one process; with several, train without it")
            sampler = ResegmentedBatchSampler(dataset, self.max_tokens, seed=self.args.seed)
        else:
            dataset = self._remove_unused_columns(dataset, description="training")
            sampler = TokenBatchSampler(
                [len(ids) for ids in dataset["input_ids"]],
                [len(ids) for ids in dataset["labels"]],
                max_tokens=self.max_tokens,
                seed=self.args.seed,
                num_replicas=self.args.world_size,
                rank=self.args.process_index,
            )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
        )
        loader = self.accelerator.prepare(loader)
        # The sampler already gives each rank its own batches; accelerate's BatchSamplerShard would shard them again.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        # Training reads only the loss: the model then never holds the full-vocabulary logits (loss_vaswani.py).
        # Scoped to this call, so that the saved config keeps forward's default of returning logits.
        config = self.accelerator.unwrap_model(model).config
        previous, config.loss_without_logits = config.loss_without_logits, not return_outputs
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            config.loss_without_logits = previous

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        if self.lr_scheduler is None:
            warmup = self.args.get_warmup_steps(num_training_steps)
            self.lr_scheduler = paper_lr_scheduler(
                optimizer or self.optimizer,
                self.model.config.d_model,
                warmup,
                cooldown_steps=self.cooldown_steps,
                total_steps=num_training_steps,
            )
        return self.lr_scheduler

    def _issue_warnings_after_load(self, load_result) -> None:
        # A checkpoint stores a tied weight once, under its source (lm_head.weight is the shared embedding): resuming
        # loads it with strict=False, which reports the tied copies as missing although they were loaded through it.
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        missing = set(load_result.missing_keys)
        falsely_missing = {target for target, source in tied.items() if target in missing and source not in missing}
        if falsely_missing:
            self.model.tie_weights()
            load_result = load_result._replace(
                missing_keys=[key for key in load_result.missing_keys if key not in falsely_missing]
            )
        super()._issue_warnings_after_load(load_result)


class CheckpointAveragingCallback(TrainerCallback):
    """§6.1: at the end of training, average the last `num_checkpoints` saved checkpoints into `output_dir/averaged`.

    With `end_at_best_validation`, the average ends at the step of the best validation BLEU that
    `ValidationBleuCallback` logged (early stopping trains on past it) instead of at the last checkpoint. Keep
    `save_total_limit` (if set) large enough for the checkpoints averaged, or they are gone before the average.
    """

    def __init__(
        self, num_checkpoints: int = 5, subdirectory: str = "averaged", end_at_best_validation: bool = False
    ) -> None:
        self.num_checkpoints = num_checkpoints
        self.subdirectory = subdirectory
        self.end_at_best_validation = end_at_best_validation
        self.averaged_path: Path | None = None
        self.checkpoints: list[Path] = []  # those averaged, oldest first

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            best = best_validation(state.log_history) if self.end_at_best_validation else None
            last_step = best["step"] if best else None
            self.checkpoints = last_checkpoints(args.output_dir, self.num_checkpoints, up_to_step=last_step)
            self.averaged_path = replace_folder(
                Path(args.output_dir) / self.subdirectory, lambda folder: average_checkpoints(self.checkpoints, folder)
            )


class TrainingTimeBudgetCallback(TrainerCallback):
    """Ends training after about `minutes` of wall-clock time with its cooldown (`PaperSchedule`) still ending at the
    last step, which a number of steps cannot promise on CPUs that differ in speed (as fairseq's `--stop-time-hours`
    does for a schedule without an end).

    At each step the last step is projected from the mean step time so far (validation and checkpoints included).
    Before the cooldown begins it is capped by `args.max_steps` and moves either way. During the cooldown it only comes
    sooner, where the machine has slowed down: the learning rate then falls from where it is to zero at the new last
    step, steeper than planned, rather than the run overrunning its time. A resumed run ends at the step its
    checkpoint's schedule holds. One process only: several would each project their own last step.
    """

    def __init__(self, minutes: float) -> None:
        if minutes <= 0:
            raise ValueError(f"minutes must be positive, got {minutes}")
        self.seconds = 60 * minutes
        self.schedule: PaperSchedule | None = None  # these three are set when training begins
        self.started = 0.0
        self.resumed = False

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs) -> None:
        self.schedule = lr_scheduler.lr_lambdas[0]  # VaswaniTrainer's PaperSchedule
        self.started = time.perf_counter()
        self.resumed = state.global_step > 0
        state.max_steps = self.schedule.total_steps

    def on_step_end(self, args, state, control, **kwargs) -> None:
        schedule, step, cooldown = self.schedule, state.global_step, self.schedule.cooldown_steps or 0
        if self.resumed:
            return
        projected = int(self.seconds * step / (time.perf_counter() - self.started))
        if step < schedule.total_steps - cooldown:
            schedule.total_steps = state.max_steps = max(step + cooldown, min(args.max_steps, projected))
        elif cooldown and projected < schedule.total_steps:
            # The scheduler has already given update `step` its factor (T - step) / C; the new line to zero at T'
            # passes through it: (T' - step) / C' with C' = (T' - step) * C / (T - step). T' is at least the next
            # step, which DefaultFlowCallback then still sees.
            end = max(step + 1, projected)
            if end < schedule.total_steps:
                schedule.cooldown_steps *= (end - step) / (schedule.total_steps - step)
                schedule.total_steps = state.max_steps = end
        if step >= state.max_steps:  # time is up without a cooldown; DefaultFlowCallback has already seen this step
            control.should_training_stop = True
            if args.save_strategy == "steps":
                control.should_save = True


def best_validation(log_history: list[dict]) -> dict | None:
    """The entry `ValidationBleuCallback` logged with the highest validation sacreBLEU (the first of equal ones).

    Read from the log history, which a resumed run restores from its checkpoint, so it covers the whole run.
    """
    return max((entry for entry in log_history if "eval_bleu" in entry), key=lambda e: e["eval_bleu"], default=None)


class ValidationBleuCallback(TrainerCallback):
    """BLEU on a validation set every `eval_steps` optimizer steps, as fairseq's `--eval-bleu` and Marian's validation.

    Translates `sources` with the model being trained (greedy by default: fast, and it ranks checkpoints as beam search
    does) and logs through `log` (give it `trainer.log`: the entry then lands in `state.log_history` and every
    reporting callback) `eval_bleu` (sacreBLEU), `eval_lowercased_tokenized_bleu` and `elapsed_minutes` since training
    began, for the training-curve plot. Keeps the best step (`best_step`, `best_bleu`, by sacreBLEU) and, with
    `early_stopping_patience`, saves a checkpoint at each new best and stops training when BLEU has not improved for
    that many evaluations in a row (`CheckpointAveragingCallback(end_at_best_validation=True)` then averages up to the
    best).

    Written here rather than through transformers' evaluation loop and EarlyStoppingCallback: that loop runs a loss pass
    over the whole set and generates in unsorted padded batches, and EarlyStoppingCallback needs it (it reads the
    metrics of `on_evaluate` and requires `eval_strategy` and `metric_for_best_model`). This callback reuses
    `translate` (length-sorted batches) and the package's metrics. Every process translates, so that all of them take
    the same early-stopping decision.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sources: Sequence[str],
        references: Sequence[str],
        target_lang: str,
        eval_steps: int,
        log: Callable[[dict[str, float]], None],
        num_beams: int = 1,
        batch_size: int = 64,
        early_stopping_patience: int | None = None,
    ) -> None:
        if eval_steps <= 0:
            raise ValueError(f"eval_steps must be positive, got {eval_steps}")
        if early_stopping_patience is not None and early_stopping_patience <= 0:
            raise ValueError(f"early_stopping_patience must be positive, got {early_stopping_patience}")
        self.tokenizer = tokenizer
        self.sources, self.references = list(sources), list(references)
        self.target_lang = target_lang
        self.eval_steps = eval_steps
        self.log = log
        self.num_beams = num_beams
        self.batch_size = batch_size
        self.early_stopping_patience = early_stopping_patience
        self.best_step: int | None = None
        self.best_bleu: float | None = None
        self.evaluations_without_improvement = 0
        self.started = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        # A resumed run has its log history back from the checkpoint: the best step, the count of evaluations since
        # it (early stopping's patience) and the clock of the curve continue from the validations logged before.
        validations = [entry for entry in state.log_history if "eval_bleu" in entry]
        best = best_validation(validations)
        self.best_step, self.best_bleu = (best["step"], best["eval_bleu"]) if best else (None, None)
        self.evaluations_without_improvement = len(validations) - 1 - validations.index(best) if best else 0
        self.started = time.perf_counter() - 60 * (validations[-1]["elapsed_minutes"] if validations else 0.0)

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        if state.global_step % self.eval_steps != 0:
            return
        was_training = model.training
        try:
            hypotheses = translate(
                model, self.tokenizer, self.sources, self.batch_size, progress=False, num_beams=self.num_beams
            )
        finally:
            model.train(was_training)  # translate leaves the model in eval mode: dropout must come back
        bleu = corpus_scores(hypotheses, self.references)["bleu"]
        lowercased = lowercased_tokenized_bleu(hypotheses, self.references, self.target_lang)["bleu"]
        self.log(
            {
                "eval_bleu": bleu,
                "eval_lowercased_tokenized_bleu": lowercased,
                "elapsed_minutes": (time.perf_counter() - self.started) / 60,
            }
        )
        if self.best_bleu is None or bleu > self.best_bleu:
            self.best_step, self.best_bleu = state.global_step, bleu
            self.evaluations_without_improvement = 0
            if self.early_stopping_patience:
                control.should_save = True  # the best step becomes a checkpoint, for an average that ends there
        else:
            self.evaluations_without_improvement += 1
        if self.early_stopping_patience and self.evaluations_without_improvement >= self.early_stopping_patience:
            logger.info(f"validation BLEU has not improved for {self.early_stopping_patience} evaluations: stopping")
            control.should_training_stop = True
            control.should_save = True  # the last step's weights become a checkpoint for the average
