"""Publishing a model folder to the Hugging Face Hub: exactly the files that make it load, safetensors only."""

from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from transformers.dynamic_module_utils import get_relative_import_files

from . import modeling_vaswani

# Weights as safetensors, configs, tokenizer, the remote code (model, config, generation, pipeline) and the card.
PUBLISHED_PATTERNS = ("*.safetensors", "*.json", "*.py", "README.md", "*.model", "*.spm", "*.txt")


def required_files() -> list[str]:
    """The files every complete model folder holds: configs, card and the remote code.

    The remote code is the modeling file and every file it imports relatively, found the way transformers finds them
    when it loads a folder with `trust_remote_code`, so a new sibling module cannot be forgotten here.
    """
    modeling = modeling_vaswani.__file__
    code = sorted(Path(path).name for path in [modeling, *get_relative_import_files(modeling)])
    return ["config.json", "generation_config.json", "README.md", *code]


def upload_plan(folder: str | Path) -> list[Path]:
    """The files of `folder` that a push uploads, checked for completeness; pickled weights are refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt"))
    if pickles:
        raise ValueError(
            f"{folder} holds pickled weights {pickles}: publish safetensors only (save_pretrained writes them)"
        )
    missing = [name for name in required_files() if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("model.safetensors")
    if missing:
        raise ValueError(
            f"{folder} is not a complete model folder: missing {missing} (write it with save_model_folder)"
        )
    files = {p for pattern in PUBLISHED_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(files)


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
