// phyrt::Client: a header-only C++17 client of a phyrt server (cppzmq + msgpack-cxx), from docs/protocol.md.
//
//   caller threads                                           I/O thread ("phyrt-client")       server
//   submit(payload, timeout, priority) / call(...): encode (one copy of
//     each tensor into a frame), pending[id], outbox, wake --> send -- [header, *frames] ---->  ROUTER
//                                                              poll <-- [header, *frames] ---
//   std::future / callback  <------------------------------- decode, complete pending[id]
//                                                            every heartbeat_interval_s: ping "heartbeat";
//                                                            a request with no word from the server for
//                                                            heartbeat_timeout_s fails (ConnectionLostError)
//                                                            socket monitor (HandshakeWatch): a connection
//                                                            lost after its handshake fails everything in
//                                                            flight; a refused handshake -> HandshakeError
//   no server listening at an ipc:// path (ipc_unreachable, at connect and again at each request
//   while so): submit throws ServerUnavailableError naming the path, at once
//
// Invariants:
// - Only the I/O thread touches the DEALER socket and its monitor; callers hand it messages through
//   ``outbox_`` (under ``mutex_``) and wake it through a pipe.
// - Every request completes exactly once: its reply, a failure here (lost connection, silence, a
//   send that could not go, close()), or call()'s deadline; completions run with no lock held, on
//   the I/O thread (or on the thread that failed them).
// - Tensors go as frames only: no shared memory (docs/protocol.md says what ipc:// peers may add).
// - close() (also the destructor) fails what is in flight, joins the thread, closes the sockets.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "phyrt/codec.hpp"
#include "phyrt/endpoint.hpp"
#include "phyrt/handshake.hpp"
#include "phyrt/inflight.hpp"

namespace phyrt {

struct ClientOptions {
  double heartbeat_interval_s = 1.0;
  double heartbeat_timeout_s = 5.0;
  // CURVE (z85 text, 40 characters each): all empty for plain ZMQ. public_key may stay empty
  // (derived from secret_key).
  std::string server_public_key, public_key, secret_key;
};

class Client {
 public:
  explicit Client(std::string address, ClientOptions options = {})
      : address_(std::move(address)),
        options_(std::move(options)),
        ctx_(1),
        sock_(ctx_, zmq::socket_type::dealer),
        watch_(address_, !options_.server_public_key.empty()) {
    if (address_.find("://") == std::string::npos)
      throw std::invalid_argument("address must look like ipc:///path or tcp://host:port, got " + address_);
    if (!(0 < options_.heartbeat_interval_s && options_.heartbeat_interval_s < options_.heartbeat_timeout_s))
      throw std::invalid_argument("need 0 < heartbeat_interval_s < heartbeat_timeout_s");
    if (::pipe2(wake_, O_NONBLOCK | O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
    try {
      configure();
      static std::atomic<unsigned> monitors{0};
      std::string endpoint = "inproc://phyrt-monitor-" + std::to_string(monitors++);
      if (zmq_socket_monitor(sock_.handle(), endpoint.c_str(), kMonitoredEvents) != 0) throw zmq::error_t();
      monitor_ = zmq::socket_t(ctx_, zmq::socket_type::pair);
      monitor_.set(zmq::sockopt::linger, 0);
      monitor_.connect(endpoint);
      sock_.connect(address_);
      unreachable_ = ipc_unreachable(address_);
      thread_ = std::thread([this] { run(); });
    } catch (...) {
      ::close(wake_[0]);
      ::close(wake_[1]);
      throw;
    }
  }

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client() { close(); }

  // Send one request; ``done`` gets its result or error once, on the client's I/O thread (keep it
  // short: it holds up other replies). ``timeout_s``: the request's deadline on the server.
  // ``priority``: larger is served sooner by the server's engine; 0 (the default) is not sent.
  std::uint64_t submit(const Value& payload, std::optional<double> timeout_s, Completion done,
                       std::int32_t priority = 0) {
    check_timeout(timeout_s);
    std::uint64_t id = next_id_++;
    Value::Map fields{{"v", kProtocolVersion}, {"op", "submit"}, {"id", id}};
    if (timeout_s) fields.push_back({"timeout_s", *timeout_s});
    if (priority != 0) fields.push_back({"priority", static_cast<std::int64_t>(priority)});
    auto message = encode_message(fields, &payload);  // before the request counts as in flight
    enqueue(id, std::move(message), std::move(done));
    return id;
  }

  // Send one request; the future gets the result, or throws a ServerError subclass.
  std::future<Value> submit(const Value& payload, std::optional<double> timeout_s = std::nullopt,
                            std::int32_t priority = 0) {
    auto promise = std::make_shared<std::promise<Value>>();
    auto future = promise->get_future();
    submit(payload, timeout_s, promised(promise), priority);
    return future;
  }

  // submit() and wait: past ``timeout_s`` (also the server's deadline) DeadlineExceededError, and
  // the server is asked to drop the request if it is still queued.
  Value call(const Value& payload, std::optional<double> timeout_s = std::nullopt, std::int32_t priority = 0) {
    auto promise = std::make_shared<std::promise<Value>>();
    auto future = promise->get_future();
    std::uint64_t id = submit(payload, timeout_s, promised(promise), priority);
    return wait(future, id, timeout_s, true);
  }

  // Round-trip time to the server's I/O thread, in seconds.
  double ping(double timeout_s = 5.0) {
    auto started = std::chrono::steady_clock::now();
    control("ping", {}, timeout_s);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }

  // The server's plugin, topology, replicas, versions and limits (a map).
  Value info(double timeout_s = 5.0) { return control("info", {}, timeout_s); }

  // Ask the server to cancel request ``id`` (submit's); true if it was still queued and is dropped.
  bool cancel(std::uint64_t id, double timeout_s = 5.0) {
    Value reply = control("cancel", {{"target", id}}, timeout_s);
    const Value* cancelled = reply.find("cancelled");
    return cancelled != nullptr && std::holds_alternative<bool>(cancelled->v) && cancelled->as_bool();
  }

  const std::string& address() const noexcept { return address_; }

  // Fail what is in flight (ConnectionLostError), stop the I/O thread, close the sockets. Idempotent.
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);  // a submit either got in before, or sees closed_
      if (closed_.exchange(true)) return;
    }
    wake();
    if (thread_.joinable()) thread_.join();
    inflight_.fail_all([&](std::uint64_t id) { return ConnectionLostError("the client of " + address_ + " was closed", id); });
    monitor_.close();
    sock_.close();
    ctx_.close();
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

 private:
  using Clock = std::chrono::steady_clock;

  static Completion promised(std::shared_ptr<std::promise<Value>> promise) {
    return [promise](Value* result, std::exception_ptr error) {
      if (error) promise->set_exception(error);
      else promise->set_value(std::move(*result));
    };
  }

  static void check_timeout(std::optional<double> timeout_s) {
    if (timeout_s && !(*timeout_s > 0 && *timeout_s <= 1e7))
      throw std::invalid_argument("timeout must be a number of seconds in (0, 1e7]");
  }

  void configure() {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.set(zmq::sockopt::rcvhwm, 0);  // replies are never dropped on this side
    sock_.set(zmq::sockopt::sndhwm, 100000);
    sock_.set(zmq::sockopt::reconnect_ivl, 100);
    sock_.set(zmq::sockopt::reconnect_ivl_max, 1000);
    if (options_.server_public_key.empty()) return;
    if (options_.secret_key.empty())
      throw std::invalid_argument("CURVE needs this client's secret_key too (public_key is derived from it)");
    std::string pub = options_.public_key;
    if (pub.empty()) {
      char derived[41];
      if (zmq_curve_public(derived, options_.secret_key.c_str()) != 0) throw zmq::error_t();
      pub.assign(derived, 40);
    }
    sock_.set(zmq::sockopt::curve_serverkey, options_.server_public_key);
    sock_.set(zmq::sockopt::curve_secretkey, options_.secret_key);
    sock_.set(zmq::sockopt::curve_publickey, pub);
  }

  Value control(const std::string& op, Value::Map extra, double timeout_s) {
    std::uint64_t id = next_id_++;
    Value::Map fields{{"v", kProtocolVersion}, {"op", op}, {"id", id}};
    for (auto& e : extra) fields.push_back(std::move(e));
    auto promise = std::make_shared<std::promise<Value>>();
    auto future = promise->get_future();
    enqueue(id, encode_message(fields), promised(promise));
    return wait(future, id, timeout_s, false);
  }

  Value wait(std::future<Value>& future, std::uint64_t id, std::optional<double> timeout_s, bool cancel_late) {
    if (timeout_s && future.wait_for(std::chrono::duration<double>(*timeout_s)) != std::future_status::ready) {
      std::unique_lock<std::mutex> lock(mutex_);
      if (inflight_.take(id)) {  // still ours to fail: nobody else completes it now
        if (cancel_late)
          outbox_.emplace_back(std::nullopt, encode_message({{"v", kProtocolVersion}, {"op", "cancel"},
                                                             {"id", "cancel"}, {"target", id}}));
        lock.unlock();
        wake();
        throw DeadlineExceededError("no result within " + std::to_string(*timeout_s) + " s from " + address_, id);
      }
    }
    return future.get();
  }

  void enqueue(std::uint64_t id, std::vector<zmq::message_t>&& message, Completion done) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) throw ConnectionLostError("the client of " + address_ + " is closed", id);
      if (refused_) throw HandshakeError(*refused_, id);
      if (unreachable_) unreachable_ = ipc_unreachable(address_);  // it may have come up since
      if (unreachable_)
        throw ServerUnavailableError(*unreachable_ + ": is the server running, with this address on its ready line?", id);
      inflight_.add(id, std::move(done));
      outbox_.emplace_back(id, std::move(message));
    }
    wake();
  }

  void wake() {
    char byte = 1;
    [[maybe_unused]] auto n = ::write(wake_[1], &byte, 1);  // a full pipe wakes the thread just as well
  }

  // -- the I/O thread ------------------------------------------------------------------------

  void run() {
    auto interval = std::chrono::duration<double>(options_.heartbeat_interval_s);
    auto next_beat = Clock::now();
    zmq::pollitem_t items[] = {{sock_.handle(), 0, ZMQ_POLLIN, 0},
                               {monitor_.handle(), 0, ZMQ_POLLIN, 0},
                               {nullptr, wake_[0], ZMQ_POLLIN, 0}};
    try {
      while (!closed_) {
        auto now = Clock::now();
        if (now >= next_beat) {
          heartbeat(now);
          next_beat = now + std::chrono::duration_cast<Clock::duration>(interval);
        }
        auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - Clock::now()).count() + 1;
        zmq::poll(items, 3, std::chrono::milliseconds(wait));
        if (items[2].revents & ZMQ_POLLIN) {
          char buf[256];
          while (::read(wake_[0], buf, sizeof buf) > 0) {
          }
        }
        flush();
        if (items[0].revents & ZMQ_POLLIN) read_replies();
        if (items[1].revents & ZMQ_POLLIN) read_monitor();
      }
    } catch (const std::exception& e) {  // a bug or a broken socket must not leave callers waiting
      std::string why = std::string("the client's I/O thread failed: ") + e.what();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        refused_ = why;
      }
      inflight_.fail_all([&](std::uint64_t id) { return ConnectionLostError(why, id); });
    }
  }

  void flush() {
    std::deque<std::pair<std::optional<std::uint64_t>, std::vector<zmq::message_t>>> out;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      out.swap(outbox_);
    }
    for (auto& [id, message] : out) {
      bool sent = true;
      try {
        for (std::size_t i = 0; i < message.size() && sent; ++i)
          sent = sock_.send(message[i], i + 1 < message.size() ? zmq::send_flags::sndmore | zmq::send_flags::dontwait
                                                               : zmq::send_flags::dontwait).has_value();
      } catch (const zmq::error_t&) {
        sent = false;
      }
      if (!sent && id)
        inflight_.fail(*id, ConnectionLostError("the send queue to the server is full (is it reachable?): " + address_,
                                                *id));
    }
  }

  void read_replies() {
    while (true) {
      std::vector<zmq::message_t> message;
      zmq::message_t part;
      if (!sock_.recv(part, zmq::recv_flags::dontwait)) return;
      bool more = part.more();
      message.push_back(std::move(part));
      while (more) {
        zmq::message_t next;
        (void)sock_.recv(next);  // the parts of a message arrive together
        more = next.more();
        message.push_back(std::move(next));
      }
      handle(std::move(message));
    }
  }

  void handle(std::vector<zmq::message_t>&& message) {
    last_heard_ = Clock::now();
    Value header;
    try {
      header = decode_message(std::move(message));
    } catch (const ProtocolError& e) {  // no id to answer: the request fails by silence at the latest
      std::fprintf(stderr, "phyrt: dropped a malformed reply from %s: %s\n", address_.c_str(), e.what());
      return;
    }
    const Value* id_value = header.find("id");
    const Value* op = header.find("op");
    bool is_ping = op != nullptr && std::holds_alternative<std::string>(op->v) && op->as_string() == "ping";
    if (is_ping) check_server(header);
    if (id_value == nullptr || !std::holds_alternative<std::uint64_t>(id_value->v)) return;  // "heartbeat", ...
    std::uint64_t id = std::get<std::uint64_t>(id_value->v);
    const Value* ok = header.find("ok");
    if (ok != nullptr && std::holds_alternative<bool>(ok->v) && ok->as_bool()) {
      Value result = header.find("result") ? header["result"] : Value();
      inflight_.complete(id, &result, nullptr);
      return;
    }
    std::string type = "ServerError", text = "malformed error reply";
    if (const Value* error = header.find("error"); error != nullptr && error->is_map()) {
      if (const Value* t = error->find("type"); t && std::holds_alternative<std::string>(t->v)) type = t->as_string();
      if (const Value* m = error->find("message"); m && std::holds_alternative<std::string>(m->v)) text = m->as_string();
    }
    inflight_.complete(id, nullptr, error_from_reply(type, text, id));
  }

  // A ping's answer names the server instance: a new one means the old one and its requests are gone.
  void check_server(const Value& header) {
    const Value* result = header.find("result");
    const Value* sid = result != nullptr ? result->find("server_id") : nullptr;
    if (sid == nullptr || !std::holds_alternative<std::string>(sid->v) || sid->as_string() == server_id_) return;
    if (!server_id_.empty())
      inflight_.fail_all([&](std::uint64_t id) {
        return ConnectionLostError("the server at " + address_ + " restarted while request " + std::to_string(id) +
                                   " was in flight (send it again)", id);
      });
    server_id_ = sid->as_string();
  }

  void heartbeat(Clock::time_point now) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!refused_)  // nothing would carry it
        outbox_.emplace_back(std::nullopt, encode_message({{"v", kProtocolVersion}, {"op", "ping"}, {"id", "heartbeat"}}));
    }
    auto timeout = std::chrono::duration<double>(options_.heartbeat_timeout_s);
    for (auto id : inflight_.silent(now, last_heard_, timeout))
      inflight_.fail(id, ConnectionLostError("no word from the server at " + address_ + " for more than " +
                                   std::to_string(options_.heartbeat_timeout_s) +
                                   " s (heartbeat_timeout_s) while request " + std::to_string(id) + " was in flight",
                                   id));
  }

  void read_monitor() {
    while (true) {
      zmq::message_t event, endpoint;
      if (!monitor_.recv(event, zmq::recv_flags::dontwait)) return;
      if (event.more()) (void)monitor_.recv(endpoint);
      if (event.size() < 6) continue;
      std::uint16_t kind;
      std::uint32_t value;
      std::memcpy(&kind, event.data(), 2);
      std::memcpy(&value, event.data<char>() + 2, 4);
      on_event(kind, value);
    }
  }

  void on_event(std::uint16_t kind, std::uint32_t value) {
    Verdict verdict = watch_.on_event(kind, value);
    if (verdict.action == Verdict::Served) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!refused_for_good_) refused_.reset();
    } else if (verdict.action == Verdict::Lost) {
      inflight_.fail_all([&](std::uint64_t id) {
        return ConnectionLostError("the connection to the server at " + address_ + " was lost while request " +
                                   std::to_string(id) + " was in flight (the client reconnects by itself; send it "
                                   "again)", id);
      });
    } else if (verdict.action == Verdict::Refused) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        refused_ = verdict.message;
        refused_for_good_ = refused_for_good_ || verdict.permanent;
      }
      inflight_.fail_all([&](std::uint64_t id) { return HandshakeError(verdict.message, id); });
    }
  }

  std::string address_;
  ClientOptions options_;
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  zmq::socket_t monitor_;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::atomic<bool> closed_{false};
  std::atomic<std::uint64_t> next_id_{0};
  InFlight inflight_;
  std::mutex mutex_;  // outbox_, refused_, refused_for_good_, unreachable_
  std::deque<std::pair<std::optional<std::uint64_t>, std::vector<zmq::message_t>>> outbox_;
  std::optional<std::string> refused_;
  bool refused_for_good_ = false;
  std::optional<std::string> unreachable_;  // why no server listens at the ipc:// path, while none does
  // the I/O thread's alone
  Clock::time_point last_heard_ = Clock::now();
  std::string server_id_;
  HandshakeWatch watch_;
};

}  // namespace phyrt
