"""Every recipe setting is checked as the settings are made, before any work: a value that a dependency would refuse
only later, after the corpus and the tokenizer (numpy's range of seeds, torch's 64-bit sizes), or that Python would
take for another kind (True for the count 1), is one line naming it, exit code 2, and no run folder. The walk covers
every field of RecipeSettings by its declared type, so a setting added later is walked too."""

import types
import typing
from dataclasses import Field, fields
from pathlib import Path

import pytest
from helpers import refused

import hf_vaswani.training.recipe
from hf_vaswani.cli import build_parser, settings_from_args
from hf_vaswani.model.errors_vaswani import UsageError
from hf_vaswani.training.settings import OVERRIDABLE_FIELDS, RecipeSettings, setting_flag

# The values given on the command line to a setting of each type: out of range, not a number, or not of the type.
COMMAND_LINE_PROBES = {
    int: ["-1", "0", str(2**63), str(2**64), "nan", "inf", "1.5", "x"],
    float: ["-1", "0", "nan", "inf", "-inf", str(2**64), "x"],
    bool: ["1", "0"],  # a flag takes no value
    str: ["", "5"],
    dict: ["-1", "nan", "d_model", "=1"],  # not KEY=VALUE
}
# Probes a user may mean: the plain cross-entropy, the seed 0, no length penalty or one favouring short outputs, and a
# float setting without an upper bound that dependencies take as it is (the learning-rate scale has one: the peak it
# makes).
LEGITIMATE = {
    "label_smoothing": ["0"],
    "seed": ["0"],
    "length_penalty": ["-1", "0", str(2**64)],
    "adam_epsilon": [str(2**64)],
    "max_grad_norm": [str(2**64)],
    "max_train_minutes": [str(2**64)],
}
# The values of a --model-override KEY=VALUE (read as JSON) walked over every field it may set, and those it may take.
OVERRIDE_PROBES = ["-1", "0", "NaN", "Infinity", "-Infinity", str(2**64), '"x"', "[1]"]
LEGITIMATE_OVERRIDES = {"dropout": ["0"], "attention_dropout": ["0"], "activation_dropout": ["0"]}
# Values a Python caller (or an edited run.json) may give that the command line cannot: of another type. None is one
# wherever the setting cannot be None.
PYTHON_PROBES = {
    int: [True, 1.5, "3"],
    float: [True, "0.5"],
    bool: [1, 0, "yes"],
    str: [5, b"base"],
    dict: ["d_model=64", [("d_model", 64)], {64: "d_model"}],
}


def declared_type(setting: Field) -> tuple[type, bool]:
    """The type a RecipeSettings field takes besides None (dict for dict[str, Any]), and whether it may be None."""
    members = typing.get_args(setting.type) if isinstance(setting.type, types.UnionType) else (setting.type,)
    (kind,) = (member for member in members if member is not type(None))
    return typing.get_origin(kind) or kind, type(None) in members


@pytest.fixture
def no_work(monkeypatch) -> None:
    """A probe that got through would train: fail it instead."""

    def accepted(*args, **kwargs):
        raise AssertionError("the settings were accepted and the run started")

    monkeypatch.setattr(hf_vaswani.training.recipe, "run_in_folder", accepted)


@pytest.mark.parametrize("setting", fields(RecipeSettings), ids=lambda setting: setting.name)
def test_every_setting_out_of_range_or_of_another_type_is_one_line_before_any_work(
    setting, tmp_path, capfd, no_work
) -> None:
    flag = setting_flag(setting.name)
    output_dir = tmp_path / "run"
    for value in COMMAND_LINE_PROBES[declared_type(setting)[0]]:
        argv = ["train", "--output-dir", str(output_dir), f"{flag}={value}"]
        if value in LEGITIMATE.get(setting.name, ()):
            settings = settings_from_args(build_parser().parse_args(argv))
            assert getattr(settings, setting.name) == float(value)
        else:
            refused(capfd, argv, flag)
        assert not output_dir.exists(), (setting.name, value)


@pytest.mark.parametrize("key", OVERRIDABLE_FIELDS)
def test_every_model_override_out_of_range_or_of_another_type_is_one_line_before_any_work(
    key, tmp_path, capfd, no_work
) -> None:
    output_dir = tmp_path / "run"
    for value in OVERRIDE_PROBES:
        argv = ["train", "--output-dir", str(output_dir), "--model-override", f"{key}={value}"]
        if value in LEGITIMATE_OVERRIDES.get(key, ()):
            assert settings_from_args(build_parser().parse_args(argv)).model_overrides == {key: 0}
        else:
            refused(capfd, argv, key)
        assert not output_dir.exists(), (key, value)


@pytest.mark.parametrize("setting", fields(RecipeSettings), ids=lambda setting: setting.name)
def test_every_setting_of_another_type_from_python_is_refused_naming_it(setting) -> None:
    kind, optional = declared_type(setting)
    for value in PYTHON_PROBES[kind] + ([] if optional else [None]):
        with pytest.raises(UsageError, match=f"^{setting_flag(setting.name)} must be [^\n]*, got ") as refusal:
            RecipeSettings(**{setting.name: value})
        assert "\n" not in str(refusal.value), (setting.name, value)


def test_values_of_the_declared_range_and_kind_are_taken() -> None:
    settings = RecipeSettings(seed=2**32 - 1, label_smoothing=0, learning_rate_scale=2, max_train_minutes=30)
    assert (settings.seed, settings.label_smoothing, settings.learning_rate_scale) == (2**32 - 1, 0, 2)
    assert RecipeSettings(max_steps=2**63 - 1).max_steps == 2**63 - 1


def test_a_learning_rate_scale_is_refused_by_the_peak_it_makes() -> None:
    # Eq. 3 peaks at warmup: d_model^-0.5 * warmup^-0.5, here 128^-0.5 * 800^-0.5 = 1 / 320: a scale of 330 peaks
    # above 1, the limit. The published Multi30k recipe's 2.53 is far below.
    overrides = {"d_model": 128, "d_ff": 256, "num_heads": 4}
    accepted = RecipeSettings(model_overrides=overrides, warmup_steps=800, learning_rate_scale=300)
    assert accepted.learning_rate_scale == 300
    with pytest.raises(UsageError, match=r"^--learning-rate-scale 330 makes Eq. 3's peak learning rate 1.03 \(d_model"):
        RecipeSettings(model_overrides=overrides, warmup_steps=800, learning_rate_scale=330)


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_numpy_refuses_is_one_line_before_the_corpus_is_made(seed, tmp_path: Path, capfd, no_work) -> None:
    for command in ("train", "demo"):
        refused(capfd, [command, "--output-dir", str(tmp_path / "run"), "--seed", seed], "--seed", "2**32", seed)
        assert not (tmp_path / "run").exists()
