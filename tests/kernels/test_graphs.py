"""The package loop's decoding step as it runs on an accelerator, compiled whole (kernels/graphs.py), checked on the
CPU: one compilation for a call's shapes and none across its steps, the eager loop's tokens, each model's steps
compiled on their own, and a step that dynamo runs eagerly named in a warning."""

import warnings
from collections.abc import Callable

import pytest
import torch
from helpers import padded_batch, sharpened, take_tensors_as_on_an_accelerator
from tiny import TINY_MODEL, random_model
from transformers.cache_utils import StaticCache

from hf_vaswani import Translator
from hf_vaswani.decoding import search
from hf_vaswani.decoding.search import SearchState, covered_request, decode
from hf_vaswani.kernels.cpu import kernelize
from hf_vaswani.model.generation_vaswani import paper_generation_config

EOS = 2
CALLS = {
    "greedy": dict(num_beams=1, max_new_tokens=12),
    "beam 4": dict(num_beams=4, max_new_tokens=12, num_return_sequences=2),
    "beam 4, minimum length": dict(num_beams=4, max_new_tokens=10, min_new_tokens=10),
}


def eager_state() -> SearchState:
    return SearchState("eager", compile=False)


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_calls_steps_replay_one_compiled_graph_and_decode_the_eager_tokens(monkeypatch, call: dict) -> None:
    """fullgraph, no dynamic shapes: a recompilation at any step (a host read, a length read as a number, a guard on
    the step) would show as a second graph. The eager loop (the CPU's growing cache) gives the same tokens."""
    model = sharpened(kernelize(random_model(0, TINY_MODEL)))
    model.generation_config = paper_generation_config(model.config)
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=3, eos_token_id=EOS)
    eager = decode([model], covered_request(model, source, None, {"attention_mask": mask, **call}), [eager_state()])
    graphs = []

    def counted(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    take_tensors_as_on_an_accelerator(monkeypatch, step_backend=counted)
    state = SearchState("compiled", compile=True)
    request = covered_request(model, source, None, {"attention_mask": mask, **call})
    captured = decode([model], request, [state])
    eager_tokens = eager if isinstance(eager, torch.Tensor) else eager.sequences
    assert torch.equal(captured if isinstance(captured, torch.Tensor) else captured.sequences, eager_tokens)
    assert eager_tokens.shape[1] > 3 and len(graphs) == 1  # several compiled steps, one graph
    decode([model], request, [state])
    assert len(graphs) == 1  # a call of the same shapes compiles nothing


def test_the_next_call_of_a_shape_reuses_its_static_cache_but_never_one_returned(monkeypatch) -> None:
    """A captured step reads the cache at the addresses it was recorded with: the second call of a shape decodes into
    the first one's cache, emptied, and gives the eager loop's tokens. A cache returned with the output is the
    caller's: a later call leaves it as it was."""
    model = sharpened(kernelize(random_model(0, TINY_MODEL)))
    model.generation_config = paper_generation_config(model.config)
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=3, eos_token_id=EOS)
    call = {"attention_mask": mask, **CALLS["beam 4"]}
    eager = decode([model], covered_request(model, source, None, call), [eager_state()])
    take_tensors_as_on_an_accelerator(monkeypatch)
    made = []

    class CountedStaticCache(StaticCache):
        def __init__(self, **options) -> None:
            made.append(self)
            super().__init__(**options)

    monkeypatch.setattr(search, "StaticCache", CountedStaticCache)
    state = SearchState("compiled", compile=True)
    returned = decode([model], covered_request(model, source, None, {**call, "return_dict_in_generate": True}), [state])
    kept_keys = [layer.keys.clone() for layer in returned.cache.self_attention_cache.layers]
    outputs = [decode([model], covered_request(model, source, None, call), [state]) for _ in range(3)]
    assert len(made) == 2  # the returned one, then one for the three calls
    assert all(torch.equal(output, eager) for output in outputs) and torch.equal(returned.sequences, eager)
    for layer, keys in zip(returned.cache.self_attention_cache.layers, kept_keys, strict=True):
        assert torch.equal(layer.keys, keys)


MODELS = 10  # more than dynamo's recompile_limit (8) of one code object


def test_ten_models_of_ten_sizes_in_one_process_each_decode_by_compiled_steps(monkeypatch) -> None:
    """Each engine's step compiles on a code object of its own: the tenth model's steps still compile (one graph
    each, its shapes), no step falls back to eager (which would warn), and each model's tokens are its eager ones.
    One code object for all would meet the limit at the ninth size: every size is a recompilation there."""
    assert torch.compiler.config.recompile_limit < MODELS
    sizes = [dict(TINY_MODEL, d_model=12 + 4 * i, d_k=4, d_v=4 + i) for i in range(MODELS)]
    models = [sharpened(kernelize(random_model(i, size))) for i, size in enumerate(sizes)]
    source, mask = padded_batch(TINY_MODEL["vocab_size"], [6, 3], seed=1, eos_token_id=EOS)
    call = dict(attention_mask=mask, num_beams=2, max_new_tokens=6)
    eager = [Translator(model, compile=False).generate(source, **call) for model in models]
    graphs: list[torch.fx.GraphModule] = []

    def counted(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    take_tensors_as_on_an_accelerator(monkeypatch, step_backend=counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a step run eagerly warns
        for model, tokens in zip(models, eager, strict=True):
            with Translator(model) as translator:
                assert torch.equal(translator.generate(source, **call), tokens)
    assert len(graphs) == MODELS  # one graph a model: each compiled its own step


def test_a_step_that_dynamo_runs_eagerly_says_so_once_naming_the_model(monkeypatch) -> None:
    """Past the recompile limit (here 1: a second shape of one engine) dynamo runs the step eagerly, as it does where
    the step is not compiled fullgraph (the default): the tokens are still the eager loop's, and one warning names the
    model."""
    model = sharpened(kernelize(random_model(0, TINY_MODEL)))
    model.name_or_path = "models/tiny-en-de"
    calls = [padded_batch(model.config.vocab_size, lengths, seed=2, eos_token_id=EOS) for lengths in ([5, 3], [4])]
    eager = [Translator(model, compile=False).generate(s, attention_mask=m, max_new_tokens=5) for s, m in calls]
    take_tensors_as_on_an_accelerator(monkeypatch)
    compile = {"backend": "aot_eager", "dynamic": False}
    with (
        torch.compiler.config.patch(recompile_limit=1),
        Translator(model, compile=compile) as translator,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("default")
        for _ in range(2):
            outputs = [translator.generate(s, attention_mask=m, max_new_tokens=5) for s, m in calls]
            assert all(torch.equal(output, tokens) for output, tokens in zip(outputs, eager, strict=True))
    eager_warnings = [w for w in caught if "runs eagerly" in str(w.message)]
    assert len(eager_warnings) == 1 and "models/tiny-en-de" in str(eager_warnings[0].message)
