"""Structured output: spec validation, the xgrammar constraint on a real tokenizer, the sampler's masking,
and generation with the real tiny model that must end in JSON valid for its schema."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.sampling.sampler import Sampler, SamplingState, make_sampling_state
from dsinfer.sampling.structured_output import (
    GrammarConstraint,
    GrammarViolation,
    StructuredOutputCompiler,
    apply_token_bitmask,
)
from dsinfer.sampling_params import SamplingParams, StructuredOutput
from dsinfer.tokenizer import THINK_END_TOKEN, TOKENIZER_FILE, Tokenizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": COLORS}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(directory, vocab_size=512)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> StructuredOutputCompiler:
    return StructuredOutputCompiler(tokenizer)


def _allowed(constraint: GrammarConstraint, vocab_size: int) -> set[int]:
    row = torch.zeros(vocab_size)
    constraint.fill_mask(row)
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def _check_schema_instance(value: object) -> None:
    """What jsonschema would check for SCHEMA (it is not installed): exact keys, enum and type."""
    assert isinstance(value, dict) and set(value) == {"color", "ok"}, value
    assert value["color"] in COLORS and isinstance(value["ok"], bool), value


# --------------------------------------------------------------------------------------------
# StructuredOutput validation
# --------------------------------------------------------------------------------------------


def test_valid_specs_construct_and_travel_in_sampling_params():
    for structured in [
        StructuredOutput("json_schema", SCHEMA),
        StructuredOutput("json_schema", json.dumps(SCHEMA)),
        StructuredOutput("json_object"),
        StructuredOutput("regex", r"\d{3}-[a-z]+"),
        StructuredOutput("grammar", 'root ::= "yes" | "no"'),
    ]:
        assert SamplingParams(structured_output=structured).structured_output is structured
    assert SamplingParams().structured_output is None
    assert StructuredOutput("json_schema", SCHEMA).cache_key == ("json_schema", json.dumps(SCHEMA))


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", {"type": "strin"}, 'invalid JSON schema: Unsupported type "strin"'),
        ("json_schema", {"type": "object", "minProperties": "a"}, "invalid JSON schema: minProperties must be"),
        ("json_schema", {"properties": {"a": {"$ref": "#/nope"}}}, "invalid JSON schema: Cannot find field 'nope'"),
        ("json_schema", '{"type": ', "spec is not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON schema object"),
        ("json_schema", None, "must be a JSON schema"),
        ("json_schema", {"type": {1, 2}}, "not JSON-serialisable"),
        ("json_object", {"type": "object"}, "must be None for kind 'json_object'"),
        ("regex", "a(b", "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
        ("regex", "", "must be a non-empty string"),
        ("grammar", "root ::= foo", 'invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not'),
        ("grammar", 'answer ::= "a"', 'The root rule with name "root" is not found'),
        ("grammar", {"root": "a"}, "must be a non-empty string"),
        ("yaml", "a: 1", "kind must be one of json_schema, json_object, regex, grammar"),
    ],
)
def test_invalid_spec_raises_value_error_naming_the_problem(kind, spec, message):
    with pytest.raises(ValueError, match="structured_output") as info:
        StructuredOutput(kind, spec)
    assert message in str(info.value)
    assert ".cc:" not in str(info.value)  # xgrammar's source location is stripped from the message


def test_sampling_params_rejects_a_structured_output_that_is_not_one():
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"kind": "json_object"})


# --------------------------------------------------------------------------------------------
# Tokenizer info and compiler
# --------------------------------------------------------------------------------------------


def test_tokenizer_info_decodes_like_xgrammars_huggingface_path(tokenizer_dir, tokenizer, compiler):
    """Our raw-vocab TokenizerInfo agrees with xgrammar's own reading of the HF fast tokenizer."""
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / TOKENIZER_FILE))
    reference = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=512, stop_token_ids=[tokenizer.eos_id])
    ours = compiler.tokenizer_info
    assert (ours.vocab_type, ours.add_prefix_space) == (reference.vocab_type, reference.add_prefix_space)
    assert ours.vocab_type == xgr.VocabType.BYTE_LEVEL and not ours.add_prefix_space
    added = set(tokenizer.special_tokens.values())
    for token_id, (mine, theirs) in enumerate(zip(ours.decoded_vocab, reference.decoded_vocab, strict=True)):
        if token_id not in added:
            assert mine == theirs, token_id
    assert ours.decoded_vocab[tokenizer.encode(" the")[0]] == b" the"  # "Ġthe" -> " the"
    # Control tokens are never text for a grammar; eos is the stop token.
    assert set(ours.special_token_ids) == added - {tokenizer.eos_id}
    assert ours.stop_token_ids == [tokenizer.eos_id]


def test_compiled_grammars_are_cached_by_kind_and_spec_in_an_lru(tokenizer):
    compiler = StructuredOutputCompiler(tokenizer, cache_size=2)
    first, second, third = (StructuredOutput("regex", pattern) for pattern in ("a+", "b+", "c+"))
    compiled = compiler.compile(first)
    assert compiler.compile(StructuredOutput("regex", "a+")) is compiled
    compiler.compile(second)
    compiler.compile(first)  # now most recent
    compiler.compile(third)  # evicts second, the least recently used
    assert compiler.cached_keys() == [("regex", "a+"), ("regex", "c+")]
    assert compiler.compile(first) is compiled


def test_padded_model_vocab_never_allows_padding_ids(tokenizer):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size=544)
    constraint = compiler.make_constraint(StructuredOutput("json_object"))
    assert constraint.vocab_size == 544
    allowed = _allowed(constraint, 544)
    assert allowed and max(allowed) < 512


# --------------------------------------------------------------------------------------------
# GrammarConstraint
# --------------------------------------------------------------------------------------------


def test_constraint_walks_a_valid_document_then_allows_only_eos(tokenizer, compiler):
    constraint = compiler.make_constraint(StructuredOutput("json_schema", SCHEMA))
    for token_id in tokenizer.encode('{"color": "green", "ok": false}'):
        allowed = _allowed(constraint, 512)
        assert token_id in allowed and len(allowed) < 512 // 2
        constraint.accept(token_id)
    assert constraint.is_completed() and not constraint.is_terminated()
    assert _allowed(constraint, 512) == {tokenizer.eos_id}
    constraint.accept(tokenizer.eos_id)
    assert constraint.is_terminated()
    assert _allowed(constraint, 512) == {tokenizer.eos_id}  # defensive: a finished grammar offers only eos


def test_control_tokens_are_never_allowed_even_inside_strings(tokenizer, compiler):
    constraint = compiler.make_constraint(StructuredOutput("json_object"))
    control = set(tokenizer.special_tokens.values()) - {tokenizer.eos_id}
    for token_id in tokenizer.encode('{"key": "some text'):
        constraint.accept(token_id)
    allowed = _allowed(constraint, 512)
    assert len(allowed) > 200  # inside a string nearly every text token fits
    assert not allowed & control and tokenizer.eos_id not in allowed


def test_rejected_token_raises_and_leaves_the_state_alone(tokenizer, compiler):
    constraint = compiler.make_constraint(StructuredOutput("grammar", 'root ::= "yes" | "no"'))
    before = _allowed(constraint, 512)
    with pytest.raises(GrammarViolation, match="does not allow"):
        constraint.accept(tokenizer.encode("{")[0])
    assert _allowed(constraint, 512) == before
    for token_id in tokenizer.encode("no"):
        constraint.accept(token_id)
    constraint.accept(tokenizer.eos_id)
    with pytest.raises(GrammarViolation, match="terminated"):
        constraint.accept(tokenizer.encode("no")[0])


def test_regex_constraint(tokenizer, compiler):
    constraint = compiler.make_constraint(StructuredOutput("regex", r"[0-9]{2}"))
    assert all(tokenizer.decode([t]).isdigit() for t in _allowed(constraint, 512))
    for token_id in tokenizer.encode("42"):
        constraint.accept(token_id)
    assert _allowed(constraint, 512) == {tokenizer.eos_id}


def test_start_after_token_leaves_the_sequence_free_until_that_token(tokenizer, compiler):
    think_end = tokenizer.token_to_id(THINK_END_TOKEN)
    constraint = compiler.make_constraint(StructuredOutput("json_object"), start_after_token=think_end)
    logits = torch.randn(512)
    for token_id in tokenizer.encode("Let me think. [not json] <think>"):
        row = logits.clone()
        constraint.fill_mask(row)
        assert torch.equal(row, logits) and not constraint.active
        constraint.accept(token_id)  # anything goes before the start token
    constraint.accept(think_end)
    assert constraint.active and not constraint.is_completed()
    assert {tokenizer.decode([t]) for t in _allowed(constraint, 512)} <= {"{", '{"'}


def test_rollback_restores_earlier_masks_and_the_free_phase(tokenizer, compiler):
    think_end = tokenizer.token_to_id(THINK_END_TOKEN)
    constraint = compiler.make_constraint(StructuredOutput("json_schema", SCHEMA), start_after_token=think_end)
    constraint.accept(tokenizer.encode("x")[0])
    constraint.accept(think_end)
    at_start = _allowed(constraint, 512)
    for token_id in tokenizer.encode('{"color": "red"'):
        constraint.accept(token_id)
    constraint.rollback(len(tokenizer.encode('{"color": "red"')))
    assert _allowed(constraint, 512) == at_start
    constraint.rollback(1)  # the start token itself
    assert not constraint.active and len(_allowed(constraint, 512)) == 512
    with pytest.raises(ValueError, match="cannot roll back 2"):
        constraint.rollback(2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_unpacking_matches_xgrammars_kernel(device, dtype):
    vocab_size = 500  # not a multiple of 32: the last word is partly padding
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31, xgr.get_bitmask_shape(1, vocab_size), dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(vocab_size, generator=generator).to(dtype)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask[0], backend="cpu")
    ours = logits.to(device)
    apply_token_bitmask(ours, bitmask[0])
    assert torch.equal(ours.cpu(), expected)
    assert 0 < torch.isinf(expected).sum() < vocab_size


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


def _constrained_state(compiler, structured, prompt, eos, **params) -> SamplingState:
    params = SamplingParams(structured_output=structured, **params)
    return make_sampling_state(params, prompt, eos, constraint=compiler.make_constraint(structured))


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_masks_constrained_rows_before_filtering_and_leaves_others_alone(tokenizer, compiler, device):
    structured = StructuredOutput("grammar", 'root ::= "yes" | "no"')
    allowed = _allowed(compiler.make_constraint(structured), 512)
    forbidden = tokenizer.encode("{")[0]
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    logits[:, forbidden] = 50.0  # the model's favourite is forbidden
    states = [
        _constrained_state(compiler, structured, [0], tokenizer.eos_id, temperature=0.0),
        _constrained_state(compiler, structured, [0], tokenizer.eos_id, temperature=1.0, seed=3),
        _constrained_state(compiler, structured, [0], tokenizer.eos_id, temperature=1.0, seed=4, top_k=1),
        make_sampling_state(SamplingParams(temperature=1.0, seed=5), [0], tokenizer.eos_id),
    ]
    tokens = [output.token_ids[0] for output in Sampler()(logits.to(device), states)]
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    assert tokens[0] == best_allowed
    assert tokens[1] in allowed
    assert tokens[2] == max(allowed, key=lambda t: logits[2, t].item())  # top-k ran after the mask
    alone = make_sampling_state(SamplingParams(temperature=1.0, seed=5), [0], tokenizer.eos_id)
    assert tokens[3] == Sampler()(logits[3:].to(device), [alone])[0].token_ids[0] == forbidden


@pytest.mark.parametrize("device", DEVICES)
def test_batched_grammar_masks_equal_each_row_masked_alone(tokenizer, compiler, device):
    """One bitmask for the batch: active, terminated, not yet started and unconstrained rows side by side."""
    from dsinfer.sampling.sampler import apply_constraints

    think_end = tokenizer.token_to_id(THINK_END_TOKEN)
    walking = compiler.make_constraint(StructuredOutput("json_schema", SCHEMA))
    for token_id in tokenizer.encode('{"color": "bl'):
        walking.accept(token_id)
    done = compiler.make_constraint(StructuredOutput("regex", r"[0-9]{2}"))
    for token_id in tokenizer.encode("42"):
        done.accept(token_id)
    done.accept(tokenizer.eos_id)
    assert done.is_terminated()
    constraints = [
        compiler.make_constraint(StructuredOutput("json_object")),
        None,
        walking,
        compiler.make_constraint(StructuredOutput("json_object"), start_after_token=think_end),  # inactive
        done,
        compiler.make_constraint(StructuredOutput("grammar", 'root ::= "yes" | "no"')),
    ]
    states = [
        make_sampling_state(SamplingParams(), [0], tokenizer.eos_id, constraint=constraint)
        for constraint in constraints
    ]
    logits = torch.randn(len(states), 512, generator=torch.Generator().manual_seed(2)).to(device)
    expected = logits.clone()
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            constraint.fill_mask(expected[row])
    batched = apply_constraints(logits.clone(), states)
    assert torch.equal(batched, expected)
    assert torch.isfinite(batched[4]).nonzero().flatten().tolist() == [tokenizer.eos_id]
    assert torch.equal(batched[1], logits[1]) and torch.equal(batched[3], logits[3])


def test_a_complete_grammar_ends_the_sequence_despite_min_tokens(tokenizer, compiler):
    structured = StructuredOutput("grammar", 'root ::= "no"')
    state = _constrained_state(compiler, structured, [0], tokenizer.eos_id, temperature=0.0, min_tokens=8)
    for token_id in tokenizer.encode("no"):
        state.constraint.accept(token_id)
        state.output_token_ids.append(token_id)
    logits = torch.randn(1, 512)
    assert Sampler()(logits, [state])[0].token_ids == [tokenizer.eos_id]
    free = make_sampling_state(SamplingParams(temperature=0.0, min_tokens=8), [0], tokenizer.eos_id)
    logits[0, tokenizer.eos_id] = 100.0
    assert Sampler()(logits, [free])[0].token_ids != [tokenizer.eos_id]  # min_tokens still holds elsewhere


# --------------------------------------------------------------------------------------------
# End to end with the real tiny model
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    model = load_model(tiny_checkpoint, progress=False)
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    return model, tokenizer, StructuredOutputCompiler(tokenizer, model.config.vocab_size)


def _generate(model, states, max_steps, eos, bias=None, force=None, must_finish=True) -> None:
    """Run every state to its end (eos, or its grammar terminated), a full forward per step, as the engine
    would: sample, append the token, then advance the constraint. ``force`` maps (row, step) to a token the
    model is made to emit instead (standing in for a thinking model that closes its reasoning)."""
    force = force or {}
    running = list(range(len(states)))
    for step in range(max_steps):
        batch = PackedBatch.from_sequences([states[i].prompt_token_ids + states[i].output_token_ids for i in running])
        with torch.no_grad():
            logits = model(batch, logits_for=batch.last_token_indices())
        if bias is not None:
            logits = logits + bias
        outputs = Sampler()(logits, [states[i] for i in running])
        for i, output in zip(list(running), outputs, strict=True):
            token_id = force.get((i, step), output.token_ids[0])
            states[i].output_token_ids.append(token_id)
            constraint = states[i].constraint
            if constraint is not None:
                constraint.accept(token_id)
            if token_id == eos or (constraint is not None and constraint.is_terminated()):
                running.remove(i)
        if not running:
            return
    if must_finish:
        raise AssertionError(f"rows {running} did not finish within {max_steps} steps")


def _prompt(tokenizer, text="Answer in JSON:") -> list[int]:
    return [tokenizer.bos_id] + tokenizer.encode(text)


def test_end_to_end_json_schema_greedy_and_seeded(tiny):
    model, tokenizer, compiler = tiny
    structured = StructuredOutput("json_schema", SCHEMA)
    states = [  # one request with n=2 would look like the two sampled rows: one constraint each
        _constrained_state(compiler, structured, _prompt(tokenizer), tokenizer.eos_id, temperature=0.0),
        _constrained_state(compiler, structured, _prompt(tokenizer), tokenizer.eos_id, temperature=1.0, seed=0),
        _constrained_state(compiler, structured, _prompt(tokenizer), tokenizer.eos_id, temperature=0.7, seed=1),
    ]
    _generate(model, states, max_steps=90, eos=tokenizer.eos_id)
    texts = set()
    for state in states:
        assert state.output_token_ids[-1] == tokenizer.eos_id and state.constraint.is_terminated()
        text = tokenizer.decode(state.output_token_ids, skip_special_tokens=True)
        _check_schema_instance(json.loads(text))
        texts.add(text)
    assert len(texts) == 3  # the rows really were sampled differently


def test_end_to_end_json_object(tiny):
    """The random model rarely closes a string, so the loop favours every token holding '"' or '}'; that
    pushes towards invalid JSON as often as valid, and only the grammar keeps the output well-formed."""
    model, tokenizer, compiler = tiny
    closing = torch.tensor([any(c in tokenizer.decode([t]) for c in '"}') for t in range(512)])
    structured = StructuredOutput("json_object")
    states = [
        _constrained_state(compiler, structured, _prompt(tokenizer), tokenizer.eos_id, temperature=0.0),
        _constrained_state(compiler, structured, _prompt(tokenizer), tokenizer.eos_id, temperature=1.0, seed=0),
    ]
    _generate(model, states, max_steps=60, eos=tokenizer.eos_id, bias=10.0 * closing)
    for state in states:
        assert state.constraint.is_terminated()
        assert isinstance(json.loads(tokenizer.decode(state.output_token_ids, skip_special_tokens=True)), dict)


def test_end_to_end_start_after_think_end(tiny):
    """Thinking mode: free text until </think>, then JSON. An unconstrained twin shows the free part is
    exactly what the model writes without any constraint."""
    model, tokenizer, compiler = tiny
    think_end = tokenizer.token_to_id(THINK_END_TOKEN)
    structured = StructuredOutput("json_schema", SCHEMA)
    params = SamplingParams(temperature=0.0, structured_output=structured)
    constraint = compiler.make_constraint(structured, start_after_token=think_end)
    thinking = make_sampling_state(params, _prompt(tokenizer), tokenizer.eos_id, constraint=constraint)
    twin = make_sampling_state(SamplingParams(temperature=0.0), _prompt(tokenizer), tokenizer.eos_id)
    free_steps = 6
    _generate(
        model,
        [thinking, twin],
        max_steps=free_steps,
        eos=tokenizer.eos_id,
        force={(0, free_steps - 1): think_end},
        must_finish=False,
    )
    assert thinking.output_token_ids[: free_steps - 1] == twin.output_token_ids[: free_steps - 1]
    free_text = tokenizer.decode(thinking.output_token_ids[: free_steps - 1])
    assert not free_text.lstrip().startswith("{")  # the free part was not JSON: the mask really was off
    assert constraint.active
    _generate(model, [thinking], max_steps=90, eos=tokenizer.eos_id)
    answer = thinking.output_token_ids[thinking.output_token_ids.index(think_end) + 1 :]
    _check_schema_instance(json.loads(tokenizer.decode(answer, skip_special_tokens=True)))
