"""The deployment examples in ``examples/deploy/`` do what their comments promise.

The systemd unit is read by a small parser of systemd's syntax (sections, ``key=value``,
lines continued by a backslash, comments), the Kubernetes manifest with PyYAML (which
transformers, a dependency of phyrt, requires), and the command of each by
``runtime.launch.build_parser()``, so that a flag the launcher does not know fails here
rather than on the first deployment. The unit's command is then run on the CPU: it must
print its ready line, answer its probes and a request, and exit 0 on SIGTERM leaving nothing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.launch import build_parser
from tests.test_launch import Launched

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "examples" / "deploy" / "phyrt.service"
MANIFEST = ROOT / "examples" / "deploy" / "kubernetes.yaml"
#: what a stop needs beyond --drain-timeout-s: the ranks stopped (a SIGTERM grace of 2 s
#: each group), the segments and the socket removed, with room for a loaded machine
STOP_MARGIN_S = 10.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


# --------------------------------------------------------------------------- reading the files


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [value, ...]}}`` of a systemd unit file (a key may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):  # continued: systemd joins the lines with a space
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a line of a unit file: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    assert not pending, "the unit file ends inside a continued line"
    return sections


def timespan_s(text: str) -> float:
    """Seconds of a systemd time span: ``40``, ``40s``, ``1min 30s``."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    assert parts and "".join(n + u for n, u in parts) == text.replace(" ", ""), f"not a time span: {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def launch_args(argv: list[str]) -> tuple[list[str], Any]:
    """The arguments after ``PYTHON -m runtime.launch`` and what the launcher makes of them."""
    assert os.path.isabs(argv[0]) and os.path.basename(argv[0]).startswith("python"), argv
    assert argv[1:3] == ["-m", "runtime.launch"], argv
    args = argv[3:]
    try:
        return args, build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"python -m runtime.launch refuses the arguments {args} (see its usage above)")


def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key, [])
    assert len(values) == 1, f"{key}= is set {len(values)} times, expected once"
    return values[0]


def unit_command() -> tuple[list[str], Any]:
    return launch_args(shlex.split(one(unit()["Service"], "ExecStart")))


def pod() -> dict[str, Any]:
    kinds = {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}
    assert set(kinds) == {"Deployment", "Service"}, sorted(kinds)
    return kinds


def container(docs: dict[str, Any]) -> dict[str, Any]:
    (found,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return found


def manifest_command(docs: dict[str, Any]) -> tuple[list[str], Any]:
    phyrt = container(docs)
    return launch_args([str(part) for part in phyrt["command"] + phyrt.get("args", [])])


def container_port(phyrt: dict[str, Any], port: Any) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in phyrt["ports"]}
    assert port in named, f"no container port named {port!r}: {sorted(named)}"
    return named[port]


# --------------------------------------------------------------------------- the systemd unit


def test_the_units_command_is_one_the_launcher_accepts():
    args, opts = unit_command()
    assert opts.devices == (0, 1) and opts.replicas == 2
    assert opts.metrics_port == 9100
    assert opts.replica_restarts == 3
    assert not opts.keep_serving_unhealthy  # exit status 3 is what lets systemd restart it


def test_the_unit_drains_on_stop_and_restarts_only_on_failure():
    service = unit()["Service"]
    _, opts = unit_command()
    # SIGTERM to the main process alone: it drains, then stops its ranks itself
    assert one(service, "KillMode") == "mixed"
    assert one(service, "KillSignal") == "SIGTERM"
    stop_s = timespan_s(one(service, "TimeoutStopSec"))
    assert stop_s >= opts.drain_timeout_s + STOP_MARGIN_S, (stop_s, opts.drain_timeout_s)
    # exit 1 and 3 restart the service; 0 (a requested stop) and 2 (bad arguments) do not
    assert one(service, "Restart") == "on-failure"
    assert timespan_s(one(service, "RestartSec")) > 0
    prevented = one(service, "RestartPreventExitStatus").split()
    assert "2" in prevented and "3" not in prevented and "1" not in prevented


def test_the_units_socket_is_in_the_private_directory_systemd_makes():
    service = unit()["Service"]
    _, opts = unit_command()
    assert opts.address.startswith("ipc://"), opts.address
    directory = os.path.dirname(opts.address[len("ipc://"):])
    # runtime.launch refuses an ipc:// path outside a 0700 directory of its own user
    assert directory == "/run/" + one(service, "RuntimeDirectory"), directory
    assert int(one(service, "RuntimeDirectoryMode"), 8) == 0o700
    assert service.get("User") and service.get("User") == service.get("Group")


@pytest.mark.timeout(240)
def test_the_units_command_serves_answers_its_probes_and_exits_0_on_sigterm(tmp_path):
    """As systemd runs it, on the CPU: the ipc path in a private directory of our own and
    a free metrics port stand in for /run/phyrt and 9100."""
    args, _ = unit_command()
    private = tempfile.mkdtemp(prefix="phyrt-deploy-")  # mode 0700, as RuntimeDirectoryMode
    try:
        args = with_option(args, "--address", f"ipc://{private}/phyrt.sock")
        args = with_option(with_option(args, "--metrics-port", "0"), "--device", "cpu")
        server = Launched(*args, log_dir=tmp_path, name="deploy-unit")
        try:
            assert server.fields["mode"] == "local" and server.fields["replicas"] == "2", server.ready_line
            probes = server.fields["metrics"].rsplit("/", 1)[0]
            assert http_status(probes + "/healthz") == 200, server.log()
            assert http_status(probes + "/readyz") == 200, server.log()
            assert call_policy(server.address) == (1, 8, 7)
        finally:
            code = server.stop(signal.SIGTERM)  # what KillMode=mixed sends: the main process only
        assert code == 0, server.log()
        assert "stopped" in server.log()
    finally:
        shutil.rmtree(private, ignore_errors=True)  # its socket is gone already: Launched.stop checks that


def with_option(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced, or ``flag value`` added."""
    if flag in args:
        at = args.index(flag)
        return args[:at + 1] + [value] + args[at + 2:]
    return args + [flag, value]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def call_policy(address: str) -> tuple[int, ...]:
    import numpy as np

    from runtime.client import Client

    with Client(address) as client:
        return tuple(client.call({"obs": np.zeros((1, 32), np.float32)}, timeout=60)["actions"].shape)


# --------------------------------------------------------------------------- the Kubernetes manifest


def test_the_manifests_command_is_one_the_launcher_accepts_and_its_address_is_allowed():
    from runtime.transport.endpoints import check_address

    docs = pod()
    _, opts = manifest_command(docs)
    assert opts.replica_restarts >= 1 and not opts.keep_serving_unhealthy
    assert opts.address.startswith("tcp://") and not opts.address[len("tcp://"):].startswith(LOOPBACK)
    check_address(opts.address, curve=opts.curve_secret_key is not None)  # raises for a refused one
    # the secret key comes from a Secret mounted where the command looks for it
    phyrt = container(docs)
    volumes = {v["name"]: v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in phyrt["volumeMounts"]}
    volume = mounts.get(os.path.dirname(opts.curve_secret_key))
    assert volume is not None and "secret" in volume, f"{opts.curve_secret_key} is on no mounted Secret"


def test_the_manifests_probes_ask_healthz_and_readyz_on_the_metrics_port():
    docs = pod()
    _, opts = manifest_command(docs)
    phyrt = container(docs)
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        get = phyrt[probe]["httpGet"]
        assert get["path"] == path, (probe, get)
        assert container_port(phyrt, get["port"]) == opts.metrics_port, (probe, get)
    # the kubelet probes the pod's address: a metrics endpoint on loopback would fail every probe
    assert opts.metrics_host not in LOOPBACK, opts.metrics_host
    # the endpoint opens once the engine is up: the start may take --startup-timeout-s
    startup = phyrt["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= opts.startup_timeout_s


def test_the_manifest_gives_the_drain_time_to_finish_and_the_service_reaches_the_pod():
    docs = pod()
    _, opts = manifest_command(docs)
    template = docs["Deployment"]["spec"]["template"]
    grace = template["spec"]["terminationGracePeriodSeconds"]
    assert grace >= opts.drain_timeout_s + STOP_MARGIN_S, (grace, opts.drain_timeout_s)
    service = docs["Service"]["spec"]
    assert service["selector"].items() <= template["metadata"]["labels"].items()
    phyrt = container(docs)
    targets = {container_port(phyrt, p["targetPort"]) for p in service["ports"]}
    assert int(opts.address.rpartition(":")[2]) in targets and opts.metrics_port in targets, targets
