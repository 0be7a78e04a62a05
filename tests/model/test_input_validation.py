"""Bad values in a model folder, a setting, an input file or an API argument: one line naming the file or argument
(the command exits 2), or a ValueError naming the argument, instead of a traceback or a silent wrong result."""

import codecs
import gzip
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import cpu_offload
from helpers import count_host_reads, refused
from tiny import random_model, save_untrained_folder, write_corpus_files
from transformers.modeling_outputs import BaseModelOutput

import hf_vaswani
import hf_vaswani.cli
import hf_vaswani.decoding.translation
from hf_vaswani import VaswaniConfig
from hf_vaswani.data.corpus import load_jsonl, load_parallel_files, load_tsv
from hf_vaswani.data.tokenization import load_trained_bpe
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.model import modeling_vaswani
from hf_vaswani.model.errors_vaswani import UsageError
from hf_vaswani.model.generation_vaswani import paper_generation_config
from hf_vaswani.text_io import read_sentences
from hf_vaswani.training.averaging import average_checkpoints


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny folder with the paper's decoding in its generation_config.json, as `vaswani train` writes it."""
    folder = save_untrained_folder(tmp_path_factory.mktemp("tiny") / "model")
    paper_generation_config(VaswaniConfig.from_pretrained(folder), max_new_tokens=3).save_pretrained(folder)
    return folder


@pytest.fixture
def folder_copy(tiny_folder, tmp_path) -> Path:
    """A copy of the tiny folder that a test may damage."""
    return Path(shutil.copytree(tiny_folder, tmp_path / "model"))


@pytest.fixture(scope="module")
def loaded(tiny_folder) -> tuple:
    """The tiny folder's model and tokenizer, loaded as the commands load them."""
    return load_model_folder(tiny_folder)


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))  # NaN is written as the token NaN


# 1. A generation config's values, from generation_config.json or given to generate


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("num_beams", 0, "num_beams must be an integer of at least 1, got 0"),  # a ZeroDivisionError in transformers
        ("length_penalty", math.nan, "length_penalty must be a finite number, got nan"),  # every line the same token
        ("length_penalty", math.inf, "length_penalty must be a finite number, got inf"),
        ("max_new_tokens_over_source", -1, "max_new_tokens_over_source must be an integer of at least 0, got -1"),
        ("num_return_sequences", 0, "num_return_sequences must be an integer of at least 1, got 0"),
        ("min_new_tokens", -2, "min_new_tokens must be an integer of at least 0, got -2"),
        ("length_penalty_type", "gnm", "length_penalty_type must be 'gnmt' or 'power', got 'gnm'"),
        ("max_new_tokens", -1, "`max_new_tokens` must be greater than 0, but is -1"),  # transformers' own validate
    ],
)
def test_bad_generation_settings_are_refused_naming_the_file_or_argument(
    folder_copy, loaded, capfd, setting, value, named
) -> None:
    file = folder_copy / "generation_config.json"
    edit_json(file, **{setting: value})
    (folder_copy / "in.txt").write_text("red cat\n")
    refused(capfd, ["translate", str(folder_copy), "--input", str(folder_copy / "in.txt")], f"{file}: {named}")
    model, tokenizer = loaded
    with pytest.raises(ValueError, match=f"^{setting}|`{setting}`"):
        model.generate(tokenizer(["red cat"], return_tensors="pt").input_ids, **{setting: value})


def test_a_damaged_generation_config_is_refused_and_settings_that_are_merely_unused_are_not(folder_copy, capfd) -> None:
    # what `vaswani train --num-beams 1` writes: a length penalty and early stopping that one beam does not use
    edit_json(folder_copy / "generation_config.json", num_beams=1)
    model, _ = load_model_folder(folder_copy)
    assert (model.generation_config.num_beams, model.generation_config.length_penalty) == (1, 0.6)
    # transformers alone would decode with defaults built from config.json instead
    (folder_copy / "generation_config.json").write_text("{")
    refused(capfd, ["translate", str(folder_copy)], f"{folder_copy / 'generation_config.json'} is not valid JSON")
    (folder_copy / "generation_config.json").unlink()  # no file at all: transformers' defaults, as before
    assert load_model_folder(folder_copy)[0].generation_config.num_beams in (None, 1)  # None: one beam


def test_bad_config_values_are_refused_naming_the_file(folder_copy, capfd) -> None:
    edit_json(folder_copy / "config.json", dropout=math.nan)
    refused(capfd, ["translate", str(folder_copy)], f"{folder_copy / 'config.json'}: dropout must be a finite number")
    edit_json(folder_copy / "config.json", dropout=0.0, d_model="wide")  # a type error of strict, no ValueError
    refused(capfd, ["translate", str(folder_copy)], f"{folder_copy / 'config.json'}: ", "d_model")


# 2. A tokenizer.json that tokenizers cannot read


def test_a_malformed_tokenizer_is_refused_naming_the_file(folder_copy, capfd) -> None:
    file = folder_copy / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    tokenizer["model"]["merges"][0] = 5  # neither "a b" nor ["a", "b"]
    file.write_text(json.dumps(tokenizer))
    refused(capfd, ["translate", str(folder_copy)], f"{file} is not a tokenizer tokenizers can read", "MergeType")
    with pytest.raises(ValueError, match=f"^{file} is not a tokenizer tokenizers can read"):
        load_trained_bpe(folder_copy)  # how a resumed run reads its tokenizer/


# 3. Float settings of `vaswani train`: NaN passes `value <= 0`, so each is refused before anything is written


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--learning-rate-scale", "nan"], "--learning-rate-scale must be positive and finite, got nan"),
        (["--learning-rate-scale", "inf"], "--learning-rate-scale must be positive and finite, got inf"),
        (["--max-train-minutes", "nan"], "--max-train-minutes must be positive and finite, got nan"),
        (["--length-penalty", "nan"], "--length-penalty must be a finite number, got nan"),
        (["--length-penalty=-inf"], "--length-penalty must be a finite number, got -inf"),
        (["--bpe-dropout", "nan"], "--bpe-dropout must be in (0, 1), got nan"),
        (["--label-smoothing", "nan"], "--label-smoothing must be in [0, 1), got nan"),
        (["--model-override", "dropout=NaN"], "dropout must be a finite number, got nan"),
        (["--model-override", "attention_dropout=Infinity"], "attention_dropout must be a finite number, got inf"),
    ],
)
def test_non_finite_settings_are_refused_before_anything_is_written(tmp_path, capsys, options, named) -> None:
    output_dir = tmp_path / "run"
    refused(capsys, ["train", "--output-dir", str(output_dir), *write_corpus_files(tmp_path), *options], named)
    assert not output_dir.exists()  # no run.json, tokenizer/ or checkpoints/ that would block a plain re-run


# 4. A UTF-8 byte-order mark at the start of an input is no part of its first line


def with_bom(lines: list[str]) -> bytes:
    return codecs.BOM_UTF8 + "".join(line + "\n" for line in lines).encode()


def test_a_byte_order_mark_is_dropped_from_every_text_input(tiny_folder, tmp_path, monkeypatch) -> None:
    lines = ["red cat", "blue dog"]
    expected = with_bom(lines).decode("utf-8-sig").split("\n")[:-1]  # Python's own reading of such a file
    assert expected == lines
    assert read_sentences(io.BytesIO(with_bom(lines)), "input") == expected

    translated = []

    def translate(translator, sentences: list[str], **options) -> list[str]:
        translated.append(sentences)
        return sentences

    monkeypatch.setattr(hf_vaswani.decoding.translation.Translator, "translate", translate)
    (tmp_path / "in.txt").write_bytes(with_bom(lines))
    hf_vaswani.cli.main(["translate", str(tiny_folder), "--input", str(tmp_path / "in.txt")])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(with_bom(lines))))
    hf_vaswani.cli.main(["translate", str(tiny_folder)])
    assert translated == [expected, expected]

    (tmp_path / "train.en").write_bytes(with_bom(lines))
    (tmp_path / "train.de").write_bytes(with_bom(lines))
    (tmp_path / "train.tsv.gz").write_bytes(gzip.compress(with_bom([f"{line}\t{line}" for line in lines])))
    records = [json.dumps({"source": line, "target": line}) for line in lines]
    (tmp_path / "train.jsonl").write_bytes(with_bom(records))
    for split in (
        load_parallel_files(tmp_path / "train.en", tmp_path / "train.de"),
        load_tsv(tmp_path / "train.tsv.gz"),
        load_jsonl(tmp_path / "train.jsonl"),
    ):
        assert split["source"] == expected and split["target"] == expected


# 5. API arguments of the wrong kind


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (
            lambda model: model.generate(torch.zeros(1, 0, dtype=torch.long)),
            r"input_ids holds no token: shape \(1, 0\)",
        ),
        (lambda model: model.generate(torch.tensor([[5.0, 6.0, 2.0]])), r"input_ids must be a tensor of token ids"),
        (lambda model: model.generate([[5, 6, 2]]), r"input_ids must be a tensor of shape \(batch, length\), got list"),
        (lambda model: model.generate(torch.tensor([5, 6, 2])), r"input_ids must be .* got shape \(3,\)"),
        (
            lambda model: model.generate(inputs_embeds=torch.randn(1, 3, model.config.d_model, dtype=torch.float64)),
            r"inputs_embeds has dtype torch.float64, the model torch.float32",
        ),
        (
            lambda model: model(
                inputs_embeds=torch.randn(1, 3, model.config.d_model, dtype=torch.float64),
                decoder_input_ids=torch.tensor([[1]]),
            ),
            r"inputs_embeds has dtype torch.float64",
        ),
        (
            lambda model: model(input_ids=torch.tensor([5, 6, 2]), decoder_input_ids=torch.tensor([[1]])),
            r"input_ids must be a tensor of shape \(batch, length\), got shape \(3,\)",
        ),
        (
            lambda model: model(input_ids=[[5, 6, 2]], decoder_input_ids=torch.tensor([[1]])),
            r"input_ids must be .* got list",
        ),
    ],
)
def test_model_inputs_of_the_wrong_kind_are_refused_naming_the_argument(loaded, call, named) -> None:
    with pytest.raises(ValueError, match=named):
        call(loaded[0])


def test_one_checkpoint_path_instead_of_a_list_is_refused(tiny_folder, tmp_path) -> None:
    with pytest.raises(ValueError, match="checkpoints must be a list of checkpoint folders, not one path"):
        average_checkpoints(str(tiny_folder), tmp_path / "averaged")
    assert not (tmp_path / "averaged").exists()


@pytest.mark.parametrize("name", ["past_key_value", "decoder_attention_masks", "labels_smoothing"])
def test_an_argument_the_model_does_not_take_is_refused_not_swallowed(name: str) -> None:
    """forward takes transformers' keyword arguments (TransformersKwargs) on top of its own; a misspelt one would
    otherwise vanish into them, and the call run as if it were not given."""
    from tiny import random_model

    model = random_model(0)
    ids = torch.tensor([[5, 6, 2]])
    with pytest.raises(ValueError, match=f"the model takes no argument {name}"):
        model(input_ids=ids, decoder_input_ids=ids, **{name: None})
    with pytest.raises(ValueError, match=f"the model takes no argument {name}"):
        model.generate(ids, max_new_tokens=2, **{name: None})


# 6. Inputs on another device than the weights


def inputs_with_one_on_meta(model, name: str) -> dict:
    """Inputs of a forward call on the model's device, but `name` on the meta device. Labels only where they are the
    input on meta: on the CPU their ids are read (check_token_ids)."""
    ids = torch.tensor([[5, 6, 2]])
    embeds = torch.randn(1, 3, model.config.d_model)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids, labels=ids)
    inputs |= dict(decoder_attention_mask=torch.ones_like(ids))
    if name != "labels":
        del inputs["labels"]
    if name.endswith("inputs_embeds"):  # in place of the ids of its side
        del inputs[name.replace("inputs_embeds", "input_ids")]
        inputs[name] = embeds
    if name == "encoder_outputs":
        del inputs["input_ids"]
        inputs[name] = BaseModelOutput(last_hidden_state=embeds.to("meta"))
    else:
        inputs[name] = inputs[name].to("meta")
    return inputs


@pytest.mark.parametrize(
    "name",
    [
        "input_ids",
        "attention_mask",
        "inputs_embeds",
        "encoder_outputs",
        "decoder_input_ids",
        "decoder_attention_mask",
        "decoder_inputs_embeds",
        "labels",
    ],
)
def test_an_input_on_another_device_than_the_weights_is_refused_before_the_embedding(name, monkeypatch) -> None:
    """Ids on the meta device, the weights on the CPU, came out as CPU logits, a third of them NaN and the rest
    garbage. The check compares devices: it reads no value on the host (on an accelerator, a wait for the device)."""
    model = random_model(0)
    inputs = inputs_with_one_on_meta(model, name)

    def embedded(*args, **kwargs):
        raise AssertionError("the inputs were embedded")

    monkeypatch.setattr(modeling_vaswani.VaswaniEmbeddings, "forward", embedded)
    reads = count_host_reads(monkeypatch)
    with pytest.raises(UsageError, match=f"^{name} is on meta, the model's weights on cpu: move it to model.device$"):
        model(**inputs)
    assert reads == {}


def test_generate_refuses_a_source_on_another_device_than_the_weights(monkeypatch) -> None:
    model = random_model(0)
    monkeypatch.setattr(modeling_vaswani.VaswaniEmbeddings, "forward", None)  # an embedding would be a TypeError
    for source in (
        dict(input_ids=torch.tensor([[5, 6, 2]], device="meta")),
        dict(inputs_embeds=torch.randn(1, 3, model.config.d_model, device="meta")),
    ):
        with pytest.raises(UsageError, match="is on meta, the model's weights on cpu"):
            model.generate(**source, max_new_tokens=2)
    with pytest.raises(UsageError, match="^input_ids is on meta, the model's weights on cpu"):
        hf_vaswani.generate(model, torch.tensor([[5, 6, 2]], device="meta"), max_new_tokens=2)
    with pytest.raises(UsageError, match="^attention_mask is on meta"):
        model.generate(torch.tensor([[5, 6, 2]]), attention_mask=torch.ones(1, 3, device="meta"), max_new_tokens=2)


def test_weights_offloaded_by_accelerate_take_inputs_on_its_execution_device() -> None:
    """accelerate's offloading keeps the weights on the meta device until its hooks bring them, and the inputs, to the
    execution device: inputs there are the model's, and give the logits of the model before offloading."""
    model = random_model(0).eval()
    ids = torch.tensor([[5, 6, 2]])
    with torch.no_grad():
        expected = model(input_ids=ids, decoder_input_ids=ids).logits
        cpu_offload(model, execution_device="cpu")
        assert model.get_input_embeddings().weight.device.type == "meta"
        torch.testing.assert_close(model(input_ids=ids, decoder_input_ids=ids).logits, expected, rtol=0, atol=0)
