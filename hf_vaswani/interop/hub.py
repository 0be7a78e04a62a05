"""Publishing a model folder to the Hugging Face Hub: exactly the files that make it load, safetensors only."""

import json
import tempfile
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from transformers import AutoTokenizer
from transformers.dynamic_module_utils import get_relative_import_files

from ..model import modeling_vaswani
from ..model.errors_vaswani import UsageError

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def required_files() -> list[str]:
    """The files every complete model folder holds: configs, card and the remote code.

    The remote code is the modeling file and every file it imports relatively, found the way transformers finds them
    when it loads a folder with `trust_remote_code`, so a new sibling module cannot be forgotten here.
    """
    modeling = modeling_vaswani.__file__
    code = sorted(Path(path).name for path in [modeling, *get_relative_import_files(modeling)])
    return ["config.json", "generation_config.json", "README.md", *code]


def weight_files(folder: Path) -> list[str]:
    """`model.safetensors`, or the shard index and the shards it names (which is what transformers loads)."""
    if (folder / WEIGHTS_NAME).is_file():
        return [WEIGHTS_NAME]
    if (folder / WEIGHTS_INDEX_NAME).is_file():
        shards = sorted(set(json.loads((folder / WEIGHTS_INDEX_NAME).read_text())["weight_map"].values()))
        return [WEIGHTS_INDEX_NAME, *shards]
    return [WEIGHTS_NAME]


def tokenizer_files(folder: Path) -> list[str]:
    """The files of the folder's tokenizer, named by the tokenizer itself: those it writes when saved."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as error:
        absent = [name for name in ("tokenizer.json", "tokenizer_config.json") if not (folder / name).is_file()]
        raise UsageError(
            f"{folder} has no loadable tokenizer{f' (missing {absent})' if absent else ''}: save it into the folder "
            f"with save_model_folder ({error})"
        ) from error
    with tempfile.TemporaryDirectory() as saved:
        tokenizer.save_pretrained(saved)
        return sorted(path.name for path in Path(saved).iterdir())


def upload_plan(folder: str | Path) -> list[Path]:
    """The files of `folder` that a push uploads, checked for completeness; pickled weights are refused.

    The plan is derived, not globbed: the required files, the weights and the tokenizer's files. Anything else in the
    folder (notes, credentials, training state) stays behind.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UsageError(
            f"{folder} holds pickled weights {pickles}: publish safetensors only (save_pretrained writes them)"
        )
    names = [*required_files(), *weight_files(folder)]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise UsageError(
            f"{folder} is not a complete model folder: missing {missing} (write it with save_model_folder)"
        )
    names += tokenizer_files(folder)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise UsageError(f"{folder} is not a complete model folder: missing tokenizer files {missing}")
    return sorted(folder / name for name in set(names))


def push_folder(
    folder: str | Path, repo_id: str, private: bool = False, token: str | None = None, commit_message: str | None = None
) -> CommitInfo:
    """Create `repo_id` if needed and upload the folder's publishable files in one commit."""
    operations = [CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path)) for path in upload_plan(folder)]
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.create_commit(
        repo_id, operations=operations, commit_message=commit_message or "Upload hf_vaswani translation model"
    )
