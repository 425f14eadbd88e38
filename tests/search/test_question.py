"""One question, one check, one set of defaults: the Question every surface answers, on a real index
(tiny GPT-2, LanceDB on disk)."""

from __future__ import annotations

import dataclasses

import pytest

from eogp_index.errors import ConfigError, InputError
from eogp_index.search.question import Question, check_question
from eogp_index.search.select import select_documents, write_scores

QUERY = [3, 1, 4, 1, 5, 9, 2, 6, 5]
#: Filters Lance alone would drop or answer wrongly: text left over, a second statement, and a
#: comparison of two strings (names take backticks, not double quotes).
BROKEN_FILTERS = ("`group` = 1 ANDD num_tokens > 3", "1=1; DROP TABLE x", "\"name\" = 'doc1'")


def test_one_set_of_defaults_everywhere(fitted_index):
    question = Question()
    assert (question.k, question.direction, question.normalize, question.route) == (10, "both", "none", "auto")
    assert (question.where, question.aggregate, question.group_by, question.candidates) == (None, None, None, None)
    assert fitted_index.search(QUERY).to_query_object() == Question(queries=({"input_ids": QUERY},))
    hits = fitted_index.top_influential(QUERY)
    assert hits.column_names[0] == "direction" and set(hits.column("direction").to_pylist()) <= {"positive", "negative"}
    assert max(hits.column("rank").to_pylist()) <= 10


def test_the_builder_is_a_question_and_a_question_answers_as_the_builder(fitted_index):
    built = fitted_index.search(QUERY).where(" `group` != 1 ").limit(4).direction("negative").by_module()
    question = Question(queries=(QUERY,), where="`group` != 1", k=4, direction="negative", by_module=True)
    assert built.to_query_object() == question
    assert built.to_arrow().to_pylist() == fitted_index.search(question).to_arrow().to_pylist()
    assert fitted_index.top_influential(question).to_pylist() == built.to_arrow().to_pylist()
    chat = Question(queries=("t1 t2", [{"role": "user", "content": "x"}], {"prompt": "a", "completion": "b"}))
    assert chat.queries == ({"text": "t1 t2"}, {"messages": [{"role": "user", "content": "x"}]}, chat.queries[2])


@pytest.mark.parametrize(
    "field, changes",
    [
        ("k", {"k": 0}),
        ("k", {"k": True}),
        ("k", {"k": "5"}),
        ("direction", {"direction": "up"}),
        ("candidates", {"k": 5, "candidates": 3}),
        ("candidates", {"route": "stream", "candidates": 30}),
        ("candidates", {"route": "candidates"}),
        ("route", {"route": "gpu"}),
        ("normalize", {"normalize": "l2"}),
        ("normalize", {"normalize": "unit", "candidates": 30}),
        ("group_by", {"group_by": "group", "route": "stream"}),
        ("aggregate", {"aggregate": "max"}),
        ("where", {"where": 3}),
    ],
)
def test_a_stateless_error_names_its_question_field(field, changes):
    with pytest.raises(ConfigError) as caught:
        Question(queries=(QUERY,), **changes)
    assert caught.value.field == field


def test_a_query_of_no_kind_or_of_no_text_names_its_position(fitted_index):
    with pytest.raises(InputError) as caught:
        Question(queries=(QUERY, None))
    assert caught.value.field == "queries[1]"
    for bad in (
        {"prompt": "t1", "completion": "t2 \ud800"},
        {"text": "\udfff"},
        [{"role": "us\ud800er", "content": "x"}],
    ):
        with pytest.raises(InputError, match="surrogate") as caught:
            fitted_index.search(Question(queries=(QUERY, bad), aggregate="mean")).to_arrow()
        assert caught.value.field == "queries[1]"


def test_every_library_surface_refuses_a_broken_filter_the_same_way(fitted_index, tmp_path):
    for where in BROKEN_FILTERS:
        question = Question(queries=(QUERY,), where=where)
        with pytest.raises(InputError) as caught:
            check_question(question, fitted_index.stored)
        assert caught.value.field == "where"
        expected = str(caught.value)
        surfaces = {
            "search": lambda: fitted_index.search(question).to_arrow(),
            "stream": lambda: fitted_index.search(question.replace(route="stream")).to_arrow(),
            "top_influential": lambda: fitted_index.top_influential(QUERY, where=where),
            "scores": lambda: fitted_index.scores([QUERY], where=where),
            "select": lambda: fitted_index.select(question),
            "select_documents": lambda: select_documents(fitted_index, question),
            "write_scores": lambda: write_scores(fitted_index, question, tmp_path / "scores.parquet"),
            "group_by": lambda: fitted_index.search(question.replace(group_by="group")).to_arrow(),
        }
        for name, ask in surfaces.items():
            with pytest.raises(InputError) as caught:
                ask()
            assert (caught.value.field, str(caught.value)) == ("where", expected), (name, where)
        assert not (tmp_path / "scores.parquet").exists()


def test_an_unknown_group_by_column_is_named(fitted_index):
    with pytest.raises(InputError, match="no stored column 'nope'") as caught:
        fitted_index.search(Question(queries=(QUERY,), group_by="nope")).to_arrow()
    assert caught.value.field == "group_by"


def test_question_fields_are_documented():
    for field in dataclasses.fields(Question):
        assert field.metadata.get("help"), field.name
