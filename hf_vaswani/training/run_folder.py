"""A run's output folder: what it holds, whether a run may start or resume there, and the run record (run.json)."""

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path

from datasets import Dataset

from ..model.errors_vaswani import UsageError
from .settings import RecipeSettings, model_config, setting_flag

RUN_RECORD = "run.json"  # the settings and training corpus that define the run in an output folder
TOKENIZER_FOLDER = "tokenizer"  # the run's vocabulary, saved before training so that a resumed run keeps its ids
# What a run writes at its end, in this order, each whole or not at all: all of them mean the run has ended.
RUN_OUTPUTS = ("model", "results.json", "training_curves.png")
# What a run leaves in its output folder: any of them means the folder holds one.
RUN_ENTRIES = (RUN_RECORD, TOKENIZER_FOLDER, "checkpoints", *RUN_OUTPUTS)
# Settings a resumed run may change: more steps continue the same trajectory (Eq. 3 and the data order do not depend
# on the total), a compiled model computes what the eager one does, and decoding and evaluation come after training.
# Fewer steps could end before the last checkpoint.
RESUMABLE_SETTINGS = (
    "max_steps",
    "torch_compile",
    "num_beams",
    "length_penalty",
    "eval_batch_size",
    "eval_bleu_sample",
    "build_shortlist",
)


def is_main_process() -> bool:
    """Whether this is the process that judges and writes the output folder (torchrun and accelerate set RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


@contextmanager
def claimed_run_folder(output_dir: str | Path) -> Iterator[None]:
    """Hold `output_dir` (created if missing) as the one folder this run writes, refusing it in one ValueError line
    while another process holds it; on leaving, a folder created here that is still empty is removed again.

    The hold is an exclusive `flock` on the folder itself, which the operating system releases when the process ends
    however it ends (a SIGKILL included), so no stale lock outlives a run. Only the main process claims; the others
    write under its claim.
    """
    folder = Path(output_dir).absolute()
    if not is_main_process():
        yield
        return
    check_writable_folder(folder)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise UsageError(
            f"--output-dir {output_dir} is in use by another run (vaswani train or demo): wait for it to end or "
            "choose another --output-dir"
        ) from None
    try:
        yield
    finally:
        os.close(descriptor)  # releases the lock
        if created and not any(folder.iterdir()):
            folder.rmdir()


@contextmanager
def prepared_run_folder(
    output_dir: str | Path, settings: RecipeSettings, resume: bool = False, overwrite: bool = False
) -> Iterator[dict | None]:
    """`output_dir` held for this run (`claimed_run_folder`) and checked for it (`check_output_dir`), before any work:
    gives the record of the run to resume there, or None."""
    with claimed_run_folder(output_dir):
        yield check_output_dir(output_dir, settings, resume, overwrite)


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
        raise UsageError("--resume and --overwrite exclude each other")
    output_dir = Path(output_dir)
    check_writable_folder(output_dir)
    found = [name for name in RUN_ENTRIES if (output_dir / name).exists()]
    if not found or overwrite or not is_main_process():
        return None
    if not resume:
        raise UsageError(
            f"{output_dir} holds a previous run ({', '.join(found)}): continue it with --resume, replace it with "
            "--overwrite, or choose another --output-dir"
        )
    if not (output_dir / RUN_RECORD).is_file():
        raise UsageError(
            f"--resume: {output_dir} holds no {RUN_RECORD} (a run of an older version, or killed before it started), "
            "so its corpus and settings cannot be checked; start again with --overwrite"
        )
    record, previous = read_run_record(output_dir / RUN_RECORD)
    differences = settings_differences(previous, settings)
    if differences:
        raise UsageError(f"--resume: {'; '.join(differences)} (only --max-steps may grow and decoding change)")
    return record


def run_has_ended(output_dir: Path, record: dict, settings: RecipeSettings) -> bool:
    """Whether the run recorded in `output_dir` (`record`, its run.json) has ended with these very settings: it wrote
    all its outputs. A resume that changes a resumable setting (more steps, other decoding) continues it instead."""
    written = all((output_dir / name).exists() for name in RUN_OUTPUTS)
    return written and record["settings"] == json.loads(json.dumps(asdict(settings)))


def check_writable_folder(folder: Path) -> None:
    """Refuse, in one ValueError line, an output folder that could not be created or written into.

    Checked up front because the first write comes after the corpus is read and the tokenizer trained. The nearest
    existing folder of the path must be a folder (not a file) that this process may write into.
    """
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        problem = "is a file, not a folder" if existing == folder else f"cannot be created: {existing} is a file"
        raise UsageError(f"--output-dir {folder} {problem}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {folder}: {existing} is not writable")


def read_run_record(path: Path) -> tuple[dict, RecipeSettings]:
    """The run record at `path` and its settings, refused in one ValueError line naming the file and what is wrong.

    A record cut short by a full disk or edited by hand would otherwise be a traceback far from its cause.
    """
    remedy = "so the run cannot be checked; restore it or start again with --overwrite"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON (empty or cut short)
        raise UsageError(f"--resume: {path} cannot be read ({error}), {remedy}") from None
    kinds = {"settings": dict, "train_corpus_sha256": str}
    if not isinstance(record, dict) or any(not isinstance(record.get(key), kind) for key, kind in kinds.items()):
        raise UsageError(
            f"--resume: {path} is not a run record (a JSON object with 'settings', an object, and "
            f"'train_corpus_sha256', a string), {remedy}"
        )
    try:  # an unknown setting (a missing one takes its default), a value of the wrong type or range fails here
        previous = RecipeSettings(**record["settings"])
    except (TypeError, ValueError) as error:
        raise UsageError(f"--resume: the settings in {path} are not valid ({error}), {remedy}") from None
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
