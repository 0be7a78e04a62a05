"""bf16 and int8 decoding by the package's loop give the tokens fp32 gives on the trained fixture, or differ only where
fp32's own choice was closer than the reduced type's rounding could tell apart.

How a difference is judged: delta is the largest move of any logit from fp32 to the reduced model, teacher-forced
along fp32's own outputs. A log-probability then moves by at most 2 delta (the logit and the log-sum-exp each by
delta), so a greedy choice can change only where fp32's two candidates' logits were within 2 delta, and a beam
hypothesis's score (a sum of log-probabilities, divided by a length penalty of at least 1) only by 2 delta a token: two
hypotheses can swap ranks only where fp32 scored them within 4 delta times their length.
"""

import pytest
import torch
from tiny import PROBE_SENTENCES

from hf_vaswani import generate
from hf_vaswani.decoding import loading
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.kernels import quantization
from hf_vaswani.kernels.quantization import INT8_ENGINES

REDUCED = {"bf16": dict(dtype="bf16"), **{f"int8 {engine}": dict(int8=True) for engine in INT8_ENGINES}}
N_BEST = 4


def logits_along(model, batch: dict, outputs: torch.Tensor) -> torch.Tensor:
    """float32 logits of `model` teacher-forced along `outputs` (decoder start first), one row per output position."""
    with torch.inference_mode():
        return model(**batch, decoder_input_ids=outputs[:, :-1]).logits.float()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two padded outputs of one batch differ (never 0, the decoder start), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.parametrize("kind", sorted(REDUCED))
def test_reduced_precision_decodes_fp32s_tokens_but_where_fp32_was_within_its_rounding(
    trained_folder, monkeypatch, kind: str
) -> None:
    monkeypatch.setattr(loading, "cpu_float_type_problem", lambda dtype: None)  # bf16 emulated where not native
    if kind.startswith("int8"):  # each engine, whichever this CPU measures fastest
        engine = kind.removeprefix("int8 ")
        if engine not in torch.backends.quantized.supported_engines:
            pytest.skip(f"torch has no {engine} engine on this CPU")
        monkeypatch.setattr(torch.backends.quantized, "engine", engine)  # as process_int8_engine sets it, once
        monkeypatch.setattr(quantization, "process_int8_engine", lambda: engine)
    fp32, tokenizer = load_model_folder(trained_folder)
    reduced, _ = load_model_folder(trained_folder, **REDUCED[kind])
    batch = dict(tokenizer(PROBE_SENTENCES, return_tensors="pt", padding=True))
    with torch.inference_mode():
        greedy = {name: generate(model, **batch, num_beams=1) for name, model in (("fp32", fp32), (kind, reduced))}
    reference = logits_along(fp32, batch, greedy["fp32"])
    delta = (logits_along(reduced, batch, greedy["fp32"]) - reference).abs().max().item()
    assert 0 < delta < 1.0, f"{kind} moved the logits by {delta}"  # it does round; a slip would be far larger

    for row, (ours, theirs) in enumerate(zip(greedy["fp32"].tolist(), greedy[kind].tolist(), strict=True)):
        if (position := first_difference(ours, theirs)) is not None:
            logits = reference[row, position - 1]  # the logits that chose position's token
            gap = (logits[ours[position]] - logits[theirs[position]]).item()
            assert gap <= 2 * delta, f"{kind} greedy changed {PROBE_SENTENCES[row]!r} where fp32 led by {gap:.3f}"

    options = dict(num_beams=N_BEST, num_return_sequences=N_BEST, return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        beams = {name: generate(model, **batch, **options) for name, model in (("fp32", fp32), (kind, reduced))}
    sequences = {name: output.sequences.view(len(PROBE_SENTENCES), N_BEST, -1) for name, output in beams.items()}
    scores = beams["fp32"].sequences_scores.view(len(PROBE_SENTENCES), N_BEST)
    lengths = (sequences["fp32"] != tokenizer.pad_token_id).sum(-1)
    for row in range(len(PROBE_SENTENCES)):
        for rank in range(N_BEST):
            if not torch.equal(sequences["fp32"][row, rank], sequences[kind][row, rank]):
                # fp32's hypothesis at this rank was displaced: it must have been as close as rounding allows to a
                # neighbour in fp32's own list
                neighbours = [r for r in (rank - 1, rank + 1) if 0 <= r < N_BEST]
                gap = min((scores[row, rank] - scores[row, r]).abs().item() for r in neighbours)
                allowed = 4 * delta * lengths[row, rank].item()
                assert gap <= allowed, f"{kind} reordered the n-best list of {PROBE_SENTENCES[row]!r} (gap {gap:.3f})"
