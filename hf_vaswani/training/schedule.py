"""The paper's learning-rate schedule (§5.3, Eq. 3), with an optional cooldown, and a wall-clock training budget."""

import time

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback

from ..model.errors_vaswani import UsageError


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
            raise UsageError(f"warmup_steps must be positive for the paper's schedule, got {warmup_steps}")
        if cooldown_steps is not None and not (total_steps is not None and 0 < cooldown_steps <= total_steps):
            raise UsageError(f"cooldown_steps must be in 1..total_steps ({total_steps}), got {cooldown_steps}")
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
            raise UsageError(f"minutes must be positive, got {minutes}")
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
