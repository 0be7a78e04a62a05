"""Training as it runs on an accelerator, checked on the CPU by what it must not do: read a tensor's values on the host
(which waits for the device), or break the compiled graph; and by equality with the CPU's chunked loss."""

from dataclasses import replace

import pytest
import torch
from helpers import count_host_reads, take_tensors_as_on_an_accelerator
from tiny import TINY_MODEL, TRAINABLE_MODEL, toy_dataset, toy_tokenizer
from torch import nn
from transformers import DataCollatorForSeq2Seq

from hf_vaswani import UsageError, VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.model import loss_vaswani
from hf_vaswani.model.loss_vaswani import label_smoothed_loss
from hf_vaswani.training.recipe import tokenize_corpus, training_arguments
from hf_vaswani.training.settings import DEMO_SETTINGS
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def trainer_and_batch(tmp_path, tokenizer, **arguments) -> tuple[VaswaniTrainer, dict]:
    """A VaswaniTrainer of the recipe's arguments (and `arguments`), and a padded batch of its collator, labels -100
    where padded."""
    torch.manual_seed(0)
    # no dropout: a compiled graph may draw its masks otherwise
    config = VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL, dropout=0.0)
    model = VaswaniForConditionalGeneration(config)
    tokenized = tokenize_corpus(toy_dataset(), tokenizer)
    arguments = dict(use_cpu=True, disable_tqdm=True, save_strategy="no", max_steps=1) | arguments
    args = paper_training_arguments(tmp_path, **arguments)
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenized,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )
    batch = trainer.data_collator([tokenized[i] for i in range(len(tokenized))])
    assert (batch["labels"] == -100).any() and (batch["attention_mask"] == 0).any()  # padded
    return trainer, batch


def test_a_training_micro_batch_reads_nothing_on_the_host(tmp_path, tokenizer, monkeypatch) -> None:
    trainer, batch = trainer_and_batch(tmp_path, tokenizer)
    tokens = (batch["labels"] != -100).sum()
    take_tensors_as_on_an_accelerator(monkeypatch)
    host_reads = count_host_reads(monkeypatch)
    loss = trainer.training_step(trainer.model, batch, num_items_in_batch=tokens)
    assert dict(host_reads) == {}
    assert torch.isfinite(loss) and all(p.grad is not None for p in trainer.model.parameters() if p.requires_grad)


def test_the_trainer_refuses_ids_outside_the_vocabulary_where_it_collates(tmp_path, tokenizer) -> None:
    trainer, _ = trainer_and_batch(tmp_path, tokenizer)
    features = [{"input_ids": [5, len(tokenizer) + 3, 2], "labels": [7, 2]}]
    with pytest.raises(UsageError, match=rf"input_ids holds id {len(tokenizer) + 3}, outside the vocabulary"):
        trainer.data_collator(features)
    # a separate source vocabulary, larger than the target's: each side checked against its own
    config = VaswaniConfig(
        vocab_size=len(tokenizer), source_vocab_size=len(tokenizer) + 10, share_embeddings=False, **TRAINABLE_MODEL
    )
    model = VaswaniForConditionalGeneration(config)
    args = paper_training_arguments(tmp_path / "separate", use_cpu=True, disable_tqdm=True)
    trainer = VaswaniTrainer(model=model, args=args, data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
    batch = trainer.data_collator(features)
    assert int(batch["input_ids"].max()) == len(tokenizer) + 3
    target_bound = rf"holds id {len(tokenizer) + 3}, outside the vocabulary \[0, {len(tokenizer)}\)"
    with pytest.raises(UsageError, match=rf"decoder_input_ids {target_bound}"):  # the labels shifted right
        trainer.data_collator([{"input_ids": [5, 2], "labels": [len(tokenizer) + 3, 2]}])


def loss_and_gradients(model, hidden, labels, smoothing, tokens=None) -> list[torch.Tensor]:
    hidden = hidden.detach().requires_grad_()
    model.zero_grad()
    loss, nll = label_smoothed_loss(hidden, model.lm_head, labels, smoothing, model.config.pad_token_id, tokens)
    loss.backward()
    return [loss.detach(), nll, hidden.grad, model.lm_head.weight.grad, model.lm_head.bias.grad]


@pytest.mark.parametrize("smoothing", [0.1, 0.0])
def test_the_accelerators_loss_is_the_cpus_chunked_loss_and_torchs(monkeypatch, smoothing) -> None:
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig(**TINY_MODEL, output_bias=True))
    hidden = torch.randn(3, 7, TINY_MODEL["d_model"])
    labels = torch.randint(4, TINY_MODEL["vocab_size"], (3, 7))
    labels[0, 5:], labels[2, 2:] = -100, model.config.pad_token_id  # padding either way
    tokens = torch.tensor(30)  # a count over an accumulated batch, as Trainer passes it
    chunked = loss_and_gradients(model, hidden, labels, smoothing, tokens)
    monkeypatch.setattr(loss_vaswani, "values_wait_for_device", lambda tensor: True)
    at_once = loss_and_gradients(model, hidden, labels, smoothing, tokens)
    # float32 sums of the same terms in another order: a few ulps of the loss, relative
    for ours, theirs in zip(at_once, chunked, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    logits = model.lm_head(hidden).flatten(0, 1)
    counted = labels.flatten().masked_fill(labels.flatten() == model.config.pad_token_id, -100)
    reference = nn.functional.cross_entropy(logits, counted, label_smoothing=smoothing, reduction="sum") / tokens
    torch.testing.assert_close(at_once[0], reference.detach(), rtol=1e-5, atol=1e-6)


def test_forward_and_loss_compile_as_one_graph(tokenizer) -> None:
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL, dropout=0.0))
    batch = DataCollatorForSeq2Seq(tokenizer, model=model)(list(tokenize_corpus(toy_dataset(), tokenizer)))
    tokens = (batch["labels"] != -100).sum()

    def training_loss(batch: dict, tokens: torch.Tensor) -> torch.Tensor:  # as VaswaniTrainer calls the model
        return model(**batch, return_logits=False, smoothing=0.1, num_items_in_batch=tokens).loss

    compiled = torch.compile(training_loss, fullgraph=True, backend="aot_eager")  # a graph break raises here
    loss = compiled(batch, tokens)
    loss.backward()
    compiled_gradients = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager = training_loss(batch, tokens)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(compiled_gradients, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_the_trainer_trains_the_compiled_model_as_the_eager_one(tmp_path, tokenizer) -> None:
    """`--torch-compile` is Trainer's torch_compile; with it VaswaniTrainer's steps log the eager steps' losses."""
    assert training_arguments(replace(DEMO_SETTINGS, torch_compile=True), tmp_path, "fp32").torch_compile
    logged = {}
    for compiled in (False, True):
        # aot_eager: the graphs inductor would compile, run by torch's own kernels (no C++ build in a test)
        options = dict(torch_compile_backend="aot_eager") if compiled else {}
        trainer, _ = trainer_and_batch(
            tmp_path / str(compiled), tokenizer, max_steps=3, logging_steps=1, per_device_train_batch_size=4, **options
        )
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule) == compiled
        logged[compiled] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged[True]) == 3 and logged[True] == pytest.approx(logged[False], rel=1e-5)


@pytest.mark.skipif(not hasattr(nn, "LinearCrossEntropyOptions"), reason="this torch has no linear_cross_entropy")
def test_torchs_fused_linear_cross_entropy_has_no_label_smoothing_yet() -> None:
    """Why the CPU's chunked loss is the package's own (ProjectedLabelSmoothedLoss): torch's fused, chunked
    linear_cross_entropy computes no label-smoothed loss (§5.4); given one it warns and takes all logits at once. When
    this fails, torch has it: use it wherever it measures at least as fast (scripts/benchmark.py)."""
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (5,))
    with pytest.warns(UserWarning, match="options`` ignored; chunked path needs .*label_smoothing == 0"):
        nn.functional.linear_cross_entropy(
            hidden, weight, labels, label_smoothing=0.1, options=nn.LinearCrossEntropyOptions()
        )
