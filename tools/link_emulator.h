// A long, slow network link emulated by a userspace TCP proxy, for the tests and benchmarks that
// put it between workers and servers (aloe-linkemu, tools/linkemu_main.cc, runs one on its own).
// The kernel of the development hosts has no netem qdisc, and a proxy needs no privileges.
//
// Every byte that enters the link leaves it after the link has serialised it at its rate (one
// queue per direction, shared by every connection) and after the one-way delay, plus jitter
// (order kept). The endpoints' own TCP windows are on loopback, so the emulator keeps one of its
// own: each connection has at most `window_bytes` unacknowledged per direction, and a delivered
// byte is acknowledged one reverse delay after it was handed to the receiver. A connection moves
// at most one window per round trip, as over a real link; windows of the protocols on top
// (HTTP/2 flow control) cross the link as the bytes they are and pay the same round trip.
// A new connection carries bytes one round trip after it was accepted (the TCP handshake).
//
// Faults: Cut() resets every open connection (new ones are accepted); Stall() holds every byte
// where it is, connections open, until Resume().
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace aloe::tools {

// One direction of the link.
struct LinkDirection {
  double rate_bps = 0;  // bits per second; 0 = no limit
  absl::Duration delay = absl::ZeroDuration();
  // Extra delay of each piece of the stream, uniform in [0, jitter]; a piece never overtakes the
  // one before it (TCP delivers in order).
  absl::Duration jitter = absl::ZeroDuration();
  // Unacknowledged bytes one connection may have in this direction: the TCP window of the
  // emulated endpoints. The default is what hosts tuned for long links reach.
  uint64_t window_bytes = uint64_t{64} << 20;
};

// One listening port of the emulator and where its connections go.
struct LinkRoute {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 = any
  std::string upstream;                // host:port
};

struct LinkEmulatorOptions {
  std::vector<LinkRoute> routes;  // at least one
  LinkDirection up;               // from the connecting side to the upstream
  LinkDirection down;             // back
  uint64_t seed = 1;              // of the jitter
};

// Bytes delivered so far and connections accepted.
struct LinkStats {
  uint64_t up_bytes = 0;
  uint64_t down_bytes = 0;
  uint64_t connections = 0;
};

// Thread-safe. Runs an accept thread per route and four threads per open connection (a reader
// and a writer per direction, blocking I/O in chunks of about a millisecond of the link's rate).
class LinkEmulator {
 public:
  // Listens on every route. kInvalidArgument for no route, a rate below 0, a negative delay or
  // jitter or a window of 0; kUnavailable when a route cannot listen.
  static absl::StatusOr<std::unique_ptr<LinkEmulator>> Start(const LinkEmulatorOptions& options);
  ~LinkEmulator();  // Shutdown()
  LinkEmulator(const LinkEmulator&) = delete;
  LinkEmulator& operator=(const LinkEmulator&) = delete;

  // The port route `route` listens on, and "127.0.0.1:port" (the listen host for others).
  int port(size_t route) const;
  std::string address(size_t route) const;

  // Resets every open connection: both of its ends see the connection end.
  void Cut();
  // Holds every byte in the link (connections stay open and new ones are accepted) until
  // Resume(); what arrived meanwhile is delivered at once then.
  void Stall();
  void Resume();
  LinkStats Stats() const;

  // Closes the listeners and every connection and joins every thread. Idempotent.
  void Shutdown();

 private:
  struct Connection;
  struct Listener;
  explicit LinkEmulator(const LinkEmulatorOptions& options);

  void AcceptLoop(Listener* listener);
  void Open(int client_fd, const std::string& upstream);
  // Joins and frees the connections whose threads have all ended.
  void Reap();
  // When the last byte of a piece of `bytes` entering direction `dir` (0 up, 1 down) now leaves
  // the link's queue: the link serialises pieces one after the other at its rate.
  absl::Time Serialise(int dir, uint64_t bytes, absl::Time now);
  absl::Duration Jitter(int dir);

  const LinkEmulatorOptions options_;
  std::vector<std::unique_ptr<Listener>> listeners_;
  int wake_fd_ = -1;  // an eventfd that stops the accept loops

  std::atomic<uint64_t> delivered_[2] = {0, 0};  // bytes handed to receivers, per direction

  mutable absl::Mutex link_mu_;
  absl::Time busy_until_[2] ABSL_GUARDED_BY(link_mu_);
  uint64_t rng_state_ ABSL_GUARDED_BY(link_mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace aloe::tools
