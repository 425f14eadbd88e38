"""How tests/data/first-pass-v1/ was written: by the code of commit 24df466 (FAISS format 2, clustered format 1,
before the first passes became kinds of eogp_index.search.first_pass), run as
`git archive 24df466 eogp_index | tar -x -C /tmp/old && PYTHONPATH=/tmp/old:tests python tests/data/make_first_pass_v1.py`
from the repository root. Kept as the provenance of those files.

It writes a small real index (tiny GPT-2, 1 bit, 60 rows), one first pass of each kind built by that code, the
coordinates of three queries, and what that code's candidate path answered for them (every rescored row's
address and score, per kind, side, budget C and filter). tests/search/test_first_pass_formats.py opens the same
files with today's code and checks that it answers the same.
"""
import json
import shutil
from pathlib import Path

import numpy as np
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.search.candidates import FaissConfig, build, candidate_top_k
from eogp_index.store.stored_index import StoredIndex

OUT = Path("tests/data/first-pass-v1")
KINDS = {"flat": FaissConfig(kind="flat", replicas=2), "ivf": FaissConfig(kind="ivf", nlist=4, replicas=3),
         "hnsw": FaissConfig(kind="hnsw"), "clustered": FaissConfig(kind="clustered", lists=2, scale_cells=4, z=1.0)}
BUDGETS = (12, 60)
FILTERS = (None, "`group` = 1")

shutil.rmtree(OUT, ignore_errors=True)
index = AttributionIndex.create(
    OUT / "index", make_tiny_gpt2(3), TinyTokenizer(), make_examples(60, seed=11), model_name="tiny",
    projection=ProjectionConfig(variant="eogp", k=16, m=64), curvature=CurvatureConfig(num_examples=24, batch_size=4),
    gradients=GradientConfig(batch_size=8), progress=False)
index.ingest(make_examples(60, seed=11), progress=False)
for name, config in KINDS.items():
    build(index, name, config, progress=False)
queries = make_examples(3, seed=13, prefix="q", masked_prompt=True)
y = index.query_coordinates([{"input_ids": list(q.input_ids), "labels": list(q.labels)} for q in queries])
np.save(OUT / "queries.npy", y)

stored = StoredIndex.open(OUT / "index")
answers = []
for name in KINDS:
    for q in range(y.shape[0]):
        for C in BUDGETS:
            for where in FILTERS:
                found = candidate_top_k(stored, y[q:q + 1], 5, C, ["positive", "negative"], where=where,
                                        faiss_name=name)
                answers.append({"name": name, "query": q, "C": C, "where": where, "sides": {
                    side: {"rowaddr": [int(a) for a in rowaddr], "scores": [float(str(s)) for s in scores]}
                    for side, (rowaddr, scores) in found.items()}})
(OUT / "answers.json").write_text(json.dumps(answers) + "\n")
for folder in ("hot", "curvature", "fit"):  # rebuilt on open (the hot copy), or used only by a fit
    shutil.rmtree(OUT / "index" / folder, ignore_errors=True)
print(sorted(str(p.relative_to(OUT)) for p in OUT.rglob("*") if p.is_file()))
