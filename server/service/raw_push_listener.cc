#include "server/service/raw_push_listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe::server {
namespace {

// "host:port" of the peer of socket `fd`, for warnings.
std::string PeerOf(int fd) {
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  char host[INET6_ADDRSTRLEN] = "";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return "an unknown peer";
  if (peer.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&peer);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return absl::StrFormat("[%s]:%d", host, ntohs(a->sin6_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&peer);
  inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
  return absl::StrFormat("%s:%d", host, ntohs(a->sin_port));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RawPushListener>> RawPushListener::Start(const std::string& address,
                                                                        Handler handler,
                                                                        Options options) {
  int port = 0;
  absl::StatusOr<int> fd = ListenTcp(address, &port);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<RawPushListener> listener(
      new RawPushListener(*fd, port, std::move(handler), options));
  listener->acceptor_ = std::thread([l = listener.get()] { l->AcceptLoop(); });
  return listener;
}

RawPushListener::RawPushListener(int fd, int port, Handler handler, Options options)
    : listen_fd_(fd), port_(port), handler_(std::move(handler)), options_(options) {}

RawPushListener::~RawPushListener() { Shutdown(); }

void RawPushListener::Shutdown() {
  if (stopping_.exchange(true)) return;
  shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
  if (acceptor_.joinable()) acceptor_.join();
  close(listen_fd_);
  std::list<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    for (Connection& c : connections_) shutdown(c.fd, SHUT_RDWR);  // wakes its reads
    connections.splice(connections.end(), connections_);
  }
  for (Connection& c : connections) {
    if (c.thread.joinable()) c.thread.join();
    close(c.fd);
  }
}

void RawPushListener::Reap() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    it->thread.join();  // has returned already
    close(it->fd);
    it = connections_.erase(it);
  }
}

void RawPushListener::AcceptLoop() {
  bool warned = false;
  while (!stopping_.load()) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopping_.load()) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      // EMFILE and the like: back off instead of spinning.
      ALOE_LOG_WARNING("raw-push", "accept: %s", std::strerror(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    absl::MutexLock lock(&mu_);
    Reap();
    if (static_cast<int>(connections_.size()) >= options_.max_connections) {
      if (!warned) {
        ALOE_LOG_WARNING("raw-push", "%d connections open: closing new ones",
                         options_.max_connections);
        warned = true;
      }
      close(fd);
      continue;
    }
    Connection& c = connections_.emplace_back();
    c.fd = fd;
    c.thread = std::thread([this, &c] { Serve(&c); });
  }
}

void RawPushListener::Serve(Connection* connection) {
  const int fd = connection->fd;
  std::unique_ptr<TlsStream> tls = options_.tls != nullptr ? Secure(fd) : nullptr;
  const bool refused = options_.tls != nullptr && tls == nullptr;
  SocketStream plain(fd, options_.io_timeout);
  ByteStream& stream = tls != nullptr ? static_cast<ByteStream&>(*tls) : plain;
  while (!refused && !stopping_.load()) {
    // Between pushes a connection may idle for a whole training round.
    if (!stream.HasBuffered()) {
      pollfd p{fd, POLLIN, 0};
      const int ready =
          poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(options_.idle_timeout)));
      if (ready <= 0 && !(ready < 0 && errno == EINTR)) break;
      if (ready < 0) continue;
    }
    bool nothing_read = true;
    absl::StatusOr<RawPushRequest> request = ReadRawPushPrelude(stream, &nothing_read);
    const std::function<bool()> cancelled = [this, fd] {
      if (stopping_.load()) return true;
      pollfd hung{fd, POLLRDHUP, 0};
      return poll(&hung, 1, 0) > 0 && (hung.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
    };
    absl::StatusOr<v1::PushReply> reply = request.ok()
                                              ? handler_(*request, stream, cancelled)
                                              : absl::StatusOr<v1::PushReply>(request.status());
    if (!request.ok() &&
        (nothing_read || request.status().code() != absl::StatusCode::kInvalidArgument)) {
      break;  // closed between pushes, or broken: nobody to answer
    }
    const std::string bytes =
        EncodeRawPushReply(reply.status(), reply.ok() ? *reply : v1::PushReply());
    if (!stream.WriteAll(bytes.data(), bytes.size()).ok()) break;
    if (!reply.ok()) {
      // The client reads the reply once it has sent the whole payload.
      if (tls != nullptr) tls->Close();
      Drain(fd);
      break;
    }
  }
  tls.reset();
  shutdown(fd, SHUT_RDWR);
  absl::MutexLock lock(&mu_);
  connection->done = true;
}

std::unique_ptr<TlsStream> RawPushListener::Secure(int fd) {
  // A TLS client opens with a handshake record (content type 22); the first byte of a raw push's
  // magic is a client that speaks no TLS here. One that sends nothing, or hangs up, gets no
  // answer.
  if (!WaitForSocket(fd, POLLIN, options_.io_timeout).ok()) return nullptr;
  char first = 0;
  const ssize_t peeked = recv(fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
  if (peeked <= 0) return nullptr;
  if (first == static_cast<char>(kRawPushMagic & 0xff)) {
    ALOE_LOG_WARNING("raw-push", "refused a plaintext raw push from %s: this listener takes TLS",
                     PeerOf(fd));
    const std::string reply = EncodeRawPushReply(
        absl::UnauthenticatedError(
            "raw push: this listener takes TLS only (the server has TLS configured): connect "
            "with TLS, as aloe-worker does given --tls_ca_file"),
        v1::PushReply());
    if (WriteAll(fd, reply.data(), reply.size(), options_.io_timeout).ok()) Drain(fd);
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<TlsStream>> tls = options_.tls->Accept(fd, options_.io_timeout);
  if (!tls.ok()) {
    if (stopping_.load()) return nullptr;
    ALOE_LOG_WARNING("raw-push", "refused a raw push connection from %s: %s", PeerOf(fd),
                     tls.status().message());
    // The client may be sending its first push already, and reads why (an alert) after it.
    Drain(fd);
    return nullptr;
  }
  return *std::move(tls);
}

void RawPushListener::Drain(int fd) {
  shutdown(fd, SHUT_WR);
  char scratch[64 << 10];
  const int wait_ms = static_cast<int>(absl::ToInt64Milliseconds(options_.io_timeout));
  while (!stopping_.load()) {
    pollfd more{fd, POLLIN, 0};
    if (poll(&more, 1, wait_ms) == 0) break;
    const ssize_t r = recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
}

}  // namespace aloe::server
