"""One output record (gateway.core.records.OutputRecord) read from the outputs hash field the
output scripts write, and the wire models built from it in one place
(gateway.http.job_state_models)."""

from __future__ import annotations

import json

import pytest

from gateway.core.records import DEFAULT_TYPE, OutputRecord
from gateway.http.job_state_models import output_out, output_record_out

pytestmark = pytest.mark.fast

# the fields output-stage-3 writes, then output-record-3 adds (gateway/store/lua)
STAGED = {
    "state": "staged", "key": "t/j/g3/report.csv", "size": 0, "sha256": "",
    "content_type": "text/csv", "staged_ms": 1_700_000_000_000, "presigned": False,
    "upload": "u-1", "deadline": 1_700_000_060_000, "worker_id": "w-1",
}  # fmt: skip
RECORDED = {
    **STAGED, "state": "recorded", "size": 12, "sha256": "ab" * 32, "etag": "e-1",
    "recorded_ms": 1_700_000_001_000,
}  # fmt: skip


def test_a_staged_then_recorded_field_reads_as_one_record() -> None:
    staged = OutputRecord.parse("3/report.csv", json.dumps(STAGED))
    assert (staged.generation, staged.name, staged.state) == (3, "report.csv", "staged")
    assert (staged.size, staged.sha256, staged.recorded_ms) == (0, "", 0)
    assert staged.at_ms == STAGED["staged_ms"] and staged.deadline_ms == STAGED["deadline"]
    recorded = OutputRecord.parse("3/report.csv", json.dumps(RECORDED))
    assert (recorded.state, recorded.size, recorded.etag) == ("recorded", 12, "e-1")
    assert recorded.at_ms == RECORDED["recorded_ms"]
    assert (recorded.upload, recorded.worker_id) == ("u-1", "w-1")


def test_a_missing_field_reads_as_its_zero_value_and_the_default_media_type() -> None:
    record = OutputRecord.parse("1/a.bin", json.dumps({"state": "staged", "key": "t/j/g1/a.bin"}))
    assert (record.size, record.sha256, record.etag, record.presigned) == (0, "", "", False)
    assert record.content_type == DEFAULT_TYPE and record.at_ms is None


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", json.dumps({"size": [1]})])
def test_a_field_that_is_no_output_record_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match=r"output record '1/a\.bin'"):
        OutputRecord.parse("1/a.bin", raw)


def test_the_upload_answer_and_the_job_view_row_show_the_same_record() -> None:
    record = OutputRecord.parse("3/report.csv", json.dumps(RECORDED))
    upload = output_out("j", record).model_dump()
    row = output_record_out(record, promoted=True).model_dump()
    shared = ("name", "generation", "state", "key", "size", "sha256", "content_type")
    assert {f: upload[f] for f in shared} == {f: row[f] for f in shared}
    assert upload["recorded_at"] == row["at"] and upload["staged_at"] is not None
    assert upload["job_id"] == "j" and row["promoted"] is True
