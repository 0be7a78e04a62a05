"""`vaswani train` never loses a run, `--resume` never continues an inconsistent one, and a mistake in the output
folder or the data is one line before any work."""

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import refused
from matplotlib.figure import Figure
from tiny import TOY_TARGETS, toy_train_options, write_corpus_files

import hf_vaswani.cli
import hf_vaswani.training.recipe
from hf_vaswani.cli import main
from hf_vaswani.files import partial_path, replace_folder, write_text
from hf_vaswani.plots import plot_training_curves
from hf_vaswani.training.checkpoints import newest_complete_checkpoint
from hf_vaswani.training.run_folder import RUN_ENTRIES, check_output_dir
from hf_vaswani.training.settings import RecipeSettings


def train_arguments(run: Path, corpus: list[str], *options: str) -> list[str]:
    """A toy run into `run`: 6 steps, a checkpoint every 2, the last 2 kept and averaged (checkpoint-4 and -6 stay)."""
    schedule = toy_train_options(max_steps=6, save_steps=2, average_last=2)
    return ["train", "--output-dir", str(run), *corpus, *schedule, *options]


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: its content's sha256 and modification time."""
    return {
        str(path.relative_to(folder)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished tiny run (its folder, never changed by the tests) and its corpus options."""
    folder = tmp_path_factory.mktemp("finished")
    corpus = write_corpus_files(folder / "corpus")
    main(train_arguments(folder / "run", corpus))
    return folder / "run", corpus


@pytest.fixture
def copied_run(tmp_path, finished_run) -> tuple[Path, list[str]]:
    """A copy of the finished run that a test may change, with its corpus options."""
    run, corpus = finished_run
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", corpus


def no_corpus_reading(monkeypatch) -> None:
    """Make reading the corpus fail the test: what is refused must be refused before it."""

    def load_data(args):
        raise AssertionError("the corpus was read before the output folder was checked")

    monkeypatch.setattr(hf_vaswani.cli, "load_data", load_data)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (
            [],
            "holds a previous run (run.json, tokenizer, checkpoints, model, results.json, training_curves.png): "
            "continue it with --resume, replace it with --overwrite",
        ),
        (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        # d_k and d_v follow d_model / num_heads in the preset
        (["--resume", "--model-override", "d_model=64"], "--resume: d_k was 8, now 16; d_model was 32, now 64; d_v "),
        (["--resume", "--vocab-size", "400"], "--resume: --vocab-size was 300, now 400"),
        (["--resume", "--max-steps", "4", "--average-last", "1"], "--max-steps was 6, now 4"),
        # a longer run may not raise a learning rate that its cooldown has lowered
        (
            ["--resume", "--max-steps", "8", "--cooldown-steps", "2"],
            "--max-steps was 6, now 8; --cooldown-steps was None, now 2",
        ),
        # nor move the end of a run whose time budget projected it
        (
            ["--resume", "--max-steps", "8", "--max-train-minutes", "5"],
            "--max-steps was 6, now 8; --max-train-minutes was None, now 5.0",
        ),
    ],
)
def test_a_folder_holding_a_run_is_refused_before_the_corpus_is_read(
    finished_run, capsys, monkeypatch, options, named
) -> None:
    run, corpus = finished_run
    before = snapshot(run)
    no_corpus_reading(monkeypatch)
    assert named in refused(capsys, train_arguments(run, corpus, *options))
    assert snapshot(run) == before


def test_resume_on_a_changed_corpus_is_refused(finished_run, tmp_path, capsys) -> None:
    run, _ = finished_run
    before = snapshot(run)
    changed = write_corpus_files(tmp_path / "changed", [target.replace("Hund", "Hündin") for target in TOY_TARGETS])
    error = refused(capsys, train_arguments(run, changed, "--resume"))
    assert f"--resume: the training corpus is not the one the run in {run} started with (sha256 " in error
    assert snapshot(run) == before


def test_resume_needs_the_record_of_the_run(copied_run, capsys) -> None:
    run, corpus = copied_run
    (run / "run.json").unlink()  # a run of an older version
    before = snapshot(run)
    assert "holds no run.json" in refused(capsys, train_arguments(run, corpus, "--resume"))
    assert snapshot(run) == before


RECORD_DAMAGES = {
    "empty": (lambda record: "", "cannot be read (Expecting value: line 1 column 1 (char 0))"),
    "cut short": (lambda record: record[: len(record) // 2], "cannot be read ("),
    "not UTF-8": (lambda record: "\udcff" + record, "cannot be read ('utf-8' codec can't decode"),
    "a list": (lambda record: "[]", "is not a run record (a JSON object with 'settings'"),
    "no fingerprint": (
        lambda record: json.dumps({"settings": json.loads(record)["settings"]}),
        "is not a run record (a JSON object with 'settings', an object, and 'train_corpus_sha256', a string)",
    ),
    "an unknown setting": (
        lambda record: json.dumps(json.loads(record) | {"settings": {"no_such_setting": 1}}),
        "are not valid (RecipeSettings.__init__() got an unexpected keyword argument 'no_such_setting')",
    ),
    "a bad setting": (
        lambda record: json.dumps(json.loads(record) | {"settings": {"max_steps": 0}}),
        "are not valid (--max-steps must be positive and finite, got 0)",
    ),
}


@pytest.mark.parametrize("damage", RECORD_DAMAGES)
def test_a_damaged_run_record_is_one_line_naming_it_and_the_run_is_kept(copied_run, capsys, monkeypatch, damage):
    run, corpus = copied_run
    damaged, named = RECORD_DAMAGES[damage]
    record = run / "run.json"
    record.write_bytes(damaged(record.read_text()).encode("utf-8", "surrogateescape"))
    before = snapshot(run)
    no_corpus_reading(monkeypatch)
    error = refused(capsys, train_arguments(run, corpus, "--resume"))
    assert f"--resume: {record}" in error or f"--resume: the settings in {record}" in error, error
    assert named in error and error.endswith(
        "so the run cannot be checked; restore it or start again with --overwrite\n"
    )
    # without --resume the record is not read: the folder holds a run, whatever its record
    assert "holds a previous run (run.json, " in refused(capsys, train_arguments(run, corpus))
    assert snapshot(run) == before


@pytest.mark.parametrize("inside", [False, True])
def test_an_output_folder_that_cannot_be_made_is_refused_before_the_corpus_is_read(
    tmp_path, capsys, monkeypatch, inside
) -> None:
    a_file = tmp_path / "results"
    a_file.write_text("mine")
    output_dir = a_file / "run" if inside else a_file
    no_corpus_reading(monkeypatch)
    error = refused(capsys, train_arguments(output_dir, write_corpus_files(tmp_path / "corpus")))
    problem = f"cannot be created: {a_file} is a file" if inside else "is a file, not a folder"
    assert error == f"vaswani train: error: --output-dir {output_dir} {problem}\n"
    assert a_file.read_text() == "mine"


def test_a_failed_write_at_the_end_keeps_the_previous_run_whole(copied_run, capsys, monkeypatch) -> None:
    run, corpus = copied_run
    kept = {name: snapshot(run / name) for name in ("model", "tokenizer")}
    kept |= {name: snapshot(run)[name] for name in ("results.json", "training_curves.png")}

    def disk_full(model, tokenizer, folder: Path) -> None:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.safetensors"))

    monkeypatch.setattr(hf_vaswani.training.recipe, "save_model_folder", disk_full)
    # The run is finished: resuming with another beam trains no step, translates the test split again and writes the
    # model folder anew.
    with pytest.raises(SystemExit) as stopped:
        main(train_arguments(run, corpus, "--resume", "--num-beams", "3"))
    stderr = capsys.readouterr().err  # the progress bars of the work done, then the error
    assert stopped.value.code == 2 and "Traceback" not in stderr
    partial = partial_path(run / "model") / "model.safetensors"
    assert stderr.endswith(f"\nvaswani train: error: [Errno 28] No space left on device: '{partial}'\n")
    now = {name: snapshot(run / name) for name in ("model", "tokenizer")}
    assert now | {name: snapshot(run)[name] for name in ("results.json", "training_curves.png")} == kept
    assert not list(run.glob(".*.partial")) and not list(run.glob(".*.previous"))


CHECKPOINT_DAMAGES = {
    "optimizer.pt": ("missing", "optimizer.pt: FileNotFoundError"),
    "scheduler.pt": ("cut short", "scheduler.pt: BadZipFile"),
    "rng_state.pth": ("missing", "no rng_state*.pth"),
    "trainer_state.json": ("cut short", "trainer_state.json: JSONDecodeError"),
}


@pytest.mark.parametrize("name", CHECKPOINT_DAMAGES)
def test_a_checkpoint_killed_while_saving_is_moved_aside_for_the_previous_one(copied_run, caplog, name) -> None:
    run, _ = copied_run
    damage, problem = CHECKPOINT_DAMAGES[name]
    path = run / "checkpoints" / "checkpoint-6" / name
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="hf_vaswani.training.checkpoints"):
        assert newest_complete_checkpoint(run / "checkpoints") == run / "checkpoints" / "checkpoint-4"
    assert [record.getMessage() for record in caplog.records if record.name == "hf_vaswani.training.checkpoints"] == [
        f"{path.parent} is incomplete ({problem}); moved to incomplete-checkpoint-6; resuming from checkpoint-4"
    ]
    assert (run / "checkpoints" / "incomplete-checkpoint-6").is_dir() and not path.parent.exists()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--data", "files", "--test", "{train_en}", "{train_de}"], "--data files needs --train and --test"),
        (["--data", "hub"], "--data hub needs --hub-name"),
        (
            ["--data", "files", "--train", "{missing}", "{train_de}", "--test", "{train_en}", "{train_de}"],
            "[Errno 2] No such file or directory: '{missing}'",
        ),
        (["--data", "hub", "--hub-name", "{empty}"], "The directory at {empty} doesn't contain any data files"),
    ],
)
def test_a_missing_corpus_is_one_line_and_writes_nothing(tmp_path, capsys, options, named) -> None:
    write_corpus_files(tmp_path / "corpus")
    (tmp_path / "empty").mkdir()
    paths = {
        "train_en": tmp_path / "corpus" / "train.en",
        "train_de": tmp_path / "corpus" / "train.de",
        "missing": tmp_path / "none.en",
        "empty": tmp_path / "empty",
    }
    arguments = train_arguments(tmp_path / "run", [option.format(**paths) for option in options])
    assert named.format(**paths) in refused(capsys, arguments)
    assert not (tmp_path / "run").exists()


def test_the_hub_unreachable_is_one_line(tmp_path) -> None:
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    environment = {
        name: value for name, value in os.environ.items() if name not in ("HF_DATASETS_CACHE", "HF_HUB_CACHE")
    }
    name = "hf-vaswani-tests/no-such-corpus"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_vaswani.cli",
            *train_arguments(tmp_path / "run", ["--data", "hub", "--hub-name", name]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment | offline,
    )
    assert result.returncode == 2
    assert result.stderr == f"vaswani train: error: Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)\n"
    assert not (tmp_path / "run").exists()


def test_a_folder_in_use_is_refused_at_once_and_a_killed_run_does_not_hold_it(tmp_path, capsys) -> None:
    corpus = write_corpus_files(tmp_path / "corpus")
    run = tmp_path / "run"
    # A run that stops itself (SIGSTOP) after its first step, holding the folder, until the test kills it.
    command = [sys.executable, "interrupted_train.py", "step-1", "STOP", *train_arguments(run, corpus)[1:]]
    holder = subprocess.Popen(
        command, cwd=Path(__file__).parents[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _, status = os.waitpid(holder.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        before = snapshot(run)
        in_use = f"--output-dir {run} is in use by another run"
        for argv in (
            train_arguments(run, corpus),
            train_arguments(run, corpus, "--resume"),
            train_arguments(run, corpus, "--overwrite"),
            ["demo", "--output-dir", str(run), "--overwrite"],
        ):
            refused(capsys, argv, in_use)
        assert snapshot(run) == before  # nothing of the first run changed
    finally:
        holder.kill()  # SIGKILL: the lock goes with the process
        holder.wait()
    main(train_arguments(run, corpus, "--resume"))
    assert json.loads((run / "results.json").read_text())["steps"] == 6


def test_a_refused_run_leaves_no_folder_behind(tmp_path, capsys) -> None:
    run = tmp_path / "new"
    refused(capsys, train_arguments(run, write_corpus_files(tmp_path / "corpus"), "--resume", "--overwrite"), "exclude")
    assert not run.exists()


@pytest.mark.parametrize("entry", RUN_ENTRIES)
def test_any_trace_of_a_run_is_a_run(tmp_path, entry) -> None:
    (tmp_path / entry).mkdir()  # as a run killed early leaves, e.g. only checkpoints/
    with pytest.raises(ValueError, match=f"holds a previous run \\({entry}\\)"):
        check_output_dir(tmp_path, RecipeSettings())
    assert check_output_dir(tmp_path, RecipeSettings(), overwrite=True) is None
    (tmp_path / entry).rmdir()
    (tmp_path / "notes.txt").write_text("mine")  # what is not a run's leaves the folder free
    assert check_output_dir(tmp_path, RecipeSettings()) is None


def test_resume_of_an_ended_run_changes_nothing_in_its_folder_and_says_so(copied_run, capsys) -> None:
    run, corpus = copied_run
    (run / "model" / "notes.txt").write_text("a file of the user's beside the model\n")
    before = snapshot(run)
    capsys.readouterr()
    main(train_arguments(run, corpus, "--resume"))
    assert capsys.readouterr().out == (
        f"{run}: the run has ended with these settings; nothing to do (its results: results.json)\n"
    )
    assert snapshot(run) == before  # every file's bytes and modification time


def test_a_resume_that_writes_the_model_folder_anew_keeps_the_files_it_did_not_write(copied_run) -> None:
    run, corpus = copied_run
    (run / "model" / "notes.txt").write_text("a file of the user's beside the model\n")
    before = snapshot(run / "model")
    main(train_arguments(run, corpus, "--resume", "--num-beams", "3"))  # another decoding: evaluated and written anew
    after = snapshot(run / "model")
    assert after["config.json"][1] != before["config.json"][1]  # the folder was written anew
    assert after["notes.txt"] == before["notes.txt"]


def test_resume_skips_a_truncated_checkpoint_keeps_the_tokenizer_and_may_train_longer(copied_run, capsys, caplog):
    run, corpus = copied_run
    weights = run / "checkpoints" / "checkpoint-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # killed while saving
    broken, tokenizer = snapshot(run / "checkpoints" / "checkpoint-6"), snapshot(run / "tokenizer")
    trainer_warnings = ListHandler()
    logging.getLogger("transformers.trainer").addHandler(trainer_warnings)  # transformers' loggers do not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="hf_vaswani.training.checkpoints"):
            main(train_arguments(run, corpus, "--resume", "--max-steps", "8"))
    finally:
        logging.getLogger("transformers.trainer").removeHandler(trainer_warnings)
    (message,) = [record.getMessage() for record in caplog.records if record.name == "hf_vaswani.training.checkpoints"]
    assert message == (
        f"{run / 'checkpoints' / 'checkpoint-6'} is incomplete (model.safetensors: Error while deserializing header: "
        "incomplete metadata, file not fully covered); moved to incomplete-checkpoint-6; resuming from checkpoint-4"
    )
    assert snapshot(run / "checkpoints" / "incomplete-checkpoint-6") == broken  # kept aside, never averaged
    assert snapshot(run / "tokenizer") == tokenizer  # reused, not retrained
    assert not [line for line in trainer_warnings.lines if "missing keys" in line]  # lm_head.weight is tied
    results = json.loads((run / "results.json").read_text())
    assert results["steps"] == 8
    assert json.loads((run / "run.json").read_text())["settings"]["max_steps"] == 8
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == [
        "averaged",
        "checkpoint-6",
        "checkpoint-8",
        "incomplete-checkpoint-6",
    ]
    assert not list(run.glob(".*.partial")) and not list(run.glob(".*.previous"))


def test_overwrite_replaces_the_run(copied_run) -> None:
    run, corpus = copied_run
    (run / "notes.txt").write_text("mine")
    main(train_arguments(run, corpus, "--overwrite", "--max-steps", "4", "--average-last", "1"))
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["averaged", "checkpoint-4"]
    assert (run / "notes.txt").read_text() == "mine"


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path) -> None:
    folder = tmp_path / "model"
    replace_folder(folder, lambda temporary: temporary.mkdir() or (temporary / "weights").write_text("old"))

    def killed_midway(temporary: Path) -> None:
        temporary.mkdir()
        (temporary / "weights").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_folder(folder, killed_midway)
    assert (folder / "weights").read_text() == "old"
    assert [path.name for path in tmp_path.iterdir()] == ["model"]  # the partial folder is gone
    replace_folder(folder, lambda temporary: temporary.mkdir() or (temporary / "config").write_text("new"))
    assert [path.name for path in folder.iterdir()] == ["config"]
    write_text(tmp_path / "results.json", "{}\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "results.json"]  # no temporary left


def test_training_curves_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    curves = tmp_path / "training_curves.png"
    curves.write_bytes(b"the previous run's curves")
    history = [{"step": step, "loss": 5.0 / step, "learning_rate": 1e-3} for step in (1, 2, 3)]
    savefig = Figure.savefig

    def disk_full(figure, path, **options) -> None:
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(Figure, "savefig", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        plot_training_curves(history, curves)
    assert curves.read_bytes() == b"the previous run's curves"
    assert [path.name for path in tmp_path.iterdir()] == ["training_curves.png"]  # no partial file
    monkeypatch.setattr(Figure, "savefig", savefig)
    plot_training_curves(history, curves)
    assert curves.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")  # a PNG, though the temporary name is no .png
    assert [path.name for path in tmp_path.iterdir()] == ["training_curves.png"]


class ListHandler(logging.Handler):
    """Keeps the messages it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
