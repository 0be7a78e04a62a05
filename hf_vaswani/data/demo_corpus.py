"""The embedded English -> German corpus, generated rather than loaded: what `vaswani demo` (the main job) trains on.

A small lexicon (nouns, adjectives, verbs with their German inflection) and a grammar of clauses and sentences are
realised in both languages at once, so the corpus needs no download and its target is a deterministic function of its
source. The grammar (case, gender and number agreement, subject-verb agreement, verb-second, verb-first and verb-final
word order) gives a small model something real to learn. `make_synthetic_corpus` samples distinct sentence pairs into
``train``, ``validation`` and ``test`` splits with the loaders' two string columns, ``source`` and ``target``;
`realize` renders one hand-built `Sentence` or `Clause`. `vaswani train --data synthetic` trains on it too.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from datasets import Dataset, DatasetDict

from .corpus import FEATURES

__all__ = [
    "ADJECTIVES",
    "ADVERBS",
    "DETERMINERS",
    "NAMES",
    "NOUNS",
    "VERBS",
    "Adjective",
    "Clause",
    "Name",
    "Noun",
    "NounPhrase",
    "PrepPhrase",
    "Pronoun",
    "Sentence",
    "Verb",
    "german_finite_forms",
    "make_synthetic_corpus",
    "realize",
]

# ----------------------------------------------------------------------------------------------------------------------
# Lexicon
# ----------------------------------------------------------------------------------------------------------------------

Kind = Literal["person", "animal", "place", "thing"]
_KINDS: tuple[Kind, ...] = ("person", "animal", "place", "thing")
# Persons index every conjugation table: ich, du, er/sie/es, wir, sie (plural).
_FIRST_SINGULAR, _SECOND_SINGULAR, _THIRD_SINGULAR, _FIRST_PLURAL, _THIRD_PLURAL = range(5)


@dataclass(frozen=True)
class Noun:
    """A countable noun: English and German singular/plural, German gender, semantic kind and selection tags."""

    en: str
    en_plural: str
    de: str
    de_plural: str
    gender: Literal["m", "f", "n"]
    kind: Kind
    tags: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Adjective:
    """An adjective with the stem its German attributive endings attach to (teuer -> teur-e) and its noun kinds."""

    en: str
    de: str
    de_stem: str
    kinds: frozenset[str]


@dataclass(frozen=True)
class Verb:
    """A verb with its English forms, German present tense (ich, du, er, wir, sie), participle and argument frame."""

    en: str
    en_3sg: str
    en_past: str
    de_present: tuple[str, str, str, str, str]
    de_infinitive: str
    de_participle: str
    de_auxiliary: Literal["haben", "sein"]
    frame: Literal["intransitive", "accusative", "dative", "ditransitive", "motion", "copula", "that"]
    subjects: frozenset[str]
    objects: frozenset[str] = frozenset()
    recipients: frozenset[str] = frozenset()


# english singular, english plural, german singular, german plural, gender, kind, tags...
_NOUN_TABLE = """
man      men       Mann        Männer       m person
woman    women     Frau        Frauen       f person
child    children  Kind        Kinder       n person
girl     girls     Mädchen     Mädchen      n person
teacher  teachers  Lehrer      Lehrer       m person
doctor   doctors   Arzt        Ärzte        m person
father   fathers   Vater       Väter        m person
mother   mothers   Mutter      Mütter       f person
brother  brothers  Bruder      Brüder       m person
sister   sisters   Schwester   Schwestern   f person
friend   friends   Freund      Freunde      m person
cook     cooks     Koch        Köche        m person
baker    bakers    Bäcker      Bäcker       m person
king     kings     König       Könige       m person
queen    queens    Königin     Königinnen   f person
baby     babies    Baby        Babys        n person
dog      dogs      Hund        Hunde        m animal
cat      cats      Katze       Katzen       f animal
horse    horses    Pferd       Pferde       n animal
bird     birds     Vogel       Vögel        m animal
mouse    mice      Maus        Mäuse        f animal
cow      cows      Kuh         Kühe         f animal
house    houses    Haus        Häuser       n place
garden   gardens   Garten      Gärten       m place
park     parks     Park        Parks        m place
school   schools   Schule      Schulen      f place
kitchen  kitchens  Küche       Küchen       f place
city     cities    Stadt       Städte       f place
street   streets   Straße      Straßen      f place
station  stations  Bahnhof     Bahnhöfe     m place
library  libraries Bibliothek  Bibliotheken f place
book     books     Buch        Bücher       n thing readable writable portable
letter   letters   Brief       Briefe       m thing readable writable portable
newspaper newspapers Zeitung   Zeitungen    f thing readable portable
song     songs     Lied        Lieder       n thing writable audible
apple    apples    Apfel       Äpfel        m thing food portable
cake     cakes     Kuchen      Kuchen       m thing food portable
bread    breads    Brot        Brote        n thing food portable
egg      eggs      Ei          Eier         n thing food portable
car      cars      Auto        Autos        n thing washable paintable
bicycle  bicycles  Fahrrad     Fahrräder    n thing washable
table    tables    Tisch       Tische       m thing washable paintable
chair    chairs    Stuhl       Stühle       m thing paintable
door     doors     Tür         Türen        f thing openable paintable
window   windows   Fenster     Fenster      n thing openable washable
key      keys      Schlüssel   Schlüssel    m thing portable
bag      bags      Tasche      Taschen      f thing portable openable
cup      cups      Tasse       Tassen       f thing portable washable
bottle   bottles   Flasche     Flaschen     f thing portable openable
glass    glasses   Glas        Gläser       n thing portable washable
flower   flowers   Blume       Blumen       f thing portable paintable
picture  pictures  Bild        Bilder       n thing portable paintable
ball     balls     Ball        Bälle        m thing portable
hat      hats      Hut         Hüte         m thing portable
coat     coats     Mantel      Mäntel       m thing portable washable
box      boxes     Kiste       Kisten       f thing portable openable
clock    clocks    Uhr         Uhren        f thing portable
tree     trees     Baum        Bäume        m thing paintable
lamp     lamps     Lampe       Lampen       f thing portable
"""

# english, german predicative, german attributive stem, noun kinds it describes...
_ADJECTIVE_TABLE = """
big        groß        groß        person animal place thing
small      klein       klein       person animal place thing
old        alt         alt         person animal place thing
good       gut         gut         person animal place thing
beautiful  schön       schön       person animal place thing
young      jung        jung        person animal
new        neu         neu         place thing
red        rot         rot         thing
green      grün        grün        place thing
blue       blau        blau        thing
black      schwarz     schwarz     animal thing
white      weiß        weiß        animal thing
happy      glücklich   glücklich   person animal
sad        traurig     traurig     person animal
tired      müde        müd         person animal
hungry     hungrig     hungrig     person animal
friendly   freundlich  freundlich  person animal
clever     klug        klug        person animal
fast       schnell     schnell     person animal
expensive  teuer       teur        place thing
dark       dunkel      dunkl       place thing
cold       kalt        kalt        place thing
clean      sauber      sauber      place thing
"""

# english base past | german ich du er wir (the plural sie form always equals wir) | participle, plus "sein" where the
# perfect takes sein rather than haben | frame | subjects | objects | recipients.
# Frames: acc(usative), dat(ive), ditr(ansitive: dative recipient + accusative theme), intr(ansitive), to (motion verb
# with a "to" destination), be (copula), that (heads a that-clause).
# Selectors name noun kinds or tags: "animate" is person + animal, "inanimate" place + thing, "any" every kind.
_VERB_TABLE = """
see saw         | sehe siehst sieht sehen               | gesehen          | acc  | animate | any
buy bought      | kaufe kaufst kauft kaufen             | gekauft          | acc  | person  | thing animal
read read       | lese liest liest lesen                | gelesen          | acc  | person  | readable
write wrote     | schreibe schreibst schreibt schreiben | geschrieben      | acc  | person  | writable
eat ate         | esse isst isst essen                  | gegessen         | acc  | animate | food
find found      | finde findest findet finden           | gefunden         | acc  | animate | portable animal
take took       | nehme nimmst nimmt nehmen             | genommen         | acc  | person  | portable
carry carried   | trage trägst trägt tragen             | getragen         | acc  | person  | portable
love loved      | liebe liebst liebt lieben             | geliebt          | acc  | person  | animate
like liked      | mag magst mag mögen                   | gemocht          | acc  | person  | any
visit visited   | besuche besuchst besucht besuchen     | besucht          | acc  | person  | person place
open opened     | öffne öffnest öffnet öffnen           | geöffnet         | acc  | person  | openable
close closed    | schließe schließt schließt schließen  | geschlossen      | acc  | person  | openable
wash washed     | wasche wäschst wäscht waschen         | gewaschen        | acc  | person  | washable animal
need needed     | brauche brauchst braucht brauchen     | gebraucht        | acc  | animate | thing
paint painted   | male malst malt malen                 | gemalt           | acc  | person  | paintable animate place
ask asked       | frage fragst fragt fragen             | gefragt          | acc  | person  | person
sell sold       | verkaufe verkaufst verkauft verkaufen | verkauft         | acc  | person  | thing animal
hear heard      | höre hörst hört hören                 | gehört           | acc  | animate | animate audible
catch caught    | fange fängst fängt fangen             | gefangen         | acc  | animate | animal portable
help helped     | helfe hilfst hilft helfen             | geholfen         | dat  | person  | animate
thank thanked   | danke dankst dankt danken             | gedankt          | dat  | person  | person
follow followed | folge folgst folgt folgen             | gefolgt sein     | dat  | animate | animate
give gave       | gebe gibst gibt geben                 | gegeben          | ditr | person  | portable         | animate
show showed     | zeige zeigst zeigt zeigen             | gezeigt          | ditr | person  | inanimate animal | person
send sent       | schicke schickst schickt schicken     | geschickt        | ditr | person  | portable         | person
bring brought   | bringe bringst bringt bringen         | gebracht         | ditr | person  | portable         | animate
sleep slept     | schlafe schläfst schläft schlafen     | geschlafen       | intr | animate
laugh laughed   | lache lachst lacht lachen             | gelacht          | intr | person
work worked     | arbeite arbeitest arbeitet arbeiten   | gearbeitet       | intr | person
sing sang       | singe singst singt singen             | gesungen         | intr | person
wait waited     | warte wartest wartet warten           | gewartet         | intr | animate
run ran         | laufe läufst läuft laufen             | gelaufen sein    | intr | animate
swim swam       | schwimme schwimmst schwimmt schwimmen | geschwommen sein | intr | animate
play played     | spiele spielst spielt spielen         | gespielt         | intr | animate
dance danced    | tanze tanzt tanzt tanzen              | getanzt          | intr | person
cry cried       | weine weinst weint weinen             | geweint          | intr | person
go went         | gehe gehst geht gehen                 | gegangen sein    | to   | animate | person place
drive drove     | fahre fährst fährt fahren             | gefahren sein    | to   | person  | person place
come came       | komme kommst kommt kommen             | gekommen sein    | to   | animate | person place
be was          | bin bist ist sind                     | gewesen sein     | be   | any
say said        | sage sagst sagt sagen                 | gesagt           | that | person
think thought   | denke denkst denkt denken             | gedacht          | that | person
know knew       | weiß weißt weiß wissen                | gewusst          | that | person
"""

NAMES: tuple[str, ...] = ("Anna", "Maria", "Julia", "Sophie", "Emma", "Thomas", "Peter", "Paul", "Lukas", "Felix")

ADVERBS: dict[str, str] = {
    "today": "heute",
    "tomorrow": "morgen",
    "now": "jetzt",
    "often": "oft",
    "sometimes": "manchmal",
    "yesterday": "gestern",
}
# "yesterday" with a present verb (or "tomorrow" with a past one) would make English no learner should imitate.
_ADVERBS_BY_TENSE: dict[str, tuple[str, ...]] = {
    "present": ("today", "tomorrow", "now", "often", "sometimes"),
    "can": ("today", "tomorrow", "now", "often", "sometimes"),
    "want": ("today", "tomorrow", "now", "often", "sometimes"),
    "past": ("yesterday", "today", "often", "sometimes"),
}

# english -> (english rendering, german nominative, person)
_PRONOUNS: dict[str, tuple[str, str, int]] = {
    "i": ("I", "ich", _FIRST_SINGULAR),
    "you": ("you", "du", _SECOND_SINGULAR),
    "he": ("he", "er", _THIRD_SINGULAR),
    "she": ("she", "sie", _THIRD_SINGULAR),
    "we": ("we", "wir", _FIRST_PLURAL),
    "they": ("they", "sie", _THIRD_PLURAL),
}

_HABEN = ("habe", "hast", "hat", "haben", "haben")
_SEIN = ("bin", "bist", "ist", "sind", "sind")
_WAR = ("war", "warst", "war", "waren", "waren")
_KOENNEN = ("kann", "kannst", "kann", "können", "können")
_WOLLEN = ("will", "willst", "will", "wollen", "wollen")
_EN_BE_PRESENT = ("am", "are", "is", "are", "are")
_EN_BE_PAST = ("was", "were", "was", "were", "were")

Case = Literal["nom", "acc", "dat"]
# Gender slots: m, f, n and "p" for any plural (German plurals do not distinguish gender).
_DEFINITE: dict[str, dict[str, str]] = {
    "nom": {"m": "der", "f": "die", "n": "das", "p": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "p": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "p": "den"},
}
_DIES_ENDINGS: dict[str, dict[str, str]] = {
    "nom": {"m": "er", "f": "e", "n": "es", "p": "e"},
    "acc": {"m": "en", "f": "e", "n": "es", "p": "e"},
    "dat": {"m": "em", "f": "er", "n": "em", "p": "en"},
}
_EIN_ENDINGS: dict[str, dict[str, str]] = {
    "nom": {"m": "", "f": "e", "n": "", "p": "e"},
    "acc": {"m": "en", "f": "e", "n": "", "p": "e"},
    "dat": {"m": "em", "f": "er", "n": "em", "p": "en"},
}
# Adjective endings: weak after der-words, mixed after ein-words, strong with no determiner (plural only here).
_WEAK: dict[str, dict[str, str]] = {
    "nom": {"m": "e", "f": "e", "n": "e", "p": "en"},
    "acc": {"m": "en", "f": "e", "n": "e", "p": "en"},
    "dat": {"m": "en", "f": "en", "n": "en", "p": "en"},
}
_MIXED: dict[str, dict[str, str]] = {
    "nom": {"m": "er", "f": "e", "n": "es", "p": "en"},
    "acc": {"m": "en", "f": "e", "n": "es", "p": "en"},
    "dat": {"m": "en", "f": "en", "n": "en", "p": "en"},
}
_STRONG_PLURAL: dict[str, str] = {"nom": "e", "acc": "e", "dat": "en"}

# english determiner -> german ein-word stem; "the" and "this" are der-words, "" is the bare plural
_EIN_WORDS: dict[str, str] = {
    "a": "ein",
    "no": "kein",
    "my": "mein",
    "your": "dein",
    "his": "sein",
    "her": "ihr",
    "our": "unser",
    "their": "ihr",
}
DETERMINERS: tuple[str, ...] = ("the", "this", *_EIN_WORDS, "")

# english preposition -> (german preposition, case it governs)
_PREPOSITIONS: dict[str, tuple[str, Case]] = {
    "with": ("mit", "dat"),
    "without": ("ohne", "acc"),
    "for": ("für", "acc"),
    "in": ("in", "dat"),
    "to": ("zu", "dat"),
}
# What each adjunct preposition may govern, so that sampled sentences stay sensible.
_ADJUNCT_OBJECTS: dict[str, frozenset[str]] = {
    "with": frozenset({"person", "animal", "portable"}),
    "without": frozenset({"person", "animal", "portable"}),
    "for": frozenset({"person"}),
    "in": frozenset({"place"}),
}
_CONTRACTIONS: dict[tuple[str, str], str] = {("in", "dem"): "im", ("zu", "dem"): "zum", ("zu", "der"): "zur"}
_CONJUNCTIONS: dict[str, str] = {"because": "weil", "although": "obwohl", "if": "wenn", "that": "dass"}


_SELECTOR_ALIASES: dict[str, frozenset[str]] = {
    "animate": frozenset({"person", "animal"}),
    "inanimate": frozenset({"place", "thing"}),
    "any": frozenset(_KINDS),
}
_FRAME_CODES = {
    "acc": "accusative",
    "dat": "dative",
    "ditr": "ditransitive",
    "intr": "intransitive",
    "to": "motion",
    "be": "copula",
    "that": "that",
}


def _expand(selector: str) -> frozenset[str]:
    words: set[str] = set()
    for word in selector.split():
        words |= _SELECTOR_ALIASES.get(word, {word})
    return frozenset(words)


def _english_third_singular(base: str) -> str:
    if base.endswith(("s", "sh", "ch", "x", "z", "o")):
        return base + "es"
    if base.endswith("y") and base[-2:-1] not in ("a", "e", "i", "o", "u"):
        return base[:-1] + "ies"
    return base + "s"


def _parse_nouns(table: str) -> dict[str, Noun]:
    nouns = {}
    for line in table.strip().splitlines():
        en, en_plural, de, de_plural, gender, kind, *tags = line.split()
        nouns[en] = Noun(en, en_plural, de, de_plural, gender, kind, frozenset(tags))
    return nouns


def _parse_adjectives(table: str) -> dict[str, Adjective]:
    adjectives = {}
    for line in table.strip().splitlines():
        en, de, de_stem, *kinds = line.split()
        adjectives[en] = Adjective(en, de, de_stem, frozenset(kinds))
    return adjectives


def _parse_verbs(table: str) -> dict[str, Verb]:
    verbs = {}
    for line in table.strip().splitlines():
        english, german, participle_aux, frame, subjects, *selectors = (field.strip() for field in line.split("|"))
        en, en_past = english.split()
        ich, du, er, wir = german.split()
        participle, auxiliary = (*participle_aux.split(), "haben")[:2]
        frame = _FRAME_CODES[frame]
        verbs[en] = Verb(
            en=en,
            en_3sg="is" if frame == "copula" else _english_third_singular(en),
            en_past=en_past,
            de_present=(ich, du, er, wir, wir),
            # Every infinitive equals the wir form except the copula's.
            de_infinitive="sein" if frame == "copula" else wir,
            de_participle=participle,
            de_auxiliary=auxiliary,
            frame=frame,
            subjects=_expand(subjects),
            objects=_expand(selectors[0]) if selectors else frozenset(),
            recipients=_expand(selectors[1]) if len(selectors) > 1 else frozenset(),
        )
    return verbs


NOUNS: dict[str, Noun] = _parse_nouns(_NOUN_TABLE)
ADJECTIVES: dict[str, Adjective] = _parse_adjectives(_ADJECTIVE_TABLE)
VERBS: dict[str, Verb] = _parse_verbs(_VERB_TABLE)


def german_finite_forms() -> frozenset[str]:
    """Every finite German verb form the grammar can produce (lexical verbs, auxiliaries, modals, copula past)."""
    forms = {form for verb in VERBS.values() for form in verb.de_present}
    for table in (_HABEN, _SEIN, _WAR, _KOENNEN, _WOLLEN):
        forms.update(table)
    return frozenset(forms)


# ----------------------------------------------------------------------------------------------------------------------
# Sentence structures and their realisation in both languages
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NounPhrase:
    """Determiner, optional adjective and noun, all given in English, e.g. ``NounPhrase("dog", "a", adjective="big")``.

    ``determiner`` is one of ``DETERMINERS``; "" (no determiner) needs ``plural=True``, "a" is singular only.
    """

    noun: str
    determiner: str = "the"
    plural: bool = False
    adjective: str | None = None


@dataclass(frozen=True)
class Name:
    """A proper name (one of ``NAMES``); it is the same word in both languages."""

    name: str


@dataclass(frozen=True)
class Pronoun:
    """A subject pronoun: "I", "you" (always German "du"), "he", "she", "we" or "they"."""

    pronoun: str


@dataclass(frozen=True)
class PrepPhrase:
    """An adjunct "with"/"without"/"for"/"in" + noun phrase or name."""

    preposition: str
    object: NounPhrase | Name


Tense = Literal["present", "past", "can", "want"]


@dataclass(frozen=True)
class Clause:
    """One clause; English simple past becomes the German perfect (the copula's becomes the preterite "war").

    ``objects`` follow the verb's frame: accusative verbs take one (accusative), dative verbs one (dative), ditransitive
    verbs two (recipient in the dative, then theme in the accusative). ``predicate`` is the adjective of "be",
    ``destination`` the "to ..." of motion verbs. ``adverb_first`` fronts the adverb ("Today the man ...").
    """

    subject: NounPhrase | Name | Pronoun
    verb: str
    tense: Tense = "present"
    objects: tuple[NounPhrase | Name, ...] = ()
    predicate: str | None = None
    destination: NounPhrase | Name | None = None
    adjuncts: tuple[PrepPhrase, ...] = ()
    adverb: str | None = None
    adverb_first: bool = False


@dataclass(frozen=True)
class Sentence:
    """A statement or yes/no question, optionally joined to a subordinate clause by because/although/if/that.

    With ``subordinate_first`` the subordinate clause opens the sentence ("If ..., the man ...").
    """

    main: Clause
    mood: Literal["statement", "question"] = "statement"
    conjunction: str | None = None
    subordinate: Clause | None = None
    subordinate_first: bool = False


_OBJECT_COUNTS = {"accusative": 1, "dative": 1, "ditransitive": 2}


def _person(subject: NounPhrase | Name | Pronoun) -> int:
    if isinstance(subject, Pronoun):
        return _PRONOUNS[subject.pronoun.lower()][2]
    if isinstance(subject, NounPhrase) and subject.plural:
        return _THIRD_PLURAL
    return _THIRD_SINGULAR


def _english_nominal(phrase: NounPhrase | Name | Pronoun) -> str:
    if isinstance(phrase, Pronoun):
        return _PRONOUNS[phrase.pronoun.lower()][0]
    if isinstance(phrase, Name):
        return phrase.name
    noun = NOUNS[phrase.noun]
    words = [phrase.adjective] if phrase.adjective else []
    words.append(noun.en_plural if phrase.plural else noun.en)
    determiner = phrase.determiner
    if determiner == "a":
        determiner = "an" if words[0][0] in "aeiou" else "a"
    elif determiner == "this" and phrase.plural:
        determiner = "these"
    return " ".join([determiner, *words]) if determiner else " ".join(words)


def _german_nominal(phrase: NounPhrase | Name | Pronoun, case: Case) -> str:
    if isinstance(phrase, Pronoun):
        if case != "nom":
            raise ValueError(f"pronouns are only supported as subjects, got {phrase.pronoun!r} in the {case}")
        return _PRONOUNS[phrase.pronoun.lower()][1]
    if isinstance(phrase, Name):
        return phrase.name
    noun = NOUNS[phrase.noun]
    slot = "p" if phrase.plural else noun.gender
    determiner = phrase.determiner
    if determiner == "the":
        article, endings = _DEFINITE[case][slot], _WEAK
    elif determiner == "this":
        article, endings = "dies" + _DIES_ENDINGS[case][slot], _WEAK
    elif determiner in _EIN_WORDS:
        article, endings = _EIN_WORDS[determiner] + _EIN_ENDINGS[case][slot], _MIXED
    else:
        article, endings = "", None
    words = [article] if article else []
    if phrase.adjective:
        ending = endings[case][slot] if endings else _STRONG_PLURAL[case]
        words.append(ADJECTIVES[phrase.adjective].de_stem + ending)
    if phrase.plural:
        # Dative plural nouns take -n unless the plural already ends in -n or -s (den Kindern, den Frauen, den Autos).
        dative_n = case == "dat" and not noun.de_plural.endswith(("n", "s"))
        words.append(noun.de_plural + ("n" if dative_n else ""))
    else:
        words.append(noun.de)
    return " ".join(words)


def _english_pp(preposition: str, phrase: NounPhrase | Name) -> str:
    return f"{preposition} {_english_nominal(phrase)}"


def _german_pp(preposition: str, phrase: NounPhrase | Name) -> str:
    german, case = _PREPOSITIONS[preposition]
    text = _german_nominal(phrase, case)
    article, _, rest = text.partition(" ")
    contraction = _CONTRACTIONS.get((german, article))
    if contraction and isinstance(phrase, NounPhrase) and phrase.determiner == "the":
        return f"{contraction} {rest}"
    return f"{german} {text}"


def _check_word(value: str, known: Mapping[str, Any] | Sequence[str], what: str) -> None:
    if value not in known:
        raise ValueError(f"unknown {what} {value!r}")


def _check_phrase(phrase: NounPhrase | Name | Pronoun) -> None:
    if isinstance(phrase, Pronoun):
        _check_word(phrase.pronoun.lower(), _PRONOUNS, "pronoun")
    elif isinstance(phrase, Name):
        _check_word(phrase.name, NAMES, "name")
    else:
        _check_word(phrase.noun, NOUNS, "noun")
        _check_word(phrase.determiner, DETERMINERS, "determiner")
        if phrase.adjective is not None:
            _check_word(phrase.adjective, ADJECTIVES, "adjective")
        if phrase.determiner == "a" and phrase.plural:
            raise ValueError('"a" takes a singular noun; use determiner "" for a bare plural')
        if phrase.determiner == "" and not phrase.plural:
            raise ValueError("a noun phrase without determiner must be plural")


def _check_clause(clause: Clause) -> Verb:
    _check_word(clause.verb, VERBS, "verb")
    verb = VERBS[clause.verb]
    _check_word(clause.tense, ("present", "past", "can", "want"), "tense")
    _check_phrase(clause.subject)
    for phrase in (*clause.objects, *(pp.object for pp in clause.adjuncts)):
        if isinstance(phrase, Pronoun):
            raise ValueError("pronouns are only supported as subjects")
        _check_phrase(phrase)
    expected = _OBJECT_COUNTS.get(verb.frame, 0)
    if len(clause.objects) != expected:
        raise ValueError(f"{verb.frame} verb {verb.en!r} takes {expected} object(s), got {len(clause.objects)}")
    if (verb.frame == "copula") != (clause.predicate is not None):
        raise ValueError('a predicate adjective goes with "be" and only with "be"')
    if clause.predicate is not None:
        _check_word(clause.predicate, ADJECTIVES, "adjective")
    if (verb.frame == "motion") != (clause.destination is not None):
        raise ValueError("a destination goes with motion verbs (go, drive, come) and only with them")
    if clause.destination is not None:
        _check_phrase(clause.destination)
    for pp in clause.adjuncts:
        _check_word(pp.preposition, _ADJUNCT_OBJECTS, "adjunct preposition")
    if clause.adverb is not None:
        _check_word(clause.adverb, ADVERBS, "adverb")
    elif clause.adverb_first:
        raise ValueError("adverb_first needs an adverb")
    if clause.tense == "past" and verb.en_past == verb.en:
        # "I read the book" is present or past: the target would not be a function of the source.
        raise ValueError(f"{verb.en!r} has no distinct English past form")
    return verb


def _english_clause(clause: Clause, question: bool = False) -> str:
    verb = VERBS[clause.verb]
    person = _person(clause.subject)
    third_singular = person == _THIRD_SINGULAR
    subject = _english_nominal(clause.subject)
    if verb.frame == "copula" and clause.tense in ("present", "past"):
        finite = (_EN_BE_PRESENT if clause.tense == "present" else _EN_BE_PAST)[person]
        words = [finite, subject] if question else [subject, finite]
    elif clause.tense == "present":
        do = "does" if third_singular else "do"
        words = [do, subject, verb.en] if question else [subject, verb.en_3sg if third_singular else verb.en]
    elif clause.tense == "past":
        words = ["did", subject, verb.en] if question else [subject, verb.en_past]
    elif clause.tense == "can":
        words = ["can", subject, verb.en] if question else [subject, "can", verb.en]
    else:
        if question:
            words = ["does" if third_singular else "do", subject, "want", "to", verb.en]
        else:
            words = [subject, "wants" if third_singular else "want", "to", verb.en]
    words.extend(_english_nominal(obj) for obj in clause.objects)
    if clause.predicate is not None:
        words.append(clause.predicate)
    if clause.destination is not None:
        words.append(_english_pp("to", clause.destination))
    words.extend(_english_pp(pp.preposition, pp.object) for pp in clause.adjuncts)
    if clause.adverb is not None:
        if clause.adverb_first:
            words.insert(0, clause.adverb)
        else:
            words.append(clause.adverb)
    return " ".join(words)


def _german_clause(clause: Clause, order: Literal["verb-second", "verb-first", "verb-final"]) -> str:
    verb = VERBS[clause.verb]
    person = _person(clause.subject)
    nonfinite: list[str] = []
    if clause.tense == "present":
        finite = verb.de_present[person]
    elif clause.tense == "past" and verb.frame == "copula":
        finite = _WAR[person]
    elif clause.tense == "past":
        finite = (_HABEN if verb.de_auxiliary == "haben" else _SEIN)[person]
        nonfinite.append(verb.de_participle)
    else:
        finite = (_KOENNEN if clause.tense == "can" else _WOLLEN)[person]
        nonfinite.append(verb.de_infinitive)

    # Middle field: time adverb, dative before accusative, adjuncts, then what binds closest to the verb.
    middle: list[str] = []
    if clause.adverb is not None and not clause.adverb_first:
        middle.append(ADVERBS[clause.adverb])
    if verb.frame == "ditransitive":
        middle += [_german_nominal(clause.objects[0], "dat"), _german_nominal(clause.objects[1], "acc")]
    elif clause.objects:
        middle.append(_german_nominal(clause.objects[0], "dat" if verb.frame == "dative" else "acc"))
    middle.extend(_german_pp(pp.preposition, pp.object) for pp in clause.adjuncts)
    if clause.predicate is not None:
        middle.append(ADJECTIVES[clause.predicate].de)
    if clause.destination is not None:
        middle.append(_german_pp("to", clause.destination))

    subject = _german_nominal(clause.subject, "nom")
    if order == "verb-final":
        words = [subject, *middle, *nonfinite, finite]
    elif order == "verb-first":
        words = [finite, subject, *middle, *nonfinite]
    elif clause.adverb_first:
        words = [ADVERBS[clause.adverb], finite, subject, *middle, *nonfinite]
    else:
        words = [subject, finite, *middle, *nonfinite]
    return " ".join(words)


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def realize(sentence: Sentence | Clause) -> tuple[str, str]:
    """Render a sentence structure as its (English, German) pair, capitalised and punctuated."""
    if isinstance(sentence, Clause):
        sentence = Sentence(sentence)
    main_verb = _check_clause(sentence.main)
    if sentence.mood not in ("statement", "question"):
        raise ValueError(f"unknown mood {sentence.mood!r}")
    question = sentence.mood == "question"
    if sentence.subordinate is None:
        if sentence.conjunction is not None:
            raise ValueError("a conjunction needs a subordinate clause")
        if main_verb.frame == "that":
            raise ValueError(f'{main_verb.en!r} needs a "that" clause')
        if question and sentence.main.adverb_first:
            raise ValueError("questions cannot front an adverb")
        english = _english_clause(sentence.main, question)
        german = _german_clause(sentence.main, "verb-first" if question else "verb-second")
        mark = "?" if question else "."
        return _capitalise(english) + mark, _capitalise(german) + mark

    sub_verb = _check_clause(sentence.subordinate)
    if question:
        raise ValueError("questions with a subordinate clause are not supported")
    if sentence.conjunction not in _CONJUNCTIONS:
        raise ValueError(f"unknown conjunction {sentence.conjunction!r}; expected one of {sorted(_CONJUNCTIONS)}")
    if (sentence.conjunction == "that") != (main_verb.frame == "that"):
        raise ValueError('"that" clauses go with say/think/know, and those verbs need one')
    if sub_verb.frame == "that":
        raise ValueError("say/think/know cannot head a subordinate clause")
    if sentence.subordinate.adverb_first:
        raise ValueError("a subordinate clause cannot front its adverb")
    conjunction_de = _CONJUNCTIONS[sentence.conjunction]
    sub_english = _english_clause(sentence.subordinate)
    sub_german = _german_clause(sentence.subordinate, "verb-final")
    if sentence.subordinate_first:
        if sentence.conjunction == "that" or sentence.main.adverb_first:
            raise ValueError("a fronted subordinate clause cannot precede a fronted adverb or open a that-sentence")
        # The fronted clause fills the first position, so the main clause's finite verb comes straight after it.
        english = f"{sentence.conjunction} {sub_english}, {_english_clause(sentence.main)}."
        german = f"{conjunction_de} {sub_german}, {_german_clause(sentence.main, 'verb-first')}."
    else:
        english = f"{_english_clause(sentence.main)} {sentence.conjunction} {sub_english}."
        german = f"{_german_clause(sentence.main, 'verb-second')}, {conjunction_de} {sub_german}."
    return _capitalise(english), _capitalise(german)


# ----------------------------------------------------------------------------------------------------------------------
# Random sentences
# ----------------------------------------------------------------------------------------------------------------------


@functools.cache
def _nouns_matching(selector: frozenset[str]) -> tuple[Noun, ...]:
    return tuple(noun for noun in NOUNS.values() if noun.kind in selector or noun.tags & selector)


@functools.cache
def _adjectives_for(kind: str) -> tuple[str, ...]:
    return tuple(adjective.en for adjective in ADJECTIVES.values() if kind in adjective.kinds)


_CLAUSE_VERBS = tuple(verb for verb in VERBS.values() if verb.frame != "that")
_THAT_VERBS = tuple(verb for verb in VERBS.values() if verb.frame == "that")
_SAMPLED_DETERMINERS = ("the", "a", "this", "my", "your", "his", "her", "our", "their", "no")
_DETERMINER_WEIGHTS = (34, 22, 8, 6, 5, 5, 5, 5, 4, 6)
_TENSES: tuple[Tense, ...] = ("present", "past", "can", "want")
_TENSE_WEIGHTS = (40, 30, 15, 15)
_PRONOUN_KEYS = tuple(_PRONOUNS)
_MIN_WORDS, _MAX_WORDS = 4, 20


def _sample_noun_phrase(rng: random.Random, selector: frozenset[str], name_probability: float) -> NounPhrase | Name:
    if "person" in selector and rng.random() < name_probability:
        return Name(rng.choice(NAMES))
    noun = rng.choice(_nouns_matching(selector))
    plural = rng.random() < 0.3
    determiner = rng.choices(_SAMPLED_DETERMINERS, _DETERMINER_WEIGHTS)[0]
    if determiner == "a" and plural:
        determiner = ""
    adjective = rng.choice(_adjectives_for(noun.kind)) if rng.random() < 0.3 else None
    return NounPhrase(noun.en, determiner, plural, adjective)


def _kind_of(phrase: NounPhrase | Name | Pronoun) -> str:
    return NOUNS[phrase.noun].kind if isinstance(phrase, NounPhrase) else "person"


def _sample_clause(rng: random.Random, verb: Verb | None = None, allow_adverb_first: bool = False) -> Clause:
    if verb is None:
        verb = rng.choice(_CLAUSE_VERBS)
    tense = rng.choices(_TENSES, _TENSE_WEIGHTS)[0]
    while (tense == "past" and verb.en_past == verb.en) or (tense == "want" and verb.frame == "copula"):
        tense = rng.choices(_TENSES, _TENSE_WEIGHTS)[0]
    if verb.frame == "that":
        tense = "present" if tense in ("can", "want") else tense

    subject: NounPhrase | Name | Pronoun
    if "person" in verb.subjects and rng.random() < 0.25:
        subject = Pronoun(rng.choice(_PRONOUN_KEYS))
    else:
        subject = _sample_noun_phrase(rng, verb.subjects, 0.2)

    objects: tuple[NounPhrase | Name, ...] = ()
    if verb.frame == "ditransitive":
        objects = (_sample_noun_phrase(rng, verb.recipients, 0.2), _sample_noun_phrase(rng, verb.objects, 0.0))
    elif verb.frame in ("accusative", "dative"):
        objects = (_sample_noun_phrase(rng, verb.objects, 0.15),)
    predicate = rng.choice(_adjectives_for(_kind_of(subject))) if verb.frame == "copula" else None
    destination = _sample_noun_phrase(rng, verb.objects, 0.2) if verb.frame == "motion" else None

    adjuncts: tuple[PrepPhrase, ...] = ()
    if verb.frame not in ("copula", "that") and rng.random() < 0.25:
        preposition = rng.choice(tuple(_ADJUNCT_OBJECTS))
        adjuncts = (PrepPhrase(preposition, _sample_noun_phrase(rng, _ADJUNCT_OBJECTS[preposition], 0.2)),)

    adverb = rng.choice(_ADVERBS_BY_TENSE[tense]) if rng.random() < 0.3 else None
    adverb_first = adverb is not None and allow_adverb_first and rng.random() < 0.5
    return Clause(subject, verb.en, tense, objects, predicate, destination, adjuncts, adverb, adverb_first)


def _sample_sentence(rng: random.Random) -> Sentence:
    draw = rng.random()
    if draw < 0.45:
        return Sentence(_sample_clause(rng, allow_adverb_first=True))
    if draw < 0.57:
        return Sentence(_sample_clause(rng), mood="question")
    if draw < 0.87:
        conjunction = rng.choice(("because", "although", "if"))
        subordinate_first = draw >= 0.72
        main = _sample_clause(rng, allow_adverb_first=not subordinate_first)
        return Sentence(main, "statement", conjunction, _sample_clause(rng), subordinate_first)
    main = _sample_clause(rng, rng.choice(_THAT_VERBS), allow_adverb_first=True)
    return Sentence(main, "statement", "that", _sample_clause(rng))


def _sample_pair(rng: random.Random) -> tuple[str, str]:
    while True:
        english, german = realize(_sample_sentence(rng))
        if _MIN_WORDS <= english.count(" ") + 1 <= _MAX_WORDS:
            return english, german


def make_synthetic_corpus(
    seed: int = 0, num_train: int = 20000, num_validation: int = 500, num_test: int = 500
) -> DatasetDict:
    """Deterministic English -> German corpus from the embedded grammar; no source or target repeats across pairs."""
    sizes = {"train": num_train, "validation": num_validation, "test": num_test}
    for split, size in sizes.items():
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"num_{split} must be a non-negative integer, got {size!r}")
    total = sum(sizes.values())
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    seen_sources: set[str] = set()
    # "her"/"their" both give "ihr": distinct sources can share a target, which must not leak across splits either.
    seen_targets: set[str] = set()
    attempts = 0
    while len(pairs) < total:
        attempts += 1
        if attempts > 20 * total + 1000:
            raise ValueError(f"could only generate {len(pairs)} distinct pairs of the {total} requested")
        english, german = _sample_pair(rng)
        if english in seen_sources or german in seen_targets:
            continue
        seen_sources.add(english)
        seen_targets.add(german)
        pairs.append((english, german))
    # Duplicates are rejected more often among short sentences as the pool fills: shuffle so that later splits do not
    # lean towards long ones.
    rng.shuffle(pairs)
    splits = {}
    start = 0
    for split, size in sizes.items():
        chunk = pairs[start : start + size]
        start += size
        splits[split] = Dataset.from_dict(
            {"source": [english for english, _ in chunk], "target": [german for _, german in chunk]}, features=FEATURES
        )
    return DatasetDict(splits)
