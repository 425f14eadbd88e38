"""``eogp plan``: the paper's storage accounting (Appendix E) for a model, before anything runs.

Given the attributed modules' shapes and the fit options, :func:`make_plan` gives per module
``d_u = d_out·d_in'`` (``d_in'`` counts a bias column), ``(m_u, k_u)`` from
:meth:`ProjectionConfig.dims`, and the bytes each part of an index takes:

* per example: ``Σ_u(⌈k_u/8⌉+2)`` in 1-bit mode (``2Σk_u`` / ``4Σk_u`` for fp16 / fp32 coordinates);
* shared, in ``projection.safetensors``: the eigenvector columns the kept coordinates touch —
  ``4·(d_out·r_u + d_in'·c_u)`` with ``r_u ≤ d_out`` rows and ``c_u ≤ d_in'`` columns, known only
  after the fit, so the upper bound ``4·(d_out² + d_in'²)`` is given (exact when ``m_u = d_u``) —,
  ``12·m_u`` of whitening weights and positions, and ``P`` at ``2·m_u·k_u`` (FP16) or ``4·m_u·k_u``;
* kronfluence's factors (``curvature/``): covariances, eigenvectors, eigenvalues and the
  corrected eigenvalues, float32;
* the fit's cache (``fit/``, deleted when the fit finishes): the PCA set's first-stage
  coordinates, ``n·Σ_u m_u·2`` bytes, and each module's fitted ``P`` in float32;
* peak memory of fit, ingest and query, each listing what it counts;
* the store for ``N`` documents: ``N`` times the per-example payload, and the in-memory copy
  queries scan.

The arithmetic is torch-free; :func:`model_shape` builds the model on PyTorch's ``meta``
device (no weights are read or allocated) to list its modules.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from eogp_index.config import DEFAULT_M_HELP, PCA_DTYPE_BYTES, ProjectionConfig, bytes_per_module
from eogp_index.errors import ModelError

#: Weights are loaded in float32 (``gradients.model.load_model``).
WEIGHT_BYTES = 4
F32, F64 = 4, 8
#: Resident memory of an eogp process before it builds any model or index data: the Python
#: interpreter, torch, transformers, kronfluence, LanceDB, numba and their libraries. Measured
#: (``benchmarks/fit_memory.py``, "process baseline") on x86-64 Linux with CPU torch 2.x; a CUDA
#: build adds its own libraries and context (about 0.5-1 GB more).
PROCESS_BYTES = 600_000_000
#: The largest float32/float64 buffer that fit_pca and apply_pca upcast at once
#: (``fit.projection._UPCAST_BYTES``).
UPCAST_BLOCK_BYTES = 64 << 20
#: The fit's phases, run one after another; its peak is the largest.
FIT_PHASES = ("fit_curvature", "fit_first_stage", "fit_pca", "fit_save")


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
    <eogp_index.gradients.coverage.Coverage.to_json>`).
    """

    name: str
    modules: Tuple[ModuleShape, ...]
    num_parameters: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    context: int
    coverage: Optional[Dict[str, Any]] = None


def model_shape(name_or_config: str, patterns: Optional[Sequence[str]] = None, *,
                experts: str = "fused") -> ModelShape:
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
        raise ModelError(f"cannot read a model config from {name_or_config!r} ({exc}); give a hub name, a model "
                         "directory or a config.json with a model_type") from exc
    return shape_of_config(config, name=str(name_or_config), patterns=patterns, adapter=adapter, experts=experts)


def shape_of_config(config, *, name: str, patterns: Optional[Sequence[str]] = None,
                    adapter: Optional[str] = None, experts: str = "fused") -> ModelShape:
    """:func:`model_shape` from a ``transformers`` config object, with ``adapter``'s LoRA layers if
    given, and fused experts rebuilt as linear layers with ``experts="dense"``."""
    import torch
    from transformers import AutoModelForCausalLM

    from eogp_index.gradients.coverage import model_coverage
    from eogp_index.gradients.experts import make_experts_trackable
    from eogp_index.gradients.model import add_lora_layers, find_attributed_modules, module_shape, replace_conv1d

    with torch.device("meta"):  # shapes only: no weight is allocated, however large the model
        model = AutoModelForCausalLM.from_config(config)
        if adapter is not None:
            add_lora_layers(model, adapter)
        replace_conv1d(model)
        make_experts_trackable(model, dense=experts == "dense")
    names = find_attributed_modules(model, patterns)
    modules = tuple(ModuleShape(n, *module_shape(model, n)) for n in names)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape(
        name=name, modules=modules, num_parameters=sum(p.numel() for p in model.parameters()),
        hidden_size=int(getattr(text, "hidden_size")), num_layers=int(getattr(text, "num_hidden_layers")),
        vocab_size=int(getattr(text, "vocab_size")),
        context=int(getattr(text, "max_position_embeddings", 0) or getattr(text, "n_positions", 0) or 2048),
        coverage=model_coverage(model, names).to_json(),
    )


def _eigen_upper(mod: ModuleShape) -> int:
    """Bytes of the kept eigenvector columns: at most all of ``Q_S`` and ``Q_A`` (float32);
    exactly that when every coordinate is kept."""
    return F32 * (mod.d_out ** 2 + mod.d_in ** 2)


def make_plan(shape: ModelShape, projection: ProjectionConfig, *, precision: str = "1bit",
              curvature_examples: int = 1000, batch_size: int = 8, max_tokens: Optional[int] = None,
              documents: int = 0) -> Dict[str, Any]:
    """The storage and memory accounting of an index of ``shape`` under these fit options.

    Returns a JSON-able dict: ``modules`` (per module ``d_out, d_in, d, m, k``, bytes per example,
    ``pca_bytes``, ``eigenbasis_bytes_max``), ``per_example``, ``shared``, ``fit_cache``,
    ``memory`` (each estimate with a ``counts`` line) and ``store``. Byte counts are exact
    except where named ``*_max`` (upper bounds) or under ``memory`` (estimates).
    """
    num = len(shape.modules)
    tokens = max_tokens or shape.context
    pca = projection.second_stage == "pca"
    p_dtype = PCA_DTYPE_BYTES[projection.pca_dtype]
    n_pca = projection.num_fit_examples if pca else 0
    rows: List[Dict[str, Any]] = []
    for mod in shape.modules:
        m, k = projection.dims(mod.d, num, precision)  # type: ignore[arg-type]
        pca_bytes = m * k * p_dtype if pca else 0
        srht_bytes = (F32 * m + 8 * k) if projection.second_stage == "srht" else 0
        rows.append({
            "name": mod.name, "d_out": mod.d_out, "d_in": mod.d_in, "d": mod.d, "m": m, "k": k,
            "bytes_per_example": bytes_per_module(k, precision),  # type: ignore[arg-type]
            "pca_bytes": pca_bytes,
            "eigenbasis_bytes_max": _eigen_upper(mod),
            "eigenbasis_exact": m == mod.d,
            # whiten (float32) and local_index (int64) per kept coordinate, and the SRHT's signs/rows
            "other_bytes": 12 * m + srht_bytes,
            # kronfluence: A and S covariances and eigenvectors, their eigenvalues, Λ (float32)
            "factor_bytes": F32 * (2 * mod.d_in ** 2 + 2 * mod.d_out ** 2 + mod.d_in + mod.d_out + mod.d),
        })
    per_example = sum(r["bytes_per_example"] for r in rows)
    attributed = sum(r["d"] for r in rows)
    pca_total = sum(r["pca_bytes"] for r in rows)
    eigen_max = sum(r["eigenbasis_bytes_max"] for r in rows)
    other = sum(r["other_bytes"] for r in rows)
    factors = sum(r["factor_bytes"] for r in rows)
    projection_file_max = pca_total + eigen_max + other
    weights = WEIGHT_BYTES * shape.num_parameters
    sum_m = sum(r["m"] for r in rows)
    largest = max(rows, key=lambda r: r["m"] * r["k"])

    # One batch through the model, float32: the activations autograd keeps for the backward pass,
    # ~34·h bytes per token and layer at 16 bits (Korthikanti et al. 2022, attention scores not
    # kept by fused attention), doubled for float32; the logits and their gradient (B·T·V·4, x2);
    # and the inputs of every attributed module, held by the capture hooks until its backward.
    batch_tokens = batch_size * tokens
    autograd = 2 * 34 * shape.hidden_size * shape.num_layers * batch_tokens
    logits = 2 * F32 * shape.vocab_size * batch_tokens
    captured = F32 * batch_tokens * sum(mod.d_in for mod in shape.modules)
    activations = autograd + logits + captured
    curvature_batch = min(batch_size, curvature_examples)
    curvature_act = (autograd + logits) * curvature_batch // batch_size
    widest = max(mod.d for mod in shape.modules)
    eigen_mem = eigen_max + other
    # kronfluence holds every module's factors at once; its Λ pass also holds one module's
    # per-example gradients of the batch and their rotation into the eigenbasis (float32).
    kronfluence = factors + curvature_act + 2 * F32 * curvature_batch * widest
    # The factors read back (eigenvectors and corrected eigenvalues of every module) while the
    # kept columns are copied out of them (build_projection).
    build = sum(F32 * (mod.d_in ** 2 + mod.d_out ** 2 + mod.d) for mod in shape.modules) + eigen_mem
    # Per batch, one module at a time: one example's (r, c) eigenbasis block at a time, with the
    # intermediate product of the per-example routes, and the batch's (B, m) rows taken from it
    # (float32, each block at most d_u); every module's rows of the batch (float16).
    first_stage_work = F32 * (2 * widest + batch_size * max(r["m"] for r in rows)) + 2 * batch_size * sum_m

    def pca_peak(r: Dict[str, Any]) -> int:
        """fit_pca of one module from its cache: the FP16 cache, the Gram (n < m) or covariance
        matrix and its eigenvectors (float64), the float64 blocks it upcasts (<= 64 MiB each, two
        at a time), the directions (float32) and P at its stored dtype."""
        n, m, k = n_pca, r["m"], r["k"]
        square = min(n, m)
        blocks = 2 * min(F64 * n * m, UPCAST_BLOCK_BYTES)
        return 2 * n * m + 2 * F64 * square * square + blocks + (F32 + p_dtype) * m * k

    pca_memory = max((pca_peak(r) for r in rows), default=0) if pca else 0
    resident_p = pca_total
    in_turn_p = largest["pca_bytes"]
    # apply_pca upcasts an FP16 P in float32 blocks of at most 64 MiB (none for an fp32 P)
    upcast = min(F32 * largest["m"] * largest["k"], UPCAST_BLOCK_BYTES) if pca and projection.pca_dtype == "fp16" else 0
    hot = documents * ((sum(math.ceil(r["k"] / 8) for r in rows) + F32 * num) if precision == "1bit"
                       else F32 * sum(r["k"] for r in rows))
    model = PROCESS_BYTES + weights
    project = model + eigen_mem + activations + first_stage_work
    memory = {
        "process": {"bytes": PROCESS_BYTES,
                    "counts": "the interpreter, torch, transformers, kronfluence, LanceDB and their libraries, "
                              "before any model or index data (measured once on x86-64 Linux with CPU torch: "
                              "benchmarks/fit_memory.py prints it; counted in every figure below)"},
        "fit_curvature": {"bytes": model + max(kronfluence, build),
                          "counts": "process + weights (float32) + the larger of kronfluence's fit (every module's "
                                    "covariances, eigenvectors, eigenvalues and Λ, one curvature batch's activations "
                                    "and one module's per-example gradients) and reading its factors back while the "
                                    "kept eigenvector columns are copied out"},
        "fit_first_stage": {"bytes": project,
                            "counts": "process + weights + kept eigenvector columns (upper bound) + one batch's "
                                      "activations, captured module inputs and first-stage blocks"},
        "fit_pca": {"bytes": model + eigen_mem + pca_memory,
                    "counts": f"process + weights + kept eigenvector columns + the largest module's PCA: its cached "
                              f"coordinates ({n_pca} x m_u, float16), Gram or covariance matrix and eigenvectors "
                              "(float64), float64 blocks of at most 64 MiB, P"},
        "fit_save": {"bytes": model + eigen_mem + in_turn_p,
                     "counts": "process + weights + kept eigenvector columns + one module's P: the projection file "
                               "is written one tensor at a time"},
        "ingest": {"bytes": project + resident_p + upcast,
                   "counts": "what the first stage holds + every module's P, resident (P under the memory limit) "
                             "and an upcast float32 block of it"},
        "ingest_in_turn": {"bytes": project + in_turn_p + upcast,
                           "counts": "the same with P over the memory limit: one module's P at a time "
                                     f"({_size(in_turn_p)}) and its float32 block ({_size(upcast)})"},
        "query": {"bytes": project + resident_p + upcast + hot,
                  "counts": "what ingest holds, plus the in-memory copy of the codes it scans (packed signs and "
                            "float32 scales per row); with P in turn, "
                            f"{_size(project + in_turn_p + upcast + hot)}"},
    }
    # The largest k this fit can give: a PCA of n examples has at most n directions (the rest
    # would be completed with EK-FAC axes, with a warning), and no module outputs more than m_u.
    widths = min(r["m"] for r in rows) if pca else min(r["d"] for r in rows)
    k_max = min(n_pca, widths) if pca else widths
    k_max_note = (f"min(PCA examples {n_pca}, smallest m_u {widths:,})" if pca
                  else f"the smallest d_u ({widths:,})")
    memory["fit_peak"] = {"bytes": max(memory[k]["bytes"] for k in FIT_PHASES),
                          "counts": "the largest of the fit's phases (they run one after another)"}
    return {
        "model": {"name": shape.name, "num_parameters": shape.num_parameters, "weights_bytes": weights,
                  "attributed_parameters": attributed, "modules": num, "coverage": shape.coverage},
        "options": {"variant": projection.variant, "k": projection.k, "budget_kb": projection.budget_kb,
                    "m": projection.m, "precision": precision,
                    "pca_dtype": projection.pca_dtype, "pca_examples": n_pca,
                    "curvature_examples": curvature_examples, "batch_size": batch_size, "tokens": tokens,
                    "tokens_from": "--max-tokens" if max_tokens else "the model's context length"},
        "modules": rows,
        "limits": {"k_max": k_max, "note": k_max_note},
        "per_example": {"bytes": per_example, "uncompressed_fp16_bytes": 2 * attributed,
                        "compression": (2 * attributed / per_example) if per_example else None},
        "shared": {"pca_bytes": pca_total, "eigenbasis_bytes_max": eigen_max, "other_bytes": other,
                   "projection_file_bytes_max": projection_file_max,
                   "projection_file_note": "plus a safetensors header of a few KB; the eigenbases are an upper "
                                           "bound (exact for modules with m_u = d_u)",
                   "curvature_factor_bytes": factors},
        "fit_cache": {"coordinate_bytes": 2 * n_pca * sum_m if pca else 0,
                      "pca_bytes": pca_total,
                      "note": "fit/ during eogp fit: the PCA set's first-stage coordinates (float16) and each "
                              f"module's fitted P ({projection.pca_dtype}); deleted when the index is written"},
        "memory": memory,
        "store": {"documents": documents, "codes_bytes": documents * per_example,
                  "hot_copy_bytes": hot,
                  "total_bytes_max": documents * per_example + projection_file_max + factors,
                  "note": "codes: N x bytes per example (the paper's N_store B_1bit); the table adds ids and "
                          "metadata columns (and --store-text), not counted; total = codes + projection file "
                          "(upper bound) + kronfluence factors"},
    }


def _size(n: Optional[float]) -> str:
    """Bytes for people: 1.07 GB, 272 B (decimal units, as the paper's)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def format_plan(plan: Dict[str, Any], *, all_modules: bool = False) -> str:
    """The plan as text: a per-module table (identical modules grouped unless ``all_modules``),
    then the totals."""
    opts, model = plan["options"], plan["model"]
    lines = [f"model       {model['name']}: {model['num_parameters']:,} parameters ({_size(model['weights_bytes'])} "
             f"float32), {model['modules']} attributed modules, {model['attributed_parameters']:,} attributed "
             "parameters",
             f"options     variant {opts['variant']}, precision {opts['precision']}, P in {opts['pca_dtype']}, "
             f"k {opts['k'] if opts['k'] is not None else '(budget ' + str(opts['budget_kb']) + ' KiB)'}, "
             f"m {opts['m'] if opts['m'] is not None else DEFAULT_M_HELP}, "
             f"{opts['pca_examples']} PCA examples, batch {opts['batch_size']} x {opts['tokens']} tokens "
             f"({opts['tokens_from']})",
             "",
             f"{'module':<44} {'d_out':>7} {'d_in':>7} {'d_u':>12} {'m_u':>9} {'k_u':>6} {'B/ex':>6} "
             f"{'P':>10} {'eigenbases':>11}"]
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for row in plan["modules"]:
        key = (row["name"],) if all_modules else _pattern_key(row)
        groups.setdefault(key, []).append(row)
    for key, rows in groups.items():
        row = rows[0]
        name = row["name"] if len(rows) == 1 else f"{key[0]} (x{len(rows)})"
        eigen = ("" if row["eigenbasis_exact"] else "<=") + _size(row["eigenbasis_bytes_max"])
        lines.append(f"{name[:44]:<44} {row['d_out']:>7} {row['d_in']:>7} {row['d']:>12,} {row['m']:>9,} "
                     f"{row['k']:>6} {row['bytes_per_example']:>6} {_size(row['pca_bytes']):>10} {eigen:>11}")
    per, shared, cache, store = plan["per_example"], plan["shared"], plan["fit_cache"], plan["store"]
    lines += [
        "",
        f"largest k     {plan['limits']['k_max']:,}: {plan['limits']['note']}"
        + ("" if max(r["k"] for r in plan["modules"]) <= plan["limits"]["k_max"] else
           " -- k_u is above it: the PCA leaves directions undetermined (completed with EK-FAC axes)"),
        f"per example   {per['bytes']:,} bytes ({_size(per['bytes'])}); an uncompressed FP16 gradient is "
        f"{_size(per['uncompressed_fp16_bytes'])}"
        + (f", {per['compression']:,.0f}x more" if per["compression"] else ""),
        f"shared        P {_size(shared['pca_bytes'])}; eigenbases <= {_size(shared['eigenbasis_bytes_max'])}; "
        f"whitening, positions, SRHT {_size(shared['other_bytes'])}",
        f"              projection.safetensors <= {_size(shared['projection_file_bytes_max'])} "
        f"({shared['projection_file_note']})",
        f"              kronfluence factors (curvature/) {_size(shared['curvature_factor_bytes'])}",
        f"fit cache     {_size(cache['coordinate_bytes'])} of first-stage coordinates + {_size(cache['pca_bytes'])} "
        "of fitted P (fit/, deleted when the index is written)",
        "peak memory   (estimates)",
    ]
    for key in ("fit_peak", "fit_curvature", "fit_first_stage", "fit_pca", "ingest", "ingest_in_turn", "query"):
        entry = plan["memory"][key]
        lines.append(f"  {key:<16} {_size(entry['bytes']):>10}  {entry['counts']}")
    if model.get("coverage"):
        from eogp_index.gradients.coverage import format_coverage

        lines += format_coverage(model["coverage"])
    lines += [
        f"store         {store['documents']:,} documents: codes {_size(store['codes_bytes'])}, in-memory copy for "
        f"queries {_size(store['hot_copy_bytes'])}, total <= {_size(store['total_bytes_max'])}",
        f"              ({store['note']})",
    ]
    return "\n".join(lines)


def _pattern_key(row: Dict[str, Any]) -> tuple:
    """Group modules that differ only in their block number (``h.0.attn`` / ``h.1.attn``)."""
    return (re.sub(r"\.\d+\.", ".*.", row["name"]), row["d_out"], row["d_in"], row["m"], row["k"])
