"""The package loop's decoding step as it runs on an accelerator, compiled whole (kernels/graphs.py), checked on the
CPU: one compilation for a call's shapes and none across its steps, and the eager loop's tokens."""

from collections.abc import Callable

import pytest
import torch
from helpers import padded_batch, sharpened, take_tensors_as_on_an_accelerator
from tiny import TINY_MODEL, random_model
from transformers.cache_utils import StaticCache

from hf_vaswani.decoding import search
from hf_vaswani.decoding.search import covered_request, decode
from hf_vaswani.kernels.cpu import kernelize
from hf_vaswani.model.generation_vaswani import paper_generation_config

EOS = 2
CALLS = {
    "greedy": dict(num_beams=1, max_new_tokens=12),
    "beam 4": dict(num_beams=4, max_new_tokens=12, num_return_sequences=2),
    "beam 4, minimum length": dict(num_beams=4, max_new_tokens=10, min_new_tokens=10),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_calls_steps_replay_one_compiled_graph_and_decode_the_eager_tokens(monkeypatch, call: dict) -> None:
    """fullgraph, no dynamic shapes: a recompilation at any step (a host read, a length read as a number, a guard on
    the step) would show as a second graph. The eager loop (the CPU's growing cache) gives the same tokens."""
    model = sharpened(kernelize(random_model(0, TINY_MODEL)))
    model.generation_config = paper_generation_config(model.config)
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=3, eos_token_id=EOS)
    eager = decode(model, covered_request(model, source, None, {"attention_mask": mask, **call}))
    graphs = []

    def counted(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    take_tensors_as_on_an_accelerator(monkeypatch, step_backend=counted)
    request = covered_request(model, source, None, {"attention_mask": mask, **call})
    captured = decode(model, request)
    eager_tokens = eager if isinstance(eager, torch.Tensor) else eager.sequences
    assert torch.equal(captured if isinstance(captured, torch.Tensor) else captured.sequences, eager_tokens)
    assert eager_tokens.shape[1] > 3 and len(graphs) == 1  # several compiled steps, one graph
    decode(model, request)
    assert len(graphs) == 1  # a call of the same shapes compiles nothing


def test_the_next_call_of_a_shape_reuses_its_static_cache_but_never_one_returned(monkeypatch) -> None:
    """A captured step reads the cache at the addresses it was recorded with: the second call of a shape decodes into
    the first one's cache, emptied, and gives the eager loop's tokens. A cache returned with the output is the
    caller's: a later call leaves it as it was."""
    model = sharpened(kernelize(random_model(0, TINY_MODEL)))
    model.generation_config = paper_generation_config(model.config)
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=3, eos_token_id=EOS)
    call = {"attention_mask": mask, **CALLS["beam 4"]}
    eager = decode(model, covered_request(model, source, None, call))
    take_tensors_as_on_an_accelerator(monkeypatch)
    made = []

    class CountedStaticCache(StaticCache):
        def __init__(self, **options) -> None:
            made.append(self)
            super().__init__(**options)

    monkeypatch.setattr(search, "StaticCache", CountedStaticCache)
    returned = decode(model, covered_request(model, source, None, {**call, "return_dict_in_generate": True}))
    kept_keys = [layer.keys.clone() for layer in returned.cache.self_attention_cache.layers]
    outputs = [decode(model, covered_request(model, source, None, call)) for _ in range(3)]
    assert len(made) == 2  # the returned one, then one for the three calls
    assert all(torch.equal(output, eager) for output in outputs) and torch.equal(returned.sequences, eager)
    for layer, keys in zip(returned.cache.self_attention_cache.layers, kept_keys, strict=True):
        assert torch.equal(layer.keys, keys)
