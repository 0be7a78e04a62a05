"""sacreBLEU (and optionally chrF) as an `evaluate` metric that loads from a local path, without the Hub.

`evaluate.load("sacrebleu")` fetches its script from the Hugging Face Hub, which fails offline. This file is shipped
inside hf_vaswani and loaded with `evaluate.load("<package dir>/evaluate_metrics/sacrebleu_local")`: evaluate resolves a
directory to the script of the same name inside it and copies the script into its modules cache, so the script must
stay self-contained (library imports only, no relative imports).

Input format follows the Hub's sacrebleu metric: `references` holds, for each prediction, a list of its references
(all predictions with the same number), or a single reference string per prediction.
"""

from __future__ import annotations

import datasets
import evaluate
from sacrebleu.metrics import BLEU, CHRF

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    address = "Belgium, Brussels",
    publisher = "Association for Computational Linguistics",
    url = "https://www.aclweb.org/anthology/W18-6319",
    pages = "186--191",
}
"""

_DESCRIPTION = """\
Corpus-level BLEU computed by sacreBLEU on detokenized text, with its own standard tokenization (13a by default), so
scores are comparable across systems and report a signature of the settings used. Optionally also chrF (chrF2 by
default, chrF++ with chrf_word_order=2).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): detokenized system outputs.
    references (list of list of str, or list of str): the references of each prediction; every prediction must have
        the same number of references.
    smooth_method (str): 'exp' (default), 'none', 'floor' or 'add-k'.
    smooth_value (float): for 'floor' and 'add-k'; sacreBLEU's default when None.
    force (bool): do not warn about apparently tokenized input. Defaults to False.
    lowercase (bool): case-insensitive BLEU. Defaults to False.
    tokenize (str): sacreBLEU tokenizer ('13a', 'intl', 'zh', 'ja-mecab', 'char', 'none', ...); None means '13a'.
    use_effective_order (bool): ignore n-gram orders with no matches (for sentence-level BLEU). Defaults to False.
    include_chrf (bool): also compute chrF. Defaults to False.
    chrf_char_order (int), chrf_word_order (int), chrf_beta (int): chrF parameters, defaults 6, 0, 2 (chrF2).
Returns:
    score (float): BLEU, 0-100.
    counts, totals (list of int): matching / total n-grams for n = 1..4.
    precisions (list of float): n-gram precisions, 0-100.
    bp (float): brevity penalty.
    sys_len, ref_len (int): hypothesis and effective reference lengths in tokens.
    signature (str): sacreBLEU's BLEU signature, e.g. 'nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0'.
    chrf (float), chrf_signature (str): only with include_chrf=True.
Examples:
    >>> metric = evaluate.load("path/to/sacrebleu_local")
    >>> metric.compute(predictions=["Das Haus ist klein."], references=[["Das Haus ist klein."]])["score"]
    100.00000000000004
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SacrebleuLocal(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            homepage="https://github.com/mjpost/sacrebleu",
            # Two accepted input layouts; evaluate picks the one matching the first example.
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references"),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
            codebase_urls=["https://github.com/mjpost/sacrebleu"],
            reference_urls=["https://www.aclweb.org/anthology/W18-6319"],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[list[str]] | list[str],
        smooth_method: str = "exp",
        smooth_value: float | None = None,
        force: bool = False,
        lowercase: bool = False,
        tokenize: str | None = None,
        use_effective_order: bool = False,
        include_chrf: bool = False,
        chrf_char_order: int = CHRF.CHAR_ORDER,
        chrf_word_order: int = CHRF.WORD_ORDER,
        chrf_beta: int = CHRF.BETA,
    ) -> dict[str, object]:
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} reference entries")
        if references and isinstance(references[0], str):
            references = [[reference] for reference in references]
        references_per_prediction = len(references[0]) if references else 1
        if any(len(refs) != references_per_prediction for refs in references):
            raise ValueError("sacreBLEU requires the same number of references for each prediction")
        # sacreBLEU takes reference *streams* (one list per reference position), the transpose of evaluate's layout.
        reference_streams = [[refs[i] for refs in references] for i in range(references_per_prediction)]

        bleu = BLEU(
            lowercase=lowercase,
            force=force,
            tokenize=tokenize,
            smooth_method=smooth_method,
            smooth_value=smooth_value,
            effective_order=use_effective_order,
        )
        output = bleu.corpus_score(predictions, reference_streams)
        result: dict[str, object] = {
            "score": output.score,
            "counts": output.counts,
            "totals": output.totals,
            "precisions": output.precisions,
            "bp": output.bp,
            "sys_len": output.sys_len,
            "ref_len": output.ref_len,
            "signature": str(bleu.get_signature()),
        }
        if include_chrf:
            chrf = CHRF(char_order=chrf_char_order, word_order=chrf_word_order, beta=chrf_beta, lowercase=lowercase)
            result["chrf"] = chrf.corpus_score(predictions, reference_streams).score
            result["chrf_signature"] = str(chrf.get_signature())
        return result
