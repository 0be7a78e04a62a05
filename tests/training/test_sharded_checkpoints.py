"""Checkpoints of weights sharded by FSDP, as accelerate saves them (a torch distributed checkpoint, DCP): complete or
not, averaged and loaded as whole ones are. One process writes them here, the format being the same for any number;
tests/training/test_distributed.py reads those of 2-process FSDP1 and FSDP2 runs."""

import json
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_without_hf_vaswani
from safetensors.torch import load_file
from tiny import SMALLEST_MODEL, random_model, toy_tokenizer
from transformers import TrainerControl, TrainerState

from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.model.errors_vaswani import UsageError
from hf_vaswani.sharded_weights import SHARDED_WEIGHTS
from hf_vaswani.training.averaging import average_checkpoints
from hf_vaswani.training.callbacks import CheckpointAveragingCallback
from hf_vaswani.training.checkpoints import SHARDED_OPTIMIZER, checkpoint_problem
from hf_vaswani.training.trainer import wrapped_class_code_saved

# Loads a folder as the Hub's users do, with the code it carries, and says which module the model's class came from.
REMOTE_CODE_LOADER = """
import json, sys

import torch
from transformers import AutoModelForSeq2SeqLM

model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    model(input_ids=torch.tensor([[5, 6, 2]]), decoder_input_ids=torch.tensor([[1, 7]]))
print(json.dumps({"model_module": type(model).__module__, "hf_vaswani_loaded": "hf_vaswani" in sys.modules}))
"""


def save_dcp(state: dict, folder: Path) -> None:
    with warnings.catch_warnings():  # DCP's note that it writes in one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def save_sharded(model: VaswaniForConditionalGeneration, checkpoint: Path, model_files: bool = True) -> None:
    """`checkpoint` as Trainer saves it under FSDP with sharded state dicts (accelerate's save_fsdp_model), with the
    model files CheckpointAveragingCallback writes beside the weights unless not `model_files`."""
    save_dcp({"model": model.state_dict()}, checkpoint / SHARDED_WEIGHTS)
    if model_files:
        model.generation_config.save_pretrained(checkpoint)
        model.config.save_pretrained(checkpoint)


def resumable(checkpoint: Path) -> Path:
    """`checkpoint` with the training state Trainer saves beside the weights, its optimizer's sharded."""
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        torch.save({}, checkpoint / name)
    save_dcp({"optimizer": {"state": {"step": torch.tensor(1.0)}}}, checkpoint / SHARDED_OPTIMIZER)
    return checkpoint


def test_the_average_of_sharded_checkpoints_is_the_mean_of_their_weights_and_loads(tmp_path: Path) -> None:
    models = [random_model(seed) for seed in range(3)]
    for step, model in enumerate(models):
        save_sharded(model, tmp_path / f"checkpoint-{step}")
    averaged = average_checkpoints([tmp_path / f"checkpoint-{step}" for step in range(3)], tmp_path / "averaged")

    states = [model.state_dict() for model in models]
    weights = load_file(averaged / "model.safetensors")
    assert sorted(weights) == sorted(states[0])  # a tied weight under each of its names, as the state dict has it
    for name, tensor in weights.items():
        mean = (sum(state[name].to(torch.float64) for state in states) / 3).to(tensor.dtype)
        assert torch.equal(tensor, mean), name
    model, info = VaswaniForConditionalGeneration.from_pretrained(averaged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is model.model.decoder.embeddings.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_a_sharded_checkpoint_loads_as_a_model_folder(tmp_path: Path) -> None:
    model = random_model(0)
    model.generation_config.num_beams = 3
    save_sharded(model, tmp_path)
    toy_tokenizer().save_pretrained(tmp_path)

    loaded, _ = load_model_folder(tmp_path)
    assert loaded.generation_config.num_beams == 3
    assert loaded.lm_head.weight is loaded.model.encoder.embeddings.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_sharded_checkpoints_that_make_no_model_folder_are_refused_in_one_line(tmp_path: Path) -> None:
    save_sharded(random_model(0), tmp_path / "checkpoint-1")
    save_sharded(random_model(1), tmp_path / "checkpoint-2", model_files=False)
    random_model(2).save_pretrained(tmp_path / "checkpoint-3")
    with pytest.raises(UsageError, match=r"checkpoint-2 holds sharded weights and no config.json"):
        average_checkpoints([tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"], tmp_path / "averaged")
    with pytest.raises(UsageError, match=r"checkpoint-1 holds sharded weights and .*checkpoint-3 whole ones"):
        average_checkpoints([tmp_path / "checkpoint-1", tmp_path / "checkpoint-3"], tmp_path / "averaged")

    (tmp_path / "checkpoint-1" / SHARDED_WEIGHTS / ".metadata").write_bytes(b"cut")
    with pytest.raises(UsageError, match=r"sharded weights of .*checkpoint-1 are incomplete or damaged: .*\.metadata"):
        average_checkpoints([tmp_path / "checkpoint-1"], tmp_path / "averaged")
    with pytest.raises(UsageError, match=r"sharded weights of .*checkpoint-1 are incomplete"):
        load_model_folder(tmp_path / "checkpoint-1")

    save_dcp({"optimizer": {"step": torch.tensor(1.0)}}, tmp_path / "checkpoint-4" / SHARDED_WEIGHTS)
    shutil.copy(tmp_path / "checkpoint-3" / "config.json", tmp_path / "checkpoint-4")
    with pytest.raises(UsageError, match=r"not a model's weights as accelerate saves them: it holds 'optimizer.step'"):
        average_checkpoints([tmp_path / "checkpoint-4"], tmp_path / "averaged")
    assert not (tmp_path / "averaged").exists()


def test_a_sharded_checkpoint_is_complete_with_its_metadata_and_config(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-1"
    save_sharded(random_model(0), checkpoint)
    assert checkpoint_problem(resumable(checkpoint)) is None

    (checkpoint / SHARDED_OPTIMIZER / ".metadata").unlink()  # a save killed before DCP's last write
    assert checkpoint_problem(checkpoint) == f"{SHARDED_OPTIMIZER}/.metadata: FileNotFoundError"
    (checkpoint / "config.json").write_text('{"cut')  # CheckpointAveragingCallback's last write cut short
    assert checkpoint_problem(checkpoint) == "config.json beside the sharded weights: JSONDecodeError"
    (checkpoint / SHARDED_WEIGHTS / ".metadata").unlink()
    assert checkpoint_problem(checkpoint) == f"{SHARDED_WEIGHTS}/.metadata: FileNotFoundError"


def test_a_checkpoint_of_whole_weights_under_fsdp_is_complete(tmp_path: Path) -> None:
    # accelerate saves the optimizer of FSDP's whole-model state dicts as optimizer.bin, not Trainer's optimizer.pt
    random_model(0).save_pretrained(tmp_path)
    resumable(tmp_path)
    shutil.rmtree(tmp_path / SHARDED_OPTIMIZER)
    torch.save({}, tmp_path / "optimizer.bin")
    assert checkpoint_problem(tmp_path) is None
    (tmp_path / "optimizer.bin").write_bytes(b"cut")
    assert checkpoint_problem(tmp_path) == "optimizer.bin: BadZipFile"


def test_the_averaging_callback_writes_the_model_files_beside_sharded_weights_only(tmp_path: Path) -> None:
    model, tokenizer = random_model(0), toy_tokenizer()
    model.generation_config.num_beams = 3
    save_sharded(model, tmp_path / "checkpoint-4", model_files=False)
    random_model(1).save_pretrained(tmp_path / "checkpoint-8")
    (tmp_path / "checkpoint-8" / "config.json").write_text("{}")
    callback = CheckpointAveragingCallback(2)
    for step in (4, 8):
        state = TrainerState(global_step=step)
        callback.on_save(SimpleNamespace(output_dir=str(tmp_path)), state, TrainerControl(), model, tokenizer)

    assert json.loads((tmp_path / "checkpoint-4" / "generation_config.json").read_text())["num_beams"] == 3
    assert (tmp_path / "checkpoint-4" / "tokenizer.json").is_file()
    loaded = load_model_folder(tmp_path / "checkpoint-4")[0]
    assert (loaded.name_or_path, loaded.generation_config.num_beams) == (str(tmp_path / "checkpoint-4"), 3)
    assert (tmp_path / "checkpoint-8" / "config.json").read_text() == "{}"  # whole weights: Trainer's files stay
    assert not (tmp_path / "checkpoint-8" / "tokenizer.json").exists()


def test_a_model_under_fsdp2_saves_its_own_code(tmp_path: Path) -> None:
    """FSDP2 gives a model a class of its own, defined in torch (FSDPVaswaniForConditionalGeneration): saved as its
    whole-model checkpoint as VaswaniTrainer saves it, the folder still names and carries the package's code, as a
    plain model's does, and loads where hf_vaswani cannot be imported."""
    model = random_model(0, SMALLEST_MODEL)
    model.save_pretrained(tmp_path / "plain")
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        torch.distributed.fsdp.fully_shard(model)
        assert type(model).__module__.startswith("torch.distributed.fsdp")
        with wrapped_class_code_saved(model, tmp_path / "sharded"):
            model.save_pretrained(tmp_path / "sharded", state_dict=weights)  # accelerate gathers the state dict so
        assert "_auto_class" not in vars(type(model))  # torch's class as it was
    finally:
        torch.distributed.destroy_process_group()
    saved = {name: json.loads((tmp_path / name / "config.json").read_text()) for name in ("plain", "sharded")}
    assert saved["sharded"]["auto_map"] == saved["plain"]["auto_map"]
    assert sorted(os.listdir(tmp_path / "sharded")) == sorted(os.listdir(tmp_path / "plain"))
    report = run_without_hf_vaswani(REMOTE_CODE_LOADER, [str(tmp_path / "sharded")], tmp_path)
    assert report["model_module"].startswith("transformers_modules") and report["hf_vaswani_loaded"] is False
