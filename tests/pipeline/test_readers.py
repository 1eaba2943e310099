"""Work units split inputs without losing or repeating a document, whatever the unit size."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common import UserError
from pipeline.readers import RejectCounter, discover_inputs, plan_units, unit_texts


def _all_texts(units):
    rejected = RejectCounter()
    texts = [t for unit in units for t in unit_texts(unit, "text", 1_000_000, rejected)]
    return texts, rejected


@pytest.mark.parametrize("unit_bytes", [1024, 1500, 4096, 1 << 20])
def test_line_aligned_byte_ranges_cover_every_line_once(tmp_path, unit_bytes):
    docs = [f"document {i} " + "word " * (i % 37) for i in range(300)]
    body = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    (tmp_path / "c.jsonl").write_text(body)
    units = plan_units(discover_inputs([str(tmp_path / "c.jsonl")]), unit_bytes)
    assert len(units) == -(-len(body.encode()) // unit_bytes)
    texts, rejected = _all_texts(units)
    assert texts == docs and sum(rejected.values()) == 0


def test_parquet_row_groups_become_units(tmp_path):
    docs = [f"row {i} " + "x" * (i % 50) for i in range(200)]
    pq.write_table(pa.table({"text": docs, "n": list(range(200))}), tmp_path / "c.parquet", row_group_size=20)
    units = plan_units(discover_inputs([str(tmp_path)]), unit_bytes=1024)
    assert len(units) > 1 and units[0].start == 0 and units[-1].end == 10
    assert _all_texts(units)[0] == docs
    with pytest.raises(UserError, match="no column 'body'"):
        list(unit_texts(units[0], "body", 100, RejectCounter()))


def test_globs_directories_and_sorting(tmp_path):
    for name in ("b.jsonl", "a.jsonl.gz", "sub/c.txt", "notes.csv"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = [i.path for i in discover_inputs([str(tmp_path)])]
    assert [p.rsplit("/", 1)[-1] for p in found] == ["a.jsonl.gz", "b.jsonl", "c.txt"]
    assert len(discover_inputs([str(tmp_path / "*.jsonl")])) == 1
    with pytest.raises(UserError, match="input not found"):
        discover_inputs([str(tmp_path / "*.parquet")])
