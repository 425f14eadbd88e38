"""Retraining ground truth for small models: LDS and counterfactual removal (Appendix D.1).

* **LDS.** ``R`` random half-subsets of the training documents (seeded masks); the base model
  is fine-tuned on each with the evaluation's recipe (:func:`tinylm.finetune`) and every
  query's token-summed loss is measured (:func:`tinylm.document_losses`), giving ``Y``
  ``(R, n_queries)``. A method's LDS is :func:`metrics.lds` of its scores against ``(masks,
  Y)``: the per-query Spearman correlation across subsets between ``-Σ_{i∈S_r} I_q(i)`` and
  ``Y_rq``, averaged over queries, with a subset-bootstrap 95% interval.
* **Counterfactual.** The training documents ranked most influential on the first queries
  (summed scores, :func:`metrics.counterfactual_ranking`) are removed, the model is retrained
  with a few seeds, and the queries' perplexity increase over the no-removal run of the same
  seed is compared with removing as many random documents.

Retraining is the expensive part, so its results are cached: subset ``r`` depends only on
``(seed, r)``, and ``<out>/retraining.npz`` holds every subset trained so far under a key
hashing the recipe, the seed, the subset fraction, the base weights and the training and
query documents. A rerun reuses the subsets it has (raising ``R`` trains only the new ones),
and any change of those inputs starts afresh. Counterfactual runs are cached the same way in
``<out>/counterfactual.json``, keyed by the removed set, the seed and the same inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation import metrics, tinylm
from eogp_index.evaluation.fidelity import REF_EKFAC, REF_KFAC, REF_TRACIN, ScoreSet

__all__ = [
    "CounterfactualResult",
    "Retraining",
    "counterfactual",
    "lds_records",
    "retrain_subsets",
    "subset_masks",
]

RETRAINING_FILE = "retraining.npz"
COUNTERFACTUAL_FILE = "counterfactual.json"


def _tokens_hash(docs: Sequence[Sequence[int]]) -> str:
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(json.dumps([int(t) for t in doc]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _base_model(base):
    """The base model (loaded once) and the SHA-256 of its weights."""
    from eogp_index.gradients.model import model_sha256

    try:
        model = tinylm._load_model(base)
    except (OSError, TypeError) as exc:  # unreadable weights; a missing directory is already a ConfigError
        raise ConfigError(f"cannot load the base model to retrain from: {exc}; check --base") from exc
    return model, model_sha256(model)


def subset_masks(n_train: int, num_subsets: int, *, fraction: float = 0.5, seed: int = 0, start: int = 0) -> np.ndarray:
    """Masks ``(num_subsets, n_train)`` bool of subsets ``start .. start + num_subsets - 1``.

    Subset ``r`` keeps ``round(fraction · n_train)`` documents drawn without replacement by a
    generator seeded with ``(seed, r)``, so it does not depend on how many subsets are drawn.
    """
    if not 0 < fraction < 1:
        raise ConfigError(f"the subset fraction must lie in (0, 1), got {fraction}")
    size = int(round(fraction * n_train))
    if not 1 <= size < n_train:
        raise ConfigError(f"a {fraction} subset of {n_train} documents is empty or complete")
    masks = np.zeros((num_subsets, n_train), dtype=bool)
    for i in range(num_subsets):
        rng = np.random.default_rng([seed, start + i])
        masks[i, rng.choice(n_train, size=size, replace=False)] = True
    return masks


@dataclass(frozen=True)
class Retraining:
    """Retraining outcomes of the LDS subsets.

    masks: ``(R, n_train)`` bool, True = kept. losses: ``(R, n_queries)`` float64,
    token-summed query losses after retraining on each subset. num_trained: subsets trained
    by this call (0 when everything came from the cache). seconds: wall time of this call's
    retraining. seconds_per_subset: mean training + measuring time of one subset, as cached.
    """

    masks: np.ndarray
    losses: np.ndarray
    num_trained: int
    seconds: float
    seconds_per_subset: float
    key: str


def retraining_key(
    recipe: tinylm.FinetuneRecipe,
    *,
    seed: int,
    fraction: float,
    base_sha256: str,
    train: Sequence[Sequence[int]],
    queries: Sequence[Sequence[int]],
) -> str:
    """The cache key of retraining outcomes: everything they depend on except ``R``."""
    payload = {
        "recipe": recipe.to_dict(),
        "seed": seed,
        "fraction": fraction,
        "base": base_sha256,
        "train": _tokens_hash(train),
        "queries": _tokens_hash(queries),
        "version": 1,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def retrain_subsets(
    base,
    train: Sequence[Sequence[int]],
    queries: Sequence[Sequence[int]],
    *,
    recipe: tinylm.FinetuneRecipe = tinylm.FinetuneRecipe(),
    num_subsets: int = 24,
    fraction: float = 0.5,
    seed: int = 0,
    cache: Optional[Path] = None,
    log: Optional[Callable[[str], None]] = None,
    train_fn: Callable = tinylm.finetune,
) -> Retraining:
    """Retrain ``base`` on ``num_subsets`` random subsets and measure the queries' losses.

    Args:
        base: a model directory or a ``GPT2LMHeadModel`` (the pretrained starting point).
        train, queries: token-id lists (:func:`tinylm.tokenize_documents`).
        cache: the ``.npz`` file that keeps the outcomes (written after every subset, so an
            interrupted run resumes); None disables caching.
        train_fn: ``train_fn(base_model, documents, recipe)`` → model (tests count calls).
    """
    if num_subsets < 2:
        raise ConfigError(f"LDS needs at least 2 subsets, got {num_subsets}")
    say = log or (lambda _msg: None)
    base_model, base_hash = _base_model(base)
    key = retraining_key(recipe, seed=seed, fraction=fraction, base_sha256=base_hash, train=train, queries=queries)
    masks = np.zeros((0, len(train)), dtype=bool)
    losses = np.zeros((0, len(queries)), dtype=np.float64)
    seconds_cached = 0.0
    if cache is not None and Path(cache).exists():
        with np.load(cache, allow_pickle=False) as data:
            if str(data["key"]) == key:
                masks, losses = data["masks"], data["losses"]
                seconds_cached = float(data["seconds"])
                say(f"retraining cache {cache}: {len(masks)} subsets reused")
            else:
                say(f"retraining cache {cache} is for other inputs; retraining from scratch")
    have = len(masks)
    t_start = time.perf_counter()
    trained = 0
    for r in range(have, num_subsets):
        t0 = time.perf_counter()
        mask = subset_masks(len(train), 1, fraction=fraction, seed=seed, start=r)[0]
        model = train_fn(base_model, [train[i] for i in np.flatnonzero(mask)], recipe)
        y = tinylm.document_losses(model, queries)
        masks = np.concatenate([masks, mask[None]], axis=0)
        losses = np.concatenate([losses, y[None]], axis=0)
        trained += 1
        seconds_cached += time.perf_counter() - t0
        say(f"subset {r + 1}/{num_subsets} retrained in {time.perf_counter() - t0:.1f}s")
        if cache is not None:
            _save_npz(Path(cache), key=np.array(key), masks=masks, losses=losses, seconds=np.array(seconds_cached))
    count = max(len(masks), 1)
    return Retraining(
        masks=masks[:num_subsets],
        losses=losses[:num_subsets],
        num_trained=trained,
        seconds=time.perf_counter() - t_start,
        seconds_per_subset=seconds_cached / count,
        key=key,
    )


def _save_npz(path: Path, **arrays) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


# --------------------------------------------------------------------------- LDS of every method


def _lds(scores: np.ndarray, retraining: Retraining, n_bootstrap: int, seed: int) -> metrics.LDSResult:
    return metrics.lds(scores, retraining.masks, retraining.losses, n_bootstrap=n_bootstrap, seed=seed)


def lds_records(
    scoreset: ScoreSet, retraining: Retraining, *, n_bootstrap: int = 1000, seed: int = 0
) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """LDS of every config and reference; returns ``(records, details)``.

    A config with several seeds (the Gaussian control) reports the mean of its seeds' LDS
    and the mean of their interval bounds. Reference lines: uncompressed EK-FAC
    (kronfluence), K-FAC and TracIn.
    """
    records: List[Dict[str, Any]] = []
    per_config: Dict[str, Any] = {}
    for cfg in scoreset.configs:
        results = [_lds(s, retraining, n_bootstrap, seed) for s in scoreset.scores[cfg.id]]
        mean = metrics.nanmean([r.mean for r in results])
        lo, hi = metrics.nanmean([r.ci_low for r in results]), metrics.nanmean([r.ci_high for r in results])
        rec = {"method": cfg.label, "bytes_per_example": cfg.budget, "metric": "lds", "value": mean}
        if math.isfinite(lo) and math.isfinite(hi):
            rec.update(ci_low=lo, ci_high=hi)
        records.append(rec)
        per_config[cfg.id] = {
            "lds": [r.mean for r in results],
            "ci_low": [r.ci_low for r in results],
            "ci_high": [r.ci_high for r in results],
            "n_valid": [r.n_valid for r in results],
        }
    references: Dict[str, Dict[str, float]] = {}
    named = [(f"{REF_EKFAC.split(' (')[0]} (uncompressed)", scoreset.reference)]
    named += [
        (f"{label} (uncompressed)", scoreset.references[key])
        for key, label in (("kfac", REF_KFAC), ("tracin", REF_TRACIN))
        if key in scoreset.references
    ]
    for label, scores in named:
        r = _lds(scores, retraining, n_bootstrap, seed)
        references[label] = {"lds": r.mean, "ci_low": r.ci_low, "ci_high": r.ci_high, "n_valid": r.n_valid}
    details = {
        "per_config": per_config,
        "references": references,
        "reference_lines": {name: v["lds"] for name, v in references.items()},
        "num_subsets": int(len(retraining.masks)),
        "subset_size": int(retraining.masks[0].sum()),
        "retraining_seconds_per_subset": retraining.seconds_per_subset,
    }
    return records, details


# --------------------------------------------------------------------------- counterfactual


@dataclass(frozen=True)
class CounterfactualResult:
    """Perplexity increase after removing each method's top-ranked documents.

    delta_ppl: ``{method: {N: mean over seeds of PPL_s(N) - PPL_s(0)}}``; ``std`` the
    population standard deviation of the post-removal perplexities over seeds; ``base_ppl``
    ``PPL_s(0)`` per seed. ``"Random"`` removes the first ``N`` of a seeded permutation.
    """

    removals: Tuple[int, ...]
    seeds: Tuple[int, ...]
    num_queries: int
    base_ppl: Tuple[float, ...]
    delta_ppl: Dict[str, Dict[int, float]]
    std: Dict[str, Dict[int, float]]
    num_trained: int
    seconds: float

    def to_json(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        data["delta_ppl"] = {m: {str(n): v for n, v in d.items()} for m, d in self.delta_ppl.items()}
        data["std"] = {m: {str(n): v for n, v in d.items()} for m, d in self.std.items()}
        return data


def counterfactual(
    base,
    train: Sequence[Sequence[int]],
    queries: Sequence[Sequence[int]],
    scores: Mapping[str, np.ndarray],
    *,
    removals: Sequence[int] = (16, 32, 64),
    seeds: Sequence[int] = (0, 1, 2),
    num_queries: int = 16,
    recipe: tinylm.FinetuneRecipe = tinylm.FinetuneRecipe(),
    cache: Optional[Path] = None,
    log: Optional[Callable[[str], None]] = None,
    train_fn: Callable = tinylm.finetune,
) -> CounterfactualResult:
    """Remove each method's top-``N`` documents, retrain with each seed, measure perplexity.

    Args:
        scores: ``{method: (n_queries, n_train) scores}``; documents are ranked by their
            summed score over the first ``num_queries`` queries, whose perplexity
            (``exp`` of the mean token loss) is measured after retraining.
        seeds: retraining seeds (``recipe.seed`` is replaced by each), shared by all methods.
    """
    if not removals or min(removals) < 1 or max(removals) >= len(train):
        raise ConfigError(f"removal counts must lie in [1, {len(train) - 1}], got {list(removals)}")
    if not seeds:
        raise ConfigError("counterfactual retraining needs at least one seed")
    num_queries = min(num_queries, len(queries))
    say = log or (lambda _msg: None)
    base_model, base_hash = _base_model(base)
    measured = list(queries[:num_queries])
    tokens = sum(len(q) - 1 for q in measured)
    if tokens < 1:
        raise InputError("the counterfactual queries have no token to measure")
    inputs = {"base": base_hash, "train": _tokens_hash(train), "queries": _tokens_hash(measured)}
    stored: Dict[str, List[float]] = {}
    if cache is not None and Path(cache).exists():
        stored = json.loads(Path(cache).read_text(encoding="utf-8"))
    t_start = time.perf_counter()
    trained = 0

    def perplexity(removed: Sequence[int], seed: int) -> float:
        nonlocal trained
        run_recipe = dataclasses.replace(recipe, seed=int(seed))
        payload = {**inputs, "recipe": run_recipe.to_dict(), "removed": sorted(int(i) for i in removed)}
        key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        if key not in stored:
            drop = set(int(i) for i in removed)
            t0 = time.perf_counter()
            model = train_fn(base_model, [d for i, d in enumerate(train) if i not in drop], run_recipe)
            stored[key] = tinylm.document_losses(model, measured).tolist()
            trained += 1
            say(f"counterfactual: removed {len(drop)}, seed {seed}: retrained in {time.perf_counter() - t0:.1f}s")
            if cache is not None:
                Path(cache).parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(str(cache) + ".tmp")
                tmp.write_text(json.dumps(stored), encoding="utf-8")
                tmp.replace(cache)
        return float(math.exp(sum(stored[key]) / tokens))

    base_ppl = [perplexity([], s) for s in seeds]
    orders: Dict[str, np.ndarray] = {}
    for name, s in scores.items():
        orders[name] = metrics.counterfactual_ranking(np.asarray(s), n_queries_used=min(num_queries, len(s)))
    delta: Dict[str, Dict[int, float]] = {}
    std: Dict[str, Dict[int, float]] = {}
    for name in list(orders) + ["Random"]:
        delta[name], std[name] = {}, {}
        for n in removals:
            ppl = []
            for s in seeds:
                if name == "Random":
                    removed = np.random.default_rng([int(s), 7]).permutation(len(train))[:n]
                else:
                    removed = orders[name][:n]
                ppl.append(perplexity(removed, s))
            delta[name][int(n)] = float(np.mean([p - b for p, b in zip(ppl, base_ppl)]))
            std[name][int(n)] = float(np.std(ppl))
    return CounterfactualResult(
        removals=tuple(int(n) for n in removals),
        seeds=tuple(int(s) for s in seeds),
        num_queries=num_queries,
        base_ppl=tuple(base_ppl),
        delta_ppl=delta,
        std=std,
        num_trained=trained,
        seconds=time.perf_counter() - t_start,
    )
