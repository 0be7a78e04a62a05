"""PEFT's LoRA on the model, with the target modules docs/training.md names: it fine-tunes only the adapter, the saved
adapter reloads to the same outputs, and merging it gives the package's model class computing what the adapter did."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, PeftModelForSeq2SeqLM, get_peft_model
from peft.tuners.lora import LoraLayer
from test_docs import ROOT, fenced_blocks
from tiny import PROBE_SENTENCES, capitalised_pairs
from transformers import AutoTokenizer

from hf_vaswani import VaswaniForConditionalGeneration, save_model_folder

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
FEED_FORWARD = ("fc1", "fc2")


def documented_lora() -> str:
    """docs/training.md's Python that puts LoRA on `model`."""
    blocks = [block.text for language, block in fenced_blocks(ROOT / "docs" / "training.md") if language == "python"]
    (lora,) = [text for text in blocks if "LoraConfig" in text]
    return lora


def with_documented_lora(model: VaswaniForConditionalGeneration) -> PeftModelForSeq2SeqLM:
    namespace = {"model": model}
    exec(compile(documented_lora(), "docs/training.md", "exec"), namespace)
    return namespace["model"]


def with_all_linear_lora(model: VaswaniForConditionalGeneration) -> PeftModelForSeq2SeqLM:
    return get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules="all-linear"))


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def test_peft_has_no_default_target_modules_for_this_model(trained_folder) -> None:
    """What docs/training.md says: without target_modules, PEFT stops, naming them."""
    model = VaswaniForConditionalGeneration.from_pretrained(trained_folder)
    with pytest.raises(ValueError, match="target_modules"):
        get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM"))


@pytest.mark.parametrize(
    ("add_lora", "adapted"),
    [(with_documented_lora, ATTENTION_PROJECTIONS), (with_all_linear_lora, ATTENTION_PROJECTIONS + FEED_FORWARD)],
    ids=["documented", "all-linear"],
)
def test_lora_fine_tunes_reloads_and_merges(trained_folder, tmp_path: Path, add_lora, adapted) -> None:
    tokenizer = AutoTokenizer.from_pretrained(trained_folder)
    base = VaswaniForConditionalGeneration.from_pretrained(trained_folder).eval()
    sources = PROBE_SENTENCES[:8]
    batch = tokenizer(sources, text_target=[source.upper() for source in sources], return_tensors="pt", padding=True)
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    base_logits = logits(base, batch)
    linear_layers = {name for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)}

    model = add_lora(base)
    assert isinstance(model, PeftModelForSeq2SeqLM)
    lora_layers = {name for name, module in model.base_model.model.named_modules() if isinstance(module, LoraLayer)}
    assert lora_layers == {name for name in linear_layers if name.endswith(adapted)}  # never the output projection
    frozen = {name: weight.clone() for name, weight in model.named_parameters() if not weight.requires_grad}
    trainable = [weight for weight in model.parameters() if weight.requires_grad]
    assert all("lora_" in name for name, weight in model.named_parameters() if weight.requires_grad)

    # A fine-tune on more of the capitalisation task: a few steps, enough to move the adapter off its zero start.
    optimizer = torch.optim.Adam(trainable, lr=1e-3)
    pairs = capitalised_pairs(32 * 10, seed=2)
    model.train()
    for step in range(10):
        chunk = pairs[32 * step : 32 * (step + 1)]
        inputs = tokenizer([s for s, _ in chunk], text_target=[t for _, t in chunk], return_tensors="pt", padding=True)
        inputs["labels"] = inputs["labels"].masked_fill(inputs["labels"] == tokenizer.pad_token_id, -100)
        loss = model(**inputs).loss
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    for name, weight in model.named_parameters():
        if name in frozen:
            assert torch.equal(weight, frozen[name]), f"{name} is not LoRA's, yet it trained"
    adapter_logits = logits(model, batch)
    # Merging only rounds differently: each logit ends a chain of ~33 dot products of length <= 128 (6 in each encoder
    # layer, 10 in each decoder layer, the output projection), with layer norms keeping activations at unit scale in
    # between, each off by ~sqrt(128) eps of its scale: ~400 eps of the logits' scale. A merge that is wrong, or
    # missing, is off by the adapter's whole change, which the first check makes far larger.
    tolerance = 400 * torch.finfo(torch.float32).eps * adapter_logits.abs().max().item()
    assert (adapter_logits - base_logits).abs().max() > 10 * tolerance, "the fine-tune left the adapter at zero"

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        VaswaniForConditionalGeneration.from_pretrained(trained_folder), tmp_path / "adapter"
    ).eval()
    assert torch.equal(logits(reloaded, batch), adapter_logits)
    generation = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8)
    adapter_greedy = reloaded.generate(**generation, num_beams=1)
    adapter_beam = reloaded.generate(**generation)  # the paper's decoding, the model's generation config

    merged = reloaded.merge_and_unload()
    assert type(merged) is VaswaniForConditionalGeneration
    assert not any(isinstance(module, LoraLayer) for module in merged.modules())
    torch.testing.assert_close(logits(merged, batch), adapter_logits, atol=tolerance, rtol=0)
    # Tokens compare exactly: the trained model's candidates lie far more than that tolerance apart.
    assert torch.equal(merged.generate(**generation, num_beams=1), adapter_greedy)
    assert torch.equal(merged.generate(**generation), adapter_beam)

    save_model_folder(merged, tokenizer, tmp_path / "merged")
    saved = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(saved.generate(**generation, num_beams=1), adapter_greedy)
