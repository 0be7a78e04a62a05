"""transformers' run_translation.py on a model folder, as docs/training.md runs it: the page's commands, the script's
flow in this process with its own pieces (the options parsed from the page), and the fine-tuned folder reloaded where
hf_vaswani cannot be imported."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import evaluate
import numpy as np
import pytest
import sacrebleu
import torch
from datasets import load_dataset
from helpers import run_translation_options, run_without_hf_vaswani
from test_docs import ROOT, example_script_arguments, fenced_blocks, shell_lines
from tiny import PROBE_SENTENCES, capitalised_pairs
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
)

RELOADER = """
import json, sys

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

folder, num_beams, max_length, *sources = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    generated = model.generate(**tokenizer(sources, return_tensors="pt", padding=True), num_beams=int(num_beams),
                               max_length=int(max_length))
print(json.dumps({"model_module": type(model).__module__,
                  "translations": tokenizer.batch_decode(generated, skip_special_tokens=True),
                  "hf_vaswani_loaded": any(m.startswith("hf_vaswani") for m in sys.modules)}))
"""
# run_translation.py's default --max_target_length, which it also passes to evaluate and predict as max_length
MAX_TARGET_LENGTH = 128


def documented_commands() -> tuple[list[str], list[str]]:
    """docs/training.md's shell block that runs the script: (the lines before it, the script's arguments)."""
    for language, block in fenced_blocks(ROOT / "docs" / "training.md"):
        lines = [line.text for line in shell_lines(block)] if language == "bash" else []
        runs = [index for index, line in enumerate(lines) if example_script_arguments(line) is not None]
        if runs and "sacrebleu" in block.text:
            return lines[: runs[0]], example_script_arguments(lines[runs[0]])
    raise AssertionError("docs/training.md has no shell block that sets up sacreBLEU and runs run_translation.py")


def write_json_lines(path: Path, pairs: list[tuple[str, str]], source_lang: str, target_lang: str) -> None:
    records = [{"translation": {source_lang: source, target_lang: target}} for source, target in pairs]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_run_translation_flow_fine_tunes_evaluates_predicts_and_reloads(
    trained_folder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup, arguments = documented_commands()
    monkeypatch.chdir(tmp_path)  # the page's commands name their files relative to where they run
    # The page's set-up lines, by the shell, with this interpreter as `python`.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(["bash", "-c", "set -e\n" + "\n".join(setup)], env={**os.environ, "PATH": path}, check=True)

    training_args, options = run_translation_options(arguments)
    assert training_args.predict_with_generate and training_args.do_train and training_args.do_predict
    assert options["trust_remote_code"] == "True"
    source_lang, target_lang = options["source_lang"], options["target_lang"]
    shutil.copytree(trained_folder, options["model_name_or_path"])
    held_out = set(PROBE_SENTENCES)
    train = [pair for pair in capitalised_pairs(200, seed=3) if pair[0] not in held_out][:64]
    tests = [(source, source.upper()) for source in PROBE_SENTENCES[:8]]  # what the trained fixture translates right
    for option, pairs in (("train_file", train), ("validation_file", tests), ("test_file", tests)):
        write_json_lines(Path(options[option]), pairs, source_lang, target_lang)

    # The script's flow, step by step, with its calls.
    folder, trust_remote_code = options["model_name_or_path"], True
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, config=config, trust_remote_code=trust_remote_code)
    files = {"train": options["train_file"], "validation": options["validation_file"], "test": options["test_file"]}
    raw_datasets = load_dataset("json", data_files=files)

    def preprocess_function(examples: dict) -> dict:
        inputs = [example[source_lang] for example in examples["translation"]]
        targets = [example[target_lang] for example in examples["translation"]]
        model_inputs = tokenizer(inputs, max_length=1024, truncation=True)
        labels = tokenizer(text_target=targets, max_length=MAX_TARGET_LENGTH, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    tokenized = {
        split: raw_datasets[split].map(preprocess_function, batched=True, remove_columns=["translation"])
        for split in files
    }
    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    metric = evaluate.load("sacrebleu")  # offline: the copy the page's set-up made in the working directory
    assert type(metric).__name__ == "SacrebleuLocal"

    def compute_metrics(eval_preds) -> dict:
        preds, labels = eval_preds
        if isinstance(preds, tuple):
            preds = preds[0]
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        decoded_preds = [pred.strip() for pred in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_labels = [[label.strip()] for label in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        result = {"bleu": metric.compute(predictions=decoded_preds, references=decoded_labels)["score"]}
        result["gen_len"] = np.mean([np.count_nonzero(pred != tokenizer.pad_token_id) for pred in preds])
        return {key: round(value, 4) for key, value in result.items()}

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )
    train_result = trainer.train()
    trainer.save_model()
    assert train_result.global_step > 0 and math.isfinite(train_result.training_loss)
    num_beams = int(options["num_beams"])
    evaluation = trainer.evaluate(max_length=MAX_TARGET_LENGTH, num_beams=num_beams, metric_key_prefix="eval")
    predicted = trainer.predict(
        tokenized["test"], metric_key_prefix="predict", max_length=MAX_TARGET_LENGTH, num_beams=num_beams
    )
    predictions = np.where(predicted.predictions != -100, predicted.predictions, tokenizer.pad_token_id)
    translations = [text.strip() for text in tokenizer.batch_decode(predictions, skip_special_tokens=True)]

    # Beam search through the Trainer is the model's own; its BLEU is sacreBLEU's.
    sources, references = [source for source, _ in tests], [target for _, target in tests]
    model.eval()
    with torch.no_grad():
        generated = model.generate(
            **tokenizer(sources, return_tensors="pt", padding=True), num_beams=num_beams, max_length=MAX_TARGET_LENGTH
        )
    assert translations == tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert translations == references  # the trained fixture's task, kept through a short fine-tune
    bleu = round(sacrebleu.corpus_bleu(translations, [references]).score, 4)
    assert predicted.metrics["predict_bleu"] == bleu and evaluation["eval_bleu"] == bleu

    # The fine-tuned folder, where the package cannot be imported.
    output_dir = Path(training_args.output_dir).resolve()
    report = run_without_hf_vaswani(
        RELOADER, [str(output_dir), str(num_beams), str(MAX_TARGET_LENGTH), *sources], tmp_path
    )
    assert report["model_module"].startswith("transformers_modules") and report["hf_vaswani_loaded"] is False
    assert report["translations"] == translations
