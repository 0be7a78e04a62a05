"""`vaswani train` never loses a run and `--resume` never continues an inconsistent one."""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

import hf_vaswani.cli
from hf_vaswani.cli import main
from hf_vaswani.recipe import RUN_ENTRIES, RecipeSettings, check_output_dir
from hf_vaswani.training import replace_folder, write_text_atomically

SOURCES = ["the dog sleeps .", "the cat sleeps .", "the dog sees the cat .", "the cat sees the dog ."] * 5
TARGETS = ["der Hund schläft .", "die Katze schläft .", "der Hund sieht die Katze .", "die Katze sieht den Hund ."] * 5
TINY = ["d_model=32", "d_ff=64", "num_heads=4", "encoder_layers=1", "decoder_layers=1"]
# 6 steps, a checkpoint every 2, the last 2 kept and averaged: checkpoint-4 and checkpoint-6 stay.
SCHEDULE = ["--max-steps", "6", "--save-steps", "2", "--average-last", "2", "--logging-steps", "2"]


def write_corpus(folder: Path, targets: list[str] = TARGETS) -> list[str]:
    """Parallel files of a tiny corpus in `folder`; the `--data files` options reading them (train doubles as test)."""
    folder.mkdir(exist_ok=True)
    (folder / "train.en").write_text("\n".join(SOURCES) + "\n")
    (folder / "train.de").write_text("\n".join(targets) + "\n")
    files = [str(folder / "train.en"), str(folder / "train.de")]
    return ["--data", "files", "--train", *files, "--test", *files]


def train_arguments(run: Path, corpus: list[str], *options: str) -> list[str]:
    overrides = [word for override in TINY for word in ("--model-override", override)]
    tiny = ["--vocab-size", "300", "--max-tokens", "64", "--warmup-steps", "4", "--num-beams", "2"]
    return ["train", "--output-dir", str(run), *corpus, *overrides, *tiny, *SCHEDULE, *options]


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
    corpus = write_corpus(folder / "corpus")
    main(train_arguments(folder / "run", corpus))
    return folder / "run", corpus


@pytest.fixture
def copied_run(tmp_path, finished_run) -> tuple[Path, list[str]]:
    """A copy of the finished run that a test may change, with its corpus options."""
    run, corpus = finished_run
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", corpus


def refusal(capsys, arguments: list[str]) -> str:
    """The one-line error of a `vaswani` command that must be refused with exit status 2."""
    with pytest.raises(SystemExit) as stopped:
        main(arguments)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("vaswani train: error: ") and error.count("\n") == 1, error
    return error


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
    ],
)
def test_a_folder_holding_a_run_is_refused_before_the_corpus_is_read(
    finished_run, capsys, monkeypatch, options, named
) -> None:
    run, corpus = finished_run
    before = snapshot(run)

    def load_data(args):
        raise AssertionError("the corpus was read before the output folder was checked")

    monkeypatch.setattr(hf_vaswani.cli, "load_data", load_data)
    assert named in refusal(capsys, train_arguments(run, corpus, *options))
    assert snapshot(run) == before


def test_resume_on_a_changed_corpus_is_refused(finished_run, tmp_path, capsys) -> None:
    run, _ = finished_run
    before = snapshot(run)
    changed = write_corpus(tmp_path / "changed", [target.replace("Hund", "Hündin") for target in TARGETS])
    error = refusal(capsys, train_arguments(run, changed, "--resume"))
    assert f"--resume: the training corpus is not the one the run in {run} started with (sha256 " in error
    assert snapshot(run) == before


def test_resume_needs_the_record_of_the_run(copied_run, capsys) -> None:
    run, corpus = copied_run
    (run / "run.json").unlink()  # a run of an older version
    before = snapshot(run)
    assert "holds no run.json" in refusal(capsys, train_arguments(run, corpus, "--resume"))
    assert snapshot(run) == before


@pytest.mark.parametrize("entry", RUN_ENTRIES)
def test_any_trace_of_a_run_is_a_run(tmp_path, entry) -> None:
    (tmp_path / entry).mkdir()  # as a run killed early leaves, e.g. only checkpoints/
    with pytest.raises(ValueError, match=f"holds a previous run \\({entry}\\)"):
        check_output_dir(tmp_path, RecipeSettings())
    assert check_output_dir(tmp_path, RecipeSettings(), overwrite=True) is None
    (tmp_path / entry).rmdir()
    (tmp_path / "notes.txt").write_text("mine")  # what is not a run's leaves the folder free
    assert check_output_dir(tmp_path, RecipeSettings()) is None


def test_resume_skips_a_truncated_checkpoint_keeps_the_tokenizer_and_may_train_longer(copied_run, capsys, caplog):
    run, corpus = copied_run
    weights = run / "checkpoints" / "checkpoint-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # killed while saving
    broken, tokenizer = snapshot(run / "checkpoints" / "checkpoint-6"), snapshot(run / "tokenizer")
    trainer_warnings = ListHandler()
    logging.getLogger("transformers.trainer").addHandler(trainer_warnings)  # transformers' loggers do not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="hf_vaswani.training"):
            main(train_arguments(run, corpus, "--resume", "--max-steps", "8"))
    finally:
        logging.getLogger("transformers.trainer").removeHandler(trainer_warnings)
    (message,) = [record.getMessage() for record in caplog.records if record.name == "hf_vaswani.training"]
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
    assert not list(run.glob("*.tmp-*")) and not list(run.glob("*.old-*"))


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
    replace_folder(folder, lambda temporary: temporary.mkdir() or (temporary / "config").write_text("new"))
    assert [path.name for path in folder.iterdir()] == ["config"]
    write_text_atomically(tmp_path / "results.json", "{}\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "results.json"]  # no temporary left


class ListHandler(logging.Handler):
    """Keeps the messages it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
