// InFlight: a client's requests in flight, each completed exactly once, with no lock held.
//
//   caller: add(id, done)              the request is about to be sent
//   I/O thread: complete(id, ...)      its reply; a late reply (failed here already) is ignored
//   anyone: fail(id, E), fail_all(E)   a deadline, silence, a lost connection, close()
//   I/O thread: silent(now, ...)       the ids with no word from the server for too long
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "phyrt/value.hpp"

namespace phyrt {

// A request's outcome, as a completion callback gets it: a result, or an exception.
using Completion = std::function<void(Value* result, std::exception_ptr error)>;

class InFlight {
 public:
  using Clock = std::chrono::steady_clock;

  void add(std::uint64_t id, Completion done) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.emplace(id, Pending{std::move(done), Clock::now()});
  }

  // Forget ``id`` without completing it; whether it was still in flight (then the caller owns it).
  bool take(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return pending_.erase(id) == 1;
  }

  void complete(std::uint64_t id, Value* result, std::exception_ptr error) {
    Completion done;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pending_.find(id);
      if (it == pending_.end()) return;  // failed here already (deadline, silence): a late reply
      done = std::move(it->second.done);
      pending_.erase(it);
    }
    done(result, error);
  }

  template <class E> void fail(std::uint64_t id, E error) { complete(id, nullptr, std::make_exception_ptr(error)); }

  // Fail every request in flight with ``make(id)``.
  template <class Make> void fail_all(Make make) {
    std::unordered_map<std::uint64_t, Pending> failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed.swap(pending_);
    }
    for (auto& [id, p] : failed) p.done(nullptr, std::make_exception_ptr(make(id)));
  }

  // The requests sent, and not heard of since ``last_heard``, more than ``timeout`` ago.
  std::vector<std::uint64_t> silent(Clock::time_point now, Clock::time_point last_heard,
                                    std::chrono::duration<double> timeout) {
    std::vector<std::uint64_t> ids;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, p] : pending_)
      if (now - std::max(p.sent_at, last_heard) > timeout) ids.push_back(id);
    return ids;
  }

 private:
  struct Pending {
    Completion done;
    Clock::time_point sent_at;
  };

  std::mutex mutex_;
  std::unordered_map<std::uint64_t, Pending> pending_;
};

}  // namespace phyrt
