"""The default model's training pipeline: corpus, rendering through the server's chat format, a toy run on CPU.

A rendered completion must parse back (through the server's own output parser) into exactly the turn the
corpus meant: reasoning, content, tool calls with their arguments. A toy model trained for a few steps must
lower its loss and load through the normal loader in the release formats.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from dataclasses import replace

import deepseek_recipe as recipe
import pytest
import torch

from dsinfer.chat.format import ChatFormat
from dsinfer.chat.stream import ChoiceStream
from dsinfer.engine.outputs import CompletionOutput
from dsinfer.models.expert_packing import dequantized_state_dict
from dsinfer.models.loader import CheckpointError, load_model
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.tokenizer import Tokenizer
from dsinfer.training import corpus, world_names
from dsinfer.training.render import SampleRenderer
from dsinfer.training.trainer import PRESETS, RESUME_FILE, train


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> SampleRenderer:
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(directory, vocab_size=1024, digit_group=1)
    return SampleRenderer(ChatFormat(Tokenizer.from_dir(directory), "v41", "default"))


def _parsed_message(renderer: SampleRenderer, sample: corpus.Sample) -> dict:
    chat_format = renderer.chat_format
    prepared = chat_format.prepare("chat", sample.body)
    prompt, completion = renderer.encode(sample)
    assert prompt == prepared.prompt_ids
    assert completion[-1] == chat_format.tokenizer.eos_id
    ids = completion[:-1]  # the engine stops at eos and does not hand it to the parser
    generator = recipe.ChatCompletionRequest.chunk_generator(prepared.request, "m", "m")
    response = recipe.ChatCompletionResponse("m", "m", 0, len(prompt), 0)
    output = CompletionOutput(0, chat_format.tokenizer.decode(ids), ids, "stop")
    for event in ChoiceStream(chat_format, prepared, generator).push(output):
        response.accumulate(event)
    return json.loads(response.to_json())["choices"][0]["message"]


@pytest.mark.parametrize("thinking", [False, True])
def test_rendered_turns_parse_back_into_the_intended_message(renderer, thinking):
    samples = [s for s in corpus.training_samples(7, 160) if s.thinking == thinking]
    assert {s.skill for s in samples} == set(corpus.SKILLS)
    for sample in samples:
        message = _parsed_message(renderer, sample)
        completion = sample.completion
        assert (message.get("reasoning_content") or "") == (completion.reasoning if thinking else "")
        if completion.tool_calls:
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
            assert calls == [(c["name"], c["arguments"]) for c in completion.tool_calls]
        else:
            assert message["content"] == completion.content
            assert not message.get("tool_calls")


def test_held_out_names_and_problems_never_reach_training():
    training = corpus.training_samples(3, 3000)
    trained_texts = "\n".join(json.dumps(s.body) for s in training)
    for skill in ("tools", "extraction"):
        for sample in corpus.held_out(skill, 20):
            values = sample.expected["arguments"] if skill == "tools" else sample.expected
            for name in (v for v in values.values() if isinstance(v, str) and v not in corpus.UNITS):
                assert name not in trained_texts, f"held-out {name!r} appears in training"
    trained_questions = {s.body["messages"][0]["content"] for s in training if s.skill == "arithmetic"}
    for sample in corpus.held_out("arithmetic", 50):
        assert 0 <= sample.expected <= 999
        assert sample.body["messages"][0]["content"] not in trained_questions


def test_the_new_held_out_sets_never_reach_training():
    """Names of other scripts and lengths, cities and people of the world, and subtraction pairs: none of the
    eval sets' names is a name of a training chat (nor, from eight bytes on, anywhere in a training chat's
    text), and no subtraction pair was trained on, in either order of asking."""
    training = corpus.training_samples(3, 3000)
    trained_names = {name for sample in training for name in sample.names}
    trained_texts = "\n".join(json.dumps(s.body, ensure_ascii=False) + s.completion.content for s in training)
    assert sum(len(name.encode()) > len(name) for name in trained_names) > 500  # other scripts are trained
    for eval_set in ("copy_world", "cities_world", "extraction_world"):
        for thinking in (True, False):
            for sample in corpus.held_out(eval_set, 40, seed=11, thinking=thinking):
                assert sample.names and not set(sample.names) & trained_names, sample.names
                for name in (n for n in sample.names if len(n.encode()) >= 8):
                    assert name not in trained_texts, f"held-out {name!r} appears in training"
    pair = re.compile(r"(\d+) ([-+x]) (\d+)")
    trained_pairs = {
        pair.search(s.body["messages"][0]["content"]).groups() for s in training if s.skill == "arithmetic"
    }
    held = corpus.held_out("subtraction", 60) + corpus.held_out("subtraction", 30, seed=99, thinking=False)
    for sample in held:
        a, op, b = pair.search(sample.body["messages"][0]["content"]).groups()
        assert op == "-" and (a, op, b) not in trained_pairs and sample.expected == int(a) - int(b)
    assert sum(sample.expected < 0 for sample in held) >= len(held) // 3


def test_world_names_cover_scripts_and_lengths_within_their_limits():
    names = corpus.held_out("copy_world", 400, seed=5)
    texts = [sample.expected for sample in names]
    assert min(map(len, texts)) == 1 and max(map(len, texts)) >= 30
    assert all(len(t) <= world_names.MAX_CHARACTERS and len(t.encode()) <= world_names.MAX_UTF8_BYTES for t in texts)
    first_letters = {unicodedata.name(t[0]).split()[0] for t in texts}
    assert {"LATIN", "CYRILLIC", "GREEK", "CJK", "ARABIC", "HEBREW", "DEVANAGARI", "HANGUL"} <= first_letters
    assert sum(" " in t for t in texts) > 40


def test_subtraction_working_ends_with_the_signed_result():
    rng = random.Random(1)
    for _ in range(300):
        a, op, b = corpus.arithmetic_problem(rng, held_out=False, operations="-")
        last = corpus.sub_working(a, b).splitlines()[-1]
        assert last.endswith(f"{a} - {b} = {a - b}"), (a, b, last)


def test_subtraction_working_names_the_larger_number_first():
    """The comparison ends on the larger number, and the plan subtracts the smaller from it."""
    rng = random.Random(2)
    problems = [corpus.arithmetic_problem(rng, held_out=False, operations="-") for _ in range(300)]
    for a, b in [*((a, b) for a, _, b in problems), (5, 5), (752, 702), (7, 12), (90, 9)]:
        first = corpus.sub_working(a, b).splitlines()[0]
        compared, plan = first.rsplit(". ", 1)
        if a == b:
            assert compared.endswith("so the numbers are equal"), first
        else:
            assert compared.endswith(f"so {max(a, b)} is larger"), first
        assert plan == (f"I subtract column by column: {a} - {b}." if a >= b else f"I compute {b} - {a} and negate it.")


def test_every_digit_relation_follows_both_digits():
    """Each comparison place and each subtraction column writes its two digits, then their true relation."""
    rng = random.Random(3)
    relation = re.compile(r"(-?\d) and (\d), (?:(equal)|(-?\d) is (more|less|not less))")
    problems = [corpus.arithmetic_problem(rng, held_out=False, operations="-") for _ in range(300)]
    for a, b in [*((a, b) for a, _, b in problems), (5, 5), (752, 702), (100, 99), (1000, 1)]:
        first, *columns, _ = corpus.sub_working(a, b).splitlines()
        relations = relation.findall(first)
        assert (len(relations) > 0) == (len(str(a)) == len(str(b))), first
        for line in columns:
            found = relation.findall(line)
            assert len(found) == 1 and not found[0][2], line
            relations += found
        for x, y, equal, repeated, word in relations:
            x, y = int(x), int(y)
            assert (x == y) if equal else (int(repeated) == x and (word == "less") == (x < y)), (a, b, x, y, word)
            assert word != "more" or x > y, (a, b, x, y, word)


def test_column_working_spells_the_true_result():
    """Reading the digits the working writes gives the exact result: copying the working is computing."""
    rng = random.Random(0)
    workings = {"+": corpus.add_working, "-": corpus.sub_working, "x": corpus.mul_working}
    for _ in range(500):
        a, op, b = corpus.arithmetic_problem(rng, held_out=False)
        columns = [line for line in workings[op](a, b).splitlines() if line.split(":")[0] in corpus.PLACES]
        if op == "-":
            digits, value = [line.rsplit("= ", 1)[1] for line in columns], abs(a - b)
        else:
            digits = [line.split("write ")[1].split(",")[0].replace("the carry ", "") for line in columns]
            value = a + b if op == "+" else a * b
        assert int("".join(reversed(digits))) == value, (a, op, b)


def test_a_toy_model_trains_and_loads_through_the_normal_loader(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = replace(PRESETS["toy"], steps=3, batch_tokens=700, rounding_phase=0.34, log_every=1)
        result = train(tmp_path, settings, device="cpu", log=lambda message: None)
    finally:
        torch.set_num_threads(threads)
    losses = [record["loss"] for record in result.history]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "draft_loss" in result.history[0]
    model = load_model(tmp_path, progress=False)
    assert type(model).__name__ == "DeepseekV41" and model.fake_quantization
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.0.attn.wq_a.scale" in index  # FP8 blocks with their scales
    assert any(name.endswith("experts.0.w1.scale") for name in index)  # packed FP4 experts
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["settings"]["steps"] == 3 and len(record["history"]) == 3


def test_a_run_stopped_at_its_time_limit_resumes_into_the_uninterrupted_run(tmp_path):
    """Stop after the first step, resume: the same losses and the same exported weights as one whole run (the
    rounding phase starts after the stop, so the resumed part also switches it on)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = replace(PRESETS["toy"], steps=3, batch_tokens=600, rounding_phase=0.34, log_every=1)
        whole = train(tmp_path / "whole", settings, device="cpu", log=lambda message: None)
        first = train(tmp_path / "split", replace(settings, time_limit_s=0.0), device="cpu", log=lambda m: None)
        assert len(first.history) == 1 and (tmp_path / "split" / RESUME_FILE).exists()
        rest = train(tmp_path / "split", settings, device="cpu", log=lambda message: None, resume=True)
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "split" / RESUME_FILE).exists()
    assert [r["loss"] for r in rest.history] == [r["loss"] for r in whole.history]
    for shard in sorted((tmp_path / "whole").glob("*.safetensors")):
        assert shard.read_bytes() == (tmp_path / "split" / shard.name).read_bytes(), shard.name


def _float_weights(model) -> dict:
    """Every weight as the values it stands for (Engram rows: FP8 codes times their per-32 scales)."""
    state = dequantized_state_dict(model)
    for name in [n for n in state if n.endswith("engram.embed.weight")]:
        scale = state.pop(name[: -len("weight")] + "scale").float()
        state[name] = state[name].float() * scale.repeat_interleave(32, -1)
    return {name: value.float() for name, value in state.items()}


def test_a_run_started_from_a_checkpoint_keeps_its_weights_and_tokenizer(tmp_path):
    """``init_from`` fills the master weights from the release files (FP8 / FP4 dequantised): a run of zero
    steps exports the weights it started from exactly (a block whose largest code rounded down may come back
    with half the scale and twice the codes: the same values), and one step trains from there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = replace(PRESETS["toy"], steps=2, batch_tokens=600, rounding_phase=0.5, log_every=1)
        train(tmp_path / "base", settings, device="cpu", log=lambda message: None)
        again = replace(settings, steps=0, init_from=str(tmp_path / "base"), vocab_size=512)
        train(tmp_path / "same", again, device="cpu", log=lambda message: None)
        tuned = train(tmp_path / "tuned", replace(again, steps=1), device="cpu", log=lambda message: None)
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "base" / "tokenizer.json").read_bytes() == (tmp_path / "same" / "tokenizer.json").read_bytes()
    base, same = (_float_weights(load_model(tmp_path / n, progress=False)) for n in ("base", "same"))
    assert base.keys() == same.keys()
    for name, value in base.items():
        assert torch.equal(value, same[name]), name
    assert len(tuned.history) == 1 and load_model(tmp_path / "tuned", progress=False).config == tuned.config


def test_a_checkpoint_of_other_widths_is_refused_by_name(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = replace(PRESETS["toy"], steps=1, batch_tokens=500, log_every=1)
        train(tmp_path / "base", settings, device="cpu", log=lambda message: None)
        wider = replace(settings, init_from=str(tmp_path / "base"), widths={**settings.widths, "hidden_size": 64})
        with pytest.raises(CheckpointError, match="hidden_size"):
            train(tmp_path / "wider", wider, device="cpu", log=lambda message: None)
    finally:
        torch.set_num_threads(threads)
