"""The export on a real trained model, the demo's: on its held-out test sentences, CTranslate2's fp32
greedy output equals ours token for token, its beam search with the options `vaswani export` prints agrees with ours,
and its int8 model loses less than 1 BLEU."""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny import SHORT_DEMO_SETTINGS
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_vaswani.data.demo_corpus import make_synthetic_corpus
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.decoding.metrics import corpus_scores
from hf_vaswani.decoding.translation import length_sorted_batches, translate
from hf_vaswani.interop.export import decoding_note, export_ctranslate2
from hf_vaswani.training.recipe import run_recipe

ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 not installed: pip install '.[export]'")

# A translator, not a collapsed run (those score < 5). The run ends where BLEU still climbs fast, so each CPU's float
# trajectory lands elsewhere on the climb: the bound sits well below all of them.
REAL_TRANSLATOR_BLEU = 50.0
# The greedy comparison's absolute length limit (CTranslate2's default max_decoding_length), with our source length + 50
# cap off: the purest comparison (the cap forces </s> where CTranslate2 just stops; beam search emulates the cap below).
# A half-trained model repeats itself up to the limit on a few sentences, a cheap cost with greedy only.
MAX_NEW_TOKENS = 256
BATCH_SIZE = 100
# The two implementations' log-probabilities of the same tokens differ by fp32 rounding (asserted below to be under a
# tenth of this), so a greedy step can only go another way where our top-1 and top-2 logits are closer than this.
NEAR_TIE = 1e-3
# A top-2 gap small enough to flip (~2e-5, twice the discrepancy) is rare among the ~10^4 greedy steps here.
MAX_NEAR_TIE_SENTENCES = 3
# Beam search with the same scoring rule (transformers' score / length^alpha) picks the same hypothesis unless two of
# them tie to fp32 rounding: 1% leaves room for such ties.
SAME_RULE_IDENTICAL = 0.99
# Against our own decoding, the paper's GNMT penalty, which CTranslate2 lacks, is given as its length^alpha with the
# same alpha (the export's note): outputs differ where hypotheses of different lengths are close in score, on about 1%
# of sentences (4% leaves room). What those few, often long, outputs do to BLEU depends on the model, not on the
# export, so BLEU is asserted for each decoding on its own (a real translator).
PAPER_IDENTICAL = 0.96
# The export's int8 bound, where CTranslate2's int8 products sum exactly (VNNI). Where its int8 library is held below
# VNNI (oneDNN by ONEDNN_MAX_CPU_ISA, MKL by MKL_CBWR), u8 x s8 pairs sum in saturating int16 (vpmaddubsw), which moves
# BLEU by a few points either way: CTranslate2's arithmetic, not the export's, so there int8 must be a real translator.
INT8_BLEU_TOLERANCE = 1.0


def int8_products_use_vnni() -> bool:
    """Whether CTranslate2's int8 products sum exactly here: a CPU with VNNI, and its int8 library not held below it."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    onednn_held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper().startswith("AVX2")
    mkl_path = os.environ.get("MKL_CBWR", "AUTO").upper()  # AVX512_E1 and AVX2_E1 are MKL's paths with VNNI
    mkl_held = "GenuineIntel" in cpuinfo and not (mkl_path.startswith("AUTO") or "_E" in mkl_path)
    return ("avx512_vnni" in cpuinfo or "avx_vnni" in cpuinfo) and not onednn_held and not mkl_held


@dataclass
class Demo:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    folder: Path
    sources: list[str]
    references: list[str]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """The demo recipe's averaged model folder, trained with SHORT_DEMO_SETTINGS on the demo's corpus."""
    corpus = make_synthetic_corpus(seed=SHORT_DEMO_SETTINGS.seed)  # as `vaswani demo` builds it
    output_dir = tmp_path_factory.mktemp("demo")
    started = time.perf_counter()
    results = run_recipe(corpus, output_dir, SHORT_DEMO_SETTINGS, dataset_name="hf_vaswani-synthetic-en-de")
    print(f"demo fixture: {results['steps']} steps in {time.perf_counter() - started:.0f} s, BLEU {results['bleu']}")
    assert results["bleu"] >= REAL_TRANSLATOR_BLEU, f"the demo model did not train: test sacreBLEU {results['bleu']}"
    model, tokenizer = load_model_folder(output_dir / "model")
    test = corpus["test"]
    return Demo(model.eval(), tokenizer, output_dir / "model", test["source"], test["target"])


@dataclass
class Greedy:
    ids: list[list[int]]  # the output tokens after the start token, through </s> where it was reached
    gaps: list[list[float]]  # each step's top-1 minus top-2 logit
    log_probs: list[list[float]]  # each output token's log-probability


def our_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sources: list[str]) -> Greedy:
    """Our greedy decoding in batches as `translate` makes them, with the logits of every step."""
    eos = model.config.eos_token_id
    greedy = Greedy([[]] * len(sources), [[]] * len(sources), [[]] * len(sources))
    for indices in length_sorted_batches(range(len(sources)), lambda i: len(sources[i]), BATCH_SIZE):
        batch = tokenizer([sources[i] for i in indices], return_tensors="pt", padding=True)
        with torch.inference_mode():
            output = model.generate(
                **batch,
                num_beams=1,
                max_new_tokens=MAX_NEW_TOKENS,
                max_new_tokens_over_source=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logits = torch.stack(output.logits, dim=1)  # (batch, steps, vocabulary), before any processing
        chosen = output.sequences[:, 1:]
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[..., 0] - top2[..., 1]
        log_probs = logits.log_softmax(-1).gather(-1, chosen[..., None])[..., 0]
        for row, i in enumerate(indices):
            tokens = chosen[row].tolist()
            length = tokens.index(eos) + 1 if eos in tokens else len(tokens)  # rows that ended early are padded
            greedy.ids[i] = tokens[:length]
            greedy.gaps[i] = gaps[row, :length].tolist()
            greedy.log_probs[i] = log_probs[row, :length].tolist()
    return greedy


def first_difference(ours: list[int], theirs: list[int]) -> int:
    """The first step where two different outputs differ (one may be a prefix of the other)."""
    shorter = min(len(ours), len(theirs))
    return next((k for k in range(shorter) if ours[k] != theirs[k]), shorter)


def translate_with_source_cap(
    translator: "ctranslate2.Translator", source_tokens: list[list[str]], extra: int, **options
) -> list:
    """CTranslate2's results with our source length + `extra` cap, which it lacks: its max_decoding_length is one
    absolute limit per call, so one call per source length. We force </s> as the (source length + extra)-th token, where
    CTranslate2 stops after max_decoding_length tokens without one: the same text at a limit one lower."""
    results: list = [None] * len(source_tokens)
    for length in sorted({len(tokens) for tokens in source_tokens}):
        indices = [i for i, tokens in enumerate(source_tokens) if len(tokens) == length]
        batch = [source_tokens[i] for i in indices]
        for i, result in zip(
            indices, translator.translate_batch(batch, max_decoding_length=length + extra - 1, **options), strict=True
        ):
            results[i] = result
    return results


def bleu(hypotheses: list[str], references: list[str]) -> float:
    return corpus_scores(hypotheses, references)["bleu"]


def identical_fraction(ours: list[str], theirs: list[str]) -> float:
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


# One test, not one per criterion: under `pytest -n 2` (the Makefile's) tests of one module may go to both workers,
# and each would train the fixture.
def test_ctranslate2_translates_the_demo_model_as_we_do(demo: Demo, tmp_path: Path) -> None:
    model, tokenizer, sources, references = demo.model, demo.tokenizer, demo.sources, demo.references
    threads = torch.get_num_threads()
    fp32 = ctranslate2.Translator(str(export_ctranslate2(demo.folder, tmp_path / "fp32")), intra_threads=threads)
    int8_folder = export_ctranslate2(demo.folder, tmp_path / "int8", quantization="int8")
    int8 = ctranslate2.Translator(str(int8_folder), compute_type="int8", intra_threads=threads)
    source_tokens = [tokenizer.convert_ids_to_tokens(tokenizer(sentence)["input_ids"]) for sentence in sources]

    def ct2_strings(results: list) -> list[str]:
        return [tokenizer.convert_tokens_to_string(result.hypotheses[0]) for result in results]

    # (a) greedy, token for token
    ours = our_greedy(model, tokenizer, sources)
    theirs = [
        tokenizer.convert_tokens_to_ids(result.hypotheses[0])
        for result in fp32.translate_batch(
            source_tokens,
            beam_size=1,
            max_decoding_length=MAX_NEW_TOKENS,
            return_end_token=True,
            max_batch_size=BATCH_SIZE,
        )
    ]
    # How far apart the two implementations' numbers are: CTranslate2 scores our outputs (it appends </s> itself).
    eos = model.config.eos_token_id
    scored = fp32.score_batch(
        source_tokens,
        [tokenizer.convert_ids_to_tokens(ids[:-1] if ids[-1] == eos else ids) for ids in ours.ids],
        max_batch_size=BATCH_SIZE,
    )
    discrepancy = max(
        abs(a - b)
        for result, log_probs in zip(scored, ours.log_probs, strict=True)
        # an output cut at the length limit gets one </s> more there
        for a, b in zip(result.log_probs[: len(log_probs)], log_probs, strict=True)
    )
    differing = {i: first_difference(o, t) for i, (o, t) in enumerate(zip(ours.ids, theirs, strict=True)) if o != t}
    gaps_at_difference = {i: ours.gaps[i][k] if k < len(ours.gaps[i]) else None for i, k in differing.items()}

    # (b) beam search with the options the export prints and our source + 50 cap, against ours with the same rule
    # (transformers' length penalty, CTranslate2's) and with our generation config (the paper's GNMT penalty)
    generation = model.generation_config
    beams, alpha = generation.num_beams, generation.length_penalty
    extra = generation.max_new_tokens_over_source
    note = decoding_note(generation)
    assert f"beam_size={beams}, length_penalty={alpha}" in note and f"source length + {extra} cap" in note
    options = dict(beam_size=beams, length_penalty=alpha, max_batch_size=BATCH_SIZE)
    ct2_beam = ct2_strings(translate_with_source_cap(fp32, source_tokens, extra, **options))
    paper = translate(model, tokenizer, sources, batch_size=BATCH_SIZE, progress=False)
    same_rule = translate(model, tokenizer, sources, batch_size=BATCH_SIZE, progress=False, length_penalty_type="power")

    # (c) int8, the same beam search
    int8_beam = ct2_strings(translate_with_source_cap(int8, source_tokens, extra, **options))

    scores = {
        "ours greedy": bleu(tokenizer.batch_decode(ours.ids, skip_special_tokens=True), references),
        "ours beam (paper)": bleu(paper, references),
        "ours beam (power)": bleu(same_rule, references),
        "ct2 beam": bleu(ct2_beam, references),
        "ct2 int8 beam": bleu(int8_beam, references),
    }
    measured = [  # shown with -s: the numbers behind the tolerances
        f"greedy {len(sources) - len(differing)}/{len(sources)} identical, gaps where not: {gaps_at_difference}",
        f"smallest top-2 gap {min(min(gaps) for gaps in ours.gaps):.1e}",
        f"log-prob discrepancy {discrepancy:.1e}",
        f"beam identical {identical_fraction(same_rule, ct2_beam):.3f} (same rule), "
        f"{identical_fraction(paper, ct2_beam):.3f} (paper)",
        *(f"{name} {score:.2f}" for name, score in scores.items()),
    ]
    print("; ".join(measured))

    assert scores["ours beam (paper)"] >= REAL_TRANSLATOR_BLEU
    assert discrepancy < NEAR_TIE / 10, f"CTranslate2 scores our greedy outputs {discrepancy:.1e} apart from us"
    near_ties = {i: gap for i, gap in gaps_at_difference.items() if gap is not None and gap < NEAR_TIE}
    assert near_ties == gaps_at_difference, f"greedy outputs differ after decisive steps: {gaps_at_difference}"
    assert len(near_ties) <= MAX_NEAR_TIE_SENTENCES, f"greedy outputs differ at near-ties: {near_ties}"

    assert identical_fraction(same_rule, ct2_beam) >= SAME_RULE_IDENTICAL
    assert identical_fraction(paper, ct2_beam) >= PAPER_IDENTICAL
    assert scores["ct2 beam"] >= REAL_TRANSLATOR_BLEU

    if int8_products_use_vnni():
        assert abs(scores["ct2 int8 beam"] - scores["ct2 beam"]) <= INT8_BLEU_TOLERANCE
    else:
        assert scores["ct2 int8 beam"] >= REAL_TRANSLATOR_BLEU
