"""The report: gpu_figures.json and gpu_figures.md, written whole after every measurement with the summary
recomputed, and --merge's join of several runs' reports."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from hf_vaswani.files import write_text

from .summary import summary

UNRUN = ("not selected", "not reached")


class Report:
    """The results so far with their summary."""

    def __init__(self, output_dir: Path, data: dict[str, Any], started: float | None = None) -> None:
        self.output_dir = output_dir
        self.data = data
        self.started = started  # None: a merged report, whose elapsed time is its parts'

    def save(self) -> None:
        if self.started is not None:
            self.data["elapsed_seconds"] = round(time.monotonic() - self.started, 1)
        self.data["summary"] = summary(self.data)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_text(self.output_dir / "gpu_figures.json", json.dumps(self.data, indent=2) + "\n")
        write_text(self.output_dir / "gpu_figures.md", markdown(self.data))


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: a header line on the device, the summary, then a table per section."""
    device = data["device"]
    peak = device["dense_bf16_peak_tflops"]
    lines = [
        "# GPU figures",
        "",
        f"{device['name']} ({device['type']}, {device['gpus']} GPUs; dense bf16 peak "
        f"{f'{peak} TFLOP/s' if peak else 'unknown'}); torch {device['torch']}, CUDA {device['cuda']}, transformers "
        f"{device['transformers']}, CTranslate2 {device['ctranslate2']}. {'Tiny sizes. ' if data['tiny'] else ''}"
        f"Time limit {data['time_limit_minutes']} min, {data.get('elapsed_seconds', 0)} s used."
        + (f" Merged from {', '.join(data['merged from'])}." if "merged from" in data else ""),
        "",
        "## Summary",
        "",
        "| figure | value | from |",
        "|---|---|---|",
    ]
    for name, entry in data.get("summary", {}).items():
        if entry["value"] is None:
            lines.append(f"| {name} | n/a | {cell(entry['missing'])} |")
        else:
            source = entry["of"] + (f" / {entry['over']}" if "over" in entry else "")
            lines.append(f"| {name} | {cell(entry['value'])} | {cell(source)} |")
    for name, section in data["sections"].items():
        reason = f": {section['reason']}" if "reason" in section else ""
        lines += ["", f"## {name} ({section['status']}{reason})"]
        items = section.get("results", {})
        if not items:
            continue
        fields = [set(values) - {"seconds"} for values in items.values()]
        if all(keys == fields[0] for keys in fields):  # one row per item, one column per field
            columns = list(dict.fromkeys(key for values in items.values() for key in values))
            lines += ["", f"| item | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
            for item, values in items.items():
                lines.append(f"| {item} | {' | '.join(cell(values.get(column, '')) for column in columns)} |")
        else:  # items measure different things: their fields in one cell
            lines += ["", "| item | results |", "|---|---|"]
            for item, values in items.items():
                lines.append(f"| {item} | {'; '.join(f'{key}: {cell(value)}' for key, value in values.items())} |")
    return "\n".join(lines) + "\n"


def merged_reports(paths: list[Path]) -> dict[str, Any]:
    """One report of several runs' (each device call's): each section from the last report that ran it."""
    reports = [json.loads(path.read_text()) for path in paths]
    data = copy.deepcopy(reports[0])
    for report in reports[1:]:
        for name, entry in report["sections"].items():
            if entry.get("status") not in UNRUN or name not in data["sections"]:
                data["sections"][name] = entry
    data["merged from"] = [str(path) for path in paths]
    data["elapsed_seconds"] = round(sum(report.get("elapsed_seconds", 0) for report in reports), 1)
    return data
