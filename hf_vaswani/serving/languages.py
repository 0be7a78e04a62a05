"""The language pair a model translates, as its folder records it (the model card's `language` list, source first,
which `vaswani train` writes) or as the command line gives it, and LibreTranslate's description of it."""

import os
from dataclasses import dataclass
from pathlib import Path

from ..model.errors_vaswani import UsageError

AUTO = "auto"  # LibreTranslate's source language that asks the server to detect it: here, the model's source

# English names of ISO 639-1 codes, LibreTranslate's `name` field; another code is named by itself.
LANGUAGE_NAMES = {
    "ar": "Arabic",
    "az": "Azerbaijani",
    "bg": "Bulgarian",
    "bn": "Bengali",
    "ca": "Catalan",
    "cs": "Czech",
    "da": "Danish",
    "de": "German",
    "el": "Greek",
    "en": "English",
    "eo": "Esperanto",
    "es": "Spanish",
    "et": "Estonian",
    "eu": "Basque",
    "fa": "Persian",
    "fi": "Finnish",
    "fr": "French",
    "ga": "Irish",
    "gl": "Galician",
    "he": "Hebrew",
    "hi": "Hindi",
    "hu": "Hungarian",
    "id": "Indonesian",
    "it": "Italian",
    "ja": "Japanese",
    "ko": "Korean",
    "lt": "Lithuanian",
    "lv": "Latvian",
    "ms": "Malay",
    "nb": "Norwegian Bokmål",
    "nl": "Dutch",
    "pl": "Polish",
    "pt": "Portuguese",
    "ro": "Romanian",
    "ru": "Russian",
    "sk": "Slovak",
    "sl": "Slovenian",
    "sq": "Albanian",
    "sv": "Swedish",
    "th": "Thai",
    "tl": "Tagalog",
    "tr": "Turkish",
    "uk": "Ukrainian",
    "ur": "Urdu",
    "vi": "Vietnamese",
    "zh": "Chinese",
}


@dataclass(frozen=True)
class LanguagePair:
    source: str
    target: str

    def libretranslate_languages(self) -> list[dict]:
        """`GET /languages` as LibreTranslate answers it: each language with the targets it translates into."""
        return [
            {"code": self.source, "name": LANGUAGE_NAMES.get(self.source, self.source), "targets": [self.target]},
            {"code": self.target, "name": LANGUAGE_NAMES.get(self.target, self.target), "targets": []},
        ]


def recorded_pair(model_folder: str | os.PathLike) -> LanguagePair | None:
    """The pair the folder's model card records (its `language` list of two, source first), or None."""
    from huggingface_hub.repocard import metadata_load

    card = Path(model_folder) / "README.md"
    languages = (metadata_load(card) or {}).get("language") if card.is_file() else None
    if isinstance(languages, list) and len(languages) == 2 and all(isinstance(code, str) for code in languages):
        return LanguagePair(*languages)
    return None


def language_pair(model_folder: str | os.PathLike, source: str | None, target: str | None) -> LanguagePair:
    """The model's pair: the folder's, else `source` and `target` (--source-lang, --target-lang), which may repeat
    the folder's but not contradict it. Refused (UsageError) when neither says."""
    recorded = recorded_pair(model_folder)
    if recorded is None:
        if source is None or target is None:
            raise UsageError(
                f"{model_folder} does not record its languages (a model card listing them): give --source-lang and "
                "--target-lang"
            )
        if source == target:
            raise UsageError(f"--source-lang and --target-lang are both {source!r}")
        if AUTO in (source, target):
            raise UsageError(f"{AUTO!r} is a request's word for the model's source language, not a language code")
        return LanguagePair(source, target)
    for flag, given, recorded_code in (
        ("--source-lang", source, recorded.source),
        ("--target-lang", target, recorded.target),
    ):
        if given is not None and given != recorded_code:
            raise UsageError(
                f"{flag} {given}: {model_folder} translates {recorded.source} to {recorded.target}, as its model "
                "card says"
            )
    return recorded
