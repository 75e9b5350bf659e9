"""``python -m runtime.cluster [options] [-- runtime.launch options]``: phyrt servers on a Ray cluster.

Connects to the Ray cluster (``--ray-address``: by default the running one that ``ray start --head``
left on this machine or ``RAY_ADDRESS`` names; with none, one line on stderr says how to start one,
exit status 1; ``local`` starts a private one for this process), starts a ``RayFleet`` (one server per node,
or per ``--gpus-per-server`` GPUs), writes what clients need into ``--keys-dir`` and the
address list into ``--addresses-file`` (rewritten whenever Ray restarts a server), prints
one line per change, and stops every server on SIGINT or SIGTERM.

    --keys-dir DIR (0700):  server.key (the servers' public key), client.key, client.key_secret
    --addresses-file FILE:  {"addresses": ["tcp://...", ...], "server_public_key": "..."}
    a client:  Client(json.load(open(FILE))["addresses"], refresh=..., server_public_key=DIR/server.key,
                      public_key=DIR/client.key, secret_key=DIR/client.key_secret)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

from runtime.core.signals import SignalRelay

EPILOG = """\
Everything after -- goes to python -m runtime.launch on every server (not --address nor the CURVE
options: each server binds tcp://ITS_NODE_IP:PORT with the fleet's CURVE pair). Example:
  python -m runtime.cluster --ray-address auto --keys-dir keys --addresses-file fleet.json -- --plugin policy
--ray-address auto (the default) joins the Ray cluster this machine is part of (`ray start --head` on
one node, `ray start --address HEAD_IP:6379` on the others; or RAY_ADDRESS); --ray-address local starts
a private one-node Ray for this process (stopped with it).
Exit status: 0 after SIGINT or SIGTERM (every server stopped), 1 when no Ray cluster was reached or the
fleet could not start (the cause in one line on stderr), 2 bad arguments.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.cluster", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start phyrt servers on a Ray cluster (one per node, or per GPU set), restarted by Ray; "
                    "requests go straight from clients to the servers, never through Ray.")
    parser.add_argument("--ray-address", default="auto",
                        help="the Ray cluster: auto (a running one: `ray start --head`, or RAY_ADDRESS), HOST:PORT, "
                             "or local (a private one for this process) (default: auto)")
    parser.add_argument("--gpus-per-server", type=int, default=None, metavar="N",
                        help="one server per N GPUs of the cluster (default: one server per node)")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each server's actor reserves (default: 1)")
    parser.add_argument("--max-restarts", type=int, default=-1,
                        help="how often Ray restarts a server that died (-1: always) (default: -1)")
    parser.add_argument("--keys-dir", required=True, metavar="DIR",
                        help="a new directory for the keys clients need (made mode 0700; must not exist)")
    parser.add_argument("--addresses-file", required=True, metavar="FILE",
                        help="the servers' addresses as JSON, rewritten (atomically) when one changes")
    parser.add_argument("--refresh-s", type=float, default=1.0, help="how often the addresses are looked up")
    return parser


def write_keys(directory: str, keys: dict[str, Any]) -> None:
    """server.key, client.key and client.key_secret (zmq.auth's format) in a new 0700 directory."""
    import zmq

    from runtime.cluster.ray_fleet import write_key

    os.mkdir(directory, 0o700)
    write_key(os.path.join(directory, "server.key"), keys["server_public_key"], None)
    write_key(os.path.join(directory, "client.key"), keys["public_key"], None)
    secret = keys["secret_key"]
    write_key(os.path.join(directory, "client.key_secret"), zmq.curve_public(secret), secret)


def write_addresses(path: str, addresses: list[str], server_public_key: bytes) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump({"addresses": addresses, "server_public_key": server_public_key.decode()}, f)
    os.replace(temporary, path)


def connect(address: str) -> str | None:
    """``ray.init(address)``; None once connected, else why not, in one line that says what to do."""
    import ray

    try:
        ray.init(address=address, logging_level="warning")
    except Exception as exc:
        if isinstance(exc, ConnectionError) and address == "auto" and not os.environ.get("RAY_ADDRESS"):
            return ("no running Ray cluster found: start one with `ray start --head`, pass --ray-address "
                    "HOST:PORT for another machine's, or --ray-address local to start a private one for this process")
        return " ".join(f"could not connect to the Ray cluster (--ray-address {address}): {type(exc).__name__}: "
                        f"{exc}".split())
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    opts = parser.parse_args(argv[:split])
    launch_args = argv[split + 1:]
    if os.path.exists(opts.keys_dir):
        parser.error(f"--keys-dir {opts.keys_dir} exists: name a new directory (the fleet's keys are new)")
    try:
        import ray
    except ImportError as exc:
        print(f"phyrt cluster: Ray is not installed ({exc}): pip install 'phyrt[ray]'", file=sys.stderr)
        return 1

    from runtime.cluster.ray_fleet import RayFleet

    problem = connect(opts.ray_address)
    if problem:
        print(f"phyrt cluster: {problem}", file=sys.stderr)
        return 1
    stop = threading.Event()
    SignalRelay(lambda signum: stop.set())  # after ray.init, which installs handlers of its own
    try:
        fleet = RayFleet(launch_args, gpus_per_server=opts.gpus_per_server, num_cpus=opts.num_cpus,
                         max_restarts=opts.max_restarts)
    except Exception as exc:
        print(f"phyrt cluster: the fleet did not start: {type(exc).__name__}: {exc}", file=sys.stderr)
        ray.shutdown()
        return 1
    try:
        write_keys(opts.keys_dir, fleet.client_keys)
        published: list[str] | None = None
        while not stop.is_set():
            addresses = fleet.addresses()
            if addresses != published:
                write_addresses(opts.addresses_file, addresses, fleet.client_keys["server_public_key"])
                print(f"phyrt cluster servers={len(addresses)} addresses={','.join(addresses)}", flush=True)
                published = addresses
            stop.wait(opts.refresh_s)
    finally:
        codes = fleet.close()
        ray.shutdown()
    print(f"phyrt cluster stopped: server exit statuses {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
