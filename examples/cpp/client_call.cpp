// Call a running phyrt server from C++: the policy demo's request, its actions as JSON on stdout.
//
//   python -m runtime.launch                          # terminal 1: prints "phyrt ready address=..."
//   build/client_call --address ADDRESS               # terminal 2
//
// Sends {"obs": float32 [1, obs_dim]} with element i = 0.01 * i and prints the result's "actions"
// as {"shape": [...], "data": [...]} (floats written with 9 significant digits: exact for float32).
// An error prints "phyrt error: <ExceptionClass>: <message>" on stderr and exits with the code of
// its class (see exit_code below). --calls N then times N more calls and writes their round trips
// to --latency-out as {"round_trip_ns": [...]}, in nanoseconds (python -m bench's "cpp" section reads
// it). --help prints the options.
// --print KEY prints the result's tensor KEY instead (an echo plugin answers "obs"). --sleep-s S
// adds "sleep": S to the request, which tests.plugins:Echo honours: the tests hold a request in
// flight with it. --priority N sends each request with that priority (larger is sooner; 0, the
// default, is not sent).
#include <phyrt/client.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>

namespace {

int exit_code(const std::exception& e) {  // the most derived class first
  if (dynamic_cast<const phyrt::HandshakeError*>(&e)) return 9;
  if (dynamic_cast<const phyrt::ConnectionLostError*>(&e)) return 8;
  if (dynamic_cast<const phyrt::ServerUnavailableError*>(&e)) return 7;
  if (dynamic_cast<const phyrt::InvalidRequestError*>(&e)) return 3;
  if (dynamic_cast<const phyrt::DeadlineExceededError*>(&e)) return 4;
  if (dynamic_cast<const phyrt::OverloadedError*>(&e)) return 5;
  if (dynamic_cast<const phyrt::PluginError*>(&e)) return 6;
  if (dynamic_cast<const phyrt::ServerError*>(&e)) return 10;
  if (dynamic_cast<const phyrt::ProtocolError*>(&e)) return 11;
  return 1;
}

const char kUsage[] =
    "usage: client_call --address ADDRESS [options]\n"
    "Sends the policy demo's request {\"obs\": float32 [1, obs-dim]} (element i = 0.01 * i) to a phyrt server\n"
    "and prints the result's tensor as {\"shape\": [...], \"data\": [...]}.\n"
    "  --address ADDRESS         the server's address, from its \"phyrt ready\" line (required)\n"
    "  --obs-dim N               floats in the observation (32)\n"
    "  --timeout-s S             each call's deadline, in seconds (30)\n"
    "  --print KEY               the result's tensor to print (actions)\n"
    "  --sleep-s S               adds \"sleep\": S to the request (tests.plugins:Echo sleeps that long)\n"
    "  --priority N              each request's priority, an int32: larger is sooner (0)\n"
    "  --calls N                 then times N more calls\n"
    "  --latency-out PATH        where --calls writes {\"round_trip_ns\": [...]}: each call's round trip in\n"
    "                            nanoseconds (default: stderr)\n"
    "  --heartbeat-interval-s S  (1)   --heartbeat-timeout-s S  (5)\n"
    "  --server-public-key K --secret-key K [--public-key K]   CURVE keys, z85 text\n"
    "  --help                    this text\n"
    "An error prints \"phyrt error: <Class>: <message>\" on stderr and exits 3 InvalidRequestError,\n"
    "4 DeadlineExceededError, 5 OverloadedError, 6 PluginError, 7 ServerUnavailableError,\n"
    "8 ConnectionLostError, 9 HandshakeError, 10 another ServerError, 11 ProtocolError; 2 bad arguments.\n";

const char* class_name(int code) {
  static const std::map<int, const char*> names = {
      {3, "InvalidRequestError"}, {4, "DeadlineExceededError"}, {5, "OverloadedError"},
      {6, "PluginError"}, {7, "ServerUnavailableError"}, {8, "ConnectionLostError"},
      {9, "HandshakeError"}, {10, "ServerError"}, {11, "ProtocolError"}, {1, "std::exception"}};
  return names.at(code);
}

void print_tensor(const phyrt::Tensor& tensor) {
  std::printf("{\"shape\": [");
  for (std::size_t i = 0; i < tensor.shape().size(); ++i) std::printf(i ? ", %llu" : "%llu",
                                                                       (unsigned long long)tensor.shape()[i]);
  std::printf("], \"data\": [");
  auto data = tensor.to_vector<float>();
  for (std::size_t i = 0; i < data.size(); ++i) std::printf(i ? ", %.9g" : "%.9g", data[i]);
  std::printf("]}\n");
}

struct Options {
  std::string address, latency_out, print = "actions";
  std::uint64_t obs_dim = 32;
  double timeout_s = 30, sleep_s = 0;
  int calls = 0;
  std::int32_t priority = 0;
  bool help = false;
  phyrt::ClientOptions client;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      o.help = true;
      return o;
    }
    if (i + 1 >= argc) throw std::invalid_argument("missing the value of " + flag);
    std::string value = argv[++i];
    if (flag == "--address") o.address = value;
    else if (flag == "--obs-dim") o.obs_dim = std::stoull(value);
    else if (flag == "--timeout-s") o.timeout_s = std::stod(value);
    else if (flag == "--sleep-s") o.sleep_s = std::stod(value);
    else if (flag == "--calls") o.calls = std::stoi(value);
    else if (flag == "--priority") o.priority = std::stoi(value);  // std::out_of_range past an int32
    else if (flag == "--latency-out") o.latency_out = value;
    else if (flag == "--print") o.print = value;
    else if (flag == "--heartbeat-interval-s") o.client.heartbeat_interval_s = std::stod(value);
    else if (flag == "--heartbeat-timeout-s") o.client.heartbeat_timeout_s = std::stod(value);
    else if (flag == "--server-public-key") o.client.server_public_key = value;
    else if (flag == "--public-key") o.client.public_key = value;
    else if (flag == "--secret-key") o.client.secret_key = value;
    else throw std::invalid_argument("unknown option " + flag);
  }
  if (o.address.empty()) throw std::invalid_argument("--address is required");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "usage: client_call --address ADDRESS [options] (--help lists them)\n%s\n", e.what());
    return 2;
  }
  if (o.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::vector<float> obs(o.obs_dim);
  for (std::size_t i = 0; i < obs.size(); ++i) obs[i] = 0.01f * static_cast<float>(i);
  phyrt::Value::Map request{{"obs", phyrt::TensorView::of(obs.data(), {1, o.obs_dim})}};
  if (o.sleep_s > 0) request.push_back({"sleep", o.sleep_s});
  phyrt::Value payload(request);
  try {
    phyrt::Client client(o.address, o.client);
    phyrt::Value result = client.call(payload, o.timeout_s, o.priority);
    print_tensor(result[o.print].tensor());
    std::fflush(stdout);
    if (o.calls > 0) {
      std::vector<long long> ns;
      for (int i = 0; i < o.calls; ++i) {
        auto started = std::chrono::steady_clock::now();
        client.call(payload, o.timeout_s, o.priority);
        ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started)
                         .count());
      }
      std::ofstream out(o.latency_out.empty() ? "/dev/stderr" : o.latency_out);
      out << "{\"round_trip_ns\": [";
      for (std::size_t i = 0; i < ns.size(); ++i) out << (i ? ", " : "") << ns[i];
      out << "]}\n";
    }
  } catch (const std::exception& e) {
    int code = exit_code(e);
    std::fprintf(stderr, "phyrt error: %s: %s\n", class_name(code), e.what());
    return code;
  }
  return 0;
}
