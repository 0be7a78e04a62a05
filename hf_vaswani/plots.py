"""Training curves from a Trainer's log history, as PNG."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers
import matplotlib.pyplot as plt  # noqa: E402


def plot_training_curves(log_history: list[dict], output_path: str | Path) -> Path:
    """Training loss and learning rate against the optimizer step, side by side."""
    logged = [entry for entry in log_history if "loss" in entry and "step" in entry]
    if not logged:
        raise ValueError("the log history holds no training loss: was logging_steps larger than the run?")
    steps = [entry["step"] for entry in logged]
    figure, (loss_axis, lr_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axis.plot(steps, [entry["loss"] for entry in logged])
    loss_axis.set(xlabel="step", ylabel="label-smoothed cross-entropy", title="Training loss")
    loss_axis.grid(alpha=0.3)
    lr_axis.plot(steps, [entry["learning_rate"] for entry in logged], color="tab:orange")
    lr_axis.set(xlabel="step", ylabel="learning rate", title="Learning rate (§5.3, Eq. 3)")
    lr_axis.grid(alpha=0.3)
    figure.tight_layout()
    output_path = Path(output_path)
    figure.savefig(output_path, dpi=120)
    plt.close(figure)
    return output_path
