"""Names as the world writes them, generated: people and places in many scripts, lengths and shapes.

The default model can only copy a name it never saw if its training taught copying for every kind of text a
user may type: Latin with and without diacritics, Cyrillic, Greek, Han, kana, Hangul, Arabic, Hebrew and
Devanagari; one character to forty; one word to several; places shaped like real ones ("San Pedro de la
Vega", "Nizhny Krasnogorsk", "Saint-Étienne-sur-Loire", "Новоалексеевск", "東山市"). Everything here is drawn
from syllable and character tables, nothing is downloaded, and the draw is deterministic given the caller's
random generator.

A name's length is capped at :data:`MAX_CHARACTERS` characters and :data:`MAX_UTF8_BYTES` UTF-8 bytes: the
byte-level tokenizer spends one token per byte on scripts its merges never saw (two per Cyrillic letter,
three per Han character), and a copied name must stay inside the 128-token attention window of the copy.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["MAX_CHARACTERS", "MAX_UTF8_BYTES", "SCRIPTS", "WorldNames"]

MAX_CHARACTERS = 40
MAX_UTF8_BYTES = 64


def _split(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# Per script: onsets, vowels, codas (syllable = onset + vowel + coda), and how words join into place names.
_LATIN = (_split("b c d f g h j k l m n p r s t v w y z br ch cl cr dr fl fr gr kl pl pr qu sch sh sm sp st th "
                 "tr wh wr"),
          _split("a e i o u y a e i o ea ee oo ie ia au ou ai"),
          _split("- - - n r l s t m x ck ng nd st th ll ss tt rd rt ce th"))  # fmt: skip
_LATIN_MARKED = (_split("b c ç d f g ğ h j k l ł m n ñ p r ř s š ş t v w z ž ż dž sz cz"),
                 _split("a á à â ä ã å e é è ê ë ě i í î ï o ó ò ô ö õ ø ő u ú ù û ü ű y ý æ œ"),
                 _split("- - - n ň r l s ß t m k ć ś ź ń"))  # fmt: skip
_CYRILLIC = (_split("б в г д ж з к л м н п р с т ф х ц ч ш щ"), _split("а е и о у ы э ю я ё"),
             _split("- - - й н р л с к в м т"))  # fmt: skip
_GREEK = (_split("β γ δ ζ θ κ λ μ ν ξ π ρ σ τ φ χ ψ"), _split("α ε η ι ο υ ω ά έ ή ί ό ύ ώ"),
          _split("- - - ς ν ρ"))  # fmt: skip
_ARABIC = (_split("ب ت ث ج ح خ د ذ ر ز س ش ص ض ط ظ ع غ ف ق ك ل م ن ه"), _split("ا و ي - -"),
           _split("- - ن ر ل م د"))  # fmt: skip
_HEBREW = (_split("ב ג ד ה ז ח ט כ ל מ נ ס ע פ צ ק ר ש ת"), _split("ו י - - א"), _split("- - ם ן ך ף ץ"))
_DEVANAGARI = (_split("क ख ग घ च ज झ ट ड त थ द ध न प फ ब भ म य र ल व श स ह"), _split("- ा ि ी ु ू े ै ो ौ"),
               _split("- - - ं ्"))  # fmt: skip
_KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわん"
_KATAKANA = "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワン"
_HAN_PLACE = "山川京州市江島田林村原海河湖城都港岡野崎"


def _syllables(rng: random.Random, table: tuple, count: int) -> str:
    onsets, vowels, codas = table
    return "".join((rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)).replace("-", "")
                   for _ in range(count))  # fmt: skip


def _han(rng: random.Random, count: int) -> str:
    return "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(count))


def _hangul(rng: random.Random, count: int) -> str:
    return "".join(chr(0xAC00 + rng.randrange(11172)) for _ in range(count))


def _kana(rng: random.Random, count: int) -> str:
    alphabet = rng.choice((_KANA, _KATAKANA))
    return "".join(rng.choice(alphabet) for _ in range(count))


def _word_maker(table: tuple, capitalize: bool) -> Callable[[random.Random, int], str]:
    def make(rng: random.Random, syllables: int) -> str:
        word = _syllables(rng, table, syllables)
        return word[:1].upper() + word[1:] if capitalize else word

    return make


#: script name -> (word maker (rng, size) -> word, place patterns with ``{}`` for words, word separator)
SCRIPTS: dict[str, tuple[Callable[[random.Random, int], str], tuple[str, ...], str]] = {
    "latin": (
        _word_maker(_LATIN, True),
        (
            "{}",
            "{}",
            "San {}",
            "Santa {} de {}",
            "{} de la {}",
            "New {}",
            "Port {}",
            "{}ville",
            "{}burg",
            "Saint-{}-sur-{}",
            "{} City",
            "Lake {}",
            "Mount {}",
            "{} Springs",
            "Bad {}",
            "{} am {}",
            "{}ton",
            "Al-{}",
            "{}abad",
            "{}pur",
            "Ciudad {}",
            "Rio {}",
            "{} Beach",
            "Nizhny {}",
            "Los {}",
            "{}-{}",
        ),
        " ",
    ),  # fmt: skip
    "latin_marked": (
        _word_maker(_LATIN_MARKED, True),
        (
            "{}",
            "{}",
            "São {}",
            "Saint-Étienne-{}",
            "{} nad {}",
            "Ústí nad {}",
            "{}öy",
            "{}ås",
            "{}-Ñuñoa",
            "{} de {}",
            "Łódź {}",
            "{}štadt",
            "{}ø",
        ),
        " ",
    ),  # fmt: skip
    "cyrillic": (
        _word_maker(_CYRILLIC, True),
        ("{}", "{}ск", "{}град", "Нижний {}", "Санкт-{}", "{}-на-{}", "Ново{}", "{}ово"),
        " ",
    ),
    "greek": (_word_maker(_GREEK, True), ("{}", "Άγιος {}", "{}πολη", "Νέα {}"), " "),
    "arabic": (_word_maker(_ARABIC, False), ("{}", "ال{}", "مدينة {}", "{} {}"), " "),
    "hebrew": (_word_maker(_HEBREW, False), ("{}", "{} {}", "קרית {}"), " "),
    "devanagari": (_word_maker(_DEVANAGARI, False), ("{}", "{}पुर", "{}नगर", "{}ाबाद"), " "),
    "han": (lambda rng, size: _han(rng, size), ("{}", "{}" + "{}", *(f"{{}}{c}" for c in _HAN_PLACE)), ""),
    "kana": (lambda rng, size: _kana(rng, 1 + size), ("{}", "{}市", "{}町"), ""),
    "hangul": (lambda rng, size: _hangul(rng, size), ("{}", "{}시", "{}동", "{} {}"), " "),
}
_SCRIPT_WEIGHTS = {"latin": 4, "latin_marked": 2, "cyrillic": 2, "greek": 1, "arabic": 1, "hebrew": 1,
                   "devanagari": 1, "han": 2, "kana": 1, "hangul": 1}  # fmt: skip
_GLUE = {"latin": ("", "", "", "", "van ", "de ", "O'", "Mc", "del ", "von "), "latin_marked": ("", "", "", "de ")}


def _fits(name: str) -> bool:
    return 1 <= len(name) <= MAX_CHARACTERS and len(name.encode()) <= MAX_UTF8_BYTES and name == name.strip()


class WorldNames:
    """People, places and time-zone places in a script chosen per name (or fixed by ``script``)."""

    def __init__(self, rng: random.Random, script: str | None = None) -> None:
        if script is not None and script not in SCRIPTS:
            raise ValueError(f"unknown script {script!r}; choose one of {sorted(SCRIPTS)}")
        self.rng, self.script = rng, script

    def _script(self) -> str:
        if self.script is not None:
            return self.script
        return self.rng.choices(list(_SCRIPT_WEIGHTS), list(_SCRIPT_WEIGHTS.values()))[0]

    def _word(self, script: str) -> str:
        size = self.rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        return SCRIPTS[script][0](self.rng, size)

    def _until_fits(self, make: Callable[[], str]) -> str:
        while True:
            name = make()
            if _fits(name):
                return name

    def person(self) -> str:
        """A given name, sometimes a middle initial or a second given name, and a family name (Han and kana:
        written together; sometimes a single name, as many people and some cultures use)."""

        def make() -> str:
            script = self._script()
            words = [self._word(script) for _ in range(self.rng.choice((1, 2, 2, 2, 2, 3)))]
            if script in _GLUE and len(words) > 1:
                words[-1] = self.rng.choice(_GLUE[script]) + words[-1]
                if self.rng.random() < 0.15:
                    words.insert(1, f"{words[1][0].upper()}.")
            if script == "latin" and self.rng.random() < 0.05:
                words = [w.upper() for w in words]
            return SCRIPTS[script][2].join(words)

        return self._until_fits(make)

    def city(self) -> str:
        """A place name shaped like the script's real ones (prefixes, suffixes, several words)."""

        def make() -> str:
            script = self._script()
            _, patterns, _ = SCRIPTS[script]
            pattern = self.rng.choice(patterns)
            return pattern.format(*(self._word(script) for _ in range(pattern.count("{}"))))

        return self._until_fits(make)

    def timezone_place(self) -> str:
        """A city as an IANA zone writes it (spaces become underscores)."""
        return self.city().replace(" ", "_")

    def any_text(self) -> str:
        """A person or a place, or a short string of letters of one script (one to forty characters)."""
        kind = self.rng.random()
        if kind < 0.4:
            return self.person()
        if kind < 0.8:
            return self.city()
        script = self._script()
        return self._until_fits(lambda: self._word(script)[: self.rng.randint(1, MAX_CHARACTERS)])
