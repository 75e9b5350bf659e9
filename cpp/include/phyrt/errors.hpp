// The exceptions a phyrt::Client raises: a server's error reply, a lost connection, a malformed reply.
//
// They mirror runtime/client/errors.py; type() is the name a reply's error.type carries on the
// wire (docs/protocol.md, "Error types"):
//
//   Error (std::runtime_error)                 every phyrt error
//   |-- ProtocolError                          a reply this client cannot read (never sent)
//   `-- ServerError                            any error reply; an unknown type keeps its name
//       |-- InvalidRequestError                InvalidRequest
//       |-- DeadlineExceededError              DeadlineExceeded (also raised by call() itself)
//       |-- OverloadedError                    Overloaded
//       |-- PluginError                        PluginError
//       |-- CancelledError                     Cancelled (Python cancels the future instead)
//       `-- ServerUnavailableError             EngineUnavailable
//           `-- ConnectionLostError            raised by the client itself, never sent
//               `-- HandshakeError             the server refused this client's CURVE handshake
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>

namespace phyrt {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A reply that breaks the protocol (bad msgpack, a tensor reference that does not fit its frame).
class ProtocolError : public Error {
 public:
  using Error::Error;
};

class ServerError : public Error {
 public:
  ServerError(const std::string& message, std::optional<std::uint64_t> request_id = std::nullopt,
              std::string type = "ServerError")
      : Error(message), request_id_(request_id), type_(std::move(type)) {}
  // The wire name of the error ("InvalidRequest", ...); "ServerError" for an unknown one.
  const std::string& type() const noexcept { return type_; }
  // The id of the request it answers (none when the server could not tell).
  std::optional<std::uint64_t> request_id() const noexcept { return request_id_; }

 private:
  std::optional<std::uint64_t> request_id_;
  std::string type_;
};

#define PHYRT_ERROR(Name, Base, Wire)                                                          \
  class Name : public Base {                                                                  \
   public:                                                                                    \
    explicit Name(const std::string& message, std::optional<std::uint64_t> request_id = std::nullopt, \
                  std::string type = Wire)                                                    \
        : Base(message, request_id, std::move(type)) {}                                       \
  };

PHYRT_ERROR(InvalidRequestError, ServerError, "InvalidRequest")
PHYRT_ERROR(DeadlineExceededError, ServerError, "DeadlineExceeded")
PHYRT_ERROR(OverloadedError, ServerError, "Overloaded")
PHYRT_ERROR(PluginError, ServerError, "PluginError")
PHYRT_ERROR(CancelledError, ServerError, "Cancelled")
PHYRT_ERROR(ServerUnavailableError, ServerError, "EngineUnavailable")
PHYRT_ERROR(ConnectionLostError, ServerUnavailableError, "ConnectionLost")
PHYRT_ERROR(HandshakeError, ConnectionLostError, "Handshake")
#undef PHYRT_ERROR

// The exception for an error reply {type, message}, as an exception_ptr of its own class.
inline std::exception_ptr error_from_reply(const std::string& type, const std::string& message,
                                           std::optional<std::uint64_t> request_id) {
  if (type == "InvalidRequest") return std::make_exception_ptr(InvalidRequestError(message, request_id));
  if (type == "DeadlineExceeded") return std::make_exception_ptr(DeadlineExceededError(message, request_id));
  if (type == "Overloaded") return std::make_exception_ptr(OverloadedError(message, request_id));
  if (type == "PluginError") return std::make_exception_ptr(PluginError(message, request_id));
  if (type == "Cancelled") return std::make_exception_ptr(CancelledError(message, request_id));
  if (type == "EngineUnavailable") return std::make_exception_ptr(ServerUnavailableError(message, request_id));
  return std::make_exception_ptr(ServerError(type + ": " + message, request_id));
}

}  // namespace phyrt
