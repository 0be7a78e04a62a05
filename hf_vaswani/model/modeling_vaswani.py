"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), section 3, as a transformers model.

Classes follow the paper: attention (§3.2.1), multi-head attention (§3.2.2), the position-wise feed-forward network
(§3.3), embeddings (§3.4) with positional encodings (§3.5), then the encoder and decoder layers and stacks (§3.1),
the encoder-decoder and the whole model of Figure 1 with its pre-softmax projection (§3.4).

The training loss lives in loss_vaswani.py, the paper's decoding (§6.1) in generation_vaswani.py, input checks in
checks_vaswani.py. This file travels to the Hub with `trust_remote_code`: it imports only torch, transformers and
those sibling modules, through their public API. The installed package attaches faster CPU kernels to the same modules
from outside (`kernelize` of its kernels/cpu.py).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .checks_vaswani import (
    check_inputs,
    check_keyword_arguments,
    check_labels,
    check_source,
    check_token_ids,
    values_wait_for_device,
)
from .configuration_vaswani import VaswaniConfig
from .errors_vaswani import UsageError
from .generation_vaswani import PaperDecodingMixin
from .loss_vaswani import label_smoothed_loss
from .pipeline_vaswani import TRANSLATION_PIPELINE  # also makes save_pretrained copy the pipeline's file


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.2.1, Eq. 1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, masked scores pushed to -inf first.

    The "eager" entry of transformers' attention interface; sdpa, flex and others compute the same function.
    Shapes: query/key (batch, heads, len, d_k), value (batch, heads, len, d_v); returns (batch, len, heads, d_v).
    """
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        # transformers hands eager attention an additive mask holding the dtype's minimum where attention is barred
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attend_with_shared_source(
    attention: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encoder-decoder attention of `group` decoder rows per sentence to one copy of each sentence's keys and values.

    During generation the beams (or returned sequences) of a sentence share its encoder states instead of holding
    `group` copies (generation_vaswani's `_expand_inputs_for_generation`): their queries are stacked along the length
    axis and attend to that one copy together, which is the same attention. `attention` is any of transformers'
    attention functions; returns its output as (batch, length, heads, d_v) and its weights as (batch, heads, length,
    source length), as if the keys and values had been copied.
    """
    batch_size, _, length, _ = query.shape
    group = batch_size // key.shape[0]
    if group * key.shape[0] != batch_size:
        raise UsageError(f"decoder batch {batch_size} is not a multiple of the encoder batch {key.shape[0]}")
    query = query.unflatten(0, (-1, group)).transpose(1, 2).flatten(2, 3)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :1]  # a padding mask: the same row for every query
    output, weights = attention(module, query, key, value, attention_mask, **kwargs)
    if weights is not None:
        weights = weights.unflatten(2, (group, length)).transpose(1, 2).flatten(0, 1)
    # (batch / group, group * length, heads, d_v) holds the same memory order as (batch, length, heads, d_v)
    return output.reshape(batch_size, length, *output.shape[2:]), weights


class VaswaniMultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h projections of each kind are one Linear layer; d_k and d_v are free (Table 3 row B). The projections carry
    biases initialised to zero, as in torch.nn.MultiheadAttention and the released checkpoints of this family.
    """

    def __init__(self, config: VaswaniConfig, layer_idx: int, is_causal: bool = False) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal  # read by the sdpa and flash attention functions
        self.d_k, self.d_v = config.d_k, config.d_v
        self.scaling = config.d_k**-0.5
        self.q_proj = nn.Linear(config.d_model, config.num_heads * config.d_k)
        self.k_proj = nn.Linear(config.d_model, config.num_heads * config.d_k)
        self.v_proj = nn.Linear(config.d_model, config.num_heads * config.d_v)
        self.out_proj = nn.Linear(config.num_heads * config.d_v, config.d_model)

    def attention_function(self) -> Callable:
        """Eq. 1 as the configured entry of transformers' attention interface computes it (eager, sdpa, flex, ...)."""
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention when `key_value_states` is None, else encoder-decoder attention over `key_value_states`."""
        batch_size, length = hidden_states.shape[:2]
        query = self.q_proj(hidden_states).unflatten(-1, (-1, self.d_k)).transpose(1, 2)

        is_cross_attention = key_value_states is not None
        layer_cache = None
        if cache is not None:
            layer_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache
        if is_cross_attention and layer_cache is not None and cache.is_updated.get(self.layer_idx):
            # Encoder outputs do not change while decoding: their keys and values are computed once per generation.
            key, value = layer_cache.layers[self.layer_idx].keys, layer_cache.layers[self.layer_idx].values
        else:
            source = key_value_states if is_cross_attention else hidden_states
            key = self.k_proj(source).unflatten(-1, (-1, self.d_k)).transpose(1, 2)
            value = self.v_proj(source).unflatten(-1, (-1, self.d_v)).transpose(1, 2)
            if layer_cache is not None:
                key, value = layer_cache.update(key, value, self.layer_idx)
                if is_cross_attention:
                    cache.is_updated[self.layer_idx] = True

        attention = self.attention_function()
        if key.shape[0] != batch_size:  # the beams of each sentence share its encoder states while generating
            attention = partial(attend_with_shared_source, attention)
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            dropout=self.config.attention_dropout if self.training else 0.0,
            **kwargs,
        )
        return self.out_proj(output.reshape(batch_size, length, -1)), weights


class VaswaniFeedForward(nn.Module):
    """§3.3, Eq. 2: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately."""

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_dropout(nn.functional.relu(self.fc1(hidden_states))))


class VaswaniSinusoidalPositionalEncoding(nn.Module):
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    Computed for the positions asked for, so any length works, including lengths never seen in training. `fairseq`
    selects fairseq's frequencies 10000^(-i / (d_model/2 - 1)) and first position, for converted checkpoints.
    """

    def __init__(self, d_model: int, fairseq: bool = False, first_position: int = 0) -> None:
        super().__init__()
        self.d_model = d_model
        self.fairseq = fairseq
        self.first_position = first_position

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        i = torch.arange(self.d_model // 2, device=position_ids.device, dtype=torch.float32)
        exponents = i / (self.d_model // 2 - 1) if self.fairseq else 2 * i / self.d_model
        angles = (position_ids + self.first_position).float().unsqueeze(-1) / torch.pow(10000.0, exponents)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleave sin (even), cos (odd)


class VaswaniLearnedPositionalEmbedding(nn.Embedding):
    """Table 3 row (E): learned positional embeddings instead of sinusoids, for positions < max_position_embeddings."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        if (
            not (torch.compiler.is_compiling() or values_wait_for_device(position_ids))
            and position_ids.numel()
            and int(position_ids.max()) >= self.num_embeddings
        ):
            raise UsageError(
                f"position {int(position_ids.max())} is beyond max_position_embeddings={self.num_embeddings} of the "
                "learned positional embeddings; use sinusoidal positional_encoding for unbounded lengths"
            )
        return super().forward(position_ids)


class VaswaniEmbeddings(nn.Module):
    """§3.4-3.5: token embeddings times sqrt(d_model), plus positional encodings, then dropout (§5.4)."""

    def __init__(self, config: VaswaniConfig, vocab_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, config.d_model)
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        if config.positional_encoding == "learned":
            self.positions = VaswaniLearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        elif config.positional_encoding == "fairseq_sinusoidal":
            self.positions = VaswaniSinusoidalPositionalEncoding(config.d_model, True, config.pad_token_id + 1)
        else:
            self.positions = VaswaniSinusoidalPositionalEncoding(config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, past_length: int = 0
    ) -> torch.Tensor:
        """`inputs_embeds`, when given, replaces the token embedding lookup (and is scaled like it)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise UsageError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_length
        positions = self.positions(position_ids).to(inputs_embeds.dtype)
        return self.dropout(inputs_embeds * self.scale + positions)


class VaswaniEncoderLayer(GradientCheckpointingLayer):
    """§3.1 encoder layer: self-attention, then FFN, each sub-layer as LayerNorm(x + Dropout(Sublayer(x)))."""

    def __init__(self, config: VaswaniConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attention = VaswaniMultiHeadAttention(config, layer_idx)
        self.self_attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = VaswaniFeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Unpack[TransformersKwargs]
    ) -> torch.Tensor:
        attended, _ = self.self_attention(hidden_states, attention_mask=attention_mask, **kwargs)
        hidden_states = self.self_attention_norm(hidden_states + self.dropout(attended))
        return self.feed_forward_norm(hidden_states + self.dropout(self.feed_forward(hidden_states)))


class VaswaniDecoderLayer(GradientCheckpointingLayer):
    """§3.1 decoder layer: masked self-attention, encoder-decoder attention, FFN, each as LayerNorm(x + Dropout(.))."""

    def __init__(self, config: VaswaniConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attention = VaswaniMultiHeadAttention(config, layer_idx, is_causal=True)
        self.self_attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.cross_attention = VaswaniMultiHeadAttention(config, layer_idx)
        self.cross_attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = VaswaniFeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attended, _ = self.self_attention(hidden_states, attention_mask=attention_mask, cache=cache, **kwargs)
        hidden_states = self.self_attention_norm(hidden_states + self.dropout(attended))
        attended, _ = self.cross_attention(
            hidden_states,
            attention_mask=encoder_attention_mask,
            key_value_states=encoder_hidden_states,
            cache=cache,
            **kwargs,
        )
        hidden_states = self.cross_attention_norm(hidden_states + self.dropout(attended))
        return self.feed_forward_norm(hidden_states + self.dropout(self.feed_forward(hidden_states)))


class VaswaniPreTrainedModel(PreTrainedModel):
    """Weight initialisation and transformers plumbing shared by the stacks and the full models."""

    config: VaswaniConfig
    config_class = VaswaniConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VaswaniEncoderLayer", "VaswaniDecoderLayer"]
    _supports_sdpa = True
    # attention goes through transformers' AttentionInterface with its masks (tests/model/test_modeling.py registers
    # one)
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # a static cache makes the decoding step one graph (tests/model/test_static_cache.py)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Reference-code (tensor2tensor) init: uniform unit scaling for projections, N(0, d_model^-0.5) embeddings.
        `initialization="fairseq"`: fairseq's transformer instead (xavier-uniform projections; in attention, q/k/v at
        gain 1/sqrt(2) with nn.Linear's default biases; the padding embedding zero)."""
        fairseq = self.config.initialization == "fairseq"
        if isinstance(module, nn.Linear) and fairseq and module in self.attention_inputs():
            init.xavier_uniform_(module.weight, gain=0.5**0.5)
            bound = module.in_features**-0.5  # nn.Linear's default bias
            init.uniform_(module.bias, -bound, bound)
        elif isinstance(module, nn.Linear):
            if fairseq:
                init.xavier_uniform_(module.weight)
            else:
                bound = math.sqrt(3.0 / module.in_features)  # variance 1 / fan_in
                init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
            tokens = not isinstance(module, VaswaniLearnedPositionalEmbedding)
            if fairseq and tokens and self.config.pad_token_id is not None:
                module.weight[self.config.pad_token_id] = 0.0
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)

    def attention_inputs(self) -> list[nn.Linear]:
        """The query, key and value projections of every attention layer."""
        layers = [module for module in self.modules() if isinstance(module, VaswaniMultiHeadAttention)]
        return [projection for layer in layers for projection in (layer.q_proj, layer.k_proj, layer.v_proj)]

    def tie_weights(self, missing_keys: set[str] | None = None, recompute_mapping: bool = True) -> None:
        super().tie_weights(missing_keys=missing_keys, recompute_mapping=recompute_mapping)
        # §3.4's one embedding layer for source and target: one module as well, once transformers has tied its weight
        # (it ties none while it loads). Wrappers that group modules by get_input_embeddings (accelerate's FSDP2) then
        # meet every use of it, the output projection's included where it is tied too.
        for model in [module for module in self.modules() if isinstance(module, VaswaniModel)]:
            source, target = model.encoder.get_input_embeddings(), model.decoder.get_input_embeddings()
            if model.config.share_embeddings and source.weight is target.weight:
                model.decoder.set_input_embeddings(source)

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        # transformers applies `_tied_weights_keys` only under config.tie_word_embeddings, but sharing the source and
        # target embeddings (§3.4) is a switch of its own: the mapping built in __init__ already reflects both.
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        return dict(self._tied_weights_keys or {})


class VaswaniEncoder(VaswaniPreTrainedModel):
    """§3.1 encoder: embedded source, then a stack of N encoder layers."""

    _can_record_outputs = {"hidden_states": VaswaniEncoderLayer, "attentions": VaswaniMultiHeadAttention}

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.embeddings = VaswaniEmbeddings(config, config.source_vocab_size)
        self.layers = nn.ModuleList([VaswaniEncoderLayer(config, i) for i in range(config.encoder_layers)])
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.embed_tokens = value

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutput:
        # checked here rather than in VaswaniModel: generate calls the encoder directly
        check_source(input_ids, inputs_embeds, self.embeddings.embed_tokens, attention_mask)
        hidden_states = self.embeddings(input_ids, inputs_embeds)
        attention_mask = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            # dropping a mask without padding reads it: on an accelerator, a wait for the device
            allow_is_bidirectional_skip=not values_wait_for_device(hidden_states),
        )
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, **kwargs)
        return BaseModelOutput(last_hidden_state=hidden_states)


class VaswaniDecoder(VaswaniPreTrainedModel):
    """§3.1 decoder: embedded target (shifted right), then a stack of N decoder layers attending to the encoder."""

    _can_record_outputs = {
        "hidden_states": VaswaniDecoderLayer,
        "attentions": OutputRecorder(VaswaniMultiHeadAttention, index=1, layer_name="self_attention"),
        "cross_attentions": OutputRecorder(VaswaniMultiHeadAttention, index=1, layer_name="cross_attention"),
    }

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.embeddings = VaswaniEmbeddings(config, config.vocab_size)
        self.layers = nn.ModuleList([VaswaniDecoderLayer(config, i) for i in range(config.decoder_layers)])
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.embed_tokens = value

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")  # its name before transformers 5.24, as Marian
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        if encoder_hidden_states is None:
            raise UsageError("the decoder needs encoder_hidden_states (or encoder_outputs) to attend to")
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        if cache is not None and not isinstance(cache, EncoderDecoderCache):
            raise UsageError(
                f"cache must be an EncoderDecoderCache (self- and cross-attention), got {type(cache).__name__}"
            )
        check_token_ids("decoder_input_ids", input_ids, self.embeddings.embed_tokens.num_embeddings)
        past_length = cache.get_seq_length() if cache is not None else 0
        hidden_states = self.embeddings(input_ids, inputs_embeds, past_length)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            cache=cache.self_attention_cache if cache is not None else None,
        )
        encoder_attention_mask = create_bidirectional_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
            allow_is_bidirectional_skip=not values_wait_for_device(hidden_states),
        )
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,  # positional, so that gradient checkpointing passes it through
                encoder_attention_mask=encoder_attention_mask,
                cache=cache,
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states, cache=cache)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder inputs for teacher forcing: the targets moved one step right behind the start token (§3.1)."""
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


class VaswaniModel(VaswaniPreTrainedModel):
    """The encoder-decoder of Figure 1 without the output projection: returns the decoder's last hidden states."""

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.encoder = VaswaniEncoder(config)
        self.decoder = VaswaniDecoder(config)
        if config.share_embeddings:
            self._tied_weights_keys = {
                "decoder.embeddings.embed_tokens.weight": "encoder.embeddings.embed_tokens.weight"
            }
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.set_input_embeddings(value)
        if self.config.share_embeddings:
            self.decoder.set_input_embeddings(value)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: tuple[torch.Tensor] | BaseModelOutput | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqModelOutput:
        check_keyword_arguments(kwargs)
        if encoder_outputs is not None and not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        past_length = cache.get_seq_length() if isinstance(cache, Cache) else 0
        check_inputs(
            input_ids,
            attention_mask,
            inputs_embeds,
            decoder_input_ids,
            decoder_attention_mask,
            decoder_inputs_embeds,
            encoder_outputs,
            past_length,
            self.get_input_embeddings().weight.device,
        )
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            cache=decoder_outputs.cache,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


@dataclass
class VaswaniSeq2SeqLMOutput(Seq2SeqLMOutput):
    r"""
    nll_loss: the plain cross-entropy of the labelled tokens (fairseq's nll_loss; its exp is the perplexity), not
        differentiable: `loss` itself unless the loss is label-smoothed.
    """

    nll_loss: torch.FloatTensor | None = None


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, PaperDecodingMixin, GenerationMixin):
    """Figure 1 whole: encoder-decoder plus the pre-softmax linear projection (§3.4). With labels, the loss is the
    cross-entropy, label-smoothed as §5.4 trains when asked (`smoothing` per call, or the config's
    `label_smoothing`)."""

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.model = VaswaniModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.output_bias)
        self.loss_function = label_smoothed_loss  # transformers' hook for a model's loss; kernelize may replace it
        self._tied_weights_keys = {f"model.{k}": f"model.{v}" for k, v in (self.model._tied_weights_keys or {}).items()}
        if config.tie_word_embeddings:
            source = "encoder" if config.share_embeddings else "decoder"
            self._tied_weights_keys["lm_head.weight"] = f"model.{source}.embeddings.embed_tokens.weight"
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        # transformers 5 has no translation pipeline: saved folders (and push_to_hub) carry ours, so that
        # pipeline("translation", model=folder_or_repo, trust_remote_code=True) works.
        self.config.custom_pipelines = TRANSLATION_PIPELINE
        super().save_pretrained(save_directory, *args, **kwargs)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "6.0.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: tuple[torch.Tensor] | BaseModelOutput | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_logits: bool = True,
        smoothing: float | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> VaswaniSeq2SeqLMOutput:
        r"""
        labels: target token ids; -100 and the padding id are ignored by the loss, the mean cross-entropy over the
            others. When given without decoder inputs, the decoder is fed the labels shifted right behind
            `decoder_start_token_id`.
        num_items_in_batch: number of target tokens in the whole (accumulated) batch, passed by Trainer; the summed
            loss is divided by it so that gradient accumulation equals one large batch.
        logits_to_keep: logits for the last this many positions only (0: all), or for the positions this tensor
            indexes; `generate` asks for the last one. The loss still covers every labelled position.
        return_logits: False (with labels) returns `logits=None`, what training needs: on the CPU the loss is then
            computed chunk by chunk without ever holding the full-vocabulary logits (loss_vaswani.py).
        smoothing: the label smoothing eps_ls of this call's loss (§5.4 trains with 0.1): the cross-entropy against
            (1 - eps) one_hot(y) + eps / V, the plain cross-entropy still in `nll_loss`; None: the config's
            `label_smoothing` (0 unless set). Not named label_*: Trainer takes such parameters for labels.
        """
        if not return_logits and labels is None:
            raise UsageError("return_logits=False computes the loss without logits: it needs labels")
        if "label_smoothing" in kwargs:  # would pass unread into the attention kwargs
            raise UsageError("label_smoothing is the config's name: forward takes `smoothing`")
        if smoothing is None:
            smoothing = self.config.label_smoothing
        elif not 0.0 <= smoothing < 1.0:
            raise UsageError(f"smoothing must be in [0, 1), got {smoothing}")
        if labels is not None:
            check_labels(
                labels,
                decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds,
                self.config.vocab_size,
                self.get_input_embeddings().weight.device,  # an int8 lm_head's weight is a method
            )
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = loss = nll_loss = None
        if return_logits:
            positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(outputs.last_hidden_state[:, positions])
        if labels is not None:  # from the logits when they cover every position
            loss, nll_loss = self.loss_function(
                outputs.last_hidden_state,
                self.lm_head,
                labels,
                smoothing,
                self.config.pad_token_id,
                num_items_in_batch,
                logits if isinstance(logits_to_keep, int) and logits_to_keep == 0 else None,
            )
        return VaswaniSeq2SeqLMOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
            nll_loss=nll_loss,
        )


__all__ = ["VaswaniPreTrainedModel", "VaswaniModel", "VaswaniForConditionalGeneration", "VaswaniSeq2SeqLMOutput"]
