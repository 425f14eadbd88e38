"""Tests of the evaluation report writers (plots, Markdown table, JSON)."""

from __future__ import annotations

import json
import math

import pytest

from eogp_index.errors import ConfigError, InputError
from eogp_index.evaluation.report import (
    ResultRecord,
    format_bytes,
    load_records,
    markdown_table,
    plot_metric_vs_bytes,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records():
    recs = []
    for method, base in (("EOGP", 0.6), ("LoGra (PCA)", 0.3)):
        for i, kb in enumerate((12, 24, 96)):
            size = kb * 1024
            recs.append({"method": method, "bytes_per_example": size, "metric": "ndcg@20", "value": base + 0.05 * i})
            recs.append(
                {"method": method, "bytes_per_example": size, "metric": "spearman", "value": base - 0.1 + 0.05 * i}
            )
            v = base / 3 + 0.02 * i
            recs.append(
                {
                    "method": method,
                    "bytes_per_example": size,
                    "metric": "lds",
                    "value": v,
                    "ci_low": v - 0.02,
                    "ci_high": v + 0.03,
                }
            )
    # A budget a method cannot reach.
    recs.append(ResultRecord("LoGra (PCA)", 1536 * 1024, "lds", float("nan")))
    return recs


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1024


def test_plot_writes_valid_png(tmp_path):
    out = plot_metric_vs_bytes(
        _records(),
        "lds",
        tmp_path / "sub" / "lds.png",
        reference_lines={"EK-FAC": 0.35, "TracIn": 0.1},
        title="GPT-2 LDS",
    )
    assert out.exists()
    _assert_png(out)


def _pixels_of(path, rgb) -> int:
    import numpy as np
    from matplotlib.image import imread

    return int(np.all(np.abs(imread(path)[..., :3] - np.asarray(rgb)) < 0.02, axis=-1).sum())


def test_plot_draws_each_method_in_its_given_colour(tmp_path):
    given = plot_metric_vs_bytes(_records(), "ndcg@20", tmp_path / "given.png", colours={"LoGra (PCA)": "#ff00ff"})
    cycled = plot_metric_vs_bytes(_records(), "ndcg@20", tmp_path / "cycled.png")
    assert _pixels_of(given, (1, 0, 1)) > 100 and _pixels_of(cycled, (1, 0, 1)) == 0
    blue = (0x1F / 255, 0x77 / 255, 0xB4 / 255)  # EOGP, not in colours: the cycle's first colour
    assert _pixels_of(given, blue) > 100


def test_plot_unknown_metric_raises(tmp_path):
    with pytest.raises(InputError):
        plot_metric_vs_bytes(_records(), "nope", tmp_path / "x.png")


def test_plot_ci_not_containing_value_is_accepted(tmp_path):
    recs = [{"method": "m", "bytes_per_example": 100, "metric": "lds", "value": 0.5, "ci_low": 0.6, "ci_high": 0.7}]
    _assert_png(plot_metric_vs_bytes(recs, "lds", tmp_path / "p.png"))


def test_markdown_table_header_and_rows():
    table = markdown_table(_records())
    lines = table.strip().split("\n")
    assert lines[0] == "| Method | Bytes per example | NDCG@20 | Spearman correlation | LDS |"
    assert lines[1] == "|---|---:|---:|---:|---:|"
    assert lines[2] == "| EOGP | 12 KB (12288 B) | 0.600 | 0.500 | 0.200 |"
    assert lines[4] == "| EOGP | 96 KB (98304 B) | 0.700 | 0.600 | 0.240 |"
    assert lines[5] == "| LoGra (PCA) | 12 KB (12288 B) | 0.300 | 0.200 | 0.100 |"
    assert lines[-1] == "| LoGra (PCA) | 1.5 MB (1572864 B) | — | — | — |"
    assert len(lines) == 2 + 7


def test_markdown_table_duplicate_cell_raises():
    rec = {"method": "m", "bytes_per_example": 10, "metric": "lds", "value": 0.1}
    with pytest.raises(InputError):
        markdown_table([rec, dict(rec, value=0.2)])


def test_record_validation():
    with pytest.raises(InputError):
        ResultRecord.coerce({"method": "m", "metric": "lds", "value": 1.0})
    with pytest.raises(InputError):
        ResultRecord.coerce({"method": "m", "bytes_per_example": 0, "metric": "lds", "value": 1.0})
    with pytest.raises(InputError):
        ResultRecord.coerce({"method": "m", "bytes_per_example": 1, "metric": "lds", "value": 1.0, "ci_low": 0.0})


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(12 * 1024) == "12 KB"
    assert format_bytes(1536 * 1024) == "1.5 MB"


def test_write_report_outputs(tmp_path):
    refs = {"lds": {"EK-FAC": 0.35, "K-FAC": 0.3}, "ndcg@20": {"EK-FAC": 1.0}}
    paths = write_report(_records(), tmp_path / "report", reference_lines=refs)
    assert set(paths) == {"json", "markdown", "ndcg@20", "spearman", "lds"}
    for metric in ("ndcg@20", "spearman", "lds"):
        _assert_png(paths[metric])
    assert paths["ndcg@20"].name == "ndcg_at_20.png"

    payload = json.loads(paths["json"].read_text())
    assert len(payload["records"]) == len(_records())
    assert payload["reference_lines"]["lds"] == {"EK-FAC": 0.35, "K-FAC": 0.3}
    back = load_records(paths["json"])
    assert back[0] == ResultRecord.coerce(_records()[0])
    assert math.isnan(back[-1].value)

    md = paths["markdown"].read_text()
    assert "| Method | Bytes per example | NDCG@20 | Spearman correlation | LDS |" in md
    assert "| EOGP | 24 KB (24576 B) | 0.650 | 0.550 | 0.220 |" in md
    assert "| LDS | K-FAC | 0.300 |" in md


def test_write_report_flat_references_and_extra_metric(tmp_path):
    recs = [{"method": "EOGP", "bytes_per_example": 12 * 1024, "metric": "pearson_1bit_fp16", "value": 0.902}]
    paths = write_report(recs, tmp_path, reference_lines={"ideal": 1.0})
    assert set(paths) == {"json", "markdown", "pearson_1bit_fp16"}
    _assert_png(paths["pearson_1bit_fp16"])
    assert "| EOGP | 12 KB (12288 B) | 0.902 |" in paths["markdown"].read_text()


def test_write_report_mixed_reference_lines_raise(tmp_path):
    with pytest.raises(ConfigError):
        write_report(_records(), tmp_path, reference_lines={"lds": {"EK-FAC": 0.3}, "x": 1.0})
