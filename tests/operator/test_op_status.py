"""The typed job status (kelastic.operator.status.JobStatus): the CRD's fields, read and written back unchanged."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from kelastic.operator.status import JobStatus

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "elasticjob.yaml"


def crd_status_keys() -> set[str]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return set(schema["properties"]["status"]["properties"])


def test_one_field_per_status_key_of_the_crd() -> None:
    keys = set(JobStatus().to_dict()) | set(
        JobStatus(**{f.name: 0 for f in fields(JobStatus) if f.name != "extra"}).to_dict()
    )
    assert keys == crd_status_keys()


def test_a_field_reads_and_writes_its_camel_case_key() -> None:
    status = JobStatus.from_dict({"belowMinSince": "2026-01-01T12:00:00Z", "scaledTo": 3, "other": {"x": 1}})
    assert status.below_min_since == "2026-01-01T12:00:00Z" and status.scaled_to == 3
    assert status.extra == {"other": {"x": 1}}
    status.below_min_since = None  # None: the key goes
    status.backoff_count = 2
    assert status.to_dict() == {"scaledTo": 3, "other": {"x": 1}, "backoffCount": 2}


values = st.one_of(st.integers(), st.text(max_size=5), st.lists(st.text(max_size=3), max_size=2))
keys = st.one_of(st.sampled_from(sorted(crd_status_keys())), st.text(min_size=1, max_size=8))


@given(st.dictionaries(keys, values, max_size=12))
def test_a_status_read_and_written_back_is_unchanged(stored: dict[str, Any]) -> None:
    assert JobStatus.from_dict(stored).to_dict() == stored
