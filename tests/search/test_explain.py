"""Explaining a hit on real tiny models: per-module terms, per-token contributions, the document's text.

The references: the ranked scores themselves (terms and contributions must sum to them), the
unquantized projection (``⟨y, z⟩``), and kronfluence's own per-token EK-FAC scores at full width.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tinymodels import (
    TinyTokenizer,
    kronfluence_scores,
    make_examples,
    make_tiny_gpt2,
    make_tiny_llama,
    make_word_tokenizer,
)

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig, StorageConfig
from eogp_index.data.records import Example
from eogp_index.errors import IncompatibleIndexError, InputError
from eogp_index.gradients.model import load_model
from eogp_index.search.render import explanation_html, explanation_terminal
from ingest.pipeline import run_ingest

TRAIN = make_examples(20, seed=5)
QUERY = {"input_ids": [4, 8, 15, 16, 23, 42, 7], "labels": [-100, -100, 15, 16, 23, 42, 7]}


def _library_index(path, make_model, **kwargs):
    """An index built and filled through the library, with stored text (documents from ids)."""
    kwargs.setdefault("projection", ProjectionConfig(variant="eogp", k=12, m=48))
    index = AttributionIndex.create(
        path,
        make_model(),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny",
        curvature=CurvatureConfig(num_examples=20, batch_size=5),
        gradients=GradientConfig(batch_size=5),
        progress=False,
        **kwargs,
    )
    index.ingest(TRAIN, progress=False, store_text=1 << 16)
    return index


@pytest.fixture(scope="module", params=[make_tiny_gpt2, make_tiny_llama], ids=["gpt2", "llama"])
def library_index(request, tmp_path_factory):
    return _library_index(tmp_path_factory.mktemp("explain") / "idx", request.param)


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_module_terms_sum_to_the_ranked_score(library_index):
    hits = library_index.top_influential(QUERY, k=6, direction="both", by_module=True).to_pylist()
    assert len(hits) == 12
    for hit in hits:
        assert list(hit["modules"]) == library_index.manifest.module_names
        assert _relative(sum(hit["modules"].values()), hit["score"]) < 1e-5


def test_token_contributions_sum_to_the_projected_and_the_ranked_score(library_index):
    hits = library_index.top_influential(QUERY, k=4, direction="both").to_pylist()
    explanations = library_index.explain_many(QUERY, [h["id"] for h in hits])
    y = library_index.query_coordinates([QUERY])[0].astype(np.float64)
    by_id = {ex.id: ex for ex in TRAIN}
    for hit, e in zip(hits, explanations):
        assert e.id == hit["id"]
        z = library_index.project([by_id[e.id]])[0].astype(np.float64)
        # Tokens' sums are linear in the first stage, while the projection (z, y) rounds the first
        # stage to FP16 before P (as the fit's PCA saw it): about 5e-4 relative per coordinate at most,
        # so the token sums match the scores to that rounding.
        assert _relative(e.score_projected, float(z @ y)) < 2e-3
        assert _relative(sum(t.contribution for t in e.train_tokens), e.score_projected) < 1e-4
        assert _relative(sum(t.contribution for t in e.query_tokens), hit["score"]) < 2e-3
        assert _relative(e.score, hit["score"]) < 1e-5  # the score as ranked, from the module terms
        assert _relative(sum(e.modules.values()), hit["score"]) < 1e-5
        assert len(e.train_tokens) == len(by_id[e.id].input_ids) and len(e.query_tokens) == len(QUERY["input_ids"])
        assert json.loads(e.text)["input_ids"] == list(by_id[e.id].input_ids)  # stored text: ids as JSON
    assert library_index.explain(QUERY, hits[0]["id"]).to_json()["id"] == hits[0]["id"]


def test_full_width_training_tokens_equal_kronfluence_per_token_scores(tmp_path):
    """m = k = d, fp32, no PCA: each training token's contribution is kronfluence's per-token score."""
    index = _library_index(
        tmp_path / "idx",
        make_tiny_gpt2,
        projection=ProjectionConfig(variant="ekfac-topk", k=10**9),
        storage=StorageConfig(precision="fp32"),
    )
    docs = TRAIN[:5]
    ours = index.explain_many(QUERY, [d.id for d in docs])
    query = Example.from_ids("q", QUERY["input_ids"], QUERY["labels"])
    reference = kronfluence_scores(index, [query], docs, per_token=True)[0]  # (docs, T_max)
    for i, (doc, e) in enumerate(zip(docs, ours)):
        got = np.array([t.contribution for t in e.train_tokens])
        expected = reference[i, : len(doc.input_ids)]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        assert np.abs(reference[i, len(doc.input_ids) :]).max(initial=0.0) == 0.0  # padding adds nothing


@pytest.fixture(scope="module")
def shard_index(tmp_path_factory):
    """An index of a real tokenizer's text shard, ingested without stored text."""
    root = tmp_path_factory.mktemp("shard")
    make_tiny_gpt2().save_pretrained(root / "model")
    make_word_tokenizer().save_pretrained(root / "model")
    lines = [{"id": f"d{i}", "text": " ".join(f"t{(i * 5 + j) % 60 + 2}" for j in range(5 + i % 7))} for i in range(16)]
    (root / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    model, tokenizer = load_model(str(root / "model"))
    from eogp_index.data.records import RecordSpec, tokenize_record

    examples = [
        tokenize_record(line, shard="docs.jsonl", position=i, spec=RecordSpec(id_field="id"), tokenizer=tokenizer)
        for i, line in enumerate(lines)
    ]
    index = AttributionIndex.create(
        root / "idx",
        model,
        tokenizer,
        examples,
        model_name=str(root / "model"),
        projection=ProjectionConfig(k=8, m=32),
        curvature=CurvatureConfig(num_examples=16, batch_size=4),
        progress=False,
    )
    from ingest.records import RecordSpec as IngestSpec

    run_ingest(index, [root / "docs.jsonl"], spec=IngestSpec(id_field="id"), progress=False)
    return root, index


def test_without_stored_text_the_document_is_read_back_from_its_shard(shard_index):
    root, index = shard_index
    sources = json.loads((index.path / "sources.json").read_text())
    assert sources["shards"]["docs.jsonl"]["uri"] == str((root / "docs.jsonl").resolve())
    assert sources["store_text"] is None and "text" not in index.store.schema.names
    e = index.explain("t3 t4 t5 t6", "d3")
    assert e.text == "t17 t18 t19 t20 t21 t22 t23 t24"
    assert [t.token for t in e.train_tokens] == e.text.split()
    rendered = explanation_terminal(e, color=False)
    assert rendered.startswith("d3: score") and "document tokens:" in rendered
    assert "⟨" in rendered  # the largest contributions are marked without colour
    fragment = explanation_html(e)
    assert fragment.count('class="eogp-token eogp-') == len(e.train_tokens) + len(e.query_tokens)
    assert "<script" not in fragment


def test_a_changed_or_moved_shard_is_an_error_not_a_wrong_explanation(shard_index, tmp_path):
    root, index = shard_index
    shard = root / "docs.jsonl"
    original = shard.read_text()
    try:
        lines = original.splitlines()
        lines[3] = json.dumps({"id": "d3", "text": "t9 t9 t9 t9"})
        shard.write_text("\n".join(lines) + "\n")
        with pytest.raises(InputError, match=r"docs.jsonl:4 .* has changed since it was ingested"):
            index.explain("t3 t4", "d3")
        shard.rename(tmp_path / "elsewhere.jsonl")
        with pytest.raises(InputError, match="can no longer be read"):
            index.explain("t3 t4", "d3")
    finally:
        if not shard.exists():
            (tmp_path / "elsewhere.jsonl").rename(shard)
        shard.write_text(original)
    with pytest.raises(InputError, match="no stored example has id 'nope'"):
        index.explain("t3 t4", "nope")


def test_store_text_setting_is_fixed_by_the_first_ingest(shard_index):
    root, index = shard_index
    from ingest.records import RecordSpec as IngestSpec

    with pytest.raises(Exception, match="ingested without stored text"):
        run_ingest(index, [root / "docs.jsonl"], spec=IngestSpec(id_field="id"), progress=False, store_text=1024)


def test_a_format_1_index_still_opens_and_queries_but_cannot_explain(tmp_path):
    """Index format 1 (before content hashes): rows have no content columns and it is read as before."""
    index = AttributionIndex.create(
        tmp_path / "v1",
        make_tiny_gpt2(),
        TinyTokenizer(),
        TRAIN,
        model_name="tiny",
        projection=ProjectionConfig(k=8, m=32),
        curvature=CurvatureConfig(num_examples=20, batch_size=5),
        progress=False,
    )
    manifest_path = index.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 1
    manifest_path.write_text(json.dumps(manifest))
    v1 = AttributionIndex.open(index.path, model=make_tiny_gpt2(), tokenizer=TinyTokenizer())
    assert v1.ingest(TRAIN, progress=False) == len(TRAIN)
    assert "content_sha256" not in v1.store.schema.names and not (v1.path / "sources.json").exists()
    top = v1.top_influential(QUERY, k=3, direction="positive", by_module=True)
    assert top.num_rows == 3
    with pytest.raises(IncompatibleIndexError, match="index format 1"):
        v1.explain(QUERY, top.column("id")[0].as_py())
    with pytest.raises(Exception, match="format 1, which has no text column"):
        v1.ingest(make_examples(2, seed=77, prefix="more"), progress=False, store_text=100)
    shutil.rmtree(index.path)
