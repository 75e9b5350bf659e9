"""docs/own-model.md ("Serve your own model"), step by step: a trained ``TinyPolicy`` in a safetensors
file, served by ``examples.own_policy.plugin:OwnPolicy`` inline, through the launch command of that page
and a ``runtime.client.Client``, and refused clearly when the file or the observation is wrong."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from examples.own_policy.make_weights import train
from examples.own_policy.model import TinyPolicyConfig, load_policy, save_policy
from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
from tests.test_launch import ROOT, Launched, run_launch

PLUGIN = "examples.own_policy.plugin:OwnPolicy"
CONFIG = TinyPolicyConfig(obs_dim=6, horizon=3, action_dim=2, hidden=16)
#: the inline engines compared with the module on the CPU run there too, wherever CUDA is visible
CPU = EngineConfig(device=DeviceConfig(target="cpu"))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A weights file trained for a few steps (sizes other than the defaults, so they must come from the file)."""
    path = tmp_path_factory.mktemp("own_policy") / "policy.safetensors"
    model, _, _ = train(CONFIG, steps=20, seed=3)
    save_policy(model, path)
    return path


def direct_actions(path, obs: np.ndarray, device: str = "cpu", dtype: str = "float32") -> np.ndarray:
    """What the module, loaded without phyrt, answers: on ``device`` in ``dtype``, as the plugin runs it."""
    dtype = getattr(torch, dtype)
    with torch.inference_mode():
        model = load_policy(path, device).to(dtype)
        return model(torch.from_numpy(obs).to(device, dtype)).float().cpu().numpy()


def readme_launch_args() -> list[str]:
    """The arguments of the launch command for this plugin, the same in README.md's "Serve your own
    model" and in docs/own-model.md, which walks through it."""
    found = []
    for doc, heading in (("README.md", "## Serve your own model"), ("docs/own-model.md", "# Serve your own model")):
        text = (ROOT / doc).read_text()
        section = text[text.index(heading):]
        line = next(l for l in section.splitlines() if l.startswith("python -m runtime.launch") and PLUGIN in l)
        found.append(shlex.split(line)[3:])
    assert found[0] == found[1], found
    return found[0]


def test_inline_engine_gives_the_actions_of_the_module_loaded_directly(weights):
    obs = np.random.default_rng(0).standard_normal((5, CONFIG.obs_dim)).astype(np.float32)
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"weights": str(weights)}, config=CPU)) as engine:
        actions = engine.step({"obs": torch.from_numpy(obs)})["actions"]
        from_numpy64 = engine.step({"obs": obs.astype(np.float64)})["actions"]
    assert actions.shape == (5, CONFIG.horizon, CONFIG.action_dim) and actions.dtype == torch.float32
    np.testing.assert_array_equal(actions.numpy(), direct_actions(weights, obs))
    np.testing.assert_allclose(from_numpy64.numpy(), actions.numpy(), atol=1e-6)


def test_bad_weights_files_fail_before_anything_starts(weights, tmp_path):
    def engine(plugin_args):
        return Engine(EngineArgs(plugin=PLUGIN, plugin_args=plugin_args))

    with pytest.raises(FileNotFoundError, match="weights file .*missing.safetensors' does not exist"):
        engine({"weights": str(tmp_path / "missing.safetensors")})
    (tmp_path / "notes.txt").write_text("not a weights file")
    with pytest.raises(ValueError, match="notes.txt is not a readable safetensors file"):
        engine({"weights": str(tmp_path / "notes.txt")})
    other = tmp_path / "other.safetensors"  # the sizes say obs_dim 6, the tensors were made for 7
    model = train(TinyPolicyConfig(obs_dim=7, horizon=3, action_dim=2, hidden=16), steps=0, seed=0)[0]
    model.config = CONFIG
    save_policy(model, other)
    with pytest.raises(ValueError, match=r"does not hold TinyPolicy.*inp.weight is \[16, 7\], expected \[16, 6\]"):
        engine({"weights": str(other)})
    with pytest.raises(ValueError, match="unknown keys \\['hidden'\\]"):
        engine({"weights": str(weights), "hidden": 8})
    with pytest.raises(TypeError, match="plugin_args must be a dict"):
        engine(str(weights))


def test_bad_observations_get_clear_errors_and_the_engine_keeps_serving(weights):
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"weights": str(weights)})) as engine:
        with pytest.raises(ValueError, match=r"obs must have shape \[B >= 1, 6\], got \[1, 5\]"):
            engine.step({"obs": torch.zeros(1, 5)})
        with pytest.raises(ValueError, match="obs must be float16, bfloat16, float32 or float64, got torch.int64"):
            engine.step({"obs": torch.zeros(1, 6, dtype=torch.int64)})
        with pytest.raises(ValueError, match="NaN or inf"):
            engine.step({"obs": torch.full((1, 6), float("nan"))})
        with pytest.raises(ValueError, match="exactly the key 'obs'"):
            engine.step({"obs": torch.zeros(1, 6), "prompt": "pick"})
        with pytest.raises(TypeError, match="must be a dict"):
            engine.step(torch.zeros(1, 6))
        assert engine.step({"obs": torch.zeros(2, 6)})["actions"].shape == (2, 3, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [(), ("--devices", "0")], ids=["inline", "spawned-rank"])
def test_the_readme_launch_command_serves_it_to_a_client(weights, tmp_path, extra):
    from runtime.client import Client, InvalidRequestError

    args = readme_launch_args()
    assert args[:2] == ["--plugin", PLUGIN] and json.loads(args[3]) == {"weights": "policy.safetensors"}
    args[3] = json.dumps({"weights": str(weights)})
    server = Launched(*args, *extra, log_dir=tmp_path)
    try:
        assert server.fields["plugin"] == PLUGIN
        assert server.fields["mode"] == ("local" if extra else "inline")
        # the command names no device: the reference runs where the server does, in its dtype
        device, dtype = server.fields["device"], server.fields.get("dtype", "float32")
        atol = 1e-6 if dtype == "float32" else 1e-2  # 16 bits: an ulp or two near 1
        obs = np.random.default_rng(1).standard_normal((2, CONFIG.obs_dim)).astype(np.float32)
        with Client(server.address) as client:
            actions = client.call({"obs": obs}, timeout=30)["actions"]
            assert actions.dtype == np.float32
            np.testing.assert_allclose(actions, direct_actions(weights, obs, device, dtype), rtol=0, atol=atol)
            with pytest.raises(InvalidRequestError, match=r"obs must have shape \[B >= 1, 6\], got \[1, 4\]"):
                client.call({"obs": np.zeros((1, 4), np.float32)}, timeout=30)
            assert client.call({"obs": obs[:1]}, timeout=30)["actions"].shape == (1, 3, 2)
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.timeout(120)
def test_the_launch_command_with_a_missing_file_exits_1_with_the_cause(tmp_path):
    args = readme_launch_args()
    args[3] = json.dumps({"weights": str(tmp_path / "policy.safetensors")})
    out = run_launch(*args, timeout=100)
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"FileNotFoundError: weights file '.*policy.safetensors' does not exist", out.stderr), out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["module", "path"])
def test_make_weights_writes_a_trained_file_the_plugin_serves(tmp_path, how):
    out = tmp_path / "made.safetensors"
    command = ([sys.executable, "-m", "examples.own_policy.make_weights"] if how == "module"
               else [sys.executable, str(ROOT / "examples/own_policy/make_weights.py")])  # by path, from elsewhere
    done = subprocess.run([*command, "--out", str(out), "--obs-dim", "5", "--steps", "100"],
                          cwd=ROOT if how == "module" else tmp_path, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", done.stdout).groups())
    assert last < first / 5, done.stdout  # trained, not just initialised
    with Engine(EngineArgs(plugin=PLUGIN, plugin_args={"weights": str(out)})) as engine:
        assert engine.step({"obs": torch.zeros(1, 5)})["actions"].shape == (1, 4, 3)
