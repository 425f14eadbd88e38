"""The fitting stage on disk: ``<index>/fit/``, written so that a killed fit resumes where it stopped.

Layout (every file is written under a temporary name and renamed into place, so a file that
exists is complete: the renamed file is its own completion marker; in an object store each is
one upload, which appears whole or not at all, :mod:`eogp_index.data.location`)::

    fit/fitting_set.json          the settings and the chosen examples; written first
    fit/curvature.done            kronfluence's EK-FAC factors (in <index>/curvature/) are complete
    fit/coords/batch-000042.safetensors
                                  first-stage coordinates of the PCA set's batch 42: one
                                  (B, m_u) float16 tensor per module, named by the module
    fit/pca/module-0003.json      module 3's held-out measurement of the two 1-bit codes (with a
                                  held-out split), written before its P
    fit/pca/module-0003.scores.safetensors
                                  with a rescoring tier: module 3's tier scores and stored code's
                                  one-bit scores of the held-out documents, (h, h - 1) float64
                                  each, summed over modules for the index's recall; written
                                  before the measurement record
    fit/pca/module-0003.queries.npy
                                  with a rescoring tier: the first held-out documents' coordinates
                                  by module 3's stored P, (q, width) float32 (q <= 64), written
                                  before its P; joined over modules, the queries of the table's
                                  recall measurement (eogp_index.store.table_recall)
    fit/pca/module-0003.npy       module 3's fitted P, (m_u, k_u), at the projection's P dtype

A rerun that finds ``fitting_set.json`` checks that its settings and examples are the same
(else :class:`~eogp_index.errors.ConfigError`: resume with the same options, or start over)
and skips every stage, batch and module whose file exists. After the index is written the
coordinates and the fitted modules are deleted; ``fitting_set.json`` stays, as the record of
which examples fitted the index.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from eogp_index.data.location import index_path, is_remote, remove_tree, upload
from eogp_index.data.records import Example
from eogp_index.errors import ConfigError, ModelError

FIT_DIR = "fit"
FITTING_SET_FILE = "fitting_set.json"
FIT_FORMAT_VERSION = 1


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)``, flush it to disk, then rename it to ``path`` (all or nothing); an
    object-store ``path`` (:class:`~eogp_index.data.location.RemotePath`): ``write`` makes a local
    file, uploaded in one request (the object appears whole or not at all)."""
    if is_remote(path):
        folder = Path(tempfile.mkdtemp(prefix="eogp-upload-"))
        try:
            write(folder / path.name)
            upload(folder / path.name, path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def examples_sha256(examples: Sequence[Example]) -> str:
    """SHA-256 over the examples' ids, tokens and labels, in order."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex.id, list(ex.input_ids), list(ex.labels)]).encode())
    return digest.hexdigest()


class FitFolder:
    """``<index>/fit/``: the stages of one fit, found complete or not.

    Args:
        index_dir: the index directory.
        settings: everything the stored coordinates and fitted matrices depend on (JSON-able).
        curvature, pca: the fitting sets.
    """

    def __init__(
        self,
        index_dir: Path,
        settings: Dict[str, Any],
        curvature: Sequence[Example],
        pca: Sequence[Example],
        *,
        disjoint: bool,
        held_out: Sequence[Example] = (),
    ):
        self.dir = index_path(index_dir) / FIT_DIR
        self.record = {
            "format": "eogp-fit",
            "format_version": FIT_FORMAT_VERSION,
            "settings": settings,
            "disjoint": disjoint,
            "curvature_sha256": examples_sha256(curvature),
            "pca_sha256": examples_sha256(pca),
            "curvature": [[ex.id, ex.shard, ex.position] for ex in curvature],
            "pca": [[ex.id, ex.shard, ex.position] for ex in pca],
            "pca_held_out": [[ex.id, ex.shard, ex.position] for ex in held_out],
        }

    # -- the fitting set ---------------------------------------------------------------------------
    def existing(self) -> Optional[Dict[str, Any]]:
        path = self.dir / FITTING_SET_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:  # renamed into place, so only a foreign file
            raise ConfigError(
                f"{path} is not a fitting set written by eogp fit ({exc}); pass --overwrite "
                "(mode='overwrite') to start the fit over"
            ) from exc

    @staticmethod
    def existing_settings(index_dir: Path) -> Optional[Dict[str, Any]]:
        """The settings of an interrupted fit found in ``index_dir`` (None when there is none
        or it cannot be read: :meth:`begin` then says why)."""
        path = index_path(index_dir) / FIT_DIR / FITTING_SET_FILE
        try:
            return json.loads(path.read_text()).get("settings")
        except (OSError, ValueError, AttributeError):
            return None

    def begin(self) -> bool:
        """Write ``fitting_set.json``, or check the one found; True when resuming an earlier fit."""
        found = self.existing()
        if found is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.dir / FITTING_SET_FILE, lambda tmp: tmp.write_text(json.dumps(self.record, indent=1)))
            return False
        differ = [
            key
            for key in ("format", "format_version", "disjoint", "curvature_sha256", "pca_sha256")
            if found.get(key) != self.record[key]
        ]
        mine, theirs = self.record["settings"], found.get("settings", {})
        differ += [f"settings.{key}" for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
        if differ:
            raise ConfigError(
                f"{self.dir} holds an interrupted fit with other settings or fitting examples (differs in: "
                f"{', '.join(differ)}); rerun it with the same options and data to resume it, or pass "
                "--overwrite (mode='overwrite') to start over"
            )
        return True

    # -- stages ------------------------------------------------------------------------------------
    @property
    def curvature_marker(self) -> Path:
        return self.dir / "curvature.done"

    def curvature_done(self) -> bool:
        return self.curvature_marker.exists()

    def mark_curvature_done(self) -> None:
        atomic_write(self.curvature_marker, lambda tmp: tmp.write_text("kronfluence EK-FAC factors complete\n"))

    def batch_path(self, batch: int) -> Path:
        return self.dir / "coords" / f"batch-{batch:06d}.safetensors"

    def batches_done(self, num_batches: int) -> List[int]:
        return [b for b in range(num_batches) if self.batch_path(b).exists()]

    def write_batch(self, batch: int, coords: Dict[str, torch.Tensor]) -> None:
        """Store one batch's first-stage coordinates, ``{module: (B, m_u)}``, as float16."""
        from safetensors.torch import save_file

        half = {}
        for name, z in coords.items():
            z = z.detach().to("cpu", torch.float16).contiguous()
            if not torch.isfinite(z).all():
                raise ModelError(
                    f"first-stage coordinates of module {name!r} (fitting batch {batch}) overflow float16 "
                    f"(|z| > 65504): the half-whitened gradients are far larger than the curvature predicts; "
                    "check that the model and fitting data are the ones the curvature was fitted on"
                )
            half[name] = z
        atomic_write(self.batch_path(batch), lambda tmp: save_file(half, str(tmp)))

    def read_module(self, name: str, num_batches: int) -> torch.Tensor:
        """One module's cached coordinates for the whole PCA set, ``(n, m_u)`` float16 (batch order)."""
        paths = [self.batch_path(batch) for batch in range(num_batches)]
        rows = []
        for path in paths:  # headers only: the module's size, so its rows land in one buffer
            with _tensors(path) as handle:
                rows.append(handle.get_slice(name).get_shape())
        out = torch.empty(sum(shape[0] for shape in rows), rows[0][1], dtype=torch.float16)
        start = 0
        for path, shape in zip(paths, rows):
            with _tensors(path) as handle:
                out[start : start + shape[0]] = handle.get_tensor(name)
            start += shape[0]
        return out

    def module_path(self, index: int) -> Path:
        return self.dir / "pca" / f"module-{index:04d}.npy"

    def modules_done(self, num_modules: int) -> List[int]:
        return [i for i in range(num_modules) if self.module_path(i).exists()]

    def write_module(self, index: int, pca: torch.Tensor) -> None:
        array = np.ascontiguousarray(pca.detach().cpu().numpy())

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                np.save(handle, array)

        atomic_write(self.module_path(index), write)

    def choice_path(self, index: int) -> Path:
        return self.dir / "pca" / f"module-{index:04d}.json"

    def write_choice(self, index: int, record: Dict[str, Any]) -> None:
        """A module's held-out measurement (``CodeChoice.to_json()``), written before its P."""
        atomic_write(self.choice_path(index), lambda tmp: tmp.write_text(json.dumps(record)))

    def read_choice(self, index: int) -> Optional[Dict[str, Any]]:
        path = self.choice_path(index)
        return json.loads(path.read_text()) if path.exists() else None

    def scores_path(self, index: int) -> Path:
        return self.dir / "pca" / f"module-{index:04d}.scores.safetensors"

    def write_scores(self, index: int, scores: Dict[str, torch.Tensor]) -> None:
        """A module's held-out scores for the index's recall (``{"tier", "one_bit"}``, ``(h, h - 1)``
        float64), written before its measurement record."""
        from safetensors.torch import save_file

        tensors = {name: value.detach().cpu().to(torch.float64).contiguous() for name, value in scores.items()}
        atomic_write(self.scores_path(index), lambda tmp: save_file(tensors, str(tmp)))

    def read_scores(self, index: int) -> Optional[Dict[str, torch.Tensor]]:
        from safetensors.torch import load, load_file

        path = self.scores_path(index)
        if not path.exists():
            return None
        return load(path.read_bytes()) if is_remote(path) else load_file(str(path))

    def queries_path(self, index: int) -> Path:
        return self.dir / "pca" / f"module-{index:04d}.queries.npy"

    def write_queries(self, index: int, coordinates: torch.Tensor) -> None:
        """A module's held-out query coordinates ``(q, width)`` float32, written before its P."""
        array = np.ascontiguousarray(coordinates.detach().cpu().to(torch.float32).numpy())

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                np.save(handle, array)

        atomic_write(self.queries_path(index), write)

    def read_queries(self, index: int) -> Optional[np.ndarray]:
        path = self.queries_path(index)
        return np.load(path) if path.exists() else None

    def read_module_pca(self, index: int) -> torch.Tensor:
        """A fitted P, memory-mapped (copy-on-write): its pages are read as the projection file is
        written and leave memory when the tensor is dropped, so the fit holds one module's P at a time.
        From an object store it is read whole (one module's P)."""
        path = self.module_path(index)
        if is_remote(path):
            return torch.from_numpy(np.load(io.BytesIO(path.read_bytes())))
        return torch.from_numpy(np.load(path, mmap_mode="c"))

    def finish(self) -> None:
        """After the index is written: drop the coordinates and the fitted modules, keep the record."""
        for sub in ("coords", "pca"):
            remove_tree(self.dir / sub)
        self.curvature_marker.unlink(missing_ok=True)


@contextmanager
def _tensors(path):
    """A safetensors file's reader: memory-mapped locally, by range reads from an object store."""
    if is_remote(path):
        from eogp_index.data.location import RangeSafetensors

        with path.open_input() as handle:
            yield RangeSafetensors(handle, str(path))
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        yield handle
