"""LibreTranslate's `POST /translate`, as its clients send it: the request read from a JSON or form body (the query
string's fields too, as LibreTranslate reads them), checked against the model's pair and the limits, and the response
shaped as q was.

Each line of a text is a sentence, translated as `vaswani translate` translates that line; the lines' translations are
joined by "\\n" again. `alternatives` n asks for an n-best list of n + 1: the best is the translation, the others
(those differing from it and from each other) the alternatives, as LibreTranslate gives them.
"""

import json
from dataclasses import dataclass
from urllib.parse import parse_qsl

from python_multipart import create_form_parser
from python_multipart.exceptions import FormParserError

from .languages import AUTO, LanguagePair
from .settings import ServingSettings

JSON_TYPES = ("application/json",)
URLENCODED = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"


class BadRequest(Exception):
    """A request refused with `status` and a one-line message, the response's `{"error": message}`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TranslateRequest:
    """A checked `POST /translate`: its texts (q, one or a list of them) and how to answer."""

    texts: list[str]
    is_list: bool
    alternatives: int
    auto_source: bool

    @property
    def lines(self) -> list[list[str]]:
        """Each text's lines, split at "\\n" (and a "\\r" before it) as `vaswani translate` reads its input."""
        return [[line.removesuffix("\r") for line in text.split("\n")] for text in self.texts]

    @property
    def nbest(self) -> int:
        return self.alternatives + 1

    def sentences(self) -> list[str]:
        """The lines to decode, in order: the non-blank ones (a blank line translates to a blank line)."""
        return [line for lines in self.lines for line in lines if line.strip()]

    def response(self, decoded: list[list[str]], pair: LanguagePair) -> dict:
        """The response body, given the n-best texts of each of `sentences()` in order."""
        hypotheses = iter(decoded)
        translations, alternatives = [], []
        for lines in self.lines:
            # a blank line's hypotheses: itself blank, as many as asked
            line_hypotheses = [next(hypotheses) if line.strip() else [""] * self.nbest for line in lines]
            texts = ["\n".join(line[rank] for line in line_hypotheses) for rank in range(self.nbest)]
            translations.append(texts[0])
            alternatives.append(unique_alternatives(texts[1:], texts[0]))
        body: dict = {"translatedText": translations if self.is_list else translations[0]}
        if self.auto_source:  # no detection: the model's source language, the only one it takes
            detected = {"confidence": 100.0, "language": pair.source}
            body["detectedLanguage"] = [detected] * len(self.texts) if self.is_list else detected
        if self.alternatives:
            body["alternatives"] = alternatives if self.is_list else alternatives[0]
        return body


def unique_alternatives(texts: list[str], translation: str) -> list[str]:
    """`texts` without blanks, repeats and the translation itself, in order (LibreTranslate's filter_unique)."""
    seen = {translation, ""}
    return [text for text in texts if not (text in seen or seen.add(text))]


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadRequest(f"{what} is not UTF-8: {error.reason} at byte {error.start}") from None


def form_fields(body: bytes, content_type: str) -> list[tuple[str, str]]:
    """The fields of a form body, each value checked to be UTF-8."""
    if media_type(content_type) == URLENCODED:
        return query_fields(body, "the form body")
    fields: list[tuple[str, str]] = []
    files: list[object] = []
    parser = create_form_parser(
        {"Content-Type": content_type.encode("latin-1")},
        lambda field: fields.append((utf8(field.field_name or b"", "a field name"), utf8(field.value or b"", "q"))),
        files.append,
    )
    try:
        parser.write(body)
        parser.finalize()
    except FormParserError as error:
        raise BadRequest(f"the multipart body is malformed: {error}") from None
    if files:
        raise BadRequest("files are not translated here: send the text as the field q")
    return fields


def query_fields(data: bytes, what: str) -> list[tuple[str, str]]:
    """The fields of a URL-encoded string (a query string, a form body), percent-escapes decoded as UTF-8."""
    try:
        return parse_qsl(utf8(data, what), keep_blank_values=True, errors="strict")
    except UnicodeDecodeError as error:
        raise BadRequest(f"{what} is not UTF-8 once percent-decoded: {error.reason}") from None


def request_fields(body: bytes, content_type: str, query_string: bytes) -> dict[str, object]:
    """The request's fields by name: a JSON body's object; or the query string's and a form body's fields, a field
    given more than once (q=...&q=...) as the list of its values."""
    kind = media_type(content_type)
    if kind in JSON_TYPES or kind.endswith("+json"):
        try:
            fields = json.loads(utf8(body, "the JSON body"))
        except json.JSONDecodeError as error:
            raise BadRequest(f"the body is not valid JSON: {error}") from None
        if not isinstance(fields, dict):
            raise BadRequest(f"the JSON body must be an object of fields, got {type(fields).__name__}")
        return fields
    pairs = query_fields(query_string, "the query string")
    if kind in (URLENCODED, MULTIPART):
        pairs += form_fields(body, content_type)
    elif body:
        raise BadRequest(f"a body of type {kind or 'unknown'} is not read: send JSON, or a form ({URLENCODED})")
    values: dict[str, list[str]] = {}
    for name, value in pairs:
        values.setdefault(name, []).append(value)
    return {name: given if name == "q" and len(given) > 1 else given[0] for name, given in values.items()}


def translate_request(
    body: bytes, content_type: str, query_string: bytes, pair: LanguagePair, settings: ServingSettings
) -> TranslateRequest:
    """The checked request of a `POST /translate` (BadRequest naming what is wrong)."""
    fields = request_fields(body, content_type, query_string)
    q = fields.get("q")
    for name in ("q", "source", "target"):
        if fields.get(name) in (None, "", []):
            raise BadRequest(f"Invalid request: missing {name} parameter")
    if not (isinstance(q, str) or (isinstance(q, list) and all(isinstance(text, str) for text in q))):
        raise BadRequest(f"q must be a string or a list of strings, got {json.dumps(q)[:80]}")
    source, target = fields["source"], fields["target"]
    if source not in (pair.source, AUTO):
        raise BadRequest(f"source language {source} is not supported: this server translates {pair.source} (or auto)")
    if target != pair.target:
        raise BadRequest(f"target language {target} is not supported: this server translates into {pair.target}")
    text_format = fields.get("format") or "text"
    if text_format != "text":
        raise BadRequest(f"format {text_format} is not supported: this server translates plain text (format text)")
    request = TranslateRequest(
        texts=q if isinstance(q, list) else [q],
        is_list=isinstance(q, list),
        alternatives=alternatives(fields.get("alternatives", 0), settings.max_alternatives),
        auto_source=source == AUTO,
    )
    lines = [line for lines in request.lines for line in lines]
    if len(lines) > settings.max_sentences:
        raise BadRequest(f"the request has {len(lines)} sentences (lines), over the limit of {settings.max_sentences}")
    longest = max(lines, key=len)
    if len(longest) > settings.max_characters:
        raise BadRequest(
            f"a sentence (line) of {len(longest)} characters is over the limit of {settings.max_characters}"
        )
    return request


def alternatives(value: object, most: int) -> int:
    """The `alternatives` field: an integer from 0 to `most`, in JSON or as a form's text."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise BadRequest(f"alternatives must be an integer from 0 to {most}, got {json.dumps(value)[:40]}")
    return value
