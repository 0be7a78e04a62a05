"""A tiny VaswaniTrainer run for the multi-process and resume tests (run as a script, under a launcher or not).

Usage: python tiny_training_run.py DATA.tsv OUTPUT_DIR MAX_TOKENS UPDATE_FREQ STEPS SAVE_STEPS DROPOUT [resume]
Writes OUTPUT_DIR/state_rank{R}.pt (each rank's final parameters) and, from rank 0, OUTPUT_DIR/losses.json.
The run is seeded and in transformers' full_determinism; with NO_KERNEL_TIMING=1 a kernel choice by timing fails it.
Under `accelerate launch --use_fsdp` it trains sharded on the CPU (`FsdpOnCpuTrainer`), each rank writing the full
parameters gathered from the shards.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from helpers import timing_forbidden
from tiny import TOY_VOCAB_SIZE, TRAINABLE_MODEL
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel
from transformers import DataCollatorForSeq2Seq, TrainerCallback

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.data.corpus import load_tsv
from hf_vaswani.data.tokenization import train_shared_bpe_from_dataset
from hf_vaswani.kernels import cpu as cpu_kernels
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
config = VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL, dropout=dropout)
model = cpu_kernels.kernelize(VaswaniForConditionalGeneration(config))  # as the recipe builds it
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
)


class FsdpOnCpuTrainer(VaswaniTrainer):
    """VaswaniTrainer on accelerate's FSDP path on a CPU. accelerate turns FSDP on only with an accelerator (on a CPU
    `--use_fsdp` trains DDP), so its state is set as it is on GPUs, from the launcher's --fsdp_* flags."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        state.fsdp_plugin = FullyShardedDataParallelPlugin()  # reads the launcher's flags, as Accelerator does
        state.distributed_type = DistributedType.FSDP
        # accelerate's CPU device is "cpu:0", which torch's FSDP takes for another device than its parameters' "cpu"
        state.device = torch.device("cpu")
        self.is_fsdp_enabled = True


fsdp = os.environ.get("ACCELERATE_USE_FSDP") == "true"  # what `accelerate launch --use_fsdp` sets
trainer = (FsdpOnCpuTrainer if fsdp else VaswaniTrainer)(
    model=model,
    args=args,
    train_dataset=tokenize_corpus(dataset, tokenizer),
    data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    max_tokens=max_tokens,
)


class WaitAfterSave(TrainerCallback):
    """With HANG_AFTER_SAVE_STEP=N the run waits once checkpoint N is complete, to be killed there (resume test)."""

    def on_save(self, args, state, control, **kwargs):
        if str(state.global_step) == os.environ.get("HANG_AFTER_SAVE_STEP"):
            (output / "saved").write_text(str(state.global_step))
            time.sleep(600)


trainer.add_callback(WaitAfterSave())
trainer.train(resume_from_checkpoint=resume or None)
if fsdp:  # each rank gathers the whole of every parameter, under the plain model's names
    final_state = get_model_state_dict(trainer.model_wrapped, options=StateDictOptions(full_state_dict=True))
else:
    final_state = trainer.model.state_dict()
torch.save(final_state, output / f"state_rank{trainer.args.process_index}.pt")
if trainer.is_world_process_zero():
    if fsdp:  # the modules FSDP made units of their own, inside the whole model's
        units = [unit.module for unit in trainer.model_wrapped.modules() if isinstance(unit, FullyShardedDataParallel)]
        (output / "fsdp_units.txt").write_text("\n".join(type(module).__name__ for module in units[1:]))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    (output / "losses.json").write_text(json.dumps(losses))
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # PyTorch asks this of every process-group program before it exits
