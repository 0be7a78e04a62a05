"""The model against independent references: torch.nn.Transformer, the paper's formulas, and its other paths."""

import json
import math

import pytest
import torch
from helpers import padded_batch
from safetensors.torch import save_file
from tiny import TINY_MODEL, UNEVEN_MODEL
from torch import nn
from transformers.utils import find_labels

import hf_vaswani  # noqa: F401  (registers the Auto classes)
from hf_vaswani import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel
from hf_vaswani.model.loss_vaswani import ProjectedLabelSmoothedLoss
from hf_vaswani.model.modeling_vaswani import VaswaniSinusoidalPositionalEncoding

VOCAB_SIZE = TINY_MODEL["vocab_size"]


def make_model(attn_implementation: str = "sdpa", seed: int = 0, **kwargs) -> VaswaniForConditionalGeneration:
    torch.manual_seed(seed)
    config = VaswaniConfig(**kwargs)
    return VaswaniForConditionalGeneration._from_config(config, attn_implementation=attn_implementation).eval()


# --- torch.nn.Transformer as the reference for the stacks ------------------------------------------------------------


def copy_attention(ours, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.weight.copy_(ours.out_proj.weight)
    theirs.out_proj.bias.copy_(ours.out_proj.bias)


def copy_norm(ours: nn.LayerNorm, theirs: nn.LayerNorm) -> None:
    theirs.weight.copy_(ours.weight)
    theirs.bias.copy_(ours.bias)


def copy_feed_forward(ours, theirs) -> None:
    for src, dst in ((ours.fc1, theirs.linear1), (ours.fc2, theirs.linear2)):
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)


@torch.no_grad()
def reference_transformer(model: VaswaniModel, config: VaswaniConfig) -> nn.Transformer:
    """torch's post-LN ReLU Transformer holding our weights; its extra final LayerNorms are removed (not in §3.1)."""
    reference = nn.Transformer(
        d_model=config.d_model,
        nhead=config.num_heads,
        num_encoder_layers=config.encoder_layers,
        num_decoder_layers=config.decoder_layers,
        dim_feedforward=config.d_ff,
        dropout=0.0,
        activation="relu",
        layer_norm_eps=config.layer_norm_eps,
        batch_first=True,
        norm_first=False,
    ).eval()
    reference.encoder.norm = None
    reference.decoder.norm = None
    for ours, theirs in zip(model.encoder.layers, reference.encoder.layers, strict=True):
        copy_attention(ours.self_attention, theirs.self_attn)
        copy_norm(ours.self_attention_norm, theirs.norm1)
        copy_feed_forward(ours.feed_forward, theirs)
        copy_norm(ours.feed_forward_norm, theirs.norm2)
    for ours, theirs in zip(model.decoder.layers, reference.decoder.layers, strict=True):
        copy_attention(ours.self_attention, theirs.self_attn)
        copy_norm(ours.self_attention_norm, theirs.norm1)
        copy_attention(ours.cross_attention, theirs.multihead_attn)
        copy_norm(ours.cross_attention_norm, theirs.norm2)
        copy_feed_forward(ours.feed_forward, theirs)
        copy_norm(ours.feed_forward_norm, theirs.norm3)
    return reference


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_stacks_equal_torch_nn_transformer(attn_implementation: str) -> None:
    model = make_model(attn_implementation, **UNEVEN_MODEL)
    config = model.config
    # Non-trivial LayerNorm parameters and biases, so that a mis-wired norm or bias cannot go unnoticed.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    reference = reference_transformer(model.model, config)

    source, source_mask = padded_batch(config.vocab_size, [7, 4, 6])
    target, target_mask = padded_batch(config.vocab_size, [5, 5, 2], seed=2)
    with torch.no_grad():
        ours = model.model(
            input_ids=source, attention_mask=source_mask, decoder_input_ids=target, decoder_attention_mask=target_mask
        )
        source_embedded = model.model.encoder.embeddings(source, None)
        target_embedded = model.model.decoder.embeddings(target, None)
        memory = reference.encoder(source_embedded, src_key_padding_mask=~source_mask.bool())
        causal = torch.ones(target.shape[1], target.shape[1], dtype=torch.bool).triu(1)
        decoded = reference.decoder(
            target_embedded,
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            tgt_key_padding_mask=~target_mask.bool(),
            memory_key_padding_mask=~source_mask.bool(),
        )
    real_source, real_target = source_mask.bool(), target_mask.bool()
    torch.testing.assert_close(ours.encoder_last_hidden_state[real_source], memory[real_source], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.last_hidden_state[real_target], decoded[real_target], atol=1e-5, rtol=0)


# --- §3.4 and §3.5 --------------------------------------------------------------------------------------------------


def test_positional_encoding_is_the_papers_interleaved_formula() -> None:
    d_model, positions = 16, 60
    expected = torch.tensor(
        [
            [
                math.sin(pos / 10000 ** (dim / d_model))
                if dim % 2 == 0
                else math.cos(pos / 10000 ** ((dim - 1) / d_model))
                for dim in range(d_model)
            ]
            for pos in range(positions)
        ],
        dtype=torch.float64,
    )
    computed = VaswaniSinusoidalPositionalEncoding(d_model)(torch.arange(positions))
    torch.testing.assert_close(computed.double(), expected, atol=1e-5, rtol=0)


def test_embeddings_are_scaled_by_sqrt_d_model_and_add_positions() -> None:
    model = make_model(**TINY_MODEL)
    ids = torch.tensor([[5, 9, 17, 4]])
    table = model.model.encoder.embeddings.embed_tokens.weight
    positions = VaswaniSinusoidalPositionalEncoding(model.config.d_model)(torch.arange(4))
    expected = table[ids] * math.sqrt(model.config.d_model) + positions
    torch.testing.assert_close(model.model.encoder.embeddings(ids, None), expected)
    unscaled = make_model(**TINY_MODEL, scale_embedding=False)
    torch.testing.assert_close(
        unscaled.model.encoder.embeddings(ids, None),
        unscaled.model.encoder.embeddings.embed_tokens.weight[ids] + positions,
    )


def test_hidden_states_zero_is_the_embedding_output() -> None:
    model = make_model("eager", **TINY_MODEL)
    source, mask = padded_batch(model.config.vocab_size, [6, 3])
    target, _ = padded_batch(model.config.vocab_size, [4, 4], seed=3)
    out = model(
        input_ids=source,
        attention_mask=mask,
        decoder_input_ids=target,
        output_hidden_states=True,
        output_attentions=True,
    )
    assert len(out.encoder_hidden_states) == model.config.encoder_layers + 1
    assert len(out.decoder_hidden_states) == model.config.decoder_layers + 1
    torch.testing.assert_close(out.encoder_hidden_states[0], model.model.encoder.embeddings(source, None))
    torch.testing.assert_close(out.decoder_hidden_states[0], model.model.decoder.embeddings(target, None))
    torch.testing.assert_close(out.encoder_hidden_states[-1], out.encoder_last_hidden_state)
    heads = model.config.num_heads
    assert out.encoder_attentions[0].shape == (2, heads, 6, 6)
    assert out.decoder_attentions[0].shape == (2, heads, 4, 4)
    assert out.cross_attentions[0].shape == (2, heads, 4, 6)
    # Masked keys get no weight; decoder self-attention never looks ahead; every row is a distribution.
    assert out.encoder_attentions[0][1, :, :, 3:].abs().max() == 0
    assert out.cross_attentions[0][1, :, :, 3:].abs().max() == 0
    assert torch.triu(out.decoder_attentions[0], diagonal=1).abs().max() == 0
    torch.testing.assert_close(out.cross_attentions[1].sum(-1), torch.ones(2, heads, 4))


def test_sinusoidal_model_accepts_lengths_beyond_max_position_embeddings() -> None:
    model = make_model(**TINY_MODEL, max_position_embeddings=8)
    source, mask = padded_batch(model.config.vocab_size, [40])
    logits = model(input_ids=source, attention_mask=mask, decoder_input_ids=source).logits
    assert logits.shape == (1, 40, model.config.vocab_size) and torch.isfinite(logits).all()


def test_learned_positions_are_trainable_and_refuse_overlong_input() -> None:
    model = make_model(**TINY_MODEL, positional_encoding="learned", max_position_embeddings=8)
    assert isinstance(model.model.encoder.embeddings.positions, nn.Embedding)
    source, mask = padded_batch(model.config.vocab_size, [8])
    model(input_ids=source, attention_mask=mask, decoder_input_ids=source)
    long_source, long_mask = padded_batch(model.config.vocab_size, [9])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(input_ids=long_source, attention_mask=long_mask, decoder_input_ids=source)


# --- inconsistent inputs are refused before anything is computed ---------------------------------------------------


def ids(*shape: int, value: int = 5) -> torch.Tensor:
    return torch.full(shape, value, dtype=torch.long)


BAD_INPUTS = [
    (
        "decoder batch",
        dict(input_ids=ids(2, 7), decoder_input_ids=ids(4, 5)),
        r"decoder input shape \(4, 5\) and source shape \(2, 7\) have different batch sizes",
    ),
    (
        "labels length",
        dict(input_ids=ids(2, 7), decoder_input_ids=ids(2, 5), labels=ids(2, 3)),
        r"labels shape \(2, 3\) does not match the decoder input shape \(2, 5\)",
    ),
    (
        "labels batch",
        dict(input_ids=ids(2, 7), labels=ids(3, 5)),
        r"decoder input shape \(3, 5\) and source shape \(2, 7\) have different batch sizes",
    ),
    (
        "attention_mask batch",
        dict(input_ids=ids(2, 7), attention_mask=ids(3, 7, value=1), decoder_input_ids=ids(2, 5)),
        r"attention_mask shape \(3, 7\) does not match the source shape \(2, 7\)",
    ),
    (
        "attention_mask length",
        dict(input_ids=ids(2, 7), attention_mask=ids(2, 6, value=1), decoder_input_ids=ids(2, 5)),
        r"attention_mask shape \(2, 6\) does not match the source shape \(2, 7\)",
    ),
    (
        "decoder_attention_mask",
        dict(input_ids=ids(2, 7), decoder_input_ids=ids(2, 5), decoder_attention_mask=ids(3, 5, value=1)),
        r"decoder_attention_mask shape \(3, 5\) does not match the decoder input shape \(2, 5\) after 0 cached",
    ),
    (
        "source id too large",
        dict(input_ids=ids(2, 7, value=61), decoder_input_ids=ids(2, 5)),
        r"input_ids holds id 61, outside the vocabulary \[0, 61\)",
    ),
    (
        "negative decoder id",
        dict(input_ids=ids(2, 7), decoder_input_ids=ids(2, 5, value=-1)),
        r"decoder_input_ids holds id -1, outside the vocabulary \[0, 61\)",
    ),
    (
        "label id",
        dict(input_ids=ids(2, 7), labels=ids(2, 5, value=99)),
        r"labels holds id 99, outside the vocabulary \[0, 61\)",
    ),
    (
        "empty batch",
        dict(input_ids=ids(0, 7), decoder_input_ids=ids(0, 5)),
        r"empty input: source shape \(0, 7\), decoder input shape \(0, 5\)",
    ),
    (
        "zero-length source",
        dict(input_ids=ids(2, 0), decoder_input_ids=ids(2, 5)),
        r"empty input: source shape \(2, 0\), decoder input shape \(2, 5\)",
    ),
    (
        "zero-length target",
        dict(input_ids=ids(2, 7), decoder_input_ids=ids(2, 0)),
        r"empty input: source shape \(2, 7\), decoder input shape \(2, 0\)",
    ),
]


@pytest.mark.parametrize(("inputs", "message"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_inconsistent_inputs_are_refused_naming_the_shapes(inputs: dict, message: str) -> None:
    model = make_model(**TINY_MODEL).train()
    with pytest.raises(ValueError, match=message):
        model(**inputs)


def test_encoder_outputs_admit_a_multiple_of_their_batch_only() -> None:
    # While generating, the beams of each sentence share its encoder states: 2 sentences x 3 beams
    model = make_model(**TINY_MODEL)
    source, mask = padded_batch(model.config.vocab_size, [7, 4])
    encoder_outputs = model.get_encoder()(input_ids=source, attention_mask=mask)
    shared = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=ids(6, 5)).logits
    copied = model(
        input_ids=source.repeat_interleave(3, 0),
        attention_mask=mask.repeat_interleave(3, 0),
        decoder_input_ids=ids(6, 5),
    ).logits
    torch.testing.assert_close(shared, copied)
    with pytest.raises(ValueError, match=r"decoder input shape \(5, 5\): its batch is not a multiple of the encoder"):
        model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=ids(5, 5))
    with pytest.raises(ValueError, match=r"attention_mask shape \(6, 7\) does not match the source shape \(2, 7\)"):
        model(encoder_outputs=encoder_outputs, attention_mask=mask.repeat(3, 1), decoder_input_ids=ids(6, 5))


def test_generate_refuses_ids_outside_the_vocabulary() -> None:
    model = make_model(**TINY_MODEL)
    with pytest.raises(ValueError, match=r"input_ids holds id 70, outside the vocabulary \[0, 61\)"):
        model.generate(ids(2, 7, value=70), max_new_tokens=3)
    generated = model.generate(ids(2, 7), num_beams=3, num_return_sequences=2, max_new_tokens=3)
    assert generated.shape[0] == 4


def test_base_model_refuses_inconsistent_batches() -> None:
    model = VaswaniModel(VaswaniConfig(**TINY_MODEL)).eval()
    with pytest.raises(ValueError, match=r"decoder input shape \(4, 5\) and source shape \(2, 7\)"):
        model(input_ids=ids(2, 7), decoder_input_ids=ids(4, 5))


# --- weight sharing (§3.4) -------------------------------------------------------------------------------------------


def test_three_way_tied_weights_survive_save_and_load(tmp_path) -> None:
    model = make_model(**TINY_MODEL)
    model.save_pretrained(tmp_path)
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    embeddings = (
        loaded.model.encoder.embeddings.embed_tokens.weight,
        loaded.model.decoder.embeddings.embed_tokens.weight,
        loaded.lm_head.weight,
    )
    assert len({t.data_ptr() for t in embeddings}) == 1
    torch.testing.assert_close(embeddings[0], model.lm_head.weight)
    with torch.no_grad():
        embeddings[0][7] += 1.0
    assert torch.equal(embeddings[2][7], embeddings[0][7])
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert sum(weights.get_tensor(key).shape == (61, 24) for key in weights.keys()) == 1


@pytest.mark.parametrize("tie", [True, False])
def test_the_shared_embedding_is_one_module_once_tied_and_a_lost_one_is_reported_missing(tmp_path, tie: bool) -> None:
    # One module: accelerate's FSDP2 groups the module get_input_embeddings gives (with the output projection where
    # they are tied), which then holds every use of the shared embedding. Two modules holding one weight would put
    # the decoder's use in another group, and FSDP2 refuses a weight in two.
    model = make_model(**TINY_MODEL, tie_word_embeddings=tie)
    assert model.model.decoder.get_input_embeddings() is model.get_input_embeddings()
    model.save_pretrained(tmp_path)
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.model.decoder.get_input_embeddings() is loaded.get_input_embeddings()
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) is tie
    # transformers ties no weight while it loads: weights without the embedding report it missing (were the module
    # shared from the start, transformers' marking of the decoder's weight as one to tie would mark it loaded)
    save_file({"unrelated": torch.zeros(1)}, tmp_path / "model.safetensors", {"format": "pt"})
    _, info = VaswaniForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert "model.encoder.embeddings.embed_tokens.weight" in info["missing_keys"]


@pytest.mark.parametrize(("share", "tie"), [(False, True), (True, False), (False, False)])
def test_sharing_switches_are_independent(tmp_path, share: bool, tie: bool) -> None:
    model = make_model(**TINY_MODEL, share_embeddings=share, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    encoder = loaded.model.encoder.embeddings.embed_tokens.weight
    decoder = loaded.model.decoder.embeddings.embed_tokens.weight
    assert (encoder.data_ptr() == decoder.data_ptr()) is share
    assert (loaded.lm_head.weight.data_ptr() == decoder.data_ptr()) is tie
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)


# --- attention implementations, caching and padding ----------------------------------------------------------------


def padded_pair_batch() -> dict[str, torch.Tensor]:
    """Three source/target pairs of different lengths, right-padded, for the vocabulary of TINY_MODEL."""
    source, source_mask = padded_batch(VOCAB_SIZE, [9, 2, 5])
    target, target_mask = padded_batch(VOCAB_SIZE, [6, 3, 6], seed=4)
    return dict(
        input_ids=source, attention_mask=source_mask, decoder_input_ids=target, decoder_attention_mask=target_mask
    )


def test_eager_and_sdpa_agree() -> None:
    eager, sdpa = make_model("eager", **TINY_MODEL), make_model("sdpa", **TINY_MODEL)
    inputs = padded_pair_batch()
    torch.testing.assert_close(eager(**inputs).logits, sdpa(**inputs).logits, atol=1e-5, rtol=1e-5)


def test_a_registered_attention_function_is_used_with_transformers_masks() -> None:
    """`_supports_attention_backend`: a function registered in transformers' AttentionInterface (as custom kernels
    are) is called by every attention layer with the additive masks it builds, and computes the model's function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls: list[tuple[int, ...] | None] = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append(None if attention_mask is None else tuple(attention_mask.shape))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("recording_sdpa", recording_sdpa)
    AttentionMaskInterface.register("recording_sdpa", sdpa_mask)  # a kernel names the masks it takes
    eager, recorded = make_model("eager", **TINY_MODEL), make_model("recording_sdpa", **TINY_MODEL)
    inputs = padded_pair_batch()
    torch.testing.assert_close(recorded(**inputs).logits, eager(**inputs).logits, atol=1e-5, rtol=1e-5)
    config = recorded.config
    assert len(calls) == config.encoder_layers + 2 * config.decoder_layers
    assert all(shape is not None and shape[0] == 3 for shape in calls)  # padding is masked in each of them


@pytest.mark.parametrize(
    ("attn_implementation", "cache_argument"), [("eager", "cache"), ("sdpa", "cache"), ("sdpa", "past_key_values")]
)
def test_incremental_decoding_equals_full_recomputation(attn_implementation: str, cache_argument: str) -> None:
    """Also with the cache under `past_key_values`, its name before transformers 5.24, which transformers' own models
    still take (with a FutureWarning): the name most code passes it by."""
    model = make_model(attn_implementation, **TINY_MODEL)
    source, source_mask = padded_batch(VOCAB_SIZE, [7, 4])
    target, _ = padded_batch(VOCAB_SIZE, [6, 6], seed=5)
    full = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target, use_cache=False).logits
    encoder_outputs = model.get_encoder()(input_ids=source, attention_mask=source_mask)
    cache, steps = None, []
    for t in range(target.shape[1]):
        step = dict(encoder_outputs=encoder_outputs, attention_mask=source_mask, decoder_input_ids=target[:, t : t + 1])
        if t > 0 and cache_argument == "past_key_values":
            with pytest.warns(FutureWarning, match="`past_key_values` is deprecated"):
                out = model(**step, past_key_values=cache, use_cache=True)
        else:
            out = model(**step, cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # The cross-attention keys and values were computed once, from the encoder output, and never grew.
    assert cache.cross_attention_cache.get_seq_length() == source.shape[1]
    assert cache.self_attention_cache.get_seq_length() == target.shape[1]


def test_generate_with_and_without_cache_agree() -> None:
    model = make_model(**TINY_MODEL)
    source, source_mask = padded_batch(VOCAB_SIZE, [7, 4, 5])
    settings = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    with_cache = model.generate(input_ids=source, attention_mask=source_mask, use_cache=True, **settings)
    without_cache = model.generate(input_ids=source, attention_mask=source_mask, use_cache=False, **settings)
    assert torch.equal(with_cache, without_cache)


def test_padded_batch_equals_one_by_one() -> None:
    model = make_model(**TINY_MODEL)
    lengths = [8, 3, 5]
    source, source_mask = padded_batch(VOCAB_SIZE, lengths)
    target, target_mask = padded_batch(VOCAB_SIZE, [4, 6, 2], seed=6)
    batched = model(
        input_ids=source, attention_mask=source_mask, decoder_input_ids=target, decoder_attention_mask=target_mask
    ).logits
    greedy = model.generate(
        input_ids=source, attention_mask=source_mask, max_new_tokens=6, do_sample=False, num_beams=1, min_new_tokens=6
    )
    for row, length in enumerate(lengths):
        target_length = int(target_mask[row].sum())
        single = model(
            input_ids=source[row : row + 1, :length], decoder_input_ids=target[row : row + 1, :target_length]
        ).logits
        torch.testing.assert_close(batched[row, :target_length], single[0], atol=1e-5, rtol=1e-5)
        alone = model.generate(
            input_ids=source[row : row + 1, :length], max_new_tokens=6, do_sample=False, num_beams=1, min_new_tokens=6
        )
        assert torch.equal(greedy[row], alone[0])


FOUR_LABEL_ROWS = torch.tensor(
    [[9, 12, 2, -100, -100], [33, 2, -100, -100, -100], [5, 6, 7, 8, 2], [40, 2, -100, -100, -100]]
)


# --- training-time behaviour ------------------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    source, source_mask = padded_batch(VOCAB_SIZE, [7, 4])
    labels, _ = padded_batch(VOCAB_SIZE, [5, 5], seed=7)
    grads = []
    for checkpointing in (False, True):
        model = make_model(**TINY_MODEL).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(input_ids=source, attention_mask=source_mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


@pytest.mark.parametrize("return_logits", [True, False])
def test_a_new_models_loss_is_torch_cross_entropy_with_its_gradients(return_logits: bool) -> None:
    """transformers' convention: the loss with labels is the cross-entropy (exp: the perplexity), whichever path."""
    model = make_model(**TINY_MODEL)  # VaswaniConfig's defaults: no label smoothing
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4])
    labels = torch.tensor([[9, 12, 2, -100], [33, 2, -100, -100]])  # -100: DataCollatorForSeq2Seq's padding
    decoder_inputs = torch.tensor([[1, 9, 12, 2], [1, 33, 2, 0]])
    out = model(input_ids=source, attention_mask=source_mask, labels=labels, return_logits=return_logits)
    ours = torch.autograd.grad(out.loss, list(model.parameters()))
    logits = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=decoder_inputs).logits
    reference = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())  # ignore_index=-100, mean
    expected = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(out.loss, reference)
    torch.testing.assert_close(out.nll_loss, reference.detach())  # fairseq's nll_loss: the loss itself here
    assert not out.nll_loss.requires_grad
    for (name, _), got, want in zip(model.named_parameters(), ours, expected, strict=True):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("return_logits", [True, False])
def test_label_smoothing_asked_per_call_is_torch_label_smoothing_with_the_cross_entropy_beside(
    return_logits: bool,
) -> None:
    model = make_model(**TINY_MODEL, label_smoothing=0.2)  # a call's value overrides the config's
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4])
    labels = torch.tensor([[9, 12, 2, -100], [33, 2, -100, -100]])
    decoder_inputs = torch.tensor([[1, 9, 12, 2], [1, 33, 2, 0]])
    logits = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=decoder_inputs).logits.detach()
    inputs = dict(input_ids=source, attention_mask=source_mask, labels=labels, return_logits=return_logits)
    smoothed = model(**inputs, smoothing=0.1)
    flat_logits, flat_labels = logits.flatten(0, 1), labels.flatten()
    reference = nn.functional.cross_entropy(flat_logits, flat_labels, label_smoothing=0.1)
    torch.testing.assert_close(smoothed.loss, reference)
    torch.testing.assert_close(smoothed.nll_loss, nn.functional.cross_entropy(flat_logits, flat_labels))
    assert not smoothed.nll_loss.requires_grad  # for logs and perplexity: training follows `loss`
    plain = model(**inputs, smoothing=0.0)
    torch.testing.assert_close(plain.loss, nn.functional.cross_entropy(flat_logits, flat_labels))
    torch.testing.assert_close(plain.nll_loss, plain.loss.detach())
    configured = model(**inputs)
    torch.testing.assert_close(
        configured.loss, nn.functional.cross_entropy(flat_logits, flat_labels, label_smoothing=0.2)
    )
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\), got 1.0"):
        model(**inputs, smoothing=1.0)
    with pytest.raises(ValueError, match="label_smoothing is the config's name: forward takes `smoothing`"):
        model(**inputs, label_smoothing=0.1)  # not dropped silently
    assert find_labels(VaswaniForConditionalGeneration) == ["labels"]  # what Trainer takes for labels


def test_label_smoothed_loss_matches_hand_computation() -> None:
    model = make_model(**TINY_MODEL, label_smoothing=0.1)  # set in the config, as saved folders may carry it
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4])
    labels = torch.tensor([[9, 12, 2, -100], [33, 2, 0, 0]])  # -100 and the padding id are both ignored
    out = model(input_ids=source, attention_mask=source_mask, labels=labels)
    decoder_inputs = torch.tensor([[1, 9, 12, 2], [1, 33, 2, 0]])
    logits = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=decoder_inputs).logits
    torch.testing.assert_close(out.logits, logits)  # with gradients on too, like any transformers model
    log_probs = logits.detach().double().log_softmax(-1)
    eps, vocab, total, nll, count = 0.1, VOCAB_SIZE, 0.0, 0.0, 0
    for b in range(2):
        for t in range(4):
            y = int(labels[b, t])
            if y in (-100, 0):
                continue
            # Szegedy et al.: q = (1 - eps) * one_hot(y) + eps / V, loss = -sum_k q_k log p_k
            total += -((1 - eps) * log_probs[b, t, y] + eps / vocab * log_probs[b, t].sum())
            nll += -log_probs[b, t, y]  # fairseq's nll_loss beside it
            count += 1
    assert count == 5
    assert out.loss.detach().item() == pytest.approx(float(total / count), rel=1e-5)
    assert out.nll_loss.item() == pytest.approx(float(nll / count), rel=1e-5)
    # Decoder inputs were the labels shifted right behind the start token, with ignored positions as padding.
    explicit = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=decoder_inputs, labels=labels)
    torch.testing.assert_close(explicit.loss, out.loss)
    with torch.no_grad():  # evaluation: logits returned, loss from them
        evaluated = model(input_ids=source, attention_mask=source_mask, labels=labels)
    torch.testing.assert_close(evaluated.logits, logits)
    torch.testing.assert_close(evaluated.loss, out.loss)


def test_the_loss_without_logits_is_a_per_call_choice_with_the_same_loss_and_gradients() -> None:
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4])
    labels = torch.tensor([[9, 12, 2, -100], [33, 2, 0, 0]])
    model = make_model(**TINY_MODEL)
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(
            input_ids=source,
            attention_mask=source_mask,
            labels=labels,
            return_logits=return_logits,
            smoothing=0.1,
        )
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (with_logits, grads), (chunked, chunked_grads) = results
    assert with_logits.logits is not None and chunked.logits is None  # the chunked loss never holds all logits
    torch.testing.assert_close(chunked.loss, with_logits.loss)
    torch.testing.assert_close(chunked.nll_loss, with_logits.nll_loss)
    assert grads.keys() == chunked_grads.keys()
    for name in grads:
        torch.testing.assert_close(chunked_grads[name], grads[name], msg=name)
    assert "return_logits" not in model.config.to_dict()  # a call's choice, not the model's
    with pytest.raises(ValueError, match="needs labels"):
        model(input_ids=source, attention_mask=source_mask, decoder_input_ids=source, return_logits=False)


def test_logits_to_keep_gives_the_last_positions_and_the_same_loss() -> None:
    model = make_model(**TINY_MODEL)
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4])
    labels = torch.tensor([[9, 12, 2, -100], [33, 2, 0, 0]])
    full = model(input_ids=source, attention_mask=source_mask, labels=labels)
    last = model(input_ids=source, attention_mask=source_mask, labels=labels, logits_to_keep=1)
    assert last.logits.shape == (2, 1, VOCAB_SIZE)
    torch.testing.assert_close(last.logits, full.logits[:, -1:])
    torch.testing.assert_close(last.loss, full.loss)
    picked = model(input_ids=source, attention_mask=source_mask, labels=labels, logits_to_keep=torch.tensor([0, 2]))
    torch.testing.assert_close(picked.logits, full.logits[:, [0, 2]])


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize(("scale", "upstream"), [(1.0, 0.37), (torch.tensor(1 / 19), 1.0), (torch.tensor(0.25), 3.0)])
def test_chunked_projected_loss_and_gradients_match_torch_cross_entropy(chunk_size: int, scale, upstream) -> None:
    """The loss times `scale`, and its gradients whether the loss is differentiated directly or further scaled."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, 3] = labels[2, 6] = -100
    ours, ours_nll = ProjectedLabelSmoothedLoss.apply(hidden, weight, bias, labels, 0.1, chunk_size, scale)
    ours_grads = torch.autograd.grad(ours * upstream, (hidden, weight, bias))
    logits, targets = nn.functional.linear(hidden, weight, bias).flatten(0, 1), labels.flatten()
    reference = nn.functional.cross_entropy(logits, targets, reduction="sum", label_smoothing=0.1) * scale
    reference_grads = torch.autograd.grad(reference * upstream, (hidden, weight, bias))
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(ours_nll, nn.functional.cross_entropy(logits, targets, reduction="sum") * scale)
    for name, got, expected in zip(("hidden", "weight", "bias"), ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, expected, msg=name)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_projected_loss_under_bf16_autocast_matches_torch_cross_entropy(chunk_size: int) -> None:
    """Mixed precision: bfloat16 products, the loss and the float32 weight gradient summed in float32 over chunks."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, 3] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = ProjectedLabelSmoothedLoss.apply(hidden, weight, None, labels, 0.1, chunk_size, 1 / 20)
        logits = nn.functional.linear(hidden, weight).float().flatten(0, 1)
        reference = nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum", label_smoothing=0.1) / 20
    ours_grads = torch.autograd.grad(ours, (hidden, weight))
    reference_grads = torch.autograd.grad(reference, (hidden, weight))
    assert ours.dtype == torch.float32 and all(grad.dtype == torch.float32 for grad in ours_grads)
    # bfloat16 keeps 8 significant bits: both sides round the logits and the logit gradients to it (rtol 2^-8)
    torch.testing.assert_close(ours, reference, rtol=2**-8, atol=0)
    for name, got, expected in zip(("hidden", "weight"), ours_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item(), msg=name)


def test_num_items_in_batch_makes_accumulated_loss_equal_the_full_batch() -> None:
    model = make_model(**TINY_MODEL)
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4, 7, 3])
    labels = FOUR_LABEL_ROWS
    full = model(input_ids=source, attention_mask=source_mask, labels=labels).loss
    items = int((labels != -100).sum())
    halves = sum(
        model(input_ids=source[s], attention_mask=source_mask[s], labels=labels[s], num_items_in_batch=items).loss
        for s in (slice(0, 2), slice(2, 4))
    )
    torch.testing.assert_close(halves, full)


def test_trainer_gradient_accumulation_equals_one_large_batch(tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    source, source_mask = padded_batch(VOCAB_SIZE, [6, 2, 7, 3])
    labels = FOUR_LABEL_ROWS
    examples = [dict(input_ids=source[i], attention_mask=source_mask[i], labels=labels[i]) for i in range(4)]

    def collate(batch: list[dict]) -> dict:
        return {key: torch.stack([example[key] for example in batch]) for key in batch[0]}

    trained = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        model = make_model(**TINY_MODEL)
        args = TrainingArguments(
            output_dir=str(tmp_path / f"run{accumulation}"),
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=0.5,
            optim="sgd",
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            logging_strategy="no",
        )
        Trainer(model=model, args=args, train_dataset=examples, data_collator=collate).train()
        trained.append(model.state_dict())
    initial = make_model(**TINY_MODEL).state_dict()
    assert not torch.allclose(trained[0]["lm_head.weight"], initial["lm_head.weight"])  # a step was really taken
    for name in trained[0]:
        torch.testing.assert_close(trained[1][name], trained[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_initialisation_is_the_reference_codes() -> None:
    """tensor2tensor: uniform unit scaling, U(-sqrt(3/fan_in), sqrt(3/fan_in)), and N(0, d_model^-0.5) embeddings."""
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(vocab_size=3000, d_model=256, d_ff=1024, num_heads=4, encoder_layers=1, decoder_layers=1)
    )
    embedding = model.get_input_embeddings().weight
    assert embedding.std().item() == pytest.approx(256**-0.5, rel=0.02)
    assert embedding.mean().abs().item() < 1e-3
    for linear in (model.model.encoder.layers[0].self_attention.q_proj, model.model.decoder.layers[0].feed_forward.fc2):
        bound = math.sqrt(3 / linear.in_features)
        assert linear.weight.abs().max().item() <= bound
        assert linear.weight.abs().max().item() > 0.99 * bound  # uniform up to the bound, not a narrower normal
        assert linear.weight.std().item() == pytest.approx(linear.in_features**-0.5, rel=0.03)
        assert torch.count_nonzero(linear.bias) == 0
    norm = model.model.encoder.layers[0].feed_forward_norm
    assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)


def test_fairseq_initialisation_is_fairseqs(tmp_path) -> None:
    """fairseq's transformer: xavier-uniform weights, U(+-gain sqrt(6 / (fan_in + fan_out))), gain 1/sqrt(2) for q/k/v
    whose biases keep nn.Linear's U(+-1/sqrt(fan_in)), zero biases elsewhere, the padding embedding zero; a loaded
    padding row stays as saved."""
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=3000, d_model=256, d_ff=1024, num_heads=4, encoder_layers=1, decoder_layers=1,
        initialization="fairseq", pad_token_id=3,
    )  # fmt: skip
    model = VaswaniForConditionalGeneration(config)
    layer = model.model.decoder.layers[0]

    def xavier_bound(linear: nn.Linear, gain: float = 1.0) -> float:
        return gain * math.sqrt(6 / (linear.in_features + linear.out_features))

    for attention in (layer.self_attention, layer.cross_attention, model.model.encoder.layers[0].self_attention):
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
            bound = xavier_bound(linear, 0.5**0.5)
            assert bound * 0.99 < linear.weight.abs().max().item() <= bound
            assert linear.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)
            assert 0.9 / 16 < linear.bias.abs().max().item() <= 1 / 16  # 1 / sqrt(256)
    for linear in (layer.self_attention.out_proj, layer.feed_forward.fc1, layer.feed_forward.fc2):
        assert xavier_bound(linear) * 0.99 < linear.weight.abs().max().item() <= xavier_bound(linear)
        assert torch.count_nonzero(linear.bias) == 0
    embedding = model.get_input_embeddings().weight
    assert torch.count_nonzero(embedding[3]) == 0 and torch.count_nonzero(embedding[4]) == 256
    assert embedding.std().item() == pytest.approx(256**-0.5, rel=0.02)
    assert model.lm_head.weight.data_ptr() == embedding.data_ptr()

    with torch.no_grad():
        embedding[3] = 1.0
    model.save_pretrained(tmp_path)
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert torch.all(loaded.get_input_embeddings().weight[3] == 1.0)
    assert loaded.config.initialization == "fairseq"


def test_a_saved_config_with_label_smoothing_loads_and_keeps_it(tmp_path) -> None:
    """Folders saved when 0.1 was the config's default still load, their loss smoothed as their config says."""
    make_model(**TINY_MODEL).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"label_smoothing": 0.1}))
    model = VaswaniForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert model.config.label_smoothing == 0.1
    source, source_mask = padded_batch(VOCAB_SIZE, [6, 4])
    labels = torch.tensor([[9, 12, 2, -100], [33, 2, -100, -100]])
    out = model(input_ids=source, attention_mask=source_mask, labels=labels)
    flat_logits, flat_labels = out.logits.flatten(0, 1), labels.flatten()
    torch.testing.assert_close(out.loss, nn.functional.cross_entropy(flat_logits, flat_labels, label_smoothing=0.1))
    torch.testing.assert_close(out.nll_loss, nn.functional.cross_entropy(flat_logits, flat_labels))
