// A ROS 1 (roscpp) node that serves a phyrt policy: observations in, action chunks out.
// The C++ twin of examples/ros_policy_node.py (same topics, gating, counters and log lines).
//
//   python -m runtime.launch                                    # terminal 1: "phyrt ready address=..."
//   roscore                                                     # terminal 2 (or: rosmaster --core)
//   build/ros_policy_node --address ADDRESS                     # terminal 3
//
//   /phyrt/obs (Float32MultiArray, obs_dim floats)
//       -> subscriber callback: check, gate, client.submit({"obs": [1, obs_dim]}, callback)  (returns at once)
//   client I/O thread: the callback -> publish (roscpp's Publisher queues: returns at once)
//       -> /phyrt/actions (Float32MultiArray, horizon*act_dim floats, layout.dim = [horizon, act_dim])
//
// Neither callback ever waits on the server. At most --max-inflight requests (default 1) are in
// flight; an observation that comes while that many run is dropped and counted (the next one will be
// fresher than a queued one). An action chunk older than --max-age-s (from when this node received
// its observation) is not published either. Each request carries the server deadline --timeout-s.
// Ctrl-C stops the node: the client closes, requests in flight fail, the counters are logged.
#include <phyrt/client.hpp>
#include <ros/ros.h>
#include <std_msgs/Float32MultiArray.h>

#include <cmath>
#include <sstream>

namespace {

struct Options {
  std::string address, obs_topic = "/phyrt/obs", action_topic = "/phyrt/actions";
  std::uint64_t obs_dim = 32;
  int max_inflight = 1;
  double max_age_s = 1.0, timeout_s = 5.0;
};

class PolicyNode {
 public:
  PolicyNode(phyrt::Client& client, ros::NodeHandle& nh, const Options& o) : client_(client), o_(o) {
    pub_ = nh.advertise<std_msgs::Float32MultiArray>(o.action_topic, 10);
    sub_ = nh.subscribe(o.obs_topic, 1, &PolicyNode::on_obs, this);
  }

  // Stop taking observations and publishing; the counters as "{'received': N, ...}". Idempotent.
  std::string close() {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    sub_.shutdown();
    std::ostringstream text;
    const char* sep = "{";
    for (const auto& [name, n] : counts_) {
      text << sep << "'" << name << "': " << n;
      sep = ", ";
    }
    text << "}";
    return text.str();
  }

 private:
  // roscpp's spinner thread: never waits on the server.
  void on_obs(const std_msgs::Float32MultiArray::ConstPtr& msg) {
    auto received = std::chrono::steady_clock::now();
    bool finite = std::all_of(msg->data.begin(), msg->data.end(), [](float x) { return std::isfinite(x); });
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) return;
      ++counts_["received"];
      if (msg->data.size() != o_.obs_dim || !finite) {
        ++counts_["dropped_malformed"];
        ROS_WARN_THROTTLE(5.0, "ignored an observation of %zu values (or NaN/inf): expected %llu finite floats",
                          msg->data.size(), static_cast<unsigned long long>(o_.obs_dim));
        return;
      }
      if (inflight_ >= o_.max_inflight) {
        ++counts_["dropped_busy"];
        ROS_WARN_THROTTLE(5.0, "dropped an observation: %d request(s) still in flight (max_inflight %d)", inflight_,
                          o_.max_inflight);
        return;
      }
      ++inflight_;
      ++counts_["submitted"];
    }
    auto obs = phyrt::Value::map({{"obs", phyrt::TensorView::of(msg->data.data(), {1, o_.obs_dim})}});
    try {
      client_.submit(obs, o_.timeout_s, [this, received](phyrt::Value* result, std::exception_ptr error) {
        on_result(result, error, received);
      });
    } catch (const std::exception& e) {  // a closed client or a refused handshake: report, keep serving
      finish("failed");
      ROS_WARN_THROTTLE(5.0, "could not submit an observation: %s", e.what());
    }
  }

  // The client's I/O thread: publish, never wait.
  void on_result(phyrt::Value* result, std::exception_ptr error, std::chrono::steady_clock::time_point received) {
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        if (finish("failed")) ROS_WARN_THROTTLE(5.0, "policy request failed: %s", e.what());
      }
      return;
    }
    double age = std::chrono::duration<double>(std::chrono::steady_clock::now() - received).count();
    if (age > o_.max_age_s) {
      finish("dropped_stale");
      ROS_WARN_THROTTLE(5.0, "dropped an action chunk %.3f s after its observation (max_age_s %g)", age, o_.max_age_s);
      return;
    }
    std_msgs::Float32MultiArray msg;
    try {
      const phyrt::Tensor& actions = (*result)["actions"].tensor();  // [1, horizon, act_dim]
      if (actions.shape().size() != 3 || actions.shape()[0] != 1) throw std::invalid_argument("not [1, horizon, act_dim]");
      auto horizon = static_cast<std::uint32_t>(actions.shape()[1]), act_dim = static_cast<std::uint32_t>(actions.shape()[2]);
      msg.layout.dim.resize(2);
      msg.layout.dim[0].label = "horizon", msg.layout.dim[0].size = horizon, msg.layout.dim[0].stride = horizon * act_dim;
      msg.layout.dim[1].label = "act_dim", msg.layout.dim[1].size = act_dim, msg.layout.dim[1].stride = act_dim;
      msg.layout.data_offset = 0;
      msg.data = actions.to_vector<float>();
    } catch (const std::exception& e) {  // an answer of the wrong shape is this request's failure
      finish("failed");
      ROS_WARN_THROTTLE(5.0, "policy answer without actions[0]: %s", e.what());
      return;
    }
    if (finish("published")) pub_.publish(msg);
  }

  // One request is over; false once the node is closed (publish nothing then).
  bool finish(const std::string& outcome) {
    std::lock_guard<std::mutex> lock(mutex_);
    --inflight_;
    ++counts_[closed_ && outcome == "published" ? "dropped_closed" : outcome];
    return !closed_;
  }

  phyrt::Client& client_;
  Options o_;
  ros::Publisher pub_;
  ros::Subscriber sub_;
  std::mutex mutex_;  // counts_, inflight_, closed_
  std::map<std::string, long> counts_{{"received", 0},      {"submitted", 0},         {"published", 0},
                                      {"dropped_busy", 0},  {"dropped_malformed", 0}, {"dropped_stale", 0},
                                      {"dropped_closed", 0}, {"failed", 0}};
  int inflight_ = 0;
  bool closed_ = false;
};

Options parse(int argc, char** argv) {  // what ros::init left: our flags only
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("missing the value of " + flag);
    std::string value = argv[++i];
    if (flag == "--address") o.address = value;
    else if (flag == "--obs-topic") o.obs_topic = value;
    else if (flag == "--action-topic") o.action_topic = value;
    else if (flag == "--obs-dim") o.obs_dim = std::stoull(value);
    else if (flag == "--max-inflight") o.max_inflight = std::stoi(value);
    else if (flag == "--max-age-s") o.max_age_s = std::stod(value);
    else if (flag == "--timeout-s") o.timeout_s = std::stod(value);
    else throw std::invalid_argument("unknown option " + flag);
  }
  if (o.address.empty()) throw std::invalid_argument("--address is required");
  if (o.obs_dim < 1 || o.max_inflight < 1 || !(o.max_age_s > 0 && o.timeout_s > 0))
    throw std::invalid_argument("need --obs-dim >= 1, --max-inflight >= 1, --max-age-s > 0 and --timeout-s > 0");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  ros::init(argc, argv, "phyrt_policy");  // takes ROS remappings (name:=...) out of argv
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "usage: ros_policy_node --address ADDRESS [--obs-topic /phyrt/obs] [--action-topic "
                         "/phyrt/actions] [--obs-dim 32] [--max-inflight 1] [--max-age-s 1] [--timeout-s 5]\n%s\n",
                 e.what());
    return 2;
  }
  ros::NodeHandle nh;
  phyrt::Client client(o.address);
  std::string plugin;
  try {
    plugin = client.info(30)["plugin"].as_string();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "phyrt error: the server at %s did not answer info: %s\n", o.address.c_str(), e.what());
    return 1;
  }
  PolicyNode node(client, nh, o);
  ROS_INFO("phyrt policy node: %s -> %s at %s -> %s", o.obs_topic.c_str(), plugin.c_str(), o.address.c_str(),
           o.action_topic.c_str());
  std::printf("phyrt ros node ready obs=%s actions=%s\n", o.obs_topic.c_str(), o.action_topic.c_str());
  std::fflush(stdout);
  ros::spin();  // until SIGINT (roscpp's handler) or ros::shutdown()
  std::string counts = node.close();
  client.close();  // requests in flight fail now: their callbacks count them, publish nothing
  std::printf("phyrt policy node closed: %s\n", counts.c_str());
  std::fflush(stdout);
  return 0;
}
