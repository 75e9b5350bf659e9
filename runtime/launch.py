"""python -m runtime.launch: start an engine and serve it over ZeroMQ.

    python -m runtime.launch                                   # the policy demo, inline, on the CPU
    python -m runtime.launch --devices 0,1,2,3 --replicas 2    # 2 replicas x 2 ranks (tensor parallel 2)
    python -m runtime.launch --model /path/to/qwen3            # the qwen3 plugin
    python -m runtime.launch --address tcp://127.0.0.1:5555

Progress goes to stderr; once the server is up, exactly one line goes to stdout:

    phyrt ready address=ipc:///tmp/phyrt-serve-x/phyrt.sock mode=local replicas=2 ranks_per_replica=2 device=cpu backend=gloo plugin=policy pid=123

Then run a client in another terminal: ``python examples/client_call.py --address ADDRESS``.

Addresses. The default is an ipc:// socket in a fresh owner-only directory (removed
at exit). A given ipc:// path must be in a directory of this user with mode 0700.
tcp://HOST:PORT binds exactly HOST (127.0.0.1 when HOST is empty); any interface
other than loopback needs CURVE keys (--curve-secret-key, --curve-public-key; make a
pair with ``python -c "import zmq.auth; zmq.auth.create_certificates('.', 'server')"``)
and is refused without them.

Signals. SIGINT or SIGTERM: stop accepting (new requests get EngineUnavailable),
let in-flight requests finish for up to --drain-timeout-s, close the engine and its
ranks, remove the socket file and every segment, exit 0. A second signal skips the
drain. A failure to start exits 1 with the cause on stderr (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

log = logging.getLogger("phyrt.launch")


class _Interrupted(Exception):
    """SIGTERM (or SIGINT) arrived while the engine was starting."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.launch", description=__doc__.split("\n\n")[0],
        epilog="Without arguments: the 'policy' demo plugin, inline, on the CPU, on a private ipc:// socket.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = parser.add_argument_group("what to serve")
    what.add_argument("--plugin", default="policy",
                      help="a registered plugin name, an entry point, or 'package.module:EntryClass'")
    what.add_argument("--plugin-args", type=_json, default=None, metavar="JSON",
                      help='the plugin\'s arguments as JSON, e.g. \'{"obs_dim": 32}\'')
    what.add_argument("--model", metavar="DIR", default=None,
                      help='shorthand for --plugin qwen3 with {"model": DIR} added to --plugin-args')
    where = parser.add_argument_group("where it runs")
    where.add_argument("--devices", type=_devices, default=None, metavar="0,1,2,3",
                       help="device entries (CUDA indices, or CPU rank slots); implies local ranks")
    where.add_argument("--replicas", type=_positive_int, default=1,
                       help="replicas; each gets len(devices)/replicas ranks, tensor parallel over them")
    where.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="auto: cuda when torch sees a GPU, else the CPU with gloo")
    where.add_argument("--base-port", type=_positive_int, default=29500,
                       help="replica i's ranks rendezvous on 127.0.0.1:base_port+i")
    where.add_argument("--execution-timeout-s", type=_seconds, default=None,
                       help="a local replica whose request runs longer is failed (default: no limit)")
    where.add_argument("--heartbeat-interval-s", type=_seconds, default=0.5, help="rank heartbeat period")
    where.add_argument("--heartbeat-timeout-s", type=_seconds, default=10.0,
                       help="a rank silent this long fails its replica")
    where.add_argument("--startup-timeout-s", type=_seconds, default=300.0, help="every rank must be ready by then")
    serve = parser.add_argument_group("serving")
    serve.add_argument("--address", default=None,
                       help="ipc:///path/in/a/0700/dir or tcp://HOST:PORT (default: ipc:// in a new private dir)")
    serve.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; needs "
                            "prometheus-client, pip install 'phyrt[serve]')")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="interface of the metrics endpoint")
    serve.add_argument("--max-inflight", type=_positive_int, default=256,
                       help="requests the engine may hold; beyond, requests get Overloaded at once")
    serve.add_argument("--max-message-bytes", type=_positive_int, default=64 << 20,
                       help="larger messages are dropped and their sender disconnected")
    serve.add_argument("--drain-timeout-s", type=_seconds, default=10.0,
                       help="on SIGINT/SIGTERM, how long in-flight requests may still finish")
    serve.add_argument("--curve-secret-key", default=None, metavar="KEY_OR_FILE",
                       help="the server's CURVE secret key (z85) or a zmq.auth .key_secret file")
    serve.add_argument("--curve-public-key", default=None, metavar="KEY_OR_FILE",
                       help="the server's CURVE public key (z85) or .key file (default: derived from the secret)")
    serve.add_argument("--curve-authorized-clients", default=None, metavar="DIR",
                       help="only clients whose public .key files are in DIR (default: any client with the "
                            "server's public key)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None


def _devices(text: str) -> tuple[int, ...]:
    try:
        devices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated device indices like 0,1,2,3, got {text!r}") from None
    if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise argparse.ArgumentTypeError(f"device indices must be distinct and >= 0, got {text!r}")
    return devices


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


# --------------------------------------------------------------------------- configuration


def plugin_and_args(opts: argparse.Namespace) -> tuple[str, Any]:
    if opts.model is None:
        return opts.plugin, opts.plugin_args
    if opts.plugin != "policy":
        raise ValueError(f"--model is shorthand for --plugin qwen3; it cannot go with --plugin {opts.plugin}")
    if opts.plugin_args is not None and not isinstance(opts.plugin_args, dict):
        raise ValueError("--plugin-args must be a JSON object when --model is given")
    return "qwen3", {**(opts.plugin_args or {}), "model": opts.model}


def build_engine_config(opts: argparse.Namespace) -> tuple[Any, Any]:
    """EngineArgs and DeploymentConfig from the command line (ValueError for a bad combination)."""
    from runtime.core.config import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                                EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

    plugin, plugin_args = plugin_and_args(opts)
    slots = len(opts.devices) if opts.devices is not None else opts.replicas
    if slots % opts.replicas:
        raise ValueError(f"--devices has {slots} entries, which {opts.replicas} replicas cannot share evenly")
    tp = slots // opts.replicas
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
    args = EngineArgs(plugin, plugin_args, EngineConfig(device=DeviceConfig(target=opts.device), parallel=parallel))
    deployment = DeploymentConfig(
        replica_count=opts.replicas, devices=opts.devices,
        process_config=WorkerSupervisorConfig(
            base_port=opts.base_port, execution_timeout_s=opts.execution_timeout_s,
            heartbeat_interval_s=opts.heartbeat_interval_s, heartbeat_timeout_s=opts.heartbeat_timeout_s,
            startup_timeout_s=opts.startup_timeout_s))
    return args, deployment


def resolve_address(address: str | None) -> tuple[str, str | None]:
    """The address to bind, and the private directory made for it (None if the user chose)."""
    if address is not None:
        if address.startswith("tcp://") and address[len("tcp://"):].startswith(":"):
            address = "tcp://127.0.0.1" + address[len("tcp://"):]
        return address, None
    private = tempfile.mkdtemp(prefix="phyrt-serve-")  # mode 0700
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
    opts = build_parser().parse_args(argv)
    _configure_logging(opts.log_level)
    stop = threading.Event()

    def interrupt_start(signum: int, frame: Any) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt_start)
    signal.signal(signal.SIGINT, interrupt_start)
    private_dir = engine = server = metrics_http = None
    started = time.monotonic()
    try:
        address, private_dir = resolve_address(opts.address)
        from runtime.transport.endpoints import check_address

        curve = curve_keys(opts)
        check_address(address, curve is not None)  # before minutes of start-up, not after
        args, deployment = build_engine_config(opts)
        if _log_plan(args, deployment) == "local":
            # Ranks spawned now inherit an ignored SIGINT (SIG_IGN survives exec; a handler
            # does not), so that a Ctrl-C in the terminal, which signals the whole process
            # group, reaches only this process, which then drains and stops the ranks in order.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            log.info("Ctrl-C takes effect once the ranks are up; SIGTERM stops the start")
        from runtime.engine import Engine

        engine = Engine(args, deployment)
        from runtime.serving.server import Server

        topology = _topology(engine)
        log.info("engine ready in %.1f s; binding %s", time.monotonic() - started, address)
        metrics_http = _start_metrics(opts, engine)
        metrics = metrics_http.metrics if metrics_http is not None else None
        server = Server(engine, address, max_inflight=opts.max_inflight, max_message_bytes=opts.max_message_bytes,
                        curve=curve, info={"device": topology["device"], "backend": topology["backend"]},
                        metrics=metrics)
        engine = None  # the server owns it now
        handler = _stop_handler(server, stop)
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        server.start()
    except _Interrupted as exc:
        log.info("%s while starting: stopped", exc)
        _cleanup(engine, server, private_dir, 0.0, metrics_http)
        return 0
    except Exception as exc:
        log.error("startup failed: %s: %s", type(exc).__name__, exc)
        log.debug("startup failure in detail", exc_info=True)
        _cleanup(engine, server, private_dir, 0.0, metrics_http)
        return 1

    _print_ready(server, topology, metrics_http)
    stop.wait()
    log.info("stopping: %d request(s) in flight, draining for up to %.1f s", server.inflight, opts.drain_timeout_s)
    _cleanup(None, server, private_dir, opts.drain_timeout_s, metrics_http)
    log.info("stopped")
    return 0


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


def _print_ready(server: Any, topology: dict[str, Any], metrics_http: Any) -> None:
    """The one line on stdout that says the server is up, and where."""
    fields = {"address": server.address, **{k: topology[k] for k in
              ("mode", "replicas", "ranks_per_replica", "device", "backend", "plugin")}, "pid": os.getpid()}
    if metrics_http is not None:
        fields["metrics"] = metrics_http.url
    print("phyrt ready " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def _stop_handler(server: Any, stop: threading.Event) -> Any:
    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():  # a second signal: no more waiting
            log.warning("%s again: not waiting for in-flight requests", signal.Signals(signum).name)
            server.skip_drain()
            return
        log.info("%s received", signal.Signals(signum).name)
        server.stop_accepting()
        stop.set()

    return handle


def _cleanup(engine: Any, server: Any, private_dir: str | None, drain_timeout_s: float,
             metrics_http: Any = None) -> None:
    try:
        if server is not None:
            server.close(drain_timeout_s)
        elif engine is not None:
            engine.close()
    finally:
        if metrics_http is not None:
            metrics_http.close()
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
    target = engine.args.config.device.resolve_target()
    backend = "none" if engine.mode == "inline" else ("nccl" if target == "cuda" else "gloo")
    return {"mode": engine.mode, "replicas": len(engine.replicas), "ranks_per_replica": engine.ranks_per_replica,
            "device": target, "backend": backend, "plugin": engine.args.plugin}


if __name__ == "__main__":
    sys.exit(main())
