"""The HTTP API on a real index (tiny GPT-2 on disk, LanceDB table), through FastAPI's test client."""

from __future__ import annotations

import functools
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

fastapi = pytest.importorskip("fastapi", reason="the serve extra: pip install 'eogp-index[serve]'")
from fastapi.testclient import TestClient  # noqa: E402

from eogp_index.serve.app import STATIC, create_app  # noqa: E402
from eogp_index.serve.config import ServeConfig  # noqa: E402

QUERY = "t1 t2 t3 t4 t5"


@pytest.fixture(scope="module")
def client(served_index):
    with TestClient(create_app(served_index, ServeConfig(max_query_tokens=64))) as test_client:
        yield test_client


def _error(response, status, field):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"], error
    assert "Traceback" not in response.text
    return error["message"]


def test_query_answers_the_hits_of_eogp_query_json(client, index_dir):
    from eogp_index.cli import cli

    args = [
        "query",
        str(index_dir),
        "--text",
        QUERY,
        "-k",
        "4",
        "--where",
        "kind != 'module'",
        "--device",
        "cpu",
        "--json",
    ]
    printed = CliRunner().invoke(cli, args)
    assert printed.exit_code == 0, printed.output
    expected = json.loads(printed.stdout)[0]
    answer = client.post("/v1/query", json={"text": QUERY, "k": 4, "where": "kind != 'module'", "direction": "both"})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["query"] == expected["query"] == QUERY
    assert [(r["direction"], r["rank"], r["id"]) for r in got["results"]] == [
        (r["direction"], r["rank"], r["id"]) for r in expected["results"]
    ]
    assert [r["score"] for r in got["results"]] == pytest.approx([r["score"] for r in expected["results"]], rel=1e-5)
    for mine, theirs in zip(got["results"], expected["results"]):  # the same columns, text included
        assert {k: v for k, v in mine.items() if k != "score"} == {k: v for k, v in theirs.items() if k != "score"}
    assert all(r["text"] and r["kind"] != "module" for r in got["results"])


def test_by_module_terms_sum_to_the_score(client):
    rows = client.post("/v1/query", json={"text": QUERY, "k": 3, "direction": "positive", "by_module": True}).json()
    assert [r["rank"] for r in rows["results"]] == [1, 2, 3]
    for row in rows["results"]:
        assert len(row["modules"]) == 8
        assert sum(row["modules"].values()) == pytest.approx(row["score"], rel=1e-4, abs=1e-5)


def test_chat_and_token_id_queries(client):
    chat = client.post(
        "/v1/query",
        json={"messages": [{"role": "user", "content": "t3 t4"}, {"role": "assistant", "content": "t5 t6 t7"}], "k": 2},
    )
    # The word tokenizer has no chat template: the message says so and names the field.
    if chat.status_code != 200:
        assert "messages" in _error(chat, 400, "messages")
    ids = client.post(
        "/v1/query",
        json={"input_ids": [5, 9, 13, 2, 7], "labels": [-100, -100, 13, 2, 7], "k": 2, "direction": "negative"},
    )
    assert ids.status_code == 200, ids.text
    assert [r["rank"] for r in ids.json()["results"]] == [1, 2]


def test_requests_that_arrive_together_share_one_pass_and_keep_their_own_options(served_index, caplog):
    # A long window and a batch size equal to the number of requests: the batch closes when all
    # of them are in, so the grouping is deterministic.
    requests = [
        {"text": QUERY, "k": 3},
        {"text": QUERY, "k": 5, "direction": "positive"},
        {"text": "t7 t8 t9 t10", "k": 2, "direction": "positive"},
        {"text": "t7 t8 t9 t10", "k": 4, "where": "kind = 'class'"},
        {"text": "t11 t12 t13", "k": 1, "where": "kind = 'class'"},
        {"text": "t11 t12 t13", "k": 6, "where": "n < 20", "direction": "negative"},
        {"text": "", "k": 3},  # fails alone
        {"text": "t2 t3 t4", "k": 3, "where": "nosuch = 1"},  # fails alone
    ]
    config = ServeConfig(batch_window_ms=10_000, max_batch=len(requests))
    with TestClient(create_app(served_index, config)) as together:
        caplog.set_level(logging.INFO, logger="eogp.serve")
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda body: together.post("/v1/query", json=body), requests))
        batches = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event") == "batch"]
    assert [(b["queries"], b["projected"], b["scans"]) for b in batches] == [(8, 7, 5)]
    with TestClient(create_app(served_index, ServeConfig(batch_window_ms=0))) as alone:
        for body, answer in zip(requests, answers):
            single = alone.post("/v1/query", json=body)
            assert answer.status_code == single.status_code, (body, answer.text)
            if single.status_code != 200:
                assert answer.json()["error"] == single.json()["error"]
                continue
            got, want = answer.json()["results"], single.json()["results"]
            assert [(r.get("direction"), r["id"]) for r in got] == [(r.get("direction"), r["id"]) for r in want]
            for side, sign in (("positive", 1), ("negative", -1)):  # up to k per side, each of its sign
                scores = [r["score"] for r in got if r.get("direction", body.get("direction")) == side]
                assert len(scores) <= body["k"] and all(sign * score > 0 for score in scores)
    assert _error(answers[6], 400, "text")
    assert "invalid where filter" in _error(answers[7], 400, "where")


@pytest.mark.parametrize(
    "where, problem",
    [
        ("kind = 'class' garbage", "at column 16: 'garbage' is left over"),
        ("n > 3; DROP TABLE examples", "at column 6: ';' starts a second statement"),
        ("kind IN (SELECT kind FROM examples)", "at column 10: subqueries are not filters"),
        ("'class' = 'class'", "at column 1: the comparison 'class' = 'class' names no column"),
    ],
)
def test_a_filter_that_is_not_one_condition_on_columns_is_refused_with_its_position(client, where, problem):
    message = _error(client.post("/v1/query", json={"text": QUERY, "where": where}), 400, "where")
    assert problem in message and "backticks" in message


def test_user_errors_name_the_field_and_what_to_fix(client):
    message = _error(client.post("/v1/query", json={"text": QUERY, "where": "kynd = 'a'"}), 400, "where")
    assert "kynd" in message and "'kind'" in message  # lists the columns to choose from
    assert "empty document" in _error(client.post("/v1/query", json={"text": ""}), 400, "text")
    assert "max_k" in _error(client.post("/v1/query", json={"text": QUERY, "k": 101}), 400, "k")
    assert "max_query_tokens" in _error(client.post("/v1/query", json={"text": " ".join(["t1"] * 65)}), 413, "text")
    assert "integer" in _error(client.post("/v1/query", json={"text": QUERY, "k": "5"}), 422, "k")
    assert "unknown field" in _error(client.post("/v1/query", json={"txt": QUERY}), 422, "txt")
    assert "exactly one" in _error(
        client.post("/v1/query", json={"text": QUERY, "input_ids": [1, 2]}), 400, "input_ids"
    )
    assert "one of text" in _error(client.post("/v1/query", json={"k": 3}), 400, "text")
    assert "not valid JSON" in _error(
        client.post("/v1/query", content=b'{"text": "t1 t2",', headers={"content-type": "application/json"}),
        422,
        "body",
    )
    assert "positive" in _error(client.post("/v1/query", json={"text": QUERY, "direction": "up"}), 422, "direction")
    assert _error(client.get("/v1/examples/no-such-doc"), 404, "id")
    assert _error(client.post("/v1/explain", json={"query": QUERY, "id": "no-such-doc"}), 404, "id")
    assert _error(client.get("/v1/nothing-here"), 404, "path")
    missing = client.post("/v1/query", json={"text": QUERY, "candidates": 10, "first_pass": "no-such-pass"})
    assert "build-candidates" in _error(missing, 400, "first_pass")  # how to build it, not a 500


def test_request_size_limit(served_index):
    with TestClient(create_app(served_index, ServeConfig(max_request_bytes=200))) as small:
        big = small.post("/v1/query", json={"text": "t1 " * 100})
        assert "max_request_bytes" in _error(big, 413, "body")
        chunked = small.post(
            "/v1/query",
            content=iter([b'{"text": "', b"t1 " * 100, b'"}']),
            headers={"content-type": "application/json"},
        )
        assert "max_request_bytes" in _error(chunked, 413, "body")


def test_full_queue_answers_503_and_a_stuck_request_504(served_index):
    gate = threading.Event()
    config = ServeConfig(queue_size=2, timeout_s=0.3)
    with TestClient(create_app(served_index, config)) as busy:
        batcher = busy.app.state.batcher
        # Hold the model thread with a call that waits for the gate: later work queues behind it.
        held = busy.portal.start_task_soon(functools.partial(batcher.call, gate.wait, timeout=120))
        second = None
        try:
            timed_out = busy.post("/v1/query", json={"text": QUERY})  # waits behind the held call, then gives up
            assert timed_out.status_code == 504 and timed_out.headers["retry-after"] == "1"
            assert "timeout_s" in timed_out.json()["error"]["message"]
            second = busy.portal.start_task_soon(functools.partial(batcher.call, gate.wait, timeout=120))
            full = busy.post("/v1/query", json={"text": QUERY})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert "busy" in full.json()["error"]["message"]
        finally:
            gate.set()
        held.result()
        if second is not None:
            second.result()
        assert busy.post("/v1/query", json={"text": QUERY}).status_code == 200  # and it recovers


def test_bearer_token(served_index):
    with TestClient(create_app(served_index, ServeConfig(token="s3cret"))) as guarded:
        assert "Bearer" in _error(guarded.get("/v1/info"), 401, "authorization")
        assert guarded.get("/v1/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert guarded.get("/v1/info", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert guarded.get("/healthz").status_code == 200 and guarded.get("/").status_code == 200
        # RFC 7235: the scheme is case-insensitive; the token is not.
        for given in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
            assert guarded.get("/v1/info", headers={"Authorization": given}).status_code == 200, given
        for given in ("bearer S3CRET", "Basic s3cret", "s3cret", "Bearer"):
            assert guarded.get("/v1/info", headers={"Authorization": given}).status_code == 401, given
        assert "'Basic'" in _error(
            guarded.get("/v1/info", headers={"Authorization": "Basic s3cret"}), 401, "authorization"
        )


@pytest.mark.parametrize(
    "content_type",
    [None, "application/x-www-form-urlencoded", "text/plain", "application/json; charset=utf-8", "multipart/form-data"],
)
def test_a_json_body_is_read_whatever_its_content_type_claims(client, content_type):
    body = {"text": QUERY, "k": 2, "where": "kind = 'class'"}
    expected = client.post("/v1/query", json=body).json()["results"]
    headers = {} if content_type is None else {"Content-Type": content_type}
    answer = client.post("/v1/query", content=json.dumps(body).encode(), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["results"] == expected
    # Not JSON at all, as a form would send it: the message says what is wrong with it.
    form = client.post("/v1/query", content=b"text=t1+t2&k=2", headers=headers)
    assert "not valid JSON" in _error(form, 422, "body")


def test_info_examples_health_and_schema(client, served_index):
    info = client.get("/v1/info").json()
    assert info["rows"] == 40 and info["has_text"] and info["limits"]["max_k"] == 100
    assert {"name": "kind", "type": "string"} in info["columns"]
    assert not {"signs", "scales", "coords"} & {c["name"] for c in info["columns"]}
    row = client.get("/v1/examples/doc-7").json()
    assert row["id"] == "doc-7" and row["kind"] == "class" and row["text"].startswith("t")
    assert "signs" not in row
    assert client.get("/healthz").json()["status"] == "ok"
    schema = client.get("/openapi.json").json()
    assert {"/v1/query", "/v1/explain", "/v1/info", "/v1/examples/{example_id}", "/healthz"} <= set(schema["paths"])
    assert "QueryRequest" in json.dumps(schema)


def test_explain_gives_module_and_token_contributions(client):
    hit = client.post("/v1/query", json={"text": QUERY, "k": 1, "direction": "positive"}).json()["results"][0]
    why = client.post("/v1/explain", json={"query": QUERY, "id": hit["id"]})
    assert why.status_code == 200, why.text
    data = why.json()
    assert data["id"] == hit["id"] and data["score"] == pytest.approx(hit["score"], rel=1e-4)
    assert len(data["modules"]) == 8 and data["text"] == hit["text"]
    assert [t["token"] for t in data["query_tokens"]] == QUERY.split()
    assert len(data["train_tokens"]) == hit["num_tokens"]
    chat = client.post("/v1/explain", json={"query": {"input_ids": [5, 9, 13, 2]}, "id": hit["id"]})
    assert chat.status_code == 200, chat.text


def test_the_page_and_its_assets_are_served_from_the_package(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for name in ("app.js", "app.css"):
        assert client.get(f"/static/{name}").status_code == 200
    for path in STATIC.iterdir():  # works offline: nothing is fetched from elsewhere
        text = path.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path.name


def test_select_downloads_what_eogp_select_writes(client, index_dir, tmp_path):
    from eogp_index.cli import cli

    body = {"queries": [QUERY, {"prompt": "t9 t8", "completion": " t7 t6"}], "top": "25%", "where": "kind != 'class'"}
    response = client.post("/v1/select", json=body)
    assert response.status_code == 200, response.text
    assert 'filename="selection.jsonl"' in response.headers["content-disposition"]
    (tmp_path / "targets.jsonl").write_text(json.dumps({"text": QUERY}) + "\n" + json.dumps(body["queries"][1]) + "\n")
    args = [
        "select",
        str(index_dir),
        "--queries",
        str(tmp_path / "targets.jsonl"),
        "--top",
        "25%",
        "--where",
        "kind != 'class'",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "cli.jsonl"),
    ]
    assert CliRunner().invoke(cli, args).exit_code == 0
    # The same records; scores equal up to the last digits (the server projects its own batch).
    lines = response.content.decode().splitlines()
    from_cli = [json.loads(line) for line in (tmp_path / "cli.jsonl").read_text().splitlines()]
    from_http = [json.loads(line) for line in lines]
    assert [{**r, "score": None} for r in from_http] == [{**r, "score": None} for r in from_cli]
    assert [r["score"] for r in from_http] == pytest.approx([r["score"] for r in from_cli], rel=1e-5)
    assert len(lines) == 27 * 25 // 100 and all("score" in json.loads(line) for line in lines)  # 27 rows match

    ids_only = client.post("/v1/select", json={**body, "ids_only": True, "format": "parquet"})
    import io

    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(ids_only.content))
    assert table.column_names == ["id", "score"] and table.num_rows == len(lines)


def test_select_refusals_name_the_field(client):
    assert "at least one" in _error(client.post("/v1/select", json={"queries": []}), 400, "queries")
    assert "--top" in _error(client.post("/v1/select", json={"queries": [QUERY], "top": "0%"}), 400, "top")
    assert "kynd" in _error(client.post("/v1/select", json={"queries": [QUERY], "where": "kynd = 1"}), 400, "where")
    assert "lacks" in _error(
        client.post("/v1/select", json={"queries": [{"prompt": "t1", "chosen": " t2"}]}), 400, "queries"
    )


def test_select_rebuilds_records_from_stored_text_when_the_shard_is_gone(client, index_dir):
    shard = index_dir.parent / "shard.jsonl"
    originals = {json.loads(line)["id"]: json.loads(line) for line in shard.read_text().splitlines()}
    shard.rename(shard.with_suffix(".moved"))
    try:
        response = client.post("/v1/select", json={"queries": [QUERY], "top": "4"})
    finally:
        shard.with_suffix(".moved").rename(shard)
    assert response.status_code == 200, response.text
    records = [json.loads(line) for line in response.content.decode().splitlines()]
    assert len(records) == 4 and all(set(r) == {"text", "score"} for r in records)
    assert {r["text"] for r in records} <= {o["text"] for o in originals.values()}


def test_a_behaviour_query_with_a_roll_up_answers_as_the_library(client, served_index):
    queries = ["t1 t2 t3 t4 t5", "t7 t8 t9 t10", {"input_ids": [5, 9, 13, 2, 7], "labels": [-100, -100, 13, 2, 7]}]
    body = {
        "queries": queries,
        "aggregate": "mean",
        "normalize": "unit",
        "group_by": "kind",
        "k": 4,
        "where": "n < 30",
        "direction": "both",
    }
    answer = client.post("/v1/query", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    records = [{"text": queries[0]}, {"text": queries[1]}, queries[2]]
    search = (
        served_index.search(records, many=True)
        .aggregate("mean")
        .normalize("unit")
        .where("n < 30")
        .limit(4)
        .direction("both")
    )
    expected = search.to_arrow()
    assert got["query"] == {"queries": queries, "aggregate": "mean"}
    assert [r["id"] for r in got["results"]] == expected.column("id").to_pylist()
    assert [r["score"] for r in got["results"]] == pytest.approx(expected.column("score").to_pylist(), rel=1e-5)
    groups = search.group_by("kind").to_arrow().to_pylist()
    assert [g["kind"] for g in got["groups"]] == [g["kind"] for g in groups]
    assert sum(g["rows"] for g in got["groups"]) == 30
    assert [g["sum"] for g in got["groups"]] == pytest.approx([g["sum"] for g in groups], rel=1e-5)
    assert "groups" not in client.post("/v1/query", json={"text": QUERY, "k": 2}).json()


def test_behaviour_errors_name_the_field(client):
    assert "aggregate" in _error(client.post("/v1/query", json={"queries": [QUERY, QUERY]}), 400, "aggregate")
    assert "not both" in _error(
        client.post("/v1/query", json={"queries": [QUERY], "aggregate": "mean", "text": QUERY}), 400, "text"
    )
    assert "empty document" in _error(
        client.post("/v1/query", json={"queries": [QUERY, ""], "aggregate": "sum"}), 400, "queries[1]"
    )
    assert "max_queries" in _error(
        client.post("/v1/query", json={"queries": [QUERY] * 65, "aggregate": "sum"}), 400, "queries"
    )
    assert "'kind'" in _error(client.post("/v1/query", json={"text": QUERY, "group_by": "kynd"}), 400, "group_by")
    assert _error(client.post("/v1/query", json={"text": QUERY, "normalize": "l2"}), 422, "normalize")


PREFERENCE = {"prompt": "t1 t2", "chosen": " t3 t4 t5", "rejected": " t9 t10"}
COMPLETION = {"prompt": "t5 t6", "completion": " t7 t8 t9"}


@pytest.mark.parametrize("query", [PREFERENCE, COMPLETION], ids=["preference", "prompt-completion"])
def test_preference_and_prompt_completion_queries_answer_as_the_library(client, served_index, query):
    answer = client.post("/v1/query", json={**query, "k": 4, "where": "n < 30", "direction": "both"})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["query"] == query
    expected = served_index.search(query).where("n < 30").limit(4).direction("both").to_arrow()
    assert expected.num_rows > 4
    assert [(r["direction"], r["id"]) for r in got["results"]] == list(
        zip(expected.column("direction").to_pylist(), expected.column("id").to_pylist())
    )
    assert [r["score"] for r in got["results"]] == pytest.approx(expected.column("score").to_pylist(), rel=1e-5)


def test_a_behaviour_holds_preference_and_prompt_completion_queries(client, served_index):
    queries = [QUERY, PREFERENCE, COMPLETION]
    answer = client.post("/v1/query", json={"queries": queries, "aggregate": "sum", "k": 3, "direction": "positive"})
    assert answer.status_code == 200, answer.text
    expected = (
        served_index.search([{"text": QUERY}, PREFERENCE, COMPLETION], many=True)
        .aggregate("sum")
        .limit(3)
        .direction("positive")
        .to_arrow()
    )
    got = answer.json()["results"]
    assert [r["id"] for r in got] == expected.column("id").to_pylist() and len(got) == 3
    assert [r["score"] for r in got] == pytest.approx(expected.column("score").to_pylist(), rel=1e-5)


def test_prompt_completion_and_preference_errors_name_the_field(client):
    def refused(body, field, status=400):
        return _error(client.post("/v1/query", json=body), status, field)

    assert "completion" in refused({"prompt": "t1"}, "completion")
    assert "needs its prompt" in refused({"completion": " t2"}, "prompt")
    assert "rejected is missing" in refused({"prompt": "t1", "chosen": " t2"}, "rejected")
    assert "not both" in refused({"prompt": "t1", "completion": " t2", "chosen": " t3", "rejected": " t4"}, "chosen")
    assert "exactly one" in refused({"text": QUERY, "prompt": "t1", "completion": " t2"}, "prompt")
    assert "'chosen': empty completion" in refused({"prompt": "t1", "chosen": "", "rejected": " t2"}, "chosen")
    assert "'rejected'" in refused({"prompt": "t1", "chosen": " t2", "rejected": ""}, "rejected")
    assert "empty conversation" in refused({"prompt": [], "completion": []}, "prompt")
    assert "max_query_tokens" in refused({"prompt": "t1", "chosen": " t2", "rejected": " t3" * 70}, "rejected", 413)
    assert "a text or a chat" in refused({"prompt": 5, "completion": " t2"}, "prompt", 422)
    assert "lacks" in refused(
        {"queries": [QUERY, {"prompt": "t1", "chosen": " t2"}], "aggregate": "mean"}, "queries[1]"
    )
    assert "unknown keys" in refused({"queries": [{**COMPLETION, "source": "x"}], "aggregate": "mean"}, "queries[0]")
    assert "not both" in refused({"queries": [QUERY], "aggregate": "mean", **COMPLETION}, "prompt")


def test_select_with_normalize_unit_downloads_the_library_selection(client, served_index):
    from eogp_index.config import SelectOptions
    from eogp_index.search.question import Question
    from eogp_index.search.select import select_documents

    body = {"queries": [QUERY, PREFERENCE], "top": "6", "ids_only": True, "normalize": "unit"}
    response = client.post("/v1/select", json=body)
    assert response.status_code == 200, response.text
    rows = [json.loads(line) for line in response.content.decode().splitlines()]
    targets = Question(queries=({"text": QUERY}, PREFERENCE), normalize="unit")
    picked = select_documents(served_index, targets, SelectOptions(top="6"))
    assert [r["id"] for r in rows] == served_index.stored.rows(picked.rowaddr, ["id"]).column("id").to_pylist()
    assert [r["score"] for r in rows] == pytest.approx(picked.scores.tolist(), rel=1e-5)
    assert _error(client.post("/v1/select", json={**body, "normalize": "l2"}), 422, "normalize")


#: Filters Lance alone would drop or answer wrongly: text left over, a second statement, a
#: comparison of two strings (names take backticks, not double quotes).
BROKEN_FILTERS = ("kind = 'function' ANDD n_chars > 380", "1=1; DROP TABLE x", "\"kind\" = 'function'")


@pytest.mark.parametrize("where", BROKEN_FILTERS)
def test_query_and_select_refuse_a_broken_filter_as_the_library_does(client, served_index, where):
    from eogp_index.errors import InputError
    from eogp_index.search.question import Question, check_question

    with pytest.raises(InputError) as caught:
        check_question(Question(queries=(QUERY,), where=where), served_index.stored)
    expected = str(caught.value)
    assert _error(client.post("/v1/query", json={"text": QUERY, "where": where}), 400, "where") == expected
    assert _error(client.post("/v1/select", json={"queries": [QUERY], "where": where}), 400, "where") == expected


def test_select_takes_top_as_a_count_a_counted_string_or_a_share(client):
    sizes = {}
    for top in (5, "5", "10%"):
        response = client.post("/v1/select", json={"queries": [QUERY], "top": top, "ids_only": True})
        assert response.status_code == 200, response.text
        sizes[str(top)] = len(response.content.decode().splitlines())
    assert sizes["5"] == 5 and sizes["10%"] >= 1
    assert "--top" in _error(client.post("/v1/select", json={"queries": [QUERY], "top": 0}), 400, "top")


def test_a_parquet_selection_of_jsonl_shards_holds_its_rows(client):
    import io

    import pyarrow.parquet as pq

    response = client.post("/v1/select", json={"queries": [QUERY], "top": "20", "format": "parquet"})
    assert response.status_code == 200, response.text
    lines = client.post("/v1/select", json={"queries": [QUERY], "top": "20"}).content.decode().splitlines()
    table = pq.read_table(io.BytesIO(response.content))
    assert table.num_rows == len(lines) == 20
    assert table.column("id").to_pylist() == [json.loads(line)["id"] for line in lines]


def test_explain_takes_the_query_kinds_eogp_explain_takes(client, served_index):
    hit = client.post("/v1/query", json={"text": QUERY, "k": 1, "direction": "positive"}).json()["results"][0]
    record = {"prompt": "t1 t2", "completion": " t3 t4 t5"}
    why = client.post("/v1/explain", json={"query": record, "id": hit["id"]})
    assert why.status_code == 200, why.text
    assert why.json()["score"] == pytest.approx(served_index.explain(record, hit["id"]).score, rel=1e-4)
    tokens = client.post("/v1/explain", json={"query": [5, 9, 13, 2], "id": hit["id"]})
    assert tokens.status_code == 200, tokens.text
    preference = {"prompt": "t1", "chosen": " t2 t3", "rejected": " t4 t5"}
    assert "preference" in _error(client.post("/v1/explain", json={"query": preference, "id": hit["id"]}), 400, "query")


def test_request_bodies_and_commands_map_onto_the_question_one_to_one():
    """Same names, same defaults: the server's bodies, the commands' options and the Question."""
    import dataclasses

    from eogp_index.cli import cli
    from eogp_index.config import SelectOptions
    from eogp_index.search.question import Question
    from eogp_index.serve.schemas import QueryRequest
    from eogp_index.serve.selection import SelectRequest

    question = {f.name: f.default for f in dataclasses.fields(Question)}
    options = {f.name: f.default for f in dataclasses.fields(SelectOptions)}
    body = {name: field.default for name, field in QueryRequest.model_fields.items()}
    assert {name: body[name] for name in question if name != "queries"} == {
        name: default for name, default in question.items() if name != "queries"
    }
    assert "queries" in body
    select = {name: field.default for name, field in SelectRequest.model_fields.items()}
    for name in ("where", "normalize"):
        assert select[name] == question[name], name
    assert {name: select[name] for name in options} == options
    assert set(select) == {"queries", "where", "normalize", "format", *options}

    def params(command):
        return {p.name: p.default for p in cli.commands[command].params}

    query = params("query")
    assert {name: query[name] for name in question if name != "queries"} == {
        name: default for name, default in question.items() if name != "queries"
    }
    for command in ("select", "scores"):
        assert {name: params(command)[name] for name in ("where", "normalize")} == {
            "where": question["where"],
            "normalize": question["normalize"],
        }
    assert {name: params("select")[name] for name in options} == options


def test_rescored_hits_carry_both_scores_and_explain_shows_the_ranked_one(client, served_index):
    """The served index has a rescoring tier: each hit's score is the tier's, score_1bit the scan's;
    explain's module terms sum to the rescored score, and it shows the one-bit score beside it."""
    assert served_index.stored.tier is not None
    body = {"text": QUERY, "k": 3, "direction": "both", "by_module": True}
    rows = client.post("/v1/query", json=body).json()["results"]
    assert rows and all("score_1bit" in r for r in rows)
    for row in rows:
        assert (row["score"] > 0) == (row["direction"] == "positive")  # the sides keep their signs
        assert sum(row["modules"].values()) == pytest.approx(row["score"], rel=1e-4, abs=1e-5)
        why = client.post("/v1/explain", json={"query": QUERY, "id": row["id"]}).json()
        assert why["score"] == pytest.approx(row["score"], rel=1e-4, abs=1e-5)
        assert sum(why["modules"].values()) == pytest.approx(why["score"], rel=1e-4, abs=1e-5)
        assert why["score_1bit"] == pytest.approx(row["score_1bit"], rel=1e-4, abs=1e-5)
    off = client.post("/v1/query", json={**body, "rescore": 0}).json()["results"]
    assert off and not any("score_1bit" in r for r in off)
    for row in off:  # the one-bit ranking's scores are the scan's
        assert sum(row["modules"].values()) == pytest.approx(row["score"], rel=1e-4, abs=1e-5)


def test_select_with_precision_rescore_downloads_the_tier_selection(client, served_index):
    from eogp_index.config import SelectOptions
    from eogp_index.search.question import Question
    from eogp_index.search.select import select_documents

    body = {"queries": [QUERY], "top": "5", "ids_only": True, "precision": "rescore"}
    response = client.post("/v1/select", json=body)
    assert response.status_code == 200, response.text
    rows = [json.loads(line) for line in response.content.decode().splitlines()]
    picked = select_documents(
        served_index, Question(queries=({"text": QUERY},)), SelectOptions(top="5", precision="rescore")
    )
    assert [r["id"] for r in rows] == served_index.stored.rows(picked.rowaddr, ["id"]).column("id").to_pylist()
    assert [r["score"] for r in rows] == pytest.approx(picked.scores.tolist(), rel=1e-5)
    one_bit = select_documents(served_index, Question(queries=({"text": QUERY},)), SelectOptions(top="5"))
    assert picked.scores.tolist() != pytest.approx(one_bit.scores.tolist(), rel=1e-4)
    assert "rescore" in _error(client.post("/v1/select", json={**body, "precision": "2bit"}), 422, "precision")


def test_batched_requests_of_different_k_get_their_own_rescored_answers(served_index):
    """A rescored top k is the best k of the one-bit top rescore·k: a request batched with a larger
    k gets what it gets alone, not a cut of the larger request's rescored list."""
    from eogp_index.search.question import Question
    from eogp_index.serve.engine import Engine, QueryJob, cut_to_k

    engine = Engine(served_index, ServeConfig())
    texts = [f"t{i} t{i + 1} t{i + 2} t{i + 5}" for i in range(1, 60, 4)]

    def job(text, k):
        return QueryJob(Question(queries=({"text": text},), k=k, direction="both", rescore=1), "text")

    together = engine.run_queries([job(text, k) for text in texts for k in (1, 8)])
    alone = [engine.run_queries([job(text, 1)])[0] for text in texts]
    cut = [cut_to_k(engine.run_queries([job(text, 8)])[0].results, 1) for text in texts]
    for j, text in enumerate(texts):  # (the batch's one gradient pass rounds each query's y a little apart)
        got, want = together[2 * j].results.to_pylist(), alone[j].results.to_pylist()
        assert [(r["direction"], r["id"]) for r in got] == [(r["direction"], r["id"]) for r in want], text
        assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], rel=1e-4)
        assert together[2 * j + 1].results.num_rows > alone[j].results.num_rows
    # A cut of the larger rescored list differs somewhere (what sharing one scan would have answered).
    assert any(c.column("id").to_pylist() != a.results.column("id").to_pylist() for c, a in zip(cut, alone))
