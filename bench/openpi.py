"""Section "openpi": phyrt's openpi door next to the protocol's floor and phyrt's own client.

    openpi_client.WebsocketClientPolicy  ==ws://==>  python -m runtime.launch --openpi-port 0    door
    openpi_client.WebsocketClientPolicy  ==ws://==>  websockets + msgpack_numpy server that runs  floor
                                                     the same plugin's runner in its event loop
    runtime.client.Client  ========ipc://========>   the door's own server, its ZMQ address      phyrt's client

Two observations, each served by its own ``python -m runtime.launch`` (inline, CPU):
``{"obs": float32 (32,)}`` for the ``policy`` demo plugin (obs_dim 32) and a 640 x 480 RGB
``{"image": uint8 (480, 640, 3)}`` for ``bench.plugins:ImageMeanPolicy`` (a cheap stand-in for
a vision policy). Both answer an action chunk ``{"actions": float32 (8, 7)}``.

The floor is what openpi's own ``WebsocketPolicyServer`` does: send the metadata on connect,
then per message ``msgpack_numpy.unpackb``, run the policy in the event loop, ``Packer.pack``
the result. Its "policy" is the plugin's own runner, built in that process
(``Entry.build``), with the door's conventions: numpy arrays become torch views of the
received bytes with a leading batch dimension of 1, the result loses it again. So door / floor is what
phyrt's door and engine add to the protocol, for the same computation. phyrt's client sends
the batched observation (``obs[None]``) to the same server's ZMQ address.

Calls are timed one by one (``perf_counter_ns`` around ``infer`` / ``call``), the paths
interleaved (in rounds for the small observation, call by call for the image), so that load
from elsewhere lands on all of them alike. The first answer of every path is checked against
the floor's. Both servers run torch with ``TORCH_THREADS`` (1) intra-op thread. Without
openpi_client (or websockets) the door and floor rows say "not available" and only phyrt's
client is measured.

Top level: no torch (the floor server is a spawned child that re-imports this module).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

from bench.common import (RunContext, Section, Table, Target, exit_with_parent, fmt_us, join_or_kill, p50, p99,
                          ratio, timed)
from bench.peers import serve_websocket
from bench.serving import LaunchedServer

OBS_DIM = 32
IMAGE_SHAPE = (480, 640, 3)
ACTIONS_SHAPE = (8, 7)
#: the goal: the door's p50 for the small observation at most this many times the floor's
TARGET_DOOR_RATIO = 1.5
START_TIMEOUT_S = 120.0
ROUNDS = 5
#: torch intra-op threads of both servers (with 2, spinning OpenMP threads made a p50 jump from 1 to 30 ms)
TORCH_THREADS = 1

DOOR = "openpi client → phyrt openpi door (`runtime.launch --openpi-port`)"
FLOOR = "openpi client → websockets + msgpack_numpy server, same plugin in-process (floor)"
CLIENT = "`runtime.client.Client` → the same phyrt server, ipc://"


@dataclass(frozen=True)
class Observation:
    key: str
    title: str
    plugin: str
    plugin_args: dict | None

    def make(self) -> dict:
        import numpy as np

        rng = np.random.default_rng(0)
        if self.key == "small":
            return {"obs": rng.standard_normal(OBS_DIM).astype(np.float32)}
        return {"image": rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)}


OBSERVATIONS = (Observation("small", f"obs float32 ({OBS_DIM},), policy", "policy", {"obs_dim": OBS_DIM}),
                Observation("image", f"image uint8 {IMAGE_SHAPE}, ImageMeanPolicy", "bench.plugins:ImageMeanPolicy",
                            None))


# --------------------------------------------------------------------------- the floor (a spawned child)


def _batched(obj: Any, torch: Any, np: Any) -> Any:
    """numpy arrays -> torch views (read-only, as the door's) with a leading dimension of 1 (dicts followed)."""
    if isinstance(obj, dict):
        return {k: _batched(v, torch, np) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)[None]
    return obj


def _unbatched(obj: Any, torch: Any) -> Any:
    """torch tensors -> numpy arrays without their leading dimension of 1 (dicts followed)."""
    if isinstance(obj, dict):
        return {k: _unbatched(v, torch) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()[0]
    return obj


def _floor_server(plugin: str, plugin_args: Any, conn: Any) -> None:
    """openpi's server loop around the plugin's own runner, on 127.0.0.1 (a free port, sent on ``conn``)."""
    exit_with_parent()
    import warnings

    import numpy as np
    import torch
    from openpi_client import msgpack_numpy

    from runtime import BuildContext, ParallelConfig
    from runtime.core.plugins import resolve_plugin

    # the arrays are views of the received bytes, as the door's tensors are: nobody writes into them
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    torch.set_num_threads(TORCH_THREADS)
    entry = resolve_plugin(plugin)()
    entry.configure(plugin_args)
    build = BuildContext(rank=0, world_size=1, replica_index=0, device=torch.device("cpu"), target="cpu",
                         params_dtype=torch.float32, parallel=ParallelConfig())
    runner = entry.build(build, plugin_args)
    packer = msgpack_numpy.Packer()

    def infer(obs: Any) -> Any:
        request = _batched(obs, torch, np)
        entry.validate_request(request)
        return _unbatched(runner.execute(request), torch)

    async def handler(ws: Any) -> None:
        await ws.send(packer.pack({"server": "floor", "plugin": plugin}))
        async for message in ws:
            try:
                answer = packer.pack(infer(msgpack_numpy.unpackb(message)))
            except Exception as exc:  # noqa: BLE001 - openpi's servers answer an error as a text frame
                answer = f"{type(exc).__name__}: {exc}"
            await ws.send(answer)

    serve_websocket(handler, conn)


class FloorServer:
    """The floor's process: started at construction, ``ready()`` waits for its URL (meanwhile phyrt's starts)."""

    def __init__(self, mp: Any, observation: Observation) -> None:
        self._here, there = mp.Pipe(duplex=False)
        self.process = mp.Process(target=_floor_server, args=(observation.plugin, observation.plugin_args, there),
                                  name=f"bench-openpi-floor-{observation.key}", daemon=True)
        self.process.start()
        there.close()

    def ready(self) -> str:
        try:
            if not self._here.poll(START_TIMEOUT_S):
                raise RuntimeError(f"not in {START_TIMEOUT_S:g} s")
            return f"ws://127.0.0.1:{self._here.recv()}"
        except (EOFError, RuntimeError) as exc:
            raise RuntimeError(f"the openpi floor server did not start ({exc or 'it exited'}; exit code "
                               f"{self.process.exitcode})") from None

    def close(self) -> None:
        self._here.close()
        self.process.terminate()
        join_or_kill(self.process)


# --------------------------------------------------------------------------- phyrt's server, the clients


class LaunchedDoor(LaunchedServer):
    """``python -m runtime.launch`` serving one plugin on ipc:// and, with ``openpi``, its openpi door."""

    def __init__(self, observation: Observation, address: str, log_dir: str, openpi: bool) -> None:
        self.log_path = os.path.join(log_dir, f"openpi-{observation.key}.log")
        self._log = open(self.log_path, "w")
        command = [sys.executable, "-m", "runtime.launch", "--plugin", observation.plugin, "--device", "cpu",
                   "--address", address, "--log-level", "warning"]
        if observation.plugin_args is not None:
            command += ["--plugin-args", json.dumps(observation.plugin_args)]
        if openpi:
            command += ["--openpi-port", "0"]
        env = {**os.environ, "OMP_NUM_THREADS": str(TORCH_THREADS)}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        fields = self._ready_fields()
        self.address = fields["address"]
        self.openpi_url = fields.get("openpi")
        if openpi and not self.openpi_url:
            self.close()
            raise RuntimeError(f"the ready line has no openpi= field: {fields}")


def openpi_client_class() -> type:
    """``WebsocketClientPolicy`` with a ``close`` (0.1.2 has none); ImportError without openpi_client."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    class ClosingClientPolicy(WebsocketClientPolicy):
        def close(self) -> None:
            self._ws.close()

    return ClosingClientPolicy


class OpenpiPath:
    def __init__(self, label: str, url: str, client_class: type) -> None:
        self.label = label
        self.policy = client_class(url)
        self.metadata = self.policy.get_server_metadata()

    def call(self, obs: dict) -> dict:
        return self.policy.infer(obs)

    def close(self) -> None:
        self.policy.close()


class ClientPath:
    """``runtime.client.Client`` with the observation batched by hand, the result unbatched."""

    def __init__(self, label: str, address: str) -> None:
        from runtime.client import Client

        self.label = label
        self.client = Client(address)

    def call(self, obs: dict) -> dict:
        result = self.client.call({k: v[None] for k, v in obs.items()}, timeout=START_TIMEOUT_S)
        return {k: v[0] for k, v in result.items()}

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- measuring


def check_answers(paths: list[Any], obs: dict) -> None:
    """Every path answers the same action chunk (unbatched ``ACTIONS_SHAPE``) for ``obs``."""
    import numpy as np

    first = None
    for path in paths:
        actions = np.array(path.call(obs)["actions"])
        if actions.shape != ACTIONS_SHAPE:
            raise RuntimeError(f"{path.label} answered actions of shape {actions.shape}, expected {ACTIONS_SHAPE}")
        if first is None:
            first = (path.label, actions)
        elif not np.allclose(actions, first[1], atol=1e-5):
            raise RuntimeError(f"{path.label} answered other actions than {first[0]}")


def measure(paths: list[Any], obs: dict, iters: int, warmup: int, rounds: int,
            progress: Callable[[str], None]) -> dict[str, list[int]]:
    """``warmup`` calls per path, then ``iters`` timed calls per path in ``rounds`` interleaved rounds."""
    samples: dict[str, list[int]] = {p.label: [] for p in paths}
    for path in paths:
        timed(path.call, obs, warmup, None)
    per_round = math.ceil(iters / rounds)
    for r in range(rounds):
        if rounds <= ROUNDS:
            progress(f"round {r + 1}/{rounds} ({per_round} calls per path)")
        for path in paths:
            timed(path.call, obs, per_round, samples[path.label])
    return samples


def measure_observation(ctx: RunContext, observation: Observation, client_class: type | None, log_dir: str,
                        counts: tuple[int, int, int]) -> dict[str, list[int]]:
    """Start the phyrt server (and the floor), measure every path for ``observation``, stop them."""
    iters, warmup, rounds = counts
    obs = observation.make()
    with contextlib.ExitStack() as stack:
        ctx.progress(f"openpi: {observation.key}: starting python -m runtime.launch --plugin {observation.plugin}"
                     + (" --openpi-port 0 and the floor server" if client_class else ""))
        if client_class is not None:  # starts while phyrt's server starts
            floor = FloorServer(ctx.mp(), observation)
            stack.callback(floor.close)
            ctx.pids.add(floor.process.pid)
        server = LaunchedDoor(observation, f"ipc://{ctx.workdir}/openpi-{observation.key}.sock", log_dir,
                              openpi=client_class is not None)
        stack.callback(server.close)
        ctx.pids.update(server.pids())
        paths = []
        if client_class is not None:
            paths.append(OpenpiPath(FLOOR, floor.ready(), client_class))
            stack.callback(paths[-1].close)
            paths.append(OpenpiPath(DOOR, server.openpi_url, client_class))
            stack.callback(paths[-1].close)
            if paths[-1].metadata.get("server") != "phyrt":
                raise RuntimeError(f"the door's metadata does not name phyrt: {paths[-1].metadata}")
        paths.append(ClientPath(CLIENT, server.address))
        stack.callback(paths[-1].close)
        check_answers(paths, obs)
        ctx.progress(f"openpi: {observation.key}: {warmup} warm-up + {iters} timed calls per path")
        return measure(paths, obs, iters, warmup, rounds, lambda m: ctx.progress(f"openpi: {observation.key}: {m}"))


# --------------------------------------------------------------------------- the section


def _figure(a: list[int] | None, b: list[int] | None, stat: Callable[[Any], float]) -> str:
    return ratio(stat(a), stat(b)) if a and b else "n/a"


def build_section(samples: dict[str, dict[str, list[int]]], unavailable: str | None, method: str) -> Section:
    """The tables, target and data of the section from the timed samples (ns) per observation and path;
    ``unavailable``: why the door and the floor were not measured (None: they were)."""
    section = Section("openpi", "openpi door: openpi's client against phyrt's door, the protocol's floor and "
                                "phyrt's client")
    if unavailable:
        section.notes.append(f"{DOOR} and {FLOOR}: {unavailable}")
    titles = {o.key: o.title for o in OBSERVATIONS}
    rows, ratio_rows = [], []
    for key, per_path in samples.items():
        floor = per_path.get(FLOOR)
        for label in (DOOR, FLOOR, CLIENT):
            s = per_path.get(label)
            rows.append([titles.get(key, key), label] + ([fmt_us(p50(s)), fmt_us(p99(s)), _figure(s, floor, p50),
                                                          str(len(s))] if s else [unavailable or "not measured",
                                                                                  "", "", ""]))
        door, client = per_path.get(DOOR), per_path.get(CLIENT)
        ratio_rows.append([titles.get(key, key), _figure(door, floor, p50), _figure(door, floor, p99),
                           _figure(door, client, p50), _figure(door, client, p99)])
    section.tables.append(Table("Per-call latency, one client, sequential",
                                ["observation", "path", "p50 µs", "p99 µs", "p50 / floor", "n"], rows, [method]))
    section.tables.append(Table("Ratios: the door against the floor and against phyrt's client",
                                ["observation", "door / floor p50", "door / floor p99", "door / Client p50",
                                 "door / Client p99"], ratio_rows))
    small = samples.get("small", {})
    door, floor = small.get(DOOR), small.get(FLOOR)
    name = f"openpi door small-observation p50 ≤ {TARGET_DOOR_RATIO:g}× the protocol's floor"
    if door and floor:
        r = p50(door) / p50(floor)
        figure, met = f"{r:.2f}× ({fmt_us(p50(door))} µs / {fmt_us(p50(floor))} µs)", r <= TARGET_DOOR_RATIO
    else:
        figure, met = unavailable or "not measured", None
    section.targets.append(Target(name, figure, met))
    section.data = {name: {k: {label: stat(s) for label, s in v.items()} for k, v in samples.items()}
                    for name, stat in (("p50_ns", p50), ("p99_ns", p99), ("n", len))}
    return section


def run(ctx: RunContext) -> Section:
    try:
        client_class = openpi_client_class()
        unavailable = None
    except ImportError as exc:
        client_class = None
        unavailable = (f"not available: openpi_client does not import ({exc}); pip install --no-deps "
                       "openpi-client==0.1.2 (see bench/README.md)")
    small = (500, 50, ROUNDS) if ctx.quick else (5000, 500, ROUNDS)
    image = (30, 3, 30) if ctx.quick else (200, 10, 200)
    log_dir = os.path.join(ctx.workdir, "openpi-logs")
    os.makedirs(log_dir, exist_ok=True)
    samples = {}
    try:
        for observation, counts in zip(OBSERVATIONS, (small, image)):
            samples[observation.key] = measure_observation(ctx, observation, client_class, log_dir, counts)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    method = (f"`perf_counter_ns` around one whole `infer` (openpi's `WebsocketClientPolicy`) or `call` "
              f"(`runtime.client.Client`, the observation batched with `[None]`). Small observation: {small[1]} "
              f"warm-up, then {small[0]} timed calls per path in {ROUNDS} interleaved rounds; image: {image[1]} "
              f"warm-up, then {image[0]} calls per path interleaved call by call. Each observation has its own "
              "`python -m runtime.launch --device cpu --openpi-port 0` (inline engine) and its own floor: an asyncio "
              "`websockets` server that decodes with `openpi_client.msgpack_numpy`, runs the plugin's runner in its "
              "event loop (torch views of the received bytes, batch dimension added and removed, as the door does) "
              "and packs the answer, as openpi's `WebsocketPolicyServer` does. Both servers: torch with "
              f"{TORCH_THREADS} intra-op thread. First answers checked equal across the paths.")
    return build_section(samples, unavailable, method)
