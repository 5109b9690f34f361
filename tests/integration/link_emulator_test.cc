// The link emulator (tools/link_emulator.h) on real loopback sockets and real time: round trips
// and rates measured through it within 5% of what was asked, a window that holds a connection
// to one window per round trip, directions that do not share a rate, connections that do, and
// the cut and stall switches.
#include "tools/link_emulator.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/raw_push.h"
#include "common/status_matchers.h"

namespace aloe::tools {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;

// A connected blocking socket to `address`, or -1.
int Connect(const std::string& address) {
  absl::StatusOr<int> fd = ConnectTcp(address, absl::Seconds(5));
  if (!fd.ok()) return -1;
  fcntl(*fd, F_SETFL, fcntl(*fd, F_GETFL) & ~O_NONBLOCK);
  return *fd;
}

// Writes every byte; false when the connection broke or made no room for 30 s.
bool WriteAllBytes(int fd, const char* data, size_t n) {
  return WriteAll(fd, data, n, absl::Seconds(30)).ok();
}

// A loopback TCP server whose every connection is echoed, drained (recording when its bytes
// came) or fed a fixed number of bytes, each by its own thread.
class PeerServer {
 public:
  enum class Mode { kEcho, kSink, kSource };
  // What a drained connection received.
  struct Received {
    absl::Time first;  // the end of the first read
    absl::Time last;   // the end of the last read
    uint64_t bytes = 0;
    uint64_t first_read = 0;  // bytes of the first read
  };

  explicit PeerServer(Mode mode, uint64_t source_bytes = 0)
      : mode_(mode), source_bytes_(source_bytes) {
    absl::StatusOr<int> fd = ListenTcp("127.0.0.1:0", &port_);
    EXPECT_THAT(fd.status(), IsOk());
    listener_ = fd.ok() ? *fd : -1;
    acceptor_ = std::thread([this] {
      while (true) {
        const int fd = accept(listener_, nullptr, nullptr);
        if (fd < 0) return;
        absl::MutexLock lock(&mu_);
        fds_.push_back(fd);
        threads_.emplace_back([this, fd] { Serve(fd); });
      }
    });
  }
  ~PeerServer() {
    shutdown(listener_, SHUT_RDWR);
    acceptor_.join();
    close(listener_);
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    for (std::thread& t : threads_) t.join();
    for (int fd : fds_) close(fd);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // What the first n drained connections received, once they have ended (up to `timeout`).
  std::vector<Received> Drained(size_t n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto done = [&] { return drained_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
    return drained_;
  }

 private:
  void Serve(int fd) {
    std::vector<char> buffer(1 << 20, 'x');
    if (mode_ == Mode::kSource) {
      for (uint64_t left = source_bytes_; left > 0;) {
        const size_t n = std::min<uint64_t>(left, buffer.size());
        if (!WriteAllBytes(fd, buffer.data(), n)) return;
        left -= n;
      }
      shutdown(fd, SHUT_WR);
      return;
    }
    Received got;
    while (true) {
      const ssize_t r = recv(fd, buffer.data(), buffer.size(), 0);
      if (r <= 0) break;
      if (mode_ == Mode::kEcho) {
        if (!WriteAllBytes(fd, buffer.data(), static_cast<size_t>(r))) return;
        continue;
      }
      got.last = absl::Now();
      if (got.bytes == 0) {
        got.first = got.last;
        got.first_read = static_cast<uint64_t>(r);
      }
      got.bytes += static_cast<uint64_t>(r);
    }
    if (mode_ == Mode::kSink) {
      absl::MutexLock lock(&mu_);
      drained_.push_back(got);
    }
    shutdown(fd, SHUT_WR);  // the client's end answered with ours
  }

  const Mode mode_;
  const uint64_t source_bytes_;
  int port_ = 0;
  int listener_ = -1;
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<Received> drained_ ABSL_GUARDED_BY(mu_);
};

// Bits per second of a drained connection, from its first read to its last (the first read's
// bytes came before the clock started).
double Rate(const PeerServer::Received& r) {
  return (r.bytes - r.first_read) * 8.0 / absl::ToDoubleSeconds(r.last - r.first);
}

// Sends `bytes` to `address` and ends the stream.
void Upload(const std::string& address, uint64_t bytes) {
  const int fd = Connect(address);
  ASSERT_GE(fd, 0);
  std::vector<char> buffer(1 << 20, 'u');
  for (uint64_t left = bytes; left > 0;) {
    const size_t n = std::min<uint64_t>(left, buffer.size());
    ASSERT_TRUE(WriteAllBytes(fd, buffer.data(), n));
    left -= n;
  }
  shutdown(fd, SHUT_WR);
  char end;
  EXPECT_EQ(recv(fd, &end, 1, 0), 0);  // the upstream's end crosses back
  close(fd);
}

// Reads a connection to `address` to its end; returns its rate in bits per second as Rate().
double Download(const std::string& address, uint64_t* bytes) {
  const int fd = Connect(address);
  EXPECT_GE(fd, 0);
  std::vector<char> buffer(1 << 20);
  PeerServer::Received got;
  ssize_t r;
  while ((r = recv(fd, buffer.data(), buffer.size(), 0)) > 0) {
    got.last = absl::Now();
    if (got.bytes == 0) {
      got.first = got.last;
      got.first_read = static_cast<uint64_t>(r);
    }
    got.bytes += static_cast<uint64_t>(r);
  }
  close(fd);
  *bytes = got.bytes;
  return Rate(got);
}

LinkDirection Direction(double rate_bps, absl::Duration delay) {
  LinkDirection d;
  d.rate_bps = rate_bps;
  d.delay = delay;
  return d;
}

std::unique_ptr<LinkEmulator> StartLink(const std::vector<std::string>& upstreams,
                                        const LinkDirection& up, const LinkDirection& down) {
  LinkEmulatorOptions options;
  for (const std::string& u : upstreams) options.routes.push_back({"127.0.0.1:0", u});
  options.up = up;
  options.down = down;
  absl::StatusOr<std::unique_ptr<LinkEmulator>> link = LinkEmulator::Start(options);
  EXPECT_THAT(link.status(), IsOk());
  return link.ok() ? *std::move(link) : nullptr;
}

// One 64-byte message out and back; its round trip, or an infinite duration when it failed.
absl::Duration PingPong(int fd) {
  char out[64], back[64];
  std::memset(out, 'p', sizeof(out));
  const absl::Time t0 = absl::Now();
  if (!WriteAllBytes(fd, out, sizeof(out)) ||
      !SocketStream(fd, absl::Seconds(5)).ReadExactly(back, sizeof(back)).ok()) {
    return absl::InfiniteDuration();
  }
  return absl::Now() - t0;
}

TEST(LinkEmulatorTest, RefusesBadOptions) {
  EXPECT_THAT(LinkEmulator::Start({}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  LinkEmulatorOptions options;
  options.routes.push_back({"127.0.0.1:0", "127.0.0.1:1"});
  options.down.window_bytes = 0;
  EXPECT_THAT(LinkEmulator::Start(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  options.down.window_bytes = 1;
  options.up.delay = -absl::Milliseconds(1);
  EXPECT_THAT(LinkEmulator::Start(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

// Small messages pay the round trip and nothing less; the first pays the handshake too. The
// lower quartile is checked: on a loaded host the tail is the scheduler's, not the link's.
TEST(LinkEmulatorTest, RoundTripOfSmallMessagesIsTwiceTheDelay) {
  PeerServer echo(PeerServer::Mode::kEcho);
  const absl::Duration delay = absl::Milliseconds(25);
  std::unique_ptr<LinkEmulator> link =
      StartLink({echo.address()}, Direction(20e6, delay), Direction(20e6, delay));
  ASSERT_NE(link, nullptr);
  const int fd = Connect(link->address(0));
  ASSERT_GE(fd, 0);
  const absl::Duration first = PingPong(fd);
  EXPECT_GE(first, 4 * delay * 0.98) << "the handshake's round trip, then the message's";
  std::vector<absl::Duration> rtts;
  for (int i = 0; i < 32; ++i) rtts.push_back(PingPong(fd));
  close(fd);
  std::sort(rtts.begin(), rtts.end());
  const absl::Duration asked = 2 * delay;
  const absl::Duration quartile = rtts[rtts.size() / 4];
  std::printf("round trip asked %s: min %s, lower quartile %s, median %s, max %s\n",
              absl::FormatDuration(asked).c_str(), absl::FormatDuration(rtts.front()).c_str(),
              absl::FormatDuration(quartile).c_str(),
              absl::FormatDuration(rtts[rtts.size() / 2]).c_str(),
              absl::FormatDuration(rtts.back()).c_str());
  EXPECT_GE(rtts.front(), asked) << "a message came back early";
  EXPECT_NEAR(absl::FDivDuration(quartile, asked), 1.0, 0.05);
}

// Each direction has its own rate; connections in one direction share it.
TEST(LinkEmulatorTest, BulkRateIsTheLinkRateInEachDirectionSharedByConnections) {
  const double rate = 40e6;
  const uint64_t half = 8 << 20;
  PeerServer sink(PeerServer::Mode::kSink);
  PeerServer source(PeerServer::Mode::kSource, 2 * half);
  std::unique_ptr<LinkEmulator> link =
      StartLink({sink.address(), source.address()}, Direction(rate, absl::Milliseconds(10)),
                Direction(rate, absl::Milliseconds(10)));
  ASSERT_NE(link, nullptr);
  uint64_t downloaded = 0;
  double down_rate = 0;
  std::thread down([&] { down_rate = Download(link->address(1), &downloaded); });
  std::thread up0([&] { Upload(link->address(0), half); });
  std::thread up1([&] { Upload(link->address(0), half); });
  up0.join();
  up1.join();
  down.join();
  EXPECT_EQ(downloaded, 2 * half);
  const std::vector<PeerServer::Received> got = sink.Drained(2, absl::Seconds(30));
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].bytes + got[1].bytes, 2 * half);
  // The two uploads together: from the first byte in to the last.
  const absl::Time first = std::min(got[0].first, got[1].first);
  const absl::Time last = std::max(got[0].last, got[1].last);
  const double up_rate = (2 * half - got[0].first_read - got[1].first_read) * 8.0 /
                         absl::ToDoubleSeconds(last - first);
  std::printf("rate asked %.1f Mbit/s: up %.2f (two connections), down %.2f\n", rate / 1e6,
              up_rate / 1e6, down_rate / 1e6);
  EXPECT_NEAR(up_rate / rate, 1.0, 0.05) << up_rate / 1e6 << " Mbit/s up";
  EXPECT_NEAR(down_rate / rate, 1.0, 0.05) << down_rate / 1e6 << " Mbit/s down";
  const LinkStats stats = link->Stats();
  EXPECT_EQ(stats.up_bytes, 2 * half);
  EXPECT_EQ(stats.down_bytes, 2 * half);
  EXPECT_EQ(stats.connections, 3u);
}

// A connection with a window below the bandwidth-delay product moves one window per round trip.
TEST(LinkEmulatorTest, WindowLimitsAConnectionToOneWindowPerRoundTrip) {
  PeerServer sink(PeerServer::Mode::kSink);
  const absl::Duration delay = absl::Milliseconds(50);
  LinkDirection up = Direction(0, delay);
  up.window_bytes = 1 << 20;
  std::unique_ptr<LinkEmulator> link = StartLink({sink.address()}, up, Direction(0, delay));
  ASSERT_NE(link, nullptr);
  Upload(link->address(0), 24 << 20);
  const std::vector<PeerServer::Received> got = sink.Drained(1, absl::Seconds(30));
  ASSERT_EQ(got.size(), 1u);
  // The window's bytes come in bursts, one a round trip: the clock starts with the first one.
  const double rate =
      (got[0].bytes - up.window_bytes) * 8.0 / absl::ToDoubleSeconds(got[0].last - got[0].first);
  const double expected = up.window_bytes * 8.0 / absl::ToDoubleSeconds(2 * delay);
  std::printf("one window per round trip: %.2f Mbit/s, asked %.2f\n", rate / 1e6, expected / 1e6);
  EXPECT_NEAR(rate / expected, 1.0, 0.05) << rate / 1e6 << " Mbit/s";
}

// An echo server behind a link of 2 ms each way, and one connection through it that has
// carried a message both ways.
struct EchoThroughLink {
  EchoThroughLink()
      : echo(PeerServer::Mode::kEcho),
        link(StartLink({echo.address()}, Direction(0, absl::Milliseconds(2)),
                       Direction(0, absl::Milliseconds(2)))),
        fd(link != nullptr ? Connect(link->address(0)) : -1) {
    if (fd >= 0) {
      EXPECT_LT(PingPong(fd), absl::Seconds(1));
    }
  }
  ~EchoThroughLink() {
    if (fd >= 0) close(fd);
  }
  PeerServer echo;
  std::unique_ptr<LinkEmulator> link;
  int fd;
};

TEST(LinkEmulatorTest, CutResetsOpenConnectionsAndNewOnesWork) {
  EchoThroughLink t;
  ASSERT_GE(t.fd, 0);
  t.link->Cut();
  pollfd p{t.fd, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 2000), 1) << "the cut connection did not end";
  char byte;
  EXPECT_LE(recv(t.fd, &byte, 1, 0), 0);
  const int again = Connect(t.link->address(0));
  ASSERT_GE(again, 0);
  EXPECT_LT(PingPong(again), absl::Seconds(1));
  close(again);
  EXPECT_EQ(t.link->Stats().connections, 2u);
}

TEST(LinkEmulatorTest, StallHoldsBytesUntilResumeAndLosesNone) {
  EchoThroughLink t;
  ASSERT_GE(t.fd, 0);
  t.link->Stall();
  const char message[] = "held while stalled";
  ASSERT_TRUE(WriteAllBytes(t.fd, message, sizeof(message)));
  pollfd p{t.fd, POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 300), 0) << "bytes crossed a stalled link";
  t.link->Resume();
  char back[sizeof(message)];
  ASSERT_THAT(SocketStream(t.fd, absl::Seconds(2)).ReadExactly(back, sizeof(back)), IsOk());
  EXPECT_EQ(std::string(back, sizeof(back)), std::string(message, sizeof(message)));
}

}  // namespace
}  // namespace aloe::tools
