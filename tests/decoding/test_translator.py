"""The decoding engine (decoding/translation.py's `Translator`): shared by threads, each call gets what it gets alone;
closed, it frees what it held and refuses use; built from a folder, it translates as `vaswani translate` does."""

import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import padded_batch, sharpened, take_tensors_as_on_an_accelerator
from tiny import PROBE_SENTENCES, TINY_MODEL, random_model

from hf_vaswani import Translator, UsageError, generate
from hf_vaswani.cli import main
from hf_vaswani.kernels import cpu as cpu_kernels
from hf_vaswani.kernels.cpu import PACKED_KERNELS, kernelize
from hf_vaswani.kernels.cpu_features import cpu_float_type_problem
from hf_vaswani.kernels.quantization import quantize_int8

EOS = 2
THREADS, CALLS = 8, 50
PRECISIONS = {
    "fp32": lambda model: model,
    "bf16": lambda model: model.to(torch.bfloat16),
    "int8": quantize_int8,
}


def calls_of_many_shapes(vocab_size: int) -> list[dict]:
    """CALLS generate calls: batches of 1-3 sources of 2-8 tokens, beam 1-3, each with its scores."""
    calls = []
    for i in range(CALLS):
        lengths = [2 + (i + j) % 7 for j in range(1 + i % 3)]
        source, mask = padded_batch(vocab_size, lengths, seed=i, eos_token_id=EOS)
        beams = 1 + i % 3
        calls.append(
            dict(
                input_ids=source,
                attention_mask=mask,
                num_beams=beams,
                max_new_tokens=8,
                output_scores=True,
                return_dict_in_generate=True,
                num_return_sequences=1 if beams == 1 else 2,
            )
        )
    return calls


def assert_same_output(got, expected) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    if expected.get("sequences_scores") is not None:
        assert torch.equal(got.sequences_scores, expected.sequences_scores)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))


def packed_however_fast(monkeypatch) -> None:
    """Float weights packed by the first packed kernel that takes their type, whatever this CPU measures."""

    def first_kernel(in_features: int, out_features: int, threads: int, dtype: torch.dtype) -> str | None:
        return next((name for name, kernel in PACKED_KERNELS.items() if kernel.available(dtype)), None)

    monkeypatch.setattr(cpu_kernels, "fastest_packed_kernel", first_kernel)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("through", ["one engine", "hf_vaswani.generate on one model"])
def test_threads_decoding_at_once_each_get_the_sequential_output(precision: str, through: str, monkeypatch) -> None:
    """8 threads x 50 calls at once, each call's tokens and scores equal to those of the same call made alone: no call
    sees or disturbs another's packed weights, caches or kernel choices."""
    if precision == "bf16" and cpu_float_type_problem(torch.bfloat16):
        pytest.skip(f"bf16 on this CPU: {cpu_float_type_problem(torch.bfloat16)}")
    packed_however_fast(monkeypatch)
    model = PRECISIONS[precision](sharpened(kernelize(random_model(0, TINY_MODEL))))
    calls = calls_of_many_shapes(model.config.vocab_size)
    translator = Translator(model)
    decode = translator.generate if through == "one engine" else lambda **call: generate(model, **call)
    with torch.inference_mode():
        sequential = [decode(**call) for call in calls]

        def run_all(_: int) -> list:
            return [decode(**call) for call in calls]

        with ThreadPoolExecutor(THREADS) as pool:
            concurrent = list(pool.map(run_all, range(THREADS)))
    for outputs in concurrent:
        for got, expected in zip(outputs, sequential, strict=True):
            assert_same_output(got, expected)


def test_threads_translating_through_one_engine_get_the_sequential_translations(trained_folder) -> None:
    """The tokenizer too is shared: its calls take turns."""
    translator = Translator(trained_folder)
    alone = translator.translate(PROBE_SENTENCES, batch_size=4)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda _: translator.translate(PROBE_SENTENCES, batch_size=4), range(4)))
    assert together == [alone] * 4


def test_translating_leaves_the_tokenizer_as_it_saves(trained_folder, tmp_path) -> None:
    """A padded batch's padding stays off the tokenizer, so a checkpoint saved after validation BLEU holds the
    tokenizer.json of one saved before it."""
    with Translator(trained_folder) as translator:
        translator.tokenizer.backend_tokenizer.no_padding()  # the folder's holds the padding of its training batches
        translator.tokenizer.save_pretrained(tmp_path / "before")
        translator.translate(PROBE_SENTENCES, batch_size=4)
        translator.tokenizer.save_pretrained(tmp_path / "after")
    before, after = ((tmp_path / folder / "tokenizer.json").read_text() for folder in ("before", "after"))
    assert after == before


def test_a_closed_engine_frees_its_packed_weights_and_caches_and_refuses_use(monkeypatch) -> None:
    """On the (emulated) accelerator path the engine holds a compiled step and a spare static cache, on the CPU path
    packed weights: after close() nothing references them, and the next call is refused in one line."""
    packed_however_fast(monkeypatch)
    model = sharpened(kernelize(random_model(0, TINY_MODEL)))
    source, mask = padded_batch(model.config.vocab_size, [5, 3], seed=0, eos_token_id=EOS)
    with Translator(model) as translator:
        translator.generate(source, attention_mask=mask, max_new_tokens=4)
        packed = [weakref.ref(copy.weight) for copy in translator._packed.values()]
    gc.collect()
    assert packed and all(ref() is None for ref in packed)
    take_tensors_as_on_an_accelerator(monkeypatch)
    translator = Translator(model, compile=True)
    translator.generate(source, attention_mask=mask, max_new_tokens=4)
    (state,) = translator._states
    caches = [weakref.ref(layer.keys) for cache in state.spare_static_caches.values() for layer in cache.layers]
    steps = [weakref.ref(step) for step in state.steps.values()]
    assert caches and steps
    translator.close()
    gc.collect()
    assert all(ref() is None for ref in caches + steps)
    with pytest.raises(UsageError, match="this Translator is closed") as refused:
        translator.generate(source, attention_mask=mask, max_new_tokens=4)
    assert "\n" not in str(refused.value)


def test_an_engine_of_a_folder_translates_as_vaswani_translate(trained_folder, tmp_path) -> None:
    source = tmp_path / "source.txt"
    source.write_text("\n".join(PROBE_SENTENCES) + "\n")
    main(["translate", str(trained_folder), "--input", str(source), "--output", str(tmp_path / "out.txt")])
    with Translator(trained_folder) as translator:
        assert translator.translate(PROBE_SENTENCES) == (tmp_path / "out.txt").read_text().splitlines()


def test_a_model_is_used_as_it_is_and_folder_options_are_refused_with_it() -> None:
    model = kernelize(random_model(0, TINY_MODEL))
    with pytest.raises(UsageError, match="apply to a model folder"):
        Translator(model, dtype="bf16")
    with pytest.raises(UsageError, match="no tokenizer"):
        Translator(model).translate(["a b"])
