"""The command line of ``python -m runtime.launch``: its options, their checks and its help.

Imports nothing from the project: ``build_parser()`` is all that ``--help`` and bad
arguments (exit status 2) need, so both answer before torch is imported.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["DESCRIPTION", "DTYPES", "build_parser"]

DESCRIPTION = "python -m runtime.launch: start an engine and serve it over ZeroMQ."
#: the choices of --dtype ("auto": see runtime.serving.plan)
DTYPES = ("auto", "float32", "bfloat16", "float16")

_EPILOG = """\
Without arguments: the 'policy' demo plugin, inline, on the CPU, on a private ipc:// socket.

CURVE keys (to bind an interface other than loopback): make a pair with
  python -c "import zmq.auth; zmq.auth.create_certificates('.', 'server')"
which writes server.key (public: give it to the clients) and server.key_secret; then pass
--curve-secret-key server.key_secret (the public key is derived from it).

Exit status: 0 after a requested stop (SIGINT or SIGTERM, during the start or after),
1 start-up failure (an --openpi-host other than loopback without --openpi-api-key is one),
2 bad arguments (also an unknown plugin, a layout beyond the visible CUDA devices, a dtype the
device cannot run), 3 no replica can serve (every replica failed and none is being rebuilt;
see --replica-restarts and --keep-serving-unhealthy).
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The epilog as written; "(default: X)" after an option's help unless its help
    already speaks of the default, or there is none to state (None, a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or isinstance(action.default, bool):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.launch", description=DESCRIPTION, epilog=_EPILOG,
        formatter_class=_HelpFormatter)
    what = parser.add_argument_group("what to serve")
    what.add_argument("--plugin", default="policy",
                      help="a registered plugin name, an entry point, or 'package.module:EntryClass'")
    what.add_argument("--plugin-args", type=_json, default=None, metavar="JSON",
                      help='the plugin\'s arguments as JSON, e.g. \'{"obs_dim": 32}\'')
    what.add_argument("--model", metavar="DIR", default=None,
                      help='shorthand for --plugin qwen3 with {"model": DIR} added to --plugin-args')
    _add_placement_options(parser)
    _add_batching_options(parser)
    serve = parser.add_argument_group("serving")
    serve.add_argument("--address", default=None,
                       help="ipc:///path/in/a/0700/dir or tcp://HOST:PORT (default: ipc:// in a new private dir)")
    serve.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics on http://HOST:PORT/metrics and the probes /healthz "
                            "(200 while the process serves) and /readyz (200 while a replica is healthy, "
                            "else 503); 0: a free port; needs prometheus-client, pip install 'phyrt[serve]'")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="interface of the metrics endpoint")
    serve.add_argument("--max-inflight", type=_positive_int, default=256,
                       help="requests the engine may hold; beyond, requests get Overloaded at once")
    serve.add_argument("--max-message-bytes", type=_positive_int, default=64 << 20,
                       help="larger messages are dropped and their sender disconnected")
    serve.add_argument("--drain-timeout-s", type=_seconds, default=10.0,
                       help="on SIGINT/SIGTERM (or exit 3), how long in-flight requests may still finish")
    serve.add_argument("--curve-secret-key", default=None, metavar="KEY_OR_FILE",
                       help="the server's CURVE secret key (z85) or a zmq.auth .key_secret file; needed to "
                            "bind an interface other than loopback (see below to make one); a z85 key that "
                            "starts with '-' goes as --curve-secret-key=KEY")
    serve.add_argument("--curve-public-key", default=None, metavar="KEY_OR_FILE",
                       help="the server's CURVE public key (z85) or .key file (default: derived from the secret)")
    serve.add_argument("--curve-authorized-clients", default=None, metavar="DIR",
                       help="only clients whose public .key files are in DIR (default: any client with the "
                            "server's public key)")
    _add_openpi_options(parser)
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="how much phyrt logs to stderr (other libraries log from warning)")
    return parser


def _add_batching_options(parser: argparse.ArgumentParser) -> None:
    batching = parser.add_argument_group(
        "dynamic batching", "for a plugin whose runner defines execute_batch(requests) -> results (the policy "
        "demo does): concurrent requests of a replica run as one batch; docs/plugins.md")
    batching.add_argument("--max-batch-size", type=_int_at_least(1), default=1, metavar="N",
                          help="up to N queued requests per batch (1: no batching)")
    batching.add_argument("--max-batch-delay-ms", type=_milliseconds, default=0.0, metavar="MS",
                          help="how long a batch waits for more requests after its first")


def _add_placement_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where it runs")
    where.add_argument("--devices", type=_devices, default=None, metavar="0,1,2,3",
                       help="device entries (CUDA indices, or CPU rank slots); implies local ranks")
    where.add_argument("--replicas", type=_positive_int, default=1,
                       help="replicas; each gets len(devices)/replicas ranks, tensor parallel over them")
    where.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                       help="auto: cuda when torch sees a GPU, else the CPU with gloo")
    where.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="the parameters' dtype. auto: float32 on the CPU; on CUDA the checkpoint's "
                            "torch_dtype for --model, else bfloat16")
    where.add_argument("--base-port", type=_port, default=None, metavar="PORT",
                       help="default: a free rendezvous through a file in the run directory; an int pins "
                            "replica i to 127.0.0.1:PORT+i")
    where.add_argument("--execution-timeout-s", type=_seconds, default=None,
                       help="a local replica whose request runs longer is failed (default: no limit)")
    where.add_argument("--heartbeat-interval-s", type=_seconds, default=0.5, help="rank heartbeat period")
    where.add_argument("--heartbeat-timeout-s", type=_seconds, default=10.0,
                       help="a rank silent this long fails its replica")
    where.add_argument("--startup-timeout-s", type=_seconds, default=300.0, help="every rank must be ready by then")
    where.add_argument("--replica-restarts", type=_non_negative_int, default=0, metavar="N",
                       help="rebuild a failed local replica in the background up to N times (0: it stays down)")
    where.add_argument("--restart-backoff-s", type=_seconds, default=1.0, metavar="S",
                       help="wait S * 2**(k-1) seconds, at most 60, before rebuild k of a replica")
    where.add_argument("--keep-serving-unhealthy", action="store_true",
                       help="when no replica can serve, stay up answering EngineUnavailable (default: exit 3)")


def _add_openpi_options(parser: argparse.ArgumentParser) -> None:
    openpi = parser.add_argument_group(
        "openpi clients",
        "openpi's websocket policy protocol (openpi_client.WebsocketClientPolicy) on a port of its own,\n"
        "beside the ZeroMQ address; needs websockets: pip install 'phyrt[openpi]'. The protocol has NO\n"
        "encryption: observations, results and the API key cross the network in clear.")
    openpi.add_argument("--openpi-port", type=_port_or_zero, default=None, metavar="PORT",
                        help="serve openpi clients on ws://HOST:PORT (0: a free port; the ready line gains "
                             "openpi=ws://HOST:PORT) and GET /healthz on the same port; --max-inflight and "
                             "--max-message-bytes apply to it too")
    openpi.add_argument("--openpi-host", default="127.0.0.1", metavar="HOST",
                        help="interface of the openpi door; any other than loopback only with --openpi-api-key")
    openpi.add_argument("--openpi-api-key", default=None, metavar="KEY_OR_FILE",
                        help="the key openpi clients must send (header 'Authorization: Api-Key KEY'), or a file "
                             "holding it (a file keeps it out of the process list)")
    openpi.add_argument("--openpi-no-batch-dim", action="store_true",
                        help="hand observations to the plugin as they come (default: a leading batch dimension "
                             "of 1 is added to every array, and removed from every array of the result)")


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


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return value


def _port_or_zero(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0: a free one), got {text!r}")
    return value


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60_000:
        raise argparse.ArgumentTypeError(f"expected milliseconds from 0 to 60000, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value
