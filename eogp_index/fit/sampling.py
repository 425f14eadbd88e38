"""Which examples fit the curvature and the PCA: a seeded reservoir over the shards, split in two.

``eogp fit`` reads every shard once and keeps a seeded uniform sample of
``curvature_examples + pca_examples`` records (reservoir sampling, Algorithm R), tokenizing only
the records it keeps. :func:`split_fit_sets` then deals the sample into a curvature set and a PCA
set that share no example. A corpus too small for that (the demo's 512 documents against
``--curvature-examples 256 --pca-examples 512``) gives overlapping sets, each a seeded sample of
the whole corpus, with an :class:`OverlappingFitSetsWarning` that says so.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, List, Sequence, Tuple, TypeVar

import torch

from eogp_index.data.records import Example, RecordSpec, tokenize_record
from eogp_index.errors import InputError

T = TypeVar("T")


class OverlappingFitSetsWarning(UserWarning):
    """The fitting examples are too few for disjoint curvature and PCA sets."""


def reservoir_sample(items: Iterable[T], size: int, seed: int) -> List[T]:
    """A uniform sample of ``size`` items (all of them if fewer), in one pass, in stream order.

    Algorithm R with ``random.Random(seed)``: the same stream and seed give the same sample.
    Memory: ``size`` items.
    """
    rng = random.Random(seed)
    kept: List[Tuple[int, T]] = []
    for seen, item in enumerate(items):
        if len(kept) < size:
            kept.append((seen, item))
        else:
            slot = rng.randrange(seen + 1)
            if slot < size:
                kept[slot] = (seen, item)
    return [item for _, item in sorted(kept, key=lambda pair: pair[0])]


def sample_shards(
    paths: Sequence[Any] | Any,
    spec: RecordSpec,
    tokenizer: Any,
    size: int,
    seed: int,
    *,
    shard_root: str | Path | None = None,
) -> Tuple[List[Example], int]:
    """A seeded uniform sample of ``size`` examples across all records of the shards.

    paths: shard paths or globs, as :func:`~eogp_index.data.readers.expand_shards` takes them; a
        ``datasets.Dataset`` or ``IterableDataset`` is a shard too (one pass over it, in its order).

    Only the kept records are tokenized. A malformed record or one that does not tokenize into
    an example is never part of the sample (it is skipped, and counted).

    Returns:
        The examples in shard order, and the number of records read.
    """
    from eogp_index.data.readers import ParseError, expand_shards, iter_raw_records, shard_names

    shards = expand_shards(paths)
    names = shard_names(shards, root=shard_root)

    def records():
        for path, name in zip(shards, names):
            for raw in iter_raw_records(path, shard=name):
                if not isinstance(raw.record, ParseError):
                    yield raw

    # A sampled record can still fail to tokenize (empty text, no counted label): keep a few
    # spares so that such records are replaced from the same seeded sample, not lost.
    spares = max(8, size // 20)
    counter = _Counter(records())
    kept = reservoir_sample(counter, size + spares, seed)
    order = list(range(len(kept)))
    random.Random(seed + 1).shuffle(order)  # which spares replace a bad record: seeded, not positional
    examples: List[Tuple[int, Example]] = []
    for i in order:
        if len(examples) == size:
            break
        raw = kept[i]
        try:
            examples.append(
                (i, tokenize_record(raw.record, shard=raw.shard, position=raw.position, spec=spec, tokenizer=tokenizer))
            )
        except InputError:
            continue
    return [ex for _, ex in sorted(examples, key=lambda pair: pair[0])], counter.count


class _Counter:
    """An iterable that counts what passed through it."""

    def __init__(self, items: Iterable[Any]):
        self.items, self.count = items, 0

    def __iter__(self):
        for item in self.items:
            self.count += 1
            yield item


@dataclass(frozen=True)
class FitSets:
    """The curvature and PCA fitting sets, each in the order of the examples given.

    Attributes:
        curvature, pca: the examples (``pca`` is empty without a PCA stage).
        disjoint: whether no example is in both.
    """

    curvature: List[Example]
    pca: List[Example]
    disjoint: bool


def split_fit_sets(
    examples: Sequence[Example], num_curvature: int, num_pca: int, *, curvature_seed: int, pca_seed: int
) -> FitSets:
    """Seeded, disjoint curvature and PCA sets from ``examples``; overlapping ones if too few.

    With at least ``num_curvature + num_pca`` examples a seeded permutation gives the first
    ``num_curvature`` to the curvature and ``num_pca`` of the rest to the PCA. With fewer, each
    set is a seeded sample of all the examples (as many as there are, up to its size) and an
    :class:`OverlappingFitSetsWarning` says so.
    """
    n = len(examples)
    if num_pca == 0 or n >= num_curvature + num_pca:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(curvature_seed))
        curvature = order[:num_curvature]
        rest = order[num_curvature:]
        pca = rest[torch.randperm(rest.numel(), generator=torch.Generator().manual_seed(pca_seed))[:num_pca]]
        disjoint = True
    else:
        curvature = torch.randperm(n, generator=torch.Generator().manual_seed(curvature_seed))[:num_curvature]
        pca = torch.randperm(n, generator=torch.Generator().manual_seed(pca_seed))[:num_pca]
        both = len(set(curvature.tolist()) & set(pca.tolist()))
        disjoint = both == 0
        warnings.warn(
            f"only {n} fitting examples, fewer than the {num_curvature} curvature + {num_pca} PCA examples asked "
            f"for: the curvature and PCA sets overlap ({both} examples are in both). For disjoint sets give more "
            "documents (--data / --fit-data) or fewer --curvature-examples / --pca-examples.",
            OverlappingFitSetsWarning,
            stacklevel=2,
        )
    return FitSets(
        curvature=[examples[i] for i in curvature.sort().values.tolist()],
        pca=[examples[i] for i in pca.sort().values.tolist()],
        disjoint=disjoint,
    )
