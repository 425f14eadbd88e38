"""Why a document ranks: its score split by module, and by token.

A stored row's score is a sum over modules, ``score(i) = Σ_u s_iu⟨y_u, b_iu⟩`` (1 bit) or
``Σ_u ⟨y_u, x_iu⟩`` (stored coordinates, or an index's rescoring tier, whose scores its queries
rank by). :func:`module_terms` gives each term, computed on its
own from the row's stored code, so the terms of a hit sum to its ranked score up to float32
rounding.

Tokens. A document's gradient at module ``u`` is a sum over its tokens, ``G = Σ_t g_t a_tᵀ``
(output gradient times input activation at position ``t``), and the projection ``π_u`` is
linear, so ``⟨y_u, π_u(G)⟩ = Σ_t ⟨y_u, π_u(g_t a_tᵀ)⟩``: token ``t`` contributes its share of
the document's unquantized projected score ``⟨y, z⟩``. Computing ``π_u`` per token would cost
``T`` projections; instead the query is pulled back once into weight space, ``H_u = π_uᵀ(y_u)``
``(d_out, d_in')`` with ``⟨H_u, G⟩ = ⟨y_u, π_u(G)⟩`` for every ``G`` (:func:`weight_space`: the
second stage's adjoint, the half-whitening, the kept eigenbasis coordinates scattered into
``Q_S ⋅ Q_Aᵀ``), and each token's contribution is ``g_tᵀ H_u a_t`` — one matrix-vector product
per token and module, the cost of the module's own forward pass. So :func:`explain_documents`
costs one forward and backward pass over the documents, not a pass over the store.

The query is split the same way against each document's stored code ``x̂_i`` (``s_iu b_iu``):
``g_tᵀ π_uᵀ(x̂_iu) a_t`` per query token sums to ``⟨y, x̂_i⟩``, the score as ranked. A token's
contribution is that of its position's activation and output gradient (which carries the losses
of every later position it feeds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from eogp_index.data.records import Example, check_text
from eogp_index.encode.encoder import Encoder
from eogp_index.errors import InputError
from eogp_index.gradients.capture import GradientCapture, project_examples
from eogp_index.store.codecs import Encoded, SignLayout, decode
from eogp_index.store.manifest import prefixed


@dataclass(frozen=True)
class TokenContribution:
    """One token's share of a score: its text and its contribution."""

    token: str
    contribution: float


@dataclass(frozen=True)
class Explanation:
    """Why document ``id`` ranks for a query.

    Attributes:
        score: the score as ranked (from the stored 1-bit code; from the rescoring tier on an
            index with one, as its queries rank by default). score_1bit: on an index with a
            rescoring tier, the one-bit scan's score of the row (None without a tier). score_projected: the
            unquantized projected score ``⟨y, z⟩`` the training tokens sum to.
        train_tokens: the document's tokens, each with ``⟨y, z_t⟩``.
        query_tokens: the query's tokens, each with its share of ``score`` (they sum to it up to the
            FP16 rounding the projection applies to the query's first stage).
        modules: ``{module: term}`` of ``score``.
        text: the document as stored or read back (text, or chat / ids as JSON).
        checkpoints: on an index of several checkpoints, each checkpoint's share of ``score``
            (``{checkpoint name: w_c · score_c}``, its modules' terms summed; they sum to
            ``score``); empty for one checkpoint.
    """

    id: str
    score: float
    score_projected: float
    train_tokens: List[TokenContribution]
    query_tokens: List[TokenContribution]
    modules: Dict[str, float]
    text: Optional[str] = None
    metadata: Dict[str, Any] = field(default_factory=dict)
    score_1bit: Optional[float] = None
    checkpoints: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        data = {
            "id": self.id,
            "score": self.score,
            **({} if self.score_1bit is None else {"score_1bit": self.score_1bit}),
            "score_projected": self.score_projected,
            "train_tokens": [{"token": t.token, "contribution": t.contribution} for t in self.train_tokens],
            "query_tokens": [{"token": t.token, "contribution": t.contribution} for t in self.query_tokens],
            "modules": dict(self.modules),
            **({"checkpoints": dict(self.checkpoints)} if self.checkpoints else {}),
        }
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


def weight_space(module, coords: torch.Tensor) -> torch.Tensor:
    """Pull projected coordinates back to weight space: ``(n, k)`` → ``H`` ``(n, d_out, d_in')``
    float32 with ``⟨H_j, G⟩ = ⟨coords_j, π(G)⟩`` for every per-example gradient ``G``.

    ``module`` is a :class:`~eogp_index.fit.projection.ModuleProjection` ``π``: its second stage
    is linear, so its adjoint is the gradient of ``⟨coords, second(z)⟩`` in ``z``; the
    half-whitening is diagonal; the kept eigenbasis coordinates scatter into ``(r, c)``, and
    ``⟨B, Q_Sᵀ G Q_A⟩ = ⟨Q_S B Q_Aᵀ, G⟩``.
    """
    coords = coords.float()
    z = torch.zeros(coords.shape[0], module.m, requires_grad=True)
    with torch.enable_grad():
        (pulled,) = torch.autograd.grad(module.second(z), z, grad_outputs=coords)  # (n, m)
    pulled = pulled * module.whiten
    q_s, q_a = module.gradient_eigenvectors.float(), module.activation_eigenvectors.float()
    block = pulled.new_zeros(coords.shape[0], q_s.shape[1] * q_a.shape[1])
    block[:, module.local_index] = pulled
    return q_s @ block.reshape(-1, q_s.shape[1], q_a.shape[1]) @ q_a.T


def token_contributions(index: Encoder, examples: Sequence[Example], coords: np.ndarray) -> List[np.ndarray]:
    """Per-token contributions ``(n_coords, T_i)`` float64 of each example against each row of
    ``coords`` ``(n_coords, K)`` (projected coordinates, modules concatenated): row ``j``, token
    ``t`` is ``Σ_u g_tᵀ π_uᵀ(coords_ju) a_t``; over ``t`` they sum to ``⟨coords_j, z_i⟩``.

    ``index`` is the index's :class:`~eogp_index.encode.encoder.Encoder` (model, tokenizer, projection).
    One forward and backward pass per gradient batch; padding positions are dropped.
    """
    from eogp_index.gradients.capture import batches
    from eogp_index.gradients.model import pad_token_id

    manifest = index.manifest
    layout = index.stored.coordinates  # what the second stages output (a wider tier's, with --rescore-k)
    coords_t = torch.as_tensor(np.asarray(coords, np.float32))
    pulled = {
        name: weight_space(index.projection.modules[name], coords_t[:, off : off + k]).to(index.device)
        for name, off, k in zip(manifest.module_names, layout.coord_offsets, layout.k)
    }
    out: List[np.ndarray] = []
    for batch in batches(examples, index.gradients.batch_size):  # each batch padded to its own longest
        total = 0
        for j, model in enumerate(index.models):  # an ensemble: each checkpoint's model, its modules' share
            names = {m.name: prefixed(m.name, j) for m in manifest.checkpoint_modules(j)}

            def contributions(name: str, a: torch.Tensor, g: torch.Tensor, names=names) -> torch.Tensor:
                return torch.einsum("bto,noi,bti->bnt", g, pulled[names[name]], a)  # (B, n_coords, T)

            capture = GradientCapture(
                model, list(names), contributions, checkpoint=index.gradients.gradient_checkpointing
            )
            per_module = project_examples(
                capture, batch, batch_size=len(batch), pad_token_id=pad_token_id(index.tokenizer), device=index.device
            )
            total = total + sum(per_module[name].double() for name in names).numpy()  # (B, n_coords, T)
        out.extend(total[i, :, : len(ex.input_ids)] for i, ex in enumerate(batch))
    return out


def checkpoint_shares(manifest, terms: np.ndarray) -> Dict[str, float]:
    """Each checkpoint's share of a score from its per-module ``terms`` ``(U,)`` (in the combined
    layout's order): ``{"<j>: <name>": sum of its modules' terms}``; empty for one checkpoint."""
    if manifest.checkpoints is None:
        return {}
    out, start = {}, 0
    for j, (entry, count) in enumerate(zip(manifest.checkpoints, manifest.checkpoint_parts)):
        out[f"{j}: {entry['name']}"] = float(np.asarray(terms[start : start + count], np.float64).sum())
        start += count
    return out


def _token_texts(tokenizer, ids: Sequence[int]) -> List[str]:
    decode = getattr(tokenizer, "decode", None)
    if decode is None:  # a tokenizer that only counts (pre-tokenized data): show the ids
        return [str(int(t)) for t in ids]
    return [decode([int(t)]) for t in ids]


def explain_documents(index: Encoder, query, ids: Sequence[str]) -> List[Explanation]:
    """Explanations of the stored documents ``ids`` for one query, in one batched pass.

    Costs one forward and backward pass over the documents (and one over the query), plus the
    projection of their tokens; no pass over the store.

    Args:
        index: the index's :class:`~eogp_index.encode.encoder.Encoder`. query: a text, chat, ids
            or record (not a preference query: its two completions have no one token list).
        ids: stored example ids (e.g. the top hits of the query), distinct.
    """
    from eogp_index.store.stored_ids import sql_string

    for example_id in ids:  # an id names a row through a filter: refuse what is not an id first
        if not isinstance(example_id, str):
            raise InputError(
                f"a document id is a string (take ids from query results), got {type(example_id).__name__}",
                field="id",
            )
        check_text(example_id, "id")
    if not ids:
        return []
    stored = index.stored
    query_example = index.query_examples([query])[0]
    documents = [stored.document(i, index.tokenizer) for i in ids]  # checked against their hashes
    y = stored.weigh(index.project([query_example]))  # (1, K); an ensemble's checkpoints weighted as queries are
    where = f"id IN ({', '.join(sql_string(i) for i in ids)})"
    tier = stored.tier  # an index with a rescoring tier ranks by the tier's score: explain that one
    columns = [*stored.codec.columns, *(() if tier is None else tier.columns)]
    table = stored.store.read(["id", *columns], where)
    position = {doc_id: row for row, doc_id in enumerate(table.column("id").to_pylist())}
    table = table.take(np.array([position[i] for i in ids], np.int64))
    one_bit = stored.codec.from_arrow(table)
    if tier is None:
        codes, layout, scores_1bit = one_bit, stored.layout, None
    else:
        codes, layout = Encoded(coords=tier.decode(tier.from_arrow(table))), tier.layout
        # as the scan scores it: the one-bit code's first k_u of each module's T_u coordinates
        scores_1bit = module_terms(one_bit, stored.one_bit(y)[0], stored.layout).sum(axis=1)
    # (r, T): the tier's x̂ over all its coordinates; without a tier s_u·b_u, or x (T = K)
    stored_coords = decode(codes, layout)
    terms = module_terms(codes, y[0], layout)  # (r, U)
    train = token_contributions(index, documents, y)  # [(1, T_i)]
    # (r, T_q); an ensemble's checkpoints weighted as the query is
    (queried,) = token_contributions(index, [query_example], stored.weigh(stored_coords))
    names = stored.manifest.module_names
    query_texts = _token_texts(index.tokenizer, query_example.input_ids)
    out = []
    for j, doc in enumerate(documents):
        out.append(
            Explanation(
                id=doc.id,
                score=float(terms[j].sum()),
                score_projected=float(train[j][0].sum()),
                train_tokens=[
                    TokenContribution(t, float(c))
                    for t, c in zip(_token_texts(index.tokenizer, doc.input_ids), train[j][0])
                ],
                query_tokens=[TokenContribution(t, float(c)) for t, c in zip(query_texts, queried[j])],
                modules=module_dicts(terms[j : j + 1], names)[0],
                text=doc.display_text,
                score_1bit=None if scores_1bit is None else float(scores_1bit[j]),
                checkpoints=checkpoint_shares(stored.manifest, terms[j]),
            )
        )
    return out
