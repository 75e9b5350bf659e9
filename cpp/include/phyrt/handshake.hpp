// What a client's socket monitor reports: HandshakeWatch turns libzmq's events into what to do.
// The C++ twin of runtime/client/handshake.py:
//
//   event                              verdict
//   HANDSHAKE_SUCCEEDED                Served: the connection carries requests; a refusal is forgotten
//                                      unless it was for good
//   DISCONNECTED after a handshake     Lost: the requests in flight fail (ConnectionLostError)
//   DISCONNECTED before one            none: no request reached the server; they stay queued
//   HANDSHAKE_FAILED_PROTOCOL, _AUTH   Refused for good: libzmq gives the address up (HandshakeError)
//   HANDSHAKE_FAILED_NO_DETAIL         the server dropped the handshake (a wrong server key): the
//                                      second in a row, with no handshake between, is Refused
#pragma once

#include <zmq.h>

#include <cstdint>
#include <string>

namespace phyrt {

// The events a client's monitor asks for (one or two per connection, none per request).
inline constexpr int kMonitoredEvents = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED |
                                        ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                        ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

struct Verdict {
  enum Action { None, Served, Lost, Refused } action = None;
  std::string message;  // Refused: why, naming the likely cause
  bool permanent = false;
};

class HandshakeWatch {
 public:
  HandshakeWatch(std::string address, bool curve) : address_(std::move(address)), curve_(curve) {}

  Verdict on_event(std::uint16_t kind, std::uint32_t value) {
    if (kind == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      handshaken_ = true;
      drops_ = 0;
      return {Verdict::Served, "", false};
    }
    if (kind == ZMQ_EVENT_DISCONNECTED) {
      bool was = handshaken_;
      handshaken_ = false;
      return {was ? Verdict::Lost : Verdict::None, "", false};
    }
    if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
      if (++drops_ < 2) return {};
      return {Verdict::Refused, failed(curve_ ? "the server dropped it: is server_public_key this server's public key?"
                                              : "the server dropped it: if it requires CURVE, pass server_public_key "
                                                "and this client's secret_key")};
    }
    if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
      std::string why = value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                            ? (curve_ ? "the server does not use CURVE: leave out server_public_key and this client's keys"
                                      : "the server requires CURVE: pass server_public_key and this client's secret_key")
                            : "ZMTP protocol error " + std::to_string(value) + ": is a phyrt server listening there?";
      return {Verdict::Refused, failed(why), true};
    }
    if (kind == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
      return {Verdict::Refused,
              failed("authentication refused, status " + std::to_string(value) +
                     (curve_ ? ": is this client's public key among the server's authorized clients?" : "")),
              true};
    return {};
  }

 private:
  std::string failed(const std::string& why) const {
    return "the " + std::string(curve_ ? "CURVE " : "") + "handshake with " + address_ + " failed (" + why + ")";
  }

  std::string address_;
  bool curve_;
  bool handshaken_ = false;
  int drops_ = 0;
};

}  // namespace phyrt
