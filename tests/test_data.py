"""Tests of hf_vaswani.data: the synthetic corpus and its grammar, local parallel files and Hub translation datasets."""

import gzip
import json
import re
import time
from pathlib import Path

import datasets
import pytest

from hf_vaswani.data import (
    FEATURES,
    Clause,
    Name,
    NounPhrase,
    PrepPhrase,
    Pronoun,
    Sentence,
    german_finite_forms,
    load_corpus,
    load_hub_translation,
    load_jsonl,
    load_parallel_files,
    load_tsv,
    make_synthetic_corpus,
    realize,
)

# ----------------------------------------------------------------------------------------------------------------------
# Synthetic corpus
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_corpus() -> tuple[datasets.DatasetDict, float]:
    start = time.perf_counter()
    corpus = make_synthetic_corpus()
    return corpus, time.perf_counter() - start


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
    # Generous against shared CPUs: the budget is 5 s, it takes about 1 s.
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


# ----------------------------------------------------------------------------------------------------------------------
# Local files
# ----------------------------------------------------------------------------------------------------------------------

SOURCES = ["The man sees the dog.", "Ich weiß, dass er kommt.", "Straße und Mädchen: schön!"]
TARGETS = ["Der Mann sieht den Hund.", "I know that he comes.", "Street and girl: beautiful!"]
TSV_LINES = [f"{source}\t{target}" for source, target in zip(SOURCES, TARGETS, strict=True)]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _lines(values: list[str], newline: str = "\n") -> bytes:
    return newline.join(values).encode() + newline.encode()


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_parallel_files_round_trip(tmp_path, suffix):
    source = _write(tmp_path / f"train.en{suffix}", _lines(SOURCES))
    # CRLF line ends and no final newline are both fine.
    target = _write(tmp_path / f"train.de{suffix}", "\r\n".join(TARGETS).encode())
    ds = load_parallel_files(source, target)
    assert ds.features == FEATURES
    assert ds["source"] == SOURCES and ds["target"] == TARGETS


def test_gzip_is_detected_by_magic_bytes(tmp_path):
    source = tmp_path / "train.src"
    source.write_bytes(gzip.compress(_lines(SOURCES)))
    target = _write(tmp_path / "train.tgt", _lines(TARGETS))
    assert load_parallel_files(source, target)["source"] == SOURCES


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_tsv_round_trip(tmp_path, suffix):
    path = _write(tmp_path / f"train.tsv{suffix}", _lines(TSV_LINES))
    ds = load_tsv(path)
    assert ds["source"] == SOURCES and ds["target"] == TARGETS


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_jsonl_round_trip(tmp_path, suffix):
    records = [{"en": s, "de": t, "id": i} for i, (s, t) in enumerate(zip(SOURCES, TARGETS, strict=True))]
    data = "\n".join(json.dumps(record, ensure_ascii=i % 2 == 0) for i, record in enumerate(records)).encode()
    path = _write(tmp_path / f"train.jsonl{suffix}", data)
    ds = load_jsonl(path, source_key="en", target_key="de")
    assert ds.column_names == ["source", "target"]
    assert ds["source"] == SOURCES and ds["target"] == TARGETS


PARALLEL = ("a.en", "a.de")
BAD_FILES = [
    ("empty source side", {"a.en": b"one\n  \nthree\n", "a.de": b"eins\nzwei\ndrei\n"}, PARALLEL, "a.en", 2),
    ("empty target side", {"a.en": b"one\ntwo\n", "a.de": b"eins\n\t\n"}, PARALLEL, "a.de", 2),
    ("undecodable", {"a.en": b"one\ntwo \xff\xfe\n", "a.de": b"eins\nzwei\n"}, PARALLEL, "a.en", 2),
    (
        "undecodable gzip",
        {"b.en.gz": b"one\ntwo\nth\xe9ree\n", "b.de.gz": b"eins\nzwei\ndrei\n"},
        ("b.en.gz", "b.de.gz"),
        "b.en.gz",
        3,
    ),
    ("tsv latin-1", {"c.tsv": b"one\teins\nStra\xdfe\tstreet\n"}, "c.tsv", "c.tsv", 2),
    ("tsv without tab", {"c.tsv": b"one\teins\ntwo zwei\n"}, "c.tsv", "c.tsv", 2),
    ("tsv with two tabs", {"c.tsv": b"one\teins\ntwo\tzwei\tdrei\n"}, "c.tsv", "c.tsv", 2),
    ("tsv empty target", {"c.tsv": b"one\teins\ntwo\teins\nthree\t  \n"}, "c.tsv", "c.tsv", 3),
    ("tsv blank line", {"c.tsv": b"one\teins\n\ntwo\tzwei\n"}, "c.tsv", "c.tsv", 2),
    ("jsonl invalid", {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": "a",\n'}, "d.jsonl", "d.jsonl", 2),
    (
        "jsonl missing key",
        {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": "c", "target": "d"}\n{"source": "e"}\n'},
        "d.jsonl",
        "d.jsonl",
        3,
    ),
    ("jsonl not an object", {"d.jsonl": b'["a", "b"]\n'}, "d.jsonl", "d.jsonl", 1),
    (
        "jsonl empty side",
        {"d.jsonl": b'{"source": "a", "target": "b"}\n{"source": " ", "target": "b"}\n'},
        "d.jsonl",
        "d.jsonl",
        2,
    ),
    ("jsonl non-string", {"d.jsonl": b'{"source": 3, "target": "b"}\n'}, "d.jsonl", "d.jsonl", 1),
    ("empty file", {"e.tsv": b""}, "e.tsv", "e.tsv", 1),
]


@pytest.mark.parametrize(
    ("files", "spec", "bad_file", "line"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_files_name_the_file_and_line(tmp_path, files, spec, bad_file, line):
    for name, data in files.items():
        _write(tmp_path / name, data)
    with pytest.raises(ValueError) as error:
        if isinstance(spec, tuple):
            load_parallel_files(tmp_path / spec[0], tmp_path / spec[1])
        elif spec.endswith(".tsv"):
            load_tsv(tmp_path / spec)
        else:
            load_jsonl(tmp_path / spec)
    message = str(error.value)
    assert bad_file in message
    assert re.search(rf"\bline {line}\b", message), message


@pytest.mark.parametrize(("source_lines", "target_lines"), [(3, 2), (2, 4)])
def test_mismatched_line_counts_name_both_files_and_counts(tmp_path, source_lines, target_lines):
    source = _write(tmp_path / "m.en", _lines([f"s{i}" for i in range(source_lines)]))
    target = _write(tmp_path / "m.de", _lines([f"t{i}" for i in range(target_lines)]))
    with pytest.raises(ValueError) as error:
        load_parallel_files(source, target)
    message = str(error.value)
    assert "m.en" in message and "m.de" in message
    assert f"{source_lines} lines" in message and f"has {target_lines}" in message
    assert f"line {min(source_lines, target_lines) + 1}" in message


def test_load_corpus_files_mixes_formats(tmp_path):
    source = _write(tmp_path / "train.en", _lines(SOURCES))
    target = _write(tmp_path / "train.de", _lines(TARGETS))
    tsv = _write(tmp_path / "valid.tsv.gz", _lines(TSV_LINES[:2]))
    jsonl = _write(tmp_path / "test.jsonl", _lines([json.dumps({"source": SOURCES[2], "target": TARGETS[2]})]))
    corpus = load_corpus("files", train=(source, target), validation=str(tsv), test=jsonl)
    assert list(corpus) == ["train", "validation", "test"]
    assert corpus["train"]["target"] == TARGETS
    assert corpus["validation"]["source"] == SOURCES[:2]
    assert corpus["test"]["target"] == TARGETS[2:]
    only_train = load_corpus("files", train=[str(source), str(target)])
    assert list(only_train) == ["train"]


def test_load_corpus_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="unknown corpus source"):
        load_corpus("ftp")
    with pytest.raises(ValueError, match="train"):
        load_corpus("files", validation=("a", "b"))
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_corpus("files", train=str(_write(tmp_path / "train.csv", b"a,b\n")))
    with pytest.raises(ValueError, match="unknown option"):
        load_corpus("synthetic", num_tran=5)
    with pytest.raises(ValueError, match="conflicting"):
        load_corpus("synthetic", num_train=5, sizes={"train": 6})


def test_load_corpus_synthetic_sizes():
    corpus = load_corpus("synthetic", seed=2, sizes={"train": 30, "validation": 5, "test": 7})
    assert {split: len(ds) for split, ds in corpus.items()} == {"train": 30, "validation": 5, "test": 7}
    assert corpus["train"].to_dict() == make_synthetic_corpus(2, 30, 5, 7)["train"].to_dict()


# ----------------------------------------------------------------------------------------------------------------------
# Hub translation datasets, exercised on local copies
# ----------------------------------------------------------------------------------------------------------------------

HUB_ROWS = {
    "train": [("Guten Morgen.", "Good morning."), ("Danke.", "Thank you."), ("Ja.", "Yes.")],
    "validation": [("Nein.", "No.")],
    "test": [("Hallo Welt.", "Hello world."), ("Tschüss.", "Bye.")],
}


def _translation_dict(features: datasets.Features) -> datasets.DatasetDict:
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict(
                {"translation": [{"de": de, "en": en} for de, en in rows], "id": [str(i) for i in range(len(rows))]},
                features=features,
            )
            for split, rows in HUB_ROWS.items()
        }
    )


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub")
    # Parquet shards named like the Hub's (data/{split}-00000-of-00001.parquet), with the datasets.Translation feature
    # that wmt14 declares; and a save_to_disk copy whose translation column is a plain struct.
    parquet = root / "wmt_like"
    translation = datasets.Translation(languages=["de", "en"])
    for split, ds in _translation_dict(
        datasets.Features({"translation": translation, "id": datasets.Value("string")})
    ).items():
        ds.to_parquet(str(parquet / "data" / f"{split}-00000-of-00001.parquet"))
    saved = root / "saved"
    struct = {"de": datasets.Value("string"), "en": datasets.Value("string")}
    _translation_dict(datasets.Features({"translation": struct, "id": datasets.Value("string")})).save_to_disk(
        str(saved)
    )
    no_translation = root / "no_translation"
    datasets.Dataset.from_dict({"de": ["a"], "en": ["b"]}).to_parquet(str(no_translation / "data" / "train-0.parquet"))
    return {"parquet": parquet, "saved": saved, "no_translation": no_translation, "cache": root / "cache"}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_hub_loader_maps_translation_to_source_and_target(hub_dirs, offline, kind):
    corpus = load_hub_translation(str(hub_dirs[kind]), None, "en", "de", cache_dir=str(hub_dirs["cache"]))
    assert sorted(corpus) == ["test", "train", "validation"]
    for split, rows in HUB_ROWS.items():
        assert corpus[split].features == FEATURES
        assert corpus[split]["source"] == [en for _, en in rows]
        assert corpus[split]["target"] == [de for de, _ in rows]


def test_hub_loader_direction_and_split_map(hub_dirs, offline):
    corpus = load_corpus(
        "hub",
        name=str(hub_dirs["parquet"]),
        source_lang="de",
        target_lang="en",
        split_map={"train": "train", "validation": "test"},
        cache_dir=str(hub_dirs["cache"]),
    )
    assert list(corpus) == ["train", "validation"]
    assert corpus["validation"]["source"] == [de for de, _ in HUB_ROWS["test"]]
    assert corpus["validation"]["target"] == [en for _, en in HUB_ROWS["test"]]


def test_hub_loader_errors_name_what_is_available(hub_dirs, offline):
    cache = str(hub_dirs["cache"])
    with pytest.raises(ValueError, match=r"'fr'.*\['de', 'en'\]"):
        load_hub_translation(str(hub_dirs["parquet"]), None, "fr", "en", cache_dir=cache)
    with pytest.raises(ValueError, match=r"no split 'dev'.*train"):
        load_hub_translation(
            str(hub_dirs["parquet"]), None, "en", "de", split_map={"validation": "dev"}, cache_dir=cache
        )
    with pytest.raises(ValueError, match=r"no 'translation' column.*\['de', 'en'\]"):
        load_hub_translation(str(hub_dirs["no_translation"]), None, "en", "de", cache_dir=cache)
