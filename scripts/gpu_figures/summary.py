"""The ratios the figures are for, recomputed from the recorded items at every save: each system at its best (the
fastest of its variants, named in `of` and `over`) against the other's best, each variant against eager, and big
training's MFU."""

from __future__ import annotations

import math
from typing import Any

from .compilation import VARIANTS
from .names import (
    DECODING_FIGURE,
    MARIAN,
    MFU,
    OURS,
    PACKAGE_LOOP,
    TRAINER,
    TRAINING_FIGURE,
    TRANSFORMERS_LOOP,
    item,
    shape_name,
)
from .sizes import PRESETS

Figures = dict[str, tuple[dict[str, Any], str]]


def recorded_figures(data: dict[str, Any]) -> Figures:
    """Every recorded item of every section (names are unique across sections), with the device it ran on."""
    figures = {}
    for entry in data["sections"].values():
        for name, outcome in entry.get("results", {}).items():
            figures[name] = (outcome, entry.get("device", data["device"]["name"]))
    return figures


def best_item(figures: Figures, candidates: list[str], key: str) -> str | None:
    """The candidate with the highest positive figure `key`, None where none has one."""

    def value(name: str) -> float:
        figure = figures[name][0].get(key) if name in figures else None
        is_number = isinstance(figure, int | float) and not isinstance(figure, bool)
        return figure if is_number and figure > 0 else -math.inf

    best = max(candidates, key=value, default=None)
    return best if best is not None and value(best) > -math.inf else None


def summary_entry(figures: Figures, key: str, of: list[str], over: list[str] | None = None) -> dict[str, Any]:
    """The best of the `of` items' figure `key`, divided by the best of the `over` items' of the same device where
    given; `value` None and what is `missing` where a side has no such figure."""
    numerator = best_item(figures, of, key)
    if numerator is None:
        return {"value": None, "missing": f"no {key} for {' or '.join(of)}"}
    if over is None:
        return {"value": figures[numerator][0][key], "figure": key, "of": numerator}
    device = figures[numerator][1]
    denominator = best_item(figures, [name for name in over if name in figures and figures[name][1] == device], key)
    if denominator is None:
        others = best_item(figures, over, key)
        why = f"on {figures[others][1]}, not {device}" if others is not None else f"for {' or '.join(over)}"
        return {"value": None, "missing": f"no {key} {why}"}
    value = figures[numerator][0][key] / figures[denominator][0][key]
    return {"value": round(value, 3), "figure": key, "of": numerator, "over": denominator}


def variants(*parts: str) -> list[str]:
    """The items of every variant of one system at one size or shape."""
    return [item(*parts, variant) for variant in VARIANTS]


def summary(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    figures = recorded_figures(data)
    entries = {}
    for preset in PRESETS:
        entries[f"{preset} training tokens/s, hf_vaswani / MarianMT, each at its best"] = summary_entry(
            figures, TRAINING_FIGURE, variants(preset, OURS), variants(preset, MARIAN)
        )
    entries["big training MFU %, hf_vaswani at its best"] = summary_entry(figures, MFU, variants("big", OURS))
    for preset in PRESETS:
        for system in (OURS, MARIAN):
            for variant in VARIANTS[1:]:
                entries[f"{preset} training tokens/s, {system}, {variant} / eager"] = summary_entry(
                    figures, TRAINING_FIGURE, [item(preset, system, variant)], [item(preset, system, "eager")]
                )
    entries["base VaswaniTrainer tokens/s, torch_compile / eager"] = summary_entry(
        figures, TRAINING_FIGURE, [item("base", TRAINER, "torch_compile")], [item("base", TRAINER, "eager")]
    )
    for batch in data.get("sizes", {}).get("generation batches", []):
        for beams in (1, 4):
            shape = shape_name(batch, beams)
            others = {
                "MarianMT at its best": variants(shape, MARIAN),
                "transformers' loop": variants(shape, TRANSFORMERS_LOOP),
                "CTranslate2 float16": [item(shape, "CTranslate2 float16")],
                "CTranslate2 int8_float16": [item(shape, "CTranslate2 int8_float16")],
            }
            for other, items in others.items():
                name = f"{shape} tokens/s, hf_vaswani package loop at its best / {other}"
                entries[name] = summary_entry(figures, DECODING_FIGURE, variants(shape, PACKAGE_LOOP), items)
    return entries
