"""numba's on-disk cache for this package: one source stamp over all of its files.

numba keys a cached kernel by the source of the file that defines it only; a kernel calling
(and inlining) helpers from another file keeps loading its old build after that file changes
(numba's documentation lists this under cache invalidation limits). Before the split into this
package every kernel and helper shared one file, so that could not happen. Importing this
module makes the kernels of this directory use a stamp that hashes every ``*.py`` file here:
editing any of them recompiles all of them (once), never a stale mix.

It registers two locator classes in front of numba's list (``numba.core.caching.CacheImpl``;
where that is missing, nothing is registered and each file's own stamp applies as before; a
``NUMBA_CACHE_LOCATOR_CLASSES`` setting replaces the list and wins). They answer only for
functions defined in this directory and otherwise behave like numba's own in-tree and
``NUMBA_CACHE_DIR`` locators.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_DIR = Path(__file__).resolve().parent
_STAMPS: dict = {}


def _package_stamp() -> bytes:
    """sha256 over the sources of this directory's ``*.py`` files (by name), memoized on their
    ``(name, mtime, size)``."""
    files = sorted(_DIR.glob("*.py"))
    key = tuple((p.name, st.st_mtime_ns, st.st_size) for p in files for st in (p.stat(),))
    stamp = _STAMPS.get(key)
    if stamp is None:
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        stamp = _STAMPS[key] = h.digest()
    return stamp


def _install() -> None:
    try:
        from numba.core import caching

        bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator)
        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # public name since numba 0.61
        registry = impl._locator_classes
    except (ImportError, AttributeError):  # pragma: no cover - another numba layout
        return
    if any(getattr(c, "_eogp_package_stamp", False) for c in registry):
        return

    def from_function(cls, py_func, py_file):
        if Path(os.path.abspath(py_file)).parent != _DIR:
            return None
        return super(cls, cls).from_function(py_func, py_file)

    ours = [
        type(
            f"PackageStamp{b.__name__}",
            (b,),
            {
                "_eogp_package_stamp": True,
                "get_source_stamp": lambda self: _package_stamp(),
                "from_function": classmethod(from_function),
            },
        )
        for b in bases
    ]
    registry[:0] = ours  # numba's order: NUMBA_CACHE_DIR first, then __pycache__ next to the file


_install()
