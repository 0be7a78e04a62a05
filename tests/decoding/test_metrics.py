"""BLEU / chrF: the bundled evaluate metric against sacrebleu, offline loading, and the paper's tokenized BLEU."""

from __future__ import annotations

import re
import socket

import evaluate
import pytest
import sacrebleu
from sacremoses import MosesTokenizer

from hf_vaswani.decoding.metrics import (
    SACREBLEU_METRIC_PATH,
    corpus_scores,
    load_sacrebleu,
    lowercased_tokenized_bleu,
    tokenize_for_bleu,
    tokenized_bleu,
)

# Small realistic En->De system output: word order slips, a wrong compound part, a missing word, quotes, numbers.
REFERENCES = [
    "Die Regierung hat am Dienstag neue Maßnahmen gegen die Inflation angekündigt.",
    "Das Max-Planck-Institut für Physik veröffentlichte am Montag eine neue Studie.",
    "„Wir sind sehr zufrieden mit dem Ergebnis“, sagte der Sprecher.",
    "Die Preise stiegen im Oktober um 3,5 Prozent auf 1.200 Euro.",
    "Der Zug nach München fährt um 20:15 Uhr vom Hauptbahnhof ab.",
    "Viele Kinder spielen nach der Schule im Park.",
    "Die E-Mail wurde an alle Mitarbeiter der Firma geschickt.",
    "Es ist nicht klar, ob das Treffen stattfinden wird.",
]
HYPOTHESES = [
    "Die Regierung kündigte am Dienstag neue Maßnahmen gegen die Inflation an.",
    "Das Max-Planck-Gesellschaft für Physik veröffentlichte am Montag eine neue Studie.",
    "„Wir sind mit dem Ergebnis sehr zufrieden“, sagte der Sprecher.",
    "Die Preise stiegen im Oktober um 3,5 Prozent auf 1.200 Euro.",
    "Der Zug nach München fährt um 20:15 Uhr ab Hauptbahnhof.",
    "Viele Kinder spielen im Park nach der Schule.",
    "Die E-Mail wurde an alle Angestellten der Firma gesendet.",
    "Es ist unklar, ob das Treffen stattfindet.",
]
# A second reference per segment, for the multi-reference layout.
SECOND_REFERENCES = [
    "Am Dienstag kündigte die Regierung neue Maßnahmen gegen die Inflation an.",
    "Am Montag veröffentlichte das Max-Planck-Institut für Physik eine neue Studie.",
    "„Mit dem Ergebnis sind wir sehr zufrieden“, sagte der Sprecher.",
    "Im Oktober stiegen die Preise um 3,5 Prozent auf 1.200 Euro.",
    "Der Zug nach München verlässt den Hauptbahnhof um 20:15 Uhr.",
    "Nach der Schule spielen viele Kinder im Park.",
    "Die E-Mail ging an alle Mitarbeiter der Firma.",
    "Ob das Treffen stattfinden wird, ist nicht klar.",
]


def _block_network(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    # evaluate reads HF_EVALUATE_OFFLINE once, at import; set the parsed flag too.
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_metric_script_is_shipped_inside_the_package() -> None:
    assert (SACREBLEU_METRIC_PATH / f"{SACREBLEU_METRIC_PATH.name}.py").is_file()


def test_evaluate_metric_matches_sacrebleu_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    _block_network(monkeypatch)
    metric = load_sacrebleu()
    references = [[reference] for reference in REFERENCES]
    result = metric.compute(predictions=HYPOTHESES, references=references)
    expected = sacrebleu.corpus_bleu(HYPOTHESES, list(zip(*references, strict=True)))
    assert result["score"] == pytest.approx(expected.score, abs=1e-9)
    assert 10 < result["score"] < 90  # the corpus has errors but is far from random
    assert result["counts"] == expected.counts and result["sys_len"] == expected.sys_len
    assert "tok:13a" in result["signature"] and "nrefs:1" in result["signature"]

    # Plain reference strings are accepted too, and two references per segment are scored as such.
    assert metric.compute(predictions=HYPOTHESES, references=REFERENCES)["score"] == pytest.approx(expected.score)
    two_refs = [list(pair) for pair in zip(REFERENCES, SECOND_REFERENCES, strict=True)]
    multi = metric.compute(predictions=HYPOTHESES, references=two_refs)
    expected_multi = sacrebleu.corpus_bleu(HYPOTHESES, list(zip(*two_refs, strict=True))).score
    assert multi["score"] == pytest.approx(expected_multi, abs=1e-9)
    assert multi["score"] > result["score"]


def test_corpus_scores_match_sacrebleu_bleu_and_chrf() -> None:
    scores = corpus_scores(HYPOTHESES, REFERENCES)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score, abs=1e-9)
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert "nc:6|nw:0" in scores["chrf_signature"]  # chrF2, not chrF++


def test_perfect_translation_scores_100() -> None:
    scores = corpus_scores(REFERENCES, REFERENCES)
    assert scores["bleu"] == pytest.approx(100.0)
    assert scores["chrf"] == pytest.approx(100.0)
    assert tokenized_bleu(REFERENCES, REFERENCES) == pytest.approx(100.0)


def _reference_tokenize(text: str, split_compounds: bool) -> str:
    """The get_ende_bleu.sh pipeline written out independently of hf_vaswani.decoding.metrics."""
    # replace-unicode-punctuation.perl, for the characters this corpus uses („ is not in its table).
    text = text.replace("“", '"').replace("”", '"').replace("’", "'")
    tokens = MosesTokenizer(lang="de").tokenize(text, return_str=True, escape=True)  # tokenizer.perl -l de
    if split_compounds:
        tokens = re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", tokens)  # perl -ple 's{(\S)-(\S)}{...}g'
    return tokens


@pytest.mark.parametrize("split_compounds", [True, False])
def test_tokenized_bleu_matches_multi_bleu_on_own_tokenization(split_compounds: bool) -> None:
    hypotheses = [_reference_tokenize(text, split_compounds) for text in HYPOTHESES]
    references = [_reference_tokenize(text, split_compounds) for text in REFERENCES]
    # Every n-gram order has matches here, so multi-bleu.perl (no smoothing) and sacreBLEU's default smoothing agree.
    expected = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none", force=True).score
    unsmoothed = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="none", smooth_method="none", force=True)
    assert expected == pytest.approx(unsmoothed.score)
    assert tokenized_bleu(HYPOTHESES, REFERENCES, compound_splitting=split_compounds) == pytest.approx(expected)


def test_tokenize_for_bleu_matches_the_perl_pipeline() -> None:
    # tokenizer.perl escapes by default; unicode punctuation is replaced; non-overlapping split leaves "b-c" joined.
    assert tokenize_for_bleu("„Max-Planck“ & 'Co'") == "„ Max ##AT##-##AT## Planck &quot; &amp; &apos; Co &apos;"
    assert tokenize_for_bleu("a-b-c") == "a ##AT##-##AT## b-c"
    assert tokenize_for_bleu("E-Mail", compound_splitting=False) == "E-Mail"


def test_compound_splitting_gives_partial_credit() -> None:
    references = ["Das Max-Planck-Institut für Physik veröffentlichte am Montag eine neue Studie."]
    partly_right = ["Das Max-Planck-Gesellschaft für Physik veröffentlichte am Montag eine neue Studie."]
    all_wrong = ["Das Fraunhofer-Helmholtz-Gesellschaft für Physik veröffentlichte am Montag eine neue Studie."]
    # Without splitting each compound is one wrong token, so both outputs score the same.
    unsplit_partly = tokenized_bleu(partly_right, references, compound_splitting=False)
    assert unsplit_partly == pytest.approx(tokenized_bleu(all_wrong, references, compound_splitting=False))
    # With it, "Max" and "Planck" match on their own: the partly right compound earns credit the wrong one does not.
    split_partly = tokenized_bleu(partly_right, references)
    assert tokenized_bleu(all_wrong, references) < split_partly < 100
    # On the whole corpus, the paper's metric is not sacreBLEU.
    assert tokenized_bleu(HYPOTHESES, REFERENCES) != pytest.approx(corpus_scores(HYPOTHESES, REFERENCES)["bleu"])


def test_tokenized_bleu_is_unsmoothed_like_multi_bleu() -> None:
    # No matching 4-gram: multi-bleu.perl reports 0, whatever the lower orders.
    assert tokenized_bleu(["Das Haus ist klein"], ["Das Haus war klein"]) == 0.0


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        corpus_scores(HYPOTHESES, REFERENCES[:-1])
    with pytest.raises(ValueError):
        tokenized_bleu(HYPOTHESES[:-1], REFERENCES)
    with pytest.raises(ValueError):
        corpus_scores([], [])


# Multi30k-like sentences with what tokenizer.perl -l de -no-escape and lowercasing make of them, written out by hand.
CAPTIONS = [
    ('Ein Mann mit "Hut" & Jacke läuft die Gasse.', 'ein mann mit " hut " & jacke läuft die gasse .'),
    ("Zwei Kinder spielen im Park, während es regnet.", "zwei kinder spielen im park , während es regnet ."),
    ("Eine Frau trinkt 3,5 Liter Wasser.", "eine frau trinkt 3,5 liter wasser ."),
    ("Ein Hund läuft über die grüne Wiese.", "ein hund läuft über die grüne wiese ."),
]
CAPTION_HYPOTHESES = [
    ('Ein Mann mit "Mütze" & Jacke geht die Gasse.', 'ein mann mit " mütze " & jacke geht die gasse .'),
    ("Zwei KINDER spielen im Park, während es regnet!", "zwei kinder spielen im park , während es regnet !"),
    ("Eine Frau trinkt Wasser.", "eine frau trinkt wasser ."),
    ("Ein Hund rennt über die Wiese.", "ein hund rennt über die wiese ."),
]


def test_lowercased_tokenized_bleu_is_sacrebleu_on_lowercased_moses_tokens() -> None:
    references, tokenized_references = zip(*CAPTIONS, strict=True)
    hypotheses, tokenized_hypotheses = zip(*CAPTION_HYPOTHESES, strict=True)
    result = lowercased_tokenized_bleu(hypotheses, references, lang="de")
    expected = sacrebleu.corpus_bleu(
        list(tokenized_hypotheses), [list(tokenized_references)], tokenize="none", smooth_method="none", force=True
    )
    assert result["bleu"] == pytest.approx(expected.score, abs=1e-9) and 0 < result["bleu"] < 100
    assert result["signature"].startswith("moses-tok:de|nrefs:1|case:lc|eff:no|tok:none|smooth:none|version:")
    # Case and punctuation glued to words do not count against a hypothesis; 13a's mixed-case sacreBLEU differs.
    assert lowercased_tokenized_bleu([text.upper() for text in references], references)["bleu"] == pytest.approx(100)
    assert result["bleu"] != pytest.approx(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)
