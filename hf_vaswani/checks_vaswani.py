"""Checks at the model's public entry points: inputs that do not belong together are refused before any computation.

Without them, a decoder batch larger than the source batch would silently pair rows with the wrong sentences, and an
id outside the vocabulary would end in an IndexError deep inside an embedding. This file travels to the Hub with
`trust_remote_code` (the model file imports it): it imports only torch and transformers.
"""

import torch
from transformers.modeling_outputs import BaseModelOutput


def check_token_ids(name: str, ids: torch.Tensor | None, vocab_size: int, ignored_id: int | None = None) -> None:
    """Refuses ids outside [0, vocab_size), naming the first one, instead of an IndexError deep in an embedding."""
    if ids is None or torch.compiler.is_compiling():  # a data-dependent check would break a fullgraph compile
        return
    valid = (ids >= 0) & (ids < vocab_size)
    if ignored_id is not None:
        valid |= ids == ignored_id
    if not valid.all():
        raise ValueError(f"{name} holds id {int(ids[~valid][0])}, outside the vocabulary [0, {vocab_size})")


def check_inputs(
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    decoder_input_ids: torch.Tensor | None,
    decoder_attention_mask: torch.Tensor | None,
    decoder_inputs_embeds: torch.Tensor | None,
    encoder_outputs: BaseModelOutput | None,
    past_length: int,
) -> None:
    """Refuses a source and target that do not belong together, before anything is computed on them.

    The decoder batch equals the source batch, except after `encoder_outputs` were passed: while generating, the beams
    (or returned sequences) of each sentence share its encoder states (attend_with_shared_source), so the decoder batch
    is then a positive multiple of the encoder batch.
    """
    if encoder_outputs is not None:
        source = encoder_outputs.last_hidden_state
    else:
        source = input_ids if input_ids is not None else inputs_embeds
    target = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
    if source is None or target is None:  # the stacks name a missing input themselves
        return
    if source.shape[0] == 0 or source.shape[1] == 0 or target.shape[1] == 0:
        raise ValueError(f"empty input: source shape {tuple(source.shape)}, decoder input shape {tuple(target.shape)}")
    if attention_mask is not None and attention_mask.shape != source.shape[:2]:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match the source shape "
            f"{tuple(source.shape[:2])}"
        )
    if encoder_outputs is not None and target.shape[0] % source.shape[0] != 0:
        raise ValueError(
            f"decoder input shape {tuple(target.shape[:2])}: its batch is not a multiple of the encoder_outputs batch "
            f"{source.shape[0]}"
        )
    if encoder_outputs is None and target.shape[0] != source.shape[0]:
        raise ValueError(
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
        raise ValueError(
            f"decoder_attention_mask shape {tuple(decoder_attention_mask.shape)} does not match the decoder input "
            f"shape {tuple(target.shape[:2])} after {past_length} cached positions"
        )


def check_labels(labels: torch.Tensor, decoder_inputs: torch.Tensor | None, vocab_size: int) -> None:
    """Refuses labels that are not one target id (or -100, ignored) for each decoder input position."""
    check_token_ids("labels", labels, vocab_size, ignored_id=-100)
    if decoder_inputs is not None and labels.shape != decoder_inputs.shape[:2]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match the decoder input shape "
            f"{tuple(decoder_inputs.shape[:2])}"
        )
