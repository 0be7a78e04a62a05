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

    At each step the last step is projected from the time left and the step rate over the later half of the steps so
    far (validation and checkpoint pauses included at their share). The first steps' one-time costs (the first batch,
    kernels timed or compiled) thus drop out of the rate as the run goes on, and step 1, which carries most of them,
    never counts. The projection is sound once it agrees within `SETTLED` with the one made at half as many steps: until
    then the end stays where the schedule has it (`args.max_steps`) and no cooldown begins early, unless time is up.

    Before the cooldown begins the projected end is capped by `args.max_steps` and moves either way; a projection too
    close for the whole cooldown begins a shorter one at once. During the cooldown the end only comes sooner, where the
    machine has slowed down: the learning rate then falls from where it is to zero at the new last step, steeper than
    planned, rather than the run overrunning its time. A resumed run ends at the step its checkpoint's schedule holds.
    One process only: several would each project their own last step. The run's last step is logged.
    """

    SETTLED = 0.1  # the relative difference of two projections, at step n and n // 2, below which they are sound

    def __init__(self, minutes: float) -> None:
        if minutes <= 0:
            raise UsageError(f"minutes must be positive, got {minutes}")
        self.seconds = 60 * minutes
        self.schedule: PaperSchedule | None = None  # these are set when training begins
        self.resumed = False
        self.step_ends: list[float] = []  # the clock when training began, then at the end of each step
        self.projections: list[int | None] = []  # the last step projected at each step (None: not yet)
        self.settled = False

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs) -> None:
        self.schedule = lr_scheduler.lr_lambdas[0]  # VaswaniTrainer's PaperSchedule
        self.resumed = state.global_step > 0
        self.step_ends, self.projections, self.settled = [time.perf_counter()], [None], False
        state.max_steps = self.schedule.total_steps

    def projected_last_step(self, step: int) -> int | None:
        """The step at which the budget runs out at the rate of steps (step // 2, step], step 1 left out; None at step
        1. Multiplied before dividing: a whole number of steps comes out exact."""
        first = max(1, step // 2)
        window_seconds = self.step_ends[step] - self.step_ends[first]
        if step == first or window_seconds <= 0:
            return None
        seconds_left = max(0.0, self.seconds - (self.step_ends[step] - self.step_ends[0]))
        return step + int(seconds_left * (step - first) / window_seconds)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.resumed:
            return
        schedule, step, cooldown = self.schedule, state.global_step, self.schedule.cooldown_steps or 0
        self.step_ends.append(time.perf_counter())
        projected = self.projected_last_step(step)
        self.projections.append(projected)
        earlier = self.projections[step // 2]
        self.settled = self.settled or (
            projected is not None and earlier is not None and abs(projected - earlier) <= self.SETTLED * projected
        )
        end = None
        if cooldown and step >= schedule.total_steps - cooldown:  # in the cooldown: the end only comes sooner
            if projected is not None and projected < schedule.total_steps:
                # The scheduler has already given update `step` its factor (T - step) / C; the new line to zero at T'
                # passes through it: (T' - step) / C' with C' = (T' - step) * C / (T - step). T' is at least the next
                # step, which DefaultFlowCallback then still sees.
                end = max(step + 1, projected)
                schedule.cooldown_steps *= (end - step) / (schedule.total_steps - step)
        elif self.step_ends[step] - self.step_ends[0] >= self.seconds or (projected is not None and projected <= step):
            end = step  # time is up before any cooldown
        elif self.settled:  # before the cooldown: the end moves either way, within max_steps
            end = min(args.max_steps, projected)
            if end < step + cooldown:  # too little time for the whole cooldown: a shorter one begins now
                schedule.cooldown_steps = end - step
        if end is not None:
            schedule.total_steps = state.max_steps = end
        if step >= state.max_steps:  # DefaultFlowCallback has already seen this step
            control.should_training_stop = True
            control.should_log = True  # the last interval's loss, also in a run shorter than its logging interval
            if args.save_strategy == "steps":
                control.should_save = True
