// Accepts raw push connections (common/raw_push.h) on a TCP port and serves each on a thread of
// its own: reads a push's prelude, lets the handler read the payload and decide, writes the
// reply, and waits for the connection's next push. A refused push ends its connection (its
// payload is left unread); so do a malformed prelude (after a reply naming the problem), a peer
// that stalls for `io_timeout` inside a push, and an idle connection after `idle_timeout`.
// With TLS (Options.tls) every connection starts with a TLS handshake (common/tls_stream.h);
// one that fails it, or that opens with a plaintext push (answered with kUnauthenticated in
// plaintext), ends before anything is read, with a warning naming the peer and the reason.
// Thread-safe. Shutdown (also run by the destructor) closes the listener and every connection
// and joins every thread.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/raw_push.h"
#include "common/tls_stream.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

class RawPushListener {
 public:
  // Reads the payload of `request` from `in` (exactly request.payload_bytes, or fails) and
  // answers. `cancelled` turns true once the listener shuts down or the client hung up: a
  // handler waiting (for admission, a staging slot) should give up then. Called on the
  // connection's thread, several at once.
  using Handler = std::function<absl::StatusOr<v1::PushReply>(
      const RawPushRequest& request, ByteReader& in, const std::function<bool()>& cancelled)>;

  struct Options {
    absl::Duration io_timeout = absl::Seconds(60);    // no progress inside a push
    absl::Duration idle_timeout = absl::Minutes(30);  // no push on a connection
    int max_connections = 1024;                       // more are closed at once
    std::shared_ptr<const TlsContext> tls;            // null: plaintext
  };

  // Listens on `address` (host:port; port 0 = any, see port()). kInvalidArgument for a malformed
  // address, kUnavailable when it cannot bind.
  static absl::StatusOr<std::unique_ptr<RawPushListener>> Start(const std::string& address,
                                                                Handler handler, Options options);
  RawPushListener(const RawPushListener&) = delete;
  RawPushListener& operator=(const RawPushListener&) = delete;
  ~RawPushListener();

  int port() const { return port_; }
  void Shutdown();

 private:
  struct Connection {
    int fd = -1;
    std::thread thread;
    bool done = false;
  };

  RawPushListener(int fd, int port, Handler handler, Options options);
  void AcceptLoop();
  void Serve(Connection* connection);
  // The connection's TLS session; null, having answered or warned, when it is refused.
  std::unique_ptr<TlsStream> Secure(int fd);
  // Takes in what the client still sends after its refusal, until it closes or stalls: closing
  // with unread data would reset the connection and lose the reply.
  void Drain(int fd);
  // Joins and forgets the connections whose thread has ended.
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int listen_fd_;
  const int port_;
  const Handler handler_;
  const Options options_;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe::server
