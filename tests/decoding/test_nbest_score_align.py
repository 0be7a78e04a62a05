"""n-best lists, forced-decoding scores and word alignments, each against an independent reference:
exhaustive enumeration, a plain forward pass's log-softmax, and the alignment rule applied by hand to the attention
weights of a forward pass."""

import random
from itertools import product

import pytest
import torch
from helpers import refused
from tiny import SMALLEST_MODEL, TINY_MODEL, random_model
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from hf_vaswani import VaswaniForConditionalGeneration, save_model_folder
from hf_vaswani.cli import main
from hf_vaswani.data.tokenization import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, UNK_TOKEN, train_shared_bpe
from hf_vaswani.decoding.alignment import align_pairs
from hf_vaswani.decoding.scoring import score_pairs
from hf_vaswani.decoding.translation import translate, translate_nbest
from hf_vaswani.model.generation_vaswani import paper_generation_config

ALPHA = 0.6  # the paper's GNMT alpha, the models' default length penalty


def gnmt_penalty(length: int) -> float:
    """lp(Y) = ((5 + |Y|) / 6)^alpha, written out here rather than taken from the package."""
    return ((5 + length) / 6) ** ALPHA


def word_level_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word, the special tokens first (ids 0-3), </s> after every text."""
    vocabulary = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *words])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, vocabulary[EOS_TOKEN])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )


@pytest.fixture
def eight_token_model() -> tuple[VaswaniForConditionalGeneration, PreTrainedTokenizerFast]:
    """A random model over a vocabulary of 8 (4 special tokens, 4 words): small enough to enumerate every output."""
    tokenizer = word_level_tokenizer(["a", "b", "c", "d"])
    model = random_model(0, SMALLEST_MODEL, vocab_size=len(tokenizer), encoder_layers=2, decoder_layers=2)
    model.generation_config = paper_generation_config(model.config)  # §6.1 decoding: beam 4, GNMT alpha 0.6
    return model, tokenizer


def exhaustive_ranking(model, tokenizer, sentence: str, max_tokens: int) -> list[tuple[float, tuple[int, ...], float]]:
    """(score, output tokens, log-probability) of every output `generate(max_new_tokens=max_tokens)` can finish with,
    best first: every sequence ending with </s> of at most max_tokens tokens, and every sequence of max_tokens tokens
    without </s> (the length cap ends it). Each is scored by one teacher-forced forward pass's log-softmax, divided by
    the GNMT penalty of its length; |Y| counts every output token, </s> included (as `_update_finished_beams` does:
    cur_len + 1 - decoder_prompt_len)."""
    eos = model.config.eos_token_id
    others = [token for token in range(model.config.vocab_size) if token != eos]
    candidates = [(*prefix, eos) for length in range(max_tokens) for prefix in product(others, repeat=length)]
    candidates += list(product(others, repeat=max_tokens))
    source = tokenizer(sentence, return_tensors="pt")["input_ids"]
    ranking = []
    for length in range(1, max_tokens + 1):
        outputs = torch.tensor([candidate for candidate in candidates if len(candidate) == length])
        start = torch.full((len(outputs), 1), model.config.decoder_start_token_id)
        with torch.no_grad():
            logits = model(
                input_ids=source.expand(len(outputs), -1), decoder_input_ids=torch.cat([start, outputs[:, :-1]], 1)
            ).logits
        log_probabilities = logits.log_softmax(-1).gather(-1, outputs.unsqueeze(-1)).squeeze(-1).sum(-1)
        for output, log_probability in zip(outputs.tolist(), log_probabilities.tolist(), strict=True):
            ranking.append((log_probability / gnmt_penalty(length), tuple(output), log_probability))
    return sorted(ranking, reverse=True)


def test_nbest_equals_exhaustive_top_k(eight_token_model) -> None:
    model, tokenizer = eight_token_model
    vocabulary, max_tokens, k = model.config.vocab_size, 4, 6
    # Beam search is exhaustive when the beam holds every continuation. After t < max_tokens tokens the live prefixes
    # are the (V - 1)^t sequences without </s>, with V (V - 1)^t continuations, at most V (V - 1)^(max_tokens - 1).
    # transformers keeps the top 2 num_beams continuations, goes on with the best num_beams unfinished ones and offers
    # the finished ones among the best num_beams to the finished set: with num_beams = V (V - 1)^(max_tokens - 1) every
    # prefix is continued and every finished output offered. The finished set keeps the best num_beams (2744) of the
    # 2801 outputs, so the top k are all there. Its placeholder beams (score -1e9) finish too; early_stopping "never"
    # keeps a set full of them from ending the search before the length cap.
    num_beams = vocabulary * (vocabulary - 1) ** (max_tokens - 1)
    sentences = ["a b c", "d a", "b"]
    nbest = translate_nbest(
        model,
        tokenizer,
        sentences,
        k,
        num_beams=num_beams,
        max_new_tokens=max_tokens,
        max_new_tokens_over_source=None,  # only the absolute cap: the §6.1 source cap forces </s> at no cost
        early_stopping="never",
    )
    for sentence, hypotheses in zip(sentences, nbest, strict=True):
        ranking = exhaustive_ranking(model, tokenizer, sentence, max_tokens)
        # The k-th and (k+1)-th scores are far apart compared with fp32 differences between the cached incremental
        # decoding of beam search and one full forward pass (~1e-6): the top k is the same set under either.
        assert ranking[k - 1][0] - ranking[k][0] > 1e-4
        assert [hypothesis.token_ids for hypothesis in hypotheses] == [output for _, output, _ in ranking[:k]]
        for hypothesis, (score, _, log_probability) in zip(hypotheses, ranking, strict=False):
            assert hypothesis.score == pytest.approx(score, abs=1e-5)
            assert hypothesis.log_probability == pytest.approx(log_probability, abs=1e-5)
            assert hypothesis.text == tokenizer.decode(hypothesis.token_ids, skip_special_tokens=True)


def test_nbest_with_the_models_decoding(eight_token_model) -> None:
    """Defaults (beam 4, the §6.1 source cap): k hypotheses, best first, each score its log-probability / lp(|Y|)."""
    model, tokenizer = eight_token_model
    (hypotheses, blank) = translate_nbest(model, tokenizer, ["a b c d", "  "], 3)
    assert len(hypotheses) == 3 and blank == []
    assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)
    for hypothesis in hypotheses:
        assert hypothesis.score == pytest.approx(hypothesis.log_probability / gnmt_penalty(len(hypothesis.token_ids)))
    with pytest.raises(ValueError, match="num_beams >= 5"):
        translate_nbest(model, tokenizer, ["a"], 5, num_beams=4)


PAIRS = [("a b c", "d"), ("a", "b c d a b"), ("d d", ""), ("c a b d a", "a a"), ("b", "c d")]


def forward_log_probabilities(model, tokenizer, source: str, target: str) -> list[float]:
    """log P(y_t | y_<t, source) for each target token, </s> included, from one plain forward pass."""
    source_ids = tokenizer(source, return_tensors="pt")["input_ids"]
    target_ids = tokenizer(text_target=target, return_tensors="pt")["input_ids"]
    decoder_input_ids = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), target_ids[:, :-1]], 1)
    with torch.no_grad():
        logits = model(input_ids=source_ids, decoder_input_ids=decoder_input_ids).logits
    return logits.log_softmax(-1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)[0].tolist()


def test_scores_equal_a_forward_pass_and_batching_changes_nothing(eight_token_model) -> None:
    model, tokenizer = eight_token_model
    sources, targets = [source for source, _ in PAIRS], [target for _, target in PAIRS]
    one_by_one = score_pairs(model, tokenizer, sources, targets, batch_size=1)
    for pair, (source, target) in zip(one_by_one, PAIRS, strict=True):
        expected = forward_log_probabilities(model, tokenizer, source, target)
        # the same shapes and operations as the reference: only summation order may differ
        assert pair.token_log_probs == pytest.approx(expected, abs=1e-6)
        assert pair.log_probability == pytest.approx(sum(expected), abs=1e-5)
        assert pair.score == pair.log_probability  # normalize="none"
    # Batched, each pair is padded to the longest of its batch. Masked keys get exactly zero weight (exp(-inf) = 0)
    # and the decoder is causal, so padding changes only which kernels and blockings compute the same sums: fp32
    # relative differences of ~1e-6 on each log-probability (|values| < 10 here), summed over at most 6 tokens.
    batched = score_pairs(model, tokenizer, sources, targets, batch_size=4)
    for alone, together in zip(one_by_one, batched, strict=True):
        assert together.token_log_probs == pytest.approx(alone.token_log_probs, abs=1e-4)
        assert together.log_probability == pytest.approx(alone.log_probability, abs=1e-4)
    for pair, mean, penalised in zip(
        one_by_one,
        score_pairs(model, tokenizer, sources, targets, normalize="mean"),
        score_pairs(model, tokenizer, sources, targets, normalize="length_penalty"),
        strict=True,
    ):
        length = len(pair.token_log_probs)
        assert mean.score == pytest.approx(pair.log_probability / length, abs=1e-4)
        assert penalised.score == pytest.approx(pair.log_probability / gnmt_penalty(length), abs=1e-4)


def test_a_target_beyond_the_learned_positions_is_refused(eight_token_model) -> None:
    _, tokenizer = eight_token_model
    model = random_model(
        0, SMALLEST_MODEL, vocab_size=len(tokenizer), positional_encoding="learned", max_position_embeddings=4
    )
    assert len(score_pairs(model, tokenizer, ["a b c"], ["a b c"])) == 1  # 4 tokens with </s>: fits exactly
    with pytest.raises(ValueError, match=r"pair 2: the target needs 5 positions .* max_position_embeddings=4"):
        score_pairs(model, tokenizer, ["a", "a"], ["b", "a b c d"])
    assert score_pairs(model, tokenizer, [], []) == [] and align_pairs(model, tokenizer, [], []) == []
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        score_pairs(model, tokenizer, ["a", "b"], ["a"])


@pytest.fixture
def subword_model() -> tuple[VaswaniForConditionalGeneration, PreTrainedTokenizerFast]:
    """A random model with a byte-level BPE so small that most words are several tokens."""
    corpus = ["red cats sunny day", "blueberry dogs", "the moon", "RED CATS SUNNY", "BLUEBERRY DOG", "MOON"] * 5
    tokenizer = train_shared_bpe(corpus, vocab_size=285, min_frequency=1)
    model = random_model(0, TINY_MODEL, vocab_size=len(tokenizer))
    model.generation_config = paper_generation_config(model.config)  # §6.1 decoding: beam 4, GNMT alpha 0.6
    return model, tokenizer


def alignment_by_hand(model, tokenizer, source: str, target: str) -> list[tuple[int, int]]:
    """The documented rule, with words found from the tokens themselves (a byte-level BPE token starting with "Ġ", a
    space, starts a word) rather than from character offsets as the package does."""

    def words(ids: list[int]) -> list[int | None]:
        found, current = [], -1
        for token in tokenizer.convert_ids_to_tokens(ids):
            if token in tokenizer.all_special_tokens:
                found.append(None)
                continue
            current += current < 0 or token.startswith("Ġ")
            found.append(current)
        return found

    source_ids = tokenizer(source)["input_ids"]
    target_ids = tokenizer(text_target=target)["input_ids"]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        output = model(
            input_ids=torch.tensor([source_ids]),
            decoder_input_ids=torch.tensor([[model.config.decoder_start_token_id, *target_ids[:-1]]]),
            output_attentions=True,
        )
    model.set_attn_implementation("sdpa")
    attention = output.cross_attentions[-1][0].mean(0)  # last layer, mean over heads: (target, source) tokens
    source_words, target_words = words(source_ids), words(target_ids)
    alignment = []
    for target_word in range(max(w for w in target_words if w is not None) + 1):
        rows = [t for t, w in enumerate(target_words) if w == target_word]
        row = attention[rows].mean(0)
        shares = [
            row[[s for s, w in enumerate(source_words) if w == source_word]].sum().item()
            for source_word in range(max(w for w in source_words if w is not None) + 1)
        ]
        best = max(range(len(shares)), key=shares.__getitem__)
        assert sorted(shares)[-1] - sorted(shares)[-2] > 1e-4 if len(shares) > 1 else True  # no near tie to flip
        alignment.append((best, target_word))
    return alignment


def test_alignments_follow_the_rule_on_the_attention(subword_model) -> None:
    model, tokenizer = subword_model
    generator = random.Random(0)
    source_words = "red cats sunny day blueberry dogs the moon".split()
    target_words = "RED CATS SUNNY BLUEBERRY".split()
    sources = [" ".join(generator.choices(source_words, k=generator.randint(1, 5))) for _ in range(24)]
    targets = [" ".join(generator.choices(target_words, k=generator.randint(1, 5))) for _ in range(24)]
    assert any(len(tokenizer.tokenize(word)) > 1 for word in " ".join(sources + targets).split())  # subwords merge
    alignments = align_pairs(model, tokenizer, sources, targets, batch_size=2)
    assert alignments == [alignment_by_hand(model, tokenizer, s, t) for s, t in zip(sources, targets, strict=True)]
    assert model.config._attn_implementation == "sdpa"  # eager only while aligning
    # the model's own translations, teacher-forced (what `vaswani translate --alignments` prints)
    translations = translate(model, tokenizer, sources[:4], progress=False, max_new_tokens=6)
    produced = align_pairs(model, tokenizer, sources[:4], translations)
    for translation, alignment in zip(translations, produced, strict=True):
        assert [target for _, target in alignment] == list(range(len(translation.split())))
    assert align_pairs(model, tokenizer, ["red"], [""]) == [[]]


@pytest.fixture
def model_folder(subword_model, tmp_path):
    model, tokenizer = subword_model
    save_model_folder(model, tokenizer, tmp_path / "model")
    return tmp_path / "model"


def test_translate_nbest_and_alignments_command(model_folder, tmp_path, capsys) -> None:
    source = tmp_path / "source.txt"
    source.write_text("red cats\nthe moon\n")
    main(
        [
            "translate",
            str(model_folder),
            "--input",
            str(source),
            "--nbest",
            "3",
            "--max-new-tokens",
            "5",
            "--alignments",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ||| ")[0] for line in lines] == ["0"] * 3 + ["1"] * 3
    for line in lines:
        _, hypothesis, features, score, alignment = line.split(" ||| ")
        log_probability, tokens = features.removeprefix("LogProb= ").split(" Tokens= ")
        assert float(score) == pytest.approx(float(log_probability) / gnmt_penalty(int(tokens)), abs=2e-6)
        assert [int(pair.split("-")[1]) for pair in alignment.split()] == list(range(len(hypothesis.split())))


def test_score_command(model_folder, tmp_path, capsys) -> None:
    source, target = tmp_path / "source.txt", tmp_path / "target.txt"
    source.write_text("red cats\nthe moon\n")
    target.write_text("RED CATS\nMOON\n")
    main(["score", str(model_folder), "--source", str(source), "--target", str(target), "--normalize", "mean"])
    lines = capsys.readouterr().out.splitlines()
    model = VaswaniForConditionalGeneration.from_pretrained(model_folder).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_folder)
    for line, pair in zip(lines, [("red cats", "RED CATS"), ("the moon", "MOON")], strict=True):
        score, log_probability, token_log_probs = line.split("\t")
        expected = forward_log_probabilities(model, tokenizer, *pair)
        assert [float(value) for value in token_log_probs.split()] == pytest.approx(expected, abs=1e-5)
        assert float(log_probability) == pytest.approx(sum(expected), abs=1e-5)
        assert float(score) == pytest.approx(sum(expected) / len(expected), abs=1e-5)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["translate", "{model}", "--nbest", "0"], "the n-best list size must be at least 1, got 0"),
        (["translate", "{model}", "--nbest", "5", "--num-beams", "3"], "needs beam search with num_beams >= 5"),
        (["translate", "{model}", "--alignments", "--alignment-layer", "2"], "layer 2 does not exist"),
        (["score", "{model}", "--source", "{source}", "--target", "{longer}"], "has 1 lines but --target"),
        (["score", "{model}", "--source", "{source}", "--target", "{source}", "--batch-size", "0"], "--batch-size"),
    ],
)
def test_command_errors_are_one_line(model_folder, tmp_path, capsys, arguments, message) -> None:
    (tmp_path / "source.txt").write_text("red cats\n")
    (tmp_path / "longer.txt").write_text("RED\nCATS\n")
    paths = {"model": model_folder, "source": tmp_path / "source.txt", "longer": tmp_path / "longer.txt"}
    refused(capsys, [argument.format(**paths) for argument in arguments], message)
