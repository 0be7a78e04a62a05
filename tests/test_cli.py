"""The `vaswani` command end to end on tiny inputs: train from local files, average, and clear errors."""

import json
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from helpers import refused
from tiny import save_random_checkpoints, toy_train_options, write_corpus_files

import hf_vaswani.cli
from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.cli import build_parser, main, settings_from_args
from hf_vaswani.decoding.shortlist import SHORTLIST_PER_SOURCE, Shortlist
from hf_vaswani.training.settings import RecipeSettings, setting_flag

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def local_files_arguments(folder: Path) -> list[str]:
    """`vaswani train` options for the toy corpus written into `folder`, the run going to `folder`/run."""
    return ["--output-dir", str(folder / "run"), *write_corpus_files(folder)]


def test_train_from_local_files(tmp_path) -> None:
    # d_ff again, twice: the last value wins; label smoothing is a training setting, not the model's
    # --vocab-size left at its default: --bpe-merges sizes the vocabulary (40 merges: the toy corpus has more)
    schedule = toy_train_options(max_steps=6, save_steps=2, average_last=3, vocab_size=RecipeSettings().vocab_size)
    overrides = ["--model-override", "d_ff=48", "--model-override", "d_ff=64"]
    bpe = ["--bpe", "subword_nmt", "--bpe-merges", "40"]
    options = [*overrides, "--label-smoothing", "0.2", "--build-shortlist", *bpe]
    main(["train", *local_files_arguments(tmp_path), *schedule, *options])
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 6 and results["settings"]["model_overrides"]["d_model"] == 32
    assert results["settings"]["label_smoothing"] == 0.2
    saved_bpe = json.loads((tmp_path / "run" / "model" / "tokenizer.json").read_text())["model"]
    assert saved_bpe["end_of_word_suffix"] == "</w>" and len(saved_bpe["merges"]) == 40  # --bpe subword_nmt
    assert results["averaged_checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # every 2 steps, last 3
    assert VaswaniForConditionalGeneration.from_pretrained(tmp_path / "run" / "model").config.d_model == 32
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert (config["label_smoothing"], config["d_ff"]) == (0.0, 64)  # the saved model's loss is cross-entropy
    decoding = json.loads((tmp_path / "run" / "model" / "generation_config.json").read_text())
    # --num-beams on top of the paper's decoding, which stays as it was
    assert (decoding["num_beams"], decoding["length_penalty"], decoding["max_new_tokens_over_source"]) == (2, 0.6, 50)
    shortlist = Shortlist.load(tmp_path / "run" / "model", config["vocab_size"])  # from the training corpus
    assert shortlist.candidates.shape == (config["vocab_size"], SHORTLIST_PER_SOURCE)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--model-override", "vocab_size=500"], "set it with --vocab-size"),
        (["--model-override", "no_such_field=3"], "--model-override no_such_field: VaswaniConfig has no such field"),
        (["--model-override", "dropuot=0.3"], "did you mean dropout?"),
        (["--model-override", "dropout=high"], "field 'dropout'"),
        (["--model-override", "dropout=1.5"], "dropout must be in [0, 1), got 1.5"),
        (["--max-steps", "4", "--save-steps", "1", "--average-last", "1"], "--logging-steps (100)"),
        (["--max-steps", "4", "--save-steps", "5", "--average-last", "1", "--logging-steps", "1"], "--save-steps (5)"),
        (["--bpe-merges", "100"], "--bpe-merges sizes --bpe subword_nmt's BPE only"),
        (["--bpe", "subword_nmt", "--bpe-merges", "100", "--vocab-size", "500"], "both size the vocabulary: pass one"),
    ],
)
def test_settings_are_refused_before_any_work(tmp_path, capsys, monkeypatch, options, named) -> None:
    def load_data(args):
        raise AssertionError("the corpus was read before the settings were checked")

    monkeypatch.setattr(hf_vaswani.cli, "load_data", load_data)
    refused(capsys, ["train", *local_files_arguments(tmp_path), *options], named)
    assert not (tmp_path / "run").exists()  # no tokenizer, no checkpoint


def test_a_tokenizer_field_override_is_one_line_naming_the_option(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_vaswani.cli",
            "train",
            *local_files_arguments(tmp_path),
            "--model-override",
            "vocab_size=500",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "vaswani train: error: --model-override vocab_size: the recipe takes it from the tokenizer it trains; "
        "set it with --vocab-size\n"
    )


def test_train_options_are_the_recipe_settings(capsys, monkeypatch) -> None:
    parser = build_parser()
    assert settings_from_args(parser.parse_args(["train", "--output-dir", "run"])) == RecipeSettings()
    args = parser.parse_args(
        ["train", "--output-dir", "run", "--num-beams", "2", "--length-penalty", "1.0", "--eval-batch-size", "8"]
        + ["--model-override", "d_model=64", "--model-override", "dropout=0.2", "--model-override", "d_model=256"]
        + ["--bf16", "--label-smoothing", "0.05"]
    )
    settings = settings_from_args(args)
    assert (settings.num_beams, settings.length_penalty, settings.eval_batch_size) == (2, 1.0, 8)
    assert settings.model_overrides == {"d_model": 256, "dropout": 0.2} and settings.bf16
    assert settings.label_smoothing == 0.05
    # `none` undoes an earlier option of a setting that can be None, as scripts/multi30k.sh's are undone
    undone = ["--max-train-minutes", "28.5", "--max-train-minutes", "none", "--length-penalty-type", "power"]
    undone += ["--length-penalty-type", "None"]
    settings = settings_from_args(parser.parse_args(["train", "--output-dir", "run", *undone]))
    assert (settings.max_train_minutes, settings.length_penalty_type) == (None, None)
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: argparse wraps help at the terminal's width
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for setting in fields(RecipeSettings):
        assert f"{setting_flag(setting.name)} " in help_text and setting.metadata["help"] in help_text, setting.name


def test_the_parser_and_help_import_no_data_metric_or_plotting_library() -> None:
    # torch and transformers, which register the model classes, are the floor: each command imports the rest itself.
    heavy = ("datasets", "evaluate", "matplotlib", "sacrebleu")
    probe = f"""
import contextlib, io, sys
from hf_vaswani.cli import build_parser, main
build_parser()
for arguments in (["--help"], ["train", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(arguments)
print(" ".join(sorted(set({heavy!r}) & set(sys.modules))))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"building the parser and its help imported {result.stdout.strip()}"


def script_command(name: str) -> list[str]:
    """The words of a script's `exec` line, continuation lines joined, shell variables unexpanded, "$@" dropped."""
    text = (SCRIPTS / name).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("exec "))
    return [word for word in shlex.split(line) if word != "$@"]


def test_the_scripts_commands_give_valid_settings() -> None:
    # scripts/multi30k.sh's commands: tests/training/test_published_recipe.py runs the script
    base, big = (script_command(name) for name in ("wmt14_base.sh", "wmt14_big.sh"))
    base_options = base[base.index("train") + 1 :]
    big_options = base_options + big[big.index("$output") + 1 :]  # wmt14_big.sh runs wmt14_base.sh with more options
    for options in (base_options, big_options):
        settings_from_args(build_parser().parse_args(["train", *options]))
    assert settings_from_args(build_parser().parse_args(["train", *big_options])).average_last == 20


def test_average_command_writes_the_elementwise_mean(tmp_path) -> None:
    states = list(save_random_checkpoints(tmp_path, (3, 20, 100)).values())
    main(["average", "--checkpoint-dir", str(tmp_path), "--last", "2", "--output", str(tmp_path / "avg")])
    averaged = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "avg").state_dict()
    for name in averaged:
        torch.testing.assert_close(averaged[name], (states[1][name] + states[2][name]) / 2, msg=name)


def test_bad_input_gives_a_message_not_a_traceback(tmp_path) -> None:
    (tmp_path / "a.en").write_text("one\ntwo\n")
    (tmp_path / "a.de").write_text("eins\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_vaswani.cli",
            "train",
            "--output-dir",
            str(tmp_path / "run"),
            "--data",
            "files",
            "--train",
            str(tmp_path / "a.en"),
            str(tmp_path / "a.de"),
            "--test",
            str(tmp_path / "a.en"),
            str(tmp_path / "a.de"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "a.de" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(SystemExit):
        main(["average", "--output", str(tmp_path / "x")])


def test_evaluate_command_scores_a_test_set_like_sacrebleu(tmp_path, trained_folder, capsys) -> None:
    import sacrebleu

    sources = ["red cat sun", "blue dog", "green tree moon"]
    references = ["RED CAT SUN", "BLUE DOG", "GREEN TREE SUN"]
    (tmp_path / "test.src").write_text("\n".join(sources) + "\n")
    (tmp_path / "test.ref").write_text("\n".join(references) + "\n")
    main(
        [
            "evaluate",
            str(trained_folder),
            "--source",
            str(tmp_path / "test.src"),
            "--reference",
            str(tmp_path / "test.ref"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    hypotheses = [s.upper() for s in sources]  # what the toy model translates these to (checked in test_generation)
    assert report["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert report["sentences"] == 3
