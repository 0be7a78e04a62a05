"""The vocabulary shortlist (hf_vaswani/decoding/shortlist.py): built as its formula says, decoded as a masked
vocabulary."""

import math

import pytest
import torch
from helpers import EOS, padded_batch, refused, sharpened
from tiny import PROBE_SENTENCES, TINY_MODEL, capitalised_pairs, random_model
from transformers import LogitsProcessor, LogitsProcessorList

from hf_vaswani import UsageError, generate, kernelize
from hf_vaswani.cli import main
from hf_vaswani.decoding.loading import load_model_folder
from hf_vaswani.decoding.search import projection_over
from hf_vaswani.decoding.shortlist import (
    SHORTLIST_FILE,
    Shortlist,
    build_shortlist,
    shortlist_of_corpus,
    write_ctranslate2_vocabulary_map,
)
from hf_vaswani.kernels.cpu import packed_weights
from hf_vaswani.kernels.quantization import quantize_int8

CORPUS = [  # (source ids, target ids): token 9 is in every target, 4 -> 7 always, 5 -> 8 mostly
    ([4, 5], [7, 8, 9]),
    ([4], [7, 9]),
    ([5, 6], [8, 9, 9]),
    ([6], [6, 9]),
    ([5], [7, 9]),
]


def strip_padding(row: list[int]) -> list[int]:
    """A generated row up to its </s> (included)."""
    return row[: row.index(2) + 1] if 2 in row else row


def dice_by_hand(corpus, source: int, target: int) -> float:
    both = sum(source in s and target in t for s, t in corpus)
    return 2 * both / max(1, sum(source in s for s, _ in corpus) + sum(target in t for _, t in corpus))


def test_each_source_lists_its_targets_of_highest_dice_coefficient() -> None:
    vocab_size, per_source = 12, 2
    shortlist = build_shortlist(CORPUS, vocab_size, special_ids=[2], per_source=per_source, frequent=1)
    for source in range(vocab_size):
        expected = sorted(
            (target for target in range(vocab_size) if dice_by_hand(CORPUS, source, target) > 0),
            key=lambda target: (-dice_by_hand(CORPUS, source, target), target),
        )[:per_source]
        listed = [t for t in shortlist.candidates[source].tolist() if t >= 0]
        assert listed == expected, source
    assert shortlist.candidates[4].tolist() == [7, 9]  # c(4,7)=2: Dice 1; c(4,9)=2: Dice 2*2/(2+5)
    assert shortlist.always.tolist() == [2, 9]  # the most frequent target token, and the special one


def test_a_batch_lists_the_union_of_its_sources_candidates_and_the_frequent_tokens() -> None:
    shortlist = build_shortlist(CORPUS, 12, special_ids=[2], per_source=1, frequent=1)
    source = torch.tensor([[4, 6, 0], [5, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = {2, 9} | {int(shortlist.candidates[token, 0]) for token in (4, 6, 5)}
    assert shortlist.columns(source, mask).tolist() == sorted(expected)
    assert 0 not in shortlist.columns(source, mask).tolist()  # padding is not a source token
    assert set(shortlist.columns(source).tolist()) >= expected  # without a mask, every position counts


class OutsideColumnsBarred(LogitsProcessor):
    """The reference: the scores of the unlisted tokens set to -inf (transformers then renormalises them)."""

    def __init__(self, columns: torch.Tensor):
        self.columns = columns

    def __call__(self, input_ids, scores):
        barred = torch.ones(scores.shape[-1], dtype=torch.bool)
        barred[self.columns] = False
        return scores.masked_fill(barred, -math.inf)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoding_with_a_shortlist_is_decoding_with_the_other_tokens_barred_and_scores_renormalised(seed) -> None:
    model = sharpened(kernelize(random_model(seed, TINY_MODEL)))
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=seed, eos_token_id=EOS)
    generator = torch.Generator().manual_seed(seed)
    listed = torch.randperm(model.config.vocab_size, generator=generator)[:20]
    shortlist = Shortlist(
        always=torch.tensor([2, 3]), candidates=listed[torch.randint(0, 20, (model.config.vocab_size, 4))]
    )
    columns = shortlist.columns(source, mask)
    assert 6 < len(columns) < model.config.vocab_size - 10
    for call in (dict(num_beams=1), dict(num_beams=4), dict(num_beams=3, num_return_sequences=2)):
        common = dict(attention_mask=mask, output_scores=True, return_dict_in_generate=True, **call)
        ours = generate(model, source, shortlist=shortlist, **common)
        with packed_weights(model):  # multiplied as the package's search multiplies: the loops are compared
            reference = model.generate(
                source,
                logits_processor=LogitsProcessorList([OutsideColumnsBarred(columns)]),
                renormalize_logits=True,
                **common,
            )
        assert torch.equal(ours.sequences, reference.sequences), call
        assert set(ours.sequences[:, 1:].unique().tolist()) <= set(columns.tolist()) | {0}
        if call["num_beams"] > 1:
            torch.testing.assert_close(ours.sequences_scores, reference.sequences_scores, rtol=1e-5, atol=1e-5)
        for ours_step, reference_step in zip(ours.scores, reference.scores, strict=True):
            listed_scores = ours_step[:, columns]
            assert torch.isinf(ours_step).sum() >= ours_step.shape[0] * (model.config.vocab_size - len(columns))
            if call["num_beams"] > 1:  # log-probabilities over the listed tokens
                torch.testing.assert_close(listed_scores, reference_step[:, columns], rtol=1e-5, atol=1e-5)


def test_an_int8_projection_over_the_listed_columns_gives_the_int8_projections_values_there() -> None:
    """The shortlist's int8 product multiplies by the int8 projection's own rows: torch.ao's module over the whole
    vocabulary gives the same values in those columns, bit for bit (each column is its own int8 dot product)."""
    model = quantize_int8(kernelize(random_model(0, TINY_MODEL)))
    projection = model.get_output_embeddings()
    assert isinstance(projection, torch.ao.nn.quantized.dynamic.Linear)
    hidden = torch.randn(6, 1, model.config.d_model, generator=torch.Generator().manual_seed(0))
    columns = torch.tensor([0, 3, 4, 17, model.config.vocab_size - 1])
    unpacked = (projection.weight(), projection.bias())
    assert torch.equal(projection_over(projection, columns, unpacked)(hidden), projection(hidden)[..., columns])


def test_a_shortlist_of_every_token_decodes_as_the_whole_vocabulary() -> None:
    model = sharpened(kernelize(random_model(3, TINY_MODEL)))
    source, mask = padded_batch(model.config.vocab_size, [7, 4, 2], seed=3, eos_token_id=EOS)
    vocabulary = torch.arange(model.config.vocab_size)
    shortlist = Shortlist(always=vocabulary, candidates=torch.full((model.config.vocab_size, 1), -1))
    for num_beams in (1, 4):
        with packed_weights(model):
            whole = model.generate(source, attention_mask=mask, num_beams=num_beams)
        assert torch.equal(
            generate(model, source, attention_mask=mask, num_beams=num_beams, shortlist=shortlist), whole
        )


def test_saved_loaded_and_refused_when_damaged(tmp_path) -> None:
    shortlist = build_shortlist(CORPUS, 12, special_ids=[2], per_source=2, frequent=1)
    shortlist.save(tmp_path)
    loaded = Shortlist.load(tmp_path, 12)
    assert torch.equal(loaded.always, shortlist.always) and torch.equal(loaded.candidates, shortlist.candidates)
    with pytest.raises(ValueError, match=f"{SHORTLIST_FILE}: not a shortlist for a vocabulary of 11 tokens"):
        Shortlist.load(tmp_path, 11)
    (tmp_path / SHORTLIST_FILE).write_bytes(b"damaged")
    with pytest.raises(ValueError, match=f"{SHORTLIST_FILE}: not a readable shortlist"):
        Shortlist.load(tmp_path, 12)


def test_vocabulary_map_lists_the_same_tokens_for_ctranslate2(tmp_path) -> None:
    shortlist = build_shortlist(CORPUS, 12, special_ids=[2], per_source=2, frequent=1)
    tokens = [f"t{i}" for i in range(12)]
    write_ctranslate2_vocabulary_map(shortlist, tokens, tmp_path / "vmap.txt")
    lines = (tmp_path / "vmap.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "\tt2 t9"  # the empty key: always candidates
    rules = dict(line.split("\t") for line in lines[1:])
    assert rules["t4"] == "t7 t9" and set(rules) == {f"t{s}" for s in (4, 5, 6)}


def test_shortlist_and_translate_commands(tmp_path, trained_folder, capsys) -> None:
    """`vaswani shortlist` builds from a corpus into the folder; `translate --shortlist` then translates as before."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(trained_folder, folder)
    pairs = capitalised_pairs(400, seed=0)
    (tmp_path / "src.txt").write_text("\n".join(s for s, _ in pairs) + "\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("\n".join(t for _, t in pairs) + "\n", encoding="utf-8")
    refused(capsys, ["translate", str(folder), "--shortlist"], "--shortlist", SHORTLIST_FILE, "vaswani shortlist")
    corpus = ["--source", str(tmp_path / "src.txt"), "--target", str(tmp_path / "tgt.txt")]
    refused(capsys, ["shortlist", str(folder), *corpus, "--per-source", "0"], "--per-source")
    main(["shortlist", str(folder), *corpus, "--per-source", "4", "--frequent", "0"])
    assert capsys.readouterr().out.strip() == str(folder / SHORTLIST_FILE)
    model, tokenizer = load_model_folder(folder)
    batch = tokenizer(PROBE_SENTENCES, return_tensors="pt", padding=True)
    shortlist = Shortlist.saved_in(folder, len(tokenizer))
    assert len(shortlist.columns(batch["input_ids"], batch["attention_mask"])) < len(tokenizer) / 2
    (tmp_path / "probe.txt").write_text("\n".join(PROBE_SENTENCES) + "\n", encoding="utf-8")
    for int8 in ([], ["--int8"]):
        main(["translate", str(folder), "--input", str(tmp_path / "probe.txt"), "--shortlist", *int8])
        assert capsys.readouterr().out.splitlines() == [sentence.upper() for sentence in PROBE_SENTENCES], int8


def test_a_shortlist_is_refused_where_the_package_loop_does_not_run() -> None:
    model = kernelize(random_model(0, TINY_MODEL))
    source = torch.tensor([[5, 6, 2]])
    shortlist = build_shortlist(CORPUS, model.config.vocab_size, special_ids=[2], per_source=1, frequent=1)
    with pytest.raises(
        UsageError, match="a shortlist needs the package's decoding loop, which does not cover do_sample"
    ):
        generate(model, source, shortlist=shortlist, do_sample=True)


def test_ctranslate2_with_the_exported_vocabulary_map_decodes_as_ours_with_the_shortlist(tmp_path, trained_folder):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from hf_vaswani.interop.export import export_ctranslate2

    model, tokenizer = load_model_folder(trained_folder)
    sources, targets = map(list, zip(*capitalised_pairs(400, seed=0), strict=True))
    # targets paired with the wrong sources: the lists miss the right tokens, so that the list visibly decides
    shortlist = shortlist_of_corpus(tokenizer, sources, targets[1:] + targets[:1], len(tokenizer), 2, 0)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shortlist.save(folder)
    exported = export_ctranslate2(folder, tmp_path / "ct2")
    assert (exported / "vmap.txt").is_file()
    translator = ctranslate2.Translator(str(exported), intra_threads=1)
    for sentence in PROBE_SENTENCES[:8]:  # one at a time: CTranslate2 lists per batch as we do
        source = tokenizer([sentence], return_tensors="pt")
        outputs = {}
        for use_vmap in (True, False):
            ours = generate(model, **source, num_beams=1, shortlist=shortlist if use_vmap else None, max_new_tokens=12)
            results = translator.translate_batch(
                [tokenizer.convert_ids_to_tokens(source["input_ids"][0])],
                beam_size=1,
                max_decoding_length=12,
                min_decoding_length=0,  # CTranslate2's default 1 bars an empty translation; generate has no minimum
                return_end_token=True,
                use_vmap=use_vmap,
            )
            outputs[use_vmap] = strip_padding(ours[0, 1:].tolist())
            assert tokenizer.convert_tokens_to_ids(results[0].hypotheses[0]) == outputs[use_vmap], (sentence, use_vmap)
        assert outputs[True] != outputs[False], "the list changed nothing: the test would prove nothing"
