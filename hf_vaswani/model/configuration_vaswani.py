"""Configuration of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

This file travels to the Hub with `trust_remote_code`: it imports only transformers (and its huggingface_hub).
"""

import dataclasses
import difflib
import math
from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers import GenerationConfig, PreTrainedConfig
from transformers.utils import logging

from .errors_vaswani import UsageError

logger = logging.get_logger(__name__)

# Keys that transformers passes to a config, or writes into config.json, which are neither fields nor attributes of
# PreTrainedConfig: arguments its __post_init__ and from_dict consume, and entries added for remote code, custom
# pipelines and quantized weights.
TRANSFORMERS_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation_internal",
        "_experts_implementation_internal",
        "attn_implementation",
        "experts_implementation",
        "auto_map",
        "custom_pipelines",
        "quantization_config",
    }
)
# Keys that config.json files of this model may hold and that nothing reads any more: dropped when loading.
# loss_without_logits: the chunked training loss is chosen per forward call (`return_logits=False`).
RETIRED_KEYS = frozenset({"loss_without_logits"})


@strict
class VaswaniConfig(PreTrainedConfig):
    r"""
    The paper's post-LN encoder-decoder Transformer. Defaults are the base model of Table 3 with the paper's residual
    dropout 0.1 (§5.4), no attention or ReLU dropout (as in the reference code) and LayerNorm epsilon 1e-6. The loss is
    the cross-entropy, as transformers' models return it: the paper's label smoothing 0.1 (§5.4) is a choice of
    training (`VaswaniTrainer` applies the Trainer's `label_smoothing_factor`).

    Args:
        vocab_size: size of the shared source/target vocabulary (the paper's BPE has ~37k tokens for En-De).
        d_model: model width (§3.1).
        d_ff: inner width of the position-wise feed-forward network (§3.3).
        num_heads: h, the number of attention heads (§3.2.2).
        d_k: query/key width per head; defaults to d_model // num_heads. Table 3 (B) varies it freely.
        d_v: value width per head; defaults to d_model // num_heads.
        encoder_layers, decoder_layers: N for each stack (§3.1).
        dropout: P_drop, applied to each sub-layer output and to embeddings + positional encodings (§5.4).
        attention_dropout: dropout on attention weights (0 in the paper's code).
        activation_dropout: dropout after the FFN's ReLU (0 in the paper's code).
        label_smoothing: eps_ls of the loss the model returns with labels when a call sets none (§5.4); 0: the
            cross-entropy.
        positional_encoding: "sinusoidal" (§3.5, no length limit) or "learned" (Table 3 row E); "fairseq_sinusoidal"
            is fairseq's variant for converted checkpoints: frequencies 10000^(-i / (d_model/2 - 1)) and positions
            counted from pad_token_id + 1.
        max_position_embeddings: number of learned positions; unused by sinusoidal encodings.
        layer_norm_eps: epsilon of every LayerNorm.
        initialization: "tensor2tensor" (the reference code's, as the paper trained) or "fairseq" (fairseq's
            transformer: xavier-uniform projections, q/k/v at gain 1/sqrt(2), zero padding embedding), for
            reproducing results trained with fairseq.
        share_embeddings: one embedding matrix for source and target tokens (§3.4).
        source_vocab_size: size of a separate source vocabulary (share_embeddings=False); defaults to vocab_size.
        tie_word_embeddings: the pre-softmax projection shares the target embedding matrix (§3.4).
        scale_embedding: multiply embeddings by sqrt(d_model) (§3.4).
        output_bias: a bias on the pre-softmax projection; not in the paper, present in converted Marian checkpoints.
    """

    model_type = "vaswani"
    keys_to_ignore_at_inference = ["cache"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "num_hidden_layers": "encoder_layers",
    }

    vocab_size: int = 37000
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    d_k: int | None = None
    d_v: int | None = None
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    label_smoothing: float | int = 0.0
    positional_encoding: Literal["sinusoidal", "learned", "fairseq_sinusoidal"] | str = "sinusoidal"
    max_position_embeddings: int = 1024
    layer_norm_eps: float = 1e-6
    initialization: Literal["tensor2tensor", "fairseq"] | str = "tensor2tensor"
    share_embeddings: bool = True
    source_vocab_size: int | None = None
    tie_word_embeddings: bool = True
    scale_embedding: bool = True
    output_bias: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    decoder_start_token_id: int | None = None
    is_encoder_decoder: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        for key in RETIRED_KEYS:
            kwargs.pop(key, None)
        self._check_keys(kwargs)
        self._check_values()
        # The paper leaves d_k and d_v free (Table 3 row B); by default they split d_model evenly over the heads.
        self.d_k = self.d_k if self.d_k is not None else self.d_model // self.num_heads
        self.d_v = self.d_v if self.d_v is not None else self.d_model // self.num_heads
        if self.source_vocab_size is None:
            self.source_vocab_size = self.vocab_size
        if self.decoder_start_token_id is None:
            self.decoder_start_token_id = self.bos_token_id
        super().__post_init__(**kwargs)

    @classmethod
    def unknown_keys(cls, keys) -> list[str]:
        """The keys among `keys` that neither this config nor transformers knows."""
        # PreTrainedConfig drops these itself; private, and no public name gives this set
        # (tests/interop/test_private_api.py)
        generation_keys = GenerationConfig._get_default_generation_params()
        return [
            key
            for key in keys
            if not (hasattr(cls, key) and not callable(getattr(cls, key)))  # a field or property
            and key not in cls.attribute_map
            and key not in TRANSFORMERS_KEYS
            and key not in generation_keys
        ]

    def _check_keys(self, kwargs: dict) -> None:
        """Refuses keys that neither this config nor transformers knows when a config is built from code: a misspelt
        field would otherwise be kept as an attribute nobody reads while the field keeps its default."""
        for key in self.unknown_keys(kwargs):
            fields = [field.name for field in dataclasses.fields(self)]
            suggestion = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {suggestion[0]!r}?" if suggestion else ""
            raise UsageError(f"{type(self).__name__} has no key {key!r}{hint}")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """What `save_pretrained` writes, `from_pretrained` reads: keys another tool set on a config (as PEFT and TRL
        do) are kept as attributes, with a warning, as transformers' own configs keep them."""
        unknown = cls.unknown_keys(key for key in config_dict if key not in RETIRED_KEYS)
        known = {key: value for key, value in config_dict.items() if key not in unknown}
        loaded = super().from_dict(known, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if unknown:
            logger.warning(f"{cls.__name__}: keeping keys it does not read: {', '.join(sorted(unknown))}")
        for key in unknown:
            setattr(config, key, config_dict[key])
        return loaded

    def _check_values(self) -> None:
        # Raise plain ValueErrors naming the field: strict's own validators wrap errors in a non-ValueError class.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"{field.name} must be a finite number, got {value}")
            if isinstance(value, int) and abs(value) >= 2**63:  # torch's sizes are 64-bit: it would fail building
                raise UsageError(f"{field.name} must fit in 64 bits, got {value}")
        for name in (
            "vocab_size",
            "source_vocab_size",
            "d_model",
            "d_ff",
            "num_heads",
            "encoder_layers",
            "decoder_layers",
            "max_position_embeddings",
            "d_k",
            "d_v",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"{name} must be a positive integer, got {value}")
        if (self.d_k is None or self.d_v is None) and self.d_model % self.num_heads != 0:
            raise UsageError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}) unless d_k and d_v "
                "are given explicitly"
            )
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UsageError(f"{name} must be in [0, 1), got {value}")
        if self.positional_encoding not in ("sinusoidal", "learned", "fairseq_sinusoidal"):
            raise UsageError(
                "positional_encoding must be 'sinusoidal', 'learned' or 'fairseq_sinusoidal', "
                f"got {self.positional_encoding!r}"
            )
        if self.positional_encoding.endswith("sinusoidal") and self.d_model % 2 != 0:
            raise UsageError(f"d_model must be even for sinusoidal positional_encoding, got {self.d_model}")
        if self.share_embeddings and self.source_vocab_size not in (None, self.vocab_size):
            raise UsageError(
                f"source_vocab_size ({self.source_vocab_size}) must equal vocab_size ({self.vocab_size}) when "
                "share_embeddings is True"
            )
        if self.initialization not in ("tensor2tensor", "fairseq"):
            raise UsageError(f"initialization must be 'tensor2tensor' or 'fairseq', got {self.initialization!r}")
        if self.layer_norm_eps <= 0:
            raise UsageError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise UsageError(f"{name} ({value}) is outside the vocabulary [0, {self.vocab_size})")

    @classmethod
    def base(cls, **overrides) -> "VaswaniConfig":
        """Table 3 "base": N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1."""
        return cls(**overrides)

    @classmethod
    def big(cls, **overrides) -> "VaswaniConfig":
        """Table 3 "big": N=6, d_model=1024, d_ff=4096, h=16, d_k=d_v=64, P_drop=0.3."""
        return cls(**{"d_model": 1024, "d_ff": 4096, "num_heads": 16, "dropout": 0.3, **overrides})


__all__ = ["VaswaniConfig"]
