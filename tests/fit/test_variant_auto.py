"""Variant auto: each module's 1-bit code (EOGP or EOGP-rot) chosen at fit time from held-out
fitting documents, by how well its codes keep the ranking by their first-stage inner products.

The measurement's pieces are checked against the evaluation's metrics and the store's codec; the
choice against coordinates whose variances are steep (rotation pays) and flat (a tie keeps EOGP),
and against a case where the FP16 coordinates at ``k`` and the full first stage disagree (the
full width decides); and a real fit (tiny GPT-2, kronfluence, a LanceDB-backed index on disk) against forced EOGP and
EOGP-rot fits: every stored P is exactly one of theirs, as the manifest says.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tinymodels import TinyTokenizer, make_examples, make_tiny_gpt2

from eogp_index.client import AttributionIndex
from eogp_index.config import CurvatureConfig, GradientConfig, ProjectionConfig
from eogp_index.errors import ConfigError
from eogp_index.evaluation import metrics
from eogp_index.fit.code_choice import (
    MIN_HELD_OUT,
    CodeChoice,
    _off_diagonal,
    choose_code,
    compare_codes,
    held_out_coordinates,
    held_out_directions,
    held_out_rows,
    one_bit_documents,
    ranking_agreement,
)
from eogp_index.fit.projection import fit_pca, gram_matrix, module_rotation
from eogp_index.store.codecs import SignLayout, decode, encode


def test_ranking_agreement_is_the_evaluations_ndcg_and_spearman():
    gen = np.random.default_rng(0)
    a, e = gen.normal(size=(7, 50)), gen.normal(size=(7, 50))
    got = ranking_agreement(torch.from_numpy(a), torch.from_numpy(e))
    np.testing.assert_allclose(got["ndcg@20"].numpy(), metrics.ndcg_at_k_per_query(a, e, 20), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["spearman"].numpy(), metrics.spearman_per_query(a, e), rtol=0, atol=1e-12)


def test_one_bit_documents_are_what_the_codec_stores():
    y = torch.randn(9, 21, dtype=torch.float64)
    y[0, 3] = 0.0  # a zero coordinate is stored as +1
    layout = SignLayout((21,))
    stored = decode(encode(y.float().numpy(), layout, "1bit"), layout)
    np.testing.assert_allclose(one_bit_documents(y).numpy(), stored, rtol=1e-6, atol=0)


def test_off_diagonal_drops_each_pseudo_querys_own_column():
    scores = torch.arange(16.0).view(4, 4)
    expected = torch.stack([torch.cat([row[:i], row[i + 1 :]]) for i, row in enumerate(scores)])
    assert torch.equal(_off_diagonal(scores), expected)


def test_held_out_rows_are_seeded_and_skip_tiny_sets():
    rows = held_out_rows(100, 0.15, seed=3)
    assert rows.numel() == 15 and torch.equal(rows, held_out_rows(100, 0.15, seed=3))
    assert torch.equal(rows, rows.sort().values) and not torch.equal(rows, held_out_rows(100, 0.15, seed=4))
    assert held_out_rows(40, 0.15, seed=0).numel() == 0 < MIN_HELD_OUT  # 6 documents measure nothing
    assert held_out_rows(100, 0.0, seed=0).numel() == 0


@pytest.mark.parametrize("spectrum, expected", [("steep", "eogp-rot"), ("flat", "eogp")])
def test_the_rotation_is_chosen_where_variances_are_unequal_and_a_tie_keeps_eogp(spectrum, expected):
    n, m, k = 400, 64, 32
    scale = torch.arange(1, m + 1).double() ** -1.5 if spectrum == "steep" else torch.ones(m, dtype=torch.float64)
    z = torch.randn(n, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * scale.sqrt()
    choice = choose_code(z.float(), k, module_rotation(0, "layer", k), held_out_rows(n, 0.25, 0))
    assert choice.code == expected and choice.held_out == 100
    if expected == "eogp":
        assert abs(choice.diff) < 3 * choice.diff_se  # no real difference either way: EOGP kept
    else:
        assert choice.fidelity["eogp-rot"]["spearman"] > choice.fidelity["eogp"]["spearman"] + 0.1
    assert CodeChoice.from_json(json.loads(json.dumps(choice.to_json()))) == choice


def test_the_choice_follows_the_first_stage_inner_products_not_the_fp16_coordinates_at_k():
    """The held-out documents reach beyond the fitted span (as when the PCA set is smaller than
    ``m``): their first-stage coordinates outside it are the signs of those inside, which EOGP's
    codes keep and EOGP-rot's scramble. Against the FP16 coordinates at ``k`` the steep spectrum
    favours the rotation; against the full width EOGP wins, and that is the choice."""
    n, k = 200, 16
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x *= torch.arange(1, k + 1).double() ** -0.75
    held_out = held_out_rows(n, 0.25, seed=0)
    beyond = torch.zeros(n, k, dtype=torch.float64)
    beyond[held_out] = x[held_out].sign()  # the fitting rows have nothing there: P cannot see it
    z = torch.cat([x, beyond], dim=1).float()
    rotation = module_rotation(0, "layer", k)
    y = held_out_coordinates(z, k, held_out)
    at_k = compare_codes(y, y @ y.half().double().T, rotation)
    assert at_k.code == "eogp-rot" and at_k.diff > 5 * at_k.diff_se
    for gram in (None, gram_matrix(z)):
        choice = choose_code(z, k, rotation, held_out, gram=gram)
        assert choice.code == "eogp" and choice.diff < -3 * choice.diff_se
        # The FP16 coordinates at k rank them by the fitted span alone: below full width, as are the codes.
        assert choice.fidelity["fp16"]["spearman"] < 0.9
    assert CodeChoice.from_json(json.loads(json.dumps(choice.to_json()))) == choice


@pytest.mark.parametrize("n, k", [(60, 16), (60, 55)])  # a full-rank held-out fit; one completed (48 rows < k)
def test_held_out_coordinates_from_the_gram_matrix_equal_projecting_by_the_held_out_fit(n, k):
    z = torch.randn(n, 80, generator=torch.Generator().manual_seed(1)).half()
    held_out = held_out_rows(n, 0.2, seed=0)
    gram = gram_matrix(z)
    expected = z[held_out].double() @ held_out_directions(z, k, held_out)
    torch.testing.assert_close(held_out_coordinates(z, k, held_out, gram), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(fit_pca(z, k, gram=gram), fit_pca(z, k), rtol=0, atol=0)


def test_held_out_fraction_is_validated():
    with pytest.raises(ConfigError, match="held_out_fraction"):
        ProjectionConfig(k=8, held_out_fraction=0.9)
    # The default resolves per tier: auto with a rescoring tier, eogp without (docs/variants.md).
    assert ProjectionConfig(k=8).variant is None
    assert ProjectionConfig(k=8).resolved("int8").variant == "auto"
    assert ProjectionConfig(k=8).resolved(None).variant == "eogp"
    with pytest.raises(ConfigError, match="resolved"):
        ProjectionConfig(k=8).rotation  # noqa: B018


# -- a real fit ---------------------------------------------------------------------------------
EXAMPLES = make_examples(96, seed=5)
K = 8


def _fit(path, variant):
    return AttributionIndex.create(
        path,
        make_tiny_gpt2(),
        TinyTokenizer(),
        EXAMPLES,
        model_name="tiny",
        progress=False,
        projection=ProjectionConfig(variant=variant, k=K, m=48, num_fit_examples=64, held_out_fraction=0.25),
        curvature=CurvatureConfig(num_examples=32, batch_size=16),
        gradients=GradientConfig(batch_size=16),
    )


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    return {variant: (root / variant, _fit(root / variant, variant)) for variant in ("auto", "eogp", "eogp-rot")}


def test_auto_stores_each_modules_p_from_the_forced_fit_it_chose(fits):
    path, index = fits["auto"]
    projection = index.manifest.projection
    fidelity = projection["fidelity"]
    assert projection["variant"] == "auto" and set(fidelity["modules"]) == set(index.manifest.module_names)
    chosen = {name: c["code"] for name, c in fidelity["modules"].items()}
    assert projection["rotation"]["modules"] == [n for n in index.manifest.module_names if chosen[n] == "eogp-rot"]
    stored = load_file(str(path / "projection.safetensors"))
    forced = {code: load_file(str(fits[code][0] / "projection.safetensors")) for code in ("eogp", "eogp-rot")}
    for name, code in chosen.items():
        assert torch.equal(stored[f"{name}/pca"], forced[code][f"{name}/pca"]), name
        entry = fidelity["modules"][name]
        # With the default rescoring tier the code follows the recall of its top rows (test_rescore_recall.py).
        decides = entry["recall"]
        assert entry["held_out"] == 16 and entry["code"] == (
            "eogp-rot" if decides["diff"] > decides["diff_se"] else "eogp"
        )
        for code_ in ("eogp", "eogp-rot"):
            # 15 candidates per pseudo-query, fewer than 20: NDCG@20 is 1 by definition; Spearman measures
            measured = entry[code_]
            assert measured["ndcg@20"] == 1.0 and -1 < measured["spearman"] < 1 and measured["spearman_se"] > 0

    # The same measurement is made (and recorded) whatever the variant; only auto acts on it.
    def without_time(entries):
        return {name: {key: v for key, v in entry.items() if key != "seconds"} for name, entry in entries.items()}

    assert without_time(fits["eogp"][1].manifest.projection["fidelity"]["modules"]) == without_time(fidelity["modules"])
    assert fits["eogp"][1].manifest.projection["rotation"] == {"kind": "none"}
    # The stored format is unchanged: the codes and the queries work as for EOGP.
    index.add_batch(EXAMPLES[:20])
    assert index.search(list(EXAMPLES[0].input_ids)).limit(5).direction("positive").to_arrow().num_rows == 5


def test_the_held_out_split_is_recorded_and_printed(fits, capsys):
    from eogp_index.cli import cli

    path, index = fits["auto"]
    record = json.loads((path / "fit" / "fitting_set.json").read_text())
    held = record["pca_held_out"]
    assert len(held) == 16 and all(entry in record["pca"] for entry in held)
    result = CliRunner().invoke(cli, ["info", str(path)])
    assert result.exit_code == 0, result.output
    assert "1-bit code" in result.output and all(name in result.output for name in index.manifest.module_names)


def test_auto_without_enough_held_out_documents_stores_eogp(tmp_path):
    """Too few PCA documents to hold any out (6 of 40 < 8): auto is EOGP, bit for bit."""
    settings = dict(
        model_name="tiny",
        progress=False,
        curvature=CurvatureConfig(num_examples=16, batch_size=16),
        gradients=GradientConfig(batch_size=16),
    )
    paths = {}
    for variant in ("auto", "eogp"):
        paths[variant] = tmp_path / variant
        index = AttributionIndex.create(
            paths[variant],
            make_tiny_gpt2(),
            TinyTokenizer(),
            EXAMPLES[:56],
            **settings,
            projection=ProjectionConfig(variant=variant, k=K, m=48, num_fit_examples=40),
        )
        assert "fidelity" not in index.manifest.projection
    assert AttributionIndex.open(paths["auto"], model=make_tiny_gpt2(), tokenizer=TinyTokenizer()).manifest.projection[
        "rotation"
    ] == {"kind": "hadamard", "rounds": 2, "seed": 0, "modules": []}
    auto, eogp = (load_file(str(paths[v] / "projection.safetensors")) for v in ("auto", "eogp"))
    assert auto.keys() == eogp.keys() and all(torch.equal(auto[key], eogp[key]) for key in auto)


def test_a_resumed_fit_keeps_the_choices_of_the_modules_it_had_finished(tmp_path, fits):
    """A fit stopped after some modules: those modules' measurements are read back from fit/pca/,
    the rest measured again, and the index is the uninterrupted one."""
    from eogp_index.fit.fitting import fit_projection

    settings = dict(
        projection=ProjectionConfig(variant="auto", k=K, m=48, num_fit_examples=64, held_out_fraction=0.25),
        curvature=CurvatureConfig(num_examples=32, batch_size=16),
        gradients=GradientConfig(batch_size=16),
        progress=False,
    )
    first = fit_projection(make_tiny_gpt2(), TinyTokenizer(), EXAMPLES, tmp_path, **settings)
    # As if killed while fitting module 3: its P and record, and every later module's, are missing.
    num_modules = len(first.projection.modules)
    for i in range(3, num_modules):
        first.folder.module_path(i).unlink()
        first.folder.choice_path(i).unlink()
    first.folder.choice_path(0).write_text(
        json.dumps({**json.loads(first.folder.choice_path(0).read_text()), "seconds": 123.0})
    )  # marks it as read back, not redone
    resumed = fit_projection(make_tiny_gpt2(), TinyTokenizer(), EXAMPLES, tmp_path, **settings)
    name0 = next(iter(resumed.projection.modules))
    assert resumed.projection.choices[name0].seconds == 123.0
    expected = fits["auto"][1].manifest.projection["fidelity"]["modules"]
    assert {n: c.code for n, c in resumed.projection.choices.items()} == {n: c["code"] for n, c in expected.items()}
    stored = load_file(str(fits["auto"][0] / "projection.safetensors"))
    for i, (name, module) in enumerate(resumed.projection.modules.items()):
        assert torch.equal(module.pca, stored[f"{name}/pca"]), name
