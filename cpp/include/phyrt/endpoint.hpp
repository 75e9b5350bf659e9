// Whether a server listens at an ipc:// address: ipc_unreachable, as runtime/transport/endpoints.py's.
//
// libzmq retries a connect to a missing or dead ipc:// path silently, so without this a request to a
// wrong address would wait for the heartbeat timeout and fail with "no word from the server". A stat
// and a plain AF_UNIX connect (non-blocking: a listener with a full backlog answers EAGAIN) tell at once.
#pragma once

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>

namespace phyrt {

// Why no server can answer at ``address``: no socket file at its path, a file that is not a socket,
// or a socket nobody listens on (left by a server that is gone); nothing when one listens, or for
// another transport (tcp://).
inline std::optional<std::string> ipc_unreachable(const std::string& address) {
  static const std::string scheme = "ipc://";
  if (address.compare(0, scheme.size(), scheme) != 0) return std::nullopt;
  const std::string path = address.substr(scheme.size());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return "cannot connect to " + path + ": too long for a unix socket path";
  std::memcpy(addr.sun_path, path.data(), path.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
  if (!path.empty() && path[0] == '@') {  // abstract: no file to look at, the connect alone tells
    addr.sun_path[0] = '\0';
    len -= 1;
  } else {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return "no socket at " + path;
      return "cannot look at " + path + ": " + std::strerror(errno);
    }
    if (!S_ISSOCK(st.st_mode)) return path + " is not a socket";
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;  // cannot tell: libzmq tries
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len);
  int err = errno;
  ::close(fd);
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS) return std::nullopt;
  if (err == ECONNREFUSED)
    return "nothing listens at " + path + " (connection refused: a socket file left by a server that is gone?)";
  return "cannot connect to " + path + ": " + std::strerror(err);
}

}  // namespace phyrt
