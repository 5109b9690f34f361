#include "tools/link_emulator.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/raw_push.h"

namespace aloe::tools {
namespace {

// The emulator reads and delivers the stream in pieces of about this much of the link's time:
// short enough that a piece's serialisation adds little to a round trip, long enough that a
// fast link costs a few thousand system calls a second.
constexpr absl::Duration kPieceTime = absl::Milliseconds(1);
constexpr size_t kMinPieceBytes = 4 << 10;
constexpr size_t kMaxPieceBytes = 1 << 20;
// At most this much is written to a receiver in one go (pieces that arrived together).
constexpr uint64_t kMaxBatchBytes = 4 << 20;
// How long an upstream may take to accept a connection.
constexpr absl::Duration kConnectTimeout = absl::Seconds(5);

size_t PieceBytes(double rate_bps) {
  if (rate_bps <= 0) return kMaxPieceBytes;
  const double bytes = rate_bps / 8 * absl::ToDoubleSeconds(kPieceTime);
  return std::clamp(static_cast<size_t>(bytes), kMinPieceBytes, kMaxPieceBytes);
}

// Writes all of data[0, n) to a blocking socket; false when the connection broke.
bool WriteFully(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

void MakeBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

std::string ValidateDirection(const char* name, const LinkDirection& d) {
  if (!(d.rate_bps >= 0)) return absl::StrCat(name, ": rate must be >= 0");
  if (d.delay < absl::ZeroDuration() || d.jitter < absl::ZeroDuration()) {
    return absl::StrCat(name, ": delay and jitter must be >= 0");
  }
  if (d.window_bytes == 0) return absl::StrCat(name, ": window must be > 0");
  return "";
}

}  // namespace

struct LinkEmulator::Listener {
  int fd = -1;
  int port = 0;
  std::string host;
  std::string upstream;
  std::thread thread;
};

// One proxied connection: the client's socket, the upstream's, and a pipe per direction.
struct LinkEmulator::Connection {
  // A piece of the stream in the link: data[0, size) reaches the receiver at `arrival`.
  struct Piece {
    absl::Time arrival;
    std::vector<char> data;
    size_t size = 0;
  };
  // Every field is guarded by Connection::mu.
  struct Pipe {
    int from = -1;
    int to = -1;
    std::deque<Piece> queue;  // read, not yet delivered; arrivals never decrease
    // (when, bytes): delivered bytes whose acknowledgement reaches the sender at `when`.
    std::deque<std::pair<absl::Time, uint64_t>> acks;
    uint64_t in_flight = 0;  // read and not yet acknowledged
    bool eof = false;        // the sender ended its stream: the receiver's ends after the queue
    absl::Time last_arrival = absl::InfinitePast();
    std::vector<std::vector<char>> spare;  // piece buffers to reuse
    absl::CondVar reader_cv;
    absl::CondVar writer_cv;
  };

  absl::Mutex mu;
  int client_fd = -1;
  int upstream_fd = -1;
  Pipe pipes[2];  // [0] client -> upstream, [1] upstream -> client
  absl::Time open_at;
  bool dead ABSL_GUARDED_BY(mu) = false;  // cut or broken: every thread ends
  bool stalled ABSL_GUARDED_BY(mu) = false;
  int ended ABSL_GUARDED_BY(mu) = 0;  // threads that have returned (4: reapable)
  std::thread threads[4];

  // Ends the connection: both ends see it go (a reset where the kernel can), every thread
  // wakes and returns.
  void Kill() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (dead) return;
    dead = true;
    const linger reset{1, 0};
    for (int fd : {client_fd, upstream_fd}) {
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
      shutdown(fd, SHUT_RDWR);
    }
    for (Pipe& p : pipes) {
      p.reader_cv.SignalAll();
      p.writer_cv.SignalAll();
    }
  }

  void ReadLoop(LinkEmulator& link, int dir);
  void WriteLoop(LinkEmulator& link, int dir);
};

void LinkEmulator::Connection::ReadLoop(LinkEmulator& link, int dir) {
  Pipe& p = pipes[dir];
  const LinkDirection& params = dir == 0 ? link.options_.up : link.options_.down;
  const size_t piece_max = PieceBytes(params.rate_bps);
  std::vector<char> buffer;
  mu.Lock();
  // The handshake: nothing moves until a round trip after the accept.
  while (!dead && absl::Now() < open_at) p.reader_cv.WaitWithDeadline(&mu, open_at);
  while (!dead) {
    // Wait for room in the window, taking in the acknowledgements that have come back.
    const absl::Time now = absl::Now();
    while (!p.acks.empty() && p.acks.front().first <= now) {
      p.in_flight -= p.acks.front().second;
      p.acks.pop_front();
    }
    if (p.in_flight >= params.window_bytes) {
      p.reader_cv.WaitWithDeadline(&mu,
                                   p.acks.empty() ? absl::InfiniteFuture() : p.acks.front().first);
      continue;
    }
    const size_t room = std::min<uint64_t>(piece_max, params.window_bytes - p.in_flight);
    if (!p.spare.empty()) {
      buffer = std::move(p.spare.back());
      p.spare.pop_back();
    } else {
      buffer.resize(piece_max);
    }
    mu.Unlock();
    ssize_t n;
    do {
      n = read(p.from, buffer.data(), room);
    } while (n < 0 && errno == EINTR);
    absl::Time arrival;
    if (n > 0) {
      arrival = link.Serialise(dir, static_cast<uint64_t>(n), absl::Now()) + params.delay +
                link.Jitter(dir);
    }
    mu.Lock();
    if (dead) break;
    if (n <= 0) {
      // The sender's end (n == 0) follows its bytes; an error resets the whole connection.
      if (n == 0) {
        p.eof = true;
        p.writer_cv.Signal();
      } else {
        Kill();
      }
      break;
    }
    arrival = std::max(arrival, p.last_arrival);
    p.last_arrival = arrival;
    p.queue.push_back(Piece{arrival, std::move(buffer), static_cast<size_t>(n)});
    p.in_flight += static_cast<uint64_t>(n);
    p.writer_cv.Signal();
  }
  ++ended;
  mu.Unlock();
}

void LinkEmulator::Connection::WriteLoop(LinkEmulator& link, int dir) {
  Pipe& p = pipes[dir];
  // An acknowledgement crosses the link the other way.
  const absl::Duration ack_delay = dir == 0 ? link.options_.down.delay : link.options_.up.delay;
  std::vector<Piece> batch;
  mu.Lock();
  while (!dead) {
    const absl::Time now = absl::Now();
    const bool due = !p.queue.empty() && p.queue.front().arrival <= now;
    if (stalled || !due) {
      if (!stalled && p.queue.empty() && p.eof) {
        shutdown(p.to, SHUT_WR);  // the sender's end, after its last byte
        break;
      }
      p.writer_cv.WaitWithDeadline(
          &mu, stalled || p.queue.empty() ? absl::InfiniteFuture() : p.queue.front().arrival);
      continue;
    }
    uint64_t bytes = 0;
    while (!p.queue.empty() && p.queue.front().arrival <= now && bytes < kMaxBatchBytes) {
      bytes += p.queue.front().size;
      batch.push_back(std::move(p.queue.front()));
      p.queue.pop_front();
    }
    mu.Unlock();
    bool ok = true;
    for (const Piece& piece : batch) ok = ok && WriteFully(p.to, piece.data.data(), piece.size);
    const absl::Time delivered = absl::Now();
    mu.Lock();
    if (!ok) {
      Kill();
      break;
    }
    link.delivered_[dir].fetch_add(bytes, std::memory_order_relaxed);
    p.acks.emplace_back(delivered + ack_delay, bytes);
    p.reader_cv.Signal();
    for (Piece& piece : batch) p.spare.push_back(std::move(piece.data));
    batch.clear();
  }
  ++ended;
  mu.Unlock();
}

LinkEmulator::LinkEmulator(const LinkEmulatorOptions& options)
    : options_(options), rng_state_(options.seed * 0x9E3779B97F4A7C15ull + 1) {
  busy_until_[0] = busy_until_[1] = absl::InfinitePast();
}

absl::StatusOr<std::unique_ptr<LinkEmulator>> LinkEmulator::Start(
    const LinkEmulatorOptions& options) {
  if (options.routes.empty()) return absl::InvalidArgumentError("link emulator: no route");
  for (const auto& [name, d] : {std::pair{"up", options.up}, std::pair{"down", options.down}}) {
    if (std::string bad = ValidateDirection(name, d); !bad.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("link emulator: ", bad));
    }
  }
  std::unique_ptr<LinkEmulator> link(new LinkEmulator(options));
  link->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (link->wake_fd_ < 0) return absl::UnavailableError("link emulator: eventfd failed");
  for (const LinkRoute& route : options.routes) {
    auto listener = std::make_unique<Listener>();
    absl::StatusOr<int> fd = ListenTcp(route.listen, &listener->port);
    if (!fd.ok()) {
      return absl::UnavailableError(absl::StrCat("link emulator: ", fd.status().message()));
    }
    listener->fd = *fd;
    listener->host = route.listen.substr(0, route.listen.rfind(':'));
    listener->upstream = route.upstream;
    link->listeners_.push_back(std::move(listener));
  }
  for (const std::unique_ptr<Listener>& listener : link->listeners_) {
    listener->thread = std::thread(&LinkEmulator::AcceptLoop, link.get(), listener.get());
  }
  return link;
}

LinkEmulator::~LinkEmulator() {
  Shutdown();
  if (wake_fd_ >= 0) close(wake_fd_);
}

int LinkEmulator::port(size_t route) const { return listeners_[route]->port; }

std::string LinkEmulator::address(size_t route) const {
  return absl::StrCat(listeners_[route]->host, ":", listeners_[route]->port);
}

absl::Time LinkEmulator::Serialise(int dir, uint64_t bytes, absl::Time now) {
  const double rate = dir == 0 ? options_.up.rate_bps : options_.down.rate_bps;
  if (rate <= 0) return now;
  absl::MutexLock lock(&link_mu_);
  busy_until_[dir] = std::max(now, busy_until_[dir]) + absl::Seconds(bytes * 8.0 / rate);
  return busy_until_[dir];
}

absl::Duration LinkEmulator::Jitter(int dir) {
  const absl::Duration jitter = dir == 0 ? options_.up.jitter : options_.down.jitter;
  if (jitter <= absl::ZeroDuration()) return absl::ZeroDuration();
  absl::MutexLock lock(&link_mu_);
  // xorshift64*: cheap, and the same seed gives the same jitter sequence.
  rng_state_ ^= rng_state_ >> 12;
  rng_state_ ^= rng_state_ << 25;
  rng_state_ ^= rng_state_ >> 27;
  const uint64_t r = rng_state_ * 0x2545F4914F6CDD1Dull;
  return jitter * (static_cast<double>(r >> 11) / static_cast<double>(uint64_t{1} << 53));
}

void LinkEmulator::AcceptLoop(Listener* listener) {
  while (true) {
    pollfd fds[2] = {{listener->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int ready = poll(fds, 2, 1000);
    if (fds[1].revents != 0) return;
    Reap();
    if (ready <= 0 || fds[0].revents == 0) continue;
    const int fd = accept4(listener->fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) Open(fd, listener->upstream);
  }
}

void LinkEmulator::Open(int client_fd, const std::string& upstream) {
  absl::StatusOr<int> upstream_fd = ConnectTcp(upstream, kConnectTimeout);
  if (!upstream_fd.ok()) {
    ALOE_LOG_WARNING("linkemu", "upstream %s: %s", upstream, upstream_fd.status().message());
    const linger reset{1, 0};
    setsockopt(client_fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    close(client_fd);
    return;
  }
  MakeBlocking(*upstream_fd);
  const int one = 1;
  setsockopt(client_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto c = std::make_unique<Connection>();
  c->client_fd = client_fd;
  c->upstream_fd = *upstream_fd;
  c->pipes[0].from = c->pipes[1].to = client_fd;
  c->pipes[1].from = c->pipes[0].to = *upstream_fd;
  c->open_at = absl::Now() + options_.up.delay + options_.down.delay;
  absl::MutexLock lock(&mu_);
  if (stopped_) {
    close(client_fd);
    close(*upstream_fd);
    return;
  }
  {
    absl::MutexLock connection_lock(&c->mu);
    c->stalled = stalled_;
  }
  ++accepted_;
  Connection* raw = c.get();
  for (int dir = 0; dir < 2; ++dir) {
    raw->threads[2 * dir] = std::thread(&Connection::ReadLoop, raw, std::ref(*this), dir);
    raw->threads[2 * dir + 1] = std::thread(&Connection::WriteLoop, raw, std::ref(*this), dir);
  }
  connections_.push_back(std::move(c));
}

void LinkEmulator::Reap() {
  std::vector<std::unique_ptr<Connection>> done;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      bool finished;
      {
        absl::MutexLock connection_lock(&(*it)->mu);
        finished = (*it)->ended == 4;
      }
      if (finished) {
        done.push_back(std::move(*it));
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (std::unique_ptr<Connection>& c : done) {
    for (std::thread& t : c->threads) t.join();
    close(c->client_fd);
    close(c->upstream_fd);
  }
}

void LinkEmulator::Cut() {
  absl::MutexLock lock(&mu_);
  for (const std::unique_ptr<Connection>& c : connections_) {
    absl::MutexLock connection_lock(&c->mu);
    c->Kill();
  }
}

void LinkEmulator::Stall() {
  absl::MutexLock lock(&mu_);
  stalled_ = true;
  for (const std::unique_ptr<Connection>& c : connections_) {
    absl::MutexLock connection_lock(&c->mu);
    c->stalled = true;
  }
}

void LinkEmulator::Resume() {
  absl::MutexLock lock(&mu_);
  stalled_ = false;
  for (const std::unique_ptr<Connection>& c : connections_) {
    absl::MutexLock connection_lock(&c->mu);
    c->stalled = false;
    for (Connection::Pipe& p : c->pipes) p.writer_cv.Signal();
  }
}

LinkStats LinkEmulator::Stats() const {
  LinkStats stats;
  stats.up_bytes = delivered_[0].load(std::memory_order_relaxed);
  stats.down_bytes = delivered_[1].load(std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  stats.connections = accepted_;
  return stats;
}

void LinkEmulator::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) != sizeof(one)) {
    ALOE_LOG_WARNING("linkemu", "cannot wake the accept threads");
  }
  for (const std::unique_ptr<Listener>& listener : listeners_) {
    if (listener->thread.joinable()) listener->thread.join();
    close(listener->fd);
  }
  std::vector<std::unique_ptr<Connection>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(connections_);
  }
  for (const std::unique_ptr<Connection>& c : all) {
    absl::MutexLock connection_lock(&c->mu);
    c->Kill();
  }
  for (const std::unique_ptr<Connection>& c : all) {
    for (std::thread& t : c->threads) t.join();
    close(c->client_fd);
    close(c->upstream_fd);
  }
}

}  // namespace aloe::tools
