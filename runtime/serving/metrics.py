"""Prometheus metrics of a serving process: what ``--metrics-port`` exposes.

Imports only ``runtime.link.client_protocol`` (the ops and error types that label the
counters) of the project. Needs ``prometheus-client`` (the ``serve`` extra)
only once a ``ServerMetrics`` is made or a metrics server is started, so importing
this module, and ``NullMetrics``, works without it.

    server I/O thread                     ServerMetrics (thread-safe)         HTTP thread
    message decoded  -> on_request(op)    phyrt_requests_total{op}
    reply sent       -> on_reply(ok,      phyrt_errors_total{type}
                          error_type, s)  phyrt_request_duration_seconds{op}
    housekeeping     -> observe_replicas  replica snapshot            <- GET /metrics (scrape):
                        (or ``replicas=``, a callable read at scrape)     phyrt_replica_inflight{replica}
                                                                          phyrt_replica_healthy{replica}
                                                                          phyrt_replica_restarts{replica}
                                                                          phyrt_replica_restarting{replica}
                                                                          phyrt_plugin_<key>{replica}: each
                                                                          number of the runner's info()
                                                                          phyrt_queue_wait_seconds{replica,
                                                                          priority}, phyrt_batch_size{replica}
                                                                          (runtime.serving.queue_metrics)
                                                                       <- GET /healthz: 200 "ok"
                                                                       <- GET /readyz: 200 while a replica
                                                                          is healthy, else 503 and why

Probes (same port, GET or HEAD): ``/healthz`` answers 200 while the process answers at all
(liveness); ``/readyz`` answers 200 while at least one replica is healthy and 503 otherwise,
its body naming each replica that is down and why (readiness: a replica being rebuilt is
not ready). Any other path is 404.

Label values are bounded: ops other than the protocol's and error types other than
the protocol's are counted as ``other``, so a hostile client cannot grow the label
set. ``on_request`` and ``on_reply`` cost a few microseconds (1.5 and 3 µs on a busy
2-core machine: a lock and an add, plus a bucket search); a scrape holds each lock
only to read a value, so it never stalls the server's I/O thread.
"""

from __future__ import annotations

import re
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from runtime.link.client_protocol import ERROR_TYPES, OPS
from runtime.serving.queue_metrics import queue_families

__all__ = ["ERROR_TYPES", "OPS", "MetricsServer", "NullMetrics", "ReplicaSample", "ServerMetrics",
           "start_metrics_server"]

# OPS and ERROR_TYPES (the protocol's) label the counters; anything else is counted as "other"
#: request durations from 100 µs (a small request on the same host) to a minute (a long generation)
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
_INSTALL = "prometheus-client is needed for metrics: pip install prometheus-client (or phyrt[serve])"


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return prometheus_client


class NullMetrics:
    """The recorder when metrics are off: the same methods, doing nothing; ``on`` False tells
    the request path it may skip calling them (and reading the clock for them)."""

    on = False

    def on_request(self, op: Any) -> None:
        pass

    def on_reply(self, ok: bool, error_type: str | None, seconds: float, *, op: str = "submit") -> None:
        pass

    def observe_replicas(self, statuses: Iterable[Any]) -> None:
        pass


class ServerMetrics:
    """The recorder a server calls, and the registry a metrics server exposes.

    ``replicas``: optional callable returning the replicas' statuses (objects with
    ``index``, ``healthy``, ``inflight`` and optionally ``restarts``, ``restarting``,
    ``error``, like ``Engine.replicas``, or dicts with those keys, like
    ``info()["replicas"]``); it is read at each scrape and probe, on the HTTP thread.
    Without it, the replica gauges and ``/readyz`` use what ``observe_replicas`` was last given.
    """

    def __init__(self, *, replicas: Callable[[], Iterable[Any]] | None = None, registry: Any = None) -> None:
        prom = _prometheus()
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self._replica_source = replicas
        self._replicas: list[ReplicaSample] = []
        self._lock = threading.Lock()  # the replica snapshot
        requests = prom.Counter("phyrt_requests", "Messages received, by op (unparseable or unknown: other).",
                                ["op"], registry=self.registry)
        errors = prom.Counter("phyrt_errors", "Error replies, by error type.", ["type"], registry=self.registry)
        latency = prom.Histogram("phyrt_request_duration_seconds",
                                 "From a request's arrival to its reply being sent, by op.", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        # children made once: label lookups stay off the server's I/O thread, and every
        # series exists (at 0) from the first scrape on
        self._requests = {op: requests.labels(op) for op in (*OPS, "other")}
        self._errors = {kind: errors.labels(kind) for kind in (*ERROR_TYPES, "other")}
        self._latency = {op: latency.labels(op) for op in (*OPS, "other")}
        self.registry.register(_ReplicaCollector(self))

    def on_request(self, op: Any) -> None:
        """A message arrived; ``op`` as the client sent it (None when it could not be read)."""
        self._requests.get(op, self._requests["other"]).inc()

    def on_reply(self, ok: bool, error_type: str | None, seconds: float, *, op: str = "submit") -> None:
        """A reply was sent ``seconds`` after its request arrived; ``error_type`` when not ``ok``."""
        if not ok:
            self._errors.get(error_type, self._errors["other"]).inc()
        self._latency.get(op, self._latency["other"]).observe(max(0.0, seconds))

    def observe_replicas(self, statuses: Iterable[Any]) -> None:
        """Replace the replica snapshot (replicas missing from it disappear from the metrics)."""
        snapshot = [_replica(status) for status in statuses]
        with self._lock:
            self._replicas = snapshot

    def replica_snapshot(self) -> list[ReplicaSample]:
        """The replicas now: read from ``replicas`` if given, else the last ``observe_replicas``."""
        if self._replica_source is not None:
            return [_replica(status) for status in self._replica_source()]
        with self._lock:
            return list(self._replicas)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything, as a scrape would get it."""
        return _prometheus().generate_latest(self.registry)


#: the info keys that become gauges (``phyrt_plugin_<key>``): Prometheus metric-name characters
_METRIC_KEY = re.compile(r"[a-z_][a-z0-9_]{0,63}")


class ReplicaSample(NamedTuple):
    """What the metrics and probes read of one replica's status."""

    index: str  # a label value
    healthy: bool
    inflight: int
    restarts: int
    restarting: bool
    error: str | None
    plugin_info: dict  # the numbers of the runner's info (``ReplicaStatus.plugin_info``)
    queue: dict  # the replica's queue counters (``ReplicaStatus.queue``; empty where none)


def _replica(status: Any) -> ReplicaSample:
    """A status object (``Engine.replicas``) or dict (``info()["replicas"]``); fields added
    later (``restarts``, ``restarting``, ``error``) read as 0, False, None where missing."""

    def get(key: str, default: Any = None) -> Any:
        return status.get(key, default) if isinstance(status, dict) else getattr(status, key, default)

    error = get("error", None)
    info = get("plugin_info", None) or {}
    numbers = {key: float(value) for key, value in info.items() if isinstance(key, str) and _METRIC_KEY.fullmatch(key)
               and isinstance(value, (int, float)) and not isinstance(value, bool)}
    return ReplicaSample(str(int(get("index"))), bool(get("healthy")), int(get("inflight")),
                         int(get("restarts", 0) or 0), bool(get("restarting", False)),
                         None if error is None else str(error), numbers, get("queue", None) or {})


class _ReplicaCollector:
    """Replica gauges built at scrape time, so that a replica gone is a series gone."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []  # no fixed series: do not collect at registration

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily

        inflight = GaugeMetricFamily("phyrt_replica_inflight", "Requests a replica holds now.", labels=["replica"])
        healthy = GaugeMetricFamily("phyrt_replica_healthy", "1 if a replica can serve, else 0.", labels=["replica"])
        restarts = GaugeMetricFamily("phyrt_replica_restarts", "Rebuilds of a replica begun so far.",
                                     labels=["replica"])
        restarting = GaugeMetricFamily("phyrt_replica_restarting", "1 while a replica is being rebuilt, else 0.",
                                       labels=["replica"])
        replicas = self._metrics.replica_snapshot()
        for r in replicas:
            inflight.add_metric([r.index], r.inflight)
            healthy.add_metric([r.index], 1.0 if r.healthy else 0.0)
            restarts.add_metric([r.index], r.restarts)
            restarting.add_metric([r.index], 1.0 if r.restarting else 0.0)
        yield from (inflight, healthy, restarts, restarting)
        plugin: dict[str, Any] = {}
        for r in replicas:
            for key, value in r.plugin_info.items():
                if key not in plugin:
                    plugin[key] = GaugeMetricFamily(f"phyrt_plugin_{key}", f"The plugin runner's info() {key!r} "
                                                    "(rank 0's, as of its last snapshot).", labels=["replica"])
                plugin[key].add_metric([r.index], value)
        yield from plugin.values()
        yield from queue_families((r.index, r.queue) for r in replicas)
        yield GaugeMetricFamily("phyrt_replicas_healthy", "Replicas that can serve now.",
                                value=sum(r.healthy for r in replicas))


def _readiness(replicas: list[ReplicaSample]) -> tuple[bool, str]:
    """Whether any replica is healthy, and a text that says which are down and why."""
    down = [f"replica {r.index}: " + ("being rebuilt" if r.restarting else "down")
            + (f" ({r.error})" if r.error else "") for r in replicas if not r.healthy]
    ready = any(r.healthy for r in replicas)
    head = "ready" if ready else ("not ready: no replica is healthy" if replicas else "not ready: no replica")
    return ready, "\n".join([head, *down]) + "\n"


def _probe_app(metrics: ServerMetrics, scrape: Callable[..., Any]) -> Callable[..., Any]:
    """The WSGI app of a metrics server: /metrics (``scrape``), /healthz, /readyz, else 404."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO") or "/", environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics":
            return scrape(environ, start_response)
        if method not in ("GET", "HEAD"):
            status, body = "405 Method Not Allowed", f"{method} is not served; use GET\n"
        elif path == "/healthz":
            status, body = "200 OK", "ok\n"
        elif path == "/readyz":
            try:
                ready, body = _readiness(metrics.replica_snapshot())
            except Exception as exc:  # the engine's status could not be read: not ready
                ready, body = False, f"not ready: no replica status ({type(exc).__name__}: {exc})\n"
            status = "200 OK" if ready else "503 Service Unavailable"
        else:
            status, body = "404 Not Found", f"no such path: {path} (try /metrics, /healthz or /readyz)\n"
        data = body.encode("utf-8", "replace")
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data))),
                                ("Cache-Control", "no-store")])
        return [] if method == "HEAD" else [data]

    return app


class MetricsServer:
    """An HTTP server answering ``GET /metrics``, ``/healthz`` and ``/readyz`` on its own thread;
    ``close()`` stops it."""

    def __init__(self, metrics: ServerMetrics, httpd: Any) -> None:
        self.metrics = metrics
        self._httpd = httpd
        self.host, self.port = httpd.server_address[:2]
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="phyrt-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()  # returns once serve_forever has
            self._thread.join(10)
        self._httpd.server_close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_metrics_server(port: int, host: str = "127.0.0.1", metrics: ServerMetrics | None = None) -> MetricsServer:
    """Serve ``metrics`` (a new ``ServerMetrics`` if None) on ``http://host:port/metrics``,
    with the probes ``/healthz`` and ``/readyz`` beside it (see the module docstring).

    ``port`` 0 picks a free port (see ``.port``). Loopback by default: pass another
    ``host`` to let other machines scrape. OSError if the port is taken.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty str, got {host!r}")
    prom = _prometheus()
    if metrics is None:
        metrics = ServerMetrics()
    # prometheus_client's own start_http_server returns no handle to stop it before 0.20;
    # the same WSGI app on wsgiref's server works with any version
    server_class = _IPv6Server if ":" in host else _IPv4Server
    app = _probe_app(metrics, prom.make_wsgi_app(metrics.registry))
    httpd = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    return MetricsServer(metrics, httpd)


class _IPv4Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process


class _IPv6Server(_IPv4Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no line on stderr per scrape
        pass
