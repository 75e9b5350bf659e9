"""A ROS 2 (rclpy) node that serves a phyrt policy: observations in, action chunks out.

NOT RUN HERE: this machine has no ROS 2 (rclpy is not packaged for its Debian, and
not on PyPI), so no test runs this file; tests/test_ros_example.py only compiles it.
Its ROS 1 twin, examples/ros_policy_node.py, is the one tested against a real
master. It is written against the rclpy API of ROS 2 Humble and later.

    python -m runtime.launch                                      # terminal 1: "phyrt ready address=..."
    source /opt/ros/<distro>/setup.bash                           # terminal 2
    PYTHONPATH=<phyrt checkout> python3 examples/ros2_policy_node.py --address ADDRESS

The phyrt client needs only pyzmq, msgpack and numpy (no torch), so it runs in the
ROS 2 Python. The flow:

    /phyrt/obs (std_msgs/Float32MultiArray, obs_dim floats)
        -> executor thread: check, gate, client.submit({"obs": [1, obs_dim]})   (returns at once)
    client I/O thread: future done -> publisher.publish                         (returns at once)
        -> /phyrt/actions (Float32MultiArray, horizon*act_dim floats,
                           layout.dim = [horizon, act_dim], row-major)

Neither callback waits on the server, so the executor is never blocked.
``Publisher.publish`` may be called from any thread in rclpy (it holds the
publisher's handle while it publishes).

Stale observations: at most ``--max-inflight`` (default 1) requests are in flight;
an observation arriving while that many run is dropped, counted and flagged with a
throttled warning. The subscription keeps one message (QoS depth 1). A chunk whose
observation is older than ``--max-age-s`` when it arrives (counted from when this
node received it: Float32MultiArray carries no stamp) is dropped as stale.

Shutdown: Ctrl-C ends ``rclpy.spin``; the node closes the client (in-flight requests
fail, nothing more is published), is destroyed, and rclpy shuts down.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import rclpy
from rclpy.node import Node
from rclpy.utilities import remove_ros_args
from std_msgs.msg import Float32MultiArray, MultiArrayDimension

from runtime.client import Client
from runtime.client.gate import ObservationGate


class PolicyNode(Node):
    """Bridges one observation topic to one action topic through a phyrt ``Client``.

    The gating (in flight, stale, malformed) is ``runtime.client.gate.ObservationGate``'s;
    this class only wires it to rclpy.
    """

    def __init__(self, client: Client, obs_topic: str, action_topic: str, *, obs_dim: int = 32,
                 max_inflight: int = 1, max_age_s: float = 1.0, timeout_s: float = 5.0,
                 node_name: str = "phyrt_policy") -> None:
        super().__init__(node_name)
        self.client = client
        self._pub = self.create_publisher(Float32MultiArray, action_topic, 10)
        log = self.get_logger()
        self.gate = ObservationGate(client, lambda actions: self._pub.publish(action_message(actions)),
                                    obs_dim=obs_dim, max_inflight=max_inflight, max_age_s=max_age_s,
                                    timeout_s=timeout_s,
                                    warn=lambda text: log.warning(text, throttle_duration_sec=5.0))
        self._sub = self.create_subscription(Float32MultiArray, obs_topic, self._on_obs, 1)

    @property
    def counts(self) -> dict[str, int]:
        return self.gate.counts

    def _on_obs(self, msg: Float32MultiArray) -> None:
        """The executor's thread: never waits on the server."""
        self.gate.offer(msg.data)

    def close(self) -> None:
        """Stop taking observations, then close the client (in-flight requests fail). Idempotent."""
        if self.gate.closed:
            return
        self.gate.close()
        self.client.close()
        self.get_logger().info(f"phyrt policy node closed: {self.gate.counts}")


def action_message(actions: np.ndarray) -> Float32MultiArray:
    """A [horizon, act_dim] chunk as a flat row-major Float32MultiArray with its layout."""
    horizon, act_dim = actions.shape
    msg = Float32MultiArray()
    msg.layout.dim = [MultiArrayDimension(label="horizon", size=horizon, stride=horizon * act_dim),
                      MultiArrayDimension(label="act_dim", size=act_dim, stride=act_dim)]
    msg.layout.data_offset = 0
    msg.data = actions.reshape(-1).tolist()
    return msg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the address from the server's 'phyrt ready' line")
    parser.add_argument("--obs-topic", default="/phyrt/obs", help="std_msgs/Float32MultiArray observations")
    parser.add_argument("--action-topic", default="/phyrt/actions", help="std_msgs/Float32MultiArray action chunks")
    parser.add_argument("--obs-dim", type=int, default=32, help="floats per observation")
    parser.add_argument("--max-inflight", type=int, default=1,
                        help="requests in flight at most; observations beyond are dropped")
    parser.add_argument("--max-age-s", type=float, default=1.0,
                        help="action chunks arriving later than this after their observation are dropped")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="each request's deadline on the server")
    parser.add_argument("--node-name", default="phyrt_policy")
    # rclpy takes its own arguments (--ros-args ...); argparse gets the rest
    args = sys.argv if argv is None else [sys.argv[0], *argv]
    opts = parser.parse_args(remove_ros_args(args)[1:])

    rclpy.init(args=args)
    client = node = None
    try:
        client = Client(opts.address)
        info = client.info(timeout=30)
        node = PolicyNode(client, opts.obs_topic, opts.action_topic, obs_dim=opts.obs_dim,
                          max_inflight=opts.max_inflight, max_age_s=opts.max_age_s, timeout_s=opts.timeout_s,
                          node_name=opts.node_name)
        node.get_logger().info(f"phyrt policy node: {opts.obs_topic} -> {info['plugin']} at {opts.address} -> "
                               f"{opts.action_topic}")
        rclpy.spin(node)
    except KeyboardInterrupt:
        pass
    finally:
        if node is not None:
            node.close()
            node.destroy_node()
        elif client is not None:
            client.close()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
