"""The codes of the FAISS kinds: stored signs replicated, queries weighted by ``|y|``, and row keys.

A FAISS binary index ranks rows by Hamming distance between binary codes; the exact scan ranks
them by ``Σ_u s_iu⟨y_u, b_iu⟩``. These codes bring the two closer:

* **Stored binary vectors: replicated signs.** A row's signs are its ``signs`` column as stored,
  the per-module sign bytes concatenated (``nbytes`` bytes, ``d₀ = 8·nbytes`` bits, bit 0 of a
  byte least significant, which is FAISS's convention too; padding bits are 0). The FAISS code
  of the row is that byte string repeated ``R = replicas`` times
  (``np.tile(signs, R)``: ``R·nbytes`` bytes, ``d = R·d₀`` bits), so each real coordinate ``j``
  has ``R`` identical *replica* bits ``b_j``, and every padding bit is 0 in every replica.
* **Query binary vectors: |y|-weighted.** Plain Hamming on ``pack_signs(y)`` ranks rows by the
  sign agreement ``Σ_j sign(y_j)·β_j`` (``β_j = ±1`` the stored sign), which ignores ``|y_j|``.
  With replicas the query can weight coordinates. Per query, each real coordinate gets an
  integer level ``w_j ∈ {R mod 2, R mod 2 + 2, …, R}`` (so ``R − w_j`` is even) and a sign
  ``σ_j = +1`` if ``y_j >= 0`` else ``−1``; its ``R`` replica bits are ``σ_j``'s bit in the first
  ``w_j`` replicas, then ``R − w_j`` *neutral* bits alternating 1, 0, 1, 0, … (pairs); padding
  bits are 0. Write ``q̃ = ±1`` for a query bit, then ``[q ≠ b] = (1 − q̃·β)/2`` for one bit and,
  summed over the ``R`` replicas of coordinate ``j`` (a neutral pair contributes
  ``(1 − β)/2 + (1 + β)/2 = 1``, whatever ``β``)::

      Σ_r [q_rj ≠ b_j] = w_j·(1 − σ_j β_j)/2 + (R − w_j)/2 = (R − w_j σ_j β_j)/2,

  so with ``K = Σ_u k_u`` real coordinates (padding bits match: 0 vs 0) the FAISS distance is
  exactly::

      H(query, row) = (R·K − Σ_j v_j β_j) / 2,      v_j = σ_j·w_j,

  an integer (``v_j ≡ R mod 2``). The Hamming-nearest rows are the rows with the largest
  weighted agreement ``⟨v, β⟩``. The levels are ``w = clip(round-to-parity(c·|y|), R mod 2,
  R)`` with the factor ``c`` that maximizes the cosine between ``w`` and ``|y|`` (a grid of
  factors from the query's own quantiles; :func:`query_levels`), i.e. ``v ≈ c·y`` on
  ``R + 1`` evenly spaced levels. ``R = 1`` is plain Hamming on ``pack_signs(y)``. The
  most negative influences are the nearest rows to the codes of ``-y`` (same levels, ``σ``
  flipped). What Hamming cannot see: the per-row scales ``s_iu`` (the exact rescoring applies
  them), and ``|y|`` beyond ``R + 1`` levels. The cost: FAISS holds ``R×`` the sign bytes and
  every distance reads ``R×`` the bytes.
* **Keys.** FAISS ids are not Lance row addresses (those change on compaction): they are a
  stable 63-bit hash of the example id (first 8 bytes of BLAKE2b of its UTF-8, little endian,
  top bit cleared); collisions are detected and refused.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import pyarrow as pa

from eogp_index.errors import ConfigError, IncompatibleIndexError, InputError
from eogp_index.store.codecs import SignLayout, pack_signs

KEY_SCHEME = "blake2b-64le-of-utf8-id, top bit cleared"
#: Most replicas per stored sign bit (FAISS memory and distance cost grow linearly with it).
MAX_REPLICAS = 16
#: Factors tried by :func:`query_levels` per query (quantiles of ``|y|`` mapped to level ``R``).
_LEVEL_GRID = np.linspace(0.25, 1.0, 64)
_KEY_MASK = np.int64(0x7FFF_FFFF_FFFF_FFFF)


def replicate_codes(signs: np.ndarray, replicas: int) -> np.ndarray:
    """Stored signs ``(n, nbytes)`` uint8 → FAISS codes ``(n, replicas·nbytes)`` uint8 (``np.tile``).

    Replica ``r`` of every bit sits in bytes ``[r·nbytes, (r+1)·nbytes)`` at the bit's own place,
    so padding bits stay 0 in every replica.
    """
    signs = np.ascontiguousarray(signs, dtype=np.uint8)
    return signs if replicas == 1 else np.ascontiguousarray(np.tile(signs, (1, int(replicas))))


def query_levels(y: np.ndarray, replicas: int) -> np.ndarray:
    """Integer weights ``w`` ``(nq, K)`` int32 of ``|y|``, each in ``{R mod 2, R mod 2 + 2, …, R}``.

    ``w = clip(p + 2·round((c·|y| − p)/2), p, R)`` with ``p = R mod 2`` (so ``R − w`` is even,
    as neutral pairs need) and, per query, the factor ``c`` among ``R / quantile(|y|, g)``
    (``g`` in ``_LEVEL_GRID``) that maximizes ``cos(w, |y|)``: the quantized weights closest in
    angle to ``|y|``, which is what ``⟨v, β⟩ ≈ c·⟨y, β⟩`` needs. ``R = 1`` gives all ones.

    Args:
        y: ``(nq, K)`` float query coordinates. replicas: ``R``.
    """
    a = np.abs(np.asarray(y, np.float64))
    R, p = int(replicas), int(replicas) % 2
    out = np.full(a.shape, p, np.int32)
    if R == 1:
        return out  # every level is 1: plain sign agreement
    for i, row in enumerate(a):  # one query at a time: the trial levels are (G, K)
        q = np.quantile(row, _LEVEL_GRID)
        c = R / q[q > 0]  # a zero quantile gives no factor; an all-zero query keeps level p
        if c.size == 0:
            continue
        w = np.clip(p + 2 * np.round((c[:, None] * row[None, :] - p) / 2), p, R)  # (G, K)
        norms = np.linalg.norm(w, axis=1) * np.linalg.norm(row)
        cos = np.where(norms > 0, (w @ row) / np.where(norms > 0, norms, 1.0), -1.0)
        out[i] = w[int(np.argmax(cos))]  # first of equals: deterministic
    return out


def query_codes(y: np.ndarray, layout: SignLayout, replicas: int) -> np.ndarray:
    """Weighted FAISS query codes ``(nq, replicas·nbytes)`` uint8 of coordinates ``y`` ``(nq, K)``.

    Replica ``r`` of coordinate ``j`` is ``σ_j``'s bit (1 for ``y_j >= 0``) when ``r < w_j``, else
    1 if ``r − w_j`` is even and 0 if odd (neutral pairs); ``w = query_levels(y, replicas)``.
    The Hamming distance to a row with stored signs ``β`` is then ``(R·K − Σ_j σ_j w_j β_j)/2``
    (module docstring). Pass ``-y`` for the most negative side.
    """
    y = np.asarray(y, np.float32)
    if y.ndim != 2 or y.shape[1] != layout.num_coords:
        raise ConfigError(f"query coordinates must have shape (nq, {layout.num_coords}), got {y.shape}")
    R = int(replicas)
    sigma = np.where(y >= 0, 1.0, -1.0).astype(np.float32)
    w = query_levels(y, R)
    parts = []
    for r in range(R):
        neutral = np.where((r - w) % 2 == 0, 1.0, -1.0).astype(np.float32)
        parts.append(pack_signs(np.where(r < w, sigma, neutral), layout))  # ±1 → bits 1/0
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def id_keys(ids: Sequence[str]) -> np.ndarray:
    """Stable FAISS keys of example ids: ``(n,)`` int64, non-negative (see the module docstring)."""
    digest = b"".join(hashlib.blake2b(str(i).encode("utf-8"), digest_size=8).digest() for i in ids)
    return np.frombuffer(digest, dtype="<i8").astype(np.int64) & _KEY_MASK


def check_unique(keys: np.ndarray, ids: pa.Array, where: str) -> None:
    """Refuse duplicate keys: the same id stored twice, or two ids hashing alike."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    dup = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])
    if dup.size == 0:
        return
    a, b = ids[int(order[dup[0]])].as_py(), ids[int(order[dup[0] + 1])].as_py()
    if a == b:
        raise InputError(
            f"example id {a!r} is stored more than once in {where}; FAISS candidates need unique ids. "
            "Delete the duplicate rows (or re-ingest into a fresh index) and build again",
            reason="duplicate example id",
        )
    raise IncompatibleIndexError(
        f"example ids {a!r} and {b!r} have the same 63-bit FAISS key ({int(sorted_keys[dup[0]])}) in {where}; "
        "this is a hash collision (about 1 in 10^19 per pair). Rename one of the two examples and rebuild"
    )
