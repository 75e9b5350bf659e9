"""python -m runtime.launch: start an engine and serve it over ZeroMQ.

    python -m runtime.launch                                   # the policy demo, inline, on the CPU
    python -m runtime.launch --devices 0,1,2,3 --replicas 2    # 2 replicas x 2 ranks (tensor parallel 2)
    python -m runtime.launch --model /path/to/qwen3            # the qwen3 plugin
    python -m runtime.launch --address tcp://127.0.0.1:5555

Progress goes to stderr; once the server is up, exactly one line goes to stdout:

    phyrt ready address=ipc:///tmp/phyrt-serve-x/phyrt.sock mode=local replicas=2 ranks_per_replica=2 device=cpu dtype=float32 backend=gloo plugin=policy pid=123

Then run a client in another terminal: ``python examples/client_call.py --address ADDRESS``.

Addresses. The default is an ipc:// socket in a fresh owner-only directory (removed
at exit; one left by a server killed with SIGKILL goes at the next server's start). A given ipc:// path must be in a directory of this user with mode 0700.
tcp://HOST:PORT binds exactly HOST (127.0.0.1 when HOST is empty); any interface
other than loopback needs a CURVE secret key (--curve-secret-key; the public key is
derived from it) and is refused without one. Make a pair with
``python -c "import zmq.auth; zmq.auth.create_certificates('.', 'server')"``: it writes
server.key (public, for the clients) and server.key_secret (for --curve-secret-key).

Signals. SIGINT or SIGTERM: stop accepting (new requests get EngineUnavailable),
let in-flight requests finish for up to --drain-timeout-s, close the engine and its
ranks, remove the socket file and every segment, exit 0. A second signal skips the
drain. During the start, either signal abandons it within seconds: the ranks started
so far are stopped, nothing is left, exit 0. Ranks never get the terminal's Ctrl-C
themselves; this process stops them in order.

Failures. A local replica whose rank fails is down (its requests fail at once with
EngineUnavailable); --replica-restarts N rebuilds it in the background up to N times.
When no replica can serve any more (every one failed and none is being rebuilt), the
server logs each replica's cause, stops accepting, lets in-flight requests finish,
cleans up as for SIGTERM and exits 3, so that a process manager restarts it;
--keep-serving-unhealthy stays up instead, answering EngineUnavailable.
--metrics-port also serves the probes /healthz (200 while the process serves) and
/readyz (200 while a replica is healthy, else 503 and why).

openpi clients. --openpi-port PORT also serves the engine over openpi's websocket policy
protocol (``runtime.serving.openpi``; the ready line gains openpi=ws://HOST:PORT). It
binds --openpi-host (127.0.0.1); any other interface needs --openpi-api-key and is refused
without one (exit status 1), since that protocol has no encryption. It stops, drains and
closes with the ZeroMQ server, before the engine closes.

Devices and dtype. --devices entries are checked against the CUDA devices torch sees before
anything starts (``runtime.serving.plan``): asking for more exits 2 with one line. --dtype auto
is float32 on the CPU and, on CUDA, the checkpoint's dtype for --model, else bfloat16; the
ready line and ``info()`` name the dtype chosen.

Exit status: 0 after a requested stop (SIGINT or SIGTERM, during the start or after),
1 start-up failure (the cause on stderr), 2 bad arguments (one line on stderr: an option
argparse refuses, an unknown plugin or arguments it refuses, a layout the visible devices
cannot hold, a dtype the device cannot run), 3 no replica can serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

from runtime.core.heap import freeze_startup_heap
from runtime.core.signals import SignalRelay
from runtime.serving.cli import build_parser
from runtime.serving.plan import BadArguments, build_engine_config, check_plugin
from runtime.transport.owners import make_serve_dir, sweep_serve_dirs

log = logging.getLogger("phyrt.launch")


#: exit statuses of main()
EXIT_STOPPED, EXIT_START_FAILED, EXIT_BAD_ARGUMENTS, EXIT_CANNOT_SERVE = 0, 1, 2, 3
#: how often the main thread checks that the engine can still serve
WATCH_PERIOD_S = 0.2


class _Front:
    """What clients reach: the ZeroMQ server, the openpi door (--openpi-port) and the metrics
    endpoint (--metrics-port), each None until it is up; they stop and close together."""

    def __init__(self) -> None:
        self.server: Any = None
        self.door: Any = None
        self.metrics_http: Any = None

    @property
    def inflight(self) -> int:
        return self.server.inflight + (self.door.inflight if self.door is not None else 0)

    def stop_accepting(self) -> None:
        if self.door is not None:
            self.door.stop_accepting()
        self.server.stop_accepting()

    def skip_drain(self) -> None:
        if self.door is not None:
            self.door.skip_drain()
        self.server.skip_drain()

    def close(self, engine: Any, drain_timeout_s: float) -> None:
        """Drain both doors within ``drain_timeout_s`` in all, close the door, then the server and its
        engine (``engine`` alone if no server took it), then the metrics endpoint."""
        deadline = time.monotonic() + drain_timeout_s
        try:
            if self.door is not None:
                self.door.close(drain_timeout_s)
        finally:
            try:
                if self.server is not None:
                    self.server.close(max(0.0, deadline - time.monotonic()))
                elif engine is not None:
                    engine.close()
            finally:
                if self.metrics_http is not None:
                    self.metrics_http.close()


class _Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while the engine was starting. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way mistakes it for a failure."""


# --------------------------------------------------------------------------- configuration


def resolve_address(address: str | None) -> tuple[str, str | None]:
    """The address to bind, and the private directory made for it (None if the user chose)."""
    sweep_serve_dirs()  # socket directories of servers killed with SIGKILL
    if address is not None:
        if address.startswith("tcp://") and address[len("tcp://"):].startswith(":"):
            address = "tcp://127.0.0.1" + address[len("tcp://"):]
        return address, None
    private = make_serve_dir()  # mode 0700, named phyrt-serve-{pid}-: a later start can tell it is left over
    return f"ipc://{private}/phyrt.sock", private


def curve_keys(opts: argparse.Namespace) -> Any:
    if opts.curve_secret_key is None:
        if opts.curve_public_key is not None or opts.curve_authorized_clients is not None:
            raise ValueError("CURVE needs --curve-secret-key")
        return None
    import zmq

    from runtime.transport.endpoints import CurveKeys, load_key

    secret = load_key(opts.curve_secret_key, secret=True)
    public = load_key(opts.curve_public_key, secret=False) or zmq.curve_public(secret)
    if zmq.curve_public(secret) != public:
        raise ValueError("--curve-public-key does not belong to --curve-secret-key")
    if opts.curve_authorized_clients is not None and not os.path.isdir(opts.curve_authorized_clients):
        raise ValueError(f"--curve-authorized-clients {opts.curve_authorized_clients} is not a directory")
    return CurveKeys(public, secret, opts.curve_authorized_clients)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the server until a signal stops it (0) or no replica can serve (3); see the module docstring."""
    opts = build_parser().parse_args(argv)
    _configure_logging(opts.log_level)
    _on_signals(_interrupt_start)
    private_dir = engine = None
    front = _Front()
    started = time.monotonic()
    try:
        args, deployment = build_engine_config(opts)
        check_plugin(args)
        address, private_dir = resolve_address(opts.address)
        from runtime.transport.endpoints import check_address

        curve = curve_keys(opts)
        check_address(address, curve is not None)  # before minutes of start-up, not after
        openpi_key = _check_openpi(opts)
        _log_plan(args, deployment)
        from runtime.engine import Engine

        engine = served = Engine(args, deployment)
        topology = _topology(engine)
        log.info("engine ready in %.1f s; binding %s", time.monotonic() - started, address)
        _open_front(front, opts, engine, (address, curve), topology)
        engine = None  # the server owns it now
        stop = threading.Event()
        SignalRelay(_stop_handler(front, stop))  # not in the handler itself: see runtime.core.signals
        front.server.start()
        front.door = _start_openpi(opts, served, openpi_key)
    except BadArguments as exc:
        print(f"{build_parser().prog}: error: {exc}", file=sys.stderr, flush=True)
        _cleanup(engine, front, private_dir, 0.0)
        return EXIT_BAD_ARGUMENTS
    except _Interrupted as exc:
        log.info("%s while starting: stopping the start", exc)
        _cleanup(engine, front, private_dir, 0.0)
        log.info("stopped")
        return EXIT_STOPPED
    except Exception as exc:
        _on_signals(_noted_while_stopping)  # the cleanup below is not to be cut short
        log.error("startup failed: %s: %s", type(exc).__name__, exc)
        log.debug("startup failure in detail", exc_info=True)
        _cleanup(engine, front, private_dir, 0.0)
        return EXIT_START_FAILED

    freeze_startup_heap()  # built: one full collection now, before the ready line, not under the first requests
    _print_ready(front, topology)
    code = _serve_until_stopped(front, served, stop, opts.keep_serving_unhealthy)
    log.info("stopping: %d request(s) in flight, draining for up to %.1f s", front.inflight, opts.drain_timeout_s)
    _cleanup(None, front, private_dir, opts.drain_timeout_s)
    log.info("stopped" if code == EXIT_STOPPED else f"stopped: no replica could serve (exit status {code})")
    return code


def _open_front(front: _Front, opts: argparse.Namespace, engine: Any, where: tuple[str, Any],
                topology: dict[str, Any]) -> None:
    """The metrics endpoint and the ``Server`` over ``engine`` at ``where`` (address, CURVE keys), not
    started yet: the stop signals are taken over first."""
    from runtime.serving.server import Server

    front.metrics_http = _start_metrics(opts, engine)
    metrics = front.metrics_http.metrics if front.metrics_http is not None else None
    front.server = Server(engine, where[0], max_inflight=opts.max_inflight, max_message_bytes=opts.max_message_bytes,
                          curve=where[1], metrics=metrics, info={k: topology[k] for k in ("device", "dtype", "backend")})


def _serve_until_stopped(front: _Front, engine: Any, stop: threading.Event, keep_serving_unhealthy: bool) -> int:
    """Wait until a signal sets ``stop`` (0), or until ``engine`` can no longer serve (3: new
    requests are refused from then on); with ``keep_serving_unhealthy``, only say so and wait on."""
    serving = True
    while not stop.wait(WATCH_PERIOD_S):
        if engine.can_serve == serving:
            continue
        serving = not serving
        if serving:
            log.warning("a replica serves again")
            continue
        causes = "; ".join(f"replica {r.index}: {r.error or 'unavailable'}" for r in engine.replicas)
        if keep_serving_unhealthy:
            log.error("no replica can serve (%s); staying up as --keep-serving-unhealthy asks: requests get "
                      "EngineUnavailable", causes)
            continue
        if stop.is_set():  # a signal came meanwhile: that stop was asked for
            return EXIT_STOPPED
        log.error("no replica can serve (%s); stopping with exit status %d", causes, EXIT_CANNOT_SERVE)
        front.stop_accepting()
        stop.set()  # a signal from now on skips the drain
        return EXIT_CANNOT_SERVE
    return EXIT_STOPPED


def _on_signals(handler: Any) -> None:
    """``handler`` for both SIGINT and SIGTERM."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _interrupt_start(signum: int, frame: Any) -> None:
    """During the start: abandon it (the main thread unwinds from wherever it waits)."""
    _on_signals(_noted_while_stopping)  # once: the cleanup that follows must run to its end
    raise _Interrupted(signal.Signals(signum).name)


def _noted_while_stopping(signum: int, frame: Any) -> None:
    log.warning("%s: already stopping", signal.Signals(signum).name)


def _configure_logging(level: str) -> None:
    """phyrt's own loggers at ``level``; other libraries' only from WARNING."""
    logging.basicConfig(level=max(logging.WARNING, getattr(logging, level.upper())), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("phyrt").setLevel(level.upper())


def _start_metrics(opts: argparse.Namespace, engine: Any) -> Any:
    """The Prometheus endpoint when ``--metrics-port`` asks for one (else None)."""
    if opts.metrics_port is None:
        return None
    from runtime.serving.metrics import ServerMetrics, start_metrics_server

    metrics_http = start_metrics_server(opts.metrics_port, opts.metrics_host,
                                        ServerMetrics(replicas=lambda: engine.replicas))
    log.info("metrics on %s", metrics_http.url)
    return metrics_http


def _check_openpi(opts: argparse.Namespace) -> str | None:
    """The openpi door's API key, once its host is known to be allowed (before the engine starts)."""
    if opts.openpi_port is None:
        if opts.openpi_api_key is not None or opts.openpi_host != "127.0.0.1" or opts.openpi_no_batch_dim:
            raise ValueError("--openpi-host, --openpi-api-key and --openpi-no-batch-dim need --openpi-port")
        return None
    from runtime.serving.openpi import check_openpi_host, load_api_key

    key = load_api_key(opts.openpi_api_key)
    check_openpi_host(opts.openpi_host, key)
    return key


def _start_openpi(opts: argparse.Namespace, engine: Any, api_key: str | None) -> Any:
    """The openpi door when ``--openpi-port`` asks for one (else None), serving ``engine``."""
    if opts.openpi_port is None:
        return None
    from runtime.serving.openpi import OpenpiDoor

    return OpenpiDoor(engine, opts.openpi_host, opts.openpi_port, api_key=api_key,
                      batch_dim=not opts.openpi_no_batch_dim, max_message_bytes=opts.max_message_bytes,
                      max_inflight=opts.max_inflight).start()


def _print_ready(front: _Front, topology: dict[str, Any]) -> None:
    """The one line on stdout that says the server is up, and where."""
    fields = {"address": front.server.address, **{k: topology[k] for k in
              ("mode", "replicas", "ranks_per_replica", "device", "dtype", "backend", "plugin")}, "pid": os.getpid()}
    if front.metrics_http is not None:
        fields["metrics"] = front.metrics_http.url
    if front.door is not None:
        fields["openpi"] = front.door.url
    print("phyrt ready " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def _stop_handler(front: _Front, stop: threading.Event) -> Any:
    def handle(signum: int) -> None:
        if stop.is_set():  # a second signal: no more waiting
            log.warning("%s again: not waiting for in-flight requests", signal.Signals(signum).name)
            front.skip_drain()
            return
        log.info("%s received", signal.Signals(signum).name)
        front.stop_accepting()
        stop.set()

    return handle


def _cleanup(engine: Any, front: _Front, private_dir: str | None, drain_timeout_s: float) -> None:
    try:
        front.close(engine, drain_timeout_s)
    finally:
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


def _log_plan(args: Any, deployment: Any) -> str:
    """Say what is about to start; returns the mode."""
    ranks = args.config.parallel.infer_replica_world_size()
    mode = deployment.resolve_mode(ranks)
    target = args.config.device.resolve_target()
    log.info("plugin %s, %s mode: %d replica(s) x %d rank(s), device %s", args.plugin, mode,
             deployment.replica_count, ranks, target)
    if mode == "local" and target == "cpu":
        note = "no CUDA device: " if args.config.device.target == "auto" else ""
        log.info("%srunning %d CPU ranks with gloo (tensor parallel %d per replica); starting them ...", note,
                 deployment.replica_count * ranks, ranks)
    elif mode == "local":
        log.info("starting %d CUDA ranks with NCCL on devices %s ...", deployment.replica_count * ranks,
                 list(deployment.devices or range(deployment.replica_count * ranks)))
    else:
        log.info("building the plugin in this process ...")
    return mode


def _topology(engine: Any) -> dict[str, Any]:
    from runtime.core.config import dtype_name

    target = engine.args.config.device.resolve_target()
    backend = "none" if engine.mode == "inline" else ("nccl" if target == "cuda" else "gloo")
    return {"mode": engine.mode, "replicas": len(engine.replicas), "ranks_per_replica": engine.ranks_per_replica,
            "device": target, "dtype": dtype_name(engine.args.config.device.params_dtype), "backend": backend,
            "plugin": engine.args.plugin}


if __name__ == "__main__":
    sys.exit(main())
