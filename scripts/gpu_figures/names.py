"""How the report names what it measures: an item is its parts joined by ", " (a preset or decoding shape, the system,
the variant: "base, MarianMT, compiled", "beam 4, batch 32, hf_vaswani package loop, captured"), unique across the
sections, so that the summary finds each figure by its name and a reader finds its code by its section."""

OURS, MARIAN = "hf_vaswani", "MarianMT"
PACKAGE_LOOP = "hf_vaswani package loop"
TRANSFORMERS_LOOP = "hf_vaswani transformers loop"
TRAINER = "VaswaniTrainer"
TRAINING_FIGURE, DECODING_FIGURE, MFU = "source+target tokens/s", "output tokens/s", "MFU %"


def item(*parts: str) -> str:
    return ", ".join(parts)


def shape_name(batch: int, beams: int) -> str:
    return f"{'greedy' if beams == 1 else f'beam {beams}'}, batch {batch}"
