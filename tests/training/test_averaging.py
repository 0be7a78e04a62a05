"""Checkpoint averaging (§6.1): the element-wise mean of the last checkpoints, what travels with it, and refusals."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import random_model, toy_tokenizer
from transformers import AutoModelForSeq2SeqLM, TrainerControl, TrainerState

import hf_vaswani  # noqa: F401  (registers the Auto classes)
from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.model.errors_vaswani import UsageError
from hf_vaswani.training.averaging import average_checkpoints, last_checkpoints
from hf_vaswani.training.callbacks import CheckpointAveragingCallback

STEPS = (5, 10, 100)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """A Trainer-like output folder with three checkpoints, plus their state dicts."""
    output_dir = tmp_path_factory.mktemp("run")
    state_dicts = []
    for seed, step in enumerate(STEPS):
        model = random_model(seed)
        checkpoint = output_dir / f"checkpoint-{step}"
        model.save_pretrained(checkpoint)
        # Training state that must not travel into the averaged model.
        torch.save({"step": step}, checkpoint / "optimizer.pt")
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (checkpoint / "rng_state.pth").write_bytes(b"rng")
        (checkpoint / "README.md").write_text(f"model card of step {step}")
        state_dicts.append({name: tensor.clone() for name, tensor in model.state_dict().items()})
    (output_dir / "runs").mkdir()
    (output_dir / "checkpoint-notastep").mkdir()
    return output_dir, state_dicts


def expected_mean(state_dicts: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    return torch.stack([state_dict[name] for state_dict in state_dicts]).mean(0)


def test_last_checkpoints_sorts_steps_numerically(run: tuple[Path, list]) -> None:
    output_dir, _ = run
    assert [path.name for path in last_checkpoints(output_dir, 2)] == ["checkpoint-10", "checkpoint-100"]
    assert [path.name for path in last_checkpoints(output_dir, 3)] == [f"checkpoint-{step}" for step in STEPS]
    with pytest.warns(UserWarning, match="only 3"):
        assert len(last_checkpoints(output_dir, 5)) == 3


def test_last_checkpoints_refuses_empty_folder_and_bad_n(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no checkpoint"):
        last_checkpoints(tmp_path, 5)
    with pytest.raises(ValueError, match="at least 1"):
        last_checkpoints(tmp_path, 0)
    with pytest.raises(FileNotFoundError):
        last_checkpoints(tmp_path / "missing", 1)


@pytest.mark.parametrize("n", ["5", 2.0, True, None, -1])
def test_last_checkpoints_refuses_a_count_that_is_no_whole_number_in_one_line(run: tuple[Path, list], n) -> None:
    output_dir, _ = run
    with pytest.raises(UsageError, match=rf"^n must be a whole number of checkpoints, at least 1, got {n!r}$"):
        last_checkpoints(output_dir, n)
    assert [path.name for path in last_checkpoints(output_dir, numpy.int64(1))] == ["checkpoint-100"]


def test_last_checkpoints_up_to_a_step(run: tuple[Path, list]) -> None:
    output_dir, _ = run
    assert [path.name for path in last_checkpoints(output_dir, 2, up_to_step=10)] == ["checkpoint-5", "checkpoint-10"]
    assert [path.name for path in last_checkpoints(output_dir, 1, up_to_step=99)] == ["checkpoint-10"]
    with pytest.raises(ValueError, match="no checkpoint-<step> folder of step 4 or earlier"):
        last_checkpoints(output_dir, 1, up_to_step=4)


@pytest.mark.parametrize(("end_at_best", "averaged_steps"), [(True, (5, 10)), (False, (10, 100))])
def test_averaging_callback_ends_at_the_best_validated_step_when_asked(
    run: tuple[Path, list], tmp_path: Path, end_at_best: bool, averaged_steps: tuple[int, ...]
) -> None:
    output_dir, state_dicts = run
    # validation BLEU as ValidationBleuCallback logs it: best at step 10, the run went on to step 100
    history = [{"eval_bleu": 20.0, "step": 5}, {"loss": 3.0, "step": 10}, {"eval_bleu": 31.5, "step": 10}]
    history += [{"eval_bleu": 31.5, "step": 50}, {"eval_bleu": 30.0, "step": 100}]
    callback = CheckpointAveragingCallback(
        2, subdirectory=str(tmp_path / "averaged"), end_at_best_validation=end_at_best
    )
    callback.on_train_end(SimpleNamespace(output_dir=output_dir), TrainerState(log_history=history), TrainerControl())
    assert [path.name for path in callback.checkpoints] == [f"checkpoint-{step}" for step in averaged_steps]
    averaged = VaswaniForConditionalGeneration.from_pretrained(callback.averaged_path).state_dict()
    chosen = [state_dicts[STEPS.index(step)] for step in averaged_steps]
    for name in state_dicts[0]:
        torch.testing.assert_close(averaged[name], expected_mean(chosen, name), rtol=0, atol=1e-6)


def test_average_matches_the_elementwise_mean_and_loads(run: tuple[Path, list], tmp_path: Path) -> None:
    output_dir, state_dicts = run
    assert not torch.equal(state_dicts[0]["lm_head.weight"], state_dicts[1]["lm_head.weight"])
    averaged_dir = average_checkpoints(last_checkpoints(output_dir, 3), tmp_path / "averaged")
    assert averaged_dir == tmp_path / "averaged"

    model = VaswaniForConditionalGeneration.from_pretrained(averaged_dir)
    state_dict = model.state_dict()
    assert state_dict.keys() == state_dicts[0].keys()
    for name, tensor in state_dict.items():
        assert tensor.dtype == state_dicts[0][name].dtype
        torch.testing.assert_close(tensor, expected_mean(state_dicts, name), msg=name)

    embedding = model.model.encoder.embeddings.embed_tokens.weight
    assert model.lm_head.weight is embedding
    assert model.model.decoder.embeddings.embed_tokens.weight is embedding

    auto_model = AutoModelForSeq2SeqLM.from_pretrained(averaged_dir)
    assert isinstance(auto_model, VaswaniForConditionalGeneration)
    torch.testing.assert_close(auto_model.lm_head.weight, model.lm_head.weight)

    with safe_open(averaged_dir / "model.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_copies_loading_files_of_the_last_checkpoint_only(run: tuple[Path, list], tmp_path: Path) -> None:
    output_dir, _ = run
    averaged_dir = average_checkpoints(last_checkpoints(output_dir, 2), tmp_path / "averaged")
    names = {path.name for path in averaged_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md"} <= names
    assert {"configuration_vaswani.py", "modeling_vaswani.py"} <= names
    assert not names & {"optimizer.pt", "trainer_state.json", "rng_state.pth"}
    assert (averaged_dir / "README.md").read_text() == "model card of step 100"


def test_sharded_checkpoints_are_read(run: tuple[Path, list], tmp_path: Path) -> None:
    _, state_dicts = run
    for seed in range(2):
        random_model(seed).save_pretrained(tmp_path / f"sharded-{seed}", max_shard_size="5KB")
    assert (tmp_path / "sharded-0" / "model.safetensors.index.json").is_file()
    averaged_dir = average_checkpoints([tmp_path / "sharded-0", tmp_path / "sharded-1"], tmp_path / "averaged")
    assert not (averaged_dir / "model.safetensors.index.json").exists()
    model = VaswaniForConditionalGeneration.from_pretrained(averaged_dir)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected_mean(state_dicts[:2], name), msg=name)


def test_mismatched_checkpoints_are_refused_naming_the_tensor(run: tuple[Path, list], tmp_path: Path) -> None:
    output_dir, _ = run
    random_model(0, d_ff=48).save_pretrained(tmp_path / "wider")
    with pytest.raises(ValueError, match=r"wider.*feed_forward\.fc1\.(weight|bias)"):
        average_checkpoints([output_dir / "checkpoint-5", tmp_path / "wider"], tmp_path / "averaged")
    random_model(0, encoder_layers=2).save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match=r"deeper.*model\.encoder\.layers\.1\."):
        average_checkpoints([output_dir / "checkpoint-5", tmp_path / "deeper"], tmp_path / "averaged")
    assert not (tmp_path / "averaged" / "model.safetensors").exists()


def test_dtype_is_kept_and_integer_tensors_must_agree(tmp_path: Path) -> None:
    values = [torch.tensor([1.0, 2.0, 4.0]), torch.tensor([2.0, 2.0, 8.0]), torch.tensor([3.0, 5.0, 0.0])]
    for index, value in enumerate(values):
        (tmp_path / f"c{index}").mkdir()
        tensors = {"w": value.to(torch.bfloat16), "count": torch.tensor([7, 1], dtype=torch.int64)}
        save_file(tensors, tmp_path / f"c{index}" / "model.safetensors", metadata={"format": "pt"})
    averaged_dir = average_checkpoints([tmp_path / f"c{index}" for index in range(3)], tmp_path / "out")
    with safe_open(averaged_dir / "model.safetensors", framework="pt") as handle:
        assert handle.get_tensor("w").dtype == torch.bfloat16
        torch.testing.assert_close(handle.get_tensor("w"), torch.tensor([2.0, 3.0, 4.0], dtype=torch.bfloat16))
        assert torch.equal(handle.get_tensor("count"), torch.tensor([7, 1]))

    save_file({"w": values[0].to(torch.bfloat16), "count": torch.tensor([8, 1])}, tmp_path / "c2" / "model.safetensors")
    with pytest.raises(ValueError, match=r"c2.*'count'"):
        average_checkpoints([tmp_path / f"c{index}" for index in range(3)], tmp_path / "out")


def test_bad_inputs_are_refused(run: tuple[Path, list], tmp_path: Path) -> None:
    output_dir, _ = run
    with pytest.raises(ValueError, match="at least one"):
        average_checkpoints([], tmp_path / "out")
    with pytest.raises(ValueError, match="one of the checkpoints"):
        average_checkpoints([output_dir / "checkpoint-5", output_dir / "checkpoint-10"], output_dir / "checkpoint-10")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        average_checkpoints([tmp_path], tmp_path / "out")


def test_checkpoints_with_different_tokenizers_are_refused(tmp_path: Path) -> None:
    for seed, (name, vocabulary) in enumerate([("a", '{"red": 4}'), ("b", '{"red": 5}')]):
        random_model(seed).save_pretrained(tmp_path / name)
        (tmp_path / name / "tokenizer_config.json").write_text('{"model_max_length": 512}')
        (tmp_path / name / "tokenizer.json").write_text(vocabulary)
    with pytest.raises(ValueError, match=r"checkpoints .*a and .*b have different tokenizers: tokenizer.json differs"):
        average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "averaged")


def test_checkpoints_whose_tokenizers_differ_only_in_the_last_calls_padding_are_averaged(tmp_path: Path) -> None:
    # A padded call outside encode_padded (a caller's own validation) leaves its padding on the backend, which saves it
    # in tokenizer.json: checkpoints saved before and after that call differ there and nowhere else.
    tokenizer = toy_tokenizer()
    for seed, name in enumerate(["a", "b"]):
        random_model(seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        tokenizer.backend_tokenizer.enable_padding(pad_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token)
        tokenizer.backend_tokenizer.enable_truncation(max_length=64)
    saved = [json.loads((tmp_path / name / "tokenizer.json").read_text()) for name in ("a", "b")]
    assert (saved[0]["padding"], saved[0]["truncation"]) == (None, None)
    assert saved[1]["padding"]["pad_id"] == tokenizer.pad_token_id and saved[1]["truncation"]["max_length"] == 64
    average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "averaged")
    assert (tmp_path / "averaged" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tokenizer.backend_tokenizer.add_tokens(["zebra"])  # a vocabulary of its own: still refused
    tokenizer.save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match=r"checkpoints .*a and .*b have different tokenizers: tokenizer.json differs"):
        average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "again")


def test_checkpoints_with_different_configs_are_refused(tmp_path: Path) -> None:
    random_model(0).save_pretrained(tmp_path / "a")
    random_model(1, label_smoothing=0.2).save_pretrained(tmp_path / "b")  # same tensors, another model
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps(config | {"transformers_version": "0.0"}))  # irrelevant
    with pytest.raises(ValueError, match=r"checkpoints .*a and .*b have different configs: \['label_smoothing'\]"):
        average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "averaged")


def test_truncated_weights_are_refused_naming_the_file(run: tuple[Path, list], tmp_path: Path) -> None:
    output_dir, _ = run
    truncated = tmp_path / "truncated"
    shutil.copytree(output_dir / "checkpoint-10", truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file"):
        average_checkpoints([output_dir / "checkpoint-5", truncated], tmp_path / "averaged")
