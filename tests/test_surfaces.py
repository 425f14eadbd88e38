"""A fuzzer over every surface: generated inputs, run through every registered surface.

The inputs are generated, not listed: from the record kinds (:data:`RECORD_KINDS`: each kind's
fields, text fields and chat fields), from the index's metadata columns (one of every type) and
from the question's options and their types (:data:`OPTIONS`):

* a lone surrogate (``"\\ud800"`` as JSON writes it) in every text field of every kind, as a
  string and in a chat's ``role`` and ``content``; in the id, string metadata and list items;
* filters broken four ways (a syntax error, a second statement, a quoted identifier that
  Lance's dialect reads as a string, an unknown column) and a type mismatch, one column each;
* nulls, lists, lists with nulls and nested lists in every metadata type;
* types at the edges: each content field given another JSON type, each option a value of
  another type, zero, negative or beyond int64.

The surfaces are registered, one small :class:`Surface` subclass each: the CLI (``eogp ingest``,
``query --queries``, ``select``, ``scores``, ``explain``, ``delete --where``, through click's
runner), the server (``/v1/query``, ``/v1/select``, ``/v1/explain``, ``/v1/examples/{id}``,
``DELETE /v1/examples``, the real app through Starlette's client) and the library
(``AttributionIndex`` search, scores and explain; the takedown; ``run_ingest``). The takedowns
delete on private copies of the index, the server's only what every surface refuses. Each turns an input into an :class:`Outcome`: answered (the answer's ids),
refused (the error, and the field where the surface names one) or broken (a 5xx, a traceback,
an exception outside :class:`EOGPError`). A new record kind or option joins by being in
``RECORD_KINDS`` or ``OPTIONS``, a new surface by subclassing :class:`Surface`.

The checks: no surface is ever broken; an input the generator knows the fate of (invalid
Unicode, a broken filter, a value of the wrong type) gets it on every surface, naming its field;
and the surfaces of one family (search, select, scores, explain, delete, ingest) agree on every input:
the same ids (a takedown: the same rows deleted), or all refuse, naming the same field.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, FrozenSet, List, Optional, Tuple

import pytest
from click.testing import CliRunner
from oddtext import is_text
from tinymodels import make_tiny_gpt2, make_word_tokenizer

from eogp_index.config import SelectOptions
from eogp_index.data.records import RECORD_KINDS, RecordKind
from eogp_index.errors import EOGPError
from eogp_index.search.question import question_field

__import__("transformers").logging.set_verbosity_error()
__import__("transformers").utils.logging.disable_progress_bar()

SEED = 20261128
SURROGATE = "\ud800"
#: A chat template for the word tokenizer: the role is a word, the assistant's turn follows
#: "assistant " (which a generation prompt writes).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
#: The index's metadata columns, one of every type: a value of each (its type) and the documents.
COLUMNS: Dict[str, Any] = {"kind": "function", "n": 3, "x": 0.5, "flag": True, "tags": ["function", "t"]}
DOCUMENTS = 40
#: The question's options: their declared JSON types and the value every input starts from.
OPTIONS: Dict[str, Tuple[Tuple[type, ...], Any]] = {
    "k": ((int,), 5),
    "direction": ((str,), "positive"),
    "where": ((str, type(None)), None),
    "top": ((int, str), "5"),
    "id": ((str,), "doc-1"),
    "rescore": ((int, type(None)), question_field("rescore").default),
    "precision": ((str,), SelectOptions.precision),
    "allow_partial": ((bool,), question_field("allow_partial").default),
    "checkpoint_weights": ((list, type(None)), question_field("checkpoint_weights").default),
}
BASE_QUERY = {"text": "t1 t2 t3 t4 t5"}
WRITE_TOKEN = "fuzz-writer"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(1, 64)}" for _ in range(n))


def _document(i: int) -> Dict[str, Any]:
    kinds = ("function", "class", "module")
    return {
        "id": f"doc-{i}",
        "text": " ".join(f"t{(i * 7 + j * 3) % 63 + 1}" for j in range(6 + i % 11)),
        "kind": kinds[i % 3] if i % 7 else None,
        "n": i,
        "x": i / 4,
        "flag": i % 2 == 0,
        "tags": [kinds[i % 3], None if i % 5 == 0 else "t"] if i % 9 else None,
    }


# -- inputs -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Input:
    """One generated input.

    area: ``query`` (a question: its record and options) or ``record`` (a document to ingest).
    record: the query or document record, JSON-like. options: the options changed from
    :data:`OPTIONS`' values, as ``(name, value)`` pairs. refused: what every surface taking it
    must do, when the generator knows (True: refuse; False: answer). field: the field a refusal
    must name, on surfaces that name fields. group: the inputs a batch that breaks is split into
    before each input is run alone (its kind and what was done to it). kind: the record kind
    of its record (:data:`RECORD_KINDS`).
    """

    label: str
    area: str
    record: Any
    options: Tuple[Tuple[str, Any], ...] = ()
    refused: Optional[bool] = None
    field: Optional[str] = None
    group: str = ""
    kind: str = ""

    @property
    def parts(self) -> FrozenSet[str]:
        """What this input changes: ``record`` and the options it sets."""
        changed = {name for name, _ in self.options}
        return frozenset(changed | ({"record"} if self.record != BASE_QUERY else set()))

    def option(self, name: str) -> Any:
        return dict(self.options).get(name, OPTIONS[name][1])


def _turns(field_name: str, content: str) -> List[Dict[str, str]]:
    """A chat value of a record field: a user turn for a prompt, an assistant turn for the rest."""
    if field_name == "messages":
        return [{"role": "user", "content": content}, {"role": "assistant", "content": "t9 t8"}]
    return [{"role": "user" if field_name == "prompt" else "assistant", "content": content}]


def _forms(kind: RecordKind) -> List[str]:
    """How a kind's text fields may be written: as strings, as chats, or neither (token ids)."""
    return [form for form, fields in (("text", kind.text_fields), ("chat", kind.chat_fields)) if fields]


def valid_record(kind: RecordKind, form: str, rng: random.Random) -> Dict[str, Any]:
    """A good record of ``kind`` with its text fields written as ``form`` (text or chat)."""
    record: Dict[str, Any] = {}
    for name in kind.fields:
        if name == "input_ids":
            record[name] = [rng.randrange(1, 64) for _ in range(6)]
        elif form == "chat":
            record[name] = _turns(name, _words(rng, 3))
        else:  # a prompt ends with a space, so that its words never merge with the completion's
            record[name] = _words(rng, 3) + (" " if name == "prompt" else "")
    return record


def _with_surrogate(value: str) -> str:
    at = len(value) // 2
    return value[:at] + SURROGATE + value[at:]


def query_inputs(rng: random.Random) -> List[Input]:
    """Every kind and form, good; a surrogate in each of its text fields (and each chat role and
    content); each content field given a value of another type."""
    inputs = []
    for kind in RECORD_KINDS:
        for form in _forms(kind) or ["tokens"]:
            good = valid_record(kind, form, rng)
            inputs.append(Input(f"{kind.name} ({form})", "query", good, refused=False, group="good", kind=kind.name))
            for name in kind.text_fields if form == "text" else kind.chat_fields if form == "chat" else ():
                if form == "text":
                    bad = {**good, name: _with_surrogate(good[name])}
                    label = f"surrogate in {kind.name}.{name}"
                    inputs.append(Input(label, "query", bad, refused=True, field=name, group=label, kind=kind.name))
                    continue
                for key in ("role", "content"):
                    turns = [dict(turn) for turn in good[name]]
                    turns[0][key] = _with_surrogate(turns[0][key])
                    label = f"surrogate in {kind.name}.{name}[0].{key}"
                    turns = {**good, name: turns}
                    inputs.append(
                        Input(label, "query", turns, refused=True, field=name, group=label[:-5], kind=kind.name)
                    )
        inputs += _content_edges(kind, valid_record(kind, (_forms(kind) or ["tokens"])[0], rng), rng)
    text = BASE_QUERY["text"]
    odd = text[:2] + "\x00" + text[2:] + "\ufffe"  # unusual code points, but text: kept as they are
    inputs.append(Input("NUL and U+FFFE in text", "query", {"text": odd}, refused=not is_text(odd), kind="text"))
    return inputs


#: Values of the wrong JSON type, and item values for lists of token ids.
WRONG_TYPES = [5, -1, 2**63, 1.5, True, [], {"a": 1}]
WRONG_ITEMS = ["1", -5, 2**63, 1.5, 10**6]


def _content_edges(kind: RecordKind, good: Dict[str, Any], rng: random.Random) -> List[Input]:
    inputs = []
    for name in kind.fields + kind.optional:
        if name in ("input_ids", "labels"):
            item = rng.choice(WRONG_ITEMS)
            ids = list(good.get("input_ids", [1, 2, 3, 4]))
            ids[1] = item
            label = f"{kind.name}.{name}[1] = {item!r}"
            inputs.append(
                Input(label, "query", {**good, name: ids}, refused=True, field=name, group=kind.name, kind=kind.name)
            )
        else:
            value = rng.choice(WRONG_TYPES)
            label = f"{kind.name}.{name} = {value!r}"
            inputs.append(
                Input(label, "query", {**good, name: value}, refused=True, field=name, group=kind.name, kind=kind.name)
            )
    return inputs


def filter_inputs() -> List[Input]:
    """A good filter on every metadata column (``IS NOT NULL``); on each column, one of the
    filters broken four ways or with a type mismatch."""
    inputs = []
    every = " AND ".join(f"{column} IS NOT NULL" for column in COLUMNS)
    inputs.append(Input(f"where {every}", "query", BASE_QUERY, (("where", every),), kind="text"))
    broken = [  # in the columns' order: the quoted identifier on a string column, the mismatch on a number
        ("a quoted identifier", lambda c, v: f'"{c}" = {v}', True),
        ("a type mismatch", lambda c, v: f"{c} = {'3' if isinstance(COLUMNS[c], str) else repr('three')}", None),
        ("a syntax error", lambda c, v: f"{c} = {v} ANDD n > 3", True),
        ("a second statement", lambda c, v: f"{c} = {v}; DROP TABLE x", True),
        ("an unknown column", lambda c, v: f"{c}_nosuch = {v}", True),
    ]
    for column, (how, make, refused) in zip(COLUMNS, broken):
        value = COLUMNS[column]
        literal = repr(value[0] if isinstance(value, list) else value)
        literal = literal.lower() if isinstance(value, bool) else literal
        where = make(column, literal)
        inputs.append(
            Input(f"where with {how}: {where}", "query", BASE_QUERY, (("where", where),), refused, "where", kind="text")
        )
    return inputs


def _option_input(name: str, value: Any, refused: Optional[bool]) -> Input:
    """The base query with option ``name`` set to ``value``; a refusal names ``name``."""
    return Input(f"{name} = {value!r}", "query", BASE_QUERY, ((name, value),), refused, name, kind="text")


def option_inputs() -> List[Input]:
    """Each option that takes a number or a name: zero, negative, beyond int64, and its value
    spelled as another JSON type (refused unless that type is one of the option's: ``"top": 5``);
    an id that is no document's, or holds a surrogate."""
    inputs = []
    for name, (types, value) in OPTIONS.items():
        if name in ("direction", "where", "rescore", "precision", "allow_partial", "checkpoint_weights"):
            continue
        other = int(value) if isinstance(value, str) and value.isdigit() else str(value) if value else 7
        other = 7 if name == "id" else other
        edges = [0, -1, 2**63, other] + (["nosuch", _with_surrogate("doc-1")] if name == "id" else [])
        for edge in edges:
            # a value in its types but spelled otherwise is answered as written the usual way
            refused = not isinstance(edge, types) or edge in ("nosuch", -1) or SURROGATE in str(edge)
            refused = refused or (None if edge != other else False)
            inputs.append(_option_input(name, edge, refused))
    return inputs


def rescore_inputs() -> List[Input]:
    """The rescoring factor at its edges (the index has a rescoring tier): none, one, the
    default, more than the rows (every row rescored) answer; negative, beyond int64 and the
    other JSON types are refused. The scoring precision of select and scores: both names
    answer, another name or type is refused."""
    default = OPTIONS["rescore"][1]
    values = [(0, False), (1, False), (10**6, False), (-1, True), ("5", True), (1.5, True), (2**63, True), (True, True)]
    inputs = [_option_input("rescore", value, refused) for value, refused in values]
    label = f"rescore = {default!r} (the default)"
    inputs.append(Input(label, "query", BASE_QUERY, (("rescore", default),), False, kind="text"))
    for value, refused in (("1bit", False), ("rescore", False), ("2bit", True), (1, True), (None, True)):
        inputs.append(_option_input("precision", value, refused))
    return inputs


def allow_partial_inputs() -> List[Input]:
    """Whether a sharded server may answer without a missing shard: either boolean answers (one
    process holds every row and ignores it); any other JSON type is refused, naming the field."""
    values = [(True, False), (False, False), ("true", True), (1, True), (None, True)]
    return [_option_input("allow_partial", v, refused) for v, refused in values]


def checkpoint_weights_inputs() -> List[Input]:
    """Each checkpoint's weight, on an index of one checkpoint: one finite number answers; none,
    two, a name, a boolean, or a number not in a list are refused, naming the field."""
    values = [([1.0], False), ([2], False), ([0.5], False), ([], True), ([1.0, 1.0], True), (["x"], True)]
    values += [([True], True), (1.0, True), ("1", True)]
    return [_option_input("checkpoint_weights", v, refused) for v, refused in values]


def record_inputs() -> List[Input]:
    """Documents to ingest: each stored kind, good; a surrogate in each text field, the id, string
    metadata and list items; nulls, lists and other types in every metadata column; ids at the
    edges."""
    rng = random.Random(SEED + 1)
    inputs: List[Input] = []

    def add(label: str, record: Dict[str, Any], refused: Optional[bool], group: str) -> None:
        row = {"id": f"new-{len(inputs)}", **dict(COLUMNS), **record}
        inputs.append(Input(label, "record", row, refused=refused, group=group))

    for kind in RECORD_KINDS:
        if kind.query_only:
            continue
        for form in _forms(kind) or ["tokens"]:
            good = valid_record(kind, form, rng)
            add(f"document {kind.name} ({form})", good, False, "good")
            for name in kind.text_fields if form == "text" else kind.chat_fields if form == "chat" else ():
                if form == "text":
                    label = f"document with a surrogate in {kind.name}.{name}"
                    add(label, {**good, name: _with_surrogate(good[name])}, True, label)
                    continue
                for key in ("role", "content"):
                    turns = [dict(turn) for turn in good[name]]
                    turns[0][key] = _with_surrogate(turns[0][key])
                    label = f"document with a surrogate in {kind.name}.{name}"
                    add(f"{label}[0].{key}", {**good, name: turns}, True, label)
    text = {"text": _words(rng, 5)}
    for value, refused in (
        (_with_surrogate("doc"), True),
        (7, None),
        (-1, None),
        (2**70, None),
        ("", True),
        (2.5, True),
    ):
        inputs.append(
            Input(f"document id = {value!r}", "record", {**COLUMNS, **text, "id": value}, refused=refused, group="id")
        )
    others = {"str": "5", "int": 5, "float": 2.5, "bool": True}
    for column, value in COLUMNS.items():
        scalar = value[0] if isinstance(value, list) else value
        values: List[Tuple[Any, Optional[bool]]] = [(None, False), ([scalar], None), ([scalar, None], None)]
        values += [([[scalar]], True), ({"a": scalar}, True)]
        values += [(v, None) for t, v in others.items() if t != type(scalar).__name__]
        if isinstance(scalar, str):
            values += [(_with_surrogate(scalar), True), ([_with_surrogate(scalar)], True)]
        if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
            values += [(2**63, None), (-(2**63), None), (2**64, True)]
        for bad, refused in values:
            add(f"document {column} = {bad!r}", {**text, column: bad}, refused, column)
    return inputs


def generated_inputs() -> List[Input]:
    inputs = query_inputs(random.Random(SEED)) + filter_inputs() + option_inputs() + rescore_inputs()
    return inputs + allow_partial_inputs() + checkpoint_weights_inputs() + record_inputs()


# -- outcomes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What a surface made of an input: answered (``answer``, the ids), refused (``error``: the
    error class or status, ``field`` where the surface names one) or broken (``broken``: a 5xx,
    a traceback or an exception outside the hierarchy)."""

    answer: Optional[Tuple[Any, ...]] = None
    error: str = ""
    field: Optional[str] = None
    broken: str = ""
    message: str = ""

    @property
    def refused(self) -> bool:
        return self.answer is None and not self.broken

    def shown(self) -> str:
        if self.broken:
            return f"BROKEN {self.broken[:300]}"
        if self.answer is not None:
            return f"answered {list(self.answer)[:5]}"
        return f"refused {self.error} field={self.field} {self.message[:160]!r}"


def _root_field(name: Optional[str]) -> Optional[str]:
    """The record field a surface's field names: ``messages[0].role`` and ``query.prompt`` name
    ``messages`` and ``prompt``; a bare ``query`` or ``queries`` names no field of the record."""
    if not name:
        return None
    name = re.sub(r"^(query|queries(\[\d+\])?)\.?", "", name)
    return re.split(r"[.\[]", name)[0] or None


def _library_outcome(call) -> Outcome:
    try:
        return Outcome(answer=tuple(call()))
    except EOGPError as exc:
        return Outcome(error=type(exc).__name__, field=_root_field(getattr(exc, "field", None)), message=str(exc))
    except Exception as exc:  # noqa: BLE001 - what the fuzzer is looking for
        return Outcome(broken=f"{type(exc).__name__}: {exc}")


def _http_outcome(env: "Env", response, answer) -> Outcome:
    if response.status_code >= 500 or "Traceback" in response.text:
        request_id = re.search(r"request_id (\d+)", response.text)
        cause = env.server_errors.get(request_id.group(1) if request_id else "", response.text[:200])
        return Outcome(broken=f"HTTP {response.status_code}: {cause}", message=response.text[:200])
    if response.status_code != 200:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return Outcome(broken=f"HTTP {response.status_code} without an error body: {response.text[:200]}")
        return Outcome(
            error=str(response.status_code), field=_root_field(error.get("field")), message=error.get("message", "")
        )
    return Outcome(answer=tuple(answer(response)))


def _cli_outcome(result, answer) -> Outcome:
    if (result.exception is not None and not isinstance(result.exception, SystemExit)) or "Traceback" in result.output:
        return Outcome(broken=f"{type(result.exception).__name__}: {result.exception}", message=result.output[-300:])
    if result.exit_code != 0:
        return Outcome(error=f"exit {result.exit_code}", message=result.stderr.strip()[-300:])
    return Outcome(answer=tuple(answer(result)))


def _top_ids(ids: List[str], scores: List[float], k: int) -> List[str]:
    """The ``k`` best ids of a score vector, best first (ties by id)."""
    return [i for _, i in sorted(zip((-s for s in scores), ids))[:k]]


# -- the environment: one tiny index, its server and its files --------------------------------------
@dataclass
class Env:
    root: Path
    index_dir: Path
    library: Any
    client: Any
    server_errors: Dict[str, str] = field(default_factory=dict)
    calls: Dict[str, int] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        path = self.root / "work" / name
        path.parent.mkdir(exist_ok=True)
        return path

    def fresh_copy(self) -> Path:
        """A private copy of the index, for a surface that writes."""
        path = self.file(f"copy-{sum(self.calls.values())}-{time.monotonic_ns()}")
        shutil.copytree(self.index_dir, path)
        return path

    def cli(self, *args: str):
        from eogp_index.cli import cli

        return CliRunner().invoke(cli, [str(a) for a in args])


def build_index(root: Path):
    """The index of :func:`env` under ``root``, opened."""
    from eogp_index.data.records import RecordSpec
    from eogp_index.serve.app import open_index
    from eogp_index.store.sources import DEFAULT_TEXT_BYTES
    from ingest.pipeline import run_ingest

    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    make_tiny_gpt2().save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    shard = root / "shard.jsonl"
    shard.write_text("".join(json.dumps(_document(i)) + "\n" for i in range(DOCUMENTS)))
    fit = CliRunner().invoke(
        __import__("eogp_index.cli", fromlist=["cli"]).cli,
        ["fit", str(root / "model"), "--data", str(shard), "--out", str(root / "idx"), "-k", "16"]
        + ["--curvature-examples", "40", "--pca-examples", "40", "--max-tokens", "24"],
    )
    assert fit.exit_code == 0, fit.output
    index = open_index(root / "idx", device="cpu")
    spec = RecordSpec(id_field="id", metadata_fields=tuple(COLUMNS))
    summary = run_ingest(index, [shard], spec=spec, store_text=DEFAULT_TEXT_BYTES, progress=False)
    assert summary.stored == DOCUMENTS, summary
    return index


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny GPT-2 with a word tokenizer (and a chat template), fitted with ``eogp fit`` on 40
    documents whose metadata holds one column of each type (with nulls), ingested with their
    text; opened once for the library and the server."""
    pytest.importorskip("fastapi", reason="the serve extra: pip install 'eogp-index[serve]'")
    from fastapi.testclient import TestClient

    from eogp_index.serve.app import create_app
    from eogp_index.serve.config import ServeConfig

    root = tmp_path_factory.mktemp("surfaces")
    index = build_index(root)
    # The server's own limits are test_fuzz.py's; here the surfaces' checks. The write token opens
    # DELETE /v1/examples (and changes nothing for the other routes: no read token is set).
    config = ServeConfig(max_k=2**64, write_token=WRITE_TOKEN)
    with TestClient(create_app(index, config), raise_server_exceptions=False) as client:
        env = Env(root, root / "idx", index, client)
        log, errors = logging.getLogger("eogp.serve"), ServerErrors(env.server_errors)
        log.addFilter(errors)
        try:
            yield env
        finally:
            log.removeFilter(errors)


class ServerErrors(logging.Filter):
    """The exception behind each of the server's 500s, by request id (the answer names only the
    id). It keeps the server's error records out of the test's log: the report names each one."""

    def __init__(self, found: Dict[str, str]):
        super().__init__()
        self.found = found

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.exc_info and record.exc_info[1] is not None:
            request_id = str(getattr(record, "fields", {}).get("request_id"))
            self.found[request_id] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        return False


# -- surfaces ---------------------------------------------------------------------------------------
class Surface:
    """One way into the product. A subclass with a ``name`` is registered.

    family: surfaces of one family answer the same question (their answers are compared).
    area: the inputs it takes (``query`` or ``record``). reads: what of an input it reads
    (``record`` and option names); it takes an input that changes nothing else. kinds: the
    record kinds it takes (None: every kind). typed: whether
    it can tell JSON types apart (a CLI flag or a URL path is text: it takes an option only in
    its declared types). batched: ``call`` answers several inputs at once (those asking the same
    options); a call it cannot split into outcomes (None), or one that breaks, is run again one
    input at a time.
    """

    registry: ClassVar[Dict[str, type]] = {}
    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    area: ClassVar[str] = "query"
    reads: ClassVar[FrozenSet[str]] = frozenset()
    kinds: ClassVar[Optional[FrozenSet[str]]] = None
    typed: ClassVar[bool] = True
    batched: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            Surface.registry[cls.name] = cls

    def __init__(self, env: Env):
        self.env = env

    @classmethod
    def takes(cls, item: Input) -> bool:
        if item.area != cls.area or not item.parts <= cls.reads:
            return False
        if cls.kinds is not None and item.kind and item.kind not in cls.kinds:
            return False
        return cls.typed or all(isinstance(v, OPTIONS[k][0]) and not isinstance(v, bool) for k, v in item.options)

    def call(self, items: List[Input]) -> Optional[List[Outcome]]:
        raise NotImplementedError

    def outcomes(self, items: List[Input]) -> List[Outcome]:
        """Every item's outcome: batched by the options asked where the surface allows it."""
        if not self.batched:
            return [self.call([item])[0] for item in items]
        groups: Dict[str, List[int]] = {}
        for i, item in enumerate(items):
            asked = [(k, v) for k, v in item.options if k != "record"]
            groups.setdefault(repr(asked), []).append(i)
        found: Dict[int, Outcome] = {}
        for positions in groups.values():
            found.update(zip(positions, self._split([items[i] for i in positions], by_group=True)))
        return [found[i] for i in range(len(items))]

    def _split(self, batch: List[Input], *, by_group: bool) -> List[Outcome]:
        """``call(batch)``; a call that cannot be split into outcomes, or that breaks, again by
        group and then one input at a time, so that every input keeps its own outcome."""
        answers = self.call(batch)
        if len(batch) == 1 or (answers is not None and not any(a.broken for a in answers)):
            return answers
        groups: Dict[str, List[int]] = {}
        for i, item in enumerate(batch):
            groups.setdefault(item.group if by_group else str(i), []).append(i)
        if len(groups) == 1:
            groups = {str(i): [i] for i in range(len(batch))}
        found: Dict[int, Outcome] = {}
        for positions in groups.values():
            found.update(zip(positions, self._split([batch[i] for i in positions], by_group=False)))
        return [found[i] for i in range(len(batch))]


def _jsonl(path: Path, records: List[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # ensure_ascii: "\ud800" stays an escape
    return path


def _where(item: Input) -> List[str]:
    where = item.option("where")
    return ["--where", where] if where is not None else []


def _option(item: Input, name: str) -> List[str]:
    """``--name value``, or nothing for an option left at None (a flag cannot say None)."""
    value = item.option(name)
    return [f"--{name}", value] if value is not None else []


def _weights(item: Input) -> List[str]:
    """``--checkpoint-weights w1,w2``, or nothing for the index's own."""
    value = item.option("checkpoint_weights")
    return ["--checkpoint-weights", ",".join(map(str, value))] if value is not None else []


class CliQuery(Surface):
    name, family, batched, typed = "eogp query --queries", "search", True, False
    reads = frozenset({"record", "k", "where", "direction", "rescore", "checkpoint_weights"})

    def call(self, items):
        queries = _jsonl(self.env.file("queries.jsonl"), [item.record for item in items])
        first = items[0]
        result = self.env.cli(
            "query", self.env.index_dir, "--queries", queries, "-k", first.option("k"),
            "--direction", first.option("direction"), *_where(first), *_option(first, "rescore"),
            *_weights(first), "--json",
        )  # fmt: skip
        whole = _cli_outcome(result, lambda r: [])
        if whole.broken or not result.stdout.strip():
            return [whole] * len(items)
        bad = dict(re.findall(r"queries\.jsonl:(\d+): (.*)", result.stderr))
        answers = iter(json.loads(result.stdout))
        return [
            Outcome(error="exit 1", message=bad[str(line)])
            if str(line) in bad
            else Outcome(answer=tuple(row["id"] for row in next(answers)["results"]))
            for line in range(1, len(items) + 1)
        ]


class CliSelect(Surface):
    name, family, typed = "eogp select", "select", False
    reads = frozenset({"record", "top", "where", "precision"})

    def call(self, items):
        (item,) = items
        out = self.env.file("selection.jsonl")
        out.unlink(missing_ok=True)
        result = self.env.cli(
            "select", self.env.index_dir, "--queries", _jsonl(self.env.file("targets.jsonl"), [item.record]),
            "--top", item.option("top"), *_where(item), *_option(item, "precision"), "--ids-only", "--out", out,
        )  # fmt: skip
        return [_cli_outcome(result, lambda r: [json.loads(line)["id"] for line in out.read_text().splitlines()])]


class CliScores(Surface):
    name, family, batched, typed = "eogp scores", "scores", True, False
    reads = frozenset({"record", "where", "precision"})

    def call(self, items):
        import pyarrow.parquet as pq

        out = self.env.file("scores.parquet")
        out.unlink(missing_ok=True)
        queries = _jsonl(self.env.file("probes.jsonl"), [item.record for item in items])
        asked = [*_where(items[0]), *_option(items[0], "precision")]
        result = self.env.cli("scores", self.env.index_dir, "--queries", queries, *asked, "--out", out)
        whole = _cli_outcome(result, lambda r: [])
        if whole.answer is None:
            return None if len(items) > 1 else [whole]
        rows = pq.read_table(out).to_pylist()
        return [
            Outcome(
                answer=tuple(
                    _top_ids(
                        [r["id"] for r in rows if r["query"] == q], [r["score"] for r in rows if r["query"] == q], 5
                    )
                )
            )
            for q in range(len(items))
        ]


#: What explain takes: one document's score for one measurement, by token; a preference query
#: (query_only: the difference of two measurements) is answered by query, select and scores.
EXPLAINED = frozenset(kind.name for kind in RECORD_KINDS if not kind.query_only)


class CliExplain(Surface):
    name, family, typed = "eogp explain", "explain", False
    reads, kinds = frozenset({"record", "id"}), EXPLAINED

    def call(self, items):
        (item,) = items
        queries = _jsonl(self.env.file("explain.jsonl"), [item.record])
        result = self.env.cli("explain", self.env.index_dir, "--queries", queries, "--id", item.option("id"), "--json")
        return [_cli_outcome(result, lambda r: [(e["id"], f"{e['score']:.4g}") for e in json.loads(r.stdout)])]


class CliIngest(Surface):
    name, family, area, batched = "eogp ingest", "ingest", "record", True
    reads = frozenset({"record"})

    def ingest(self, path: Path, shard: Path, rejects: Path):
        metadata = [arg for column in COLUMNS for arg in ("--metadata", column)]
        result = self.env.cli(
            "ingest", path, shard, "--on-error", "skip", "--rejects", rejects, "--id-field", "id", *metadata,
            "--store-text", "--json",
        )  # fmt: skip
        return _cli_outcome(result, lambda r: [])

    def call(self, items):
        path = self.env.fresh_copy()
        shard, rejects = _jsonl(path / "new.jsonl", [item.record for item in items]), path / "rejects.jsonl"
        whole = self.ingest(path, shard, rejects)
        if whole.answer is None:
            return None if len(items) > 1 else [whole]
        return _ingested(path, items, rejects)


def _ingested(path: Path, items: List[Input], rejects: Path) -> List[Outcome]:
    """Each record's outcome after an ingest with ``on_error="skip"``: its reject, or its stored id."""
    from eogp_index.store.stored_index import StoredIndex

    rejected = {}
    if rejects.exists():
        for line in rejects.read_text().splitlines():
            row = json.loads(line)
            rejected[row["position"]] = row["reason"]
    stored = set(StoredIndex.open(path).store.read(["id"]).column("id").to_pylist())
    outcomes = []
    for position, item in enumerate(items):
        record_id = str(item.record.get("id"))
        if position in rejected:
            outcomes.append(Outcome(error="rejected", message=rejected[position]))
        else:
            outcomes.append(Outcome(answer=(record_id if record_id in stored else "neither stored nor rejected",)))
    return outcomes


class HttpQuery(Surface):
    name, family = "/v1/query", "search"
    reads = frozenset({"record", "k", "where", "direction", "rescore", "allow_partial", "checkpoint_weights"})

    def call(self, items):
        (item,) = items
        body = {
            **item.record,
            "k": item.option("k"),
            "direction": item.option("direction"),
            "where": item.option("where"),
            "rescore": item.option("rescore"),
            "allow_partial": item.option("allow_partial"),
            "checkpoint_weights": item.option("checkpoint_weights"),
        }
        response = _post(self.env.client, "/v1/query", body)
        return [_http_outcome(self.env, response, lambda r: [row["id"] for row in r.json()["results"]])]


class HttpSelect(Surface):
    name, family = "/v1/select", "select"
    reads = frozenset({"record", "top", "where", "precision"})

    def call(self, items):
        (item,) = items
        body = {"queries": [item.record], "top": item.option("top"), "where": item.option("where"), "ids_only": True}
        body["precision"] = item.option("precision")
        response = _post(self.env.client, "/v1/select", body)
        return [_http_outcome(self.env, response, lambda r: [json.loads(line)["id"] for line in r.text.splitlines()])]


class HttpExplain(Surface):
    name, family = "/v1/explain", "explain"
    reads, kinds = frozenset({"record", "id"}), EXPLAINED

    def call(self, items):
        (item,) = items
        response = _post(self.env.client, "/v1/explain", {"query": item.record, "id": item.option("id")})
        return [_http_outcome(self.env, response, lambda r: [(r.json()["id"], f"{r.json()['score']:.4g}")])]


class HttpExample(Surface):
    name, family, typed = "/v1/examples/{id}", "example", False
    reads = frozenset({"id"})

    def call(self, items):
        from urllib.parse import quote

        (item,) = items
        path = "/v1/examples/" + quote(str(item.option("id")), safe="", errors="surrogatepass")
        response = self.env.client.get(path)
        return [_http_outcome(self.env, response, lambda r: [r.json()["id"]])]


class HttpDelete(Surface):
    """A takedown by filter, on the server (with its write token). It deletes from the index every
    other surface reads, so it takes only the inputs every surface must refuse."""

    name, family = "DELETE /v1/examples", "delete"
    reads = frozenset({"where"})

    @classmethod
    def takes(cls, item: Input) -> bool:
        return item.refused is True and item.option("where") is not None and super().takes(item)

    def call(self, items):
        (item,) = items
        headers = {"content-type": "application/json", "authorization": f"Bearer {WRITE_TOKEN}"}
        body = json.dumps({"where": item.option("where")}).encode()
        response = self.env.client.request("DELETE", "/v1/examples", content=body, headers=headers)
        return [_http_outcome(self.env, response, lambda r: [r.json()["rows_deleted"]])]


def _post(client, path: str, body: Dict[str, Any]):
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


class LibrarySearch(Surface):
    name, family = "AttributionIndex.search", "search"
    reads = frozenset({"record", "k", "where", "direction", "rescore", "checkpoint_weights"})

    def call(self, items):
        (item,) = items

        def ids():
            question = self.env.library.search(item.record).where(item.option("where")).rescore(item.option("rescore"))
            question = question.checkpoint_weights(item.option("checkpoint_weights"))
            question = question.limit(item.option("k")).direction(item.option("direction"))
            return question.to_arrow().column("id").to_pylist()

        return [_library_outcome(ids)]


class LibraryScores(Surface):
    name, family = "AttributionIndex.scores", "scores"
    reads = frozenset({"record", "where", "precision"})

    def call(self, items):
        (item,) = items

        def top():
            asked = {"where": item.option("where"), "precision": item.option("precision")}
            ids, scores = self.env.library.scores([item.record], **asked)
            return _top_ids(ids, scores[0].tolist(), 5)

        return [_library_outcome(top)]


class LibrarySelect(Surface):
    name, family = "AttributionIndex.select", "select"
    reads = frozenset({"record", "top", "where", "precision"})

    def call(self, items):
        from eogp_index.search.question import Question

        (item,) = items

        def ids():
            question = Question(queries=(item.record,), where=item.option("where"))
            options = SelectOptions(top=item.option("top"), precision=item.option("precision"))
            picked = self.env.library.select(question, options)
            return self.env.library.stored.rows(picked.rowaddr, ["id"]).column("id").to_pylist()

        return [_library_outcome(ids)]


class LibraryExplain(Surface):
    name, family = "AttributionIndex.explain", "explain"
    reads, kinds = frozenset({"record", "id"}), EXPLAINED

    def call(self, items):
        (item,) = items

        def explained():
            explanation = self.env.library.explain(item.record, item.option("id"))
            return [(explanation.id, f"{explanation.score:.4g}")]

        return [_library_outcome(explained)]


class CliDelete(Surface):
    """``eogp delete --where``, on a private copy of the index (it deletes)."""

    name, family, typed = "eogp delete --where", "delete", False
    reads = frozenset({"where"})

    @classmethod
    def takes(cls, item: Input) -> bool:
        return item.option("where") is not None and super().takes(item)

    def call(self, items):
        (item,) = items
        result = self.env.cli("delete", self.env.fresh_copy(), "--where", item.option("where"), "--json")
        return [_cli_outcome(result, lambda r: [json.loads(r.stdout)["rows_deleted"]])]


class LibraryDelete(Surface):
    """The library's takedown by filter (what ``AttributionIndex.delete`` runs), on a private copy."""

    name, family = "search.takedown.delete", "delete"
    reads = frozenset({"where"})

    @classmethod
    def takes(cls, item: Input) -> bool:
        return item.option("where") is not None and super().takes(item)

    def call(self, items):
        from eogp_index.search.takedown import delete
        from eogp_index.store.stored_index import StoredIndex

        (item,) = items
        path = self.env.fresh_copy()
        return [_library_outcome(lambda: [delete(StoredIndex.open(path), where=item.option("where")).rows_deleted])]


class LibraryIngest(Surface):
    name, family, area, batched = "run_ingest", "ingest", "record", True
    reads = frozenset({"record"})

    def call(self, items):
        from eogp_index.client import AttributionIndex
        from eogp_index.data.records import RecordSpec
        from eogp_index.store.sources import DEFAULT_TEXT_BYTES
        from ingest.pipeline import run_ingest

        path = self.env.fresh_copy()
        shard, rejects = _jsonl(path / "new.jsonl", [item.record for item in items]), path / "rejects.jsonl"
        spec = RecordSpec(id_field="id", metadata_fields=tuple(COLUMNS))
        whole = _library_outcome(
            lambda: [
                run_ingest(
                    AttributionIndex.open(path),
                    [shard],
                    spec=spec,
                    on_error="skip",
                    rejects_path=rejects,
                    store_text=DEFAULT_TEXT_BYTES,
                    progress=False,
                )
            ]
        )
        if whole.answer is None:
            return None if len(items) > 1 else [whole]
        return _ingested(path, items, rejects)


# -- the checks -------------------------------------------------------------------------------------
def run_everything(env: Env, inputs: List[Input]) -> Dict[int, Dict[str, Outcome]]:
    """``{input position: {surface name: outcome}}`` over every registered surface."""
    table: Dict[int, Dict[str, Outcome]] = {i: {} for i in range(len(inputs))}
    for name, surface_class in Surface.registry.items():
        surface = surface_class(env)
        taken = [i for i, item in enumerate(inputs) if surface.takes(item)]
        started = time.perf_counter()
        for i, outcome in zip(taken, surface.outcomes([inputs[i] for i in taken])):
            table[i][name] = outcome
        env.seconds[name] = time.perf_counter() - started
        env.calls[name] = len(taken)
    return table


#: One problem: what went wrong (the same words for the same cause), where (a surface or a
#: family), the input's label and the outcome in full.
Problem = Tuple[str, str, str, str]


def problems_of(item: Input, outcomes: Dict[str, Outcome]) -> List[Problem]:
    """What is wrong with one input's outcomes: a broken surface, a fate the generator knows not
    met, a family whose surfaces disagree."""
    found = [(f"BROKEN {_cause(o.broken)}", name, item.label, o.broken) for name, o in outcomes.items() if o.broken]
    for name, o in outcomes.items():
        if o.broken or item.refused is None:
            continue
        if item.refused and not o.refused:
            found.append((f"answered, expected a refusal naming {item.field!r}", name, item.label, o.shown()))
        elif not item.refused and o.refused:
            found.append((f"refused ({o.error}), expected an answer", name, item.label, o.shown()))
        elif item.refused and item.field and o.field and o.field != item.field:
            found.append((f"refused naming {o.field!r}, expected {item.field!r}", name, item.label, o.shown()))
    families: Dict[str, Dict[str, Outcome]] = {}
    for name, o in outcomes.items():
        if not o.broken:
            families.setdefault(Surface.registry[name].family, {})[name] = o
    for family, members in families.items():
        answered = sorted(name for name, o in members.items() if not o.refused)
        shown = "; ".join(f"{name} {o.shown()}" for name, o in members.items())
        if answered and len(answered) < len(members):
            found.append((f"answered on {', '.join(answered)} only", family, item.label, shown))
        elif len({members[name].answer for name in answered}) > 1:
            found.append(("different answers", family, item.label, shown))
        named = {name: o.field for name, o in members.items() if o.refused and o.field}
        if len(set(named.values())) > 1:
            found.append((f"refusals name different fields {sorted(set(named.values()))}", family, item.label, shown))
    return found


def _cause(broken: str) -> str:
    """A broken outcome's words without what varies between inputs (request ids)."""
    return re.sub(r"request_id \d+", "request_id N", broken)[:160]


def report(problems: List[Problem], inputs: int) -> str:
    """The problems grouped by cause, then by surface: each input once per line, one example in full."""
    causes: Dict[str, Dict[str, List[str]]] = {}
    examples: Dict[str, str] = {}
    for what, where, label, shown in problems:
        causes.setdefault(what, {}).setdefault(where, []).append(label)
        examples.setdefault(what, f"{label} on {where}: {shown[:400]}")
    lines = [f"{len({p[2] for p in problems})} of {inputs} inputs misbehave, {len(causes)} causes:"]
    for what, places in sorted(causes.items(), key=lambda kv: -sum(map(len, kv[1].values()))):
        lines.append(f"- {what}")
        lines += [f"    {where} ({len(labels)}): {' | '.join(labels)}" for where, labels in places.items()]
        lines.append(f"    e.g. {examples[what]}")
    return "\n".join(lines)


def test_the_generated_inputs_cover_every_kind_field_and_surface():
    inputs = generated_inputs()
    labels = " | ".join(item.label for item in inputs)
    for kind in RECORD_KINDS:
        for name in kind.text_fields + kind.chat_fields:
            assert f"surrogate in {kind.name}.{name}" in labels, (kind.name, name)
    for column in COLUMNS:
        assert f"document {column} = None" in labels and f"{column} IS NOT NULL" in labels, column
    assert {"eogp ingest", "eogp query --queries", "eogp select", "eogp scores", "eogp explain"} <= set(
        Surface.registry
    )
    assert {"/v1/query", "/v1/select", "/v1/explain", "/v1/examples/{id}", "run_ingest"} <= set(Surface.registry)
    assert "rescore = 2**63" not in labels and f"rescore = {2**63}" in labels and "precision = 'rescore'" in labels
    for item in inputs:  # every input reaches a surface of each family it is meant for
        assert any(surface.takes(item) for surface in Surface.registry.values()), item.label


def test_every_surface_answers_or_refuses_cleanly_and_alike(env):
    assert env.library.stored.tier is not None  # rescore and --precision rescore have a tier to read
    inputs = generated_inputs()
    table = run_everything(env, inputs)
    problems = [problem for i, item in enumerate(inputs) for problem in problems_of(item, table[i])]
    timing = ", ".join(f"{name} {env.calls[name]} inputs {env.seconds[name]:.1f}s" for name in env.calls)
    if problems:  # the report alone: the failing expression's repr would repeat it unreadably
        pytest.fail(report(problems, len(inputs)) + f"\n(surfaces: {timing})", pytrace=False)
