"""Ensembles (decoding/search.py's `EnsembleDecoder`, `Translator` given several models): each token scored by the log
of the models' mean probability, against that formula computed by teacher forcing, exhaustively for beam search."""

import json
import shutil

import pytest
import torch
from helpers import EOS, best, exhaustive_scores, offset_eos_logit, padded_batch, peaked_model, refused, strip
from tiny import PROBE_SENTENCES

from hf_vaswani import Translator, UsageError, kernelize
from hf_vaswani.cli import main


def test_wide_beams_return_the_exhaustive_best_of_the_mean_probability() -> None:
    """With as many beams as prefixes, an ensemble's beam search returns the best output under the product over its
    tokens of the models' mean probability, with that score."""
    max_new, checked = 3, 0
    for seeds, eos_boosts, alpha in [((0, 1), (0.0, 3.0), 0.6), ((2, 3), (2.0, 0.0), 1.0), ((4, 5), (4.0, 1.0), 0.6)]:
        models = []
        for seed, eos_boost in zip(seeds, eos_boosts, strict=True):
            model = peaked_model(seed)
            offset_eos_logit(model, eos_boost)
            models.append(kernelize(model).eval())
        source = torch.tensor([[3, 4, 5, EOS]])
        scores = exhaustive_scores(models, source, max_new, alpha)
        alone = [best(exhaustive_scores([model], source, max_new, alpha), "power")[0] for model in models]
        expected, margin = best(scores, "power")
        if margin < 1e-4:
            continue  # a near tie: float rounding could pick either
        output = Translator(models).generate(
            source,
            num_beams=5**max_new,
            max_new_tokens=max_new,
            early_stopping="never",
            length_penalty=alpha,
            length_penalty_type="power",
            max_new_tokens_over_source=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert strip(output.sequences[0]) == expected, (seeds, expected, alone)
        assert float(output.sequences_scores[0]) == pytest.approx(scores[expected]["power"], abs=1e-4)
        checked += 1
    assert checked >= 2


def test_greedy_search_takes_the_argmax_of_the_mean_probability() -> None:
    """Each step's token is the argmax of the models' mean next-token probability given the tokens so far, computed
    here by whole forward passes (no cache), and its scores are the log of that mean."""
    models = [kernelize(peaked_model(seed, vocab_size=13)).eval() for seed in (6, 7, 8)]
    source, mask = padded_batch(13, [5, 3, 7, 4], seed=0, eos_token_id=EOS)
    max_new = 6
    output = Translator(models).generate(
        source,
        attention_mask=mask,
        num_beams=1,
        max_new_tokens=max_new,
        max_new_tokens_over_source=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = torch.full((source.shape[0], 1), models[0].config.decoder_start_token_id)
    finished = torch.zeros(source.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for step in range(max_new):
            probabilities = torch.stack(
                [
                    model(input_ids=source, attention_mask=mask, decoder_input_ids=tokens).logits[:, -1].softmax(-1)
                    for model in models
                ]
            ).mean(0)
            torch.testing.assert_close(output.scores[step], probabilities.log(), atol=1e-5, rtol=1e-5)
            next_tokens = probabilities.argmax(-1).masked_fill(finished, models[0].config.pad_token_id)
            tokens = torch.cat((tokens, next_tokens[:, None]), dim=1)
            finished |= next_tokens == EOS
            if finished.all():
                break
    assert torch.equal(output.sequences, tokens)


def test_an_ensemble_must_share_one_vocabulary_and_be_the_packages_models() -> None:
    with pytest.raises(UsageError, match="share one vocabulary.*vocab_size"):
        Translator([peaked_model(0, vocab_size=6), peaked_model(1, vocab_size=7)])
    with pytest.raises(UsageError, match="at least one model"):
        Translator([])


def test_the_commands_decode_an_ensemble_of_folders(tmp_path, trained_folder, capsys) -> None:
    """`vaswani translate A B` and `vaswani evaluate A B`: the toy model twice is its own distribution, so the
    ensemble translates as it does (every probe sentence capitalised); a folder whose tokenizer numbers the tokens
    otherwise, or --alignments, is refused in one line."""
    source = tmp_path / "probe.txt"
    source.write_text("\n".join(PROBE_SENTENCES) + "\n")
    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(sentence.upper() for sentence in PROBE_SENTENCES) + "\n")
    capsys.readouterr()
    main(["translate", str(trained_folder), str(trained_folder), "--input", str(source)])
    assert capsys.readouterr().out.splitlines() == [sentence.upper() for sentence in PROBE_SENTENCES]
    main(["evaluate", str(trained_folder), str(trained_folder), "--source", str(source), "--reference", str(reference)])
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(100.0)

    renumbered = tmp_path / "renumbered"
    shutil.copytree(trained_folder, renumbered)
    tokenizer_file = renumbered / "tokenizer.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = [token for token, _ in sorted(vocabulary.items(), key=lambda item: item[1])][-2:]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    tokenizer_file.write_text(json.dumps(tokenizer))
    refused(capsys, ["translate", str(trained_folder), str(renumbered), "--input", str(source)], "vocabularies")
    refused(capsys, ["translate", str(trained_folder), str(trained_folder), "--alignments"], "--alignments")
