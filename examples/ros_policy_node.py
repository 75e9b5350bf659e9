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
import threading
import time
from concurrent.futures import Future

import numpy as np
import rospy
from std_msgs.msg import Float32MultiArray, MultiArrayDimension

from runtime.client import Client


class PolicyNode:
    """Bridges one observation topic to one action topic through a phyrt ``Client``."""

    def __init__(self, client: Client, obs_topic: str, action_topic: str, *, obs_dim: int = 32,
                 max_inflight: int = 1, max_age_s: float = 1.0, timeout_s: float = 5.0) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not (max_age_s > 0 and timeout_s > 0):
            raise ValueError(f"max_age_s and timeout_s must be > 0, got {max_age_s} and {timeout_s}")
        self.client = client
        self.obs_dim = obs_dim
        self.max_inflight = max_inflight
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # inflight, counts, closed
        self._inflight = 0
        self._closed = False
        self.counts = {"received": 0, "submitted": 0, "published": 0, "dropped_busy": 0, "dropped_malformed": 0,
                       "dropped_stale": 0, "failed": 0}
        self._pub = rospy.Publisher(action_topic, Float32MultiArray, queue_size=10)
        self._sub = rospy.Subscriber(obs_topic, Float32MultiArray, self._on_obs, queue_size=1)

    def _on_obs(self, msg: Float32MultiArray) -> None:
        """rospy's subscriber thread: never waits on the server."""
        received = time.monotonic()
        obs = np.asarray(msg.data, dtype=np.float32)
        with self._lock:
            if self._closed:
                return
            self.counts["received"] += 1
            if obs.shape != (self.obs_dim,) or not np.isfinite(obs).all():
                self.counts["dropped_malformed"] += 1
                malformed = True
            elif self._inflight >= self.max_inflight:
                self.counts["dropped_busy"] += 1
                rospy.logwarn_throttle(5.0, f"dropped an observation: {self._inflight} request(s) still in flight "
                                            f"(--max-inflight {self.max_inflight}); "
                                            f"{self.counts['dropped_busy']} dropped so far")
                return
            else:
                malformed = False
                self._inflight += 1
                self.counts["submitted"] += 1
        if malformed:
            rospy.logwarn_throttle(5.0, f"ignored an observation of {obs.size} values (or NaN/inf): "
                                        f"expected {self.obs_dim} finite floats")
            return
        try:
            future = self.client.submit({"obs": obs.reshape(1, self.obs_dim)}, timeout=self.timeout_s)
        except Exception as exc:  # closed client or a lost connection: report, keep the node alive
            self._finish("failed")
            rospy.logwarn_throttle(5.0, f"could not submit an observation: {type(exc).__name__}: {exc}")
            return
        future.add_done_callback(lambda f: self._on_result(f, received))

    def _on_result(self, future: Future, received: float) -> None:
        """The client's I/O thread (or the submitting thread if already done): publish, never wait."""
        if future.cancelled() or future.exception() is not None:
            self._finish("failed")
            if not self._closed:
                error = "cancelled" if future.cancelled() else f"{type(future.exception()).__name__}: " \
                                                               f"{future.exception()}"
                rospy.logwarn_throttle(5.0, f"policy request failed: {error}")
            return
        age = time.monotonic() - received
        if age > self.max_age_s:
            self._finish("dropped_stale")
            rospy.logwarn_throttle(5.0, f"dropped an action chunk {age:.3f} s after its observation "
                                        f"(--max-age-s {self.max_age_s})")
            return
        actions = np.asarray(future.result()["actions"], dtype=np.float32)[0]  # [horizon, act_dim]
        if not self._finish("published"):
            return
        self._pub.publish(action_message(actions))

    def _finish(self, outcome: str) -> bool:
        """One request is over; False once the node is closed (publish nothing then)."""
        with self._lock:
            self._inflight -= 1
            self.counts[outcome] += 1
            return not self._closed

    def close(self) -> None:
        """Stop taking observations, then close the client (in-flight requests fail). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._sub.unregister()
        self.client.close()
        rospy.loginfo(f"phyrt policy node closed: {self.counts}")


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
