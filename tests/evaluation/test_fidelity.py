"""The shared scoring pass of ``eogp eval``: budgets, the EK-FAC reference, and the CLI.

Everything runs on tiny GPT-2 models built from configs; kronfluence fits their EK-FAC in
seconds.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from tinymodels import make_examples, make_tiny_gpt2

from eogp_index.config import first_stage_width
from eogp_index.errors import ConfigError
from eogp_index.evaluation import metrics
from eogp_index.evaluation.baselines import bytes_for_coordinates
from eogp_index.evaluation.fidelity import (
    DEFAULT_METHODS,
    K_FROM_PRECISION,
    METHODS,
    PCA_FAMILIES,
    Documents,
    MethodConfig,
    ModuleShape,
    SharedPass,
    compute_scores,
    fidelity_records,
    kronfluence_scores,
    plan_methods,
)

torch.set_num_threads(1)


def _docs(examples) -> Documents:
    return Documents(
        tuple(e.id for e in examples),
        tuple(tuple(e.input_ids) for e in examples),
        tuple(tuple(e.labels) for e in examples),
    )


TRAIN = _docs(make_examples(28, seed=1))
QUERIES = _docs(make_examples(4, seed=2, prefix="q", masked_prompt=True))
BUDGETS = (32, 128)
ALL_METHODS = tuple(METHODS)  # including the opt-in 1-bit baselines and the FP32 checks


@pytest.fixture(scope="module")
def scoreset(tmp_path_factory):
    work = tmp_path_factory.mktemp("fidelity")
    return compute_scores(
        make_tiny_gpt2(), TRAIN, QUERIES, work, budgets=BUDGETS, methods=ALL_METHODS, batch_size=7, gaussian_seeds=2
    )


# The default model's 8 modules: (d_out, d_in + 1) of c_attn, attn.c_proj, c_fc, mlp.c_proj, twice.
DEFAULT_SHAPES = tuple(
    ModuleShape(f"h.{layer}.{name}", d_out, d_in)
    for layer in range(2)
    for name, d_out, d_in in (
        ("c_attn", 384, 129),
        ("attn.c_proj", 128, 129),
        ("c_fc", 512, 129),
        ("mlp.c_proj", 128, 513),
    )
)


def test_budgets_give_each_method_the_most_coordinates_that_fit():
    budgets = (64, 128, 256, 512, 1024, 2048, 4096)
    configs, skipped = plan_methods(DEFAULT_SHAPES, budgets, tuple(METHODS))
    seen = {(c.method, c.budget) for c in configs}
    for cfg in configs:
        per_module = cfg.budget // len(DEFAULT_SHAPES)
        sizing = K_FROM_PRECISION.get(cfg.method, cfg.precision)  # the precision whose bytes set k
        if sizing == cfg.precision:
            assert cfg.bytes_per_example <= cfg.budget
        assert all(bytes_for_coordinates(k, sizing) <= per_module for k in cfg.k)
        if cfg.rank is not None:  # the next rank would not fit
            assert all(k == r * r for k, r in zip(cfg.k, cfg.rank))
            assert all(bytes_for_coordinates((r + 1) ** 2, cfg.precision) > per_module for r in cfg.rank)
        else:  # one more coordinate would not fit
            assert all(bytes_for_coordinates(k + 1, sizing) > per_module for k in cfg.k)
        if cfg.m is not None:
            assert all(m == first_stage_width(s.d, k) for m, s, k in zip(cfg.m, DEFAULT_SHAPES, cfg.k))
    # 1-bit: k = 8 (b - 2) per module, so the payload is the budget exactly.
    eogp = {c.budget: c for c in configs if c.method == "eogp"}
    assert eogp[64].k[0] == 48 and eogp[64].bytes_per_example == 64
    assert eogp[512].k[0] == 496 and eogp[512].bytes_per_example == 512
    # A k above the fitting documents is planned (the PCA is completed, as the index's fit does).
    assert {("eogp", 4096), ("eogp-rot", 4096), ("eogp-fp16", 4096)} <= seen
    assert not any(s["method"].startswith("eogp") for s in skipped)
    # FP16 at the same k as 1-bit EOGP: the same k, 16 x the bytes of the signs.
    same_k = {c.budget: c for c in configs if c.method == "eogp-fp16-same-k"}
    assert same_k[2048].k == eogp[2048].k and same_k[2048].bytes_per_example == 2 * sum(eogp[2048].k)
    # LoGra at 4 KB: 512 B per module = 256 FP16 coordinates = rank 16.
    logra = {c.budget: c for c in configs if c.method == "logra-pca"}
    assert logra[4096].rank[0] == 16 and logra[4096].bytes_per_example == 4096
    assert {c.seeds for c in configs if c.method == "gaussian"} == {(0, 1, 2)}
    with pytest.raises(ConfigError, match="unknown method"):
        plan_methods(DEFAULT_SHAPES, budgets, ("nope",))


def test_shared_pass_stores_the_planned_widths(scoreset):
    """Every configuration's scores exist, and the coordinates behind them have width Σ k_u."""
    methods_run = {c.method for c in scoreset.configs}
    assert set(DEFAULT_METHODS) <= methods_run
    nq, n = len(QUERIES), len(TRAIN)
    for cfg in scoreset.configs:
        s = scoreset.scores[cfg.id]
        assert s.shape == (len(cfg.seeds), nq, n) and np.all(np.isfinite(s))
        assert cfg.bytes_per_example <= cfg.budget or cfg.method in K_FROM_PRECISION
        assert (cfg.id in scoreset.unquantized) == (cfg.precision == "1bit")
    # The transform's per-method outputs have exactly the planned widths.
    from eogp_index.gradients.model import replace_conv1d

    model = make_tiny_gpt2()
    replace_conv1d(model)
    curvature = {m.name: _fake_curvature(m) for m in scoreset.modules}
    kfac = {m.name: (torch.rand(m.d_in) + 0.1, torch.rand(m.d_out) + 0.1) for m in scoreset.modules}
    shared = SharedPass(model, curvature, scoreset.configs, kfac_eigenvalues=kfac)
    shared.run(QUERIES, "query")
    for cfg in scoreset.configs:
        for seed in cfg.seeds:
            key = f"{cfg.id}#{seed}"
            if cfg.family in PCA_FAMILIES:
                assert key not in shared.query  # PCA is applied after the pass, to the "pca" prefix
            else:
                assert shared.query[key].shape == (nq, sum(cfg.k)), key
    widths = [max(c.m[u] for c in scoreset.configs if c.family in PCA_FAMILIES) for u in range(len(scoreset.modules))]
    assert shared.query["pca"].shape == (nq, sum(widths))
    assert shared.query["ref:ekfac"].shape == (nq, sum(m.d for m in scoreset.modules))


def test_shared_transform_equals_the_library_projectors(scoreset):
    """The batched shared transform computes exactly what each projector computes alone."""
    from eogp_index.fit.projection import srht_apply
    from eogp_index.gradients.model import replace_conv1d

    model = make_tiny_gpt2()
    replace_conv1d(model)
    curvature = {m.name: _fake_curvature(m) for m in scoreset.modules}
    kfac = {m.name: (torch.rand(m.d_in) + 0.1, torch.rand(m.d_out) + 0.1) for m in scoreset.modules}
    shared = SharedPass(model, curvature, scoreset.configs, kfac_eigenvalues=kfac)
    gen = torch.Generator().manual_seed(1)
    for u, module in enumerate(scoreset.modules):
        a = torch.randn(2, 6, module.d_in, generator=gen)
        g = torch.randn(2, 6, module.d_out, generator=gen)
        first = shared.first[module.name].first_stage(a, g)
        for side in ("train", "query"):
            shared._side = side
            out = shared.transform(module.name, a, g)
            for cfg in scoreset.configs:
                for seed in cfg.seeds:
                    key, proj = f"{cfg.id}#{seed}", shared.projectors.get((cfg.id, seed, module.name))
                    if cfg.family == "ekfac-topk":
                        expected = first[:, : cfg.k[u]]
                    elif cfg.family == "eogp-r":
                        expected = srht_apply(first[:, : cfg.m[u]], *proj)
                    elif cfg.family == "gaussian" and side == "query":
                        precondition = lambda d: shared.precondition(module.name, d)  # noqa: E731
                        expected = proj.project_query(a, g, precondition) * proj.inner_product_scale
                    elif cfg.family in PCA_FAMILIES:
                        continue
                    else:
                        expected = proj.project(a, g)
                    torch.testing.assert_close(out[key], expected, rtol=1e-4, atol=1e-5 * expected.abs().max())


def test_rotated_and_same_k_eogp_scores(scoreset):
    """EOGP-rot stores the signs of the rotated coordinates: its FP16 scores equal EOGP's (an
    orthogonal R leaves inner products alone) while its 1-bit scores differ; FP16 EOGP at the same
    k is exactly EOGP's unquantized score."""
    for budget in BUDGETS:
        eogp, rot, same_k = (scoreset.config(m, budget) for m in ("eogp", "eogp-rot", "eogp-fp16-same-k"))
        assert eogp.k == rot.k == same_k.k and eogp.m == rot.m == same_k.m
        np.testing.assert_array_equal(scoreset.scores[same_k.id], scoreset.unquantized[eogp.id])
        plain, rotated = scoreset.unquantized[eogp.id], scoreset.unquantized[rot.id]
        np.testing.assert_allclose(rotated, plain, rtol=0, atol=2e-3 * np.abs(plain).max())  # FP16 rounding
        assert not np.allclose(
            scoreset.scores[rot.id], scoreset.scores[eogp.id], rtol=0, atol=1e-3 * np.abs(plain).max()
        )


def _fake_curvature(module: ModuleShape):
    from eogp_index.fit.curvature import ModuleCurvature

    gen = torch.Generator().manual_seed(0)
    q_a = torch.linalg.qr(torch.randn(module.d_in, module.d_in, generator=gen))[0]
    q_s = torch.linalg.qr(torch.randn(module.d_out, module.d_out, generator=gen))[0]
    lam = torch.rand(module.d_out, module.d_in, generator=gen) + 0.1
    return ModuleCurvature(activation_eigenvectors=q_a, gradient_eigenvectors=q_s, eigenvalues=lam)


def test_index_side_ekfac_equals_kronfluence(scoreset):
    assert scoreset.reference.shape == (len(QUERIES), len(TRAIN))
    assert scoreset.reference_error() < 1e-3
    # TracIn and K-FAC are different estimators: finite, not identical to EK-FAC.
    for key in ("kfac", "tracin"):
        assert np.all(np.isfinite(scoreset.references[key]))
        assert not np.allclose(scoreset.references[key], scoreset.reference)


def test_fidelity_records_and_table2(scoreset):
    records, details = fidelity_records(scoreset)
    by = {(r["method"], r["bytes_per_example"], r["metric"]): r["value"] for r in records}
    for cfg in scoreset.configs:
        for metric in ("ndcg@20", "spearman"):
            value = by[(cfg.label, cfg.budget, metric)]
            assert -1 <= value <= 1
        if cfg.precision == "1bit":
            assert -1 <= by[(cfg.label, cfg.budget, "pearson_1bit_fp16")] <= 1
    # Metrics are computed against kronfluence's scores, averaged over seeds.
    cfg = scoreset.config("gaussian", 128)
    expected = np.mean([metrics.mean_ndcg_at_k(s, scoreset.reference, 20) for s in scoreset.scores[cfg.id]])
    assert by[("Gaussian", 128, "ndcg@20")] == pytest.approx(expected)
    assert details["index_vs_kronfluence_rel_err"] < 1e-3
    assert set(details["reference_lines"]["ndcg@20"]) == {"K-FAC (uncompressed)", "TracIn (uncompressed)"}


def _micro_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=4,
        n_layer=1,
        n_head=1,
        n_inner=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval()


def test_full_width_eogp_and_topk_equal_the_reference(tmp_path):
    """With m = k = d and FP32 storage, PCA is a rotation and top-k keeps every axis: EK-FAC."""
    from eogp_index.config import CurvatureConfig
    from eogp_index.fit.curvature import fit_curvature
    from eogp_index.gradients.model import find_attributed_modules, replace_conv1d

    model = _micro_gpt2()
    replace_conv1d(model)
    # The MLP modules, whose PCA is then a rotation. (This one-head attention's gradients span
    # about a third of their directions: its PCA would be completed by fit_pca's fallback.)
    names = find_attributed_modules(model, ["*.mlp.*"])
    train = _docs(make_examples(64, seed=5))
    queries = QUERIES
    curvature = fit_curvature(
        model, train.pairs(), names, tmp_path, config=CurvatureConfig(num_examples=64), progress=False
    )
    d = tuple(c.num_params for c in curvature.values())
    assert max(d) <= len(train)
    configs = [MethodConfig("eogp-fp32", 1, k=d, m=d), MethodConfig("ekfac-topk-fp32", 1, k=d)]
    shared = SharedPass(model, curvature, configs)
    shared.run(queries, "query", batch_size=16)
    shared.run(train, "train", batch_size=16)
    scores, unquantized, references = shared.finish()
    reference = kronfluence_scores(model, names, tmp_path, queries, train)
    for cfg in configs:
        ours = scores[cfg.id][0]
        rel = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
        assert rel < 1e-3, (cfg.method, rel)
        rho, valid = metrics.mean_spearman(ours, reference)
        assert valid == len(queries) and rho > 0.999
        assert metrics.mean_ndcg_at_k(ours, reference, 20) == pytest.approx(1.0)
    assert unquantized == {}


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny GPT-2 with a trained byte-level BPE tokenizer, saved like the shipped default."""
    from transformers import GPT2LMHeadModel

    from eogp_index.evaluation import tinylm

    root = tmp_path_factory.mktemp("tinyfid")
    texts = [
        f"Return the {w} of the {v} in place; raise ValueError when {w} is empty."
        for w in ("sum", "length", "first item", "maximum", "copy", "sorted keys", "mean", "name")
        for v in ("list", "mapping", "string", "queue", "tuple")
    ]
    tok = tinylm.train_tokenizer(texts, vocab_size=300)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        tinylm.default_config(len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2, n_inner=32)
    ).eval()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    with open(root / "train.jsonl", "w") as fh:
        for i, t in enumerate(texts[:30]):
            fh.write(json.dumps({"id": f"train-{i}", "text": t}) + "\n")
    with open(root / "queries.jsonl", "w") as fh:
        for i, t in enumerate(texts[30:]):
            fh.write(json.dumps({"id": f"query-{i}", "text": t}) + "\n")
    return root


def _is_png(path) -> bool:
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width > 100 and height > 100


def test_cli_eval_fidelity_writes_json_markdown_and_pngs(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from eogp_index.evaluation.cli import eval_group

    out = tmp_path / "eval"
    args = [
        "fidelity",
        "--model",
        str(tiny_model_dir / "model"),
        "--train",
        str(tiny_model_dir / "train.jsonl"),
        "--queries",
        str(tiny_model_dir / "queries.jsonl"),
        "--out",
        str(out),
        "--budgets",
        "16,20,64",
        "--methods",
        "eogp,eogp-rot,eogp-fp16-same-k,eogp-fp16,logra-random,grass",
        "--limit-queries",
        "5",
        "--quiet",
        "--json",
    ]
    result = CliRunner().invoke(eval_group, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    payload = json.loads((out / "results.json").read_text())
    key = lambda r: (r["method"], float(r["bytes_per_example"]), r["metric"])  # noqa: E731
    assert {key(r): r["value"] for r in payload["records"]} == {key(r): r["value"] for r in printed["records"]}
    metrics_seen = {r["metric"] for r in payload["records"]}
    assert {"ndcg@20", "spearman", "pearson_1bit_fp16"} <= metrics_seen
    methods_seen = {r["method"] for r in payload["records"]}
    assert {"EOGP", "EOGP-rot", "EOGP (FP16, same k)", "EOGP (FP16)", "LoGra (random)", "GraSS"} <= methods_seen
    assert "TracIn (uncompressed)" in payload["reference_lines"]["ndcg@20"]
    md = (out / "results.md").read_text()
    assert "| EOGP |" in md and "## Dimensions per module" in md
    assert "## 1-bit codes against FP16 at the same k" in md  # EOGP-rot's share of the 1-bit gap, per budget
    # The rescoring tier of the 1-bit PCA methods: each tier alone, rescored, the recall, the tier's k.
    assert {"EOGP + int8 tier (full scan)", "EOGP-rot, top 5×20 rescored by int4"} <= methods_seen
    assert "recall@100" in metrics_seen
    for section in ("## Rescoring from the tier", "### Recall:", "### The tier's k"):
        assert section in md, section
    assert "| EOGP | 16 B | " in md.split("## Rescoring from the tier")[1]
    for name in ("ndcg_at_20.png", "spearman.png", "pearson_1bit_fp16.png", "rescoring.png", "tier_k.png"):
        assert _is_png(out / name), name
    details = json.loads((out / "details.json").read_text())
    rescoring = details["fidelity"]["rescoring"]
    assert {(e["method"], e["budget"]) for e in rescoring} == {
        (m, b) for m in ("eogp", "eogp-rot") for b in (16, 20, 64)
    }
    assert details["setup"]["num_train"] == 30 and details["setup"]["num_queries"] == 5
    assert details["setup"]["index_vs_kronfluence_rel_err"] < 1e-3
    gap = details["fidelity"]["one_bit_gap"]
    assert [row["budget"] for row in gap] == [16, 20, 64]
    assert all(
        row["ndcg@20"]["diff"] == pytest.approx(row["ndcg@20"]["variant"] - row["ndcg@20"]["base"]) for row in gap
    )
    # A second run with the same inputs reuses the cached scores.
    result = CliRunner().invoke(eval_group, args[:-1], catch_exceptions=False)
    assert result.exit_code == 0 and "| EOGP |" in result.stdout
    assert json.loads((out / "details.json").read_text())["scores_reused"] is True


def test_cli_rejects_unknown_methods(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from eogp_index.evaluation.cli import eval_group

    result = CliRunner().invoke(
        eval_group,
        ["fidelity", "--model", str(tiny_model_dir / "model"), "--out", str(tmp_path), "--methods", "eogp,bogus"],
    )
    assert result.exit_code != 0 and "bogus" in result.output


def test_method_table_is_the_configs():
    """The torch-free config module holds the method table the command line shows; scoring uses the same."""
    from eogp_index.evaluation import config, fidelity

    assert fidelity.METHODS == config.METHODS
    assert fidelity.DEFAULT_METHODS == config.DEFAULT_METHODS
    assert fidelity.DEFAULT_BUDGETS == config.DEFAULT_BUDGETS


def test_auto_stores_per_module_the_code_the_held_out_measurement_chose(tmp_path):
    """``auto`` as the index's variant auto: per module, EOGP's or EOGP-rot's P as the fit-time
    measurement on held-out fitting documents chooses; its scores are the sum of each module's
    chosen code, so they equal a fixed code's exactly where every module chose it."""
    train = _docs(make_examples(64, seed=4))  # 10 of 64 held out
    scoreset = compute_scores(
        make_tiny_gpt2(),
        train,
        QUERIES,
        tmp_path,
        budgets=(32, 128),
        methods=("eogp", "eogp-rot", "auto"),
        batch_size=16,
    )
    assert len(scoreset.choices) == 2 * len(scoreset.modules)
    for budget in (32, 128):
        rows = [c for c in scoreset.choices if c["budget"] == budget]
        assert all(
            c["held_out"] == 10 and c["code"] == ("eogp-rot" if c["proxy_diff"] > c["proxy_diff_se"] else "eogp")
            for c in rows
        )
        auto = scoreset.scores[scoreset.config("auto", budget).id]
        codes = {c["code"] for c in rows}
        for code in ("eogp", "eogp-rot"):
            fixed = scoreset.scores[scoreset.config(code, budget).id]
            assert np.array_equal(auto, fixed) == (codes == {code})
    records, details = fidelity_records(scoreset)
    assert [row["budget"] for row in details["auto_vs_best"]] == [32, 128]
    for row in details["auto_vs_best"]:
        v = row["spearman"]
        assert v["diff"] == pytest.approx(v["auto"] - max(v["eogp"], v["eogp-rot"]))
    # Besides the rows of the rescoring tier (tests/evaluation/test_rescoring.py).
    plain = {r["method"] for r in records if " tier " not in r["method"] and "rescored" not in r["method"]}
    assert plain == {"EOGP", "EOGP-rot", "EOGP auto (per module)"}
