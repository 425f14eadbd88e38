"""One question to the index: what is asked and how it is answered, described once.

A :class:`Question` carries everything a question can hold: its queries (record dicts of any
kind in :data:`~eogp_index.data.records.RECORD_KINDS`), how several are answered as one
behaviour (``aggregate``), and the options of the answer (``k``, ``where``, ``direction``,
``normalize``, ``group_by``, ``by_module``, ``route``, ``candidates``, ``first_pass``,
``rescore``, ``checkpoint_weights``, ``allow_partial``). Every
surface builds one and answers it: the library's builder
(:meth:`InfluenceQuery.to_query_object() <eogp_index.search.query.InfluenceQuery.to_query_object>`),
``AttributionIndex.search`` / ``top_influential`` / ``scores`` / ``select``, the commands
``eogp query`` / ``explain`` / ``select`` / ``scores`` (their options are generated from the
fields below) and the server's request bodies (same names, same defaults; a test keeps them so).

It is checked in two steps, by one module:

* :meth:`Question.__post_init__`: what needs no index (types, ranges, options that exclude each
  other), as a :class:`~eogp_index.errors.ConfigError`;
* :func:`check_question`: what needs the stored index: the filter (:func:`~eogp_index.store.filters.check_filter`),
  the ``group_by`` column and the text of every query, as an :class:`~eogp_index.errors.InputError`.

Either error's ``field`` names the question field at fault (``"where"``, ``"k"``,
``"queries[2]"``), which the server maps to its request field.

The defaults, the same on every surface: ``k=10`` rows per side, ``direction="both"``,
``normalize="none"``, no filter, no aggregate, no roll-up, route ``auto``, ``rescore=None`` (on
an index with a rescoring tier: the factor measured on its table, else its fit's,
:func:`~eogp_index.search.query.rescore_factor`).

Example:
    >>> question = Question(queries=("The Eiffel Tower is in Paris.",), k=5, where="source = 'news'")  # doctest: +SKIP
    >>> check_question(question, index.stored)  # doctest: +SKIP
    >>> index.search(question).to_arrow()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional, Sequence, Tuple

from eogp_index.config import AGGREGATES, Aggregate, Normalize, check_normalize
from eogp_index.data.records import RecordSpec, check_record, query_record
from eogp_index.errors import ConfigError, InputError

# Light on purpose: `eogp --help` builds its options from this class, without numpy or pyarrow,
# so the sides are spelled here as search/ranking.py spells them.
Direction = Literal["positive", "negative", "both"]
DIRECTIONS = ("positive", "negative", "both")

__all__ = [
    "Question",
    "Route",
    "ROUTES",
    "UNMEASURED_RESCORE",
    "check_checkpoint_weights",
    "check_question",
    "question_field",
]

Route = Literal["auto", "hot", "stream", "sharded", "candidates"]
ROUTES = ("auto", "hot", "stream", "sharded", "candidates")
#: The rescoring factor of a question without one on an index whose fit measured none (its
#: manifest has no ``projection.fidelity.recall``: too few held-out documents, or an index
#: written without the record): a middle factor of the measured ones (``fit.recall.FACTORS``),
#: rescoring few rows (``5 · k`` tier reads per side) while keeping most of the tier's top rows
#: on the measured cases (docs/variants.md).
UNMEASURED_RESCORE = 5


@dataclass(frozen=True)
class Question:
    """A question to the index; validated where it is made (see the module docstring).

    Attributes:
        queries: ``(nq,)`` record dicts (:func:`~eogp_index.data.records.query_record` makes one
            from a text, a chat or token ids): ``{"text"}``, ``{"messages"}``,
            ``{"input_ids"[, "labels"]}``, ``{"prompt", "completion"}`` or
            ``{"prompt", "chosen", "rejected"}`` (a preference: scores of the margin
            ``log p(chosen | prompt) - log p(rejected | prompt)``). Each is answered on its own,
            or all as one measurement with ``aggregate``.
        aggregate: ``mean`` / ``sum``: the queries are one behaviour, the mean (sum) of their
            losses, exact in one scan; None: each query on its own.
        k: rows per side (``direction="both"``: per side), or groups with ``group_by``.
        where: SQL filter on the stored columns (Lance's dialect); None or blank: every row.
        direction: ``positive`` (documents whose training lowers the query's loss), ``negative``
            (raises it) or ``both``; a side holds only scores of its sign, so it may hold fewer
            than ``k`` rows.
        normalize: ``unit``: each stored code divided by its exact norm (cosine); ``none``: the
            paper's influence.
        group_by: roll the scores of every row matching ``where`` up by this stored column.
        by_module: add each hit's per-module terms (they sum to its score).
        route: ``auto`` (the hot copy, on the index's device), ``hot``, ``stream`` (the table in
            batches), ``sharded`` (torchrun workers share the fragments), ``candidates`` (a first
            pass); ``candidates`` given with route ``auto`` chooses ``candidates``.
        candidates: the first pass's budget per side (``C >= k``), for the ``candidates`` route.
        first_pass: which first pass of the index directory (``eogp build-candidates --name``).
        rescore: on an index with a rescoring tier (format 3), the one-bit top ``rescore · k`` rows
            of each side (at most ``candidates``) are scored again from the tier and the best
            ``k`` kept (:mod:`eogp_index.search.rescore`); None: the factor measured on the
            index's table, else the one its fit measured (``eogp info`` shows both;
            :data:`UNMEASURED_RESCORE` when it records neither);
            0: the one-bit ranking. An index without a tier ignores it.
        checkpoint_weights: on an index of ``C`` checkpoints (an ensemble, docs/ensembles.md),
            each checkpoint's weight ``w_c`` in the score ``Σ_c w_c · score_c``: ``C`` finite
            numbers; None: the index's own (``manifest.checkpoints[c].weight``).
        allow_partial: on an index served in shards (:mod:`eogp_index.cluster`), answer from the
            shards that answered when some did not (the answer names them); one process ignores it.
    """

    queries: Tuple[Dict[str, Any], ...] = field(
        default=(), metadata={"help": "The queries: texts, chats, token ids or records of any kind."}
    )
    aggregate: Optional[Aggregate] = field(
        default=None,
        metadata={"help": "Answer all the queries as one measurement, their mean (or summed) loss: exact, one scan."},
    )
    k: int = field(default=10, metadata={"help": "How many documents per direction (or groups).", "min": 1})
    where: Optional[str] = field(
        default=None, metadata={"help": "SQL filter on stored columns, e.g. \"kind = 'function'\"."}
    )
    direction: Direction = field(
        default="both",
        metadata={"help": "positive: documents whose training lowers the query's loss; negative: raises it."},
    )
    normalize: Normalize = field(
        default="none",
        metadata={
            "help": "unit: divide each training code by its norm (cosine to the query); none: the paper's influence."
        },
    )
    group_by: Optional[str] = field(
        default=None,
        metadata={
            "help": "Roll the scores of every row matching --where up by this stored column (rows, sum, mean, max, "
            "top-k counts, shares of the positive and negative influence) instead of listing hits."
        },
    )
    by_module: bool = field(
        default=False, metadata={"help": "Split each hit's score into its per-module terms (they sum to the score)."}
    )
    route: Route = field(
        default="auto",
        metadata={
            "help": "Where codes are read from: auto (the in-memory copy), hot, stream (the table in batches), "
            "sharded (torchrun workers), candidates (a first pass)."
        },
    )
    candidates: Optional[int] = field(
        default=None,
        metadata={
            "help": "Score only this many first-pass candidates per direction (needs `eogp build-candidates`).",
            "min": 1,
        },
    )
    first_pass: str = field(
        default="default", metadata={"help": "Which first pass to use (`eogp build-candidates --name`)."}
    )
    rescore: Optional[int] = field(
        default=None,
        metadata={
            "help": "On an index with a rescoring tier: rescore the one-bit top F x k rows per direction from the "
            "tier and keep the best k (hits show score and score_1bit); 0: the one-bit ranking. Default: the "
            "factor measured on the index's table after its last ingest, else the one its fit measured; eogp info "
            f"shows both ({UNMEASURED_RESCORE} on an index with neither).",
            "min": 0,
            "show_default": False,
        },
    )

    checkpoint_weights: Optional[Tuple[float, ...]] = field(
        default=None,
        metadata={
            "help": "On an index of several checkpoints: each checkpoint's weight in the score, sum_c w_c * score_c, "
            "one number per checkpoint in order (e.g. 0.5,0.5). Default: the weights the index was fitted with.",
        },
    )
    allow_partial: bool = field(
        default=False,
        metadata={
            "help": "Served in shards (eogp serve --ray): when a shard does not answer, answer from the others and "
            "say which answered, rather than refuse naming it. One process holds every row and ignores it."
        },
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalized once, here
        set_(self, "queries", _records(self.queries))
        set_(self, "where", _blank_is_none(self.where, "where", "an SQL string"))
        set_(self, "group_by", _blank_is_none(self.group_by, "group_by", "a stored column's name"))
        if self.aggregate is not None and self.aggregate not in AGGREGATES:
            raise ConfigError(
                f"aggregate must be one of {list(AGGREGATES)} (or None: each query on its own), got {self.aggregate!r}",
                field="aggregate",
            )
        if not _is_count(self.k):
            raise ConfigError(f"k must be a positive integer (at most 2**63-1), got {self.k!r}", field="k")
        if self.direction not in DIRECTIONS:
            raise ConfigError(
                f"direction must be one of {list(DIRECTIONS)}, got {self.direction!r} "
                "(positive: documents that help the query; negative: that hurt it)",
                field="direction",
            )
        try:
            check_normalize(self.normalize)
        except ConfigError as exc:
            raise ConfigError(str(exc), field="normalize") from None
        if not isinstance(self.allow_partial, bool):
            raise ConfigError(f"allow_partial must be true or false, got {self.allow_partial!r}", field="allow_partial")
        if not isinstance(self.by_module, bool):
            raise ConfigError(f"by_module must be true or false, got {self.by_module!r}", field="by_module")
        if self.rescore is not None and not (self.rescore == 0 or _is_count(self.rescore)):
            raise ConfigError(
                f"rescore must be a non-negative integer (0: no rescoring; None: the index's measured "
                f"factor), got {self.rescore!r}",
                field="rescore",
            )
        if self.checkpoint_weights is not None:
            set_(self, "checkpoint_weights", check_checkpoint_weights(self.checkpoint_weights))
        if not isinstance(self.first_pass, str) or not self.first_pass:
            raise ConfigError(f"first_pass must name a first pass, got {self.first_pass!r}", field="first_pass")
        self._check_route()

    def _check_route(self) -> None:
        if self.route not in ROUTES:
            raise ConfigError(f"route must be one of {list(ROUTES)}, got {self.route!r}", field="route")
        if self.candidates is not None:
            if not _is_count(self.candidates):
                raise ConfigError(f"candidates must be a positive integer, got {self.candidates!r}", field="candidates")
            if self.route == "auto":
                object.__setattr__(self, "route", "candidates")
            elif self.route != "candidates":
                raise ConfigError(
                    f"candidates picks the candidates route; drop it for the {self.route} route", field="candidates"
                )
            if self.candidates < self.k:
                raise ConfigError(f"candidates C={self.candidates} must be at least k={self.k}", field="candidates")
        elif self.route == "candidates":
            raise ConfigError(
                "the candidates route needs a candidate count: .candidates(C) or --candidates C", field="candidates"
            )
        if self.normalize != "none" and self.route == "candidates":
            raise ConfigError(
                "normalize='unit' needs an exact scan; first-pass candidates are picked for unnormalized "
                "scores: drop --candidates or --normalize",
                field="normalize",
            )
        if self.group_by is not None and self.route not in ("auto", "hot"):
            raise ConfigError(
                f"group_by scores every matching row of the hot copy; the {self.route} route "
                "lists top hits only: drop the route (or --stream/--candidates) to group",
                field="group_by",
            )

    def replace(self, **changes: Any) -> "Question":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def check(self, stored) -> None:
        """:func:`check_question` against ``stored``."""
        check_question(self, stored)


#: The largest count a question takes: row positions and ranks are int64 in Arrow and numpy.
MAX_COUNT = 2**63 - 1


def _is_count(value: Any) -> bool:
    # numpy's integers are Integral; bool is too, and is refused (True is not a count).
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and 1 <= value <= MAX_COUNT


def _blank_is_none(value: Any, name: str, what: str) -> Optional[str]:
    """A string option with surrounding blanks removed; None when blank."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be {what}, got {type(value).__name__}", field=name)
    return value.strip() or None


def _records(queries: Any) -> Tuple[Dict[str, Any], ...]:
    """Every query as a record dict (:func:`~eogp_index.data.records.query_record`)."""
    if isinstance(queries, (str, dict)):
        raise ConfigError(
            "queries holds a sequence of queries; give (query,) for one, or use index.search(query)",
            field="queries",
        )
    out = []
    for i, query in enumerate(queries):
        try:
            out.append(query_record(query, i))
        except InputError as exc:
            raise InputError(exc.reason, field=f"queries[{i}]") from None
    return tuple(out)


def check_checkpoint_weights(weights: Any, count: Optional[int] = None) -> Tuple[float, ...]:
    """``weights`` as a tuple of finite floats, one per checkpoint (``count`` of them when given).

    Raises:
        ConfigError: not a sequence of finite numbers, or not ``count`` of them
            (``field="checkpoint_weights"``).
    """
    import math

    if isinstance(weights, (str, bytes, dict)) or not hasattr(weights, "__iter__"):
        raise ConfigError(
            f"checkpoint_weights must be a list of numbers, one per checkpoint, got {weights!r}",
            field="checkpoint_weights",
        )
    values = tuple(weights)
    if not values or any(
        isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)) for v in values
    ):
        raise ConfigError(
            f"checkpoint_weights must be finite numbers, one per checkpoint, got {list(values)!r}",
            field="checkpoint_weights",
        )
    if count is not None and len(values) != count:
        raise ConfigError(
            f"checkpoint_weights has {len(values)} weights but the index has {count} checkpoint(s); give one per "
            "checkpoint, in the order of `eogp info`'s checkpoints",
            field="checkpoint_weights",
        )
    return tuple(float(v) for v in values)


def question_field(name: str) -> dataclasses.Field:
    """The :class:`Question` field ``name`` (its default and ``metadata["help"]``)."""
    found = {f.name: f for f in dataclasses.fields(Question)}.get(name)
    if found is None:
        raise KeyError(f"Question has no field {name!r}")
    return found


#: Queries hold their content under the canonical field names.
_QUERY_SPEC = RecordSpec()


def check_question(question: Question, stored) -> None:
    """Refuse what the index says is wrong with ``question``.

    Args:
        stored: the :class:`~eogp_index.store.stored_index.StoredIndex` asked.

    Raises:
        InputError: ``where`` is not exactly one SQL expression over the stored columns
            (:func:`~eogp_index.store.filters.check_filter`: text left over, a second statement,
            a subquery, a comparison naming no column), ``group_by`` is no stored column, or a
            query holds text that is not Unicode (``field``: ``where``, ``group_by``, ``queries[i]``).
    """
    from eogp_index.search.rollup import check_group_column
    from eogp_index.store.filters import check_filter

    if question.checkpoint_weights is not None:
        check_checkpoint_weights(question.checkpoint_weights, stored.manifest.num_checkpoints)

    for i, record in enumerate(question.queries):  # the one record checker, as documents are checked
        try:
            check_record(record, _QUERY_SPEC, query=True)
        except InputError as exc:
            exc.field = f"queries[{i}]"
            raise
    store = stored.store
    if question.where is not None:
        try:
            check_filter(question.where, store.schema, store)
        except InputError as exc:
            exc.field = "where"
            raise
    if question.group_by is not None:
        try:
            check_group_column(question.group_by, _columns(stored))
        except InputError as exc:
            exc.field = "group_by"
            raise


def _columns(stored) -> Sequence[str]:
    """The stored columns a question may name (not the codes)."""
    codes = (*stored.codec.columns, *(() if stored.tier is None else stored.tier.columns))
    return [f.name for f in stored.store.schema or [] if f.name not in codes]
