"""A saved folder loads with trust_remote_code=True where hf_vaswani cannot be imported, with the same logits, as the
plain model, and its tokenizer as docs/deployment.md says; the files that travel use no torch operator outside its
public API and import no private name of transformers (the private GenerationMixin hooks they override:
tests/interop/test_private_api.py)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REFUSE_HF_VASWANI, run_without_hf_vaswani
from test_docs import ROOT, fenced_blocks
from tiny import SMALLEST_MODEL, random_model, save_untrained_folder
from transformers import PreTrainedTokenizerFast

import hf_vaswani
from hf_vaswani.interop.hub import required_files

REMOTE_CODE = [name for name in required_files() if name.endswith(".py")]

LOADER = """
import json, sys

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

folder, inputs_path, output_path = sys.argv[1:]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
inputs = torch.load(inputs_path)
with torch.no_grad():
    logits = model(**inputs).logits
generated = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                           max_new_tokens=5, num_beams=2)
torch.save({"logits": logits, "generated": generated}, output_path)
plain = (torch.nn.Linear, torch.nn.Dropout)
print(json.dumps({"model_module": type(model).__module__,
                  "plain_modules": all(type(m) in plain for m in model.modules() if isinstance(m, plain)),
                  "config_module": type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__module__,
                  "hf_vaswani_loaded": any(m.startswith("hf_vaswani") for m in sys.modules)}))
"""


def test_remote_code_load_without_hf_vaswani(tmp_path: Path) -> None:
    # d_k != d_v, as in TINY_MODEL; d_ff 24 keeps every dot product short (the tolerance below)
    model = random_model(0, SMALLEST_MODEL, d_ff=24, d_k=4, d_v=12, encoder_layers=2, decoder_layers=2)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_vaswani.VaswaniForConditionalGeneration"
    assert set(REMOTE_CODE) <= set(os.listdir(folder))
    # The shipped files must not reach back into the package.
    for name in REMOTE_CODE:
        assert "hf_vaswani" not in (folder / name).read_text().replace('"hf_vaswani"', ""), name

    inputs = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "decoder_input_ids": torch.tensor([[1, 11, 12], [1, 13, 14]]),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    report = run_without_hf_vaswani(
        LOADER, [str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], tmp_path
    )
    assert report["model_module"].startswith("transformers_modules"), report
    assert report["config_module"].startswith("transformers_modules"), report
    assert report["hf_vaswani_loaded"] is False
    assert report["plain_modules"] is True  # the CPU kernels are the installed package's (kernels/cpu.py's kernelize)

    remote = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        local_logits = model(**inputs).logits
    # The point is that the shipped code computes the same function, not the same bits: the other process runs with
    # its own thread count, and so possibly other kernels and summation orders. Each logit ends a chain of ~16 dot
    # products of length <= 24 (2 + 2 layers), with layer norms keeping activations at unit scale in between; a
    # length-n dot product is off by ~sqrt(n) * eps of its scale, and these add along the chain: 16 * sqrt(24) * eps,
    # ~80 eps of the logit scale. A different function (a mask, a scale, a wrong projection) is off by the scale itself.
    tolerance = 100 * torch.finfo(torch.float32).eps * local_logits.abs().max().item()
    torch.testing.assert_close(remote["logits"], local_logits, atol=tolerance, rtol=0)
    local_generated = model.generate(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5, num_beams=2
    )
    # Tokens compare exactly: this model's candidate scores at each step lie far more than that tolerance apart.
    assert torch.equal(remote["generated"], local_generated)


TOKENIZER_LOADER = """
import json, sys, time

folder = sys.argv[1]
{prelude}
started = time.perf_counter()
{loading}
seconds = time.perf_counter() - started
print()  # a question transformers asks ends without a line break
print(json.dumps({{"seconds": seconds, "class": type(tokenizer).__name__, "ids": tokenizer(sys.argv[2:]).input_ids,
                  "hf_vaswani_loaded": any(m.startswith("hf_vaswani") for m in sys.modules)}}))
"""
REMOTE_CODE_QUESTION = "Do you wish to run the custom code?"
MODEL_TYPE_WARNING = "You are using a model of type"
TOKENIZED = ["red cat sun", "blue dog"]
AUTO_TOKENIZER = "from transformers import AutoTokenizer\ntokenizer = AutoTokenizer.from_pretrained(folder{})"


def documented_tokenizer_loading() -> str:
    """docs/deployment.md's Python that loads the tokenizer where hf_vaswani is not imported."""
    blocks = [block.text for language, block in fenced_blocks(ROOT / "docs" / "deployment.md") if language == "python"]
    (loading,) = [text for text in blocks if ".from_pretrained(folder)" in text]
    return loading


def load_tokenizer_in_a_fresh_process(
    folder: Path, loading: str, hf_vaswani_importable: bool, workdir: Path, prelude: str = ""
) -> tuple[str, dict]:
    """Run `prelude`, then `loading` (Python that binds `tokenizer` from `folder`, timed) in a fresh interpreter,
    offline, its stdin closed: (what it printed, stdout and stderr together; its report)."""
    script = TOKENIZER_LOADER.format(prelude=prelude, loading=loading)
    path = workdir / "load_tokenizer.py"
    path.write_text((REFUSE_HF_VASWANI if not hf_vaswani_importable else "") + script)
    env = {**os.environ, "HF_HOME": str(workdir / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    command = [sys.executable, str(path), str(folder), *TOKENIZED]
    result = subprocess.run(command, input="", env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("prelude", "loading", "hf_vaswani_importable"),
    [
        ("import torch, transformers", documented_tokenizer_loading(), False),
        ("import torch, transformers", AUTO_TOKENIZER.format(", trust_remote_code=True"), False),
        ("import hf_vaswani", AUTO_TOKENIZER.format(""), True),
    ],
    ids=["documented", "trust_remote_code", "hf_vaswani imported"],
)
def test_the_tokenizer_loads_without_a_question_or_a_warning(tmp_path, prelude, loading, hf_vaswani_importable) -> None:
    """A saved folder's tokenizer, in a fresh process with stdin closed and the Hub offline: no question, no warning
    about the model type, loaded in under 5 seconds (the question waits 15 where stdin is open; importing torch,
    transformers or the package first, as a program would at its start, is not counted), and the saved tokenizer's
    ids."""
    folder = save_untrained_folder(tmp_path / "model")
    printed, report = load_tokenizer_in_a_fresh_process(folder, loading, hf_vaswani_importable, tmp_path, prelude)
    assert REMOTE_CODE_QUESTION not in printed and MODEL_TYPE_WARNING not in printed, printed
    assert report["seconds"] < 5
    assert report["hf_vaswani_loaded"] is hf_vaswani_importable
    assert report["class"] == "TokenizersBackend"  # the one class AutoTokenizer gives these folders
    saved = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    assert report["ids"] == saved(TOKENIZED).input_ids


def test_auto_tokenizer_without_the_package_still_asks(tmp_path) -> None:
    """The limitation docs/deployment.md states: where it no longer holds, the docs must say so."""
    folder = save_untrained_folder(tmp_path / "model")
    printed, _ = load_tokenizer_in_a_fresh_process(folder, AUTO_TOKENIZER.format(""), False, tmp_path)
    assert REMOTE_CODE_QUESTION in printed and MODEL_TYPE_WARNING in printed, (
        "transformers now loads the tokenizer of a folder with remote code without asking: docs/deployment.md and "
        f"the README's limitations say otherwise; it printed: {printed}"
    )


def non_public_names(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each use of torch's operator namespaces or private modules (`torch.ops`, `torch._x`) and of
    each private name imported from transformers (`from transformers... import _x`, `transformers._x`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            if node.attr == "ops" or node.attr.startswith("_"):
                found.append((node.lineno, f"torch.{node.attr}"))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                parts = module.split(".")
                if parts[0] in ("torch", "transformers") and any(part.startswith("_") for part in parts[1:]):
                    found.append((node.lineno, module))
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if alias.name[0] == "_"]
    return found


@pytest.mark.parametrize("name", REMOTE_CODE)
def test_remote_code_uses_public_torch_and_transformers_api_only(name: str) -> None:
    """What travels to the Hub must keep working with the torch and transformers of whoever loads it: no operators
    outside torch's public API (torch.ops, torch._x), no private names of transformers imported."""
    path = Path(hf_vaswani.__file__).parent / "model" / name
    found = non_public_names(ast.parse(path.read_text(), filename=name))
    assert not found, f"{name} uses non-public API: " + ", ".join(f"line {line}: {use}" for line, use in found)


def test_the_remote_code_check_finds_what_it_looks_for() -> None:
    source = """
import torch
from transformers.generation.utils import _private
from transformers._internal import thing
x = torch.ops.mkldnn._linear_pointwise
y = torch._dynamo.mark_static_address
"""
    found = [use for _, use in non_public_names(ast.parse(source))]
    assert sorted(found) == sorted(
        ["transformers.generation.utils._private", "transformers._internal", "torch.ops", "torch._dynamo"]
    )


def test_the_model_folder_holds_exactly_the_remote_code() -> None:
    """hf_vaswani/model/ is the remote code: every module there travels with a saved model, and nothing else does."""
    folder = Path(hf_vaswani.__file__).parent / "model"
    assert sorted(REMOTE_CODE) == sorted(path.name for path in folder.glob("*.py") if path.name != "__init__.py")
