"""encode/measurements.py on a real index (tiny GPT-2, word tokenizer): every query kind becomes
coordinates in one gradient pass, a bad query fails alone, and its error names the field at fault."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from tinymodels import make_tiny_gpt2, make_word_tokenizer

from eogp_index.encode.measurements import Measured, measure, tokenize_queries
from eogp_index.errors import InputError, QueryTooLongError

TEXT = "t1 t2 t3 t4 t5"
COMPLETION = {"prompt": "t5 t6", "completion": " t7 t8 t9"}
PREFERENCE = {"prompt": "t1 t2", "chosen": " t3 t4 t5", "rejected": " t9 t10"}


@pytest.fixture(scope="module")
def encoder(fitted_index_template, tmp_path_factory):
    from eogp_index.client import AttributionIndex
    from eogp_index.config import GradientConfig

    path = shutil.copytree(fitted_index_template, tmp_path_factory.mktemp("measure") / "index")
    index = AttributionIndex.open(
        path, model=make_tiny_gpt2(), tokenizer=make_word_tokenizer(), gradients=GradientConfig(batch_size=8)
    )
    return index.encoder


def _counting(encoder, monkeypatch) -> list:
    """The example counts of each gradient pass ``encoder.project`` makes from here on."""
    passes = []
    project = encoder.project

    def counted(examples, **kwargs):
        passes.append(len(examples))
        return project(examples, **kwargs)

    monkeypatch.setattr(encoder, "project", counted)
    return passes


def test_every_kind_is_measured_in_one_pass_and_a_bad_query_fails_alone(encoder, monkeypatch):
    queries = [TEXT, {"text": ""}, [5, 9, 13, 2, 7], COMPLETION, PREFERENCE, 5, {"input_ids": [3, 4, 5]}]
    passes = _counting(encoder, monkeypatch)
    got = measure(encoder, queries)
    assert isinstance(got, Measured) and passes == [6]  # one pass: the preference query's two completions in it
    assert got.answered == (0, 2, 3, 4, 6) and sorted(got.errors) == [1, 5]
    assert got.coordinates.shape == (5, encoder.layout.num_coords) and got.coordinates.dtype == np.float32
    assert got.errors[1].field == "text" and "empty document" in str(got.errors[1])
    assert got.errors[5].field == "query"
    # Each row is the query measured on its own.
    for row, position in enumerate(got.answered):
        alone = encoder.query_coordinates([queries[position]])[0]
        # float32 sums run in another order in a batch of other lengths: equal to 1e-3 of the row's scale
        np.testing.assert_allclose(got.coordinates[row], alone, rtol=1e-4, atol=1e-3 * np.abs(alone).max())


def test_a_preference_query_is_its_chosen_completion_minus_its_rejected_one(encoder):
    (row,) = measure(encoder, [PREFERENCE]).coordinates
    chosen, rejected = encoder.project(
        encoder.query_examples(
            [
                {"prompt": PREFERENCE["prompt"], "completion": PREFERENCE["chosen"]},
                {"prompt": PREFERENCE["prompt"], "completion": PREFERENCE["rejected"]},
            ]
        )
    )
    np.testing.assert_allclose(row, chosen - rejected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "query, field, words",
    [
        ({"text": ""}, "text", "empty document"),
        ({"input_ids": [3, 4, 5], "labels": [3, 4]}, "labels", "labels"),
        ({"prompt": "t1", "chosen": "", "rejected": " t2"}, "chosen", "'chosen'"),
        ({"prompt": "t1", "chosen": " t2", "rejected": ""}, "rejected", "'rejected'"),
        ({"prompt": "t1", "chosen": " t2"}, "rejected", "lacks"),
        ({"prompt": "t1"}, "completion", "prompt"),  # the prompt lacks its completion
        ({"messages": [{"role": "user", "content": "t1"}]}, "messages", "chat template"),
        ([], "query", "empty list"),
    ],
)
def test_each_error_names_the_record_field_at_fault(encoder, query, field, words):
    (error,) = tokenize_queries(encoder, [TEXT, query]).errors.values()
    assert isinstance(error, InputError) and error.field == field, (error, error.field)
    assert words in str(error)


def test_a_query_over_max_query_tokens_is_told_apart(encoder):
    long_text = " ".join(["t1"] * 9)
    got = measure(
        encoder,
        [long_text, {"input_ids": list(range(1, 10))}, {**PREFERENCE, "rejected": " t3" * 9}, TEXT],
        max_query_tokens=8,
    )
    assert got.answered == (3,)
    assert all(isinstance(e, QueryTooLongError) and "max_query_tokens" in str(e) for e in got.errors.values())
    assert [got.errors[i].field for i in range(3)] == ["text", "input_ids", "rejected"]
    assert "9 tokens" in str(got.errors[0]) and "'rejected'" in str(got.errors[2])
    assert measure(encoder, [long_text]).answered == (0,)  # no limit: measured


def test_query_coordinates_raise_the_first_error_before_any_pass(encoder, monkeypatch):
    passes = _counting(encoder, monkeypatch)
    with pytest.raises(InputError, match="empty document") as raised:
        encoder.query_coordinates([TEXT, {"text": ""}, 5])
    assert raised.value.field == "text" and passes == []
    with pytest.raises(InputError, match="preference query .* not here"):  # no single token list
        encoder.query_examples([PREFERENCE])
