"""Cross-entropy of the pre-softmax projection, label-smoothed on request (§5.4), with a training path that never holds
all logits.

This file travels to the Hub with `trust_remote_code` (the model file imports it): it imports only torch and the
model's checks.
"""

from collections.abc import Callable

import torch
from torch import nn

from .checks_vaswani import values_wait_for_device

# a @ b.T + bias for 2-d a and b: the products of the chunked loss (the installed package's kernels/cpu.py passes
# faster ones)
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ProjectedLabelSmoothedLoss(torch.autograd.Function):
    """Label-smoothed cross-entropy of `linear(hidden, weight, bias)`, summed over the target tokens, times `scale`,
    and beside it the plain cross-entropy (fairseq's nll_loss) of the same tokens, times `scale`, not differentiable.

    Training never needs the (positions x vocabulary) logits at once: each chunk of positions gets its logits, loss
    and gradients in the forward pass, so at most one chunk of logits is alive. Same FLOPs as logits then loss; the
    memory of three full-vocabulary tensors (logits, log-probabilities, their gradient) is saved. Positions labelled
    -100 are left out before the projection. The logits and the input gradient are `product`s (nn.functional.linear
    or a faster equal); without autocast the weight gradient accumulates in place (addmm_). `scale` (1 / the token
    count for a mean) is applied to the gradients there too, on chunk-sized operands, so that backward hands them on
    untouched when the loss is differentiated directly, as in training: scaling a weight gradient of vocabulary x
    d_model afterwards makes one more tensor of that size, in fresh memory.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        label_smoothing: float,
        chunk_size: int,
        scale: float | torch.Tensor = 1.0,
        product: Product = nn.functional.linear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_rows, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        counted = (labels != -100).nonzero()[:, 0]  # padding positions get neither logits nor gradient
        hidden_rows, labels = hidden_rows[counted], labels[counted, None]
        vocab_size, eps = weight.shape[0], label_smoothing
        grad_rows = torch.empty_like(hidden_rows)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        autocast = torch.is_autocast_enabled(weight.device.type)
        if autocast:  # cast once here, not in each chunk's three products; the gradients above stay float32
            dtype = torch.get_autocast_dtype(weight.device.type)
            hidden_rows, weight = hidden_rows.to(dtype), weight.to(dtype)
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # half-precision logits: loss in float32
        total, nll_total = hidden.new_zeros((), dtype=loss_dtype), hidden.new_zeros((), dtype=loss_dtype)
        for start in range(0, labels.shape[0], chunk_size):
            rows, targets = hidden_rows[start : start + chunk_size], labels[start : start + chunk_size]
            log_probs = product(rows, weight, bias).to(loss_dtype).log_softmax(-1)
            target_log_probs = log_probs.gather(1, targets).sum()
            nll_total -= target_log_probs
            # -sum_k q_k log p_k with q = (1 - eps) one_hot(y) + eps / V (Szegedy et al.)
            total -= (1 - eps) * target_log_probs + eps / vocab_size * log_probs.sum()
            grad_logits = log_probs.exp_().sub_(eps / vocab_size)  # d loss / d logits = softmax - q
            grad_logits = grad_logits.scatter_add_(1, targets, torch.full_like(targets, eps - 1, dtype=loss_dtype))
            grad_logits = grad_logits.to(rows.dtype)
            grad_rows[start : start + chunk_size] = product(grad_logits, weight.T)
            if grad_weight is not None:
                scaled_rows = rows * scale
                if autocast:  # an in-place product would run in float32 under autocast
                    grad_weight += product(grad_logits.T, scaled_rows.T)
                else:  # in place: no temporary the size of the weight
                    grad_weight.addmm_(grad_logits.T, scaled_rows)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        grad_rows *= scale
        if grad_bias is not None:
            grad_bias *= scale
        grad_hidden = hidden.new_zeros(hidden.shape)
        grad_hidden.view(-1, hidden.shape[-1]).index_copy_(0, counted, grad_rows)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        nll_total = nll_total * scale
        ctx.mark_non_differentiable(nll_total)
        return total * scale, nll_total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, grad_nll_total: torch.Tensor | None):
        grads = ctx.saved_tensors
        # the usual case, d total / d total: nothing to scale (a check that would wait for an accelerator: CPU only)
        if not (grad_total.device.type == "cpu" and grad_total.item() == 1.0):
            grads = [None if grad is None else grad * grad_total for grad in grads]
        return *grads, None, None, None, None, None


def label_smoothed_loss(
    hidden_states: torch.Tensor,
    output_projection: nn.Linear,
    labels: torch.Tensor,
    label_smoothing: float,
    pad_token_id: int | None,
    num_items_in_batch: int | torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    product: Product = nn.functional.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """§5.4: cross-entropy against (1 - eps) one_hot(y) + eps / V, averaged over the target tokens (eps 0: the plain
    cross-entropy), and the plain cross-entropy of the same tokens (fairseq's nll_loss), detached.

    -100 and `pad_token_id` labels are not counted. The sums are divided by `num_items_in_batch` when given (Trainer's
    count over an accumulated batch, so that gradient accumulation equals one large batch), else by this batch's
    count. From `logits` when they were computed anyway; else on the CPU chunk by chunk from the decoder's last hidden
    states, the output projection's products computed by `product`; else from the logits of all positions at once.
    """
    labels = labels.masked_fill(labels == pad_token_id, -100).to(hidden_states.device)
    denominator = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
    # The chunks leave out the padded positions by reading which they are: on an accelerator a wait every batch and
    # a break in a compiled graph; there all logits at once cost memory only, and a compiler fuses their softmax.
    if logits is None and (values_wait_for_device(labels) or torch.compiler.is_compiling()):
        logits = output_projection(hidden_states)
    if logits is None:
        weight, bias = output_projection.weight, output_projection.bias
        # At most ~16 MiB of float32 logits a chunk, and at most 2 d_model positions: past that, the weight gradient's
        # accumulation (a pass over vocabulary x d_model per chunk) is already small against the chunk's products, and
        # larger logits only fall out of cache (docs/performance.md).
        chunk_size = max(1, min(2 * weight.shape[1], 2**22 // weight.shape[0]))
        return ProjectedLabelSmoothedLoss.apply(
            hidden_states, weight, bias, labels, label_smoothing, chunk_size, 1.0 / denominator, product
        )
    log_probs = logits.flatten(0, 1).log_softmax(-1, dtype=torch.float32)  # half-precision logits: no float32 copy
    labels = labels.flatten()
    nll = nn.functional.nll_loss(log_probs, labels, ignore_index=-100, reduction="sum")
    total = nll
    if label_smoothing:  # torch's cross_entropy(label_smoothing=eps) written out, its cross-entropy term computed once
        uniform = -log_probs.sum(-1).masked_fill(labels == -100, 0.0).sum() / log_probs.shape[-1]
        total = (1 - label_smoothing) * nll + label_smoothing * uniform
    return total / denominator, nll.detach() / denominator
