"""``eogp plan``: the paper's storage accounting (Appendix E) for a model, before anything runs.

Given the attributed modules' shapes and the fit options, :func:`make_plan` gives per module
``d_u = d_out·d_in'`` (``d_in'`` counts a bias column), ``(m_u, k_u)`` from
:meth:`ProjectionConfig.dims`, and the bytes each part of an index takes:

* per example: ``Σ_u(⌈k_u/8⌉+2)`` in 1-bit mode (``2Σk_u`` / ``4Σk_u`` for fp16 / fp32 coordinates);
* shared, in ``projection.safetensors``: the eigenvector columns the kept coordinates touch, at
  ``w`` bytes each (2 for a half-precision model, ``config.EIGENVECTOR_DTYPES``) —
  ``w·(d_out·r_u + d_in'·c_u)`` with ``r_u ≤ d_out`` rows and ``c_u ≤ d_in'`` columns, known
  only after the fit, so the upper bound ``w·(d_out² + d_in'²)`` is given (exact when
  ``m_u = d_u``; a fitted index's are read from its file) —, ``12·m_u`` of whitening weights and
  positions, and ``P`` at ``2·m_u·k_u`` (FP16) or ``4·m_u·k_u``;
* kronfluence's factors (``curvature/``): covariances, eigenvectors, eigenvalues and the
  corrected eigenvalues, float32;
* the fit's cache (``fit/``, deleted when the fit finishes): the PCA set's first-stage
  coordinates, ``n·Σ_u m_u·2`` bytes, and each module's fitted ``P`` in float32;
* peak memory of each phase (fit: curvature, first stage, PCA, save; ingest with ``P`` resident,
  read per batch or per block of documents; query), each
  listing what it counts, from the model's dtype, the batch (documents x tokens) and kronfluence's
  module partitions; with a memory budget, whether it fits and, if not, which option would
  make it fit; and the disk each phase writes;
* the store for ``N`` documents: ``N`` times the per-example payload, and the in-memory copy
  queries scan;
* the rescoring tier (:class:`TierSize`): its bytes per row (``Σ_u (t_u + 2)`` for int8 of
  ``t_u`` coordinates per module, ``StorageConfig.rescore_k``), both tiers' totals on disk, and
  the bytes a query reads: the one-bit code of every row, and the tier of the ``N = F · k`` rows
  it rescores per side.

A checkpoint ensemble (``eogp fit CKPT_A CKPT_B ...``, ``checkpoints=C``) has ``C`` models, ``C``
projections and ``C`` codes per example: the rows are one checkpoint's modules, then each further
checkpoint's (named ``c<j>/<module>``, the index's combined layout), so the bytes per example, the
tier, the in-memory copy, the shared files, kronfluence's factors and the fit's cache count ``C``
times. The fit runs once per checkpoint, one after another: its phases' memory is one
checkpoint's, their disk (what stays) ``C`` times; ingest and queries hold every checkpoint's
model, eigenbases and ``P``, and take ``C`` gradients per document.

Every phase is a function of the plan's inputs and the batch (``*_phase``), so that a phase
or a term (a block of documents, the P bytes read per document) is added in one place.
The batch is chosen as ``eogp fit`` and ``eogp ingest`` choose theirs: the most documents (at
most ``--batch-size``) whose projecting phases fit the budget.

The arithmetic is torch-free; :func:`model_shape` builds the model on PyTorch's ``meta``
device (no weights are read or allocated) to list its modules.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from eogp_index.config import (
    DEFAULT_M_HELP,
    EIGENVECTOR_DTYPES,
    MAX_BLOCK_DOCUMENTS,
    MODEL_DTYPE_BYTES,
    PCA_DTYPE_BYTES,
    ProjectionConfig,
    StorageConfig,
    bytes_per_module,
    tier_bytes_per_module,
)
from eogp_index.errors import ConfigError, ModelError
from eogp_index.fit.blocks import (
    FIRST_STAGE_ITEMSIZE,
    PReads,
    block_memory_per_document,
    cache_bytes_per_document,
    default_block_documents,
    p_reads,
    whole_batches,
)

F32, F64 = 4, 8
#: What an eogp process holds besides tensors while it works: the interpreter, torch,
#: transformers, kronfluence, LanceDB, numba and their libraries, and their working memory (Arrow
#: buffers, numba's compiled kernels, oneDNN's caches, the allocator's free lists). Measured as
#: peak RSS less the peak of live tensor bytes (``benchmarks/fit_memory.py``, "rss-tensors") on
#: x86-64 Linux with CPU torch 2.x; a CUDA build adds its own libraries and context.
PROCESS_BYTES = 750_000_000
#: The largest float32/float64 buffer that fit_pca and apply_pca upcast at once
#: (``fit.projection._UPCAST_BYTES``).
UPCAST_BLOCK_BYTES = 64 << 20
#: The most bytes of float32 logits the loss upcasts at once (``gradients.loss.LOSS_CHUNK_BYTES``).
LOSS_CHUNK_BYTES = 32 << 20
#: The fit's phases, run one after another; its peak is the largest.
FIT_PHASES = ("fit_curvature", "fit_first_stage", "fit_pca", "fit_save")
#: The hits per side and the rescoring factor a query's bytes are counted for when the caller
#: gives none: ``Question``'s defaults (the CLI passes them from ``Question`` itself; this layer
#: sits below the search package).
QUERY_HITS = 10
QUERY_RESCORE = 5
#: The sides a query reads (direction ``both``, the default).
QUERY_SIDES = 2
#: The bandwidth a node scans its in-memory codes at, in GB/s, when ``--bandwidth-gbs`` gives
#: none: a stated figure for one server's streaming reads from memory, not a measurement.
SCAN_BANDWIDTH_GBS = 20.0
#: The table's bookkeeping columns per row, uncompressed Arrow (``--metadata-bytes`` replaces
#: it, with the user's metadata columns added): an id of 24 characters and a shard name of 16,
#: each with its 4-byte offset (28 + 20), position (8), the two token counts (4 + 4), truncated
#: (1), the content hash in hex (64 + 4) and its kind (4 + 4).
ROW_BOOKKEEPING_BYTES = 28 + 20 + 8 + 4 + 4 + 1 + 68 + 8
#: manifest.json before a fit, estimated: its fixed fields, and each module's entry
#: (``eogp plan INDEX`` reads the file's size).
MANIFEST_BASE_BYTES, MANIFEST_MODULE_BYTES = 2_000, 300


@dataclass(frozen=True)
class ModuleShape:
    """An attributed linear module: ``d_out`` outputs, ``d_in`` inputs (+1 with a bias)."""

    name: str
    d_out: int
    d_in: int

    @property
    def d(self) -> int:
        return self.d_out * self.d_in


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model: its attributed modules and its size.

    ``context`` is the longest sequence it takes (used when ``--max-tokens`` is not given);
    ``coverage`` the attributed share of its parameters (:meth:`Coverage.to_json
    <eogp_index.gradients.coverage.Coverage.to_json>`); ``dtype`` the checkpoint's own (its config's ``dtype``; float32 when it names none).
    """

    name: str
    modules: Tuple[ModuleShape, ...]
    num_parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    context: int
    coverage: Optional[Dict[str, Any]] = None
    dtype: str = "float32"


def model_shape(name_or_config: str, patterns: Optional[Sequence[str]] = None, *, experts: str = "fused") -> ModelShape:
    """The attributed modules of a model given as a hub name, a local directory or a config.json
    file, without its weights: the model is built on the ``meta`` device (nothing is allocated;
    a hub name downloads its config only).

    Raises:
        ModelError: the config cannot be read, or no module matches ``patterns``.
    """
    from transformers import AutoConfig

    from eogp_index.gradients.model import model_and_adapter

    path = Path(name_or_config)
    base, adapter = model_and_adapter(name_or_config) if path.is_dir() else (name_or_config, None)
    try:
        if path.is_file():
            fields = json.loads(path.read_text())
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(
            f"cannot read a model config from {name_or_config!r} ({exc}); give a hub name, a model "
            "directory or a config.json with a model_type"
        ) from exc
    return shape_of_config(config, name=str(name_or_config), patterns=patterns, adapter=adapter, experts=experts)


def shape_of_config(
    config,
    *,
    name: str,
    patterns: Optional[Sequence[str]] = None,
    adapter: Optional[str] = None,
    experts: str = "fused",
) -> ModelShape:
    """:func:`model_shape` from a ``transformers`` config object, with ``adapter``'s LoRA layers if
    given, and fused experts rebuilt as linear layers with ``experts="dense"``."""
    import torch
    from transformers import AutoModelForCausalLM

    from eogp_index.gradients.experts import make_experts_trackable
    from eogp_index.gradients.model import add_lora_layers, find_attributed_modules, replace_conv1d

    with torch.device("meta"):  # shapes only: no weight is allocated, however large the model
        model = AutoModelForCausalLM.from_config(config)
        if adapter is not None:
            add_lora_layers(model, adapter)
        replace_conv1d(model)
        make_experts_trackable(model, dense=experts == "dense")
    return shape_of_model(model, find_attributed_modules(model, patterns), name=name, dtype=_config_dtype(config))


def shape_of_model(model, names: Sequence[str], *, name: str, dtype: Optional[str] = None) -> ModelShape:
    """:func:`model_shape` of a built model (``Conv1D`` already replaced) and its attributed
    modules; ``dtype`` defaults to its weights' own."""
    from eogp_index.gradients.coverage import model_coverage
    from eogp_index.gradients.model import module_shape

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape(
        name=name,
        modules=tuple(ModuleShape(n, *module_shape(model, n)) for n in names),
        num_parameters=sum(p.numel() for p in model.parameters()),
        hidden_size=int(getattr(text, "hidden_size")),
        num_layers=int(getattr(text, "num_hidden_layers")),
        vocab_size=int(getattr(text, "vocab_size")),
        context=int(getattr(text, "max_position_embeddings", 0) or getattr(text, "n_positions", 0) or 2048),
        coverage=model_coverage(model, names).to_json(),
        dtype=dtype or str(next(model.parameters()).dtype).removeprefix("torch."),
    )


def memory_budget(budget_gb: Optional[float], device: str) -> Tuple[int, str]:
    """``(bytes, where from)``: ``--memory-budget`` GB, else :func:`device_memory`."""
    if budget_gb is not None:
        return int(budget_gb * 1e9), "--memory-budget"
    return device_memory(device), f"the memory of {device}"


def device_memory(device: str) -> int:
    """Bytes a run on ``device`` may use by default: a GPU's total memory, else the memory
    available now."""
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    from eogp_index.config import available_memory

    return available_memory()


def _config_dtype(config) -> str:
    """The dtype a config says its checkpoint is stored in (``from_pretrained(dtype="auto")``)."""
    value = getattr(config, "dtype", None)
    name = str(value).removeprefix("torch.") if value is not None else "float32"
    return name if name in MODEL_DTYPE_BYTES else "float32"


def _eigen_upper(mod: ModuleShape, element_bytes: int) -> int:
    """Bytes of the kept eigenvector columns at ``element_bytes`` each: at most all of ``Q_S`` and
    ``Q_A``; exactly that when every coordinate is kept."""
    return element_bytes * (mod.d_out**2 + mod.d_in**2)


def _eigen_fields(nbytes: int, dtype: str, exact: bool) -> Dict[str, Any]:
    """A module's kept eigenvector columns, as :class:`ModuleRow` fields: ``nbytes`` held in
    ``dtype`` (exact or a bound), and the float32 copy its first stage makes of them (none when
    they are float32)."""
    upcast = 0 if dtype == "float32" else nbytes * F32 // MODEL_DTYPE_BYTES[dtype]
    return {
        "eigenbasis_bytes": nbytes,
        "eigenbasis_bytes_max": nbytes,
        "eigenbasis_exact": exact,
        "eigenbasis_dtype": dtype,
        "eigenbasis_upcast_bytes": upcast,
    }


def _json(value: Any) -> Any:
    """A plan part as JSON: a dataclass by its fields, in order (a field's ``json`` metadata is
    its key), tuples as lists."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if is_dataclass(value):
        return _json_fields(value)
    if isinstance(value, (tuple, list)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


def _json_fields(part: Any, last: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """``part``'s fields as JSON in their order (a field's ``json`` metadata is its key), the
    ``last`` ones moved to the end."""
    ordered = [f for f in fields(part) if f.name not in last] + [f for f in fields(part) if f.name in last]
    return {f.metadata.get("json", f.name): _json(getattr(part, f.name)) for f in ordered}


class _Part:
    """A part of the plan: :meth:`to_json` gives its fields in order, as ``eogp plan --json`` prints them."""

    def to_json(self) -> Dict[str, Any]:
        return _json_fields(self)


@dataclass(frozen=True)
class ModuleRow(_Part):
    """One attributed module in the plan: its shape ``d_out x d_in`` (``d_in`` counts a bias
    column; ``d`` their product), ``(m, k)``, and the bytes of each of its parts: per example;
    its ``P``; its kept eigenvector columns (``eigenbasis_bytes``, exact or a bound, held in
    ``eigenbasis_dtype``, and their float32 copy while its first stage is computed); its
    whitening weights, positions and SRHT (``other_bytes``); kronfluence's factors (float32).
    ``tier_k``: the rescoring tier's coordinates (``P`` has that many columns; ``k`` without a
    wider tier), ``tier_bytes_per_example``: its bytes per row (0 without a tier)."""

    name: str
    d_out: int
    d_in: int
    d: int
    m: int
    k: int
    bytes_per_example: int
    tier_k: int
    tier_bytes_per_example: int
    pca_bytes: int
    eigenbasis_bytes: int
    eigenbasis_bytes_max: int
    eigenbasis_exact: bool
    eigenbasis_dtype: str
    eigenbasis_upcast_bytes: int
    other_bytes: int
    factor_bytes: int


def curvature_partitions(factor_bytes: Sequence[int], available: Optional[int]) -> int:
    """The fewest kronfluence module partitions whose largest holds at most ``available`` bytes
    of factors (every module alone when even that does not fit; 1 without a budget).

    kronfluence deals the modules, in model order, into ``p`` contiguous parts of nearly equal
    count (``kronfluence.module.utils.make_modules_partition``); a part's modules are the ones
    whose covariances, then eigenvectors and Λ, it holds on the device at once.
    """
    count = len(factor_bytes)
    if available is None or count == 0:
        return 1
    for parts in range(1, count + 1):
        if _largest_part(factor_bytes, parts) <= available:
            return parts
    return count


def _largest_part(factor_bytes: Sequence[int], parts: int) -> int:
    """Bytes of the largest of kronfluence's ``parts`` module partitions."""
    div, mod = divmod(len(factor_bytes), parts)
    return max(sum(factor_bytes[i * div + min(i, mod) : (i + 1) * div + min(i + 1, mod)]) for i in range(parts))


@dataclass(frozen=True)
class _Inputs:
    """What every phase's estimate reads: the model, the modules' rows and the options."""

    shape: ModelShape
    rows: Tuple[ModuleRow, ...]
    projection: ProjectionConfig
    dtype: str
    n_pca: int
    curvature_examples: int
    documents: int
    precision: str
    budget: Optional[int]
    device: str
    checkpoints: int = 1

    @property
    def w(self) -> int:
        """Bytes per weight and activation element in the model's dtype."""
        return MODEL_DTYPE_BYTES[self.dtype]

    @property
    def pca(self) -> bool:
        return self.projection.second_stage == "pca"

    @property
    def p_dtype(self) -> int:
        return PCA_DTYPE_BYTES[self.projection.pca_dtype]

    @property
    def weights(self) -> int:
        """One checkpoint's weights."""
        return self.w * self.shape.num_parameters

    @property
    def model(self) -> int:
        """The process and every checkpoint's weights (all of them loaded, as ingest and queries
        hold them)."""
        return PROCESS_BYTES + self.checkpoints * self.weights

    @property
    def one(self) -> "_Inputs":
        """One checkpoint's inputs: its rows alone (the fit's phases, which fit one checkpoint at a
        time)."""
        if self.checkpoints == 1:
            return self
        return replace(self, rows=self.rows[: len(self.rows) // self.checkpoints], checkpoints=1)

    @property
    def eigen(self) -> int:
        """Kept eigenvector columns (exact on a fitted index, else their bound) and the whitening
        weights, positions and SRHTs, as held while projecting."""
        return sum(r.eigenbasis_bytes + r.other_bytes for r in self.rows)

    @property
    def eigen_dtype(self) -> str:
        """The dtype the kept eigenvector columns are held in: ``EIGENVECTOR_DTYPES`` of the model's
        (a fitted index's file may hold them in float32, as written before they followed it)."""
        return self.rows[0].eigenbasis_dtype

    @property
    def eigen_upcast(self) -> int:
        """The float32 copy of one module's kept eigenvector columns, made while its first stage
        is computed (none when they are held in float32): the largest module's."""
        return max(r.eigenbasis_upcast_bytes for r in self.rows)

    @property
    def eigen_is_bound(self) -> bool:
        return not all(r.eigenbasis_exact for r in self.rows)

    @property
    def pca_total(self) -> int:
        return sum(r.pca_bytes for r in self.rows)

    @property
    def largest_pca(self) -> int:
        return max(r.pca_bytes for r in self.rows)

    @property
    def upcast(self) -> int:
        """apply_pca upcasts an FP16 P in float32 blocks of at most 64 MiB (none for an fp32 P)."""
        largest = max(self.rows, key=lambda r: r.m * r.tier_k)
        if not (self.pca and self.projection.pca_dtype == "fp16"):
            return 0
        return min(F32 * largest.m * largest.tier_k, UPCAST_BLOCK_BYTES)

    def activations(self, tokens: int, *, captured_bytes: Optional[int] = None, sampled: bool = False) -> int:
        """One batch of ``tokens`` (documents x padded length) through the model: the activations
        autograd keeps, ~34·h bytes per token and layer at 16 bits (Korthikanti et al. 2022,
        attention scores not kept by fused attention), scaled to the model's dtype; the logits
        (:meth:`logits`); and every attributed module's input, held by the capture hooks until its
        backward (in the model's dtype, or ``captured_bytes`` per element)."""
        shape = self.shape
        autograd = 17 * self.w * shape.hidden_size * shape.num_layers * tokens
        # The checkpoints take the batch one after another: one checkpoint's inputs are captured at once.
        captured = (captured_bytes or self.w) * tokens * sum(r.d_in for r in self.one.rows)
        return autograd + self.logits(tokens, sampled=sampled) + captured

    def logits(self, tokens: int, *, sampled: bool = False) -> int:
        return logits_bytes(self.shape.vocab_size * tokens, self.w, sampled=sampled)


def logits_bytes(elements: int, itemsize: int, *, sampled: bool = False) -> int:
    """The most the loss holds at once for ``elements`` logits (vocabulary x tokens) of
    ``itemsize`` bytes (``gradients.loss``): the logits and their gradient, in the model's dtype,
    and float32 chunks of tokens (an upcast chunk and what is computed from it, two at most);
    with ``sampled`` labels (the fit's curvature passes draw them from the model) the float32
    probabilities and the sampler's float32 draw of the same size, while the logits are held, if
    that is more."""
    backward = 2 * itemsize * elements + min(2 * LOSS_CHUNK_BYTES, 2 * F32 * elements)
    return max(backward, (itemsize + 2 * F32) * elements) if sampled else backward


def _in_dtype(inp: _Inputs, dtype: str) -> _Inputs:
    """``inp`` refitted with the model in ``dtype``: its weights, activations and kept eigenvector
    columns (the same rows and columns, held in ``EIGENVECTOR_DTYPES`` of it) counted in it."""
    held = EIGENVECTOR_DTYPES[dtype]
    rows = tuple(
        replace(
            r,
            **_eigen_fields(
                r.eigenbasis_bytes * MODEL_DTYPE_BYTES[held] // MODEL_DTYPE_BYTES[r.eigenbasis_dtype],
                held,
                r.eigenbasis_exact,
            ),
        )
        for r in inp.rows
    )
    return replace(inp, dtype=dtype, rows=rows)


@dataclass(frozen=True)
class Batch:
    """A forward/backward batch: ``documents`` of up to ``document_tokens`` tokens each."""

    documents: int
    document_tokens: int

    @property
    def tokens(self) -> int:
        return self.documents * self.document_tokens


@dataclass(frozen=True)
class Estimate(_Part):
    """A peak of memory that is not a phase of its own (the process; the fit's largest phase):
    ``bytes``, what they count, whether they are an upper bound (the kept eigenvector columns
    before a fit), and against a budget whether they fit it and, if not, the ``fix``."""

    bytes: int
    bound: bool
    counts: str
    fits: Optional[bool] = None
    fix: Optional[str] = None


@dataclass(frozen=True, kw_only=True)
class Phase:
    """A phase's peak memory (an estimate: ``bytes``, what it ``counts``, whether it is an upper
    ``bound``), the disk it writes (``disk_bytes``, ``disk_counts``), and against a budget
    whether it ``fits`` and, if not, which option would make it fit (``fix``)."""

    bytes: int
    counts: str
    bound: bool = False
    disk_bytes: int = 0
    disk_counts: str = ""
    fits: Optional[bool] = None
    fix: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        """Its fields in order, a kind's own after the common ones, ``fits`` and ``fix`` last."""
        return _json_fields(self, last=("fits", "fix"))


@dataclass(frozen=True, kw_only=True)
class CurvaturePhase(Phase):
    """kronfluence's fit: the ``module_partitions`` it runs in, each of its ``steps``' peak, and
    the host memory its eigendecomposition holds (``host_bytes``, what they count)."""

    module_partitions: int
    steps: Dict[str, int]
    host_bytes: int
    host_counts: str


@dataclass(frozen=True, kw_only=True)
class IngestPhase(Phase):
    """Projecting and storing a batch, with every module's ``P`` resident or one at a time."""

    p_resident: bool


@dataclass(frozen=True, kw_only=True)
class BlockPhase(Phase):
    """Block ingest: ``P`` read once per block of ``block_documents``."""

    block_documents: int


@dataclass(frozen=True, kw_only=True)
class QueryPhase(Phase):
    """A batch of queries: what ingest holds and the hot copy (``hot_bytes``) it scans."""

    hot_bytes: int
    p_resident: bool


def _factor_split(row: ModuleRow) -> Tuple[int, int, int]:
    """A module's kronfluence factors by the step that makes them (float32): its covariances
    (``A`` and ``S``), their eigenvectors and eigenvalues, and Λ."""
    covariances = F32 * (row.d_in**2 + row.d_out**2)
    return covariances, covariances + F32 * (row.d_in + row.d_out), F32 * row.d


def fit_curvature_phase(inp: _Inputs, batch: Batch) -> CurvaturePhase:
    """kronfluence's fit, in module partitions chosen to fit the budget: its three steps, one
    after another, and the largest of them.

    * covariance pass: one curvature batch through the model (module inputs captured in float32,
      labels sampled from the float32 probabilities) and the partition's covariances;
    * eigendecomposition: one module's covariance and eigenvectors in float64 on the device,
      while the host holds every module's covariances and the eigenvectors made so far;
    * Λ pass: the batch again, one module's per-example gradients and their rotation, and the
      partition's eigenvectors, eigenvalues and Λ.

    On the CPU the device is the host: the eigendecomposition's host memory is the step's peak.
    """
    split = [_factor_split(r) for r in inp.rows]
    factor_bytes = [sum(parts) for parts in split]
    widest = max(r.d for r in inp.rows)
    docs = min(batch.documents, inp.curvature_examples)
    tokens = docs * batch.document_tokens
    passes = inp.activations(tokens, captured_bytes=F32, sampled=True)
    per_example = 2 * F32 * docs * widest
    eigh = 2 * F64 * max(max(r.d_in, r.d_out) ** 2 for r in inp.rows)
    available = None if inp.budget is None else inp.budget - inp.model - passes - per_example
    parts = curvature_partitions(factor_bytes, available)
    held = _largest_part(factor_bytes, parts)
    covariance_pass = passes + _largest_part([c for c, _, _ in split], parts)
    lambda_pass = passes + per_example + _largest_part([e + lam for _, e, lam in split], parts)
    host = PROCESS_BYTES + sum(c + e for c, e, _ in split)
    on_cpu = inp.device == "cpu"
    decomposition = (host - PROCESS_BYTES + eigh) if on_cpu else eigh
    steps = {"covariance pass": covariance_pass, "eigendecomposition": decomposition, "Λ pass": lambda_pass}
    largest = max(steps, key=steps.get)
    return CurvaturePhase(
        bytes=inp.model + steps[largest],
        counts=f"process + weights ({inp.dtype}) + the largest of kronfluence's steps, here the {largest} "
        f"({parts} module partition{'s' if parts > 1 else ''} of {len(factor_bytes)}, {_size(held)} of "
        "factors in the largest): the covariance pass holds one curvature batch's activations (module "
        "inputs in float32; logits with the float32 probabilities their labels are sampled from) and the "
        "partition's covariances; the eigendecomposition one module's covariance and eigenvectors in "
        "float64"
        + (", and every module's covariances and eigenvectors (on the CPU, host memory)" if on_cpu else "")
        + "; the Λ pass the batch, one module's per-example gradients and the partition's eigenvectors and Λ",
        bound=inp.eigen_is_bound,
        disk_bytes=sum(factor_bytes) * (2 if parts > 1 else 1),
        disk_counts="kronfluence's factors (curvature/), twice while partitions are aggregated",
        module_partitions=parts,
        steps=steps,
        host_bytes=host,
        host_counts="process + every module's covariances and eigenvectors: kronfluence's "
        "eigendecomposition holds them in host memory, whatever the partitions",
    )


def first_stage_phase(inp: _Inputs, batch: Batch) -> Phase:
    """The model with the kept eigenvector columns and one batch's activations and first-stage
    rows: the fit's PCA pass, and what ingest and queries hold besides P."""
    widest = max(r.d for r in inp.rows)
    sum_m = sum(r.m for r in inp.rows)
    # Per batch, one module at a time: its kept eigenvector columns upcast to float32, one
    # example's (r, c) eigenbasis block at a time, with the intermediate product of the
    # per-example routes, and the batch's (B, m) rows taken from it (float32, each block at most
    # d_u); every module's rows of the batch (float16).
    work = (
        inp.eigen_upcast
        + F32 * (2 * widest + batch.documents * max(r.m for r in inp.rows))
        + 2 * batch.documents * sum_m
    )
    peak = inp.model + inp.eigen + inp.activations(batch.tokens) + work
    return Phase(
        bytes=peak,
        counts=f"process + weights ({inp.dtype}) + kept eigenvector columns ({inp.eigen_dtype}"
        + (", upper bound" if inp.eigen_is_bound else "")
        + (
            f"; one module's upcast to float32 while it is projected, {_size(inp.eigen_upcast)})"
            if inp.eigen_upcast
            else ")"
        )
        + f" + one batch's activations ({batch.documents} x {batch.document_tokens} tokens), logits and "
        "their gradient, captured module inputs and first-stage rows",
        bound=inp.eigen_is_bound,
        disk_bytes=2 * inp.n_pca * sum_m if inp.pca else 0,
        disk_counts="the PCA set's first-stage coordinates (fit/, float16)",
    )


def fit_pca_phase(inp: _Inputs) -> Phase:
    """fit_pca of the largest module from its cache: the FP16 cache, the Gram (n < m) or
    covariance matrix and its eigenvectors (float64), the float64 blocks it upcasts (<= 64 MiB
    each, two at a time), the directions (float32) and P at its stored dtype."""

    def one(r: ModuleRow) -> int:
        n, m, k = inp.n_pca, r.m, r.tier_k
        square = min(n, m)
        blocks = 2 * min(F64 * n * m, UPCAST_BLOCK_BYTES)
        return 2 * n * m + 2 * F64 * square * square + blocks + (F32 + inp.p_dtype) * m * k

    work = max(one(r) for r in inp.rows) if inp.pca else 0
    return Phase(
        bytes=inp.model + inp.eigen + work,
        counts=f"process + weights + kept eigenvector columns + the largest module's PCA: its cached coordinates "
        f"({inp.n_pca} x m_u, float16), Gram or covariance matrix and eigenvectors (float64), float64 "
        "blocks of at most 64 MiB, P",
        bound=inp.eigen_is_bound,
        disk_bytes=inp.pca_total,
        disk_counts=f"each module's fitted P (fit/pca/, {inp.projection.pca_dtype})",
    )


def fit_save_phase(inp: _Inputs) -> Phase:
    """Writing the projection file, one tensor at a time."""
    return Phase(
        bytes=inp.model + inp.eigen + inp.largest_pca,
        counts="process + weights + kept eigenvector columns + one module's P: the projection file is written "
        "one tensor at a time",
        bound=inp.eigen_is_bound,
        disk_bytes=inp.pca_total + inp.eigen,
        disk_counts="projection.safetensors",
    )


def ingest_phase(inp: _Inputs, batch: Batch, *, resident: bool) -> IngestPhase:
    """Projecting and storing a batch: the first stage's memory, and P resident or one module's
    P at a time (read in every batch; :func:`ingest_block_phase` reads it once per block)."""
    base = first_stage_phase(inp, batch).bytes
    p_held = inp.pca_total if resident else inp.largest_pca
    per_example = sum(r.bytes_per_example + r.tier_bytes_per_example for r in inp.rows)
    what = (
        "every module's P, resident"
        if resident
        else f"one module's P at a time ({_size(inp.largest_pca)}), read in every batch"
    )
    return IngestPhase(
        bytes=base + p_held + inp.upcast,
        counts=f"what the first stage holds + {what}, and an upcast float32 block of it ({_size(inp.upcast)})",
        bound=inp.eigen_is_bound,
        disk_bytes=inp.documents * per_example,
        disk_counts=f"the codes of {inp.documents:,} documents, and their rescoring tier (table columns not counted)",
        p_resident=resident,
    )


def ingest_block_phase(inp: _Inputs, batch: Batch, block: int) -> BlockPhase:
    """Block ingest (``P`` read once per block of ``block`` documents): the larger of its two
    stretches. Per batch, the first stage, with one batch's float16 coordinates in flight to the
    cache on disk; then, module after module, that module's ``P`` applied to the block's cached
    coordinates, while every module's final coordinates of the block wait to be encoded."""
    ms, ks = [r.m for r in inp.rows], [r.tier_k for r in inp.rows]
    batches = first_stage_phase(inp, batch).bytes + FIRST_STAGE_ITEMSIZE * batch.documents * sum(ms)
    apply = (
        inp.model
        + inp.eigen
        + inp.largest_pca
        + inp.upcast
        + block * block_memory_per_document(ms, ks, FIRST_STAGE_ITEMSIZE)
    )
    return BlockPhase(
        bytes=max(batches, apply),
        counts=f"the larger of: what the first stage holds + one batch's float16 coordinates written to the "
        f"block cache; and process + weights + kept eigenvector columns + one module's P "
        f"({_size(inp.largest_pca)}) applied to the block's {block:,} documents (that module's cached "
        "coordinates, float16, and every module's final coordinates, float32)",
        bound=inp.eigen_is_bound,
        disk_bytes=block * cache_bytes_per_document(ms, FIRST_STAGE_ITEMSIZE),
        disk_counts=f"the block cache (INDEX/ingest-cache/, float16 first-stage coordinates of {block:,} "
        "documents), removed once the block is committed",
        block_documents=block,
    )


def _hot_bytes(inp: _Inputs) -> int:
    """The in-memory copy of the codes queries scan, for the plan's documents."""
    return inp.documents * _hot_bytes_per_row(inp)


def _hot_bytes_per_row(inp: _Inputs) -> int:
    """One row of the in-memory copy: packed signs and float32 scales per module (1 bit), or
    float32 coordinates."""
    rows = inp.rows
    if inp.precision == "1bit":
        return sum(math.ceil(r.k / 8) for r in rows) + F32 * len(rows)
    return F32 * sum(r.k for r in rows)


def query_phase(inp: _Inputs, batch: Batch, *, resident: bool) -> QueryPhase:
    """A batch of queries: what ingest holds, plus the in-memory copy of the codes it scans."""
    hot = _hot_bytes(inp)
    ingest = ingest_phase(inp, batch, resident=resident)
    return QueryPhase(
        bytes=ingest.bytes + hot,
        counts="what ingest holds, plus the in-memory copy of the codes it scans (packed signs and float32 "
        f"scales per row, {_size(hot)})",
        bound=inp.eigen_is_bound,
        hot_bytes=hot,
        p_resident=resident,
    )


@dataclass(frozen=True)
class _BatchPhases:
    """The phases whose memory grows with the batch."""

    fit_curvature: CurvaturePhase
    fit_first_stage: Phase
    ingest: IngestPhase
    query: QueryPhase

    @classmethod
    def of(cls, inp: _Inputs, batch: Batch, resident: bool) -> "_BatchPhases":
        return cls(
            fit_curvature_phase(inp.one, batch),
            first_stage_phase(inp.one, batch),
            ingest_phase(inp, batch, resident=resident),
            query_phase(inp, batch, resident=resident),
        )

    @property
    def projecting(self) -> Tuple[Phase, ...]:
        """The phases that project documents with the batch (the curvature's batch is its own)."""
        return (self.fit_first_stage, self.ingest, self.query)


def _plan_batch(
    inp: _Inputs, document_tokens: int, most: int, batch_tokens: Optional[int], resident: bool
) -> Tuple[Batch, str]:
    """The plan's batch and why: ``batch_tokens`` when given, else :func:`choose_batch`'s."""
    if batch_tokens is None:
        return choose_batch(inp, document_tokens, most, resident)
    return Batch(max(1, min(most, batch_tokens // document_tokens)), document_tokens), "--batch-tokens"


def choose_batch(inp: _Inputs, document_tokens: int, most: int, resident: bool) -> Tuple[Batch, str]:
    """The largest batch of at most ``most`` documents whose projecting phases (first stage,
    ingest, query) fit the budget; one document when none does (the plan then says so)."""
    fits = [
        d
        for d in range(1, most + 1)
        if inp.budget is None
        or all(
            phase.bytes <= inp.budget for phase in _BatchPhases.of(inp, Batch(d, document_tokens), resident).projecting
        )
    ]
    if inp.budget is None:
        return Batch(most, document_tokens), "--batch-size (no memory budget)"
    if not fits:
        return Batch(1, document_tokens), "one document: even that does not fit the memory budget"
    return Batch(max(fits), document_tokens), ("--batch-size" if max(fits) == most else "the memory budget")


@dataclass(frozen=True)
class Memory(_Part):
    """Peak memory of every phase (estimates), in the order ``eogp plan`` prints them: the
    process alone, the fit's four phases, ingest with ``P`` resident, read per batch or per block,
    the query, and the largest of the fit's phases."""

    process: Estimate
    fit_curvature: CurvaturePhase
    fit_first_stage: Phase
    fit_pca: Phase
    fit_save: Phase
    ingest: IngestPhase
    ingest_in_turn: IngestPhase
    ingest_block: BlockPhase
    query: QueryPhase
    fit_peak: Estimate

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def phase(self, name: str) -> Union[Estimate, Phase]:
        """The phase called ``name`` (one of :meth:`names`)."""
        if name not in self.names():
            raise KeyError(f"no phase {name!r}; the phases are {', '.join(self.names())}")
        return getattr(self, name)


@dataclass(frozen=True)
class ModelSummary(_Part):
    """The model planned for: its parameters and their bytes in ``dtype``, how many of them are
    attributed, in how many ``modules``, and its coverage by kind (:class:`ModelShape`)."""

    name: str
    num_parameters: int
    weights_bytes: int
    dtype: str
    attributed_parameters: int
    modules: int
    coverage: Optional[Dict[str, Any]]


@dataclass(frozen=True)
class PlanOptions(_Part):
    """The options the plan was made with, as ``eogp fit`` takes them; ``tokens`` is the
    documents' length and ``tokens_from`` where it came from; ``checkpoints`` the checkpoints
    ensembled (``C``)."""

    variant: str
    k: Optional[int]
    budget_kb: Optional[float]
    m: Optional[int]
    precision: str
    dtype: str
    pca_dtype: str
    pca_examples: int
    curvature_examples: int
    batch_size: int
    tokens: int
    tokens_from: str
    memory_budget: Optional[int]
    device: str
    checkpoints: int = 1


@dataclass(frozen=True)
class PlanBatch(_Part):
    """The batch chosen: ``documents`` of ``document_tokens`` (``tokens`` in all), why
    (``chosen_by``, JSON ``from``), and the most documents it could have had."""

    documents: int
    document_tokens: int
    tokens: int
    chosen_by: str = field(metadata={"json": "from"})
    most_documents: int


@dataclass(frozen=True)
class CurvatureSummary(_Part):
    """kronfluence's module partitions, and the host memory its eigendecomposition holds."""

    module_partitions: int
    host_bytes: int


@dataclass(frozen=True)
class Residency(_Part):
    """Whether every module's ``P`` stays in memory: at most ``limit_bytes`` of it may (None: no limit)."""

    resident: bool
    limit_bytes: Optional[int]


@dataclass(frozen=True)
class Limits(_Part):
    """The largest ``k`` the fit can give, and why."""

    k_max: int
    note: str


@dataclass(frozen=True)
class PerExample(_Part):
    """The bytes stored per example, against an uncompressed FP16 gradient."""

    bytes: int
    uncompressed_fp16_bytes: int
    compression: Optional[float]


@dataclass(frozen=True)
class Shared(_Part):
    """What every example shares, in ``projection.safetensors`` and ``curvature/``: ``P``, the
    kept eigenvector columns (``*_max``: their bound before a fit), the other tensors, the file's
    size, and kronfluence's factors."""

    pca_bytes: int
    eigenbasis_bytes_max: int
    eigenbasis_exact: bool
    eigenbasis_dtype: str
    other_bytes: int
    projection_file_bytes_max: int
    projection_file_note: str
    curvature_factor_bytes: int


@dataclass(frozen=True)
class FitCache(_Part):
    """The fit's cache on disk (``fit/``, deleted when the index is written)."""

    coordinate_bytes: int
    pca_bytes: int
    note: str


@dataclass(frozen=True)
class StoreSize(_Part):
    """The store of ``documents`` documents: their codes, the hot copy queries scan, and the
    index on disk in all (at most)."""

    documents: int
    codes_bytes: int
    hot_copy_bytes: int
    total_bytes_max: int
    note: str


@dataclass(frozen=True)
class TierSize(_Part):
    """Both tiers of the store of ``documents`` rows and what a query reads of them.

    ``code``: the rescoring tier's (None: no tier, and every tier figure is 0); ``tier_k``: its
    coordinates in all (``Σ_u t_u``; the one-bit code keeps ``Σ_u k_u`` of them). A query with
    ``hits`` per side and rescoring factor ``rescore`` reads the one-bit code of every row and
    the tier of ``rescored_rows = rescore · hits`` rows on each of ``sides`` sides:
    ``query_bytes = documents · one_bit_bytes_per_row + sides · rescored_rows · tier_bytes_per_row``.
    """

    code: Optional[str]
    tier_k: int
    one_bit_bytes_per_row: int
    tier_bytes_per_row: int
    one_bit_bytes: int
    tier_bytes: int
    hits: int
    rescore: int
    sides: int
    rescored_rows: int
    query_bytes: int


def tier_size(
    documents: int,
    one_bit_bytes_per_row: int,
    code: Optional[str],
    tier_k: int,
    tier_bytes_per_row: int,
    *,
    hits: Optional[int] = None,
    rescore: Optional[int] = None,
    sides: int = QUERY_SIDES,
) -> TierSize:
    """:class:`TierSize` of ``documents`` rows (``eogp plan`` and ``eogp info``); ``hits`` and
    ``rescore`` default to :data:`QUERY_HITS` and :data:`QUERY_RESCORE`."""
    hits = QUERY_HITS if hits is None else int(hits)
    rescore = (QUERY_RESCORE if rescore is None else int(rescore)) if code is not None else 0
    rows = min(rescore * hits, documents)
    tier_row = tier_bytes_per_row if code is not None else 0
    return TierSize(
        code=code,
        tier_k=tier_k if code is not None else 0,
        one_bit_bytes_per_row=one_bit_bytes_per_row,
        tier_bytes_per_row=tier_row,
        one_bit_bytes=documents * one_bit_bytes_per_row,
        tier_bytes=documents * tier_row,
        hits=hits,
        rescore=rescore,
        sides=sides,
        rescored_rows=rows,
        query_bytes=documents * one_bit_bytes_per_row + sides * rows * tier_row,
    )


def format_tier_size(tiers: TierSize, *, label_width: int = 14) -> List[str]:
    """:class:`TierSize` as text lines (``eogp plan``; ``eogp info`` with its narrower labels)."""
    documents = tiers.one_bit_bytes // max(1, tiers.one_bit_bytes_per_row)

    def line(label: str, text: str) -> str:
        return f"{label:<{label_width}}{text}"

    if tiers.code is None:
        return [
            line("bytes/row", f"{tiers.one_bit_bytes_per_row:,}  (no rescoring tier)"),
            line("on disk", f"{documents:,} rows: {_size(tiers.one_bit_bytes)}"),
            line("query reads", f"{_size(tiers.query_bytes)}: the codes of every row"),
        ]
    return [
        line(
            "bytes/row",
            f"{tiers.one_bit_bytes_per_row:,} (scanned) + {tiers.tier_bytes_per_row:,} (rescoring tier, {tiers.code}, "
            f"{tiers.tier_k:,} coordinates, read for the rescored rows only)",
        ),
        line("on disk", f"{documents:,} rows: one-bit {_size(tiers.one_bit_bytes)}, tier {_size(tiers.tier_bytes)}"),
        line(
            "query reads",
            f"{_size(tiers.query_bytes)}: the one-bit code of every row + {tiers.sides} sides x "
            f"{tiers.rescored_rows:,} rescored rows (rescore {tiers.rescore} x k {tiers.hits}) x "
            f"{tiers.tier_bytes_per_row:,} B of tier",
        ),
    ]


@dataclass(frozen=True)
class ObjectStoreSize(_Part):
    """What an index at a URL keeps in object storage for ``documents`` rows: the table's one-bit
    codes and rescoring tier, its bookkeeping and metadata columns (``metadata_bytes_per_row``
    each, uncompressed), the projection file (an upper bound before a fit), kronfluence's factors
    (``curvature/``) and the manifest; ``total_bytes`` their sum. The hot copy is each node's
    own, built in its memory, and not counted."""

    codes_bytes: int
    tier_bytes: int
    metadata_bytes_per_row: int
    metadata_bytes: int
    projection_bytes_max: int
    curvature_bytes: int
    manifest_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class NodePlan(_Part):
    """The store split over ``nodes`` shard nodes (``eogp serve --ray --shards K``, a shard a
    node), the rows even: each holds ``rows_per_node = ceil(documents / nodes)`` rows, whose
    one-bit codes are ``codes_bytes_per_node`` in the table and ``hot_bytes_per_node`` in the
    in-memory copy it scans. A shard holds no model, eigenbases or ``P`` (the ingress measures
    the queries), so its memory is the copy plus the fixed per-process part
    (:data:`PROCESS_BYTES`); the rescoring tier is read from the table for the rescored rows
    only. ``ingress_bytes``: the query phase without the copy (the process, the weights, the
    eigenbases, ``P`` and one batch), on the one node that measures queries. ``scan_seconds``:
    one exact scan of a node's copy at ``bandwidth_gbs`` (``one_node_scan_seconds``: of the whole
    store on one node)."""

    nodes: int
    rows_per_node: int
    codes_bytes_per_node: int
    hot_bytes_per_node: int
    process_bytes: int
    memory_bytes_per_node: int
    ingress_bytes: int
    ingress_bound: bool
    bandwidth_gbs: float
    scan_seconds: float
    one_node_scan_seconds: float
    object_store: ObjectStoreSize


def node_plan(
    plan: "Plan",
    nodes: int,
    *,
    bandwidth_gbs: float = SCAN_BANDWIDTH_GBS,
    metadata_bytes_per_row: int = ROW_BOOKKEEPING_BYTES,
    manifest_bytes: Optional[int] = None,
) -> NodePlan:
    """:class:`NodePlan` of ``plan``'s store over ``nodes`` nodes (``eogp plan --nodes K``)."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {nodes}", field="nodes")
    if not bandwidth_gbs > 0:
        raise ConfigError(f"--bandwidth-gbs must be positive, got {bandwidth_gbs}", field="bandwidth_gbs")
    documents = plan.store.documents
    per_row_hot = plan.store.hot_copy_bytes // documents if documents else 0
    rows = -(-documents // nodes)
    hot = rows * per_row_hot
    tiers, shared = plan.tiers, plan.shared
    if manifest_bytes is None:
        manifest_bytes = MANIFEST_BASE_BYTES + MANIFEST_MODULE_BYTES * len(plan.modules)
    metadata = documents * metadata_bytes_per_row
    store = ObjectStoreSize(
        codes_bytes=tiers.one_bit_bytes,
        tier_bytes=tiers.tier_bytes,
        metadata_bytes_per_row=metadata_bytes_per_row,
        metadata_bytes=metadata,
        projection_bytes_max=shared.projection_file_bytes_max,
        curvature_bytes=shared.curvature_factor_bytes,
        manifest_bytes=manifest_bytes,
        total_bytes=tiers.one_bit_bytes
        + tiers.tier_bytes
        + metadata
        + shared.projection_file_bytes_max
        + shared.curvature_factor_bytes
        + manifest_bytes,
    )
    query = plan.memory.query
    bandwidth = bandwidth_gbs * 1e9
    return NodePlan(
        nodes=nodes,
        rows_per_node=rows,
        codes_bytes_per_node=rows * tiers.one_bit_bytes_per_row,
        hot_bytes_per_node=hot,
        process_bytes=PROCESS_BYTES,
        memory_bytes_per_node=PROCESS_BYTES + hot,
        ingress_bytes=query.bytes - query.hot_bytes,
        ingress_bound=query.bound,
        bandwidth_gbs=bandwidth_gbs,
        scan_seconds=hot / bandwidth,
        one_node_scan_seconds=plan.store.hot_copy_bytes / bandwidth,
        object_store=store,
    )


def _seconds(seconds: float) -> str:
    """Seconds for people: three significant digits, whole seconds from 1,000 up."""
    return f"{seconds:,.0f} s" if seconds >= 1000 else f"{seconds:.3g} s"


def with_nodes(
    plan: "Plan",
    nodes: Optional[int],
    *,
    bandwidth_gbs: Optional[float] = None,
    metadata_bytes: Optional[int] = None,
    manifest_bytes: Optional[int] = None,
) -> "Plan":
    """``plan`` with its store over ``nodes`` nodes (:attr:`Plan.cluster`, :func:`node_plan`);
    ``plan`` itself when ``nodes`` is None. None for the others: :data:`SCAN_BANDWIDTH_GBS`,
    :data:`ROW_BOOKKEEPING_BYTES`, the manifest estimated."""
    if nodes is None:
        return plan
    cluster = node_plan(
        plan,
        nodes,
        bandwidth_gbs=SCAN_BANDWIDTH_GBS if bandwidth_gbs is None else bandwidth_gbs,
        metadata_bytes_per_row=ROW_BOOKKEEPING_BYTES if metadata_bytes is None else metadata_bytes,
        manifest_bytes=manifest_bytes,
    )
    return replace(plan, cluster=cluster)


def format_node_plan(nodes: NodePlan) -> List[str]:
    """:class:`NodePlan` as the plan's text lines."""
    store = nodes.object_store
    bound = "<=" if nodes.ingress_bound else ""
    return [
        f"nodes         {nodes.nodes:,} shard node(s), {nodes.rows_per_node:,} rows each (an even split)",
        f"  per node    codes {_size(nodes.codes_bytes_per_node)} in the table; in memory "
        f"{_size(nodes.memory_bytes_per_node)} = the in-memory copy it scans {_size(nodes.hot_bytes_per_node)} "
        f"+ the process {_size(nodes.process_bytes)} (no model, eigenbases or P; the tier is read for the "
        "rescored rows only)",
        f"  scan        {_seconds(nodes.scan_seconds)} per node at {nodes.bandwidth_gbs:g} GB/s (--bandwidth-gbs), "
        f"one exact scan of its copy; {_seconds(nodes.one_node_scan_seconds)} for the whole store on one node",
        f"  ingress     {bound}{_size(nodes.ingress_bytes)} on the node that measures queries: the query phase "
        "without the copy (process, weights, eigenbases, P, one batch)",
        f"object store  {_size(store.total_bytes)} = one-bit codes {_size(store.codes_bytes)} + tier "
        f"{_size(store.tier_bytes)} + bookkeeping and metadata {_size(store.metadata_bytes)} "
        f"({store.metadata_bytes_per_row} B/row, --metadata-bytes) + projection file <= "
        f"{_size(store.projection_bytes_max)} + kronfluence factors {_size(store.curvature_bytes)} + manifest "
        f"{_size(store.manifest_bytes)}",
    ]


@dataclass(frozen=True)
class Plan(_Part):
    """:func:`make_plan`'s storage and memory accounting of an index. Byte counts are exact
    except where named ``*_max`` (upper bounds) or under :attr:`memory` (estimates);
    :meth:`to_json` is what ``eogp plan --json`` prints (without ``p_reads``)."""

    model: ModelSummary
    options: PlanOptions
    batch: PlanBatch
    curvature: CurvatureSummary
    projection_in_memory: Residency
    modules: Tuple[ModuleRow, ...]
    limits: Limits
    per_example: PerExample
    shared: Shared
    fit_cache: FitCache
    memory: Memory
    #: Whether every phase the runs need fits the budget (None without a budget).
    fits: Optional[bool]
    store: StoreSize
    tiers: TierSize
    #: the store over ``eogp plan --nodes K`` nodes (None: no --nodes)
    cluster: Optional[NodePlan] = None

    def p_reads(self, block_documents: Optional[int] = None) -> PReads:
        """``P`` read per ingested document in each way of applying it, and the block cache's
        disk (:func:`~eogp_index.fit.blocks.p_reads`), for ``block_documents`` per block
        (default: the plan's block, ``memory.ingest_block``)."""
        return p_reads(
            [r.m for r in self.modules],
            [r.tier_k for r in self.modules],
            sum(r.pca_bytes for r in self.modules),
            batch_size=self.options.batch_size,
            documents=self.store.documents,
            block_documents=block_documents or self.memory.ingest_block.block_documents,
        )


def make_plan(
    shape: ModelShape,
    projection: ProjectionConfig,
    *,
    precision: str = "1bit",
    curvature_examples: int = 1000,
    batch_size: int = 8,
    max_tokens: Optional[int] = None,
    documents: int = 0,
    dtype: Optional[str] = None,
    memory_budget: Optional[int] = None,
    batch_tokens: Optional[int] = None,
    document_tokens: Optional[int] = None,
    projection_memory: Optional[int] = None,
    device: str = "cuda",
    eigenbasis_bytes: Optional[Dict[str, int]] = None,
    eigenbasis_dtype: Optional[str] = None,
    dims: Optional[Dict[str, Tuple[int, int]]] = None,
    block_documents: Optional[int] = None,
    checkpoints: int = 1,
    max_tokens_from: str = "--max-tokens",
    rescore: str = "int8",
    rescore_k: Optional[int] = None,
    tier_k: Optional[Dict[str, int]] = None,
    query_hits: Optional[int] = None,
    query_rescore: Optional[int] = None,
) -> Plan:
    """The storage and memory accounting of an index of ``shape`` under these fit options.

    Args:
        dtype: the model's dtype (``None`` or ``"auto"``: the checkpoint's, ``shape.dtype``).
        memory_budget: bytes of device memory every phase must fit (None: nothing is checked).
        batch_tokens: tokens per batch; None: the most that fit ``memory_budget`` (at most
            ``batch_size`` documents of ``document_tokens``).
        document_tokens: the documents' length (default ``max_tokens``, else the context length).
        projection_memory: bytes of P that may stay resident (default half the budget).
        device: ``"cpu"`` counts kronfluence's host memory in the curvature phase's peak.
        eigenbasis_bytes: the kept eigenvector columns per module, exact, read from a fitted
            index's projection file (None: their upper bound).
        eigenbasis_dtype: the dtype they are held in (default ``EIGENVECTOR_DTYPES[dtype]``; a
            fitted index's file says).
        dims: ``(m_u, k_u)`` per module as a fitted index records them (None: from ``projection``).
        block_documents: documents per ingest block when ``P`` is read in turn (None: as an
            ingest sizes it, from what ``memory_budget`` leaves beside the loaded index, at most
            ``MAX_BLOCK_DOCUMENTS``).
        checkpoints: ``C``, the checkpoints ensembled (their rows: :func:`_with_checkpoints`).
        max_tokens_from: where ``max_tokens`` came from, as the plan says it (``tokens_from``).
        rescore, rescore_k: the rescoring tier's code (``none``: no tier) and coordinates per
            module (``StorageConfig``; refused as ``eogp fit`` refuses them).
        tier_k: the tier's coordinates per module as a fitted index records them (None: from
            ``rescore_k``).
        query_hits, query_rescore: the query whose bytes :class:`TierSize` counts (hits per
            side, rescoring factor; default :data:`QUERY_HITS`, :data:`QUERY_RESCORE`).

    Returns:
        The :class:`Plan`: per module (:class:`ModuleRow`), per example, shared, the fit's cache,
        the batch (its documents and tokens, and why), each phase's peak memory and disk
        (:class:`Memory`), whether they fit, and the store.
    """
    dtype = shape.dtype if dtype in (None, "auto") else dtype
    if dtype not in MODEL_DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {sorted(MODEL_DTYPE_BYTES)} or auto (--dtype), got {dtype!r}")
    held = eigenbasis_dtype or EIGENVECTOR_DTYPES[dtype]
    if held not in MODEL_DTYPE_BYTES:
        raise ConfigError(f"eigenbasis_dtype must be one of {sorted(MODEL_DTYPE_BYTES)}, got {held!r}")
    doc_tokens = document_tokens or max_tokens or shape.context
    pca = projection.second_stage == "pca"
    storage = StorageConfig(precision=precision, rescore=rescore, rescore_k=rescore_k)  # type: ignore[arg-type]
    rows = _module_rows(shape, projection, storage, held, eigenbasis_bytes, dims, tier_k)
    inp = _Inputs(
        shape=shape,
        rows=_with_checkpoints(rows, checkpoints, held, eigenbasis_bytes),
        projection=projection,
        dtype=dtype,
        n_pca=projection.num_fit_examples if pca else 0,
        curvature_examples=curvature_examples,
        documents=documents,
        precision=precision,
        budget=memory_budget,
        device=device,
        checkpoints=checkpoints,
    )
    default_limit = None if memory_budget is None else memory_budget // 2
    limit = default_limit if projection_memory is None else projection_memory
    resident = limit is None or inp.pca_total <= limit
    batch, batch_from = _plan_batch(inp, doc_tokens, batch_size, batch_tokens, resident)
    memory = _judged(_memory(inp, batch, resident, block_documents), inp, batch, resident, block_documents)
    tokens_from = (
        "--document-tokens" if document_tokens else max_tokens_from if max_tokens else "the model's context length"
    )
    return Plan(
        model=_model_summary(inp),
        options=PlanOptions(
            variant=projection.resolved(rescore if precision == "1bit" and rescore != "none" else None).variant,
            k=projection.k,
            budget_kb=projection.budget_kb,
            m=projection.m,
            precision=precision,
            dtype=dtype,
            pca_dtype=projection.pca_dtype,
            pca_examples=inp.n_pca,
            curvature_examples=curvature_examples,
            batch_size=batch.documents,
            tokens=doc_tokens,
            tokens_from=tokens_from,
            memory_budget=memory_budget,
            device=device,
            checkpoints=checkpoints,
        ),
        batch=PlanBatch(batch.documents, doc_tokens, batch.tokens, batch_from, batch_size),
        curvature=CurvatureSummary(memory.fit_curvature.module_partitions, memory.fit_curvature.host_bytes),
        projection_in_memory=Residency(resident, limit),
        modules=inp.rows,
        memory=memory,
        fits=None
        if memory_budget is None
        else all(memory.phase(key).fits for key in (*FIT_PHASES, "ingest" if resident else "ingest_block", "query")),
        **_storage(inp),
        tiers=_tiers(inp, storage.tier, query_hits, query_rescore),
    )


def _tiers(inp: _Inputs, code: Optional[str], hits: Optional[int], rescore: Optional[int]) -> TierSize:
    """The plan's :class:`TierSize`: the rows' one-bit and tier bytes, for its documents."""
    return tier_size(
        inp.documents,
        sum(r.bytes_per_example for r in inp.rows),
        code,
        sum(r.tier_k for r in inp.rows),
        sum(r.tier_bytes_per_example for r in inp.rows),
        hits=hits,
        rescore=rescore,
    )


def _model_summary(inp: _Inputs) -> ModelSummary:
    """The model (one checkpoint's: an ensemble's checkpoints share it)."""
    inp = inp.one
    shape = inp.shape
    return ModelSummary(
        name=shape.name,
        num_parameters=shape.num_parameters,
        weights_bytes=inp.weights,
        dtype=inp.dtype,
        attributed_parameters=sum(r.d for r in inp.rows),
        modules=len(inp.rows),
        coverage=shape.coverage,
    )


def _module_rows(
    shape: ModelShape,
    projection: ProjectionConfig,
    storage: StorageConfig,
    held: str,
    eigenbasis_bytes: Optional[Dict[str, int]],
    dims: Optional[Dict[str, Tuple[int, int]]],
    tier_k: Optional[Dict[str, int]] = None,
) -> Tuple[ModuleRow, ...]:
    """Each attributed module's row: ``(m_u, k_u)`` from ``dims`` or ``projection``, the tier's
    ``t_u`` from ``tier_k`` or ``storage``, its kept eigenvector columns in ``held`` (from
    ``eigenbasis_bytes``, exact, else their bound)."""
    pca = projection.second_stage == "pca"
    p_dtype = PCA_DTYPE_BYTES[projection.pca_dtype]
    precision, tier = storage.precision, storage.tier
    rows = []
    for mod in shape.modules:
        if dims:
            m, k = dims[mod.name]
        else:
            m, k = projection.dims(mod.d, len(shape.modules), precision, storage.rescore_k)  # type: ignore[arg-type]
        t = tier_k[mod.name] if tier_k else storage.tier_k(k, m)
        exact = eigenbasis_bytes is not None and mod.name in eigenbasis_bytes
        srht_bytes = (F32 * m + 8 * t) if projection.second_stage == "srht" else 0
        eigen = eigenbasis_bytes[mod.name] if exact else _eigen_upper(mod, MODEL_DTYPE_BYTES[held])  # type: ignore[index]
        rows.append(
            ModuleRow(
                name=mod.name,
                d_out=mod.d_out,
                d_in=mod.d_in,
                d=mod.d,
                m=m,
                k=k,
                bytes_per_example=bytes_per_module(k, precision),  # type: ignore[arg-type]
                tier_k=t,
                tier_bytes_per_example=0 if tier is None else tier_bytes_per_module(t, tier),
                pca_bytes=m * t * p_dtype if pca else 0,
                **_eigen_fields(eigen, held, exact or m == mod.d),
                # whiten (float32) and local_index (int64) per kept coordinate, and the SRHT's signs/rows
                other_bytes=12 * m + srht_bytes,
                # kronfluence: A and S covariances and eigenvectors, their eigenvalues, Λ (float32)
                factor_bytes=F32 * (2 * mod.d_in**2 + 2 * mod.d_out**2 + mod.d_in + mod.d_out + mod.d),
            )
        )
    return tuple(rows)


def _with_checkpoints(
    rows: Tuple[ModuleRow, ...], checkpoints: int, held: str, eigenbasis_bytes: Optional[Dict[str, int]]
) -> Tuple[ModuleRow, ...]:
    """Checkpoint 0's ``rows``, then checkpoints ``1 .. C-1``'s: the same, named ``c<j>/<module>``,
    with their kept eigenvector columns from ``eigenbasis_bytes`` under that name (exact), else
    their bound."""
    if isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 1:
        raise ConfigError(f"checkpoints must be a whole number of at least 1 (--checkpoints), got {checkpoints!r}")
    more = list(rows)
    for j in range(1, checkpoints):
        for row in rows:
            name = f"c{j}/{row.name}"
            if eigenbasis_bytes is not None and name in eigenbasis_bytes:
                eigen = _eigen_fields(eigenbasis_bytes[name], held, True)
            else:
                mod = ModuleShape(row.name, row.d_out, row.d_in)
                eigen = _eigen_fields(_eigen_upper(mod, MODEL_DTYPE_BYTES[held]), held, row.m == row.d)
            more.append(replace(row, name=name, **eigen))
    return tuple(more)


def _memory(inp: _Inputs, batch: Batch, resident: bool, block_documents: Optional[int]) -> Memory:
    """Every phase's peak for ``batch``, with ``P`` resident or not (nothing judged yet)."""
    phases = _BatchPhases.of(inp, batch, resident)
    fit = {
        "fit_curvature": phases.fit_curvature,
        "fit_first_stage": phases.fit_first_stage,
        "fit_pca": fit_pca_phase(inp.one),
        "fit_save": fit_save_phase(inp.one),
    }
    if inp.checkpoints > 1:
        # One checkpoint is fitted at a time; what each writes stays, in its own directory.
        fit = {
            key: replace(
                phase,
                disk_bytes=inp.checkpoints * phase.disk_bytes,
                disk_counts=f"{phase.disk_counts}, for each of the {inp.checkpoints} checkpoints",
            )
            for key, phase in fit.items()
        }
    fit_peak = max(FIT_PHASES, key=lambda key: fit[key].bytes)
    return Memory(
        process=Estimate(
            bytes=PROCESS_BYTES,
            bound=False,
            counts="the interpreter, torch, transformers, kronfluence, LanceDB and their libraries, "
            "and what they hold besides tensors while they work (measured on x86-64 Linux with CPU torch: "
            "benchmarks/fit_memory.py prints it; counted in every figure below)",
        ),
        **fit,  # type: ignore[arg-type]
        ingest=phases.ingest,
        ingest_in_turn=ingest_phase(inp, batch, resident=False),
        ingest_block=ingest_block_phase(inp, batch, _block(inp, batch, block_documents)),
        query=phases.query,
        fit_peak=Estimate(
            bytes=fit[fit_peak].bytes,
            bound=fit[fit_peak].bound,
            counts=f"the largest of the fit's phases ({fit_peak}; they run one after another)",
        ),
    )


def _judged(memory: Memory, inp: _Inputs, batch: Batch, resident: bool, block_documents: Optional[int]) -> Memory:
    """``memory`` with each phase's ``fits`` against the budget and, where it does not, its ``fix``."""
    if inp.budget is None:
        return memory
    judged = {}
    for key in Memory.names():
        entry = memory.phase(key)
        fits = entry.bytes <= inp.budget
        fix = None if fits else _fix(inp, key, batch, resident, inp.budget, block_documents)
        judged[key] = replace(entry, fits=fits, fix=fix)
    return Memory(**judged)


def _storage(inp: _Inputs) -> Dict[str, Any]:
    """The plan's parts that follow from the rows alone: the limits on ``k``, the bytes per
    example, the shared files, the fit's cache and the store."""
    rows, projection = inp.rows, inp.projection
    factors = sum(r.factor_bytes for r in rows)
    per_example = sum(r.bytes_per_example for r in rows)
    attributed = sum(r.d for r in rows)
    eigen_max = sum(r.eigenbasis_bytes for r in rows)
    other = sum(r.other_bytes for r in rows)
    projection_file_max = inp.pca_total + eigen_max + other
    # The largest k this fit can give: a PCA of n examples has at most n directions (the rest
    # would be completed with EK-FAC axes, with a warning), and no module outputs more than m_u.
    widths = min(r.m for r in rows) if inp.pca else min(r.d for r in rows)
    k_max = min(inp.n_pca, widths) if inp.pca else widths
    exact = all(r.eigenbasis_exact for r in rows)
    return {
        "limits": Limits(
            k_max,
            f"min(PCA examples {inp.n_pca}, smallest m_u {widths:,})" if inp.pca else f"the smallest d_u ({widths:,})",
        ),
        "per_example": PerExample(per_example, 2 * attributed, (2 * attributed / per_example) if per_example else None),
        "shared": Shared(
            pca_bytes=inp.pca_total,
            eigenbasis_bytes_max=eigen_max,
            eigenbasis_exact=exact,
            eigenbasis_dtype=inp.eigen_dtype,
            other_bytes=other,
            projection_file_bytes_max=projection_file_max,
            projection_file_note="plus a safetensors header of a few KB"
            + (
                ""
                if exact
                else "; the eigenbases are an upper bound before the fit "
                "(exact for modules with m_u = d_u; `eogp plan INDEX` gives them "
                "exactly)"
            ),
            curvature_factor_bytes=factors,
        ),
        "fit_cache": FitCache(
            coordinate_bytes=2 * inp.n_pca * sum(r.m for r in rows) if inp.pca else 0,
            pca_bytes=inp.pca_total,
            note="fit/ during eogp fit: the PCA set's first-stage coordinates (float16) and each "
            f"module's fitted P ({projection.pca_dtype}); deleted when the index is written",
        ),
        "store": StoreSize(
            documents=inp.documents,
            codes_bytes=inp.documents * per_example,
            hot_copy_bytes=_hot_bytes(inp),
            total_bytes_max=inp.documents * (per_example + sum(r.tier_bytes_per_example for r in rows))
            + projection_file_max
            + factors,
            note="codes: N x bytes per example (the paper's N_store B_1bit); the table adds ids and "
            "metadata columns (and --store-text), not counted; total = codes + rescoring tier + projection "
            "file + kronfluence factors",
        ),
    }


def _block(inp: _Inputs, batch: Batch, asked: Optional[int]) -> int:
    """Documents per ingest block, in whole batches: ``asked``, else as an ingest sizes its default
    (:func:`~eogp_index.fit.blocks.default_block_documents`), the free memory being what the budget
    leaves beside the loaded index and one module's ``P`` (the disk the block takes is stated, not
    limited)."""
    if asked is not None:
        return whole_batches(asked, batch.documents)
    if inp.budget is None:
        return whole_batches(MAX_BLOCK_DOCUMENTS, batch.documents)
    ms, ks = [r.m for r in inp.rows], [r.k for r in inp.rows]
    free = max(0, inp.budget - inp.model - inp.eigen - inp.largest_pca - inp.upcast)
    return default_block_documents(ms, ks, FIRST_STAGE_ITEMSIZE, batch.documents, free_disk=1 << 62, free_memory=free)


def _fix(inp: _Inputs, key: str, batch: Batch, resident: bool, budget: int, block_documents: Optional[int]) -> str:
    """Which option would make phase ``key`` fit ``budget``, found by re-planning with it
    (``block_documents``: the block asked for, as :func:`make_plan` takes it)."""
    # The process alone cannot shrink: what would make it fit is what makes the fit's peak fit.
    target = "fit_peak" if key == "process" else key

    def peak(alt: _Inputs, alt_batch: Batch, alt_resident: bool) -> int:
        return _memory(alt, alt_batch, alt_resident, block_documents).phase(target).bytes

    if key == "ingest_block" and block_documents is not None:
        sized = _block(inp, batch, None)
        if ingest_block_phase(inp, batch, sized).bytes <= budget:
            return f"--block-documents {sized} (the block the budget leaves room for)"
    one = Batch(1, batch.document_tokens)
    tries = []
    if batch.documents > 1:
        tries.append((f"--batch-tokens {batch.document_tokens} (one document per batch)", inp, one, resident))
    if batch.document_tokens > 512:
        tries.append(("--max-tokens 512 --batch-tokens 512", inp, Batch(1, 512), resident))
    if inp.dtype == "float32":
        tries.append(("--dtype bfloat16", _in_dtype(inp, "bfloat16"), one, resident))
    if resident and key in ("ingest", "query"):
        tries.append(("--projection-memory-gb below the P total (P read one module at a time)", inp, one, False))
    for option, alt, alt_batch, alt_resident in tries:
        if peak(alt, alt_batch, alt_resident) <= budget:
            return option
    need = peak(inp, one, False if key in ("ingest", "query") else resident)
    return (
        f"needs at least {_size(need)} even with one document per batch"
        + (" and P read one module at a time" if key in ("ingest", "query") else "")
        + f": raise --memory-budget to {math.ceil(need / 1e9)}, or lower --m or -k"
    )


def _size(n: Optional[float]) -> str:
    """Bytes for people: 1.07 GB, 272 B (decimal units, as the paper's)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def format_plan(plan: Plan, *, all_modules: bool = False) -> str:
    """The plan as text: a per-module table (identical modules grouped unless ``all_modules``),
    then the totals."""
    opts, model, batch = plan.options, plan.model, plan.batch
    budget = opts.memory_budget
    lines = [
        f"model       {model.name}: {model.num_parameters:,} parameters ({_size(model.weights_bytes)} "
        f"{model.dtype}), {model.modules} attributed modules, {model.attributed_parameters:,} attributed "
        "parameters",
        f"options     variant {opts.variant}, precision {opts.precision}, P in {opts.pca_dtype}, "
        f"k {opts.k if opts.k is not None else '(budget ' + str(opts.budget_kb) + ' KiB)'}, "
        f"m {opts.m if opts.m is not None else DEFAULT_M_HELP}, "
        f"{opts.pca_examples} PCA examples, documents of {opts.tokens} tokens ({opts.tokens_from})",
        *_checkpoint_lines(opts.checkpoints),
        f"batch       {batch.documents} x {batch.document_tokens} = {batch.tokens:,} tokens "
        f"(from {batch.chosen_by}; at most --batch-size {batch.most_documents} documents); kronfluence in "
        f"{plan.curvature.module_partitions} module partition(s); P "
        + ("resident" if plan.projection_in_memory.resident else "read one module at a time"),
        f"budget      {_size(budget) + ' of device memory' if budget else 'none given: nothing is checked'}"
        + ("" if plan.fits is None else "; every phase fits" if plan.fits else "; SOME PHASES DO NOT FIT (below)"),
        "",
        f"{'module':<44} {'d_out':>7} {'d_in':>7} {'d_u':>12} {'m_u':>9} {'k_u':>6} {'B/ex':>6} "
        f"{'t_u':>6} {'tier B':>6} {'P':>10} {'eigenbases':>11}",
    ]
    groups: Dict[tuple, List[ModuleRow]] = {}
    for row in plan.modules:
        key = (row.name,) if all_modules else _pattern_key(row)
        groups.setdefault(key, []).append(row)
    for key, rows in groups.items():
        row = rows[0]
        name = row.name if len(rows) == 1 else f"{key[0]} (x{len(rows)})"
        eigen = ("" if row.eigenbasis_exact else "<=") + _size(row.eigenbasis_bytes_max)
        lines.append(
            f"{name[:44]:<44} {row.d_out:>7} {row.d_in:>7} {row.d:>12,} {row.m:>9,} "
            f"{row.k:>6} {row.bytes_per_example:>6} {row.tier_k:>6} {row.tier_bytes_per_example:>6} "
            f"{_size(row.pca_bytes):>10} {eigen:>11}"
        )
    return "\n".join(lines + _totals_lines(plan))


def _checkpoint_lines(checkpoints: int) -> List[str]:
    """What an ensemble of ``checkpoints`` multiplies (nothing for one checkpoint)."""
    if checkpoints == 1:
        return []
    return [
        f"checkpoints {checkpoints}: {checkpoints} models, projections and codes per example (the modules "
        "c<j>/... below are checkpoint j's); the fit runs once per checkpoint, one after another (about "
        f"{checkpoints} x one checkpoint's time, each phase's memory one checkpoint's); ingest and every "
        f"query hold {checkpoints} models and take {checkpoints} gradients per document"
    ]


def _totals_lines(plan: Plan) -> List[str]:
    """:func:`format_plan`'s lines after the module table: sizes, peak memory, disk, coverage, store."""
    per, shared, cache, store, limits = plan.per_example, plan.shared, plan.fit_cache, plan.store, plan.limits
    budget = plan.options.memory_budget
    bound = "" if shared.eigenbasis_exact else "<= "
    lines = [
        "",
        f"largest k     {limits.k_max:,}: {limits.note}"
        + (
            ""
            if max(r.k for r in plan.modules) <= limits.k_max
            else " -- k_u is above it: the PCA leaves directions undetermined (completed with EK-FAC axes)"
        ),
        f"per example   {per.bytes:,} bytes ({_size(per.bytes)}); an uncompressed FP16 gradient is "
        f"{_size(per.uncompressed_fp16_bytes)}" + (f", {per.compression:,.0f}x more" if per.compression else ""),
        f"shared        P {_size(shared.pca_bytes)}; eigenbases {bound}{_size(shared.eigenbasis_bytes_max)} "
        f"({shared.eigenbasis_dtype}); whitening, positions, SRHT {_size(shared.other_bytes)}",
        f"              projection.safetensors {bound}{_size(shared.projection_file_bytes_max)} "
        f"({shared.projection_file_note})",
        f"              kronfluence factors (curvature/) {_size(shared.curvature_factor_bytes)}",
        f"fit cache     {_size(cache.coordinate_bytes)} of first-stage coordinates + {_size(cache.pca_bytes)} "
        "of fitted P (fit/, deleted when the index is written)",
        "peak memory   (estimates; <= marks an upper bound before the fit)"
        + (f" against the budget of {_size(budget)}" if budget else ""),
    ]
    for key in ("fit_peak", *FIT_PHASES, "ingest", "ingest_in_turn", "ingest_block", "query"):
        entry = plan.memory.phase(key)
        verdict = "" if entry.fits is None else "  fits" if entry.fits else "  DOES NOT FIT"
        amount = ("<=" if entry.bound else "") + _size(entry.bytes)
        lines.append(f"  {key:<16} {amount:>11}{verdict}  {entry.counts}")
        if entry.fix:
            lines.append(f"  {'':<16} {'':>11}  to fit: {entry.fix}")
    curvature = plan.memory.fit_curvature
    lines.append(f"  {'host memory':<16} {_size(curvature.host_bytes):>11}  {curvature.host_counts}")
    lines.append("disk")
    for key in (*FIT_PHASES, "ingest", "ingest_block"):
        phase = plan.memory.phase(key)
        lines.append(f"  {key:<16} {_size(phase.disk_bytes):>11}  {phase.disk_counts}")  # type: ignore[union-attr]
    if plan.model.coverage:
        from eogp_index.gradients.coverage import format_coverage

        lines += format_coverage(plan.model.coverage)
    return lines + [
        f"store         {store.documents:,} documents: codes {_size(store.codes_bytes)}, in-memory copy for "
        f"queries {_size(store.hot_copy_bytes)}, total <= {_size(store.total_bytes_max)}",
        f"              ({store.note})",
        *format_tier_size(plan.tiers),
        *(format_node_plan(plan.cluster) if plan.cluster is not None else []),
    ]


def format_p_reads(reads: PReads) -> str:
    """:meth:`Plan.p_reads` as the plan's text lines."""
    if not reads.p_total_bytes:
        return "P reads       none: this variant has no P"
    per = reads.per_document
    return "\n".join(
        [
            f"P reads       per ingested document, of {_size(reads.p_total_bytes)} of P: resident "
            f"{_size(per.resident)} (read once for the {reads.documents:,} documents); in turn per batch of "
            f"{reads.batch_size} {_size(per.per_batch)}; in turn per block of {reads.block_documents:,} "
            f"{_size(per.block)} (--block-documents)",
            f"block cache   {_size(reads.cache_bytes_per_document)} per document (first-stage coordinates in FP16), "
            f"{_size(reads.cache_bytes)} of disk for the block (INDEX/ingest-cache/, removed once it is committed), "
            f"{_size(reads.block_memory_bytes)} of memory while each P is applied; under torchrun, per worker",
        ]
    )


def _pattern_key(row: ModuleRow) -> tuple:
    """Group modules that differ only in their block number (``h.0.attn`` / ``h.1.attn``)."""
    return (re.sub(r"\.\d+\.", ".*.", row.name), row.d_out, row.d_in, row.m, row.k, row.tier_k)
