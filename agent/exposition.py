"""The Prometheus text exposition format (version 0.0.4), written with the standard library.

The agent runs inside a user's image, which holds torch and nothing of ours, so
its ``/metrics`` cannot use ``prometheus_client``. This module is the small part
of that library the agent needs: metric families (counter, gauge, histogram)
built by pure functions, and :func:`render`, which writes them as the text a
Prometheus server scrapes (``# HELP``/``# TYPE`` lines, escaped label values,
cumulative ``_bucket`` series with ``le`` and ``+Inf``, ``_sum`` and ``_count``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CONTENT_TYPE",
    "Family",
    "MetricType",
    "Sample",
    "counter",
    "gauge",
    "histogram",
    "render",
]

#: The Content-Type a Prometheus server expects for this format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricType(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Sample:
    """One line: the series name (the family's name plus a suffix such as ``_bucket``), labels, value."""

    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """A metric family: its name, type, help text and samples (possibly none)."""

    name: str
    type: MetricType
    help: str
    samples: tuple[Sample, ...] = ()


def counter(name: str, help: str, values: Mapping[tuple[tuple[str, str], ...], float] | float) -> Family:
    """A counter; ``name`` ends in ``_total``. ``values`` is one number or a map of label tuples to numbers."""
    if not name.endswith("_total"):
        raise ValueError(f"a counter's name must end in _total, got {name!r}")
    return Family(name, MetricType.COUNTER, help, _samples(name, values))


def gauge(name: str, help: str, values: Mapping[tuple[tuple[str, str], ...], float] | float | None) -> Family:
    """A gauge; ``None`` gives a family without samples (the value is not known yet)."""
    return Family(name, MetricType.GAUGE, help, () if values is None else _samples(name, values))


def histogram(
    name: str,
    help: str,
    observations: Mapping[tuple[tuple[str, str], ...], Sequence[float]] | Sequence[float],
    buckets: Sequence[float],
) -> Family:
    """A histogram of ``observations`` (per label tuple, or one unlabelled list) over ``buckets``."""
    bounds = sorted(float(b) for b in buckets if not math.isinf(b))
    per_labels = observations if isinstance(observations, Mapping) else {(): observations}
    samples: list[Sample] = []
    for label_items, values in per_labels.items():
        labels = dict(label_items)
        for bound in bounds:
            count = sum(1 for v in values if v <= bound)
            # le as prometheus_client writes it ("1.0", not "1"), so both agree series by series
            samples.append(Sample(f"{name}_bucket", count, {**labels, "le": repr(bound)}))
        samples.append(Sample(f"{name}_bucket", len(values), {**labels, "le": "+Inf"}))
        samples.append(Sample(f"{name}_sum", float(sum(values)), labels))
        samples.append(Sample(f"{name}_count", len(values), labels))
    return Family(name, MetricType.HISTOGRAM, help, tuple(samples))


def _samples(name: str, values: Mapping[tuple[tuple[str, str], ...], float] | float) -> tuple[Sample, ...]:
    if isinstance(values, Mapping):
        return tuple(Sample(name, float(v), dict(k)) for k, v in values.items())
    return (Sample(name, float(values)),)


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _line(sample: Sample) -> str:
    if sample.labels:
        inner = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in sample.labels.items())
        return f"{sample.name}{{{inner}}} {_number(sample.value)}"
    return f"{sample.name} {_number(sample.value)}"


def render(families: Iterable[Family]) -> str:
    """The exposition text of ``families``, in order, ending with a newline."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type.value}")
        lines.extend(_line(s) for s in family.samples)
    return "\n".join(lines) + "\n"
