"""A saved folder loads with trust_remote_code=True where hf_vaswani cannot be imported, with the same logits."""

import json
import os
from pathlib import Path

import torch
from helpers import run_without_hf_vaswani

import hf_vaswani  # noqa: F401
from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration

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
print(json.dumps({"model_module": type(model).__module__,
                  "config_module": type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__module__,
                  "hf_vaswani_loaded": any(m.startswith("hf_vaswani") for m in sys.modules)}))
"""


def test_remote_code_load_without_hf_vaswani(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=50, d_model=16, d_ff=24, num_heads=2, d_k=4, d_v=12, encoder_layers=2, decoder_layers=2, dropout=0.0
    )
    model = VaswaniForConditionalGeneration(config).eval()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_vaswani.VaswaniForConditionalGeneration"
    assert {"configuration_vaswani.py", "modeling_vaswani.py"} <= set(os.listdir(folder))
    # The shipped files must not reach back into the package.
    for name in ("configuration_vaswani.py", "modeling_vaswani.py"):
        assert "hf_vaswani" not in (folder / name).read_text().replace('"hf_vaswani"', "")

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
    # Tokens compare exactly: each step's candidate scores lie >= 5e-3 apart (measured), 100 times that tolerance.
    assert torch.equal(remote["generated"], local_generated)
