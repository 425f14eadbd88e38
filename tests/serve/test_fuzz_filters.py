"""Generated filters and requests: the library and the server refuse each broken filter where it
breaks, answer each good one, and never answer 5xx or show a traceback.

A seeded generator draws valid filters over the served index's columns (``kind``, ``n``, ``id``)
and breaks each in one way: text left over after it, a second statement, a subquery, or a
comparison that names no column. It knows where it broke the filter, so it checks the position
the error gives. Requests are also sent with the content types and ``Authorization`` spellings
clients use.
"""

from __future__ import annotations

import json
import random
from typing import List, Tuple

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install 'eogp-index[serve]'")
from fastapi.testclient import TestClient  # noqa: E402

from eogp_index.errors import InputError  # noqa: E402
from eogp_index.serve.app import create_app  # noqa: E402
from eogp_index.serve.config import ServeConfig  # noqa: E402

SEED = 20251125
TOKEN = "s3cret"
QUERY = "t1 t2 t3 t4 t5"
#: (a broken filter, a text its error must hold)
Broken = Tuple[str, str]


def _value(rng: random.Random, column: str) -> str:
    if column == "kind":
        return "'" + rng.choice(["function", "class", "module", "o''k"]) + "'"  # '' is a quote inside a string
    if column == "n":
        return str(rng.randrange(-5, 45))
    return f"'doc-{rng.randrange(40)}'"


def _condition(rng: random.Random) -> str:
    column = rng.choice(["kind", "n", "id", "`n`", "`kind`"])
    bare = column.strip("`")
    form = rng.randrange(6)
    if form == 0:
        return f"{column} {rng.choice(['=', '!=', '<', '>=', '<>'])} {_value(rng, bare)}"
    if form == 1:
        return f"{column} IN ({', '.join(_value(rng, bare) for _ in range(rng.randrange(1, 4)))})"
    if form == 2:
        return f"{column} IS {rng.choice(['', 'NOT '])}NULL"
    if form == 3 and bare == "n":
        return f"{column} BETWEEN {rng.randrange(0, 10)} AND {rng.randrange(10, 40)}"
    if form == 4:
        return f"{_value(rng, bare)} {rng.choice(['=', '<', '>='])} {column}"  # the column on the right
    return (
        f"{column} LIKE '{rng.choice(['doc-1%', '%s%', 'c_ass', '%'])}'"
        if bare != "n"
        else f"n % 2 = {rng.randrange(2)}"
    )


def good_filter(rng: random.Random) -> str:
    """One to three conditions joined by AND / OR, sometimes negated or parenthesized."""
    parts = [_condition(rng) for _ in range(rng.randrange(1, 4))]
    parts = [f"NOT ({p})" if rng.random() < 0.15 else f"({p})" if rng.random() < 0.2 else p for p in parts]
    joined = parts[0]
    for part in parts[1:]:
        joined += f" {rng.choice(['AND', 'OR', 'and', 'or'])} {part}"
    return joined


def _left_over(rng: random.Random, base: str) -> Broken:
    tail = rng.choice(
        [
            "ANDD n > 3",
            "garbage",
            "x",
            "'a'",
            "3",
            "kind",
            ")",
            "LIMIT 1",
            "ORDER BY n",
            "NOT",
            ", n",
            "AS x",
            "n_chars > 380",
            "-- ok\nn > 1",
            "(",
            "OR OR n = 1",
        ]
    )
    broken = f"{base} {tail}"
    if tail == "AS x":
        return broken, f"at column {len(base) + 2}: 'AS x' is left over"
    if tail == "OR OR n = 1":
        return broken, "at column"  # DataFusion stops at the second OR: an expression was expected
    if tail.startswith("-- ok"):
        return broken, "at line 2, column 1: 'n > 1' is left over"
    return broken, f"at column {len(base) + 2}: {tail[:40]!r} is left over"


def _statements(rng: random.Random, base: str) -> Broken:
    second = rng.choice(
        ["DROP TABLE examples", "SELECT * FROM examples", "DELETE FROM examples", "", base, "UPDATE examples SET n = 1"]
    )
    gap = rng.choice(["", " ", "  "])
    return f"{base}{gap}; {second}".rstrip(), f"at column {len(base) + len(gap) + 1}: ';' starts a second statement"


def _subquery(rng: random.Random, base: str) -> Broken:
    select = rng.choice(
        [
            "SELECT 1",
            "SELECT n FROM examples",
            "select max(n) from examples",
            "SELECT * FROM examples WHERE n > 3",
            "SELECT id FROM nosuch",
        ]
    )
    sub = rng.choice(
        [
            f"EXISTS ({select})",
            f"NOT EXISTS ({select})",
            f"n IN ({select})",
            f"n = ({select})",
            f"kind NOT IN ({select})",
        ]
    )
    if rng.random() < 0.5:
        broken = f"{base} {rng.choice(['AND', 'OR'])} {sub}"
    else:
        broken = f"{sub} {rng.choice(['AND', 'OR'])} {base}"
    return broken, f"at column {broken.find(select) + 1}: subqueries are not filters"


def _literal_only(rng: random.Random, base: str) -> Broken:
    left, right = rng.choice(
        [("'a'", "'a'"), ("1", "1"), ("2", "3"), ('"kind"', "'class'"), ('"n"', "3"), ("'class'", "'module'")]
    )
    op = rng.choice(["=", "!=", "<", ">=", "LIKE"]) if left.startswith(("'", '"')) else rng.choice(["=", "<", ">="])
    comparison = f"{left} {op} {right}"
    if rng.random() < 0.5:
        broken = f"{base} {rng.choice(['AND', 'OR'])} {comparison}"
    else:
        broken = f"{comparison} {rng.choice(['AND', 'OR'])} {base}"
    expected = "names no column"
    if left.startswith('"'):
        expected = f"{left} in double quotes is a string here, not a column: write `{left.strip(chr(34))}`"
    return broken, expected


def broken_filters(n: int = 60) -> List[Broken]:
    rng = random.Random(SEED)
    breakers = [_left_over, _statements, _subquery, _literal_only]
    return [breakers[i % len(breakers)](rng, good_filter(rng)) for i in range(n)]


def good_filters(n: int = 20) -> List[str]:
    rng = random.Random(SEED + 1)
    return [good_filter(rng) for _ in range(n)]


@pytest.fixture(scope="module")
def client(served_index):
    with TestClient(create_app(served_index, ServeConfig(token=TOKEN)), raise_server_exceptions=False) as test_client:
        yield test_client


def _post(client, body, *, content_type="application/json", scheme="Bearer", path="/v1/query"):
    headers = {"Authorization": f"{scheme} {TOKEN}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    return client.post(path, content=json.dumps(body).encode(), headers=headers)


def test_generated_broken_filters_are_refused_where_they_break_by_library_and_server(client, served_index):
    cases = broken_filters()
    for kind in ("is left over", "starts a second statement", "subqueries are not filters", "column"):
        assert sum(kind in expected for _, expected in cases) >= 10, kind
    problems = []
    for where, expected in cases:
        try:
            served_index.search(QUERY).where(where).limit(2).to_arrow()
            problems.append(f"library answered {where!r}")
        except InputError as exc:
            if expected not in str(exc):
                problems.append(f"library, {where!r}: expected {expected!r} in {exc}")
        for path, body in (
            ("/v1/query", {"text": QUERY, "k": 2, "where": where, "direction": "both"}),
            ("/v1/select", {"queries": [QUERY], "top": 2, "where": where}),  # the same one check
        ):
            answer = _post(client, body, path=path)
            error = answer.json().get("error") or {}
            if answer.status_code != 400 or error.get("field") != "where" or expected not in error.get("message", ""):
                problems.append(f"server {path}, {where!r}: {answer.status_code} {answer.text[:300]}")
            if "Traceback" in answer.text:
                problems.append(f"server {path}, {where!r}: a traceback")
    assert problems == [], f"{len(problems)} of {len(cases)}:\n" + "\n".join(problems[:20])


def test_generated_good_filters_are_answered_as_lance_selects(client, served_index):
    for where in good_filters():
        matching = set(served_index.store.read(["id"], where).column("id").to_pylist())  # Lance's own answer
        answer = _post(client, {"text": QUERY, "k": 40, "where": where, "direction": "both"})
        assert answer.status_code == 200, (where, answer.text)
        assert {row["id"] for row in answer.json()["results"]} <= matching, where


@pytest.mark.parametrize("seed", range(3))
def test_generated_content_types_and_auth_schemes_never_change_the_answer(client, seed):
    rng = random.Random(SEED + 10 + seed)
    body = {"text": QUERY, "k": 3, "where": good_filter(rng), "direction": rng.choice(["positive", "both"])}
    expected = _post(client, body)
    assert expected.status_code == 200, expected.text
    for _ in range(8):
        content_type = rng.choice(
            [
                None,
                "application/x-www-form-urlencoded",
                "text/plain",
                "application/json",
                "application/json; charset=utf-8",
                "multipart/form-data; boundary=x",
                "application/octet-stream",
                "TEXT/JSON",
            ]
        )
        scheme = "".join(c.upper() if rng.random() < 0.5 else c for c in "bearer")
        answer = _post(client, body, content_type=content_type, scheme=scheme)
        assert answer.status_code == 200, (content_type, scheme, answer.text)
        assert answer.json()["results"] == expected.json()["results"]
    wrong = _post(client, body, scheme=rng.choice(["Basic", "Token", "Bearer-x"]))
    assert wrong.status_code == 401 and wrong.json()["error"]["field"] == "authorization"
