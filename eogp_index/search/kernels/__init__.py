"""numba kernels and their helpers behind :mod:`eogp_index.search.scan`, one file per concern.

* :mod:`.checks` — layout coercion, derived geometry (byte/word offsets), input validation;
* :mod:`.base` — argument bundles passed to every kernel, FP16 scale decoding, shared block
  sizes, and the factory that compiles a parallel and a serial twin from one body;
* :mod:`.exact` — exact scores from lookup tables / straight from the query (float32 sums);
* :mod:`.quantize` — query preparation: padded queries, lookup tables, 8-bit quantization;
* :mod:`.prescan_ir` — the LLVM IR intrinsics of the bounded pre-scan (popcount / VPDPBUSD);
* :mod:`.bounded` — the bounded pre-scan kernels built on those intrinsics;
* :mod:`.select` — running top-k and the selection helpers of :func:`scan_top_k`;
* :mod:`.torch_scan` — the torch path :func:`scan_scores_torch`;
* :mod:`.rescore` — the rescoring tier's (row, query) scores (:mod:`eogp_index.search.rescore`);
* :mod:`.cache` — one numba cache stamp for the whole package (see below).

Imports run one way: :mod:`eogp_index.search.scan` (and :mod:`~eogp_index.search.rescore`) import
these modules, never the reverse, and this package imports none of its modules itself (importing it
compiles nothing).

numba's on-disk cache (``cache=True``) keys a kernel by the file that defines it, not by the
files it calls into; :mod:`.cache` gives all kernels here one stamp over every file of the
package, so that editing a helper in one file recompiles the kernels of the others.
"""
