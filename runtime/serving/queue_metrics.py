"""The replicas' queue on the metrics page: waits by priority and batch sizes.

Built at scrape time from each replica's ``ReplicaStatus.queue`` (``runtime.core.queue_stats``
``QueueStats.snapshot``), beside the replica gauges of ``runtime.serving.metrics``:

    phyrt_queue_wait_seconds{replica, priority}   histogram: from submission until the request's
                                                  batch went to the runner (priority labels are
                                                  bounded: the first 16 levels, then "other")
    phyrt_batch_size{replica}                     histogram: requests per batch the runner got
"""

from __future__ import annotations

from typing import Any, Iterable

from runtime.core.queue_stats import SIZE_BUCKETS, WAIT_BUCKETS


def queue_families(samples: Iterable[tuple[str, dict]]) -> Iterable[Any]:
    """Histogram families for ``(replica label, queue snapshot)`` pairs (a snapshot may be empty)."""
    from prometheus_client.core import HistogramMetricFamily

    waits = HistogramMetricFamily("phyrt_queue_wait_seconds", "From submission until the request's batch went "
                                  "to the runner, by priority.", labels=["replica", "priority"])
    sizes = HistogramMetricFamily("phyrt_batch_size", "Requests per batch the runner got.", labels=["replica"])
    for replica, queue in samples:
        for priority, level in sorted(queue.get("levels", {}).items()):
            waits.add_metric([replica, priority], _cumulative(WAIT_BUCKETS, level["wait_buckets"]),
                             level["wait_sum_s"])
        if "batch_size_buckets" in queue:
            sizes.add_metric([replica], _cumulative(SIZE_BUCKETS, queue["batch_size_buckets"]),
                             float(queue.get("batched", 0)))
    return waits, sizes


def _cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus buckets (``le`` bound, count up to it) from per-bucket counts (the last past the bounds)."""
    total, buckets = 0, []
    for bound, count in zip(bounds, counts):
        total += count
        buckets.append((repr(float(bound)), float(total)))
    buckets.append(("+Inf", float(sum(counts))))
    return buckets
