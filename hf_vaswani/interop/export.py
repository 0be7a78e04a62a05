"""Export to HF's MarianMTModel and to CTranslate2, the inverse direction of `convert.py`.

`to_marian(model)` gives a `MarianMTModel` computing the same logits as our model. Marian lays its sinusoids out in
halves where we interleave them, so, as in `from_marian`, the weights are permuted along every axis that is the model
dimension (a Transformer is invariant under a consistent reordering of that axis), here with the inverse of
`interleave_permutation`: their dim i <- our dim 2i, their dim d/2 + i <- our dim 2i + 1. Our output bias, if any,
becomes `final_logits_bias` (zeros otherwise). MarianMTModel's LayerNorms have no epsilon setting (torch's 1e-5 is
built in), so the returned model's LayerNorm modules are given ours (the paper's 1e-6): the object computes our
function, but a copy saved with `save_pretrained` and loaded again has 1e-5.

`export_ctranslate2(model_folder, output_dir, quantization)` converts that Marian model with CTranslate2's converter
for the BART family (the same module layout; configured post-LN, without embedding LayerNorm) rather than its Marian
loader, because the Marian loader assumes native Marian checkpoints in two ways that would change our model: it
starts the decoder from a zero vector instead of the start token's embedding (ours is `<s>`, a trained row), and it
drops the last vocabulary row as Marian's `<pad>` (ours is id 0). The converted model uses our tokenizer's token
strings (`tokenizer.convert_ids_to_tokens`), whose files are saved next to it, and our LayerNorm epsilon.

What the CTranslate2 model does not carry (it has no decoding configuration of its own):
- CTranslate2's `length_penalty` divides a hypothesis' log-probability by length^alpha, as transformers does, not
  by the paper's GNMT ((5 + length) / 6)^alpha; its beam search therefore matches ours with
  `length_penalty_type="power"`, not the paper's decoding (§6.1).
- It has no source-relative length cap (ours: source length + 50); `max_decoding_length` is absolute.
- Positions are a stored table of `max_position_embeddings` sinusoids (1024 by default), where ours have no limit:
  CTranslate2 refuses longer sequences (and truncates sources to `max_input_length`, 1024 by default).

Refused by name (ValueError), never approximated: learned or fairseq positions, d_k or d_v other than
d_model / num_heads (MarianMTModel and CTranslate2 split d_model evenly over the heads), and for CTranslate2 a source
vocabulary of another size than the target's (its converter and our tokenizer have one vocabulary for both sides) and
a tokenizer whose vocabulary is not exactly the model's or that has no unk token.
"""

import os
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig, MarianConfig, MarianMTModel, PreTrainedTokenizerBase

from ..decoding.shortlist import Shortlist, write_ctranslate2_vocabulary_map
from ..model.configuration_vaswani import VaswaniConfig
from ..model.errors_vaswani import UsageError
from ..model.generation_vaswani import length_penalty_type
from ..model.modeling_vaswani import VaswaniForConditionalGeneration
from .convert import interleave_permutation, layer_target

# Marian's parameters outside the layers -> ours, with the axis that is the model dimension.
_EMBEDDING_SOURCES = {
    "model.shared.weight": ("model.encoder.embeddings.embed_tokens.weight", 1),
    "model.encoder.embed_tokens.weight": ("model.encoder.embeddings.embed_tokens.weight", 1),
    "model.decoder.embed_tokens.weight": ("model.decoder.embeddings.embed_tokens.weight", 1),
    "lm_head.weight": ("lm_head.weight", 1),
}
# Marian computes its own sinusoids; the permutation makes them ours.
_MARIAN_POSITIONS = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}


def check_marian_expressible(config: VaswaniConfig) -> None:
    """Raise ValueError naming what a MarianMTModel cannot express."""
    if config.positional_encoding != "sinusoidal":
        raise UsageError(
            f"cannot export positional_encoding={config.positional_encoding!r}: MarianMTModel and CTranslate2's "
            "Transformer have the paper's sinusoids only"
        )
    head_size = config.d_model // config.num_heads
    if config.d_model % config.num_heads != 0 or config.d_k != head_size or config.d_v != head_size:
        raise UsageError(
            f"cannot export d_k={config.d_k}, d_v={config.d_v} with d_model={config.d_model} and "
            f"num_heads={config.num_heads}: MarianMTModel and CTranslate2 need d_k = d_v = d_model / num_heads"
        )


def to_marian(model: VaswaniForConditionalGeneration) -> MarianMTModel:
    """A MarianMTModel with the same logits as `model` (weights permuted, see the module docstring), or ValueError."""
    config = model.config
    check_marian_expressible(config)
    marian_config = MarianConfig(
        vocab_size=config.source_vocab_size,
        decoder_vocab_size=config.vocab_size,
        share_encoder_decoder_embeddings=config.share_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function="relu",
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        max_position_embeddings=config.max_position_embeddings,
        scale_embedding=config.scale_embedding,
        # Read by CTranslate2's BART-family converter (and by from_marian): post-LN, sinusoids, no embedding norm.
        static_position_embeddings=True,
        normalize_before=False,
        normalize_embedding=False,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,  # Marian's default forces </s> at the length limit; our model does not
    )
    marian = MarianMTModel(marian_config)

    ours = model.state_dict()
    to_halves = torch.argsort(interleave_permutation(config.d_model))
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in marian.state_dict().items():
        if name in _MARIAN_POSITIONS:
            weights[name] = tensor
        elif name == "final_logits_bias":
            weights[name] = ours["lm_head.bias"].reshape(1, -1) if config.output_bias else torch.zeros_like(tensor)
        else:
            our_name, model_axis = _EMBEDDING_SOURCES.get(name) or layer_target(name)
            weight = ours[our_name].detach().to("cpu", torch.float32)
            weights[name] = weight.index_select(model_axis, to_halves) if model_axis is not None else weight
    marian.load_state_dict(weights, strict=True)
    for module in marian.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = config.layer_norm_eps
    marian.to(device=model.device, dtype=model.dtype)
    return marian.train(model.training)


def check_vocabulary(model: VaswaniForConditionalGeneration, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The token strings by id, checked to be the model's one vocabulary (ValueError otherwise)."""
    config = model.config
    if config.eos_token_id is None or tokenizer.unk_token is None:
        raise UsageError(
            "cannot export a model without eos_token_id or a tokenizer without unk_token: CTranslate2 needs both"
        )
    if config.source_vocab_size != config.vocab_size:
        raise UsageError(
            f"cannot export source_vocab_size={config.source_vocab_size} != vocab_size={config.vocab_size}: "
            "CTranslate2's converter and our tokenizer have one vocabulary for both sides"
        )
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if len(tokens) != config.vocab_size or len(set(tokens)) != len(tokens):
        raise UsageError(
            f"the tokenizer has {len(set(tokens))} distinct tokens for ids 0..{len(tokens) - 1}, the model's "
            f"vocabulary {config.vocab_size}: CTranslate2 needs one token string per vocabulary row"
        )
    return tokens


def write_ctranslate2(
    model: VaswaniForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    output_dir: str | os.PathLike,
    quantization: str = "float32",
    shortlist: Shortlist | None = None,
) -> Path:
    """Write `model` as a CTranslate2 model with `tokenizer`'s files beside it, into a new or empty `output_dir`; with
    `shortlist`, its lists as CTranslate2's vocabulary map."""
    try:
        from ctranslate2.converters.converter import Converter
        from ctranslate2.converters.transformers import BartLoader
        from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES
    except ImportError:
        raise UsageError(
            "CTranslate2 is not installed: pip install ctranslate2 (in a clone of hf_vaswani: pip install '.[export]')"
        ) from None
    if quantization not in ACCEPTED_MODEL_TYPES:
        raise UsageError(f"quantization must be one of {', '.join(ACCEPTED_MODEL_TYPES)}, got {quantization!r}")
    output_dir = Path(output_dir)
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise UsageError(f"{output_dir} already exists and is not an empty folder")
    tokens = check_vocabulary(model, tokenizer)
    config, start = model.config, model.config.decoder_start_token_id
    marian = to_marian(model).float().eval()

    class MarianModelConverter(Converter):
        """CTranslate2's Converter over an in-memory model: validation, quantization and saving are its own."""

        def _load(self):
            spec = BartLoader()(marian, tokenizer)  # our token strings; the start token is our decoder start
            # The special tokens are the model's ids (the loader reads the tokenizer's attributes, which may be unset).
            spec.config.eos_token = tokens[config.eos_token_id]
            spec.config.bos_token = tokens[config.bos_token_id if config.bos_token_id is not None else start]
            spec.config.layer_norm_epsilon = config.layer_norm_eps
            return spec

    with tempfile.TemporaryDirectory() as scratch:
        vocabulary_map = None
        if shortlist is not None:  # the same lists for both engines: translate_batch(..., use_vmap=True)
            vocabulary_map = str(Path(scratch) / "vmap.txt")
            write_ctranslate2_vocabulary_map(shortlist, tokens, vocabulary_map)
        # force: the folder is new or empty (checked above), and the converter recreates it.
        MarianModelConverter().convert(str(output_dir), vmap=vocabulary_map, quantization=quantization, force=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def decoding_note(generation_config: GenerationConfig, shortlist: bool = False) -> str:
    """How to decode the CTranslate2 model as closely as it can to `generation_config` (and the model's shortlist, as
    its vocabulary map), and what differs."""
    beams = generation_config.num_beams or 1
    alpha = generation_config.length_penalty if generation_config.length_penalty is not None else 1.0
    vocabulary_map = ", use_vmap=True (the shortlist)" if shortlist else ""
    note = f"decode with translator.translate_batch(tokens, beam_size={beams}, length_penalty={alpha}{vocabulary_map})"
    differences = []
    if beams > 1 and length_penalty_type(generation_config) != "power":
        differences.append(
            f"CTranslate2's length penalty divides by length^{alpha} (transformers' form), not the paper's GNMT "
            f"((5 + length) / 6)^{alpha}"
        )
    if getattr(generation_config, "max_new_tokens_over_source", None) is not None:
        differences.append(
            f"it has no source length + {generation_config.max_new_tokens_over_source} cap (max_decoding_length is "
            "absolute)"
        )
    return note + (f"; {'; '.join(differences)}" if differences else "")


def export_ctranslate2(
    model_folder: str | os.PathLike, output_dir: str | os.PathLike, quantization: str = "float32"
) -> Path:
    """Convert a saved vaswani model folder into a CTranslate2 model folder (model, vocabulary, our tokenizer, and the
    folder's shortlist as a vocabulary map where it holds one)."""
    from ..decoding.loading import load_model_folder

    model, tokenizer = load_model_folder(model_folder)
    shortlist = Shortlist.saved_in(model_folder, model.config.vocab_size)
    return write_ctranslate2(model, tokenizer, output_dir, quantization, shortlist)


__all__ = [
    "check_marian_expressible",
    "check_vocabulary",
    "decoding_note",
    "export_ctranslate2",
    "to_marian",
    "write_ctranslate2",
]
