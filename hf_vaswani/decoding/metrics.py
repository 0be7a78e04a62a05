"""Translation metrics: sacreBLEU / chrF through a bundled `evaluate` metric, and the paper's tokenized BLEU.

Two different BLEUs live here, and their numbers must not be compared with each other:

* `corpus_scores` - sacreBLEU (detokenized text, the standard 13a tokenization, signature reported) and chrF2. This is
  the comparable, modern way to report translation quality.
* `tokenized_bleu` - BLEU as the paper reported it in 2017, reproducing tensor2tensor's `get_ende_bleu.sh`: Moses
  tokenization, then compound splitting ("rich-text" -> "rich ##AT##-##AT## text"), then `multi-bleu.perl`. The split
  gives partial credit for partly right hyphenated compounds, and scores typically come out higher than sacreBLEU.
* `lowercased_tokenized_bleu` - BLEU on lowercased, Moses-tokenized text, without compound splitting: how the
  Multi30k literature scores (fairseq on lowercased, tokenized data), also NOT comparable to sacreBLEU.
* `whitespace_bleu` - BLEU on the whitespace tokens of the text as it is (fairseq's scorer): the published Multi30k
  numbers, when the model was trained on prepared text (scripts/prepare_multi30k.py); on raw text it is not meaningful.

All metric computation runs offline: the `evaluate` metric is loaded by path from the script shipped in this package.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import evaluate
import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from ..model.errors_vaswani import UsageError

__all__ = [
    "SACREBLEU_METRIC_PATH",
    "corpus_scores",
    "load_sacrebleu",
    "lowercased_tokenized_bleu",
    "tokenize_for_bleu",
    "tokenized_bleu",
    "whitespace_bleu",
]

# evaluate.load(<directory>) loads <directory>/<directory name>.py, so the directory and script names must agree.
SACREBLEU_METRIC_PATH: Path = Path(__file__).resolve().parent / "evaluate_metrics" / "sacrebleu_local"

# tensor2tensor's get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. Python's re.sub, like Perl's s///g,
# scans left to right without overlapping matches, so chains such as "a-b-c" split identically ("b-c" stays joined).
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)")
_COMPOUND_REPLACEMENT = r"\1 ##AT##-##AT## \2"


def load_sacrebleu(**kwargs: Any) -> evaluate.EvaluationModule:
    """Load the bundled sacreBLEU `evaluate` metric by local path, so it works offline (no Hub access).

    Use as `metric.compute(predictions=[...], references=[[...], ...])`; `score` equals
    `sacrebleu.corpus_bleu(predictions, list(zip(*references))).score`. Pass `include_chrf=True` to `compute` for chrF.
    Keyword arguments go to `evaluate.load`; `keep_in_memory` defaults to True because the metric is computed in a
    single process and needs no Arrow cache files on disk.
    """
    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(SACREBLEU_METRIC_PATH), **kwargs)


@functools.cache
def _shared_sacrebleu() -> evaluate.EvaluationModule:
    # Loading copies and hashes the script into evaluate's module cache; do it once per process. compute() clears the
    # metric's state after each call, so one instance can be reused.
    return load_sacrebleu()


def _check_corpus(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise TypeError("hypotheses and references must be sequences of strings, one per segment")
    if len(hypotheses) != len(references):
        raise UsageError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise UsageError("cannot score an empty corpus")


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """sacreBLEU and chrF2 of detokenized `hypotheses` against one reference each.

    Returns:
        `bleu` (sacreBLEU, 13a tokenization, exp smoothing: the standard signature), `chrf` (chrF2), `bleu_signature`,
        `chrf_signature`, and BLEU's details `precisions`, `bp`, `sys_len`, `ref_len`. Computed with the bundled
        `evaluate` metric (see `load_sacrebleu`).
    """
    _check_corpus(hypotheses, references)
    result = _shared_sacrebleu().compute(
        predictions=list(hypotheses), references=[[reference] for reference in references], include_chrf=True
    )
    return {
        "bleu": result["score"],
        "chrf": result["chrf"],
        "bleu_signature": result["signature"],
        "chrf_signature": result["chrf_signature"],
        "precisions": result["precisions"],
        "bp": result["bp"],
        "sys_len": result["sys_len"],
        "ref_len": result["ref_len"],
    }


@functools.cache
def _moses_tokenizer(lang: str) -> MosesTokenizer:
    # Construction reads the language's non-breaking prefix list; cache it.
    return MosesTokenizer(lang=lang)


@functools.cache
def _punct_normalizer(lang: str) -> MosesPunctNormalizer:
    return MosesPunctNormalizer(lang=lang)


def tokenize_for_bleu(
    text: str, lang: str = "de", *, compound_splitting: bool = True, replace_unicode_punct: bool = True
) -> str:
    """One segment through the preprocessing of tensor2tensor's `get_ende_bleu.sh` (see `tokenized_bleu`).

    1. `replace-unicode-punctuation.perl` (e.g. “ and ” -> '"', ’ -> "'", full-width digits -> ASCII; German „ is
       left alone), if `replace_unicode_punct`;
    2. `tokenizer.perl -l <lang>` with its defaults: no aggressive hyphen splitting, and XML escaping ON
       (& < > ' " | [ ] become &amp; &lt; &gt; &apos; &quot; &#124; &#91; &#93;) because tokenizer.perl escapes unless
       given `-no-escape`. Escaping maps whole tokens one to one and adds no spaces or hyphens, so it does not change
       the BLEU score when both sides get it; it is kept only to produce the script's exact token strings;
    3. `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g` compound splitting, if `compound_splitting`.
    """
    if replace_unicode_punct:
        text = _punct_normalizer(lang).replace_unicode_punct(text)
    tokenized = _moses_tokenizer(lang).tokenize(text, return_str=True, escape=True, aggressive_dash_splits=False)
    if compound_splitting:
        tokenized = _COMPOUND_HYPHEN.sub(_COMPOUND_REPLACEMENT, tokenized)
    return tokenized


def tokenized_bleu(
    hypotheses: Sequence[str],
    references: Sequence[str],
    lang: str = "de",
    *,
    compound_splitting: bool = True,
    replace_unicode_punct: bool = True,
) -> float:
    """Tokenized BLEU with compound splitting (the paper's metric), NOT comparable to sacreBLEU.

    Reproduces how "Attention Is All You Need" scored En-De (tensor2tensor's `get_ende_bleu.sh`): both sides are
    Moses-tokenized and compound-split by `tokenize_for_bleu`, then scored like `multi-bleu.perl`: case-sensitive corpus
    BLEU over whitespace-separated tokens, no smoothing (a corpus with no matching 4-gram scores 0), brevity penalty
    from the reference length. That is `sacrebleu.corpus_bleu(..., tokenize="none", smooth_method="none")`.

    Differences from the script, on purpose: it ran replace-unicode-punctuation on the system output only, because its
    reference file was already tokenized; here the references are raw text, so both sides get the same
    preprocessing (otherwise a correct curly quote in the output would be counted wrong). The script's output is
    rounded to 2 decimals; this returns the unrounded score.

    Args:
        hypotheses: detokenized system outputs, one per segment.
        references: detokenized references, one per segment.
        lang: Moses tokenizer language (the target language).
        compound_splitting: apply the ##AT## split (False gives plain tokenized BLEU, for comparison).
        replace_unicode_punct: apply replace-unicode-punctuation first.
    """
    _check_corpus(hypotheses, references)
    tokenize = functools.partial(
        tokenize_for_bleu, lang=lang, compound_splitting=compound_splitting, replace_unicode_punct=replace_unicode_punct
    )
    tokenized_hypotheses = [tokenize(text) for text in hypotheses]
    tokenized_references = [tokenize(text) for text in references]
    # force=True: the input is tokenized on purpose, so silence sacreBLEU's "looks tokenized" warning.
    return sacrebleu.corpus_bleu(
        tokenized_hypotheses, [tokenized_references], tokenize="none", smooth_method="none", force=True
    ).score


def lowercased_tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str = "de") -> dict[str, Any]:
    """BLEU on lowercased, Moses-tokenized text (the Multi30k literature's number), with its sacreBLEU signature.

    Both sides go through sacremoses' `MosesTokenizer(lang).tokenize(..., escape=False)` (tokenizer.perl without
    XML escaping, the way fairseq's data is prepared), then sacreBLEU with `tokenize="none"` and `lowercase=True`,
    no smoothing (multi-bleu.perl and fairseq's scorer do none). Moses tokenization, not sacreBLEU's own 13a: 13a is
    not tokenizer.perl (it leaves e.g. non-breaking prefixes and apostrophes differently), and the published numbers
    are on Moses-tokenized text. sacreBLEU lowercases, so the signature says `case:lc|tok:none`; the returned
    signature prefixes it with `moses-tok:<lang>` to say what made the tokens.

    Returns:
        `bleu` (unrounded) and `signature`.
    """
    _check_corpus(hypotheses, references)
    tokenizer = _moses_tokenizer(lang)
    tokenized_hypotheses = [tokenizer.tokenize(text, return_str=True, escape=False) for text in hypotheses]
    tokenized_references = [tokenizer.tokenize(text, return_str=True, escape=False) for text in references]
    # force=True: the input is tokenized on purpose, so silence sacreBLEU's "looks tokenized" warning.
    metric = sacrebleu.BLEU(lowercase=True, tokenize="none", smooth_method="none", force=True)
    score = metric.corpus_score(tokenized_hypotheses, [tokenized_references])
    return {"bleu": score.score, "signature": f"moses-tok:{lang}|{metric.get_signature()}"}


def whitespace_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """BLEU on the whitespace-separated tokens of the text as given: fairseq's `bleu.Scorer` (what generate.py prints).

    Case-sensitive corpus BLEU, no smoothing, brevity penalty from the reference length: `sacrebleu.corpus_bleu(...,
    tokenize="none", smooth_method="none")`. The number Wu et al. (2021) report on Multi30k, whose text was lowercased
    and Moses-tokenized before training (scripts/prepare_multi30k.py): meaningful when hypotheses and references are
    text prepared that way, not on raw text.
    """
    _check_corpus(hypotheses, references)
    # force=True: the input is tokenized on purpose, so silence sacreBLEU's "looks tokenized" warning.
    return sacrebleu.corpus_bleu(
        list(hypotheses), [list(references)], tokenize="none", smooth_method="none", force=True
    ).score
