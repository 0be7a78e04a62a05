"""Section correctness: on the device, bf16 attention implementations agree, decoding equals the CPU's, compiled and
captured decoding equals eager, and a bf16 training step's loss equals fp32's within bf16's rounding."""

from __future__ import annotations

import copy
import math
import tempfile
from functools import partial
from typing import Any

import torch
from datasets import Dataset
from speed_comparison import EOS, FIRST_WORD, PAD, random_tokens

from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from hf_vaswani.training.trainer import VaswaniTrainer, paper_training_arguments

from .compilation import STATIC_COMPILED, compile_options, compiled_forward
from .run import Run, Section

# bf16 keeps 8 significant bits (7 stored and the implicit one), so one rounding errs by at most u = 2^-8 relative.
# On tensor cores (and in CPU kernels) products accumulate in fp32, so what bf16 adds to a sub-layer is the rounding of
# its inputs and output: O(u). Two implementations of the same bf16 model round in different places (eager attention
# rounds its score matrix to bf16, fused kernels keep it in fp32), and their sub-layer differences, independent, add
# along the residual path like a random walk: sqrt(S) u relative to the logits' norm over S sub-layers (2 per encoder
# layer, 3 per decoder layer, the output projection); both sides carry such an error, hence 2 sqrt(S) u. A wrong mask,
# scale or cache is an O(1) difference. At base size 2 sqrt(31) u = 0.0435; eager and sdpa differ by about 0.01.
BF16_UNIT_ROUNDOFF = 2.0**-8


def bf16_tolerance(config: VaswaniConfig) -> float:
    """The largest relative (Frobenius-norm) difference of two bf16 evaluations of `config`'s model, derived above."""
    sublayers = 2 * config.encoder_layers + 3 * config.decoder_layers + 1
    return 2 * math.sqrt(sublayers) * BF16_UNIT_ROUNDOFF


def body(section: Section) -> None:
    run = section.run
    section.measure("attention implementations, bf16 logits", 30, partial(attention_implementations, run))
    trained: dict[str, VaswaniForConditionalGeneration] = {}

    def train() -> dict[str, Any]:
        trained["model"], outcome = train_reverse_model(run)
        return outcome

    section.measure("reverse task: training until greedy is exact on the CPU", 40, train)
    if "model" in trained:
        model = trained["model"]
        section.measure("reverse task: device decoding = CPU fp32", 20, partial(decoding_matches_cpu, run, model))
        section.measure(
            "reverse task: static cache + compiled = eager", 120, partial(compiled_decoding_matches, run, model)
        )
    section.measure("Trainer step: bf16 loss = fp32 loss", 30, partial(trainer_bf16_step, run))


def relative_difference(value: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / scale.float().norm()).item()


def attention_implementations(run: Run) -> dict[str, Any]:
    """Logits of each attention implementation in bf16 against eager's, on a batch with padded sources."""
    if not run.bf16:
        return {"skipped": "bf16 does not run on this CPU"}
    from transformers.utils import is_flash_attn_2_available

    config = run.model_config(dropout=0.0)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).eval().to(run.device)
    sentences, source_length, target_length = run.sizes.check_batch
    generator = torch.Generator().manual_seed(0)
    source = random_tokens(generator, sentences, source_length, config.vocab_size)
    mask = torch.ones_like(source)
    mask[::2, source_length // 2 :] = 0  # every other sentence half padding
    source[mask == 0] = PAD
    inputs = dict(
        input_ids=source.to(run.device),
        attention_mask=mask.to(run.device),
        decoder_input_ids=random_tokens(generator, sentences, target_length, config.vocab_size).to(run.device),
    )

    def logits(implementation: str) -> torch.Tensor:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            return model(**inputs).logits

    fp32 = logits("eager")
    model.to(torch.bfloat16)
    eager = logits("eager")
    outcome: dict[str, Any] = {
        "tolerance": round(bf16_tolerance(config), 4),
        "eager bf16 vs fp32": round(relative_difference(eager, fp32, fp32), 5),
    }
    for implementation in ("sdpa", "flex_attention", "flash_attention_2"):
        if implementation == "flash_attention_2" and not is_flash_attn_2_available():
            outcome[implementation] = "skipped: flash_attn is not installed"
            continue
        try:
            difference = relative_difference(logits(implementation), eager, fp32)
        except ValueError as error:  # the model does not declare the implementation
            outcome[implementation] = f"skipped: {str(error).split('.')[0]}"
            continue
        outcome[implementation] = round(difference, 5)
        outcome[f"{implementation} within tolerance"] = difference <= outcome["tolerance"]
    return outcome


def reverse_batch(generator: torch.Generator, task: dict[str, Any], sentences: int) -> dict[str, torch.Tensor]:
    """Sentences of random tokens and their reversals (ending in </s>), padded."""
    low, high = task["lengths"]
    source = torch.full((sentences, high + 1), PAD)
    labels = torch.full((sentences, high + 1), -100)
    for row, length in enumerate(torch.randint(low, high + 1, (sentences,), generator=generator).tolist()):
        tokens = torch.randint(FIRST_WORD, task["vocab"], (length,), generator=generator)
        source[row, : length + 1] = torch.cat([tokens, torch.tensor([EOS])])
        labels[row, : length + 1] = torch.cat([tokens.flip(0), torch.tensor([EOS])])
    return {"input_ids": source, "attention_mask": (source != PAD).long(), "labels": labels}


def held_out_reversals(run: Run) -> dict[str, torch.Tensor]:
    return reverse_batch(torch.Generator().manual_seed(1), run.sizes.reverse_task, 32)


def decode(
    model: VaswaniForConditionalGeneration, batch: dict[str, torch.Tensor], beams: int, **options: Any
) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=batch["input_ids"].to(model.device),
            attention_mask=batch["attention_mask"].to(model.device),
            num_beams=beams,
            do_sample=False,
            max_new_tokens=batch["input_ids"].shape[1] + 1,
            **options,
        ).cpu()


def greedy_exact(model: VaswaniForConditionalGeneration, batch: dict[str, torch.Tensor]) -> float:
    """Share of sentences the model reverses exactly, greedy, on the CPU in fp32."""
    cpu_model = copy.deepcopy(model).to("cpu", torch.float32).eval()
    output = decode(cpu_model, batch, beams=1)[:, 1:]  # after the start token
    wanted = batch["labels"].masked_fill(batch["labels"] == -100, PAD)
    width = min(output.shape[1], wanted.shape[1])
    exact = (output[:, :width] == wanted[:, :width]).all(dim=1) & (wanted[:, width:] == PAD).all(dim=1)
    return exact.float().mean().item()


def train_reverse_model(run: Run) -> tuple[VaswaniForConditionalGeneration, dict[str, Any]]:
    """A small model trained on the device to reverse token sequences until its greedy output, on the CPU in fp32, is
    exact on held-out sentences: a confident model, whose decodings should not change with the device or precision."""
    task = run.sizes.reverse_task
    config = VaswaniConfig(
        vocab_size=task["vocab"],
        d_model=task["d_model"],
        d_ff=2 * task["d_model"],
        num_heads=4,
        encoder_layers=task["layers"],
        decoder_layers=task["layers"],
        dropout=0.0,
        label_smoothing=0.0,
    )
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).to(run.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=task["lr"], betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(0)
    held_out = held_out_reversals(run)
    exact, step = 0.0, 0
    while exact < 1.0 and step < task["max_steps"] and run.seconds_left() > 0:
        model.train()
        for _ in range(50):
            batch = {
                name: tensor.to(run.device) for name, tensor in reverse_batch(generator, task, task["batch"]).items()
            }
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step += 50
        exact = greedy_exact(model, held_out)
    return model.eval(), {"steps": step, "greedy exact on CPU": exact}


def decoding_matches_cpu(run: Run, model: VaswaniForConditionalGeneration) -> dict[str, Any]:
    """Greedy and beam-4 outputs on the device, fp32 and bf16, against the CPU's fp32 outputs."""
    held_out = held_out_reversals(run)
    cpu_model = copy.deepcopy(model).to("cpu", torch.float32)
    outcome: dict[str, Any] = {}
    for beams in (1, 4):
        reference = decode(cpu_model, held_out, beams)
        dtypes = (torch.float32, torch.bfloat16) if run.bf16 else (torch.float32,)
        for dtype in dtypes:
            output = decode(copy.deepcopy(model).to(run.device, dtype), held_out, beams)
            name = f"beam {beams} {'fp32' if dtype == torch.float32 else 'bf16'}"
            outcome[f"{name} = CPU fp32"] = output.shape == reference.shape and torch.equal(output, reference)
    return outcome


def compiled_decoding_matches(run: Run, model: VaswaniForConditionalGeneration) -> dict[str, Any]:
    """A static cache and a captured decoding step (on a CPU, a compiled one) against eager decoding with the dynamic
    cache, on the device."""
    held_out = held_out_reversals(run)
    options = compile_options("captured" if run.device.type == "cuda" else "compiled", run.device)
    outcome: dict[str, Any] = {"backend": options["backend"]}
    for dtype, beams in run.sizes.compile_checks:
        if dtype == torch.bfloat16 and not run.bf16:
            continue
        typed = copy.deepcopy(model).to(run.device, dtype)
        eager = decode(typed, held_out, beams)
        with compiled_forward(typed, options):
            compiled = decode(typed, held_out, beams, **STATIC_COMPILED)
        name = f"beam {beams} {'fp32' if dtype == torch.float32 else 'bf16'}"
        outcome[f"{name} equal"] = eager.shape == compiled.shape and torch.equal(eager, compiled)
    return outcome


def trainer_bf16_step(run: Run) -> dict[str, Any]:
    """One step of the recipe's trainer in bf16 mixed precision and in fp32, from the same weights and batch."""
    if not run.bf16:
        return {"skipped": "bf16 does not run on this CPU"}
    config = run.model_config(dropout=0.0)
    sentences, source_length, target_length = run.sizes.check_batch
    generator = torch.Generator().manual_seed(0)
    pairs = Dataset.from_dict(
        {
            "input_ids": random_tokens(generator, sentences, source_length, config.vocab_size).tolist(),
            "labels": random_tokens(generator, sentences, target_length, config.vocab_size).tolist(),
        }
    )
    losses = {}
    with tempfile.TemporaryDirectory() as folder:
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            arguments = paper_training_arguments(
                folder,
                max_steps=1,
                per_device_train_batch_size=sentences,
                bf16=precision == "bf16",
                save_strategy="no",
                logging_strategy="no",
                disable_tqdm=True,
            )
            trainer = VaswaniTrainer(model=VaswaniForConditionalGeneration(config), args=arguments, train_dataset=pairs)
            losses[precision] = trainer.train().training_loss
    tolerance = bf16_tolerance(config)
    difference = abs(losses["bf16"] - losses["fp32"]) / losses["fp32"]
    return {
        "fp32 loss": round(losses["fp32"], 5),
        "bf16 loss": round(losses["bf16"], 5),
        "relative difference": round(difference, 5),
        "tolerance": round(tolerance, 4),  # the loss is a mean of log-softmax values: relative, as the logits
        "within tolerance": difference <= tolerance,
    }
