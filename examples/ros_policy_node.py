"""A ROS 1 (rospy) node that serves a phyrt policy: observations in, action chunks out.

    python -m runtime.launch                                     # terminal 1: "phyrt ready address=..."
    roscore                                                      # terminal 2 (or: rosmaster --core)
    PYTHONPATH=<phyrt checkout> /usr/bin/python3 examples/ros_policy_node.py --address ADDRESS

rospy lives in the system Python (Debian: ``apt-get install python3-rospy
python3-std-msgs python3-zmq python3-msgpack python3-numpy``); the phyrt client
needs only pyzmq, msgpack and numpy, so it runs there from the checkout, without
torch. The flow:

    /phyrt/obs (Float32MultiArray, obs_dim floats)
        -> subscriber thread: check, gate, client.submit({"obs": [1, obs_dim]})  (returns at once)
    client I/O thread: future done -> publish (Publisher with a queue: returns at once)
        -> /phyrt/actions (Float32MultiArray, horizon*act_dim floats,
                           layout.dim = [horizon, act_dim], row-major)

Neither callback ever waits: the subscriber callback only submits, the future's
done callback only publishes (a rospy Publisher made with ``queue_size`` hands the
message to a sender thread), so a slow server never stalls rospy's threads.

Stale observations. At most ``--max-inflight`` requests (default 1) are in flight;
an observation that arrives while that many are running is dropped, counted, and
flagged with a throttled warning: the next observation will be fresher than a
queued one would be. The subscriber's own queue holds one message, so rospy drops
what this node cannot even look at. An action chunk whose observation is older than
``--max-age-s`` by the time the result arrives (measured from when this node received
it: Float32MultiArray carries no stamp) is not published either (counted as stale):
acting on it would be acting on the past. Each request carries the server
deadline ``--timeout-s``.

Shutdown: Ctrl-C (SIGINT/SIGTERM, handled by rospy) runs ``rospy.on_shutdown``, which
closes the client: requests still in flight fail and their actions are not published.
"""

from __future__ import annotations

import argparse

import numpy as np
import rospy
from std_msgs.msg import Float32MultiArray, MultiArrayDimension

from runtime.client import Client
from runtime.client.gate import ObservationGate


class PolicyNode:
    """Bridges one observation topic to one action topic through a phyrt ``Client``.

    The gating (in flight, stale, malformed) is ``runtime.client.gate.ObservationGate``'s;
    this class only wires it to rospy.
    """

    def __init__(self, client: Client, obs_topic: str, action_topic: str, *, obs_dim: int = 32,
                 max_inflight: int = 1, max_age_s: float = 1.0, timeout_s: float = 5.0) -> None:
        self.client = client
        self._pub = rospy.Publisher(action_topic, Float32MultiArray, queue_size=10)
        self.gate = ObservationGate(client, lambda actions: self._pub.publish(action_message(actions)),
                                    obs_dim=obs_dim, max_inflight=max_inflight, max_age_s=max_age_s,
                                    timeout_s=timeout_s, warn=lambda text: rospy.logwarn_throttle(5.0, text))
        self._sub = rospy.Subscriber(obs_topic, Float32MultiArray, self._on_obs, queue_size=1)

    @property
    def counts(self) -> dict[str, int]:
        return self.gate.counts

    def _on_obs(self, msg: Float32MultiArray) -> None:
        """rospy's subscriber thread: never waits on the server."""
        self.gate.offer(msg.data)

    def close(self) -> None:
        """Stop taking observations, then close the client (in-flight requests fail). Idempotent."""
        if self.gate.closed:
            return
        self.gate.close()
        self._sub.unregister()
        self.client.close()
        rospy.loginfo(f"phyrt policy node closed: {self.gate.counts}")


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
    opts = parser.parse_args(rospy.myargv()[1:] if argv is None else argv)

    rospy.init_node(opts.node_name)
    client = Client(opts.address)
    try:
        info = client.info(timeout=30)
    except BaseException:
        client.close()
        raise
    node = PolicyNode(client, opts.obs_topic, opts.action_topic, obs_dim=opts.obs_dim,
                      max_inflight=opts.max_inflight, max_age_s=opts.max_age_s, timeout_s=opts.timeout_s)
    rospy.on_shutdown(node.close)
    rospy.loginfo(f"phyrt policy node: {opts.obs_topic} -> {info['plugin']} at {opts.address} -> "
                  f"{opts.action_topic}")
    print(f"phyrt ros node ready obs={opts.obs_topic} actions={opts.action_topic}", flush=True)
    try:
        rospy.spin()
    finally:
        node.close()


if __name__ == "__main__":
    main()
