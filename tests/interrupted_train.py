"""`vaswani train` that sends itself a signal at one phase of the run (the fault-injection test runs it).

Usage: python interrupted_train.py PHASE SIGNAL [vaswani train options...]
PHASE is where the signal comes: `step-N` (after optimizer step N), `saving-N` (while checkpoint N is being written,
its weights saved but not its optimizer state), `averaging` (the averaged weights written, before they are moved into
place), `model-save` (the model folder written, before it is moved into place) or `none`. SIGNAL is KILL, INT or
STOP (the run then waits, holding its folder, until it is killed).
"""

import os
import signal
import sys
import threading
import time

import torch
from transformers import TrainerCallback

import hf_vaswani.training.callbacks
import hf_vaswani.training.recipe
from hf_vaswani.cli import main

phase, signal_name, options = sys.argv[1], sys.argv[2], sys.argv[3:]
# Ctrl-C as on a terminal: a process started in the background of a non-interactive shell (as CI may start the suite)
# inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupt() -> None:
    # To the main thread, as Ctrl-C on a terminal comes: a signal sent to the process may reach any of its threads
    # (torch's among them), which would leave the main thread to run on.
    signal.pthread_kill(threading.main_thread().ident, getattr(signal, "SIG" + signal_name))
    # SIGINT raises KeyboardInterrupt in the main thread at its next bytecode, SIGKILL never returns, SIGSTOP returns
    # only if the test lets the run go on: wait without a system call that a signal must interrupt
    while True:
        time.sleep(0.05)


class InterruptAfterStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step:
            interrupt()


class InterruptedTrainer(hf_vaswani.training.recipe.VaswaniTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_callback(InterruptAfterStep(int(phase.removeprefix("step-"))))


def interrupted_after(function):
    def call(*args, **kwargs):
        function(*args, **kwargs)
        interrupt()

    return call


if phase.startswith("step-"):
    hf_vaswani.training.recipe.VaswaniTrainer = InterruptedTrainer
elif phase.startswith("saving-"):
    save = torch.save
    checkpoint = f"checkpoint-{phase.removeprefix('saving-')}"

    def save_until_the_optimizer(state, path, *args, **kwargs):
        if os.path.basename(path) == "optimizer.pt" and os.path.basename(os.path.dirname(path)) == checkpoint:
            interrupt()
        save(state, path, *args, **kwargs)

    torch.save = save_until_the_optimizer
elif phase == "averaging":
    hf_vaswani.training.callbacks.average_checkpoints = interrupted_after(
        hf_vaswani.training.callbacks.average_checkpoints
    )
elif phase == "model-save":
    hf_vaswani.training.recipe.save_model_folder = interrupted_after(hf_vaswani.training.recipe.save_model_folder)
elif phase != "none":
    raise SystemExit(f"unknown phase {phase}")
main(["train", *options])
