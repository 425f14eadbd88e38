"""Generated bad requests: none is answered 5xx, and each 4xx names the field at fault.

Each case breaks one thing on purpose and says which field the answer must name. A seeded
generator makes a few hundred of them (wrong types, out-of-range values, bad filters, bad
token ids, malformed or oversized bodies, bad ids), so a failure is reproducible.
"""

from __future__ import annotations

import json
import random
from typing import Any, Dict, List, Optional, Tuple

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install 'eogp-index[serve]'")
from fastapi.testclient import TestClient  # noqa: E402
from oddtext import with_odd  # noqa: E402

from eogp_index.serve.app import create_app  # noqa: E402
from eogp_index.serve.config import ServeConfig  # noqa: E402

#: (method, path, JSON body or raw bytes, the field the answer must name)
Case = Tuple[str, str, Any, str]
SEED = 20240917
MAX_K, MAX_TOKENS, MAX_BYTES = 50, 32, 4096
WRONG_VALUES = [None, True, 1.5, -3, "seven", [], [1, "a"], {"a": 1}, "", 10**30]
BAD_FILTERS = [
    "kynd = 'a'",
    "kind = ",
    "kind = 'unterminated",
    "1; DROP TABLE examples",
    "n >> 3",
    "((n > 1)",
    "nosuch IS NULL",
    "kind LIKE",
    "SELECT * FROM examples",
    "n = 'x' AND AND",
    "`kind = 'a'",
    "kind = klass",
    "n BETWEEN 1",
    "embedding = [1,2]",
    "group = 1",
]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(1, 64)}" for _ in range(n))


def _query_body(rng: random.Random, **changes) -> Dict[str, Any]:
    body: Dict[str, Any] = {"text": _text(rng, rng.randrange(3, 9)), "k": rng.randrange(1, 6)}
    if rng.random() < 0.5:
        body["direction"] = rng.choice(["positive", "negative", "both"])
    body.update(changes)
    return body


def _wrong_values() -> Dict[str, List[Any]]:
    """Values that are wrong for each field of /v1/query. ``None`` is fine for the optional fields
    and ``""`` for where (no filter), so each field lists its own."""
    return {
        "k": [v for v in WRONG_VALUES if v is not None] + [0, -1, MAX_K + 1],
        "direction": [v for v in WRONG_VALUES if v is not None] + ["up", "POSITIVE", "Both "],
        "by_module": [v for v in WRONG_VALUES if v not in (None, True)] + ["yes", 1, 0],
        "where": [v for v in WRONG_VALUES if v not in (None, "")],
        "text": [v for v in WRONG_VALUES if v is not None] + ["   ", "\n\t"],
        "messages": [
            "t1 t2",
            [{"role": "user"}],
            [{"content": "t1"}],
            [{"role": 1, "content": "t1"}],
            [{"role": "user", "content": ["t1"]}],
            ["t1 t2"],
            {"role": "user", "content": "t1"},
            [{"role": "user", "content": "t1", "extra": 1}],
            7,
        ],
        "input_ids": [
            "t1 t2",
            [1.5, 2],
            [-1, 2, 3],
            [1, 2, 10**6],
            [1, "2", 3],
            [],
            [7],
            {"0": 1},
            [1, 2, 70],
            [True, False, True],
        ],
    }


def _query_body_with(rng: random.Random, field_name: str, value: Any) -> Dict[str, Any]:
    if field_name in ("text", "messages", "input_ids"):
        return {field_name: value, "k": 3}
    return _query_body(rng, **{field_name: value})


def _typed_fields(rng: random.Random) -> List[Case]:
    """A wrong type or value in each field of each endpoint."""
    cases: List[Case] = []
    for field_name, values in _wrong_values().items():
        for value in values:
            cases.append(("POST", "/v1/query", _query_body_with(rng, field_name, value), field_name))
    for labels in ([1, 2], [-100, 200, 3, 4], ["a", 1, 2, 3], [-5, 1, 2, 3], "t1"):
        cases.append(("POST", "/v1/query", {"input_ids": [4, 5, 6, 7], "labels": labels}, "labels"))
    cases.append(("POST", "/v1/query", {"text": "t1 t2 t3", "labels": [1, 2, 3]}, "labels"))
    for value in [v for v in WRONG_VALUES if v != "seven"] + [
        [{"role": "user"}],
        {"txt": "t1 t2"},
        [{"role": "user", "content": 3}],
    ]:
        cases.append(("POST", "/v1/explain", {"query": value, "id": "doc-1"}, "query"))
    for value in [None, 3, ["doc-1"], {"id": "doc-1"}, True]:
        cases.append(("POST", "/v1/explain", {"query": "t1 t2 t3", "id": value}, "id"))
    return cases


def _filters(rng: random.Random) -> List[Case]:
    cases = [("POST", "/v1/query", _query_body(rng, where=where), "where") for where in BAD_FILTERS]
    for _ in range(25):  # random SQL-ish garbage built from the real column names
        tokens = [
            rng.choice(
                [
                    "kind",
                    "n",
                    "text",
                    "nosuch",
                    "=",
                    "<",
                    "AND",
                    "OR",
                    "NOT",
                    "(",
                    ")",
                    "'a'",
                    "3",
                    "LIKE",
                    "IN",
                    ",",
                    "IS",
                    "NULL",
                    "''",
                    "`",
                    '"',
                    ";",
                ]
            )
            for _ in range(rng.randrange(2, 7))
        ]
        where = " ".join(tokens)
        cases.append(("POST", "/v1/query", _query_body(rng, where=where), "where?"))
    return cases


def _sizes(rng: random.Random) -> List[Case]:
    return [
        ("POST", "/v1/query", {"text": _text(rng, MAX_TOKENS + 1 + rng.randrange(20))}, "text"),
        ("POST", "/v1/query", {"input_ids": [3] * (MAX_TOKENS + 1)}, "input_ids"),
        ("POST", "/v1/query", {"text": "t1 " * (MAX_BYTES // 2)}, "body"),
        ("POST", "/v1/explain", {"query": _text(rng, MAX_TOKENS + 5), "id": "doc-1"}, "query"),
        ("POST", "/v1/query", {"text": "t1 t2", "k": MAX_K + rng.randrange(1, 10**6)}, "k"),
    ]


def _bodies(rng: random.Random) -> List[Case]:
    """Malformed JSON, JSON that is not an object, unknown and missing fields, bad ids in paths."""
    good = json.dumps(_query_body(rng)).encode()
    cases: List[Case] = [
        ("POST", "/v1/query", good[:cut], "body") for cut in sorted(rng.sample(range(1, len(good) - 1), 12))
    ]
    cases += [
        ("POST", "/v1/query", raw, "body")
        for raw in (b"", b"nul", b"{'text': 't1'}", b"\xff\xfe\x00{", b'{"text": "t1 t2",}', b"[", b"{}}")
    ]
    cases += [
        ("POST", "/v1/query", json.dumps(value).encode(), "body")
        for value in ([{"text": "t1 t2"}], "t1 t2", 42, None, True)
    ]
    cases += [("POST", "/v1/explain", json.dumps(value).encode(), "body") for value in ([], "x", 1)]
    for name in ("txt", "K", "filter", "directions", "query", "top_k", "by_modules", "id"):
        cases.append(("POST", "/v1/query", _query_body(rng, **{name: 1}), name))
    cases.append(("POST", "/v1/explain", {"query": "t1 t2", "id": "doc-1", "k": 3}, "k"))
    cases.append(("POST", "/v1/explain", {"id": "doc-1"}, "query"))
    cases.append(("POST", "/v1/explain", {"query": "t1 t2"}, "id"))
    cases.append(("POST", "/v1/query", {"k": 3, "where": "n > 1"}, "text"))
    cases.append(("POST", "/v1/query", b'{"text": NaN, "k": 3}', "text"))  # Python's JSON reads NaN: a float
    cases.append(("POST", "/v1/query", {"text": "t1 t2", "messages": [{"role": "user", "content": "t1"}]}, "messages"))
    for example_id in ("doc-999", "doc-1'; --", "' OR '1'='1", "%00", "doc-1/../none", "a" * 300, "doc-1\\", "é"):
        cases.append(("GET", f"/v1/examples/{example_id}", None, "id"))
        cases.append(("POST", "/v1/explain", {"query": "t1 t2 t3", "id": example_id}, "id"))
    return cases


def _mutations(rng: random.Random, n: int = 40) -> List[Case]:
    """Random good requests with one random field made wrong."""
    wrong = _wrong_values()
    cases = []
    for _ in range(n):
        field_name = rng.choice(sorted(wrong))
        cases.append(
            ("POST", "/v1/query", _query_body_with(rng, field_name, rng.choice(wrong[field_name])), field_name)
        )
    return cases


def generated_cases() -> List[Case]:
    rng = random.Random(SEED)
    return _typed_fields(rng) + _filters(rng) + _sizes(rng) + _bodies(rng) + _mutations(rng)


@pytest.fixture(scope="module")
def client(served_index):
    config = ServeConfig(max_k=MAX_K, max_query_tokens=MAX_TOKENS, max_request_bytes=MAX_BYTES)
    with TestClient(create_app(served_index, config), raise_server_exceptions=False) as test_client:
        yield test_client


def _send(client, method: str, path: str, body: Any):
    if method == "GET":
        return client.get(path)
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def test_at_least_200_generated_bad_requests_get_4xx_naming_the_field(client, served_index):
    cases = generated_cases()
    assert len(cases) >= 200
    version, rows = served_index.store.version, served_index.store.count()
    problems: List[str] = []
    for method, path, body, field in cases:
        response = _send(client, method, path, body)
        shown = f"{method} {path} {body!r:.120}"
        if response.status_code >= 500 or "Traceback" in response.text:
            problems.append(f"{shown}: {response.status_code} {response.text[:200]}")
            continue
        if field == "where?":  # random SQL: some of it is valid (answered 200); the rest must name where
            if response.status_code == 200:
                continue
            field = "where"
        if not 400 <= response.status_code < 500:
            problems.append(f"{shown}: expected a 4xx naming {field!r}, got {response.status_code}")
            continue
        error: Optional[dict] = response.json().get("error")
        named = str((error or {}).get("field")).split(".")[0].split("[")[0]  # messages[0].role: messages
        if not error or named != field or not error.get("message"):
            problems.append(f"{shown}: expected field {field!r}, got {error}")
        elif (
            field != "body"
            and field.split(".")[0].split("[")[0] not in error["message"]
            and response.status_code != 404
        ):
            problems.append(f"{shown}: the message does not name {field!r}: {error['message']}")
    assert problems == [], f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems[:40])
    # No endpoint changes stored rows.
    assert (served_index.store.version, served_index.store.count()) == (version, rows)


# -- invalid Unicode in every text field ------------------------------------------------------------
def _unicode_cases(rng: random.Random, n: int = 12) -> List[Tuple[str, str, bytes, str, bool]]:
    """(method, path, raw JSON body, the field at fault, whether it holds invalid Unicode) for each
    text field of each endpoint. JSON escapes the surrogates (``"\\ud800"``), as clients send them."""

    def chat(content: str, role: str = "user") -> List[Dict[str, str]]:
        return [{"role": role, "content": content}, {"role": "assistant", "content": _text(rng, 3)}]

    makers = {
        ("/v1/query", "text"): lambda s: {"text": s, "k": 3},
        ("/v1/query", "messages"): lambda s: {"messages": chat(s), "k": 3},
        ("/v1/query", "messages.role"): lambda s: {"messages": chat(_text(rng, 3), role=s), "k": 3},
        ("/v1/query", "where"): lambda s: _query_body(rng, where=f"kind = '{s}'"),
        ("/v1/explain", "query"): lambda s: {"query": rng.choice([s, {"text": s}, chat(s)]), "id": "doc-1"},
        ("/v1/explain", "id"): lambda s: {"query": _text(rng, 4), "id": s},
    }
    cases = []
    for (path, field_name), make in makers.items():
        for _ in range(n):
            value, invalid = with_odd(rng, _text(rng, rng.randrange(1, 6)) if field_name != "id" else "doc-1")
            cases.append(("POST", path, json.dumps(make(value)).encode(), field_name.split(".")[0], invalid))
    return cases


def test_invalid_unicode_in_any_text_field_is_a_4xx_naming_it_and_valid_odd_text_is_answered(client):
    problems: List[str] = []
    cases = _unicode_cases(random.Random(SEED + 1))
    for method, path, body, field, invalid in cases:
        response = _send(client, method, path, body)
        shown = f"{path} {body[:100]!r}"
        if response.status_code >= 500 or "Traceback" in response.text:
            problems.append(f"{shown}: {response.status_code} {response.text[:200]}")
            continue
        if response.status_code == 200:
            if invalid:
                problems.append(f"{shown}: invalid Unicode was answered 200")
            continue
        error = response.json().get("error") or {}
        named = str(error.get("field")).split(".")[0].split("[")[0]
        if not 400 <= response.status_code < 500 or named != field:
            problems.append(f"{shown}: expected a 4xx naming {field!r}, got {response.status_code} {error}")
        elif invalid and "surrogate" not in error.get("message", "") and field != "where":
            problems.append(f"{shown}: the message does not say what is wrong: {error.get('message')}")
    assert sum(invalid for *_, invalid in cases) >= 20
    assert problems == [], f"{len(problems)} of {len(cases)} cases:\n" + "\n".join(problems[:30])
