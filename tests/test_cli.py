"""The `vaswani` command end to end on tiny inputs: train from local files, average, and clear errors."""

import json
import subprocess
import sys

import pytest
import torch

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.cli import main

SOURCES = ["the dog sleeps .", "the cat sleeps .", "the dog sees the cat .", "the cat sees the dog ."] * 5
TARGETS = ["der Hund schläft .", "die Katze schläft .", "der Hund sieht die Katze .", "die Katze sieht den Hund ."] * 5


def test_train_from_local_files(tmp_path) -> None:
    for name, lines in (("train.en", SOURCES), ("train.de", TARGETS)):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    tiny = ["d_model=32", "d_ff=64", "num_heads=4", "encoder_layers=1", "decoder_layers=1"]
    main(
        [
            "train",
            "--output-dir",
            str(tmp_path / "run"),
            "--data",
            "files",
            "--train",
            str(tmp_path / "train.en"),
            str(tmp_path / "train.de"),
            "--test",
            str(tmp_path / "train.en"),
            str(tmp_path / "train.de"),
            *[arg for override in tiny for arg in ("--model-override", override)],
            "--vocab-size",
            "300",
            "--max-tokens",
            "64",
            "--warmup-steps",
            "4",
            "--max-steps",
            "6",
            "--save-steps",
            "2",
            "--average-last",
            "3",
            "--logging-steps",
            "2",
        ]
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["steps"] == 6 and results["settings"]["model_overrides"]["d_model"] == 32
    assert VaswaniForConditionalGeneration.from_pretrained(tmp_path / "run" / "model").config.d_model == 32


def test_average_command_writes_the_elementwise_mean(tmp_path) -> None:
    config = VaswaniConfig(vocab_size=30, d_model=8, d_ff=16, num_heads=2, encoder_layers=1, decoder_layers=1)
    states = []
    for step in (3, 20, 100):
        torch.manual_seed(step)
        model = VaswaniForConditionalGeneration(config)
        model.save_pretrained(tmp_path / f"checkpoint-{step}")
        states.append(model.state_dict())
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
