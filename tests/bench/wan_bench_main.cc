// aloe-bench-wan: push and pull goodput of one worker to a running aloe-server across emulated
// long links (tools/link_emulator.h), against a bulk raw TCP transfer of the same bytes over the
// same emulated link in the same run.
//
// For each link of --links (rate and round-trip time) a LinkEmulator carries routes to the
// server's gRPC port, to its raw push listener (JoinReply.push_address, when it has one), to a
// bulk TCP peer in this process and, with --tls_server, to a second server's gRPC port and raw
// push listener that take mutual TLS only (certificates of --tls). Per turn (--repeats turns, in
// order): raw TCP up (the update's bytes, then a one-byte answer: the shape of a push and its
// reply), a push over gRPC, a raw push, the same two over TLS, raw TCP down (a request, then the
// update's bytes: the shape of a pull), a pull of the latest version over gRPC and one over TLS.
// Each is timed from its first byte sent to its last byte received. The raw TCP baseline stays
// plaintext: TLS rows show what encryption costs against the link itself.
// The first --warmup transfers of each kind on a link are not measured: a worker's connections
// carry every round, and gRPC's probed windows settle within its first few. A pull's receive
// windows are the worker's: its pulls go in --pull_streams parts, each on a connection of its
// own (worker::ClientOptions::pull_streams), so that they fill the link while probing is still
// growing each connection's window. The server must run in plain async mode with no
// stop condition (scripts/bench/wan.sh); pushes carry zeros so the model does not drift.
//
// One table row per link, direction and path: median seconds per transfer, goodput, raw TCP's
// goodput and the ratio. Last line:
//   "wan: worst <link> <direction> <path> ratio=<min ratio> (raw TCP over the same link)".
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/allocator.h"
#include "common/flags_usage.h"
#include "common/model_spec.h"
#include "common/raw_push.h"
#include "tests/bench/join_with_retry.h"
#include "tools/link_emulator.h"
#include "worker/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7070", "aloe-server gRPC address (plain async mode)");
ABSL_FLAG(std::string, links, "100:100,1000:80,2500:20",
          "Emulated links, comma-separated RATE_MBIT:RTT_MS (each direction has the rate and half "
          "the round trip)");
ABSL_FLAG(int32_t, repeats, 3, "Measured transfers of each kind per link, taken in turns");
ABSL_FLAG(int32_t, warmup, 3,
          "Transfers of each kind per link before the measured ones, not measured: a worker's "
          "connections carry every round, so their windows start each round where the last left "
          "them");
ABSL_FLAG(bool, verbose, false, "Print every transfer's seconds");
ABSL_FLAG(uint64_t, window_kib, 65536,
          "The emulated TCP window per connection and direction, KiB (hosts tuned for long "
          "links: docs/operations.md)");
ABSL_FLAG(std::string, tls_server, "",
          "gRPC address of a second aloe-server (plain async mode) that takes mutual TLS only, "
          "with the certificates of --tls (scripts/make-test-ca.sh); \"\" = no TLS rows");
ABSL_FLAG(std::string, tls, "",
          "With --tls_server: a directory of scripts/make-test-ca.sh (ca.pem, client.pem, "
          "client.key); its server certificate names localhost, which the workers verify");
ABSL_FLAG(
    uint32_t, pull_streams, 4,
    "Concurrent streams per pull, each one slice of every layer (ClientOptions.pull_streams)");
ABSL_FLAG(double, join_seconds, 30, "How long to retry Join while the server answers UNAVAILABLE");

namespace aloe::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Link {
  double mbit = 0;
  double rtt_ms = 0;
  std::string name;  // "1000M/80ms"
};

absl::StatusOr<std::vector<Link>> ParseLinks(const std::string& flag) {
  std::vector<Link> links;
  for (absl::string_view entry : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> parts = absl::StrSplit(entry, ':');
    Link link;
    if (!absl::SimpleAtod(parts.first, &link.mbit) ||
        !absl::SimpleAtod(parts.second, &link.rtt_ms) || !(link.mbit > 0) || !(link.rtt_ms >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--links: bad entry '", entry, "' (want RATE_MBIT:RTT_MS)"));
    }
    link.name = absl::StrCat(parts.first, "M/", parts.second, "ms");
    links.push_back(link);
  }
  if (links.empty()) return absl::InvalidArgumentError("--links: none");
  return links;
}

// Blocking transfers of the baseline; false when the connection broke or stood still for 60 s.
bool WriteFully(int fd, const char* data, size_t n) {
  return WriteAll(fd, data, n, absl::Seconds(60)).ok();
}
bool ReadFully(int fd, char* out, size_t n) {
  return SocketStream(fd, absl::Seconds(60)).ReadExactly(out, n).ok();
}

// The far end of the raw TCP baseline. Each request is 9 bytes: 'u' (up) or 'd' (down) and a
// u64 byte count n. Up: it reads n bytes, then answers one byte. Down: it sends n bytes.
class BulkPeer {
 public:
  BulkPeer() {
    absl::StatusOr<int> fd = ListenTcp("127.0.0.1:0", &port_);
    if (!fd.ok()) {
      std::fprintf(stderr, "bulk peer: %s\n", fd.status().ToString().c_str());
      std::exit(1);
    }
    listener_ = *fd;
    acceptor_ = std::thread([this] {
      while (true) {
        const int fd = accept(listener_, nullptr, nullptr);
        if (fd < 0) return;
        absl::MutexLock lock(&mu_);
        fds_.push_back(fd);
        threads_.emplace_back([fd] { Serve(fd); });
      }
    });
  }
  ~BulkPeer() {
    shutdown(listener_, SHUT_RDWR);
    acceptor_.join();
    close(listener_);
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    for (std::thread& t : threads_) t.join();
    for (int fd : fds_) close(fd);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  static void Serve(int fd) {
    std::vector<char> buffer(1 << 20, 'x');
    char request[9];
    while (ReadFully(fd, request, sizeof(request))) {
      uint64_t n = 0;
      std::memcpy(&n, request + 1, sizeof(n));
      for (uint64_t left = n; left > 0;) {
        const size_t chunk = std::min<uint64_t>(left, buffer.size());
        const bool ok = request[0] == 'u' ? ReadFully(fd, buffer.data(), chunk)
                                          : WriteFully(fd, buffer.data(), chunk);
        if (!ok) return;
        left -= chunk;
      }
      if (request[0] == 'u' && !WriteFully(fd, "k", 1)) return;
    }
  }

  int port_ = 0;
  int listener_ = -1;
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// One raw TCP transfer of `bytes` over `fd` to the BulkPeer, up or down; seconds, or -1.
double BulkTransfer(int fd, bool up, uint64_t bytes) {
  static const std::vector<char> payload(1 << 20, 'x');
  std::vector<char> sink(1 << 20);
  char request[9];
  request[0] = up ? 'u' : 'd';
  std::memcpy(request + 1, &bytes, sizeof(bytes));
  const auto t0 = Clock::now();
  if (!WriteFully(fd, request, sizeof(request))) return -1;
  for (uint64_t left = bytes; left > 0;) {
    const size_t chunk = std::min<uint64_t>(left, payload.size());
    const bool ok = up ? WriteFully(fd, payload.data(), chunk) : ReadFully(fd, sink.data(), chunk);
    if (!ok) return -1;
    left -= chunk;
  }
  char answer;
  if (up && !ReadFully(fd, &answer, 1)) return -1;
  return Since(t0);
}

// A simulated worker across the link: joined, with its own channel (and raw connection).
class LinkWorker {
 public:
  LinkWorker(worker::ClientOptions options, const std::string& address, bool raw) {
    options.address = address;
    options.raw_push = raw;
    options.pull_streams = absl::GetFlag(FLAGS_pull_streams);
    client_ = std::make_unique<worker::ServerClient>(options);
  }
  // Joins; raw_address is where this worker's raw pushes go ("" = gRPC only).
  bool Join(const std::string& name, const std::string& raw_address) {
    absl::StatusOr<v1::JoinReply> reply =
        JoinWithRetry(*client_, name, absl::GetFlag(FLAGS_join_seconds));
    if (!reply.ok()) {
      std::fprintf(stderr, "join: %s\n", reply.status().ToString().c_str());
      return false;
    }
    id_ = reply->worker_id();
    spec_ = reply->model_spec();
    for (const v1::LayerSpec& layer : spec_.layers())
      zeros_.emplace_back(layer.num_elements(), 0.f);
    absl::Status set = client_->SetShards({}, {}, raw_address);
    if (!set.ok()) std::fprintf(stderr, "raw push address: %s\n", set.ToString().c_str());
    return set.ok();
  }
  ~LinkWorker() {
    if (id_ != 0) (void)client_->Leave(id_);
  }
  uint64_t UpdateBytes() const { return 4 * TotalElements(spec_); }

  // One push of a zero update under a fresh task; seconds of the Push call, or -1.
  double Push() {
    absl::StatusOr<v1::Task> task = client_->RequestTask(id_);
    if (!task.ok() || task->kind() != v1::Task::TRAIN) {
      std::fprintf(stderr, "task: %s\n",
                   task.ok() ? "not a TRAIN task" : task.status().ToString().c_str());
      return -1;
    }
    v1::HeartbeatRequest pulled;  // the version is held: the server need not keep it
    pulled.set_worker_id(id_);
    pulled.set_pulled_task_id(task->task_id());
    (void)client_->Heartbeat(pulled);
    v1::PushHeader header;
    header.set_worker_id(id_);
    header.set_task_id(task->task_id());
    header.set_update_id(++update_id_);
    header.set_base_version(task->base_version());
    header.set_steps_done(task->local_steps());
    header.set_tokens_learned(1);
    header.set_codec(v1::CODEC_FP32);
    uint64_t bytes = 0;
    const auto t0 = Clock::now();
    absl::StatusOr<v1::PushReply> reply =
        client_->Push(header, spec_, zeros_, {}, 256, nullptr, &bytes);
    const double seconds = Since(t0);
    if (!reply.ok()) {
      std::fprintf(stderr, "push: %s\n", reply.status().ToString().c_str());
      return -1;
    }
    return seconds;
  }

  // One pull of the latest version; seconds, or -1.
  double Pull() {
    uint64_t bytes = 0;
    const auto t0 = Clock::now();
    absl::StatusOr<uint64_t> version = client_->Pull(id_, 0, true, spec_, &pulled_, &bytes);
    const double seconds = Since(t0);
    if (!version.ok()) {
      std::fprintf(stderr, "pull: %s\n", version.status().ToString().c_str());
      return -1;
    }
    return seconds;
  }

 private:
  std::unique_ptr<worker::ServerClient> client_;
  uint64_t id_ = 0;
  uint64_t update_id_ = 0;
  v1::ModelSpec spec_;
  std::vector<std::vector<float>> zeros_;
  std::vector<std::vector<float>> pulled_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// How the workers reach the TLS server: mutual TLS with the certificates of --tls, verifying the
// name its test certificate holds (the workers dial the emulator, not the server). Exits 2 when a
// file cannot be read.
worker::ClientOptions TlsOptions() {
  worker::ClientOptions options;
  const std::string dir = absl::GetFlag(FLAGS_tls);
  const absl::Status loaded = worker::LoadClientFiles(
      {"", dir + "/ca.pem", dir + "/client.pem", dir + "/client.key"}, &options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "--tls: %s\n", std::string(loaded.message()).c_str());
    std::exit(2);
  }
  options.tls_server_name = "localhost";
  return options;
}

// Where the server at `options.address` takes raw pushes (JoinReply.push_address; "" = none),
// and the update size.
std::string ServerPushAddress(const worker::ClientOptions& options, uint64_t* update_bytes) {
  worker::ServerClient client(options);
  absl::StatusOr<v1::JoinReply> reply =
      JoinWithRetry(client, "bench-wan-probe", absl::GetFlag(FLAGS_join_seconds));
  if (!reply.ok()) {
    std::fprintf(stderr, "join: %s\n", reply.status().ToString().c_str());
    std::exit(1);
  }
  (void)client.Leave(reply->worker_id());
  *update_bytes = 4 * TotalElements(reply->model_spec());
  return reply->push_address();
}

// One kind of transfer in a turn: direction ("up" or "down"), path ("tcp" for the baseline) and
// the transfer itself (seconds, or -1).
struct Kind {
  const char* direction;
  const char* path;
  std::function<double()> run;
};

int Main() {
  absl::StatusOr<std::vector<Link>> links = ParseLinks(absl::GetFlag(FLAGS_links));
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (!links.ok() || repeats < 1 || absl::GetFlag(FLAGS_warmup) < 0) {
    std::fprintf(stderr, "%s\n",
                 links.ok() ? "--repeats must be >= 1 and --warmup >= 0"
                            : links.status().ToString().c_str());
    return 2;
  }
  const std::string server = absl::GetFlag(FLAGS_server);
  const std::string tls_server = absl::GetFlag(FLAGS_tls_server);
  const bool tls = !tls_server.empty();
  worker::ClientOptions plain_options, tls_options;
  plain_options.address = server;
  if (tls) {
    tls_options = TlsOptions();
    tls_options.address = tls_server;
  }
  uint64_t update_bytes = 0, tls_update_bytes = 0;
  const std::string push_address = ServerPushAddress(plain_options, &update_bytes);
  const std::string tls_push_address = tls ? ServerPushAddress(tls_options, &tls_update_bytes) : "";
  if (tls && tls_update_bytes != update_bytes) {
    std::fprintf(stderr, "--tls_server: its update has %llu bytes, --server's %llu\n",
                 static_cast<unsigned long long>(tls_update_bytes),
                 static_cast<unsigned long long>(update_bytes));
    return 2;
  }
  const uint64_t window = absl::GetFlag(FLAGS_window_kib) << 10;
  std::printf(
      "update: %.1f MiB of fp32; emulated TCP window %llu KiB per connection and direction; "
      "raw pushes: %s; TLS rows: %s\n",
      update_bytes / 1048576.0, static_cast<unsigned long long>(window >> 10),
      push_address.empty() ? "none (the server has no --push_listen)" : push_address.c_str(),
      tls ? "mutual TLS 1.3 to --tls_server (the raw TCP baseline stays plaintext)" : "none");
  std::printf("%-12s %-9s %-8s %12s %10s %16s %7s\n", "link", "direction", "path", "s/transfer",
              "Mbit/s", "raw TCP Mbit/s", "ratio");
  std::fflush(stdout);
  BulkPeer peer;
  double worst = 1e9;
  std::string worst_row;
  int errors = 0;
  for (const Link& link : *links) {
    // Routes: 0 gRPC, 1 raw pushes, 2 the bulk peer, 3 and 4 the TLS server's gRPC and raw pushes.
    tools::LinkEmulatorOptions options;
    options.routes.push_back({"127.0.0.1:0", server});
    options.routes.push_back({"127.0.0.1:0", push_address.empty() ? server : push_address});
    options.routes.push_back({"127.0.0.1:0", peer.address()});
    if (tls) {
      options.routes.push_back({"127.0.0.1:0", tls_server});
      options.routes.push_back(
          {"127.0.0.1:0", tls_push_address.empty() ? tls_server : tls_push_address});
    }
    options.up.rate_bps = link.mbit * 1e6;
    options.up.delay = absl::Microseconds(link.rtt_ms * 1e3 / 2);
    options.up.window_bytes = window;
    options.down = options.up;
    absl::StatusOr<std::unique_ptr<tools::LinkEmulator>> emulator =
        tools::LinkEmulator::Start(options);
    if (!emulator.ok()) {
      std::fprintf(stderr, "%s\n", emulator.status().ToString().c_str());
      return 1;
    }
    const tools::LinkEmulator& em = **emulator;
    absl::StatusOr<int> bulk = ConnectTcp(em.address(2), absl::Seconds(10));
    if (!bulk.ok()) {
      std::fprintf(stderr, "%s\n", bulk.status().ToString().c_str());
      return 1;
    }
    fcntl(*bulk, F_SETFL, fcntl(*bulk, F_GETFL) & ~O_NONBLOCK);
    LinkWorker grpc(plain_options, em.address(0), /*raw=*/false);
    LinkWorker raw(plain_options, em.address(0), /*raw=*/true);
    if (!grpc.Join("bench-wan-grpc", "") ||
        !raw.Join("bench-wan-raw", push_address.empty() ? "" : em.address(1))) {
      return 1;
    }
    std::unique_ptr<LinkWorker> grpc_tls, raw_tls;
    if (tls) {
      grpc_tls = std::make_unique<LinkWorker>(tls_options, em.address(3), /*raw=*/false);
      raw_tls = std::make_unique<LinkWorker>(tls_options, em.address(3), /*raw=*/true);
      if (!grpc_tls->Join("bench-wan-grpc-tls", "") ||
          !raw_tls->Join("bench-wan-raw-tls", tls_push_address.empty() ? "" : em.address(4))) {
        return 1;
      }
    }
    // In turn order; raw pushes only where the server takes them, TLS rows only with TLS.
    std::vector<Kind> kinds = {
        {"push", "tcp", [&] { return BulkTransfer(*bulk, true, update_bytes); }},
        {"push", "grpc", [&] { return grpc.Push(); }},
    };
    if (!push_address.empty()) kinds.push_back({"push", "raw", [&] { return raw.Push(); }});
    if (tls) {
      kinds.push_back({"push", "grpc+tls", [&] { return grpc_tls->Push(); }});
      if (!tls_push_address.empty()) {
        kinds.push_back({"push", "raw+tls", [&] { return raw_tls->Push(); }});
      }
    }
    kinds.push_back({"pull", "tcp", [&] { return BulkTransfer(*bulk, false, update_bytes); }});
    kinds.push_back({"pull", "grpc", [&] { return grpc.Pull(); }});
    if (tls) kinds.push_back({"pull", "grpc+tls", [&] { return grpc_tls->Pull(); }});
    std::vector<std::vector<double>> seconds(kinds.size());
    const int warmup = absl::GetFlag(FLAGS_warmup);
    for (int turn = 0; turn < warmup + repeats; ++turn) {
      for (size_t k = 0; k < kinds.size(); ++k) {
        const double s = kinds[k].run();
        if (s < 0) {
          ++errors;
          continue;
        }
        if (absl::GetFlag(FLAGS_verbose)) {
          std::printf("  %s %s %s turn %d: %.3f s\n", link.name.c_str(), kinds[k].direction,
                      kinds[k].path, turn, s);
        }
        if (turn >= warmup) seconds[k].push_back(s);
      }
    }
    close(*bulk);
    auto mbit = [&](double s) { return s > 0 ? update_bytes * 8 / s / 1e6 : 0.0; };
    for (size_t k = 0; k < kinds.size(); ++k) {
      if (std::strcmp(kinds[k].path, "tcp") == 0) continue;
      double tcp = 0;  // the baseline of the same direction
      for (size_t b = 0; b < kinds.size(); ++b) {
        if (std::strcmp(kinds[b].path, "tcp") == 0 &&
            std::strcmp(kinds[b].direction, kinds[k].direction) == 0) {
          tcp = Median(seconds[b]);
        }
      }
      const double s = Median(seconds[k]);
      const double ratio = s > 0 ? tcp / s : 0;
      std::printf("%-12s %-9s %-8s %12.3f %10.1f %16.1f %7.2f\n", link.name.c_str(),
                  kinds[k].direction, kinds[k].path, s, mbit(s), mbit(tcp), ratio);
      if (ratio < worst) {
        worst = ratio;
        worst_row = absl::StrCat(link.name, " ", kinds[k].direction, " ", kinds[k].path);
      }
    }
    std::fflush(stdout);
  }
  std::printf("wan: worst %s ratio=%.2f (raw TCP over the same link)\n", worst_row.c_str(), worst);
  return errors == 0 ? 0 : 1;
}

}  // namespace
}  // namespace aloe::bench

int main(int argc, char** argv) {
  aloe::KeepLargeBuffersInHeap(argv);                                   // as aloe-worker does
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as aloe-worker does
  aloe::SetUsage(
      "aloe-bench-wan --server HOST:PORT [--tls_server HOST:PORT --tls DIR]\n"
      "  [--links RATE_MBIT:RTT_MS,...] [flags]\n"
      "Push and pull goodput of one worker to a running aloe-server (plain async mode) across\n"
      "emulated long links, against raw TCP over the same links in the same run. See\n"
      "scripts/bench/wan.sh.");
  absl::ParseCommandLine(argc, argv);
  return aloe::bench::Main();
}
