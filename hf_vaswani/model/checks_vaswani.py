"""Checks at the model's public entry points: inputs that do not belong together are refused before any computation.

Without them, a decoder batch larger than the source batch would silently pair rows with the wrong sentences, and an
id outside the vocabulary would end in an IndexError deep inside an embedding. This file travels to the Hub with
`trust_remote_code` (the model file imports it): it imports only torch and transformers.
"""

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import TransformersKwargs

from .errors_vaswani import UsageError

# The index types an embedding lookup accepts.
TOKEN_ID_DTYPES = (torch.int64, torch.int32)
DIMENSIONS = {2: "batch, length", 3: "batch, length, d_model"}
# The keyword arguments transformers hands through a model to its layers and attention functions.
TRANSFORMERS_KWARGS = frozenset(TransformersKwargs.__annotations__)


def check_tensor(name: str, value: object, ndim: int) -> None:
    """Refuses an input that is not a tensor of `ndim` dimensions (a list, or a sentence without its batch
    dimension), which would fail deep inside the model with an error that names neither."""
    if value is not None and (not isinstance(value, torch.Tensor) or value.ndim != ndim):
        got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UsageError(f"{name} must be a tensor of shape ({DIMENSIONS[ndim]}), got {got}")


def values_wait_for_device(tensor: torch.Tensor) -> bool:
    """Whether reading `tensor`'s values on the host waits for its device: on an accelerator the host stops queuing
    work until the device has caught up, so the model reads none there."""
    return tensor.device.type != "cpu"


def check_devices(device: torch.device, **inputs: object) -> None:
    """Refuses an input tensor on another device than the model's weights (`device`), naming it: ids on the meta
    device embed into garbage rather than fail, another mix fails deep inside. It compares devices, reading no
    values. Weights on the meta device are not here yet: accelerate's offloading brings them, and the inputs, to its
    execution device in hooks of its own."""
    if device.type == "meta":
        return
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.device != device:
            raise UsageError(f"{name} is on {value.device}, the model's weights on {device}: move it to model.device")


def check_token_ids(name: str, ids: torch.Tensor | None, vocab_size: int, ignored_id: int | None = None) -> None:
    """Refuses ids that are not integers of [0, vocab_size), naming the first one outside it, instead of an error deep
    in an embedding. Only the dtype of ids on an accelerator (or in a compiled graph) is checked: there an id outside
    the vocabulary stops the device with an assertion in the embedding, as in transformers' models (VaswaniTrainer
    checks its batches on the CPU where it collates them)."""
    if ids is None:
        return
    if not isinstance(ids, torch.Tensor) or ids.dtype not in TOKEN_ID_DTYPES:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise UsageError(f"{name} must be a tensor of token ids (torch.long or torch.int), got {got}")
    if torch.compiler.is_compiling() or values_wait_for_device(ids):  # a wait, or a break in a fullgraph compile
        return
    valid = (ids >= 0) & (ids < vocab_size)
    if ignored_id is not None:
        valid |= ids == ignored_id
    if not valid.all():
        raise UsageError(f"{name} holds id {int(ids[~valid][0])}, outside the vocabulary [0, {vocab_size})")


def check_keyword_arguments(kwargs: dict) -> None:
    """Refuses keyword arguments that no part of the model reads (transformers' own, TransformersKwargs, are read
    below the model), which would otherwise be swallowed without effect: a misspelt name, or a name the model does not
    take."""
    unknown = sorted(kwargs.keys() - TRANSFORMERS_KWARGS)
    if unknown:
        raise UsageError(f"the model takes no argument {', '.join(unknown)}")


def check_inputs(
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    decoder_input_ids: torch.Tensor | None,
    decoder_attention_mask: torch.Tensor | None,
    decoder_inputs_embeds: torch.Tensor | None,
    encoder_outputs: BaseModelOutput | None,
    past_length: int,
    device: torch.device,
) -> None:
    """Refuses a source and target that do not belong together, or that are not on the weights' `device`, before
    anything is computed on them.

    The decoder batch equals the source batch, except after `encoder_outputs` were passed: while generating, the beams
    (or returned sequences) of each sentence share its encoder states (attend_with_shared_source), so the decoder batch
    is then a positive multiple of the encoder batch.
    """
    check_tensor("input_ids", input_ids, 2)
    check_tensor("inputs_embeds", inputs_embeds, 3)
    check_tensor("decoder_input_ids", decoder_input_ids, 2)
    check_tensor("decoder_inputs_embeds", decoder_inputs_embeds, 3)
    check_devices(
        device,
        input_ids=input_ids,
        attention_mask=attention_mask,
        inputs_embeds=inputs_embeds,
        encoder_outputs=encoder_outputs.last_hidden_state if encoder_outputs is not None else None,
        decoder_input_ids=decoder_input_ids,
        decoder_attention_mask=decoder_attention_mask,
        decoder_inputs_embeds=decoder_inputs_embeds,
    )
    if encoder_outputs is not None:
        source = encoder_outputs.last_hidden_state
    else:
        source = input_ids if input_ids is not None else inputs_embeds
    target = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
    if source is None or target is None:  # the stacks name a missing input themselves
        return
    if source.shape[0] == 0 or source.shape[1] == 0 or target.shape[1] == 0:
        raise UsageError(f"empty input: source shape {tuple(source.shape)}, decoder input shape {tuple(target.shape)}")
    if attention_mask is not None and attention_mask.shape != source.shape[:2]:
        raise UsageError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match the source shape "
            f"{tuple(source.shape[:2])}"
        )
    if encoder_outputs is not None and target.shape[0] % source.shape[0] != 0:
        raise UsageError(
            f"decoder input shape {tuple(target.shape[:2])}: its batch is not a multiple of the encoder_outputs batch "
            f"{source.shape[0]}"
        )
    if encoder_outputs is None and target.shape[0] != source.shape[0]:
        raise UsageError(
            f"decoder input shape {tuple(target.shape[:2])} and source shape {tuple(source.shape[:2])} have "
            "different batch sizes"
        )
    expected_decoder_mask = (target.shape[0], past_length + target.shape[1])
    # a 4D mask is one transformers already built for a static cache (rows, 1, queries, cache length): taken as given
    if (
        decoder_attention_mask is not None
        and decoder_attention_mask.ndim == 2
        and (decoder_attention_mask.shape != expected_decoder_mask)
    ):
        raise UsageError(
            f"decoder_attention_mask shape {tuple(decoder_attention_mask.shape)} does not match the decoder input "
            f"shape {tuple(target.shape[:2])} after {past_length} cached positions"
        )


def check_source(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    embeddings: nn.Embedding,
    attention_mask: torch.Tensor | None = None,
) -> None:
    """Refuses a source the encoder cannot read, naming the argument: ids that are not (batch, length) vocabulary ids,
    embeddings that are not (batch, length, d_model) of the embeddings' dtype, a source without a token, or one not on
    the embeddings' device."""
    check_tensor("input_ids", input_ids, 2)
    check_tensor("inputs_embeds", inputs_embeds, 3)
    check_devices(
        embeddings.weight.device, input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask
    )
    check_token_ids("input_ids", input_ids, embeddings.num_embeddings)
    if inputs_embeds is not None and inputs_embeds.shape[-1] != embeddings.embedding_dim:
        raise UsageError(f"inputs_embeds has width {inputs_embeds.shape[-1]}, not d_model {embeddings.embedding_dim}")
    # under autocast each operation casts its inputs itself; otherwise the first Linear would refuse another dtype
    if (
        inputs_embeds is not None
        and inputs_embeds.dtype != embeddings.weight.dtype
        and not torch.is_autocast_enabled(inputs_embeds.device.type)
    ):
        raise UsageError(f"inputs_embeds has dtype {inputs_embeds.dtype}, the model {embeddings.weight.dtype}")
    source, name = (input_ids, "input_ids") if input_ids is not None else (inputs_embeds, "inputs_embeds")
    if source is not None and 0 in source.shape[:2]:  # every encoded sentence holds at least its </s>
        raise UsageError(f"{name} holds no token: shape {tuple(source.shape)}")


def check_labels(
    labels: torch.Tensor, decoder_inputs: torch.Tensor | None, vocab_size: int, device: torch.device
) -> None:
    """Refuses labels that are not one target id (or -100, ignored) for each decoder input position, on the weights'
    `device`."""
    check_devices(device, labels=labels)
    check_token_ids("labels", labels, vocab_size, ignored_id=-100)
    if decoder_inputs is not None and labels.shape != decoder_inputs.shape[:2]:
        raise UsageError(
            f"labels shape {tuple(labels.shape)} does not match the decoder input shape "
            f"{tuple(decoder_inputs.shape[:2])}"
        )
