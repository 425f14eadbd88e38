"""Fitting an index's projection, stages 1-3 in order: curvature, first stage, second stage.

:func:`fit_projection` is what ``eogp fit`` runs between loading the model and writing the index
directory:

1. the fitting sets: seeded, disjoint curvature and PCA samples of the examples
   (:mod:`eogp_index.fit.sampling`);
2. EK-FAC curvature with kronfluence on the curvature set (:mod:`eogp_index.fit.curvature`;
   factors written under ``<out>/curvature``);
3. the first stage of every module from those factors (its kept eigenvector columns held in 16
   bits for a half-precision model, :data:`~eogp_index.config.EIGENVECTOR_DTYPES`), and the
   SRHTs (:mod:`eogp_index.fit.projection`);
4. for EOGP, the first-stage coordinates of the PCA set, one backward pass per batch for all
   modules, cached on disk in float16 batch by batch; then each module's uncentered PCA from
   its cache, one module at a time (the Gram route when ``n < m_u``).

Memory: the model, kronfluence's factors, one batch's activations and coordinates, and one
module's cache with its Gram matrix; nothing else grows with the number of modules (each fitted
``P`` is written to ``fit/pca/`` and read back, one module at a time, when the projection file
is written).

Every stage is kept in ``<out>/fit/`` (:mod:`eogp_index.fit.cache`): a killed fit, rerun, reuses
the finished stages, batches and modules, and says so. Label sampling is seeded per batch, so
the rerun computes exactly what an uninterrupted fit computes.

Under ``torch.distributed`` (``eogp fit`` as torchrun workers) the PCA set's batches are split
over the ranks, and the modules' PCAs are dealt round-robin; curvature is split by kronfluence
itself on CUDA with NCCL, and otherwise runs on rank 0 while the others wait. A shared
filesystem under ``<out>`` is assumed.

Writing the manifest and the projection file is the store's job
(:meth:`~eogp_index.store.stored_index.StoredIndex.create`).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from eogp_index.config import EIGENVECTOR_DTYPES, CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.data.location import index_path, local_cache_dir
from eogp_index.data.records import Example
from eogp_index.errors import ConfigError, InputError
from eogp_index.fit.cache import FitFolder
from eogp_index.fit.code_choice import CODES, FP16, CodeChoice, held_out_rows, measure_module
from eogp_index.fit.curvature import factors_dir, fit_curvature, load_curvature
from eogp_index.fit.projection import (
    PCA_TORCH_DTYPES,
    Projection,
    apply_pca,
    build_projection,
    gram_matrix,
    module_rotation,
    second_stage_directions,
)
from eogp_index.fit.recall import RECALL_QUERIES, IndexRecall, format_recall, index_recall
from eogp_index.fit.sampling import FitSets, split_fit_sets
from eogp_index.gradients.capture import GradientCapture, batches, check_counted
from eogp_index.gradients.coverage import report_coverage
from eogp_index.gradients.experts import make_experts_trackable
from eogp_index.gradients.loss import IGNORE_INDEX, collate
from eogp_index.gradients.model import (
    dtype_name,
    find_attributed_modules,
    model_sha256,
    pad_token_id,
    replace_conv1d,
    torch_dtype,
)

CURVATURE_DIR = "curvature"
log = logging.getLogger("eogp_index.fit")


@dataclass(frozen=True)
class FittedProjection:
    """What a fit produced, and the facts about it the manifest records.

    Attributes:
        projection: the fitted per-module projections, in module order.
        weights_sha256: the model's SHA-256 as loaded (:func:`~eogp_index.gradients.model.model_sha256`).
        num_parameters: the model's parameter count.
        curvature_examples: examples the EK-FAC factors were fitted on.
        pca_examples: examples in the PCA fitting set (0 without a PCA stage).
        disjoint: whether the curvature and PCA sets share no example.
        folder: the fit's stages on disk; :meth:`FitFolder.finish` once the index is written.
        recall: with a rescoring tier and held-out documents, the index's recall of the tier's
            top rows by its one-bit codes, and the default rescoring factor it gives.
        held_out_queries: with a rescoring tier and held-out documents, the first
            :data:`~eogp_index.fit.recall.RECALL_QUERIES` of them projected by the stored
            projection, ``(q, T)`` float32 (all of every module's tier coordinates, as a query's):
            the queries of the table's recall measurement (:mod:`eogp_index.store.table_recall`).
        held_out_hashes: their documents' ``content_sha256``, ``(q,)``: a stored copy of one is
            left out of its own answers.
    """

    projection: Projection
    weights_sha256: str
    num_parameters: int
    curvature_examples: int
    pca_examples: int
    disjoint: bool = True
    folder: Optional[FitFolder] = None
    recall: Optional[IndexRecall] = None
    held_out_queries: Optional[np.ndarray] = None
    held_out_hashes: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Ranks:
    """This process's place in a ``torch.distributed`` job (rank 0 of 1 outside one)."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None
    backend: Optional[str] = None

    @classmethod
    def current(cls) -> "Ranks":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), dist.barrier, dist.get_backend())
        return cls()

    def share(self, items: Sequence[int]) -> list:
        """This rank's items, dealt round-robin."""
        return list(items)[self.rank :: self.world]


def fit_projection(
    model: nn.Module,
    tokenizer,
    examples: Sequence[Example],
    out_dir: Path,
    *,
    modules: Optional[Sequence[str]] = None,
    curvature: CurvatureConfig = CurvatureConfig(),
    projection: ProjectionConfig = ProjectionConfig(k=256),
    storage: StorageConfig = StorageConfig(),
    gradients: GradientConfig = GradientConfig(),
    progress: bool = True,
    sets: Optional[FitSets] = None,
) -> FittedProjection:
    """Fit curvature and projection on ``examples``; the model is prepared for attribution in place.

    Args:
        examples: tokenized examples; seeded, disjoint samples of them fit the EK-FAC factors
            (``curvature.num_examples``) and the PCA (``projection.num_fit_examples``); when they
            are too few for both, the two sets overlap and a warning says so.
        out_dir: the index directory; kronfluence's factors go to ``out_dir/curvature``, the
            fit's stages to ``out_dir/fit`` (an interrupted fit found there is resumed).
        modules: module names or globs to attribute (default: attention and MLP linears).
        sets: the fitting sets themselves (another checkpoint fitted on an index's recorded sets,
            ``eogp add-checkpoint``); None: sampled from ``examples``.
    """
    if not examples and sets is None:
        raise InputError("no examples to fit the curvature and projection on; give --data shards with documents")
    start = time.perf_counter()
    projection = projection.resolved(storage.tier)  # the default variant is the tier's
    ranks = Ranks.current()
    progress = progress and ranks.rank == 0  # one set of bars per job
    out_dir = index_path(out_dir)  # a local directory or an object-store URL (eogp_index.data.location)
    weights_sha256 = model_sha256(model)
    replace_conv1d(model)
    make_experts_trackable(model, dense=gradients.experts == "dense")
    device = gradients.resolved_device()
    model.to(device).eval()
    names = find_attributed_modules(model, modules)
    if ranks.rank == 0:
        report_coverage(model, names, log)
    pad_id = pad_token_id(tokenizer)
    use_pca = projection.second_stage == "pca"
    if sets is None:
        sets = split_fit_sets(
            examples,
            curvature.num_examples,
            projection.num_fit_examples if use_pca else 0,
            curvature_seed=curvature.seed,
            pca_seed=projection.seed,
        )
    check_counted(sets.pca)
    _probe_capture(model, names, sets.pca or sets.curvature, pad_id, device)
    gradients, curvature, partitions = _sized(
        model, names, sets, out_dir, projection, storage, curvature, gradients, device, ranks
    )
    held_out = held_out_rows(len(sets.pca), projection.held_out_fraction, projection.seed) if use_pca else None
    settings = {
        "weights_sha256": weights_sha256,
        "modules": list(names),
        "curvature": curvature.__dict__,
        "projection": projection.__dict__,
        "precision": storage.precision,
        "rescore": storage.tier,  # the recall measured, and so auto's choice, is against this tier
        # only when set: a cache fitted without it still matches
        **({} if storage.rescore_k is None else {"rescore_k": storage.rescore_k}),
        "max_tokens": gradients.max_tokens,
        "gradient_batch_size": gradients.batch_size,
    }
    folder = FitFolder(
        out_dir,
        settings,
        sets.curvature,
        sets.pca,
        disjoint=sets.disjoint,
        held_out=[sets.pca[i] for i in held_out.tolist()] if use_pca else (),
    )
    num_batches = -(-len(sets.pca) // gradients.batch_size)
    if ranks.rank == 0 and folder.begin():
        log.info(
            "resuming the interrupted fit in %s: reusing %s",
            folder.dir,
            _reused(folder, num_batches, len(names), use_pca),
        )
    ranks.barrier()

    factors = _curvature(
        model, sets.curvature, names, out_dir, folder, curvature, pad_id, device, ranks, progress, partitions
    )
    fitted = build_projection(
        factors,
        projection,
        storage,
        damping_ratio=curvature.damping_ratio,
        eigenvector_dtype=torch_dtype(EIGENVECTOR_DTYPES[dtype_name(model)]),
    )
    del factors  # build_projection copied the columns it keeps
    gc.collect()  # kronfluence's fit leaves reference cycles that hold tensors until the collector runs
    recall = queries = None
    if use_pca:
        pass_args = (model, fitted, names, sets.pca, folder, gradients, pad_id, device, ranks, progress)
        recall, queries = _fit_second_stage(
            pass_args, num_batches=num_batches, held_out=held_out, start=start, tier=storage.tier
        )
    return FittedProjection(
        projection=fitted,
        weights_sha256=weights_sha256,
        num_parameters=sum(p.numel() for p in model.parameters()),
        curvature_examples=len(sets.curvature),
        pca_examples=len(sets.pca),
        disjoint=sets.disjoint,
        folder=folder,
        recall=recall,
        held_out_queries=queries,
        held_out_hashes=()
        if queries is None
        else tuple(sets.pca[i].content_sha256 for i in held_out[: len(queries)].tolist()),
    )


def _fit_second_stage(
    pass_args: tuple, *, num_batches: int, held_out: torch.Tensor, start: float, tier: Optional[str] = None
) -> Tuple[Optional[IndexRecall], Optional[np.ndarray]]:
    """The PCA stage: the first-stage coordinates of the PCA set (``pass_args`` are
    :func:`_first_stage_pass`'s), each module's P from them, and, with held-out rows, the
    measurement of its 1-bit codes (variant ``auto`` keeps EOGP everywhere without them) and,
    with a rescoring tier ``tier``, the index's recall of it and the held-out query coordinates
    (:func:`_held_out_queries`; both returned, else None). Each P is left on disk, read when the
    projection file is written."""
    _, fitted, _, examples, folder, _, _, _, ranks, progress = pass_args
    if fitted.config.variant == "auto" and not held_out.numel():
        if ranks.rank == 0:
            log.info(
                "variant auto: %d held-out documents (held_out_fraction %s of %d) are too few to measure the "
                "1-bit codes; every module keeps EOGP",
                held_out.numel(),
                fitted.config.held_out_fraction,
                len(examples),
            )
        for module in fitted.modules.values():
            module.rotation = None
    _first_stage_pass(*pass_args)
    gc.collect()  # the pass's graphs and hooks, in reference cycles, before the PCA needs the memory
    ranks.barrier()
    _fit_modules(fitted, folder, num_batches, held_out, ranks, progress, tier)
    ranks.barrier()
    _read_choices(fitted, folder)
    recall = _index_recall(fitted, folder, tier) if held_out.numel() else None
    queries = _held_out_queries(fitted, folder) if recall is not None else None
    if ranks.rank == 0 and fitted.choices:
        log.info("%s", format_choices(fitted, time.perf_counter() - start, recall))
        if recall is not None and not recall.reached:
            log.warning(
                "no rescoring factor measured keeps the rescored top within NDCG gap %s of the %s tier's own; "
                "queries default to the largest measured, %s (give --rescore to choose another)",
                recall.gap_target,
                recall.tier,
                recall.factor,
            )
    for i, module in enumerate(fitted.modules.values()):
        # Read when the projection file is written, one module at a time, and dropped after:
        # never every module's P in memory at once.
        module.pca_loader = functools.partial(folder.read_module_pca, i)
    return recall, queries


def _held_out_queries(fitted: Projection, folder: FitFolder) -> Optional[np.ndarray]:
    """The held-out query coordinates of every module (``fit/pca/``), joined in module order:
    ``(q, T)`` float32; None when a module has none (a fit resumed from one made without them)."""
    parts = [folder.read_queries(i) for i in range(len(fitted.modules))]
    if not parts or any(part is None for part in parts):
        return None
    return np.ascontiguousarray(np.concatenate(parts, axis=1), np.float32)


def _probe_capture(
    model: nn.Module, names: Sequence[str], examples: Sequence[Example], pad_id: int, device: str
) -> None:
    """Two examples through the gradient capture before kronfluence's curvature pass, so that a
    module the capture refuses (one without per-example inputs) is refused at once, not after it."""
    counted = [ex for ex in examples[:16] if any(label != IGNORE_INDEX for label in list(ex.labels)[1:])][:2]
    if counted:
        batch = collate([(ex.input_ids, ex.labels) for ex in counted], pad_id)
        GradientCapture(model, names, lambda name, a, g: a[:, :0]).run({k: v.to(device) for k, v in batch.items()})


def _reused(folder: FitFolder, num_batches: int, num_modules: int, use_pca: bool) -> str:
    parts = ["the curvature factors" if folder.curvature_done() else "no curvature factors (refitting them)"]
    if use_pca:
        parts.append(
            f"the first-stage coordinates of {len(folder.batches_done(num_batches))} of {num_batches} "
            "batches (every module's cache, float16)"
        )
        parts.append(f"{len(folder.modules_done(num_modules))} of {num_modules} fitted modules")
    return ", ".join(parts)


def _sized(model, names, sets, out_dir, projection, storage, curvature, gradients, device, ranks):
    """The batch (documents, at most ``gradients.batch_size``) and kronfluence's module partitions
    that fit the memory budget, as ``eogp plan`` chooses them, said in the log.

    Returns ``gradients`` and ``curvature`` with those batch sizes, and the partitions. A resumed
    fit keeps the batch its cached coordinates were computed with when the batch is not given.
    """
    from eogp_index.fit.plan import FIT_PHASES, make_plan, memory_budget, shape_of_model

    budget, budget_from = memory_budget(gradients.memory_budget_gb, device)
    examples = [*sets.curvature, *sets.pca]
    plan = make_plan(
        shape_of_model(model, names, name="the model"),
        projection,
        precision=storage.precision,
        rescore=storage.rescore,
        rescore_k=storage.rescore_k,
        curvature_examples=len(sets.curvature),
        batch_size=gradients.batch_size,
        document_tokens=max(len(ex.input_ids) for ex in examples),
        memory_budget=budget,
        batch_tokens=gradients.batch_tokens,
        device="cpu" if device == "cpu" else "cuda",
    )
    documents = plan.batch.documents
    found = (FitFolder.existing_settings(out_dir) or {}).get("gradient_batch_size")
    if found is not None and gradients.batch_tokens is None and found <= gradients.batch_size:
        documents = found  # the interrupted fit's batches, whatever memory is free now
    partitions = plan.curvature.module_partitions
    if ranks.rank == 0:
        log.info(
            "memory budget %.3g GB (%s): batches of %d documents of up to %d tokens, kronfluence in %d module "
            "partition(s); eogp plan prints the estimates",
            budget / 1e9,
            budget_from,
            documents,
            plan.batch.document_tokens,
            partitions,
        )
        for key in FIT_PHASES:
            entry = plan.memory.phase(key)
            if entry.fits is False:
                log.warning("%s is estimated at %.3g GB, over the budget: %s", key, entry.bytes / 1e9, entry.fix)
    return (
        dataclasses.replace(gradients, batch_size=documents),
        dataclasses.replace(curvature, batch_size=min(curvature.batch_size, documents)),
        partitions,
    )


def _curvature(model, examples, names, out_dir, folder, config, pad_id, device, ranks, progress, partitions=1):
    """EK-FAC factors: reused when complete; else fitted by kronfluence (see the module docstring)."""
    # kronfluence writes local files: a remote index's factors stay in its local cache folder
    curvature_dir = local_cache_dir(out_dir) / CURVATURE_DIR
    # The marker is written after kronfluence returns, so it implies complete factor files.
    if not (folder.curvature_done() and factors_dir(curvature_dir).exists()):
        # kronfluence splits the work only on CUDA with NCCL; elsewhere rank 0 fits alone.
        everyone = ranks.world > 1 and str(device).startswith("cuda") and ranks.backend == "nccl"
        if everyone or ranks.rank == 0:
            if ranks.world > 1 and not everyone:
                log.info(
                    "rank 0 fits the curvature (kronfluence splits it only on CUDA with NCCL); the other %d ranks wait",
                    ranks.world - 1,
                )
            fit_curvature(
                model,
                [(ex.input_ids, ex.labels) for ex in examples],
                names,
                curvature_dir,
                config=config,
                pad_token_id=pad_id,
                device=device,
                progress=progress,
                module_partitions=partitions,
            )
        ranks.barrier()
        if ranks.rank == 0:
            folder.mark_curvature_done()
        ranks.barrier()
    return load_curvature(curvature_dir, list(names))


def _first_stage_pass(
    model,
    fitted: Projection,
    names,
    examples,
    folder: FitFolder,
    gradients: GradientConfig,
    pad_id: int,
    device: str,
    ranks: Ranks,
    progress: bool,
) -> None:
    """First-stage coordinates of the PCA set, one file per batch (all modules, float16).

    Batches are fixed by position (``gradients.batch_size``), so a batch's coordinates do not
    depend on which rank computes it or when; the ranks split the batches not yet on disk.
    """
    from tqdm.auto import tqdm

    all_batches = list(batches(examples, gradients.batch_size))
    pending = [b for b in range(len(all_batches)) if not folder.batch_path(b).exists()]
    ranks.barrier()  # every rank has the same list before any rank writes a batch
    mine = ranks.share(pending)
    if ranks.world > 1:
        log.info(
            "rank %d: first-stage coordinates of %d of the %d batches left (%d examples in all)",
            ranks.rank,
            len(mine),
            len(pending),
            len(examples),
        )

    # Each module's rows leave the hook as float16: one batch of every module is what is held.
    def to_half(name: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return fitted.modules[name].first_stage(a, g).to(torch.float16)

    capture = GradientCapture(model, names, to_half, checkpoint=gradients.gradient_checkpointing)
    for b in tqdm(mine, desc="PCA fitting set", unit="batch", disable=not progress):
        collated = collate([(ex.input_ids, ex.labels) for ex in all_batches[b]], pad_id)
        coords, _ = capture.run({key: value.to(device) for key, value in collated.items()})
        folder.write_batch(b, coords)


def _fit_modules(
    fitted: Projection,
    folder: FitFolder,
    num_batches: int,
    held_out: torch.Tensor,
    ranks: Ranks,
    progress: bool,
    tier: Optional[str] = None,
) -> None:
    """Each module's P from its cached coordinates, one module in memory at a time, round-robin over ranks.

    With held-out rows, each module's two 1-bit codes are measured on them first
    (:func:`~eogp_index.fit.code_choice.choose_code`; written to ``fit/pca/module-NNNN.json``
    before the module's P, so a resumed fit reads it back); variant ``auto`` keeps the rotation
    of the modules where EOGP-rot wins. With a tier, the module's tier scores and its stored
    code's one-bit scores of the held-out documents are written first, for the index's recall.
    The stored P is then fitted on the whole set.
    """
    from tqdm.auto import tqdm

    modules = list(fitted.modules.items())
    pending = [i for i in range(len(modules)) if not folder.module_path(i).exists()]
    ranks.barrier()  # every rank has the same list before any rank writes a module
    mine = ranks.share(pending)
    if ranks.world > 1:
        log.info(
            "rank %d: PCA of %d of the %d modules left: %s",
            ranks.rank,
            len(mine),
            len(pending),
            ", ".join(modules[i][0] for i in mine) or "none",
        )
    # P is kept on disk at the dtype the projection file stores it in, so that writing that file
    # streams each P from its memory map instead of converting them all in memory first.
    dtype = PCA_TORCH_DTYPES[fitted.config.pca_dtype]
    for i in tqdm(mine, desc="PCA per module", unit="module", disable=not progress):
        name, module = modules[i]
        z = folder.read_module(name, num_batches)  # (n, m) float16; fit_pca works in float64
        gram = gram_matrix(z) if z.shape[0] < z.shape[1] else None  # (n, n), shared by both fits
        if held_out.numel():
            rotation = module.rotation or module_rotation(fitted.config.seed, name, module.k)
            choice, scores = measure_module(z, module.k, rotation, held_out, gram=gram, tier=tier, tier_k=module.k)
            _apply_choice(fitted, name, choice)
            if scores is not None:
                stored = "eogp-rot" if module.rotation is not None else "eogp"
                folder.write_scores(i, {"tier": scores["tier"], "one_bit": scores[stored]})
            folder.write_choice(i, choice.to_json())
        directions = second_stage_directions(z, module, gram=gram).to(dtype)  # rotated where chosen
        if held_out.numel() and tier is not None:  # a query's coordinates, by the P stored
            folder.write_queries(i, apply_pca(z[held_out[:RECALL_QUERIES]], directions))
        folder.write_module(i, directions)
        del z, gram


def _apply_choice(fitted: Projection, name: str, choice: CodeChoice) -> None:
    """Record a module's measurement; under variant auto, drop its rotation where EOGP won."""
    fitted.choices[name] = choice
    if fitted.config.variant == "auto" and choice.code == "eogp":
        fitted.modules[name].rotation = None


def _read_choices(fitted: Projection, folder: FitFolder) -> None:
    """Every module's measurement, as the ranks (or an earlier, killed run) wrote them."""
    for i, name in enumerate(fitted.modules):
        record = folder.read_choice(i)
        if record is not None:
            _apply_choice(fitted, name, CodeChoice.from_json(record))


def _index_recall(fitted: Projection, folder: FitFolder, tier: Optional[str]) -> Optional[IndexRecall]:
    """The index's recall curve: every module's tier scores and stored code's one-bit scores of the
    held-out documents (``fit/pca/``), each summed over modules as the index sums them. None
    without a tier, or when a module has none (nothing measured)."""
    if tier is None:
        return None
    total_tier = total_one_bit = None
    for i in range(len(fitted.modules)):
        scores = folder.read_scores(i)
        if scores is None:
            return None
        total_tier = scores["tier"] if total_tier is None else total_tier + scores["tier"]
        total_one_bit = scores["one_bit"] if total_one_bit is None else total_one_bit + scores["one_bit"]
    rotated = sum(module.rotation is not None for module in fitted.modules.values())
    codes = {"eogp": len(fitted.modules) - rotated, "eogp-rot": rotated}
    return index_recall(tier, total_tier, total_one_bit, codes)


def format_choices(fitted: Projection, total_seconds: float, recall: Optional[IndexRecall] = None) -> str:
    """The fit's printout of the held-out measurement: per module, each code's NDCG@20 and
    Spearman against the first-stage inner products (± standard error), the FP16 coordinates' at
    the same ``k`` beside them, the paired difference and the code stored; with a rescoring tier,
    each code's recall of the module's tier scores (mean over the factors) and the index's
    recall curve and default factor (``recall``)."""
    choices = fitted.choices
    held = max(c.held_out for c in choices.values())
    lines = [
        f"held-out 1-bit fidelity to the first-stage inner products ({held} documents of the PCA set held out, "
        f"each a pseudo-query ranking the others; variant {fitted.config.variant}):",
        f"  {'module':<28} {'EOGP ndcg@20 / spearman':>26} {'EOGP-rot ndcg@20 / spearman':>30} "
        f"{'rot - eogp':>16}  {'code':<18} FP16 at k",
    ]
    for name, c in choices.items():
        if not c.held_out:
            lines.append(f"  {name:<28} {'(not measured)':>26}")
            continue
        cells = []
        for code in (*CODES, FP16):
            f = c.fidelity[code]
            cells.append(f"{f['ndcg@20']:.3f}±{f['ndcg@20_se']:.3f} / {f['spearman']:.3f}±{f['spearman_se']:.3f}")
        stored = c.code if fitted.config.variant == "auto" else f"{fitted.config.variant} (forced)"
        diff = f"{c.diff:+.3f}±{c.diff_se:.3f}" if math.isfinite(c.diff) else "n/a"
        lines.append(f"  {name:<28} {cells[0]:>26} {cells[1]:>30} {diff:>16}  {stored:<18} {cells[2]}")
        if c.recall is not None:
            lines.append(f"  {'':<28} {_recall_cells(c.recall)}")
    if recall is not None:
        lines.append("  " + format_recall(recall.to_json()))
    extra = sum(c.seconds for c in choices.values())
    lines.append(
        f"  measurement time {extra:.2f} s of the fit's {total_seconds:.2f} s "
        f"({100 * extra / max(total_seconds, 1e-9):.1f}%)"
    )
    return "\n".join(lines)


def _recall_cells(recall) -> str:
    """A module's recall of its tier's top rows, per code, as the mean over the factors."""
    cells = []
    for code, curve in recall.curves.items():
        mean = sum(curve.recall) / len(curve.recall) if curve.recall else float("nan")
        cells.append(f"{code} {mean:.3f}")
    diff = f"{recall.diff:+.3f}±{recall.diff_se:.3f}" if math.isfinite(recall.diff) else "n/a"
    t = next(iter(recall.curves.values())).t
    return f"recall of the tier's top-{t} (mean over F): {', '.join(cells)}; rot - eogp {diff}; code {recall.code}"


#: Config entries that name or stamp a checkpoint rather than describe its architecture.
_CONFIG_STAMPS = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype")


def check_checkpoint(first: nn.Module, other: nn.Module, *, first_name: str, name: str) -> None:
    """Refuse checkpoint ``other`` (``name``) for an ensemble with ``first`` (``first_name``)
    unless both have one architecture: the same config (but for names and version stamps) and
    parameters of the same names and shapes (so the same attributed modules, which are found by
    the modules' names and types).

    Raises:
        IncompatibleIndexError: naming the checkpoint and what differs.
    """
    from eogp_index.errors import IncompatibleIndexError

    def config(model) -> dict:
        found = getattr(model, "config", None)
        data = found.to_dict() if found is not None and hasattr(found, "to_dict") else {}
        return {key: value for key, value in data.items() if key not in _CONFIG_STAMPS}

    def refuse(what: str) -> IncompatibleIndexError:
        return IncompatibleIndexError(
            f"checkpoint {name!r} cannot join an ensemble with {first_name!r}: {what}. The checkpoints of an "
            "ensemble are checkpoints of one training run: one architecture, attributed modules and tokenizer"
        )

    a, b = config(first), config(other)
    differ = sorted(key for key in set(a) | set(b) if a.get(key) != b.get(key))
    if differ:
        key = differ[0]
        raise refuse(f"its config differs in {key!r} ({b.get(key)!r}, not {a.get(key)!r})")
    shapes = [{n: tuple(p.shape) for n, p in model.named_parameters()} for model in (first, other)]
    if shapes[0] != shapes[1]:
        key = sorted(set(shapes[0]) ^ set(shapes[1]) or {n for n in shapes[0] if shapes[0][n] != shapes[1][n]})[0]
        raise refuse(f"its parameter {key!r} differs ({shapes[1].get(key)}, not {shapes[0].get(key)})")


def check_tokenizer(first, other, *, first_name: str, name: str) -> None:
    """Refuse checkpoint ``name``'s tokenizer unless it tokenizes as ``first_name``'s: the same
    vocabulary and special tokens.

    Raises:
        IncompatibleIndexError: naming the checkpoint and what differs.
    """
    from eogp_index.errors import IncompatibleIndexError

    for what, read in (
        ("vocabulary", lambda t: t.get_vocab()),
        ("special tokens", lambda t: getattr(t, "special_tokens_map", {})),
    ):
        if read(first) != read(other):
            raise IncompatibleIndexError(
                f"checkpoint {name!r} cannot join an ensemble with {first_name!r}: its tokenizer's {what} "
                "differ, so one query would be different tokens for each. Use checkpoints of one training run"
            )


def checkpoint_weights_from(spec: str, checkpoints: Sequence[str]) -> Optional[list]:
    """The weights of ``--checkpoint-weights`` (``eogp fit``, ``eogp eval lds``), one per
    checkpoint in ``checkpoints`` (the first model first), or None for ``uniform`` (``1/C`` each).

    ``spec`` is ``uniform`` or a JSON file: a list of ``C`` numbers or ``{"weights": [...]}``
    (taken as given), or a HuggingFace ``trainer_state.json``: each checkpoint's weight is the
    ``learning_rate`` its ``log_history`` logged last at or before the checkpoint's step,
    normalized to sum to 1 (TRAK's and LESS's learning-rate weighting). A checkpoint's step is its
    own ``trainer_state.json``'s ``global_step`` when its directory has one, else the ``N`` of a
    directory named ``checkpoint-N``.

    Raises:
        ConfigError: ``spec`` is neither ``uniform`` nor a file.
        InputError: the file is unreadable, holds another count of weights, a weight that is not a
            finite number, only zeros, or a trainer state without a checkpoint's step or rate;
            naming the file.
    """
    import json

    count = len(checkpoints)
    if spec == "uniform":
        return None
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--checkpoint-weights {spec!r}: neither 'uniform' nor a file; give uniform or a JSON file of {count} weights"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path}: not readable JSON ({exc}); give a list of {count} weights") from None
    if isinstance(data, dict) and "log_history" in data:
        rates = [_learning_rate(data, checkpoint, path) for checkpoint in checkpoints]
        if sum(rates) <= 0:
            raise InputError(f"{path}: the learning rates at the checkpoints' steps sum to {sum(rates)}, not above 0")
        return [rate / sum(rates) for rate in rates]
    values = data.get("weights") if isinstance(data, dict) else data
    if not isinstance(values, list) or len(values) != count:
        raise InputError(
            f"{path}: needs {count} weights, one per checkpoint with the first model first (a list or "
            f'{{"weights": [...]}}), got {values!r}'
        )
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise InputError(f"{path}: every weight must be a finite number, got {values!r}")
    if not any(values):
        raise InputError(f"{path}: the weights are all zero; give at least one non-zero weight")
    return [float(v) for v in values]


def _learning_rate(state: Dict[str, Any], checkpoint: str, path: Path) -> float:
    """The learning rate trainer state ``state`` (read from ``path``) logged last at or before
    ``checkpoint``'s step."""
    import json
    import re

    own = Path(checkpoint) / "trainer_state.json"
    step: Optional[int] = None
    if own.is_file():
        try:
            step = int(json.loads(own.read_text(encoding="utf-8"))["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            step = None
    named = re.search(r"checkpoint-(\d+)$", str(checkpoint).rstrip("/"))
    if step is None and named:
        step = int(named.group(1))
    if step is None:
        raise InputError(
            f"{path}: cannot tell the step of checkpoint {checkpoint} (no trainer_state.json with "
            "global_step, not named checkpoint-N); give its weights as a list instead"
        )
    logged = sorted(
        (int(e["step"]), float(e["learning_rate"]))
        for e in state.get("log_history") or []
        if isinstance(e, dict) and "step" in e and "learning_rate" in e
    )
    before = [rate for at, rate in logged if at <= step]
    if not before:
        raise InputError(f"{path}: log_history has no learning_rate at or before step {step} of {checkpoint}")
    return before[-1]
