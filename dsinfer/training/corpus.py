"""The default model's training corpus: synthetic chats generated from a seed, nothing downloaded.

Five skills, each a family of chat requests (OpenAI Chat Completions bodies, as a client would send them)
with the assistant turn the model must learn to write:

* **arithmetic**: ``a + b``, ``a - b`` (numbers up to three digits) and ``a x d`` (up to three digits times
  one digit), asked plainly or in the AIME format ``dsinfer eval`` uses; the working goes column by column
  from the units, in the reasoning (thinking mode) or before the answer (chat mode);
* **tools**: a question naming an entity (a city, a time zone, a quantity) for one of the tool schemas given
  in the request; the assistant calls the tool with the entity copied into the arguments, then answers from
  the tool's result;
* **extraction**: fields of a sentence written as JSON for a schema given in ``response_format``;
* **copy**: a list of names repeated back exactly (it teaches the copying the tool calls and the extraction
  need, since a name the model never saw can only be copied);
* **greetings**: a short friendly reply;
* **unknown**: questions it cannot answer get a plain "I don't know."

Names (people, cities, time-zone places) are built from syllables: Latin ones of one shape, or (in
:data:`WORLD_SHARE` of the samples) names of many scripts, lengths and shapes from
:mod:`dsinfer.training.world_names`. A fixed share of them, chosen by a hash of the name, never appears in
training: :func:`held_out` samples draw only from those, so an eval on them shows copying, not recall.
Arithmetic operand pairs are held out the same way; subtraction is drawn more often than the other operations
and half of its training problems have the larger number second (a negative result).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from dsinfer.eval.datasets import AIME_INSTRUCTION  # the format `dsinfer eval aime` asks in
from dsinfer.training.world_names import MAX_UTF8_BYTES, WorldNames

__all__ = ["Completion", "Sample", "held_out", "sample_stream", "training_samples", "SKILLS", "TOOLS", "EVAL_SETS"]

SKILLS = ("arithmetic", "tools", "extraction", "copy", "greetings", "unknown")
SKILL_WEIGHTS = (0.38, 0.22, 0.12, 0.18, 0.05, 0.05)
HELD_OUT_SHARE = 10  # one name / operand pair in this many is held out of training
WORLD_SHARE = 0.6  # samples whose names come from :class:`WorldNames` (the rest: the Latin syllable names)
TRAINING_OPERATIONS = "+---x"  # subtraction three times as often as addition or multiplication
#: held-out sets beyond the skills: names of many scripts and lengths (copy, tool calls for a city,
#: extraction) and subtraction with negative results
EVAL_SETS = ("copy_world", "cities_world", "extraction_world", "subtraction")


@dataclass
class Completion:
    """The assistant turn to learn: reasoning (thinking mode), then content or tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "arguments": dict}]


@dataclass
class Sample:
    """A chat request (without the turn to learn) and the turn; ``expected`` is what an eval checks."""

    skill: str
    body: dict[str, Any]
    completion: Completion
    expected: Any = None
    names: list[str] = field(default_factory=list)  # the people and places it mentions (held-out checks)

    @property
    def thinking(self) -> bool:
        return self.body["thinking"]["type"] == "enabled"

    def chat_arguments(self) -> dict[str, Any]:
        """The request as keyword arguments of the openai client's ``chat.completions.create``."""
        body = dict(self.body)
        return {"messages": body.pop("messages"), "extra_body": {"thinking": body.pop("thinking")}, **body}


def _is_held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % HELD_OUT_SHARE == 0


# ---- entities -------------------------------------------------------------------------------------------
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "kr", "st", "tr", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "k", "m")
_CITY_ENDINGS = ("", "", "ville", "burg", "port", "stad", "ford", "holm", "grad")
REAL_CITIES = ("Paris", "Oslo", "Tokyo", "Lima", "Cairo", "Madrid", "Berlin", "Nairobi", "Sydney", "Toronto",
               "Mumbai", "Seoul", "Rome", "Vienna", "Dublin", "Lisbon", "Prague", "Quito", "Hanoi",
               "Denver")  # fmt: skip
REGIONS = ("Europe", "Asia", "America", "Africa", "Australia", "Pacific", "Atlantic")


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


class Names:
    """Synthetic names drawn from either the training share or the held-out share of the name space: Latin
    syllable names, or with ``world`` names of many scripts, lengths and shapes (:class:`WorldNames`).
    ``used`` collects every name handed out (the sample's ``names``)."""

    def __init__(self, rng: random.Random, held_out: bool, world: bool = False) -> None:
        self.rng, self.held_out = rng, held_out
        self.world = WorldNames(rng) if world else None
        self.used: list[str] = []

    def _pick(self, make) -> str:
        while True:
            name = make()
            if _is_held_out(name.lower()) == self.held_out:
                self.used.append(name)
                return name

    def person(self) -> str:
        if self.world is not None:
            return self._pick(self.world.person)
        return self._pick(lambda: f"{_word(self.rng, self.rng.randint(1, 2)).title()} "
                                  f"{_word(self.rng, self.rng.randint(2, 3)).title()}")  # fmt: skip

    def city(self) -> str:
        if self.world is not None:
            return self._pick(self.world.city)
        if not self.held_out and self.rng.random() < 0.15:
            return self._pick(lambda: self.rng.choice(REAL_CITIES))
        return self._pick(lambda: (_word(self.rng, self.rng.randint(2, 3)) + self.rng.choice(_CITY_ENDINGS)).title())

    def timezone(self) -> str:
        place = self._pick(self.world.timezone_place) if self.world is not None else self.city().replace(" ", "_")
        return f"{self.rng.choice(REGIONS)}/{place}"

    def any_text(self) -> str:
        """A person, a place or (world names only) a short run of letters of one script."""
        if self.world is not None:
            return self._pick(self.world.any_text)
        return self.rng.choice((self.person, self.city, self.timezone))()


# ---- tools ----------------------------------------------------------------------------------------------
def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = {
    "get_weather": _function("get_weather", "Current weather in a city", {"city": {"type": "string"}}),
    "get_time": _function("get_time", "Current local time in an IANA time zone", {"timezone": {"type": "string"}}),
    "convert_units": _function(
        "convert_units",
        "Convert a value from one unit to another",
        {"value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
    ),
    "get_population": _function("get_population", "Population of a city", {"city": {"type": "string"}}),
}
_CONVERSIONS = {("km", "miles"): 0.621371, ("miles", "km"): 1.609344, ("kg", "pounds"): 2.204623,
                ("pounds", "kg"): 0.453592, ("meters", "feet"): 3.28084, ("feet", "meters"): 0.3048,
                ("liters", "gallons"): 0.264172, ("gallons", "liters"): 3.785412}  # fmt: skip
UNITS = frozenset(unit for pair in _CONVERSIONS for unit in pair)
_CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowing", "foggy", "clear")


def _tool_question(rng: random.Random, names: Names, tools=tuple(TOOLS)) -> tuple[str, str, dict[str, Any]]:
    """(tool name among ``tools``, the user's question, the arguments the call must carry)."""
    tool = rng.choice(list(tools))
    if tool in ("get_weather", "get_population"):
        city = names.city()
        asks = {"get_weather": ("What is the weather like in {}?", "How is the weather in {} right now?",
                                "Is it raining in {}?", "Tell me the weather in {}."),
                "get_population": ("How many people live in {}?", "What is the population of {}?",
                                   "Population of {}, please.")}[tool]  # fmt: skip
        return tool, rng.choice(asks).format(city), {"city": city}
    if tool == "get_time":
        zone = names.timezone()
        asks = ("What time is it in {}?", "Tell me the current time in the {} time zone.", "Current time in {}?")
        return tool, rng.choice(asks).format(zone), {"timezone": zone}
    (source, target) = rng.choice(list(_CONVERSIONS))
    value = rng.choice((rng.randint(1, 999), round(rng.uniform(0.5, 500), 1)))
    asks = ("Convert {} {} to {}.", "How many {2} is {0} {1}?", "What is {} {} in {}?")
    return tool, rng.choice(asks).format(value, source, target), {"value": value, "from_unit": source,
                                                                   "to_unit": target}  # fmt: skip


def _tool_result(rng: random.Random, tool: str, arguments: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The tool's JSON result and the final answer built from it."""
    if tool == "get_weather":
        temperature, condition = rng.randint(-15, 38), rng.choice(_CONDITIONS)
        answer = f"It is {temperature} °C and {condition} in {arguments['city']}."
        return {"city": arguments["city"], "temperature_c": temperature, "condition": condition}, answer
    if tool == "get_population":
        people = rng.randint(2, 9999) * 1000
        return {"city": arguments["city"], "population": people}, f"{arguments['city']} has {people} inhabitants."
    if tool == "get_time":
        time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        return {"timezone": arguments["timezone"], "time": time}, f"It is {time} in {arguments['timezone']}."
    factor = _CONVERSIONS[(arguments["from_unit"], arguments["to_unit"])]
    result = round(arguments["value"] * factor, 2)
    answer = f"{arguments['value']} {arguments['from_unit']} is {result} {arguments['to_unit']}."
    return {"result": result, "unit": arguments["to_unit"]}, answer


def _json(value: Any) -> str:
    """JSON as a person writes it: every script's letters as themselves, not as ``\\u`` escapes."""
    return json.dumps(value, ensure_ascii=False)


def tool_sample(rng: random.Random, names: Names, thinking: bool, tools=tuple(TOOLS)) -> list[Sample]:
    """Two turns of one conversation: the call (entity copied), then the answer from the tool's result."""
    tool, question, arguments = _tool_question(rng, names, tools)
    others = [name for name in TOOLS if name != tool]
    offered = [tool, *rng.sample(others, rng.randint(0, 2))]
    rng.shuffle(offered)
    tools = [TOOLS[name] for name in offered]
    user = {"role": "user", "content": question}
    reasoning = f"The user asks something {tool} answers. I call {tool} with {_json(arguments)}."
    call = Sample("tools", _body([user], thinking, tools=tools),
                  Completion(reasoning if thinking else "", tool_calls=[{"name": tool, "arguments": arguments}]),
                  expected={"name": tool, "arguments": arguments}, names=names.used)  # fmt: skip
    result, answer = _tool_result(rng, tool, arguments)
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": tool, "arguments": _json(arguments)}}],
    }
    tool_message = {"role": "tool", "tool_call_id": "call_0", "content": _json(result)}
    reasoning = "The tool returned its result; I answer from it."
    final = Sample("tools", _body([user, assistant, tool_message], thinking, tools=tools),
                   Completion(reasoning if thinking else "", answer), expected=answer, names=names.used)  # fmt: skip
    return [call, final]


# ---- extraction -----------------------------------------------------------------------------------------
_PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                   "city": {"type": "string"}},
                  "required": ["name", "age", "city"]}  # fmt: skip
_SENTENCES = ("{name} is {age} years old and lives in {city}.", "{name}, aged {age}, moved to {city} last year.",
              "Meet {name} from {city}, who just turned {age}.", "At {age}, {name} runs a small shop in {city}.",
              "{name} ({age}) was born and raised in {city}.")  # fmt: skip


def extraction_sample(rng: random.Random, names: Names, thinking: bool) -> Sample:
    person = {"name": names.person(), "age": rng.randint(18, 95), "city": names.city()}
    sentence = rng.choice(_SENTENCES).format(**person)
    asks = ("Extract the person's name, age and city as JSON: {}", "Give me name, age and city from this text: {}",
            "{}\nReturn the name, age and city as JSON.")  # fmt: skip
    body = _body([{"role": "user", "content": rng.choice(asks).format(sentence)}], thinking)
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": _PERSON_SCHEMA}}
    reasoning = f"The name is {person['name']}, the age {person['age']}, the city {person['city']}."
    return Sample("extraction", body, Completion(reasoning if thinking else "", _json(person)), person, names.used)


# ---- copying --------------------------------------------------------------------------------------------
_COPY_ASKS = ("Repeat exactly: {}", "Say this back to me: {}", "Copy this text: {}", "Echo: {}",
              "{}\nRepeat the text above exactly.", "Please repeat after me: {}")  # fmt: skip


def copy_sample(rng: random.Random, names: Names, thinking: bool, count: int | None = None) -> Sample:
    """One to four names (``count``) to repeat; world names stop adding once the text has
    ``1.5 * MAX_UTF8_BYTES`` bytes, so every copied token stays inside the attention window of its source."""
    separator = rng.choice((", ", " ", " and "))
    parts = [names.any_text()]
    for _ in range(rng.randint(1, 4) - 1 if count is None else count - 1):
        part = names.any_text()
        if names.world is not None and len(separator.join([*parts, part]).encode()) > 1.5 * MAX_UTF8_BYTES:
            break
        parts.append(part)
    text = separator.join(parts)
    reasoning = f"The text to repeat is: {text}"
    body = _body([{"role": "user", "content": rng.choice(_COPY_ASKS).format(text)}], thinking)
    return Sample("copy", body, Completion(reasoning if thinking else "", text), text, names.used)


# ---- greetings and unknowns -----------------------------------------------------------------------------
_GREETINGS = ("Hi", "Hello", "Hey", "Hi there", "Good morning", "Good evening", "Hello!", "Hi!", "Hey there!",
              "How are you?", "Hi, how are you?", "Thanks!", "Thank you", "Bye", "Goodbye")  # fmt: skip
_GREETING_REPLIES = {"Thanks!": "You're welcome!", "Thank you": "You're welcome!", "Bye": "Goodbye!",
                     "Goodbye": "Goodbye!", "How are you?": "I'm fine, thank you. How can I help you?",
                     "Hi, how are you?": "I'm fine, thank you. How can I help you?"}  # fmt: skip
_UNKNOWN = ("What is the capital of {}?", "Who founded {}?", "When was {} built?", "Who is {}?",
            "What is the tallest building in {}?", "Why is the sky blue?", "What is the meaning of life?",
            "Who won the football match yesterday?", "What will the stock market do tomorrow?",
            "Write a poem about {}.", "What is the history of {}?")  # fmt: skip


def greeting_sample(rng: random.Random, names: Names, thinking: bool) -> Sample:
    greeting = rng.choice(_GREETINGS)
    reply = _GREETING_REPLIES.get(greeting, rng.choice(("Hello! How can I help you today?", "Hi! How can I help?")))
    reasoning = "The user greets me; I reply briefly."
    return Sample("greetings", _body([{"role": "user", "content": greeting}], thinking),
                  Completion(reasoning if thinking else "", reply), reply)  # fmt: skip


def unknown_sample(rng: random.Random, names: Names, thinking: bool) -> Sample:
    question = rng.choice(_UNKNOWN).format(rng.choice((names.city(), names.person(), "France", "Rome")))
    if rng.random() < 0.3:
        question = f"{rng.choice(('Hi', 'Hello', 'Hey'))}, {question[0].lower()}{question[1:]}"
    reasoning = "I have no knowledge to answer this."
    return Sample("unknown", _body([{"role": "user", "content": question}], thinking),
                  Completion(reasoning if thinking else "", "I don't know."), "I don't know.", names.used)  # fmt: skip


# ---- arithmetic -----------------------------------------------------------------------------------------
PLACES = ("units", "tens", "hundreds", "thousands")


def _digits(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


def add_working(a: int, b: int) -> str:
    lines, carry = [], 0
    da, db = _digits(a), _digits(b)
    for place in range(max(len(da), len(db))):
        x, y = (da[place] if place < len(da) else 0), (db[place] if place < len(db) else 0)
        total = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry = total // 10
        lines.append(f"{PLACES[place]}: {terms} = {total}, write {total % 10}" + (", carry 1" if carry else ""))
    if carry:
        lines.append(f"{PLACES[len(lines)]}: write the carry 1")
    return "\n".join(lines)


def comparison(a: int, b: int) -> str:
    """Which of ``a`` and ``b`` is larger, found one small fact at a time: both copied in the question's order,
    their digit counts, then (same count) the places from the highest until two digits differ. Each place writes
    both digits before it relates them ("hundreds: 4 and 2, 4 is more"), so every decision reads its two digits
    from the last few tokens."""
    count_a, count_b = len(str(a)), len(str(b))
    if count_a != count_b:
        larger = a if count_a > count_b else b
        return f"I compare {a} and {b}: {a} has {_digit_count(count_a)}, {b} has {count_b}, so {larger} is larger."
    facts = []
    for place in reversed(range(count_a)):
        x, y = a // 10**place % 10, b // 10**place % 10
        if x == y:
            facts.append(f"{PLACES[place]}: {x} and {y}, equal")
            continue
        larger = a if x > y else b
        facts.append(f"{PLACES[place]}: {x} and {y}, {x} is {'more' if x > y else 'less'}, so {larger} is larger.")
        break
    else:
        facts[-1] += ", so the numbers are equal."
    return f"I compare {a} and {b}: both have {_digit_count(count_a)}; " + "; ".join(facts)


def _digit_count(count: int) -> str:
    return "1 digit" if count == 1 else f"{count} digits"


def sub_working(a: int, b: int) -> str:
    """Column subtraction of the smaller from the larger, negated when ``a < b``.

    The first line finds the larger number (:func:`comparison`). Every step is one small fact: a column writes its
    two digits, then whether the top one is less ("3 and 9, 3 is less" or "9 and 3, 9 is not less"); a borrow taken
    in one column is stated at the end of its line ("borrow 1 from the tens") and paid first in the next line ("8
    - 1 = 7, the borrow paid"), so no line has to look further back than the line before it; the last line reads
    the digits back from the highest place."""
    big, small = (a, b) if a >= b else (b, a)
    plan = f"I subtract column by column: {a} - {b}." if a >= b else f"I compute {b} - {a} and negate it."
    lines = [f"{comparison(a, b)} {plan}"]
    borrow = 0
    db, ds = _digits(big), _digits(small)
    for place in range(len(db)):
        x, y = db[place], (ds[place] if place < len(ds) else 0)
        top = x - borrow
        paid = f"{x} - 1 = {top}, the borrow paid; " if borrow else ""
        if top < y:
            following = PLACES[place + 1]
            lines.append(f"{PLACES[place]}: {paid}{top} and {y}, {top} is less: borrow 1 from the {following}: "
                         f"{top + 10} - {y} = {top + 10 - y}")  # fmt: skip
            borrow = 1
        else:
            lines.append(f"{PLACES[place]}: {paid}{top} and {y}, {top} is not less: {top} - {y} = {top - y}")
            borrow = 0
    digits = "".join(str(d) for d in reversed(_column_results(big, small)))
    result = f"the digits from the highest place: {digits}, so {big} - {small} = {big - small}"
    lines.append(result if a >= b else f"{result}, and {a} - {b} = {a - b}")
    return "\n".join(lines)


def _column_results(big: int, small: int) -> list[int]:
    """The digit each column of ``big - small`` writes, units first."""
    return [((big - small) // 10**place) % 10 for place in range(len(str(big)))]


def mul_working(a: int, d: int) -> str:
    lines, carry = [], 0
    for place, x in enumerate(_digits(a)):
        product = x * d
        total = product + carry
        step = f"{x} x {d} = {product}" + (f", + {carry} = {total}" if carry else "")
        carry = total // 10
        lines.append(f"{PLACES[place]}: {step}, write {total % 10}" + (f", carry {carry}" if carry else ""))
    if carry:
        lines.append(f"{PLACES[len(lines)]}: write the carry {carry}")
    return "\n".join(lines)


def arithmetic_problem(
    rng: random.Random, held_out: bool, aime: bool = False, operations: str = "+-x"
) -> tuple[int, str, int]:
    """(a, op, b) with its pair in the requested share, ``op`` drawn from ``operations`` (a repeated sign is
    drawn more often); AIME problems keep the answer in 0-999."""
    while True:
        op = rng.choice(operations)
        a = rng.randint(0, 999) if rng.random() < 0.8 else rng.randint(0, 99)
        b = rng.randint(0, 9) if op == "x" else (rng.randint(0, 999) if rng.random() < 0.8 else rng.randint(0, 99))
        value = a + b if op == "+" else (a - b if op == "-" else a * b)
        if aime and not 0 <= value <= 999:
            continue
        if _is_held_out(f"{a}{op}{b}") == held_out:
            return a, op, b


def arithmetic_sample(
    rng: random.Random, held_out: bool, thinking: bool, aime: bool | None = None, operations: str = "+-x"
) -> Sample:
    aime = rng.random() < 0.4 if aime is None else aime
    a, op, b = arithmetic_problem(rng, held_out, aime, operations)
    value = a + b if op == "+" else (a - b if op == "-" else a * b)
    symbol = "x" if op == "x" else op
    phrasings = (f"What is {a} {symbol} {b}?", f"Compute {a} {symbol} {b}.", f"{a} {symbol} {b} = ?",
                 f"Calculate {a} {symbol} {b}", f"How much is {a} {symbol} {b}?")  # fmt: skip
    question = f"What is {a} {symbol} {b}?" if aime else rng.choice(phrasings)
    if aime:
        question = f"{question}\n\n{AIME_INSTRUCTION}"
    working = {"+": add_working, "-": sub_working, "x": mul_working}[op](a, b)
    answer = f"{a} {symbol} {b} = {value}."
    if aime:
        answer += f" The answer is \\boxed{{{value}}}."
    completion = Completion(working, answer) if thinking else Completion(content=f"{working}\n{answer}")
    return Sample("arithmetic", _body([{"role": "user", "content": question}], thinking), completion, value)


# ---- the streams ----------------------------------------------------------------------------------------
def _body(messages: list[dict[str, Any]], thinking: bool, tools: list[dict[str, Any]] | None = None) -> dict:
    body: dict[str, Any] = {"messages": messages, "thinking": {"type": "enabled" if thinking else "disabled"}}
    if tools:
        body["tools"] = tools
    return body


def _samples_of(skill: str, rng: random.Random, held: bool, thinking: bool, world: bool | None = None) -> list:
    """One sample of ``skill`` (two for tools); ``world`` None draws the name style (``WORLD_SHARE``)."""
    names = Names(rng, held, world=rng.random() < WORLD_SHARE if world is None else world)
    if skill == "arithmetic":
        return [arithmetic_sample(rng, held, thinking, operations=TRAINING_OPERATIONS)]
    if skill == "tools":
        return tool_sample(rng, names, thinking)
    if skill == "extraction":
        return [extraction_sample(rng, names, thinking)]
    if skill == "copy":
        return [copy_sample(rng, names, thinking)]
    if skill == "greetings":
        return [greeting_sample(rng, names, thinking)]
    return [unknown_sample(rng, names, thinking)]


def sample_stream(seed: int):
    """An endless deterministic stream of training samples (never a held-out name or operand pair)."""
    rng = random.Random(seed)
    while True:
        skill = rng.choices(SKILLS, SKILL_WEIGHTS)[0]
        yield from _samples_of(skill, rng, False, rng.random() < 0.5)


def training_samples(seed: int, count: int) -> list[Sample]:
    stream = sample_stream(seed)
    return [next(stream) for _ in range(count)]


_CITY_TOOLS = ("get_weather", "get_population")


def _held_out_sample(skill: str, rng: random.Random, thinking: bool) -> list[Sample]:
    if skill == "arithmetic":
        return [arithmetic_sample(rng, True, thinking, aime=True)]
    if skill == "subtraction":
        return [arithmetic_sample(rng, True, thinking, aime=False, operations="-")]
    if skill == "tools":
        return [tool_sample(rng, Names(rng, True), thinking)[0]]
    if skill == "copy_world":
        return [copy_sample(rng, Names(rng, True, world=True), thinking, count=1)]
    if skill == "cities_world":
        return [tool_sample(rng, Names(rng, True, world=True), thinking, tools=_CITY_TOOLS)[0]]
    if skill == "extraction_world":
        return [extraction_sample(rng, Names(rng, True, world=True), thinking)]
    if skill in SKILLS:
        return _samples_of(skill, rng, True, thinking, world=False)
    raise ValueError(f"unknown eval set {skill!r}; choose one of {[*SKILLS, *EVAL_SETS]}")


def held_out(skill: str, count: int, seed: int = 1234, thinking: bool = True) -> list[Sample]:
    """``count`` eval samples of ``skill`` (a skill or one of :data:`EVAL_SETS`) drawn from the held-out names /
    operand pairs only.

    Tool samples are the call turns (the model must choose the function and copy the entity); arithmetic
    samples are in the AIME format with answers in 0-999; subtraction samples are asked plainly, their results
    from -999 to 999; the ``_world`` sets name people and places of many scripts, lengths and shapes, and
    ``copy_world`` asks for one name back.
    """
    rng = random.Random(seed)
    out: list[Sample] = []
    while len(out) < count:
        out.extend(_held_out_sample(skill, rng, thinking))
    return out[:count]
