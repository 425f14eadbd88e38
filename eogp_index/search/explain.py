"""Why a document ranks: its score split by module, and by token.

A stored row's score is a sum over modules, ``score(i) = Σ_u s_iu⟨y_u, b_iu⟩`` (1 bit) or
``Σ_u ⟨y_u, x_iu⟩`` (stored coordinates). :func:`module_terms` gives each term, computed on its
own from the row's stored code, so the terms of a hit sum to its ranked score up to float32
rounding.

Tokens. A document's gradient at module ``u`` is a sum over its tokens, ``G = Σ_t g_t a_tᵀ``
(output gradient times input activation at position ``t``), and the projection is linear, so
its projected coordinates are ``z = Σ_t z_t`` with ``z_t`` the projection of ``g_t a_tᵀ``
alone. :func:`explain_documents` recomputes ``z_t`` for the training document (one forward and
backward pass, then the index's own projection, unquantized) and reports ``⟨y, z_t⟩`` per
token: they sum to the document's unquantized projected score ``⟨y, z⟩``. The query is split the
same way, ``y = Σ_t y_t``, against the document's stored code: ``Σ_u s_iu⟨y_tu, b_iu⟩`` per
query token sums to the score as ranked. A token's contribution is that of its position's
activation and output gradient (which carries the losses of every later position it feeds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from eogp_index.data.records import Example
from eogp_index.gradients.capture import GradientCapture, project_examples
from eogp_index.store.codecs import Encoded, SignLayout, concat_modules, decode

#: Tokens projected at once per module when splitting a gradient by token: bounds the
#: ``(tokens, r, c)`` eigenbasis blocks the first stage builds.
_TOKEN_CHUNK = 256


@dataclass(frozen=True)
class TokenContribution:
    """One token's share of a score: its text and its contribution."""

    token: str
    contribution: float


@dataclass(frozen=True)
class Explanation:
    """Why document ``id`` ranks for a query.

    Attributes:
        score: the score as ranked (from the stored 1-bit code). score_projected: the
            unquantized projected score ``⟨y, z⟩`` the training tokens sum to.
        train_tokens: the document's tokens, each with ``⟨y, z_t⟩``.
        query_tokens: the query's tokens, each with its share of ``score``.
        modules: ``{module: term}`` of ``score``.
        text: the document as stored or read back (text, or chat / ids as JSON).
    """

    id: str
    score: float
    score_projected: float
    train_tokens: List[TokenContribution]
    query_tokens: List[TokenContribution]
    modules: Dict[str, float]
    text: Optional[str] = None
    metadata: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        data = {"id": self.id, "score": self.score, "score_projected": self.score_projected,
                "train_tokens": [{"token": t.token, "contribution": t.contribution} for t in self.train_tokens],
                "query_tokens": [{"token": t.token, "contribution": t.contribution} for t in self.query_tokens],
                "modules": dict(self.modules)}
        if self.text is not None:
            data["text"] = self.text
        if self.metadata:
            data["metadata"] = dict(self.metadata)
        return data


def module_terms(encoded: Encoded, y: np.ndarray, layout: SignLayout) -> np.ndarray:
    """Per-module terms ``(r, U)`` float32 of ``r`` stored rows against one query ``y`` ``(K,)``.

    Term ``u`` of row ``i`` is ``s_iu⟨y_u, b_iu⟩`` for 1-bit rows (``⟨y_u, x_iu⟩`` for stored
    coordinates), accumulated in float64.
    """
    stored = decode(encoded, layout).astype(np.float64)  # (r, K): s_u·b_u, or x
    y = np.asarray(y, np.float64).reshape(-1)
    products = stored * y[None, :]
    bounds = list(layout.coord_offsets) + [layout.num_coords]
    return np.stack([products[:, a:b].sum(axis=1) for a, b in zip(bounds[:-1], bounds[1:])], axis=1).astype(np.float32)


def module_dicts(terms: np.ndarray, names: List[str]) -> List[dict]:
    """``(r, U)`` terms → one ``{module name: term}`` dict per row (the JSON of ``by_module``)."""
    return [{name: float(v) for name, v in zip(names, row)} for row in terms]


def per_token(transform: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]):
    """A transform projecting each token's ``g_t a_tᵀ`` on its own: ``(B, T, ...)`` → ``(B, T, k)``."""

    def split(name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        B, T = a.shape[:2]
        a1 = a.reshape(B * T, 1, a.shape[-1])
        g1 = g.reshape(B * T, 1, g.shape[-1])
        parts = [transform(name, a1[i:i + _TOKEN_CHUNK], g1[i:i + _TOKEN_CHUNK])
                 for i in range(0, B * T, _TOKEN_CHUNK)]
        return torch.cat(parts).reshape(B, T, -1)

    return split


def token_coordinates(index, examples: Sequence[Example]) -> List[np.ndarray]:
    """Per-token projected coordinates of each example: ``(T_i, K)`` float32 (unquantized).

    ``index`` is an :class:`~eogp_index.client.AttributionIndex` (model, tokenizer, projection).
    One forward and backward pass per gradient batch; padding positions are dropped.
    """
    from eogp_index.gradients.model import pad_token_id

    from eogp_index.gradients.capture import batches

    names = index.manifest.module_names
    capture = GradientCapture(index.model, names, per_token(index.projection.transform))
    out: List[np.ndarray] = []
    for batch in batches(examples, index.gradients.batch_size):  # each batch padded to its own longest
        coords = project_examples(capture, batch, batch_size=len(batch), pad_token_id=pad_token_id(index.tokenizer),
                                  device=index.device)
        width = max(len(ex.input_ids) for ex in batch)
        joined = concat_modules([coords[name].reshape(len(batch) * width, -1).numpy() for name in names])
        joined = joined.reshape(len(batch), width, -1)
        out.extend(joined[i, :len(ex.input_ids)] for i, ex in enumerate(batch))
    return out


def _token_texts(tokenizer, ids: Sequence[int]) -> List[str]:
    decode = getattr(tokenizer, "decode", None)
    if decode is None:  # a tokenizer that only counts (pre-tokenized data): show the ids
        return [str(int(t)) for t in ids]
    return [decode([int(t)]) for t in ids]


def explain_documents(index, query, ids: Sequence[str]) -> List[Explanation]:
    """Explanations of the stored documents ``ids`` for one query, in one batched pass.

    Costs one forward and backward pass over the documents (and one over the query), plus the
    projection of their tokens; no pass over the store.

    Args:
        index: an :class:`~eogp_index.client.AttributionIndex`. query: a text, chat, ids or record.
        ids: stored example ids (e.g. the top hits of the query), distinct.
    """
    from eogp_index.store.stored_ids import sql_string

    if not ids:
        return []
    stored = index.stored
    query_example = index.query_examples([query])[0]
    documents = [stored.document(i, index.tokenizer) for i in ids]       # checked against their hashes
    query_tokens = token_coordinates(index, [query_example])[0].astype(np.float64)   # (T_q, K)
    y = query_tokens.sum(axis=0)                                         # (K,): Σ_t y_t = y
    doc_tokens = token_coordinates(index, documents)                      # [(T_i, K)]
    where = f"id IN ({', '.join(sql_string(i) for i in ids)})"
    table = stored.store.read(["id", *stored.codec.columns], where)
    position = {doc_id: row for row, doc_id in enumerate(table.column("id").to_pylist())}
    codes = stored.codec.from_arrow(table).take(np.array([position[i] for i in ids], np.int64))
    approx = decode(codes, stored.layout).astype(np.float64)              # (r, K): s_u·b_u, or x
    terms = module_terms(codes, y, stored.layout)                         # (r, U)
    names = stored.manifest.module_names
    query_texts = _token_texts(index.tokenizer, query_example.input_ids)
    out = []
    for j, (doc, z_t) in enumerate(zip(documents, doc_tokens)):
        train = z_t.astype(np.float64) @ y                                # (T_i,): sums to ⟨y, z⟩
        queried = query_tokens @ approx[j]                                # (T_q,): sums to the score
        out.append(Explanation(
            id=doc.id, score=float(queried.sum()), score_projected=float(train.sum()),
            train_tokens=[TokenContribution(t, float(c))
                          for t, c in zip(_token_texts(index.tokenizer, doc.input_ids), train)],
            query_tokens=[TokenContribution(t, float(c)) for t, c in zip(query_texts, queried)],
            modules=module_dicts(terms[j:j + 1], names)[0], text=doc.display_text))
    return out
