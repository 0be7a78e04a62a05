"""Training curves from a Trainer's log history, as PNG."""

from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt  # noqa: E402

from .files import replace_file  # noqa: E402
from .model.errors_vaswani import UsageError


def plot_training_curves(log_history: list[dict], output_path: str | Path) -> Path:
    """Loss and learning rate against the optimizer step, side by side, and validation BLEU when logged.

    The loss panel has the training loss and, where logged, the training NLL and `ValidationLossCallback`'s
    validation loss and NLL.

    Validation entries are those of `ValidationBleuCallback` (`eval_bleu`, `eval_lowercased_tokenized_bleu`,
    `elapsed_minutes`); their panel is against wall-clock minutes of training, the budget a learning curve is read in.
    """
    logged = [entry for entry in log_history if "loss" in entry and "step" in entry]
    if not logged:
        raise UsageError("the log history holds no training loss: was logging_steps larger than the run?")
    validated = [entry for entry in log_history if "eval_bleu" in entry and "elapsed_minutes" in entry]
    steps = [entry["step"] for entry in logged]
    figure, axes = plt.subplots(1, 3 if validated else 2, figsize=(16 if validated else 11, 4))
    loss_axis, lr_axis = axes[:2]
    loss_axis.plot(steps, [entry["loss"] for entry in logged], label="training loss")
    if all("nll_loss" in entry for entry in logged):
        loss_axis.plot(steps, [entry["nll_loss"] for entry in logged], label="training NLL")
    for name, label in (("eval_loss", "validation loss"), ("eval_nll_loss", "validation NLL")):
        if entries := [entry for entry in log_history if name in entry and "step" in entry]:
            values = [entry[name] for entry in entries]
            loss_axis.plot([entry["step"] for entry in entries], values, marker=".", label=label)
    loss_axis.set(xlabel="step", ylabel="nats per target token", title="Loss (with label smoothing) and NLL")
    loss_axis.legend(fontsize=8)
    loss_axis.grid(alpha=0.3)
    lr_axis.plot(steps, [entry["learning_rate"] for entry in logged], color="tab:orange")
    lr_axis.set(xlabel="step", ylabel="learning rate", title="Learning rate")  # Eq. 3, or Eq. 3 with a cooldown
    lr_axis.grid(alpha=0.3)
    if validated:
        bleu_axis = axes[2]
        minutes = [entry["elapsed_minutes"] for entry in validated]
        bleu_axis.plot(minutes, [entry["eval_bleu"] for entry in validated], marker="o", label="sacreBLEU")
        if all("eval_lowercased_tokenized_bleu" in entry for entry in validated):
            scores = [entry["eval_lowercased_tokenized_bleu"] for entry in validated]
            bleu_axis.plot(minutes, scores, marker="s", label="BLEU, lowercased Moses-tokenized")
        for minute, entry in zip(minutes, validated, strict=True):
            bleu_axis.annotate(str(entry["step"]), (minute, entry["eval_bleu"]), fontsize=7, alpha=0.6)
        bleu_axis.set(xlabel="wall-clock minutes of training", ylabel="BLEU", title="Validation BLEU (step labels)")
        bleu_axis.legend(fontsize=8)
        bleu_axis.grid(alpha=0.3)
    figure.tight_layout()
    replace_file(Path(output_path), partial(figure.savefig, format="png", dpi=120))  # whole or not at all
    plt.close(figure)
    return Path(output_path)


def attention_maps(model, tokenizer, sentence: str, layer: int = -1) -> dict:
    """Attention weights of one layer for `sentence` and the model's own translation of it, with token labels."""
    import torch

    layers = min(model.config.encoder_layers, model.config.decoder_layers)
    if not -layers <= layer < layers:
        raise UsageError(f"layer {layer} does not exist: the model has layers 0 to {layers - 1} (or -1 to -{layers})")
    model.eval()
    model.set_attn_implementation("eager")  # the weights themselves: sdpa does not return them
    source = tokenizer(sentence, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        translation = model.generate(**source)
        out = model(**source, decoder_input_ids=translation, output_attentions=True)
    source_tokens = tokenizer.convert_ids_to_tokens(source["input_ids"][0])
    target_tokens = tokenizer.convert_ids_to_tokens(translation[0])
    return {
        "translation": tokenizer.decode(translation[0], skip_special_tokens=True),
        "encoder self-attention": (out.encoder_attentions[layer][0], source_tokens, source_tokens),
        "decoder self-attention": (out.decoder_attentions[layer][0], target_tokens, target_tokens),
        "encoder-decoder attention": (out.cross_attentions[layer][0], target_tokens, source_tokens),
    }


def plot_attention(model, tokenizer, sentence: str, output_dir: str | Path, layer: int = -1) -> list[Path]:
    """Heatmaps of every head of one layer, for each kind of attention (as the paper's figures 3-5), as PNG."""
    maps = attention_maps(model, tokenizer, sentence, layer)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, (weights, query_tokens, key_tokens) in list(maps.items())[1:]:
        heads = weights.shape[0]
        columns = min(heads, 4)
        rows = -(-heads // columns)
        size = 0.28 * max(len(query_tokens), len(key_tokens)) + 1.5
        figure, axes = plt.subplots(rows, columns, figsize=(columns * size, rows * size), squeeze=False)
        for head, axis in enumerate(axes.flat):
            if head >= heads:
                axis.axis("off")
                continue
            axis.imshow(weights[head].float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            axis.set_title(f"head {head + 1}", fontsize=9)
            axis.set_xticks(range(len(key_tokens)), [t.replace("Ġ", "_") for t in key_tokens], rotation=90, fontsize=7)
            axis.set_yticks(range(len(query_tokens)), [t.replace("Ġ", "_") for t in query_tokens], fontsize=7)
        figure.suptitle(
            f"{kind}, layer {layer if layer >= 0 else 'last'}: {sentence!r} -> {maps['translation']!r}", fontsize=10
        )
        figure.tight_layout()
        path = output_dir / f"{kind.split()[0].replace('-', '_')}_attention.png"
        replace_file(path, partial(figure.savefig, format="png", dpi=110))
        plt.close(figure)
        written.append(path)
    return written
