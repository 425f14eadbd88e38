"""Tests of ingest.records: record kinds, the chat loss mask, ids, metadata, truncation, errors."""

from __future__ import annotations

import json
import re

import pytest

from eogp_index.errors import ConfigError, InputError
from ingest.records import (
    IGNORE_INDEX,
    Example,
    RecordSpec,
    Rejected,
    iter_examples,
    stable_id,
    tokenize_record,
)

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": " Cats and dogs!\nHa ha."},
]


def _tok(record, tokenizer, spec=RecordSpec(), shard="s.jsonl", position=0) -> Example:
    return tokenize_record(record, shard=shard, position=position, spec=spec, tokenizer=tokenizer)


def _spans(labels) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of labelled (!= -100) positions."""
    spans, start = [], None
    for index, label in enumerate(list(labels) + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = index
        elif label == IGNORE_INDEX and start is not None:
            spans.append((start, index))
            start = None
    return spans


# --- text -------------------------------------------------------------------------------


def test_text_labels_every_token_and_keeps_tokenizer_default_specials(tokenizer):
    example = _tok({"text": "hello world, how are you today?"}, tokenizer)
    expected = tokenizer("hello world, how are you today?")["input_ids"]
    assert expected[0] == tokenizer.bos_token_id  # the tiny tokenizer adds BOS, not EOS
    assert example.input_ids == tuple(expected)
    assert example.labels == example.input_ids
    assert example.num_tokens == len(expected)
    assert example.num_loss_tokens == len(expected) - 1  # labels[0] is never predicted
    assert example.truncated is False
    assert tokenizer.decode(example.input_ids[1:]) == "hello world, how are you today?"


# --- chat -------------------------------------------------------------------------------


def test_chat_loss_mask_covers_exactly_assistant_turns_and_eos(tokenizer):
    example = _tok({"messages": CHAT}, tokenizer)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    full = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert example.input_ids == tuple(full)
    assert len(example.labels) == len(example.input_ids)

    # Token by token: a labelled position carries its own token id, the rest are -100.
    for token, label in zip(example.input_ids, example.labels):
        assert label in (token, IGNORE_INDEX)

    spans = _spans(example.labels)
    assistants = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    for (start, end), content in zip(spans, assistants):
        decoded = tokenizer.decode(example.input_ids[start:end], skip_special_tokens=False)
        assert decoded == content + tokenizer.eos_token
        assert example.input_ids[end - 1] == tokenizer.eos_token_id
        # The turn header (role marker + newline) just before the span is not labelled.
        header = tokenizer.decode(example.input_ids[start - 2 : start], skip_special_tokens=False)
        assert header == "<|assistant|>\n"

    # Everything outside the spans decodes to the prompt parts of the conversation.
    outside = [t for t, label in zip(example.input_ids, example.labels) if label == IGNORE_INDEX]
    text_outside = tokenizer.decode(outside, skip_special_tokens=False)
    for message in CHAT:
        if message["role"] != "assistant":
            assert message["content"] in text_outside
    for content in assistants:
        assert content.strip() not in text_outside

    assert example.num_loss_tokens == sum(end - start for start, end in spans)


def test_chat_end_of_turn_tokens_written_after_eos_are_labelled(tokenizer_factory):
    # Real Tülu writes eos + "\n" after an assistant turn: both belong to the turn.
    template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token + '\n' }}{% else %}{{ '\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    tokenizer = tokenizer_factory(template)
    example = _tok({"messages": CHAT}, tokenizer)
    spans = _spans(example.labels)
    decoded = [tokenizer.decode(example.input_ids[s:e], skip_special_tokens=False) for s, e in spans]
    assert decoded == [m["content"] + "</s>\n" for m in CHAT if m["role"] == "assistant"]


def test_chat_without_assistant_turn_has_no_loss_tokens(tokenizer):
    record = {"messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(InputError, match=r"s\.jsonl:1: .*no loss tokens.*no assistant turn"):
        _tok(record, tokenizer)


def test_chat_starting_with_assistant_is_rejected(tokenizer):
    record = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}
    with pytest.raises(InputError, match=r"messages\[0\].*starts with an assistant"):
        _tok(record, tokenizer)


def test_chat_template_breaking_prefix_property_is_rejected(tokenizer_factory):
    # Earlier assistant turns are rendered differently from the last one (as templates that
    # strip old reasoning do), so a turn's tokens are not a prefix of the full conversation.
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[earlier]{% else %}{{ m['content'] }}{% endif %}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tokenizer = tokenizer_factory(template)
    with pytest.raises(InputError, match=r"s\.jsonl:5: .*'messages'.*not prefix-stable at assistant message 2"):
        _tok({"messages": CHAT}, tokenizer, position=4)


def test_chat_needs_a_chat_template(tokenizer_factory):
    tokenizer = tokenizer_factory(None)
    with pytest.raises(ConfigError, match="no chat template; pass a tokenizer with one"):
        _tok({"messages": CHAT}, tokenizer)


def test_chat_template_exception_becomes_input_error(tokenizer_factory):
    tokenizer = tokenizer_factory("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InputError, match="roles must alternate"):
        _tok({"messages": CHAT}, tokenizer)


def test_chat_truncation_keeps_the_mask_aligned(tokenizer):
    full = _tok({"messages": CHAT}, tokenizer)
    second_start = _spans(full.labels)[1][0]
    cut = second_start + 3  # in the middle of the second assistant turn
    example = _tok({"messages": CHAT}, tokenizer, spec=RecordSpec(max_tokens=cut))
    assert example.truncated is True
    assert example.num_tokens == cut
    assert example.input_ids == full.input_ids[:cut]
    assert example.labels == full.labels[:cut]
    assert example.num_loss_tokens == sum(1 for label in full.labels[1:cut] if label != IGNORE_INDEX)


def test_truncation_removing_every_loss_token_is_rejected(tokenizer):
    full = _tok({"messages": CHAT}, tokenizer)
    first_start = _spans(full.labels)[0][0]
    with pytest.raises(InputError, match=rf"no loss tokens \(after truncation to max_tokens={first_start}"):
        _tok({"messages": CHAT}, tokenizer, spec=RecordSpec(max_tokens=first_start))


def test_text_truncation_keeps_first_tokens(tokenizer):
    full = _tok({"text": "the quick brown fox jumps over the lazy dog"}, tokenizer)
    example = _tok(
        {"text": "the quick brown fox jumps over the lazy dog"},
        tokenizer,
        spec=RecordSpec(max_tokens=4),
    )
    assert (example.num_tokens, example.num_loss_tokens, example.truncated) == (4, 3, True)
    assert example.input_ids == full.input_ids[:4]
    at_limit = _tok({"text": "hello"}, tokenizer, spec=RecordSpec(max_tokens=full.num_tokens))
    assert at_limit.truncated is False


# --- pre-tokenized ----------------------------------------------------------------------


def test_pretokenized_with_labels(tokenizer):
    record = {"input_ids": [1, 10, 11, 12, 13], "labels": [1, -100, -100, 12, 13]}
    example = _tok(record, tokenizer)
    assert example.input_ids == (1, 10, 11, 12, 13)
    assert example.labels == (1, -100, -100, 12, 13)
    assert example.num_tokens == 5
    assert example.num_loss_tokens == 2  # labels[0] does not count


def test_pretokenized_default_labels_and_truncation(tokenizer):
    example = _tok({"input_ids": [1, 10, 11, 12, 13]}, tokenizer, spec=RecordSpec(max_tokens=3))
    assert example.labels == example.input_ids == (1, 10, 11)
    assert (example.num_loss_tokens, example.truncated) == (2, True)


def test_pretokenized_label_only_at_position_zero_has_no_loss(tokenizer):
    with pytest.raises(InputError, match="no loss tokens"):
        _tok({"input_ids": [1, 10, 11], "labels": [1, -100, -100]}, tokenizer)


# --- ids --------------------------------------------------------------------------------


def test_stable_id_is_deterministic_and_position_sensitive():
    a = stable_id("train.jsonl", 3, '{"text":"x"}')
    assert a == stable_id("train.jsonl", 3, b'{"text":"x"}')
    assert re.fullmatch(r"[0-9a-f]{24}", a)
    assert a != stable_id("train.jsonl", 4, '{"text":"x"}')
    assert a != stable_id("other.jsonl", 3, '{"text":"x"}')
    assert a != stable_id("train.jsonl", 3, '{"text":"y"}')
    assert stable_id("a1", 2, "") != stable_id("a", 12, "")


def test_example_ids_from_content_or_id_field(tokenizer):
    first = _tok({"text": "hello world"}, tokenizer, position=7)
    again = _tok({"text": "hello world"}, tokenizer, position=7)
    assert first.id == again.id
    assert _tok({"text": "hello world"}, tokenizer, position=8).id != first.id
    assert _tok({"text": "hello world!"}, tokenizer, position=7).id != first.id
    # Metadata is not part of the content hash.
    assert _tok({"text": "hello world", "other": 1}, tokenizer, position=7).id == first.id

    spec = RecordSpec(id_field="doc_id")
    assert _tok({"text": "hello", "doc_id": "abc-1"}, tokenizer, spec=spec).id == "abc-1"
    assert _tok({"text": "hello", "doc_id": 42}, tokenizer, spec=spec).id == "42"
    with pytest.raises(InputError, match=r"s\.jsonl:1: missing id field 'doc_id'"):
        _tok({"text": "hello"}, tokenizer, spec=spec)
    with pytest.raises(InputError, match=r"field 'doc_id': an id must be"):
        _tok({"text": "hello", "doc_id": 1.5}, tokenizer, spec=spec)


# --- metadata ---------------------------------------------------------------------------


def test_metadata_typed_values_preserved(tokenizer, jsonl_writer, tmp_path):
    spec = RecordSpec(metadata_fields=("source", "year", "score", "clean"))
    path = jsonl_writer(
        tmp_path / "meta.jsonl",
        [
            {"text": "hello world", "source": "web", "year": 2021, "score": 0.5, "clean": True},
            {"text": "hello you", "source": "books", "year": 1999, "score": 2, "clean": False},
        ],
    )
    first, second = list(iter_examples([path], spec, tokenizer))
    assert first.metadata == {"source": "web", "year": 2021, "score": 0.5, "clean": True}
    assert [type(v) for v in first.metadata.values()] == [str, int, float, bool]
    # An int in a float field is promoted (documented); the types stay column-consistent.
    assert second.metadata == {"source": "books", "year": 1999, "score": 2.0, "clean": False}
    assert [type(v) for v in second.metadata.values()] == [str, int, float, bool]


@pytest.mark.parametrize(
    ("second", "pattern"),
    [
        ({"year": 2.5}, r"'year'.*is float, but the field is int .*meta\.jsonl:1.*write the first value as a float"),
        ({"year": "2021"}, r"'year'.*is str, but the field is int"),
        ({"year": True}, r"'year'.*is bool, but the field is int"),
    ],
)
def test_metadata_type_must_match_earlier_records(tokenizer, jsonl_writer, tmp_path, second, pattern):
    spec = RecordSpec(metadata_fields=("year",))
    path = jsonl_writer(tmp_path / "meta.jsonl", [{"text": "hello", "year": 2021}, {"text": "hello", **second}])
    with pytest.raises(InputError, match=rf"meta\.jsonl:2: .*{pattern}"):
        list(iter_examples([path], spec, tokenizer))


def test_rejected_metadata_does_not_fix_the_field_type(tokenizer, jsonl_writer, tmp_path):
    spec = RecordSpec(metadata_fields=("year",))
    path = jsonl_writer(
        tmp_path / "meta.jsonl",
        [{"year": "bad, no content"}, {"text": "hello", "year": 2021}, {"text": "x", "year": 5}],
    )
    out = list(iter_examples([path], spec, tokenizer, on_error="skip"))
    assert [type(o) for o in out] == [Rejected, Example, Example]


# --- prompt-completion ------------------------------------------------------------------


def test_prompt_completion_text_labels_the_completion_only(tokenizer):
    example = _tok({"prompt": "what is the capital of france?", "completion": " paris is the capital"}, tokenizer)
    prompt = tokenizer("what is the capital of france?")["input_ids"]
    whole = tokenizer("what is the capital of france? paris is the capital")["input_ids"]
    assert example.input_ids == tuple(whole)
    assert example.labels == tuple([IGNORE_INDEX] * len(prompt) + whole[len(prompt) :])
    assert tokenizer.decode(example.input_ids[len(prompt) :]) == " paris is the capital"
    assert example.num_loss_tokens == len(whole) - len(prompt)
    assert example.content_kind == "completion"


def test_prompt_completion_messages_label_what_follows_the_generation_prompt(tokenizer):
    prompt, completion = CHAT[:2], [CHAT[2]]
    example = _tok({"prompt": prompt, "completion": completion}, tokenizer)
    chat = _tok({"messages": prompt + completion}, tokenizer)
    assert example.input_ids == chat.input_ids
    assert example.labels == chat.labels  # one assistant turn: the same mask as the chat record's


def test_prompt_that_merges_with_its_completion_is_rejected(tokenizer):
    # "hel" + "lo" tokenizes as "hello": the prompt's tokens are not a prefix of the whole's.
    with pytest.raises(InputError, match=r"field 'completion': the tokens of the prompt alone are not a prefix"):
        _tok({"prompt": "hel", "completion": "lo world"}, tokenizer)


def test_prompt_completion_round_trips_through_its_stored_text(tokenizer):
    from eogp_index.store.stored_index import _record_from_text

    spec = RecordSpec(prompt_field="question", completion_field="answer")
    example = _tok({"question": CHAT[:2], "answer": [CHAT[2]]}, tokenizer, spec=spec)
    again = _tok(_record_from_text(example.display_text, example.content_kind, spec), tokenizer, spec=spec)
    assert again.content_sha256 == example.content_sha256 and again.labels == example.labels


@pytest.mark.parametrize(
    "record",
    [
        {"text": "hello world"},
        {"messages": CHAT},
        {"prompt": "hello", "completion": " world"},
        {"prompt": CHAT[:2], "completion": [CHAT[2]]},
        {"input_ids": [5, 6, 7]},
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
    ],
    ids=["text", "chat", "completion", "completion-chat", "ids", "ids-labels"],
)
def test_record_content_hashes_as_the_tokenized_example(tokenizer, record):
    from eogp_index.data.records import content_sha256, record_content

    assert (
        content_sha256(record_content(record | {"source": "x"}, RecordSpec())) == _tok(record, tokenizer).content_sha256
    )


def test_text_record_may_carry_a_prompt_field():
    from eogp_index.data.records import tokenize_record as tokenize

    example = tokenize(
        {"input_ids": [1, 2, 3], "prompt": "kept as an ordinary field"},
        shard="s",
        position=0,
        spec=RecordSpec(),
        tokenizer=None,
    )
    assert example.content_kind == "tokens"


# --- spec validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"text_field": ""}, "text_field must be a non-empty string"),
        ({"messages_field": "text"}, "content fields must be distinct"),
        ({"completion_field": "prompt"}, "content fields must be distinct"),
        ({"id_field": ""}, "id_field must be None or a non-empty string"),
        ({"id_field": "text"}, "id_field 'text' is also a content field"),
        ({"metadata_fields": "source"}, "metadata_fields must be a tuple"),
        ({"metadata_fields": ("a", "a")}, r"lists \['a'\] more than once"),
        ({"metadata_fields": ("labels",)}, "which is a content field"),
        ({"max_tokens": 1}, "max_tokens must be None or an int >= 2"),
        ({"max_tokens": True}, "max_tokens must be None or an int >= 2"),
    ],
)
def test_record_spec_validation(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RecordSpec(**kwargs)


def test_record_spec_accepts_a_list_of_metadata_fields():
    assert RecordSpec(metadata_fields=["a", "b"]).metadata_fields == ("a", "b")


def test_iter_examples_rejects_bad_on_error(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="on_error"):
        next(iter_examples([tmp_path], RecordSpec(), tokenizer, on_error="ignore"))  # type: ignore[arg-type]


# --- bad records through a real shard, raise and skip -----------------------------------

GOOD_FIRST = {"text": "hello world", "doc_id": "g1", "lang": "en"}
GOOD_LAST = {"text": "the lazy dog", "doc_id": "g2", "lang": "fr"}

BAD_RECORDS = [
    (
        "missing",
        {"doc_id": "b", "lang": "en", "title": "x"},
        r"missing content: the record has none of the fields 'text', 'messages', 'input_ids'",
    ),
    (
        "two content fields",
        {"text": "a", "input_ids": [1, 2], "doc_id": "b", "lang": "en"},
        r"more than one content field: \['text', 'input_ids'\]",
    ),
    ("text not str", {"text": 5, "doc_id": "b", "lang": "en"}, r"field 'text': expected a string, got int"),
    ("messages not list", {"messages": "hi", "doc_id": "b", "lang": "en"}, r"field 'messages': expected a list"),
    (
        "message content",
        {"messages": [{"role": "user", "content": None}], "doc_id": "b", "lang": "en"},
        r"field 'messages\[0\]\.content': expected a string, got null",
    ),
    (
        "message no role",
        {"messages": [{"content": "x"}], "doc_id": "b", "lang": "en"},
        r"field 'messages\[0\]\.role': expected a non-empty string",
    ),
    (
        "message not object",
        {"messages": ["x"], "doc_id": "b", "lang": "en"},
        r"field 'messages\[0\]': expected an object",
    ),
    (
        "input_ids not ints",
        {"input_ids": [1, "2"], "doc_id": "b", "lang": "en"},
        r"field 'input_ids': expected a list of ints, item 1 is str",
    ),
    (
        "input_ids out of range",
        {"input_ids": [1, 99999], "doc_id": "b", "lang": "en"},
        r"field 'input_ids': item 1 is 99999, outside the tokenizer's ids",
    ),
    (
        "labels mismatch",
        {"input_ids": [1, 2, 3], "labels": [1, 2], "doc_id": "b", "lang": "en"},
        r"field 'labels': 2 labels for 3 'input_ids'",
    ),
    (
        "labels with text",
        {"text": "a b", "labels": [1], "doc_id": "b", "lang": "en"},
        r"field 'labels' is only allowed with 'input_ids'",
    ),
    ("empty text", {"text": "", "doc_id": "b", "lang": "en"}, r"field 'text': empty document"),
    ("empty input_ids", {"input_ids": [], "doc_id": "b", "lang": "en"}, r"field 'input_ids': empty document"),
    ("one token", {"input_ids": [5], "doc_id": "b", "lang": "en"}, r"no loss tokens \(a single token"),
    (
        "no assistant",
        {"messages": [{"role": "user", "content": "hi"}], "doc_id": "b", "lang": "en"},
        r"field 'messages': no loss tokens",
    ),
    ("prompt alone", {"prompt": "a", "doc_id": "b", "lang": "en"}, r"field 'prompt' without 'completion'"),
    ("completion alone", {"completion": "a", "doc_id": "b", "lang": "en"}, r"field 'completion' without 'prompt'"),
    (
        "prompt and completion of two kinds",
        {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}], "doc_id": "b", "lang": "en"},
        r"fields \['prompt', 'completion'\]: expected two strings or two lists of messages, got str and list",
    ),
    (
        "empty completion",
        {"prompt": "a", "completion": "", "doc_id": "b", "lang": "en"},
        r"field 'completion': empty completion",
    ),
    (
        "metadata list in a str field",
        {"text": "a", "doc_id": "b", "lang": ["en"]},
        r"field 'lang': metadata value \['en'\] is a list of str, but the field is str",
    ),
    (
        "metadata nested",
        {"text": "a", "doc_id": "b", "lang": {"en": 1}},
        r"field 'lang': metadata values must be str, int, float, bool, null or a list of these, got dict",
    ),
    (
        "metadata list of lists",
        {"text": "a", "doc_id": "b", "lang": [["en"]]},
        r"field 'lang': a metadata list holds str, int, float, bool or null items, item 0 is list",
    ),
    (
        "metadata surrogate",
        {"text": "a", "doc_id": "b", "lang": "e\ud800n"},
        r"field 'lang': character 1 is U\+D800, a lone UTF-16 surrogate",
    ),
    ("text surrogate", {"text": "ab\udc00", "doc_id": "b", "lang": "en"}, r"field 'text': character 2 is U\+DC00"),
    ("id surrogate", {"text": "a", "doc_id": "\ud83d", "lang": "en"}, r"field 'doc_id': character 0 is U\+D83D"),
    (
        "chat surrogate",
        {
            "messages": [{"role": "user", "content": "\udfff"}, {"role": "assistant", "content": "b"}],
            "doc_id": "b",
            "lang": "en",
        },
        r"field 'messages\[0\]\.content': character 0 is U\+DFFF",
    ),
    (
        "metadata wrong type",
        {"text": "a", "doc_id": "b", "lang": 3},
        r"field 'lang': metadata value 3 is int, but the field is str",
    ),
    (
        "duplicate id",
        {"text": "again", "doc_id": "g1", "lang": "en"},
        r"duplicate id 'g1': already used by the record at bad\.jsonl:1",
    ),
    ("malformed json", '{"text": "unterminated', r"malformed JSON"),
    ("json not object", "[1, 2, 3]", r"line is a JSON list, not an object"),
]


@pytest.mark.parametrize(("case", "bad", "pattern"), BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_bad_record_raises_with_location(tokenizer, jsonl_writer, tmp_path, case, bad, pattern):
    spec = RecordSpec(id_field="doc_id", metadata_fields=("lang",))
    # Line 3 is blank: the bad record sits on line 4 (blank lines still count).
    path = jsonl_writer(tmp_path / "bad.jsonl", [GOOD_FIRST, GOOD_LAST | {"doc_id": "g0"}, "", bad, GOOD_LAST])
    examples = iter_examples([path], spec, tokenizer)
    assert next(examples).id == "g1"
    assert next(examples).id == "g0"
    with pytest.raises(InputError, match=rf"^bad\.jsonl:4: .*{pattern}") as info:
        next(examples)
    assert info.value.location == "bad.jsonl:4"


@pytest.mark.parametrize(("case", "bad", "pattern"), BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_bad_record_skipped_with_reason(tokenizer, jsonl_writer, tmp_path, case, bad, pattern):
    spec = RecordSpec(id_field="doc_id", metadata_fields=("lang",))
    path = jsonl_writer(tmp_path / "bad.jsonl", [GOOD_FIRST, "", "", bad, GOOD_LAST])
    out = list(iter_examples([path], spec, tokenizer, on_error="skip"))
    assert [type(o) for o in out] == [Example, Rejected, Example]
    assert [o.id for o in out if isinstance(o, Example)] == ["g1", "g2"]
    rejected = out[1]
    assert (rejected.shard, rejected.position, rejected.location) == ("bad.jsonl", 3, "bad.jsonl:4")
    assert re.search(pattern, rejected.reason)
    assert not rejected.reason.startswith("bad.jsonl")  # the reason is without the location
    expected_id = bad.get("doc_id") if isinstance(bad, dict) and case != "id surrogate" else None
    assert rejected.record_id == expected_id


def test_skip_mode_still_raises_config_errors(tokenizer_factory, jsonl_writer, tmp_path):
    path = jsonl_writer(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: .*no chat template"):
        list(iter_examples([path], RecordSpec(), tokenizer_factory(None), on_error="skip"))


# --- generated odd text in every text field of a record -----------------------------------


def _record_with_odd_text(rng, i: int):
    """A valid record with odd code points in one of its text fields: the record, that field's
    name as errors name it, and whether the record is invalid."""
    from oddtext import with_odd

    record = {
        "doc_id": f"r{i}",
        "lang": "en",
        "tags": ["a", "b"],
        "messages": [
            {"role": "user", "content": "hello world", "name": "ann"},
            {"role": "assistant", "content": "the lazy dog"},
        ],
    }
    where = rng.choice(["text", "content", "assistant", "role", "name", "doc_id", "lang", "tags"])
    odd, invalid = with_odd(rng, "the quick brown fox")
    if where == "text":
        del record["messages"]
        record["text"] = odd
    elif where in ("content", "role", "name"):
        record["messages"][0][where] = odd
        where = f"messages[0].{where}"
    elif where == "assistant":
        record["messages"][1]["content"] = odd
        where = "messages[1].content"
    elif where == "tags":
        record["tags"] = ["a", odd]
        where = "tags[1]"
    else:
        record[where] = odd
    return record, where, invalid


def test_generated_odd_text_in_every_record_field_rejects_exactly_the_invalid_records(tokenizer, tmp_path):
    import random

    rng = random.Random(11)
    cases = [_record_with_odd_text(rng, i) for i in range(60)]
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record, _, _ in cases))  # surrogates as \ud800 escapes
    spec = RecordSpec(id_field="doc_id", metadata_fields=("lang", "tags"))
    out = list(iter_examples([path], spec, tokenizer, on_error="skip"))
    assert len(out) == len(cases)
    assert 15 <= sum(invalid for _, _, invalid in cases) <= 45
    for (record, field_name, invalid), item in zip(cases, out):
        if not invalid:
            assert isinstance(item, Example), (record, item)
            content = item.content["text"] if "text" in record else item.content["messages"]
            assert content == record.get("text", record.get("messages"))  # kept as written: NUL, non-characters
            assert item.metadata == {"lang": record["lang"], "tags": record["tags"]}
            continue
        assert isinstance(item, Rejected), record
        assert f"field '{field_name}': character" in item.reason and "surrogate" in item.reason, item.reason


# --- a huge record is cut before it is tokenized ------------------------------------------


class _Recording:
    """A tokenizer that records the length of every string it is given (and is otherwise it)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)

    def __len__(self):
        return len(self.tokenizer)


@pytest.mark.parametrize("which", ["bpe", "word"])
@pytest.mark.parametrize(
    ("record", "bounded"),
    [
        ({"text": "the quick brown fox jumps over the lazy dog. " * 40_000}, True),
        ({"text": "t1 t2 " * 150_000}, True),
        # Few tokens for many characters (a word tokenizer drops whitespace): the cut grows, to the whole.
        ({"text": "t1" + " " * 300_000 + " t2 t3" * 40}, False),
        ({"prompt": "t1 t2 t1 t2", "completion": " t3 t4 t5" * 100_000}, True),
    ],
    ids=["prose", "words", "spaces", "completion"],
)
def test_a_huge_record_is_cut_before_tokenizing_to_the_tokens_of_its_truncation(tokenizer, which, record, bounded):
    from tinymodels import make_word_tokenizer

    tok = tokenizer if which == "bpe" else make_word_tokenizer()
    spec = RecordSpec(max_tokens=24)
    whole = _tok(record, tok, RecordSpec())  # tokenized whole, then cut to 24 below
    recording = _Recording(tok)
    cut = _tok(record, recording, spec)
    assert cut.input_ids == whole.input_ids[:24] and cut.labels == whole.labels[:24] and cut.truncated
    assert cut.num_loss_tokens == sum(1 for t in whole.labels[1:24] if t != IGNORE_INDEX)
    assert cut.content == whole.content and cut.id == whole.id  # the id and hash are of the whole record
    size = sum(len(v) for v in record.values())
    if bounded:
        assert max(recording.lengths) < size // 10, recording.lengths


def test_a_lone_surrogate_in_any_text_field_of_any_kind_is_the_records_error_naming_it(tokenizer):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from badtext import bad_records

    from eogp_index.data.records import check_record, preference_pair

    for case, record, field in bad_records():
        query_only = "chosen" in record
        if not query_only:
            with pytest.raises(InputError, match=rf"^s\.jsonl:1: field '{re.escape(field)}.*surrogate") as info:
                _tok(record, tokenizer)  # the tokenizer has a chat template: chats reach no template
            assert info.value.field == field, case
        with pytest.raises(InputError, match=r"surrogate") as info:
            if query_only:
                preference_pair(record)
            else:
                check_record(record, RecordSpec(), None, query=True)
        assert info.value.field == field, case
