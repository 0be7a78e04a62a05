"""Which of a run's checkpoints are complete enough to resume from (incomplete ones are moved aside)."""

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path

from accelerate.utils.constants import OPTIMIZER_NAME
from safetensors import SafetensorError, safe_open

from ..sharded_weights import SHARDED_WEIGHTS, has_sharded_weights, sharded_problem

logger = logging.getLogger(__name__)


# What Trainer needs to continue a run exactly; it silently starts afresh (new Adam moments, schedule from step 0 or
# new random state) where one is missing, so a checkpoint without all of them is not one to resume from.
CHECKPOINT_ARCHIVES = ("scheduler.pt",)  # torch.save zip archives
# The optimizer state, one of: Trainer's; accelerate's under FSDP with whole-model state dicts; a sharded one (DCP).
OPTIMIZER_ARCHIVES = ("optimizer.pt", f"{OPTIMIZER_NAME}.bin")
SHARDED_OPTIMIZER = f"{OPTIMIZER_NAME}_0"
# The config of a model folder: Trainer writes it only beside whole weights, and a checkpoint to average or load needs
# it; CheckpointAveragingCallback writes it beside sharded ones, after the generation config and tokenizer.
MODEL_CONFIG = "config.json"


TRAINER_STATE = "trainer_state.json"  # Trainer's state at the checkpoint: step, log history, its control flags
INCOMPLETE_PREFIX = "incomplete-"  # not `checkpoint-*`: Trainer's rotation and the averaging never see these folders


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from (a file missing or cut short), or None when it is complete.

    Reads headers, archive directories and a sharded checkpoint's metadata only (cheap at any model size): a save
    killed midway leaves files missing or truncated, which these catch; they do not verify every byte.
    """
    try:
        json.loads((checkpoint / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:
        return f"{TRAINER_STATE}: {type(error).__name__}"
    problem = weights_problem(checkpoint)
    if problem is not None:
        return problem
    archives = [path.name for path in sorted(checkpoint.glob("rng_state*.pth"))]
    if not archives:
        return "no rng_state*.pth"
    if (checkpoint / SHARDED_OPTIMIZER).is_dir():
        problem = sharded_problem(checkpoint / SHARDED_OPTIMIZER)
        if problem is not None:
            return problem
    else:  # the archive there, else the first one named missing
        archives.append(next((name for name in OPTIMIZER_ARCHIVES if (checkpoint / name).is_file()), "optimizer.pt"))
    for name in (*CHECKPOINT_ARCHIVES, *archives):
        try:
            zipfile.ZipFile(checkpoint / name).close()
        except (OSError, zipfile.BadZipFile) as error:
            return f"{name}: {type(error).__name__}"
    return None


def weights_problem(checkpoint: Path) -> str | None:
    """Why the weights of `checkpoint`, whole (model.safetensors) or sharded with their config, are missing or cut
    short, or None."""
    if has_sharded_weights(checkpoint):
        problem = sharded_problem(checkpoint / SHARDED_WEIGHTS)
        if problem is not None:
            return problem
        try:
            json.loads((checkpoint / MODEL_CONFIG).read_text())
        except (OSError, ValueError) as error:
            return f"{MODEL_CONFIG} beside the sharded weights: {type(error).__name__}"
        return None
    try:
        with safe_open(checkpoint / "model.safetensors", framework="pt") as weights:
            weights.keys()
    except (OSError, SafetensorError) as error:
        return f"model.safetensors: {' '.join(str(error).split()) or type(error).__name__}"
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


def training_ended(checkpoint: Path) -> bool:
    """Whether Trainer saved `checkpoint` as training ended (at max_steps, an early stop or the time budget): the
    control state it stores with each checkpoint then says that training should stop."""
    control = json.loads((checkpoint / TRAINER_STATE).read_text()).get("stateful_callbacks", {}).get("TrainerControl")
    return bool(control and control["args"].get("should_training_stop"))
