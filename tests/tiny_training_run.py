"""A tiny VaswaniTrainer run for the multi-process and resume tests (run as a script, under a launcher or not).

Usage: python tiny_training_run.py DATA.tsv OUTPUT_DIR MAX_TOKENS UPDATE_FREQ STEPS SAVE_STEPS DROPOUT [resume]
Writes OUTPUT_DIR/state_rank{R}.pt (each rank's final parameters) and, from rank 0, OUTPUT_DIR/initial_state.pt
(the parameters before training), OUTPUT_DIR/losses.json and, with resume, OUTPUT_DIR/resumed_from.txt (the checkpoint
it resumed from, found as the recipe finds it). With checkpoints the run ends as the recipe's does: the last 2 averaged
into OUTPUT_DIR/averaged. The run is seeded and in transformers' full_determinism; with NO_KERNEL_TIMING=1 a kernel
choice by timing fails it. The model's vocabulary is larger than the tokenizer's and odd, so that FSDP2 shards the tied
embedding's rows unevenly.
Under `accelerate launch --use_fsdp` (FSDP1 or 2), or torchrun with TRAINER_FSDP=1 (Trainer's `fsdp` argument, FSDP2 by
default), it trains sharded on the CPU (`FsdpOnCpuTrainer`), each rank writing the full parameters gathered from the
shards, and rank 0 writing them at each checkpoint as well (OUTPUT_DIR/state_step{N}.pt).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from helpers import timing_forbidden
from tiny import TOY_VOCAB_SIZE, TRAINABLE_MODEL
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from transformers import DataCollatorForSeq2Seq, TrainerCallback

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.data.corpus import load_tsv
from hf_vaswani.data.tokenization import train_shared_bpe_from_dataset
from hf_vaswani.kernels import cpu as cpu_kernels
from hf_vaswani.training.callbacks import CheckpointAveragingCallback
from hf_vaswani.training.checkpoints import newest_complete_checkpoint
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments, tokenize_corpus

data, output = sys.argv[1], Path(sys.argv[2])
max_tokens, update_freq, steps, save_steps = (int(value) for value in sys.argv[3:7])
dropout = float(sys.argv[7])
resume = sys.argv[8:] == ["resume"]
torch.set_num_threads(1)
if os.environ.get("NO_KERNEL_TIMING"):
    cpu_kernels.fastest = timing_forbidden
dataset = load_tsv(data)
tokenizer = train_shared_bpe_from_dataset(dataset, vocab_size=TOY_VOCAB_SIZE, min_frequency=1)
torch.manual_seed(0)
VOCAB_SIZE = 1011  # odd: 2 processes hold 506 and 505 rows of the tied embedding
assert VOCAB_SIZE >= len(tokenizer)
config = VaswaniConfig(vocab_size=VOCAB_SIZE, **TRAINABLE_MODEL, dropout=dropout)
model = cpu_kernels.kernelize(VaswaniForConditionalGeneration(config))  # as the recipe builds it
trainer_fsdp = os.environ.get("TRAINER_FSDP") == "1"
fsdp = trainer_fsdp or os.environ.get("ACCELERATE_USE_FSDP") == "true"  # what `accelerate launch --use_fsdp` sets
if int(os.environ.get("RANK", "0")) == 0:
    output.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), output / "initial_state.pt")
args = paper_training_arguments(
    output,
    max_steps=steps,
    warmup_steps=4,
    gradient_accumulation_steps=update_freq,
    logging_steps=1,
    save_strategy="steps" if save_steps else "no",
    save_steps=save_steps or 1,
    disable_tqdm=True,
    seed=0,
    full_determinism=True,
    dataloader_num_workers=0,
    # Trainer's own argument (FSDP2, its default version, whole-model checkpoints, layers wrapped by _no_split_modules)
    fsdp=True if trainer_fsdp else None,
)


class FsdpOnCpuTrainer(VaswaniTrainer):
    """VaswaniTrainer on accelerate's FSDP path on a CPU. accelerate turns FSDP on only with an accelerator (on a CPU
    `--use_fsdp` and Trainer's `fsdp` train DDP), so its state is set as it is on GPUs."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        # from Trainer's `fsdp` argument as Trainer makes it, else from the launcher's flags as Accelerator does
        plugin_args = self.args.fsdp_plugin_args or {}
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
        # In both of accelerate's shared states, as accelerate sets them: an AcceleratorState made later (Trainer makes
        # some) takes PartialState's. accelerate's CPU device is "cpu:0", which torch's FSDP takes for another device
        # than its parameters' "cpu".
        for shared in (state, PartialState()):
            shared.distributed_type = DistributedType.FSDP
            shared.device = torch.device("cpu")
        self.is_fsdp_enabled = True


trainer = (FsdpOnCpuTrainer if fsdp else VaswaniTrainer)(
    model=model,
    args=args,
    train_dataset=tokenize_corpus(dataset, tokenizer),
    data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    processing_class=tokenizer,
    max_tokens=max_tokens,
    callbacks=[CheckpointAveragingCallback(2)] if save_steps else None,
)


def gathered_state() -> dict[str, torch.Tensor]:
    """The whole of every parameter, under the plain model's names (every rank takes part in the gathering)."""
    if fsdp:
        return get_model_state_dict(trainer.model_wrapped, options=StateDictOptions(full_state_dict=True))
    return trainer.model.state_dict()


class GatherAtSave(TrainerCallback):
    """Under FSDP, the whole parameters at each checkpoint, to compare the checkpoints' average with."""

    def on_save(self, args, state, control, **kwargs):
        if fsdp:
            weights = gathered_state()
            if state.is_world_process_zero:
                torch.save(weights, output / f"state_step{state.global_step}.pt")


class WaitAfterSave(TrainerCallback):
    """With HANG_AFTER_SAVE_STEP=N the run waits once checkpoint N is complete, to be killed there (resume test)."""

    def on_save(self, args, state, control, **kwargs):
        if str(state.global_step) == os.environ.get("HANG_AFTER_SAVE_STEP"):
            (output / "saved").write_text(str(state.global_step))
            time.sleep(600)


trainer.add_callback(GatherAtSave())
trainer.add_callback(WaitAfterSave())
# as the recipe resumes: from the newest complete checkpoint (only the main process moves incomplete ones aside)
checkpoint = newest_complete_checkpoint(output, move_aside=trainer.is_world_process_zero()) if resume else None
if checkpoint is not None and trainer.is_world_process_zero():
    (output / "resumed_from.txt").write_text(checkpoint.name)
trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
torch.save(gathered_state(), output / f"state_rank{trainer.args.process_index}.pt")
if trainer.is_world_process_zero():
    if fsdp:  # the modules FSDP made units of their own, inside the whole model's (FSDP2 names its classes FSDP...)
        wrapped = trainer.model_wrapped
        units = [unit.module for unit in wrapped.modules() if isinstance(unit, FullyShardedDataParallel)][1:]
        units += [unit for unit in wrapped.modules() if isinstance(unit, FSDPModule) and unit is not wrapped]
        names = [type(module).__name__.removeprefix("FSDP") for module in units]
        (output / "fsdp_units.txt").write_text("\n".join(names))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    (output / "losses.json").write_text(json.dumps(losses))
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # PyTorch asks this of every process-group program before it exits
