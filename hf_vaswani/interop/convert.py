"""Exact conversion of Marian (OPUS-MT) and FSMT (fairseq WMT19) checkpoints into the paper's Transformer.

Both source families are post-LN encoder-decoder Transformers with sinusoidal positions, i.e. the model of
"Attention Is All You Need", so their weights map onto `VaswaniForConditionalGeneration` without approximation: the
converted model gives the same logits (up to float rounding) and, with the copied generation config, the same greedy
and beam-search outputs.

The one layout difference is the positional encoding. Marian and FSMT lay their sinusoids out in halves (sin of every
frequency in dims [0, d/2), cos in [d/2, d)), the paper and this model interleave them (dim 2i = sin, 2i+1 = cos).
A Transformer computes the same function when the model dimension is permuted consistently everywhere: LayerNorm's
mean and variance, residual additions and every matrix product over the model dimension are invariant under a
simultaneous reordering of that axis. So instead of changing the encodings, the weights are permuted with

    our dim 2i <- their dim i,    our dim 2i+1 <- their dim d/2 + i        (`interleave_permutation`)

on every axis that *is* the model dimension: embedding and pre-softmax columns, q/k/v weight input columns, out_proj
weight rows and bias, fc1 input columns, fc2 output rows and bias, LayerNorm weight and bias. Axes that merely have
the same size (the per-head axes: q/k/v output rows and biases, out_proj input columns; the FFN's inner axis) are
left alone, since permuting them would mix heads. Marian's frequencies 10000^(-2i/d), positions from 0, are the
paper's (positional_encoding="sinusoidal"); FSMT's are fairseq's 10000^(-i/(d/2-1)) with positions from pad + 1
("fairseq_sinusoidal").

Other mappings: Marian's `final_logits_bias` becomes `lm_head.bias` (output_bias=True, always, so that the bias stays
a parameter of the converted model even where it is zero); FSMT's `decoder.output_projection` becomes `lm_head`.
Ties follow the source model's actual tensors, not its config flags: share_embeddings when the encoder and decoder
token embeddings are one tensor, tie_word_embeddings when the output projection is the decoder embedding. (transformers'
Marian unties everything when tie_word_embeddings=False even with share_encoder_decoder_embeddings=True, and FSMT with
tie_word_embeddings=True replaces the encoder embedding by the decoder's, vocabulary size included.) Vocabulary sizes
come from the embedding tensors for the same reason. Dropouts and LayerNorm epsilon are copied; label_smoothing is 0,
as both sources train with plain cross-entropy. The source's generation config is copied with
`length_penalty_type="power"` and `max_new_tokens_over_source=None`, so `generate` decodes as the source model does
rather than with the paper's GNMT penalty and source+50 cap.

Refused with a ValueError naming the feature (never converted approximately):
- `activation_function` other than "relu" (Eq. 2; OPUS-MT models often use "swish");
- different encoder and decoder attention heads (`encoder_attention_heads` != `decoder_attention_heads`) or FFN widths
  (`encoder_ffn_dim` != `decoder_ffn_dim`);
- an odd `d_model` (sinusoids need sin/cos pairs);
- pre-LN or extra normalisation declared by config flags some checkpoints carry (BART-era Marian configs, fairseq
  names): `normalize_before`, `encoder_normalize_before`, `decoder_normalize_before`, `normalize_embedding`,
  `layernorm_embedding`, `add_final_layer_norm`;
- learned positions declared by `static_position_embeddings=False`, `encoder_learned_pos` or `decoder_learned_pos`,
  and positional tables whose values are not the expected sinusoids;
- LayerNorms with differing epsilons or without affine parameters;
- any source parameter the mapping does not consume (e.g. a `layernorm_embedding` or final layer norm module).
Training-only settings without a counterpart (`encoder_layerdrop`, `decoder_layerdrop`, `init_std`) are not carried.

Two source behaviours to know when comparing: FSMT numbers positions by counting non-pad tokens, so conversion is
exact for right-padded inputs (what its tokenizer produces); and FSMT's forward with multi-token `decoder_input_ids`
applies no causal mask unless called with `use_cache=False` (its teacher-forcing path), which is what this model
always computes.
"""

import copy
import logging
import math
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoTokenizer,
    FSMTForConditionalGeneration,
    MarianMTModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..data.tokenization import encode_padded
from ..model.configuration_vaswani import VaswaniConfig
from ..model.errors_vaswani import UsageError
from ..model.modeling_vaswani import VaswaniForConditionalGeneration, VaswaniSinusoidalPositionalEncoding

logger = logging.getLogger(__name__)

# BART-family module names (shared by Marian and FSMT layers) -> this model's.
_LAYER_MODULES = {
    "self_attn": "self_attention",
    "encoder_attn": "cross_attention",
    "self_attn_layer_norm": "self_attention_norm",
    "encoder_attn_layer_norm": "cross_attention_norm",
    "final_layer_norm": "feed_forward_norm",
    "fc1": "feed_forward.fc1",
    "fc2": "feed_forward.fc2",
}

# Flags that, when true, declare an architecture the paper's post-LN model with sinusoids cannot express.
_REFUSED_FLAGS = {
    "normalize_before": "pre-LN layers",
    "encoder_normalize_before": "pre-LN encoder layers",
    "decoder_normalize_before": "pre-LN decoder layers",
    "normalize_embedding": "layer norm on embeddings",
    "layernorm_embedding": "layer norm on embeddings",
    "add_final_layer_norm": "a final layer norm after the layer stacks",
    "encoder_learned_pos": "learned encoder positions",
    "decoder_learned_pos": "learned decoder positions",
}

# Files a tokenizer may consist of besides its class's own vocabulary files.
_TOKENIZER_FILES = {
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.json",
    "chat_template.jinja",
}

_TOKENIZER_CHECK_TEXTS = ("Hello world, this is a test.", "The cat sat on the mat.")


def interleave_permutation(d_model: int) -> torch.Tensor:
    """Index j holds the source dimension that becomes our dimension j: [0, d/2, 1, d/2 + 1, ...].

    Indexing a halves-layout vector with it gives the interleaved layout: our 2i <- their i, our 2i+1 <- their d/2 + i.
    """
    half = torch.arange(d_model // 2)
    return torch.stack((half, half + d_model // 2), dim=1).flatten()


def layer_target(name: str) -> tuple[str, int | None] | None:
    """Our name for a BART-family layer parameter and the axis that is the model dimension (None: no such axis)."""
    parts = name.split(".")
    # model.{encoder,decoder}.layers.N.<module>[.<projection>].{weight,bias}
    if len(parts) not in (6, 7) or parts[:1] != ["model"] or parts[2] != "layers":
        return None
    if parts[1] not in ("encoder", "decoder"):
        return None
    stack, index, module, kind = parts[1], parts[3], parts[4], parts[-1]
    if module not in _LAYER_MODULES or kind not in ("weight", "bias"):
        return None
    prefix = f"model.{stack}.layers.{index}.{_LAYER_MODULES[module]}"
    if len(parts) == 7:
        projection = parts[5]
        if module not in ("self_attn", "encoder_attn") or projection not in ("q_proj", "k_proj", "v_proj", "out_proj"):
            return None
        if projection == "out_proj":
            return f"{prefix}.out_proj.{kind}", 0  # heads -> model: rows and bias live on the model axis
        return f"{prefix}.{projection}.{kind}", 1 if kind == "weight" else None  # model -> heads: input columns only
    if module == "fc1":
        return f"{prefix}.{kind}", 1 if kind == "weight" else None  # model -> inner: input columns only
    if module == "fc2":
        return f"{prefix}.{kind}", 0  # inner -> model
    if module.endswith("layer_norm"):
        return f"{prefix}.{kind}", 0
    return None


def _check_expressible(source: PreTrainedModel, positional_flag_name: str | None = None) -> None:
    """Raise ValueError for what the paper's model cannot express, naming the config field."""
    config = source.config
    if config.activation_function != "relu":
        raise UsageError(
            f"cannot convert activation_function={config.activation_function!r}: the paper's feed-forward network is "
            "ReLU (Eq. 2)"
        )
    if config.encoder_attention_heads != config.decoder_attention_heads:
        raise UsageError(
            f"cannot convert different attention heads in encoder ({config.encoder_attention_heads}) and decoder "
            f"({config.decoder_attention_heads}): the paper's model has one num_heads"
        )
    if config.encoder_ffn_dim != config.decoder_ffn_dim:
        raise UsageError(
            f"cannot convert different feed-forward widths in encoder ({config.encoder_ffn_dim}) and decoder "
            f"({config.decoder_ffn_dim}): the paper's model has one d_ff"
        )
    if config.d_model % 2 != 0:
        raise UsageError(f"cannot convert odd d_model={config.d_model}: sinusoidal encodings need sin/cos pairs")
    for flag, feature in _REFUSED_FLAGS.items():
        if getattr(config, flag, False):
            raise UsageError(f"cannot convert {feature} ({flag}=True): the paper's model is post-LN with sinusoids")
    # BART-era Marian configs say static_position_embeddings=True for sinusoids; False meant learned positions.
    if positional_flag_name is not None and getattr(config, positional_flag_name, True) is False:
        raise UsageError(f"cannot convert learned positions ({positional_flag_name}=False): only sinusoids convert")
    norms = [module for module in source.modules() if isinstance(module, nn.LayerNorm)]
    if any(not norm.elementwise_affine or norm.bias is None for norm in norms):
        raise UsageError("cannot convert LayerNorms without weight and bias")
    if len({norm.eps for norm in norms}) > 1:
        raise UsageError(f"cannot convert differing LayerNorm epsilons {sorted({norm.eps for norm in norms})}")


def _check_positions(table: torch.Tensor, first_position: int, fairseq: bool, where: str) -> None:
    """Refuse a positional table that is not the sinusoid the converted model will compute instead of storing."""
    d_model = table.shape[1]
    positions = VaswaniSinusoidalPositionalEncoding(d_model, fairseq, first_position)
    ours = positions(torch.arange(table.shape[0] - first_position))
    expected = ours[:, torch.argsort(interleave_permutation(d_model))]  # back to the sources' halves layout
    rows = table[first_position:].detach().to("cpu", torch.float32)
    # Float32 sinusoids differ by ~1e-5 at large positions; learned tables by O(0.1).
    if not torch.allclose(rows, expected, atol=1e-3, rtol=0):
        raise UsageError(f"cannot convert non-sinusoidal positions: {where} does not hold the expected sinusoids")


def _same_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.shape == second.shape and first.data_ptr() == second.data_ptr()


def _convert(
    source: PreTrainedModel,
    *,
    renames: dict[str, tuple[str, int | None]],
    ignored: set[str],
    encoder_embedding: torch.Tensor,
    decoder_embedding: torch.Tensor,
    output_projection: torch.Tensor,
    positional_encoding: str,
    output_bias: bool,
) -> VaswaniForConditionalGeneration:
    """Build the config, permute and rename every source tensor, load them, copy the generation config."""
    config = source.config
    norms = [module for module in source.modules() if isinstance(module, nn.LayerNorm)]
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    vaswani_config = VaswaniConfig(
        vocab_size=decoder_embedding.shape[0],
        source_vocab_size=encoder_embedding.shape[0],
        d_model=config.d_model,
        d_ff=config.encoder_ffn_dim,
        num_heads=config.encoder_attention_heads,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        label_smoothing=0.0,
        positional_encoding=positional_encoding,
        max_position_embeddings=config.max_position_embeddings,
        layer_norm_eps=norms[0].eps if norms else 1e-5,
        share_embeddings=_same_storage(encoder_embedding, decoder_embedding),
        tie_word_embeddings=_same_storage(output_projection, decoder_embedding),
        scale_embedding=config.scale_embedding,
        output_bias=output_bias,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        decoder_start_token_id=config.decoder_start_token_id,
    )

    permutation = interleave_permutation(config.d_model)
    converted: dict[str, torch.Tensor] = {}
    unconsumed = []
    for name, tensor in source.state_dict().items():
        if name in ignored:
            continue
        target = renames.get(name) or layer_target(name)
        if target is None:
            unconsumed.append(name)
            continue
        our_name, model_axis = target
        tensor = tensor.detach().to("cpu")
        if model_axis is not None:
            tensor = tensor.index_select(model_axis, permutation)
        converted[our_name] = tensor.reshape(-1) if our_name == "lm_head.bias" else tensor
    if unconsumed:
        raise UsageError(
            "cannot convert parameters with no counterpart in the paper's model (e.g. layernorm_embedding or a final "
            f"layer norm): {unconsumed}"
        )

    model = VaswaniForConditionalGeneration(vaswani_config)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(converted)), sorted(set(converted) - set(expected))
    wrong_shapes = [name for name in converted if name in expected and converted[name].shape != expected[name].shape]
    if missing or unexpected or wrong_shapes:
        # A source whose structure differs from its config (e.g. a layer count edited by hand) lands here.
        raise UsageError(
            f"source tensors do not fit the paper's model: missing {missing}, unexpected {unexpected}, "
            f"wrong shapes {wrong_shapes}"
        )
    model.load_state_dict(converted, strict=True)
    model.to(device=encoder_embedding.device, dtype=encoder_embedding.dtype)
    model.train(source.training)

    generation_config = copy.deepcopy(source.generation_config)
    # A config marked as derived from the model config (as most Marian/FSMT ones are) loads back without its
    # non-standard keys, which would silently restore the paper's decoding: it is this model's own config now.
    generation_config._from_model_config = False
    # Decode exactly as the source: transformers' score / length**length_penalty and no source-relative length cap.
    generation_config.length_penalty_type = "power"
    generation_config.max_new_tokens_over_source = None
    model.generation_config = generation_config
    return model


def from_marian(model: MarianMTModel) -> VaswaniForConditionalGeneration:
    """Convert a MarianMTModel (shared or separate vocabularies, tied or untied output) exactly, or raise ValueError."""
    if not isinstance(model, MarianMTModel):
        raise TypeError(f"from_marian needs a MarianMTModel, got {type(model).__name__}")
    _check_expressible(model, positional_flag_name="static_position_embeddings")
    for stack in (model.model.encoder, model.model.decoder):
        # Marian counts positions from 0 with the paper's frequencies.
        where = f"{type(stack).__name__}.embed_positions"
        _check_positions(stack.embed_positions.weight, 0, fairseq=False, where=where)
    return _convert(
        model,
        renames={
            "model.encoder.embed_tokens.weight": ("model.encoder.embeddings.embed_tokens.weight", 1),
            "model.decoder.embed_tokens.weight": ("model.decoder.embeddings.embed_tokens.weight", 1),
            "lm_head.weight": ("lm_head.weight", 1),
            "final_logits_bias": ("lm_head.bias", None),
        },
        # `shared` reaches the forward only through the encoder/decoder embeddings it may be tied to.
        ignored={"model.shared.weight", "model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"},
        encoder_embedding=model.model.encoder.embed_tokens.weight,
        decoder_embedding=model.model.decoder.embed_tokens.weight,
        output_projection=model.lm_head.weight,
        positional_encoding="sinusoidal",
        output_bias=True,
    )


def from_fsmt(model: FSMTForConditionalGeneration) -> VaswaniForConditionalGeneration:
    """Convert an FSMTForConditionalGeneration (separate or tied vocabularies) exactly, or raise ValueError."""
    if not isinstance(model, FSMTForConditionalGeneration):
        raise TypeError(f"from_fsmt needs an FSMTForConditionalGeneration, got {type(model).__name__}")
    _check_expressible(model)
    if model.config.pad_token_id is None:
        raise UsageError("cannot convert FSMT without pad_token_id: its positions are counted from pad_token_id + 1")
    for stack in (model.model.encoder, model.model.decoder):
        # Positions start at pad + 1; rows up to pad are never used by real tokens.
        _check_positions(
            stack.embed_positions.weight,
            model.config.pad_token_id + 1,
            fairseq=True,
            where=f"{type(stack).__name__}.embed_positions",
        )
    return _convert(
        model,
        renames={
            "model.encoder.embed_tokens.weight": ("model.encoder.embeddings.embed_tokens.weight", 1),
            "model.decoder.embed_tokens.weight": ("model.decoder.embeddings.embed_tokens.weight", 1),
            "model.decoder.output_projection.weight": ("lm_head.weight", 1),
        },
        ignored={"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"},
        encoder_embedding=model.model.encoder.embed_tokens.weight,
        decoder_embedding=model.model.decoder.embed_tokens.weight,
        output_projection=model.model.decoder.output_projection.weight,
        positional_encoding="fairseq_sinusoidal",
        output_bias=False,
    )


_CONVERTERS = {
    "marian": (MarianMTModel, from_marian),
    "fsmt": (FSMTForConditionalGeneration, from_fsmt),
}


def _tokenizer_matches(original: PreTrainedTokenizerBase, folder: Path) -> bool:
    """Whether AutoTokenizer loads from `folder` and encodes and decodes like `original`."""
    try:
        reloaded = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as error:  # any loading failure means the saved files are unusable
        logger.warning("the saved tokenizer does not load: %s", error)
        return False
    for text in _TOKENIZER_CHECK_TEXTS:
        ids = original(text)["input_ids"]
        if reloaded(text)["input_ids"] != ids or reloaded.decode(ids) != original.decode(ids):
            return False
    return True


def _copy_tokenizer_files(tokenizer: PreTrainedTokenizerBase, source_dir: Path, output_dir: Path) -> None:
    names = _TOKENIZER_FILES | set(getattr(tokenizer, "vocab_files_names", {}).values())
    for name in sorted(names):
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, output_dir / name)


def _check_logits(
    source: PreTrainedModel, converted: VaswaniForConditionalGeneration, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A last guard against a silently wrong conversion: teacher-forced logits on a tokenized sentence agree."""
    encoded = encode_padded(tokenizer, list(_TOKENIZER_CHECK_TEXTS))
    inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    config = converted.config
    # Any target tokens do; pad is avoided after the start because FSMT treats pad tokens specially.
    targets = [token for token in range(config.vocab_size) if token != config.pad_token_id][:7]
    decoder_input_ids = torch.tensor([[config.decoder_start_token_id, *targets]]).expand(len(encoded["input_ids"]), -1)
    with torch.no_grad():
        # use_cache=False: FSMT applies its causal mask only then (see the module docstring)
        expected = source(**inputs, decoder_input_ids=decoder_input_ids, use_cache=False).logits
        actual = converted(**inputs, decoder_input_ids=decoder_input_ids, use_cache=False).logits
    difference = (expected.float() - actual.float()).abs().max().item()
    if not math.isfinite(difference) or difference > 1e-3 * max(1.0, expected.abs().max().item()):
        raise RuntimeError(f"converted logits differ from the source's by {difference}")


def convert_folder(kind: str, source_dir: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """Convert a local saved MarianMTModel ("marian") or FSMT ("fsmt") folder into a Hub-ready Vaswani folder.

    The output holds the weights, remote code, generation config, translation pipeline and the source's tokenizer, and
    loads with AutoModelForSeq2SeqLM + AutoTokenizer (trust_remote_code=True where hf_vaswani is not installed).
    """
    if kind not in _CONVERTERS:
        raise UsageError(f"kind must be one of {sorted(_CONVERTERS)}, got {kind!r}")
    source_dir, output_dir = Path(source_dir), Path(output_dir)
    model_class, convert = _CONVERTERS[kind]
    try:  # a folder that is no model of this kind, or ships code of its own: transformers' ValueError or OSError
        model_type = AutoConfig.from_pretrained(source_dir, local_files_only=True, trust_remote_code=False).model_type
        if model_type != kind:
            raise UsageError(f"{source_dir} holds a {model_type!r} model, not {kind!r}")
        source = model_class.from_pretrained(source_dir, local_files_only=True, trust_remote_code=False).eval()
    except (OSError, ValueError) as error:
        if isinstance(error, UsageError):
            raise
        raise UsageError(f"cannot load {source_dir} as a {kind} model: {str(error).strip().splitlines()[0]}") from None
    try:
        # no local_files_only here: tokenizers persist their loading arguments into the tokenizer_config.json we save
        tokenizer = AutoTokenizer.from_pretrained(source_dir, trust_remote_code=False)
    except Exception as error:
        raise UsageError(f"{source_dir} has no loadable tokenizer, which the translation folder needs") from error
    converted = convert(source).eval()
    _check_logits(source, converted, tokenizer)

    converted.save_pretrained(output_dir)
    try:
        tokenizer.save_pretrained(output_dir)
    except Exception as error:  # a tokenizer that cannot write itself: its source files are copied below instead
        logger.warning("saving the tokenizer failed (%s); copying its files from %s instead", error, source_dir)
    if not _tokenizer_matches(tokenizer, output_dir):
        _copy_tokenizer_files(tokenizer, source_dir, output_dir)
        if not _tokenizer_matches(tokenizer, output_dir):
            raise RuntimeError(f"the tokenizer of {source_dir} could not be saved to {output_dir} in a loadable form")
    return output_dir


__all__ = ["convert_folder", "from_fsmt", "from_marian", "interleave_permutation"]
