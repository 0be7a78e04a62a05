"""Publishing: the exact files a push sends, that they load where hf_vaswani is not installed, and the model card."""

import shutil

import pytest
import torch
from helpers import run_without_hf_vaswani
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from tiny import save_untrained_folder

from hf_vaswani import VaswaniForConditionalGeneration
from hf_vaswani.cli import main
from hf_vaswani.interop.hub import upload_plan
from hf_vaswani.interop.model_card import write_model_card
from hf_vaswani.training.settings import RecipeSettings

PUBLISHED = {
    "README.md",
    "checks_vaswani.py",
    "errors_vaswani.py",
    "config.json",
    "configuration_vaswani.py",
    "generation_config.json",
    "generation_vaswani.py",
    "loss_vaswani.py",
    "model.safetensors",
    "modeling_vaswani.py",
    "pipeline_vaswani.py",
    "tokenizer.json",
    "tokenizer_config.json",
}

LOAD = """
import json, sys

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

folder = sys.argv[1]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
generated = model.generate(**tokenizer(["red cat sun"], return_tensors="pt"))
translator = pipeline("translation", model=folder, trust_remote_code=True)
print(json.dumps({"generate": tokenizer.batch_decode(generated, skip_special_tokens=True),
                  "pipeline": translator("green tree")}))
"""


@pytest.fixture
def publishable(tmp_path, trained_folder):
    folder = tmp_path / "publishable"
    shutil.copytree(trained_folder, folder)
    model = VaswaniForConditionalGeneration.from_pretrained(folder)
    results = {"bleu": 97.5, "chrf": 99.1, "tokenized_bleu": 97.9, "bleu_signature": "nrefs:1|tok:13a", "steps": 400}
    write_model_card(folder, model.config, RecipeSettings(), results, "en", "en", "toy-capitals", "red cat sun")
    return folder


def test_push_sends_exactly_the_loadable_files(tmp_path, publishable, monkeypatch) -> None:
    recorded: dict = {}

    def create_repo(self, repo_id, **kwargs):
        recorded["repo"] = (repo_id, kwargs)

    def create_commit(self, repo_id, operations, **kwargs):
        recorded["operations"] = list(operations)
        return CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/0",
            commit_message="",
            commit_description="",
            oid="0" * 40,
        )

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    (publishable / "optimizer.pt").unlink(missing_ok=True)
    (publishable / "notes.log").write_text("not part of a model")
    (publishable / "notes.txt").write_text("not part of a model either")
    (publishable / "credentials.json").write_text('{"token": "hf_secret"}')
    main(["push", str(publishable), "someone/capitaliser"])

    assert recorded["repo"][0] == "someone/capitaliser"
    sent = {op.path_in_repo: op.path_or_fileobj for op in recorded["operations"]}
    assert set(sent) == PUBLISHED
    remote = tmp_path / "as_uploaded"
    remote.mkdir()
    for name, source in sent.items():
        shutil.copy(source, remote / name)
    report = run_without_hf_vaswani(LOAD, [str(remote)], tmp_path)
    assert report == {"generate": ["RED CAT SUN"], "pipeline": [{"translation_text": "GREEN TREE"}]}


def test_pickled_weights_or_incomplete_folders_are_refused(publishable) -> None:
    torch.save({}, publishable / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        upload_plan(publishable)
    (publishable / "pytorch_model.bin").unlink()
    (publishable / "README.md").unlink()
    with pytest.raises(ValueError, match="README.md"):
        upload_plan(publishable)


@pytest.fixture
def untrained_folder(tmp_path):
    """A complete model folder of an untrained tiny model: the plan's checks need no trained weights."""
    folder = save_untrained_folder(tmp_path / "untrained")
    (folder / "README.md").write_text("a model card")
    return folder


def test_the_plan_leaves_out_every_file_a_model_folder_does_not_need(untrained_folder) -> None:
    (untrained_folder / "credentials.json").write_text('{"token": "hf_secret"}')
    (untrained_folder / "notes.txt").write_text("private notes")
    (untrained_folder / "vocab.txt").write_text("a stale vocabulary the tokenizer does not use")
    assert {path.name for path in upload_plan(untrained_folder)} == PUBLISHED


@pytest.mark.parametrize("removed", [("tokenizer.json",), ("tokenizer.json", "tokenizer_config.json")])
def test_a_folder_without_a_loadable_tokenizer_is_refused(untrained_folder, removed: tuple[str, ...]) -> None:
    for name in removed:
        (untrained_folder / name).unlink()
    with pytest.raises(ValueError, match=r"no loadable tokenizer \(missing \[.*'tokenizer.json'"):
        upload_plan(untrained_folder)


def test_a_tokenizer_file_the_tokenizer_writes_is_required(untrained_folder) -> None:
    (untrained_folder / "tokenizer_config.json").unlink()  # the tokenizer still loads from tokenizer.json alone
    with pytest.raises(ValueError, match=r"missing tokenizer files \['tokenizer_config.json'\]"):
        upload_plan(untrained_folder)


def test_sharded_weights_are_the_index_and_the_shards_it_names(untrained_folder) -> None:
    model = VaswaniForConditionalGeneration.from_pretrained(untrained_folder)
    (untrained_folder / "model.safetensors").unlink()
    model.save_pretrained(untrained_folder, max_shard_size="20KB")
    shards = {path.name for path in untrained_folder.glob("model-*.safetensors")}
    assert len(shards) > 1
    (untrained_folder / "model-99999-of-99999.safetensors").write_bytes(b"a stray shard no index names")
    names = {path.name for path in upload_plan(untrained_folder)}
    assert names == PUBLISHED - {"model.safetensors"} | {"model.safetensors.index.json"} | shards
    first_shard = untrained_folder / sorted(shards)[0]
    first_shard.unlink()
    with pytest.raises(ValueError, match=rf"missing \['{first_shard.name}'\]"):
        upload_plan(untrained_folder)
    (untrained_folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"missing \['model.safetensors'\]"):
        upload_plan(untrained_folder)


def test_every_code_file_that_save_pretrained_writes_is_required(publishable) -> None:
    # save_pretrained copies the modeling file and what it imports: without any one of them, trust_remote_code fails
    code = sorted(path for path in publishable.glob("*.py"))
    assert len(code) >= 2
    for path in code:
        kept = path.read_bytes()
        path.unlink()
        with pytest.raises(ValueError, match=path.name):
            upload_plan(publishable)
        path.write_bytes(kept)
    upload_plan(publishable)


def test_model_card_metadata_holds_the_measured_scores(publishable) -> None:
    card = ModelCard.load(publishable / "README.md")
    assert card.data.license == "apache-2.0" and card.data.language == ["en", "en"]
    assert "translation" in card.data.tags and card.data.datasets == ["toy-capitals"]
    metrics = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert metrics == {"bleu": 97.5, "chrf": 99.1}
    assert "| warmup steps / training steps | 4000 / 100000 | 4000 / 400 |" in card.text
    assert "| optimizer | Adam(0.9, 0.98, 1e-9) | Adam(0.9, 0.98, 1e-9) |" in card.text


def test_model_card_names_fairseqs_optimizer_settings_as_deviations(publishable) -> None:
    model = VaswaniForConditionalGeneration.from_pretrained(publishable)
    settings = RecipeSettings(adam_epsilon=1e-8, max_grad_norm=25.0)
    results = {"bleu": 40.0, "chrf": 65.0, "tokenized_bleu": 40.0, "bleu_signature": "nrefs:1|tok:13a", "steps": 6200}
    write_model_card(publishable, model.config, settings, results, "en", "de", "multi30k", "a dog runs .")
    card = ModelCard.load(publishable / "README.md").text
    assert "| optimizer | Adam(0.9, 0.98, 1e-9) | Adam(0.9, 0.98, 1e-8) |" in card
    assert "| gradient clipping (norm) | none | 25.0 |" in card
    deviations = next(line for line in card.splitlines() if line.startswith("Deviations from the paper:"))
    assert "optimizer" in deviations and "gradient clipping (norm)" in deviations


def test_model_and_tokenizer_push_to_hub_publish_a_folder_that_loads(tmp_path, trained_folder, monkeypatch) -> None:
    from transformers import AutoTokenizer

    received = tmp_path / "received"
    received.mkdir()

    def create_commit(self, repo_id, operations, **kwargs):
        for operation in operations:  # push_to_hub uploads from a temporary folder: keep copies
            shutil.copy(operation.path_or_fileobj, received / operation.path_in_repo)
        return CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/0",
            commit_message="",
            commit_description="",
            oid="0" * 40,
        )

    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kwargs: RepoUrl(f"https://huggingface.co/{repo_id}")
    )
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    VaswaniForConditionalGeneration.from_pretrained(trained_folder).push_to_hub("someone/capitaliser")
    AutoTokenizer.from_pretrained(trained_folder).push_to_hub("someone/capitaliser")
    assert {path.name for path in received.iterdir()} == PUBLISHED  # README.md: a stub card written by transformers
    report = run_without_hf_vaswani(LOAD, [str(received)], tmp_path)
    assert report == {"generate": ["RED CAT SUN"], "pipeline": [{"translation_text": "GREEN TREE"}]}
