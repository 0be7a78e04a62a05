"""Tests of hf_vaswani.data.demo_corpus: the embedded corpus, its grammar and the sentence pairs it generates."""

import re
import time

import datasets
import pytest

from hf_vaswani.data.corpus import FEATURES
from hf_vaswani.data.demo_corpus import (
    Clause,
    Name,
    NounPhrase,
    PrepPhrase,
    Pronoun,
    Sentence,
    german_finite_forms,
    make_synthetic_corpus,
    realize,
)

# ----------------------------------------------------------------------------------------------------------------------
# Synthetic corpus
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_corpus() -> tuple[datasets.DatasetDict, float]:
    # CPU time of this process, not wall-clock time: other processes busy on the same cores do not count against it.
    start = time.process_time()
    corpus = make_synthetic_corpus()
    return corpus, time.process_time() - start


@pytest.fixture(scope="module")
def pairs(default_corpus: tuple[datasets.DatasetDict, float]) -> list[tuple[str, str]]:
    corpus, _ = default_corpus
    return [pair for split in corpus.values() for pair in zip(split["source"], split["target"], strict=True)]


FINITE = german_finite_forms()


def _lower_first(word: str) -> str:
    return word[:1].lower() + word[1:]


def test_default_corpus_has_three_string_splits_of_the_requested_sizes(default_corpus):
    corpus, seconds = default_corpus
    assert isinstance(corpus, datasets.DatasetDict)
    assert {split: len(ds) for split, ds in corpus.items()} == {"train": 20000, "validation": 500, "test": 500}
    for ds in corpus.values():
        assert ds.features == FEATURES
    # The budget is 5 s of CPU time; 15 leaves room for slower CPUs.
    assert seconds < 15


def test_same_seed_same_corpus_other_seed_other_corpus():
    first = make_synthetic_corpus(seed=3, num_train=300, num_validation=40, num_test=40)
    again = make_synthetic_corpus(seed=3, num_train=300, num_validation=40, num_test=40)
    other = make_synthetic_corpus(seed=4, num_train=300, num_validation=40, num_test=40)
    for split in ("train", "validation", "test"):
        assert first[split].to_dict() == again[split].to_dict()
        assert first[split]["source"] != other[split]["source"]
    assert len(set(first["train"]["source"]) & set(other["train"]["source"])) < 100


def test_splits_are_disjoint_and_free_of_duplicates(default_corpus):
    corpus, _ = default_corpus
    for column in ("source", "target"):
        seen: set[str] = set()
        for split in corpus.values():
            values = split[column]
            assert len(set(values)) == len(values)
            assert seen.isdisjoint(values)
            seen.update(values)


def test_empty_splits_and_bad_sizes():
    corpus = make_synthetic_corpus(num_train=10, num_validation=0, num_test=0)
    assert len(corpus["validation"]) == 0 and corpus["validation"].features == FEATURES
    with pytest.raises(ValueError, match="num_test"):
        make_synthetic_corpus(num_train=10, num_test=-1)


def test_target_is_a_function_of_the_source_across_seeds(pairs):
    other = make_synthetic_corpus(seed=1, num_train=5000, num_validation=0, num_test=0)["train"]
    mapping = dict(pairs)
    shared = 0
    for source, target in zip(other["source"], other["target"], strict=True):
        if source in mapping:
            shared += 1
            assert mapping[source] == target
    assert shared > 0


def test_surface_form(pairs):
    for source, target in pairs:
        assert 4 <= len(source.split()) <= 20, source
        assert source.isascii(), source
        assert source[0].isupper() and target[0].isupper(), (source, target)
        assert source[-1] in ".?" and target[-1] == source[-1], (source, target)
        assert "  " not in source and "  " not in target
    assert any(ch in target for _, target in pairs for ch in "äöüß")


# Hand-written translations, independent of the generator's tables.
HAND_WRITTEN = [
    (
        Clause(NounPhrase("man"), "see", objects=(NounPhrase("dog"),), adverb="today", adverb_first=True),
        "Today the man sees the dog.",
        "Heute sieht der Mann den Hund.",
    ),
    (
        Sentence(
            Clause(NounPhrase("man"), "laugh"),
            conjunction="because",
            subordinate=Clause(NounPhrase("woman"), "buy", objects=(NounPhrase("book", "a"),)),
        ),
        "The man laughs because the woman buys a book.",
        "Der Mann lacht, weil die Frau ein Buch kauft.",
    ),
    (
        Clause(
            NounPhrase("child", "a", adjective="small"),
            "give",
            objects=(NounPhrase("woman", adjective="old"), NounPhrase("apple", "a", adjective="red")),
        ),
        "A small child gives the old woman a red apple.",
        "Ein kleines Kind gibt der alten Frau einen roten Apfel.",
    ),
    (
        Clause(NounPhrase("girl"), "play", adjuncts=(PrepPhrase("with", NounPhrase("dog", plural=True)),)),
        "The girl plays with the dogs.",
        "Das Mädchen spielt mit den Hunden.",
    ),
    (
        Clause(Pronoun("we"), "go", "past", destination=NounPhrase("doctor"), adverb="yesterday", adverb_first=True),
        "Yesterday we went to the doctor.",
        "Gestern sind wir zum Arzt gegangen.",
    ),
    (
        Sentence(Clause(NounPhrase("teacher"), "help", objects=(NounPhrase("child", plural=True),)), "question"),
        "Does the teacher help the children?",
        "Hilft der Lehrer den Kindern?",
    ),
    (
        Clause(Pronoun("I"), "buy", "want", objects=(NounPhrase("car", "a", adjective="expensive"),)),
        "I want to buy an expensive car.",
        "Ich will ein teures Auto kaufen.",
    ),
    (
        Sentence(
            Clause(NounPhrase("man"), "buy", objects=(NounPhrase("cake", "this", adjective="big"),)),
            conjunction="if",
            subordinate=Clause(NounPhrase("cat"), "be", predicate="hungry"),
            subordinate_first=True,
        ),
        "If the cat is hungry, the man buys this big cake.",
        "Wenn die Katze hungrig ist, kauft der Mann diesen großen Kuchen.",
    ),
    (
        Sentence(
            Clause(Name("Anna"), "know"),
            conjunction="that",
            subordinate=Clause(Pronoun("you"), "go", destination=NounPhrase("school"), adverb="tomorrow"),
        ),
        "Anna knows that you go to the school tomorrow.",
        "Anna weiß, dass du morgen zur Schule gehst.",
    ),
    (
        Sentence(
            Clause(NounPhrase("mother", "my"), "wait", "can", adjuncts=(PrepPhrase("in", NounPhrase("garden")),)),
            "question",
        ),
        "Can my mother wait in the garden?",
        "Kann meine Mutter im Garten warten?",
    ),
    (
        Sentence(
            Clause(NounPhrase("brother", "his", plural=True), "follow", "past", objects=(NounPhrase("cat", "our"),)),
            conjunction="although",
            subordinate=Clause(NounPhrase("mouse", plural=True), "be", "past", predicate="hungry"),
        ),
        "His brothers followed our cat although the mice were hungry.",
        "Seine Brüder sind unserer Katze gefolgt, obwohl die Mäuse hungrig waren.",
    ),
    (
        Clause(Name("Paul"), "dance", adjuncts=(PrepPhrase("with", NounPhrase("friend", "", True, "old")),)),
        "Paul dances with old friends.",
        "Paul tanzt mit alten Freunden.",
    ),
    (
        Clause(Pronoun("she"), "need", objects=(NounPhrase("key", "no"),)),
        "She needs no key.",
        "Sie braucht keinen Schlüssel.",
    ),
    (
        Clause(NounPhrase("horse", "our", adjective="black"), "eat", objects=(NounPhrase("apple", plural=True),)),
        "Our black horse eats the apples.",
        "Unser schwarzes Pferd isst die Äpfel.",
    ),
    (
        Clause(Pronoun("they"), "sing", "past", adjuncts=(PrepPhrase("in", NounPhrase("kitchen", adjective="dark")),)),
        "They sang in the dark kitchen.",
        "Sie haben in der dunklen Küche gesungen.",
    ),
    (
        Sentence(Clause(Pronoun("you"), "be", "past", predicate="tired"), "question"),
        "Were you tired?",
        "Warst du müde?",
    ),
    (
        Clause(NounPhrase("baby", "the", True), "sleep", "past", adverb="often"),
        "The babies slept often.",
        "Die Babys haben oft geschlafen.",
    ),
]


@pytest.mark.parametrize(("structure", "english", "german"), HAND_WRITTEN, ids=[e for _, e, _ in HAND_WRITTEN])
def test_realize_matches_hand_written_translations(structure, english, german):
    assert realize(structure) == (english, german)


@pytest.mark.parametrize(
    "structure",
    [
        Clause(Pronoun("I"), "read", "past", objects=(NounPhrase("book"),)),  # "I read" would be ambiguous
        Clause(NounPhrase("dog", "a", plural=True), "sleep"),
        Clause(NounPhrase("man"), "see"),  # missing object
        Clause(NounPhrase("man"), "sleep", adverb_first=True),
        Sentence(Clause(NounPhrase("man"), "say")),  # "say" needs a that-clause
        Sentence(Clause(NounPhrase("man"), "sleep"), "question", "because", Clause(NounPhrase("dog"), "sleep")),
    ],
)
def test_realize_rejects_malformed_structures(structure):
    with pytest.raises(ValueError):
        realize(structure)


GERMAN_ADVERBS = {
    "Today": "Heute",
    "Tomorrow": "Morgen",
    "Now": "Jetzt",
    "Often": "Oft",
    "Sometimes": "Manchmal",
    "Yesterday": "Gestern",
}
SUBJECT_PRONOUNS = {"I": "ich", "you": "du", "he": "er", "she": "sie", "we": "wir", "they": "sie"}


def test_fronted_adverb_puts_the_finite_verb_second(pairs):
    hits = [(s, t) for s, t in pairs if s.split()[0] in GERMAN_ADVERBS]
    assert len(hits) > 200
    for source, target in hits:
        english, german = source.split(), target.split()
        assert german[0] == GERMAN_ADVERBS[english[0]], (source, target)
        assert german[1].rstrip(",.?") in FINITE, (source, target)
        if english[1] in SUBJECT_PRONOUNS:
            # Inversion: the subject follows the verb.
            assert german[2].rstrip(",.") == SUBJECT_PRONOUNS[english[1]], (source, target)


def test_questions_put_the_finite_verb_first(pairs):
    hits = [(s, t) for s, t in pairs if s.endswith("?")]
    assert len(hits) > 500
    for source, target in hits:
        assert _lower_first(target.split()[0]) in FINITE, (source, target)


def test_subordinate_clauses_end_with_the_finite_verb(pairs):
    conjunctions = {"because": "weil", "although": "obwohl", "if": "wenn", "that": "dass"}
    clause = re.compile(r"\b(?:weil|obwohl|wenn|dass|Weil|Obwohl|Wenn) ([^,.?]+)")
    checked = 0
    for source, target in pairs:
        english = source.lower().split()
        for conjunction, german in conjunctions.items():
            assert english.count(conjunction) == target.lower().split().count(german), (source, target)
        for match in clause.finditer(target):
            assert match.group(1).split()[-1] in FINITE, (source, target)
            checked += 1
    assert checked > 2000


def test_main_clause_after_fronted_subordinate_clause_is_verb_first(pairs):
    hits = [(s, t) for s, t in pairs if s.split()[0] in ("Because", "Although", "If")]
    assert len(hits) > 500
    for source, target in hits:
        main_clause = target.split(", ", 1)[1]
        assert main_clause.split()[0] in FINITE, (source, target)


def test_masculine_accusative_objects_take_den_and_einen(pairs):
    masculine = {"dog": "Hund", "apple": "Apfel", "ball": "Ball", "key": "Schlüssel", "letter": "Brief", "hat": "Hut"}
    verbs = "sees|saw|see|buys|bought|buy|finds|found|find|takes|took|take|carries|carried|carry|needs|needed|need"
    pattern = re.compile(rf"\b(?:{verbs}) (the|a|an) (\w+ )?({'|'.join(masculine)})\b")
    hits = 0
    for source, target in pairs:
        for match in pattern.finditer(source):
            article = "den" if match.group(1) == "the" else "einen"
            adjective = r"\w+en " if match.group(2) else ""
            assert re.search(rf"\b{article} {adjective}{masculine[match.group(3)]}\b", target), (source, target)
            hits += 1
    assert hits > 20


def test_with_governs_the_dative(pairs):
    expected = {
        "dog": ("dem", "Hund"),
        "man": ("dem", "Mann"),
        "child": ("dem", "Kind"),
        "woman": ("der", "Frau"),
        "cat": ("der", "Katze"),
        "dogs": ("den", "Hunden"),
        "men": ("den", "Männern"),
        "children": ("den", "Kindern"),
        "women": ("den", "Frauen"),
    }
    pattern = re.compile(rf"\bwith the (\w+ )?({'|'.join(expected)})\b")
    hits = 0
    for source, target in pairs:
        for match in pattern.finditer(source):
            article, noun = expected[match.group(2)]
            adjective = r"\w+en " if match.group(1) else ""
            assert re.search(rf"\bmit {article} {adjective}{noun}\b", target), (source, target)
            hits += 1
    assert hits > 20


def test_subject_verb_agreement(pairs):
    def ich(verb: str) -> bool:
        return verb.endswith("e") or verb in {"bin", "kann", "will", "mag", "weiß", "war"}

    def du(verb: str) -> bool:
        return verb.endswith(("st", "zt", "ßt"))

    def plural(verb: str) -> bool:
        return verb.endswith("n") or verb == "sind"

    rules = {"I": ("Ich", ich), "You": ("Du", du), "We": ("Wir", plural), "They": ("Sie", plural)}
    counts = dict.fromkeys(rules, 0)
    for source, target in pairs:
        first = source.split()[0]
        if first in rules and source.endswith("."):
            pronoun, agrees = rules[first]
            german = target.split()
            assert german[0] == pronoun and agrees(german[1].rstrip(",.")), (source, target)
            counts[first] += 1
    assert min(counts.values()) > 100


def test_requested_split_sizes_and_positional_argument_order():
    corpus = make_synthetic_corpus(seed=2, num_train=30, num_validation=5, num_test=7)
    assert {split: len(ds) for split, ds in corpus.items()} == {"train": 30, "validation": 5, "test": 7}
    assert corpus["train"].to_dict() == make_synthetic_corpus(2, 30, 5, 7)["train"].to_dict()
