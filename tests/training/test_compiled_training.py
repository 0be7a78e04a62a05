"""Compiled training as it runs on a GPU, checked on the CPU: batches of few shapes (what CUDA graphs are kept for),
one compilation per shape and none beyond, the same losses and gradients as eager; and the GPU defaults."""

import gzip
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from tiny import TRAINABLE_MODEL, toy_tokenizer
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from transformers import DataCollatorForSeq2Seq

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.cli import build_parser, settings_from_args
from hf_vaswani.data.batching import TokenBatchSampler
from hf_vaswani.data.tokenization import train_shared_bpe
from hf_vaswani.gpu_policy import PADDING_MULTIPLE, compile_mode, compiles, pads_batches
from hf_vaswani.training import precision
from hf_vaswani.training.recipe import training_arguments
from hf_vaswani.training.settings import DEMO_SETTINGS
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


def random_pairs(vocab_size: int, count: int, seed: int) -> Dataset:
    """Pairs of random content ids (4 on) ending in </s> (2), of lengths 2 to 30 on each side, loosely correlated as
    a translation's are."""
    generator = random.Random(seed)
    pairs = []
    for _ in range(count):
        source = generator.randint(1, 29)
        target = max(1, min(29, source + generator.randint(-4, 4)))
        pairs.append(
            {
                "input_ids": [generator.randrange(4, vocab_size) for _ in range(source)] + [2],
                "labels": [generator.randrange(4, vocab_size) for _ in range(target)] + [2],
            }
        )
    return Dataset.from_list(pairs)


def compiled_trainer(tmp_path: Path, tokenizer, pairs: Dataset, dropout: float = 0.0) -> VaswaniTrainer:
    """The recipe's trainer compiled (`torch_compile`): its sampler and collator as a compiled run has them."""
    torch.manual_seed(0)
    config = VaswaniConfig(vocab_size=len(tokenizer), **TRAINABLE_MODEL, dropout=dropout)
    model = VaswaniForConditionalGeneration(config)
    args = paper_training_arguments(
        tmp_path, use_cpu=True, disable_tqdm=True, save_strategy="no", max_steps=1, torch_compile=True
    )
    return VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=pairs,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        max_tokens=MAX_TOKENS,
    )


def loss_and_gradients(trainer: VaswaniTrainer, model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    """A training micro-batch as Trainer runs it (its token count a tensor, as Trainer passes it): the loss, then
    every parameter's gradient."""
    trainer.model.zero_grad(set_to_none=True)
    tokens = (batch["labels"] != -100).sum()
    loss = trainer.training_step(model, batch, num_items_in_batch=tokens)
    return [loss] + [parameter.grad.clone() for parameter in trainer.model.parameters()]


def rounded_up(size: int) -> int:
    return -(-size // PADDING_MULTIPLE) * PADDING_MULTIPLE


def test_added_rows_and_padding_change_neither_the_loss_nor_a_gradient(tmp_path, tokenizer) -> None:
    """A batch of the compiled trainer's collator against DataCollatorForSeq2Seq's of the same pairs: rows and lengths
    padded up to the multiple, the rows added all -100 labels, and the same loss and gradients."""
    pairs = random_pairs(len(tokenizer), 40, seed=1)
    trainer = compiled_trainer(tmp_path, tokenizer, pairs)
    plain_collator = DataCollatorForSeq2Seq(tokenizer, model=trainer.model)
    sampler = trainer.get_train_dataloader().base_dataloader.batch_sampler
    features = next(batch for batch in ([pairs[i] for i in rows] for rows in sampler) if len(batch) % PADDING_MULTIPLE)
    bounded, plain = trainer.data_collator(features), plain_collator(features)
    for name in ("input_ids", "attention_mask", "labels", "decoder_input_ids"):
        assert bounded[name].shape == tuple(map(rounded_up, plain[name].shape)), name
    assert bounded["labels"].shape[0] > len(features) and (bounded["labels"][len(features) :] == -100).all()
    results = (loss_and_gradients(trainer, trainer.model, batch) for batch in (bounded, plain))
    for ours, reference in zip(*results, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)


def test_the_compiled_step_compiles_once_for_each_padded_shape_and_computes_the_eager_one(tmp_path, tokenizer) -> None:
    """50 micro-batches from the recipe's sampler and collator through forward, loss and backward compiled as one
    graph (fullgraph, no dynamic shapes, aot_eager): one compilation per batch shape and no other, far fewer than
    batches; and each step's loss and gradients those of the eager model."""
    pairs = random_pairs(len(tokenizer), 600, seed=2)
    trainer = compiled_trainer(tmp_path, tokenizer, pairs)
    compilations = []

    def counted(graph: torch.fx.GraphModule, inputs: list) -> Callable:  # as aot_eager compiles
        compilations.append(graph)
        return make_boxed_func(graph.forward)

    # AOTAutograd's joint trace: a forward graph counted, and its backward graph. Dynamo's recompilation limit counts
    # per code object, and the model's forward shares one with what earlier tests in this process compiled: cleared.
    torch.compiler.reset()
    backend = aot_autograd(fw_compiler=counted, bw_compiler=lambda graph, inputs: make_boxed_func(graph.forward))
    compiled = torch.compile(trainer.model, fullgraph=True, dynamic=False, backend=backend)
    shapes = set()
    for step, batch in zip(range(50), trainer.get_train_dataloader(), strict=False):
        shapes.add((tuple(batch["input_ids"].shape), tuple(batch["labels"].shape)))
        compiled_result = loss_and_gradients(trainer, compiled, batch)
        if step % 10 == 0:  # eager and compiled alike
            for ours, reference in zip(compiled_result, loss_and_gradients(trainer, trainer.model, batch), strict=True):
                torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    assert step == 49 and len(compilations) == len(shapes) <= 10, (step, len(compilations), sorted(shapes))


SCRIPTS = Path(__file__).parents[2] / "scripts"
MULTI30K = Path(__file__).parents[3] / "shared" / "data" / "multi30k"


@pytest.mark.skipif(not MULTI30K.is_dir(), reason="the Multi30k corpus of ../shared is not beside this checkout")
def test_the_published_recipes_batches_take_at_most_64_shapes_in_five_epochs(tmp_path) -> None:
    """scripts/multi30k.sh --recipe published's batches, compiled: its text prepared (lowercased, Moses-tokenized),
    subword-nmt's BPE with 10,000 merges, --max-tokens 3800 and seed 1; every batch shape of five epochs counted."""
    prepared = tmp_path / "prepared"
    subprocess.run([sys.executable, SCRIPTS / "prepare_multi30k.py", MULTI30K, prepared], check=True)
    sides = {}
    for lang in ("en", "de"):
        with gzip.open(prepared / f"train.{lang}.gz", "rt", encoding="utf-8") as lines:
            sides[lang] = [line.rstrip("\n") for line in lines]
    tokenizer = train_shared_bpe(sides["en"] + sides["de"], kind="subword_nmt", merges=10000)
    encoded = tokenizer(sides["en"], text_target=sides["de"])
    lengths = [[len(ids) for ids in encoded[name]] for name in ("input_ids", "labels")]
    sampler = TokenBatchSampler(*lengths, 3800, seed=1)
    shapes = {
        (rounded_up(len(batch)), *(rounded_up(max(side[i] for i in batch)) for side in lengths))
        for epoch in range(5)
        for batch in sampler.all_batches(epoch)
    }
    assert len(shapes) <= 64, len(shapes)


def test_on_a_cuda_gpu_training_is_compiled_and_bf16_by_default(monkeypatch, tmp_path) -> None:
    """With no setting of their own: eager and float32 on the CPU; on a CUDA GPU compiled, captured in CUDA graphs
    with one batch an update, and bf16 where it supports it; --torch-compile and --no-torch-compile, --fp32, say
    otherwise."""
    cpu = training_arguments(DEMO_SETTINGS, tmp_path, precision.training_precision(DEMO_SETTINGS))
    assert DEMO_SETTINGS.torch_compile is None and not cpu.torch_compile and not cpu.bf16
    compiled = replace(DEMO_SETTINGS, torch_compile=True)
    assert training_arguments(compiled, tmp_path, "fp32").torch_compile
    assert training_arguments(compiled, tmp_path, "fp32").torch_compile_mode is None  # no CUDA graphs off CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a CUDA GPU")
    assert precision.training_precision(DEMO_SETTINGS) == "bf16"
    assert compiles(DEMO_SETTINGS.torch_compile)
    assert compile_mode(compiles(DEMO_SETTINGS.torch_compile), DEMO_SETTINGS.update_freq) == "reduce-overhead"
    # captured in CUDA graphs, but not where gradients accumulate over micro-batches, nor where not compiled
    assert compile_mode(True, 2) is None and compile_mode(compiles(False), 1) is None
    # batches padded to the multiple where compiled or on a CUDA GPU, eager or not; on the CPU only where compiled
    assert pads_batches(False, torch.device("cuda")) and pads_batches(True, torch.device("cpu"))
    assert not pads_batches(False, torch.device("cpu"))
    parser = build_parser()
    train = ["train", "--output-dir", str(tmp_path)]
    assert parser.parse_args(train).torch_compile is None
    settings = settings_from_args(parser.parse_args([*train, "--no-torch-compile", "--fp32"]))
    assert settings.torch_compile is False and precision.training_precision(settings) == "fp32"
    assert settings_from_args(parser.parse_args([*train, "--torch-compile"])).torch_compile is True
