// aloe-bench-push: how fast a running aloe-server accepts pseudo-gradients, against raw loopback
// TCP measured in the same run.
//
// Every simulated worker is a real gRPC client (worker/client.h, the code path of aloe-worker):
// it joins as a trainer (retrying while the server answers UNAVAILABLE: a layer-sharded server
// until its shard processes follow the coordinator), then loops RequestTask -> --round_seconds of
// simulated training -> Push of a full fp32 update (every value 0, so the model does not drift),
// whose reply carries the next task (--next_task_in_reply, as aloe-worker asks); a worker's first
// push (right after its first task) is not measured (it warms the connections). Against a
// layer-sharded server (JoinReply.shard_addresses) every push goes to the shard processes
// directly, each getting its own layers, as aloe-worker's do. The server must run in plain async
// mode (aggregation { mode: AGGREGATION_ASYNC }, no grace window) so that every push is applied
// as it arrives, and with no stop condition.
//
//   --mode ingest: --pushers concurrent workers for --seconds; GB/s of pseudo-gradient accepted
//     (bytes of acknowledged pushes / wall time) vs the GB/s of --pushers concurrent loopback TCP
//     streams (1 MiB writes, a reader thread per stream) measured in the same process, taking
//     turns with it (--repeats).
//     Last line: "ingest: accepted_gbps=<X> ratio=<X / tcp> (raw TCP <Y> GB/s, N streams)".
//   --mode egress: the other direction: --pushers concurrent workers each pulling every layer of
//     the latest version back to back (a joiner's download, from every shard at once) for
//     --seconds; GB/s of parameters served vs the same raw TCP baseline. Last line:
//     "egress: served_gbps=<X> ratio=<X / tcp> (raw TCP <Y> GB/s, N streams)".
//   --mode scale: for each worker count in --workers, that many concurrent workers for --seconds:
//     offered load (workers x update bytes / round), accepted GB/s, updates/s, push latency
//     p50/p99 (first byte sent to reply), and with --watch the server processes' CPU time per
//     push; then the pushes by how many others overlapped them, the p99 of those that overlapped
//     none at the last count against p50 at 16, and the server's CPU time per push at 16 against
//     p50 there (near 100%: a push is bound by the server's cores, so pushes that overlap share
//     them and take longer in proportion). Last line:
//     "scale: p99_at_<max>=<ms> ms ratio=<p99 at max / p50 at 16> (p50 at 16 workers: <ms> ms)".
//
// With --tls DIR the workers reach the server over TLS (gRPC and raw pushes alike) with the
// certificates of scripts/make-test-ca.sh DIR; the raw TCP baseline stays plaintext, so the ratio
// then includes what TLS costs.
//
// Before measuring it prints the model and, for a layer-sharded server, one line per shard
// process "shard I holds L layers, N parameters = B bytes" (scripts/bench/_push.sh reads these
// for the memory bound). With --watch it also reports the CPU (cores used while pushing) and the
// peak RSS (VmHWM) of the named server processes. With --pin, ingest also reports how busy the
// receiving CPU was in each measurement (/proc/stat) and its busy seconds per GB for the least
// work and for the server: whether the gap to the least work is more CPU per byte or idle time.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/allocator.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "kernels/cpu/outer_kernels.h"
#include "tests/bench/join_with_retry.h"
#include "worker/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7070",
          "aloe-server address (plain async mode; for a layer-sharded server the coordinator)");
ABSL_FLAG(std::string, mode, "ingest", "ingest | egress | scale");
ABSL_FLAG(int32_t, pushers, 4,
          "ingest / egress: concurrent workers (and TCP streams of the baseline)");
ABSL_FLAG(std::string, workers, "8,16,32,64", "scale: worker counts, comma-separated");
ABSL_FLAG(double, seconds, 10, "Measured seconds per configuration");
ABSL_FLAG(double, round_seconds, 0,
          "Simulated training time of a worker between the reply to one push and its next push "
          "(the inner steps of a DiLoCo round); each worker's first push comes at a random phase "
          "in [0, round). 0 = push back to back (a closed loop without pause)");
ABSL_FLAG(int32_t, repeats, 3,
          "ingest / egress: the measurements take turns this many times (raw TCP, raw TCP with a "
          "push's least work, the server; --seconds / repeats each turn), so that a machine "
          "whose speed drifts during the run (other tenants, clocks) weighs on every one alike; "
          "the ratios of each turn are printed too");
ABSL_FLAG(int32_t, staged_slots, 8,
          "ingest: staging buffers of the raw TCP baseline with a push's least work (the server's "
          "max_staged_updates)");
ABSL_FLAG(double, round_jitter, 0,
          "Standard deviation of each round's training time as a fraction of --round_seconds "
          "(normal, clamped to [0.5, 1.5] x round; each worker its own seeded generator). Real "
          "rounds vary; with 0 every worker keeps its phase forever, so two pushes that collide "
          "once collide every round");
ABSL_FLAG(bool, report_pulled, true,
          "Tell the server at each task's start that its base version is held (a simulated worker "
          "pushes zeros and never reads parameters, so it skips the pull itself); false: keep "
          "every open task's base version on the server for the whole round");
ABSL_FLAG(bool, next_task_in_reply, true,
          "Ask for the next task with each push (PushHeader.want_next_task), as aloe-worker does; "
          "false: ask RequestTask after every push (one more round trip per round)");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the workers' first-push phases (--round_seconds)");
ABSL_FLAG(std::string, pin, "",
          "RECEIVER,SENDER: CPU numbers. The raw TCP baseline's reader threads run on RECEIVER and "
          "its writers on SENDER, and this process's workers on SENDER (start the server "
          "processes on RECEIVER, e.g. with taskset): both sides of both measurements on their "
          "own core. Empty = no pinning");
ABSL_FLAG(double, join_seconds, 30,
          "How long to retry Join while the server answers UNAVAILABLE (a layer-sharded server "
          "until all its shard processes follow the coordinator)");
ABSL_FLAG(std::string, tls, "",
          "DIR with ca.pem, client.pem and client.key (scripts/make-test-ca.sh DIR): the workers "
          "reach the server over TLS, raw pushes included, verifying its certificate against "
          "ca.pem and presenting client.pem (mutual TLS). The server must have TLS configured "
          "with DIR's server.pem and server.key (and ca.pem as tls_client_ca_file). The raw TCP "
          "baseline stays plaintext. Empty = plaintext");
ABSL_FLAG(std::string, tls_server_name, "",
          "With --tls: the name to verify in the server's certificates instead of the host "
          "dialled. make-test-ca.sh's certificates name only localhost and 127.0.0.1: give "
          "localhost when the workers dial another address, e.g. a link emulator's");
ABSL_FLAG(std::string, watch, "",
          "NAME:PID,... server processes on this machine (e.g. coordinator:123,shard0:124) whose "
          "CPU use while pushing and peak RSS (VmHWM, /proc/PID/status) are reported");

namespace aloe::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A server process whose CPU time and peak memory the report includes (--watch).
struct Watched {
  std::string name;
  int pid = 0;
};

// Parses --watch ("NAME:PID,..."; empty = none). kInvalidArgument for a malformed entry.
absl::StatusOr<std::vector<Watched>> ParseWatch(const std::string& flag) {
  std::vector<Watched> watched;
  for (absl::string_view entry : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> parts = absl::StrSplit(entry, absl::MaxSplits(':', 1));
    Watched w{parts.first, 0};
    if (w.name.empty() || !absl::SimpleAtoi(parts.second, &w.pid) || w.pid <= 0) {
      return absl::InvalidArgumentError("--watch: bad entry '" + std::string(entry) +
                                        "' (want NAME:PID)");
    }
    watched.push_back(w);
  }
  return watched;
}

// User + system CPU seconds of process `pid` so far (/proc/PID/stat), or -1 when unreadable.
double CpuSeconds(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return -1;
  std::istringstream fields(stat.substr(paren + 2));
  // Fields 3.. of proc(5): state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
  // cmajflt utime stime.
  std::string skip;
  for (int i = 3; i < 14; ++i) fields >> skip;
  double utime = 0, stime = 0;
  if (!(fields >> utime >> stime)) return -1;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Peak resident set size (VmHWM) of process `pid` in MiB, or -1 when unreadable.
double PeakRssMiB(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    double kib = 0;
    if (line.rfind("VmHWM:", 0) == 0 && std::istringstream(line.substr(6)) >> kib) {
      return kib / 1024;
    }
  }
  return -1;
}

// "a/b/c": the peak RSS in MiB of every watched process, in --watch order.
std::string PeakRssList(const std::vector<Watched>& watched) {
  std::vector<std::string> values;
  values.reserve(watched.size());
  for (const Watched& w : watched) values.push_back(std::to_string(std::lround(PeakRssMiB(w.pid))));
  return values.empty() ? "-" : absl::StrJoin(values, "/");
}

// The calling thread (and the threads it starts from now on) runs on `cpu` only; -1: anywhere.
void PinThisThread(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    std::fprintf(stderr, "cannot pin a thread to CPU %d\n", cpu);
    std::exit(2);
  }
}

// --pin: (receiver CPU, sender CPU), or (-1, -1).
std::pair<int, int> PinnedCpus() {
  const std::string pin = absl::GetFlag(FLAGS_pin);
  if (pin.empty()) return {-1, -1};
  std::vector<std::string> parts = absl::StrSplit(pin, ',');
  int receiver = -1, sender = -1;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &receiver) ||
      !absl::SimpleAtoi(parts[1], &sender) || receiver < 0 || sender < 0) {
    std::fprintf(stderr, "--pin must be RECEIVER,SENDER (two CPU numbers), got '%s'\n",
                 pin.c_str());
    std::exit(2);
  }
  return {receiver, sender};
}

// Busy and all time of one CPU so far, in clock ticks (/proc/stat: busy = user, nice, system,
// irq, softirq and steal; all = busy + idle + iowait). Zeros for cpu < 0 or when unreadable.
struct CpuTicks {
  uint64_t busy = 0;
  uint64_t all = 0;
};

CpuTicks ReadCpuTicks(int cpu) {
  CpuTicks t;
  if (cpu < 0) return t;
  std::ifstream in("/proc/stat");
  const std::string name = absl::StrCat("cpu", cpu);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string label;
    uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (!(fields >> label) || label != name) continue;
    fields >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    t.busy = user + nice + system + irq + softirq + steal;
    t.all = t.busy + idle + iowait;
    break;
  }
  return t;
}

// The share of the time between two readings the CPU was busy; -1 when unknown.
double BusyShare(const CpuTicks& from, const CpuTicks& to) {
  if (to.all <= from.all) return -1;
  return static_cast<double>(to.busy - from.busy) / static_cast<double>(to.all - from.all);
}

// `streams` connected loopback TCP connections as (sending end, receiving end), or none (the
// error printed) when they cannot be made.
std::vector<std::pair<int, int>> LoopbackConnections(int streams) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  std::vector<std::pair<int, int>> connections;
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, streams) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("loopback TCP listener");
    if (listener >= 0) close(listener);
    return connections;
  }
  for (int s = 0; s < streams; ++s) {
    const int out = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(out, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      std::perror("loopback TCP connect");
      for (auto [o, i] : connections) close(o), close(i);
      close(out);
      close(listener);
      return {};
    }
    connections.emplace_back(out, accept(listener, nullptr, nullptr));
  }
  close(listener);
  return connections;
}

// GB/s of `streams` concurrent loopback TCP connections, each written with 1 MiB send()s for
// `seconds` and drained by its own reader thread (readers on CPU `receiver_cpu`, writers on
// `sender_cpu` when those are >= 0).
// *receiver_busy (when given): BusyShare of CPU receiver_cpu over the measured window.
double RawTcpGbps(int streams, double seconds, int receiver_cpu = -1, int sender_cpu = -1,
                  double* receiver_busy = nullptr) {
  const std::vector<std::pair<int, int>> connections = LoopbackConnections(streams);
  if (connections.empty()) return 0;
  std::atomic<uint64_t> received{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  std::vector<int> senders;
  for (auto [out, in] : connections) {
    senders.push_back(out);
    threads.emplace_back([in = in, &received, receiver_cpu] {
      PinThisThread(receiver_cpu);
      std::vector<char> buffer(1 << 20);
      ssize_t n;
      while ((n = recv(in, buffer.data(), buffer.size(), 0)) > 0) received += n;
      close(in);
    });
  }
  const auto t0 = Clock::now();
  std::atomic<uint64_t> at_start{0};
  std::vector<std::thread> writers;
  writers.reserve(senders.size());
  for (int out : senders) {
    writers.emplace_back([out, &stop, sender_cpu] {
      PinThisThread(sender_cpu);
      std::vector<char> buffer(1 << 20, 'x');
      while (!stop.load()) {
        size_t sent = 0;
        while (sent < buffer.size()) {
          const ssize_t n = send(out, buffer.data() + sent, buffer.size() - sent, MSG_NOSIGNAL);
          if (n <= 0) return;
          sent += n;
        }
      }
    });
  }
  at_start = received.load();
  const CpuTicks cpu0 = ReadCpuTicks(receiver_cpu);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double elapsed = Since(t0);
  const uint64_t bytes = received.load() - at_start.load();
  if (receiver_busy != nullptr) *receiver_busy = BusyShare(cpu0, ReadCpuTicks(receiver_cpu));
  stop = true;
  for (std::thread& t : writers) t.join();
  for (int out : senders) shutdown(out, SHUT_RDWR), close(out);
  for (std::thread& t : threads) t.join();
  return static_cast<double>(bytes) / elapsed / 1e9;
}

// The least work any push path must do, on raw TCP: GB/s of `update_bytes`-byte float32 updates
// over `streams` loopback connections, each sender screening its update for NaN/Inf before
// sending it (as a worker does) with 1 MiB send()s, each reader recv()ing it in 256 KiB pieces and
// screening each piece while it streams it into one of `slots` staging buffers (at most `slots`
// updates received or waiting at once, as the shard's max_staged_updates; the way of the shard's
// raw pushes, which is 1.1-1.3x the GB/s of recv() straight into the staging buffer and a
// separate screen, measured turn by turn on the dev host), and one applier thread on the
// readers' CPU taking the outer SGD step from each staged update into one parameter buffer in
// place. No framing, no headers, no gRPC, no coordinator: what is left of the gap between a
// push path and raw TCP is the push path's own. Counts applied bytes.
constexpr float kScreenLimit = 1e6f;  // the shard's kMaxPushMagnitude (update_assembler.h)

double StagedTcpGbps(int streams, double seconds, uint64_t update_bytes, int slots,
                     int receiver_cpu = -1, int sender_cpu = -1, double* receiver_busy = nullptr) {
  const size_t n = update_bytes / sizeof(float);
  if (n == 0) return 0;
  const std::vector<std::pair<int, int>> connections = LoopbackConnections(streams);
  if (connections.empty()) return 0;
  absl::Mutex mu;
  std::vector<std::vector<float>> buffers(slots, std::vector<float>(n));
  std::vector<float*> idle, staged;  // guarded by mu
  for (std::vector<float>& b : buffers) idle.push_back(b.data());
  bool stop = false;  // guarded by mu
  std::atomic<bool> stop_sending{false};
  std::atomic<uint64_t> applied{0};
  std::vector<float> params(n, 1.0f);
  std::thread applier([&] {
    PinThisThread(receiver_cpu);
    while (true) {
      float* g = nullptr;
      {
        absl::MutexLock lock(&mu);
        auto ready = [&] { return stop || !staged.empty(); };
        mu.Await(absl::Condition(&ready));
        if (staged.empty()) return;
        g = staged.front();
        staged.erase(staged.begin());
      }
      kernels::SgdApply(g, params.data(), params.data(), n, 1e-3f);
      applied += update_bytes;
      absl::MutexLock lock(&mu);
      idle.push_back(g);
    }
  });
  std::vector<std::thread> readers, writers;
  std::vector<int> senders;
  for (auto [out, in] : connections) {
    senders.push_back(out);
    readers.emplace_back([&, in = in] {
      PinThisThread(receiver_cpu);
      while (true) {
        float* g = nullptr;
        {
          absl::MutexLock lock(&mu);
          auto ready = [&] { return stop || !idle.empty(); };
          mu.Await(absl::Condition(&ready));
          if (stop) break;
          g = idle.back();
          idle.pop_back();
        }
        // As the shard's raw pushes (UpdateAssembler::AddFp32Read): each piece recv()d into a
        // small buffer that stays in cache, then screened while it is streamed into the staging
        // buffer (no read of the cold destination before it is written).
        thread_local std::vector<char> bounce(256 << 10);
        size_t got = 0;
        bool ok = true;
        while (ok && got < update_bytes) {
          const size_t want = std::min<size_t>(update_bytes - got, bounce.size());
          for (size_t have = 0; ok && have < want;) {
            const ssize_t r = recv(in, bounce.data() + have, want - have, 0);
            ok = r > 0;
            if (ok) have += static_cast<size_t>(r);
          }
          ok = ok && kernels::StreamWithinMagnitude(bounce.data(), g + got / sizeof(float),
                                                    want / sizeof(float), kScreenLimit);
          got += want;
        }
        absl::MutexLock lock(&mu);
        (ok ? staged : idle).push_back(g);
        if (!ok) break;
      }
      close(in);
    });
  }
  std::vector<float> update(n, 0.0f);
  for (int out : senders) {
    writers.emplace_back([&, out] {
      PinThisThread(sender_cpu);
      const char* bytes = reinterpret_cast<const char*>(update.data());
      while (!stop_sending.load()) {
        if (!kernels::AllFinite(update.data(), n)) return;
        size_t sent = 0;
        while (sent < update_bytes) {
          const ssize_t r =
              send(out, bytes + sent, std::min<size_t>(update_bytes - sent, 1 << 20), MSG_NOSIGNAL);
          if (r <= 0) return;
          sent += static_cast<size_t>(r);
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));  // as the pushes: connections warm
  const uint64_t at_start = applied.load();
  const auto t0 = Clock::now();
  const CpuTicks cpu0 = ReadCpuTicks(receiver_cpu);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double elapsed = Since(t0);
  const uint64_t bytes = applied.load() - at_start;
  if (receiver_busy != nullptr) *receiver_busy = BusyShare(cpu0, ReadCpuTicks(receiver_cpu));
  stop_sending = true;
  for (int out : senders) shutdown(out, SHUT_RDWR);
  for (std::thread& t : writers) t.join();
  {
    absl::MutexLock lock(&mu);
    stop = true;
  }
  for (std::thread& t : readers) t.join();
  applier.join();
  for (int out : senders) close(out);
  return static_cast<double>(bytes) / elapsed / 1e9;
}

struct Result {
  uint64_t updates = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::vector<double> latencies;  // seconds per push, sorted
  // Every push of every worker that ended without error, counted or not, as (start, end) seconds
  // on one clock, and which of them were counted (in `latencies`): how many pushes were in flight
  // beside each counted one.
  std::vector<std::pair<double, double>> spans;
  std::vector<bool> span_counted;
  int errors = 0;
  double bench_cores = 0;             // CPU of this process while pushing, in cores
  std::vector<double> watched_cores;  // the same for each --watch process
  double receiver_busy = -1;          // BusyShare of the receiving CPU (--pin), -1 unknown
};

// How the simulated workers reach --server: plaintext, or TLS with the certificates of --tls.
// Exits 2 naming a file that cannot be read.
worker::ClientOptions WorkerOptions() {
  worker::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  if (const std::string dir = absl::GetFlag(FLAGS_tls); !dir.empty()) {
    const absl::Status loaded = worker::LoadClientFiles(
        {"", dir + "/ca.pem", dir + "/client.pem", dir + "/client.key"}, &options);
    if (!loaded.ok()) {
      std::fprintf(stderr, "--tls: %s\n", std::string(loaded.message()).c_str());
      std::exit(2);
    }
    options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  }
  return options;
}

// `workers` concurrent simulated workers pushing full updates, each pausing `round` seconds after
// every push (its first push at a random phase in [0, round), not measured), measured for
// `seconds` from when every worker has pushed once and at least one round has passed.
// pull: each worker pulls the latest version back to back instead (egress; round ignored).
Result RunWorkers(int workers, double seconds, double round, const std::vector<Watched>& watched,
                  bool pull = false, int receiver_cpu = -1) {
  const worker::ClientOptions options = WorkerOptions();
  std::vector<std::unique_ptr<worker::ServerClient>> clients;
  std::vector<v1::JoinReply> joined(workers);
  for (int w = 0; w < workers; ++w) {
    clients.push_back(std::make_unique<worker::ServerClient>(options));
    absl::StatusOr<v1::JoinReply> reply =
        JoinWithRetry(*clients[w], "bench-" + std::to_string(w), absl::GetFlag(FLAGS_join_seconds));
    if (!reply.ok()) {
      std::fprintf(stderr, "join: %s\n", reply.status().ToString().c_str());
      std::exit(1);
    }
    joined[w] = *reply;
    // A layer-sharded server: the pushes go to its shard processes, as aloe-worker's do (raw
    // where the shards, or a single-process server, take raw pushes).
    absl::Status shards = clients[w]->SetShards(
        {reply->shard_addresses().begin(), reply->shard_addresses().end()},
        {reply->shard_push_addresses().begin(), reply->shard_push_addresses().end()},
        reply->push_address());
    if (!shards.ok()) {
      std::fprintf(stderr, "shard addresses: %s\n", shards.ToString().c_str());
      std::exit(1);
    }
  }
  const v1::ModelSpec& spec = joined[0].model_spec();
  std::vector<std::vector<float>> zeros;
  for (const v1::LayerSpec& layer : spec.layers()) zeros.emplace_back(layer.num_elements(), 0.0f);
  // Phases drawn up front from one generator: the same seed gives the same schedule.
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::uniform_real_distribution<double> uniform(0, round);
  const double jitter = absl::GetFlag(FLAGS_round_jitter);
  std::vector<double> phases(workers, 0.0);
  if (round > 0) {
    for (double& phase : phases) phase = uniform(rng);
  }
  absl::Notification go;            // the workers start (their first push at their phase)
  const auto epoch = Clock::now();  // of Result.spans
  absl::Notification measure;       // the window opens: pushes started from now on count
  const bool report_pulled = absl::GetFlag(FLAGS_report_pulled);
  const bool next_task_in_reply = absl::GetFlag(FLAGS_next_task_in_reply);
  absl::Notification stop;   // the window closes: pushes finished from now on do not
  std::atomic<int> warm{0};  // workers whose first push is done
  std::vector<Result> per_worker(workers);
  std::vector<std::thread> threads;
  threads.reserve(workers);
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      worker::ServerClient& client = *clients[w];
      const uint64_t id = joined[w].worker_id();
      Result& r = per_worker[w];
      uint64_t update_id = 0;
      std::optional<v1::Task> next;  // the task the last push's reply carried
      // RequestTask -> `train` seconds of simulated training -> Push, as a worker's round: the
      // task (and the version it starts from) is open while the worker trains. Returns false when
      // the worker must stop (no task, or the window closed while training). The push counts in
      // r when the window was open at its start and had not closed at its end.
      std::vector<std::vector<float>> layers;  // egress: where this worker pulls to
      auto push = [&](double train) {
        if (pull) {
          // A joiner's download: every layer of the latest version, from every shard at once,
          // into the worker's own buffers (reused, as a worker's parameters are).
          uint64_t bytes = 0;
          const bool counted = measure.HasBeenNotified();
          const auto t0 = Clock::now();
          absl::StatusOr<uint64_t> version = client.Pull(id, 0, true, spec, &layers, &bytes);
          const double latency = Since(t0);
          if (!version.ok()) {
            std::fprintf(stderr, "pull: %s\n", version.status().ToString().c_str());
            ++r.errors;
            return false;
          }
          if (counted && !stop.HasBeenNotified()) {
            ++r.updates;
            r.bytes += bytes;
            r.latencies.push_back(latency);
          }
          return true;
        }
        while (true) {
          absl::StatusOr<v1::Task> task =
              next ? absl::StatusOr<v1::Task>(*std::move(next)) : client.RequestTask(id);
          next.reset();
          if (!task.ok() || task->kind() == v1::Task::STOP) {
            if (!task.ok()) std::fprintf(stderr, "task: %s\n", task.status().ToString().c_str());
            ++r.errors;
            return false;
          }
          if (task->kind() != v1::Task::TRAIN) continue;  // WAIT: the server held it a while
          if (report_pulled) {
            v1::HeartbeatRequest pulled;
            pulled.set_worker_id(id);
            pulled.set_pulled_task_id(task->task_id());
            if (absl::StatusOr<v1::HeartbeatReply> beat = client.Heartbeat(pulled); !beat.ok()) {
              std::fprintf(stderr, "heartbeat: %s\n", beat.status().ToString().c_str());
              ++r.errors;
            }
          }
          if (train > 0 && stop.WaitForNotificationWithTimeout(absl::Seconds(train))) return false;
          v1::PushHeader header;
          header.set_worker_id(id);
          header.set_task_id(task->task_id());
          header.set_update_id(++update_id);
          header.set_base_version(task->base_version());
          header.set_steps_done(task->local_steps());
          header.set_tokens_learned(1);
          header.set_codec(v1::CODEC_FP32);
          header.set_want_next_task(next_task_in_reply);
          uint64_t bytes = 0;
          const bool counted = measure.HasBeenNotified();
          const auto t0 = Clock::now();
          absl::StatusOr<v1::PushReply> reply =
              client.Push(header, spec, zeros, {}, 256, nullptr, &bytes);
          const double latency = Since(t0);
          if (!reply.ok()) {
            std::fprintf(stderr, "push: %s\n", reply.status().ToString().c_str());
            ++r.errors;
          } else {
            if (reply->has_next_task()) next = reply->next_task();
            const double start = std::chrono::duration<double>(t0 - epoch).count();
            r.spans.emplace_back(start, start + latency);
            r.span_counted.push_back(counted && !stop.HasBeenNotified());
            if (r.span_counted.back()) {
              ++r.updates;
              r.bytes += bytes;
              r.latencies.push_back(latency);
            }
          }
          return true;
        }
      };
      go.WaitForNotification();
      if (phases[w] > 0 && stop.WaitForNotificationWithTimeout(absl::Seconds(phases[w]))) return;
      // The first push is never counted: connections and gRPC's flow-control windows are set up
      // once in a worker's life (a real one has pulled from the shards before), not every round.
      bool ok = push(0);
      ++warm;
      // Each worker's round lengths from its own generator: the same seed, the same schedule.
      std::mt19937_64 round_rng(absl::GetFlag(FLAGS_seed) * 1000003 + w);
      std::normal_distribution<double> round_length(round, round * jitter);
      while (ok && !stop.HasBeenNotified()) {
        ok = push(jitter > 0 ? std::clamp(round_length(round_rng), 0.5 * round, 1.5 * round)
                             : round);
      }
    });
  }
  go.Notify();
  // The window opens once every worker has pushed once and, with rounds, one round after the
  // start: from then on the phases are spread as in a long run.
  // A first push still out after a minute more is stuck: measure anyway (it shows as errors).
  const auto started = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(round));
  while (warm.load() < workers && Since(started) < round + 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<double> cpu_before;
  cpu_before.reserve(watched.size());
  for (const Watched& w : watched) cpu_before.push_back(CpuSeconds(w.pid));
  const double bench_cpu_before = CpuSeconds(getpid());
  const auto t0 = Clock::now();
  const CpuTicks receiver0 = ReadCpuTicks(receiver_cpu);
  measure.Notify();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop.Notify();
  Result total;
  total.seconds = Since(t0);
  total.receiver_busy = BusyShare(receiver0, ReadCpuTicks(receiver_cpu));
  total.bench_cores = (CpuSeconds(getpid()) - bench_cpu_before) / total.seconds;
  for (size_t i = 0; i < watched.size(); ++i) {
    total.watched_cores.push_back((CpuSeconds(watched[i].pid) - cpu_before[i]) / total.seconds);
  }
  for (std::thread& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    total.updates += per_worker[w].updates;
    total.bytes += per_worker[w].bytes;
    total.errors += per_worker[w].errors;
    total.latencies.insert(total.latencies.end(), per_worker[w].latencies.begin(),
                           per_worker[w].latencies.end());
    total.spans.insert(total.spans.end(), per_worker[w].spans.begin(), per_worker[w].spans.end());
    total.span_counted.insert(total.span_counted.end(), per_worker[w].span_counted.begin(),
                              per_worker[w].span_counted.end());
    (void)clients[w]->Leave(joined[w].worker_id());
  }
  std::sort(total.latencies.begin(), total.latencies.end());
  return total;
}

// Adds the measured window of `r` to `total` (a run measured in several turns): updates, bytes,
// seconds and errors add up, latencies merge (sorted), CPU use is weighted by seconds; spans stay
// apart (each turn has its own clock).
void MergeInto(Result& total, const Result& r) {
  const double seconds = total.seconds + r.seconds;
  auto weigh = [&](double a, double b) {
    return seconds > 0 ? (a * total.seconds + b * r.seconds) / seconds : 0.0;
  };
  total.bench_cores = weigh(total.bench_cores, r.bench_cores);
  total.receiver_busy = weigh(total.receiver_busy, r.receiver_busy);
  total.watched_cores.resize(r.watched_cores.size(), 0.0);
  for (size_t i = 0; i < r.watched_cores.size(); ++i) {
    total.watched_cores[i] = weigh(total.watched_cores[i], r.watched_cores[i]);
  }
  total.updates += r.updates;
  total.bytes += r.bytes;
  total.errors += r.errors;
  total.seconds = seconds;
  total.latencies.insert(total.latencies.end(), r.latencies.begin(), r.latencies.end());
  std::sort(total.latencies.begin(), total.latencies.end());
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i =
      std::min(sorted.size() - 1, static_cast<size_t>(std::lround(p * (sorted.size() - 1))));
  return sorted[i];
}

// The counted pushes of `r` by how many other pushes (counted or not) were in flight at some
// moment of theirs: [0] alone, [1] beside one other, [2] beside two or more. Latencies in
// seconds, sorted.
std::array<std::vector<double>, 3> LatenciesByOverlap(const Result& r) {
  std::array<std::vector<double>, 3> out;
  for (size_t i = 0; i < r.spans.size(); ++i) {
    if (!r.span_counted[i]) continue;
    const auto [start, end] = r.spans[i];
    int others = 0;
    for (size_t j = 0; j < r.spans.size(); ++j) {
      if (j != i && r.spans[j].first < end && r.spans[j].second > start) ++others;
    }
    out[std::min(others, 2)].push_back(end - start);
  }
  for (std::vector<double>& v : out) std::sort(v.begin(), v.end());
  return out;
}

// Joins once (waiting for a layer-sharded server to assemble), prints the model and, when the
// server is layer-sharded, what every shard process holds; returns the bytes of one fp32 update,
// or 0 when the server cannot be joined.
uint64_t DescribeServer() {
  worker::ServerClient client(WorkerOptions());
  absl::StatusOr<v1::JoinReply> reply =
      JoinWithRetry(client, "bench-probe", absl::GetFlag(FLAGS_join_seconds));
  if (!reply.ok()) {
    std::fprintf(stderr, "join: %s\n", reply.status().ToString().c_str());
    return 0;
  }
  (void)client.Leave(reply->worker_id());
  const v1::ModelSpec& spec = reply->model_spec();
  const int processes = reply->shard_addresses_size();
  const uint64_t elements = TotalElements(spec);
  const std::string layout =
      processes > 0 ? absl::StrFormat("%d shard process(es) (layer-sharded server)", processes)
                    : "one server process (not layer-sharded)";
  std::printf("model: %d layers, %llu parameters, %.2f MiB per fp32 update; %s\n",
              spec.layers_size(), static_cast<unsigned long long>(elements),
              4.0 * elements / 1048576.0, layout.c_str());
  for (int s = 0; s < processes; ++s) {
    int layers = 0;
    uint64_t owned = 0;
    for (const v1::LayerSpec& layer : spec.layers()) {
      if (static_cast<int>(layer.shard()) != s) continue;
      ++layers;
      owned += layer.num_elements();
    }
    std::printf("shard %d holds %d layers, %llu parameters = %llu bytes\n", s, layers,
                static_cast<unsigned long long>(owned), 4 * static_cast<unsigned long long>(owned));
  }
  if (const std::string tls = absl::GetFlag(FLAGS_tls); tls.empty()) {
    std::printf("workers: plaintext\n");
  } else {
    std::printf("workers: mutual TLS 1.3 with the certificates of %s, raw pushes included\n",
                tls.c_str());
  }
  std::fflush(stdout);  // a pipe (scripts/bench/_push.sh) would hold it until the end
  return 4 * elements;
}

int Main() {
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const double round = absl::GetFlag(FLAGS_round_seconds);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const double jitter = absl::GetFlag(FLAGS_round_jitter);
  if (!(round >= 0) || !(seconds > 0) || !(jitter >= 0 && jitter <= 0.5)) {
    std::fprintf(stderr,
                 "--seconds must be > 0, --round_seconds >= 0 and --round_jitter in [0, 0.5]\n");
    return 2;
  }
  absl::StatusOr<std::vector<Watched>> watched = ParseWatch(absl::GetFlag(FLAGS_watch));
  if (!watched.ok()) {
    std::fprintf(stderr, "%s\n", std::string(watched.status().message()).c_str());
    return 2;
  }
  std::vector<std::string> names;
  for (const Watched& w : *watched) names.push_back(w.name);
  if (mode == "ingest" || mode == "egress") {
    // The same run both ways: pushes accepted (ingest) or pulls served (egress).
    const bool pull = mode == "egress";
    const char* ops = pull ? "pull" : "push";
    const int workers = absl::GetFlag(FLAGS_pushers);
    const auto [receiver_cpu, sender_cpu] = PinnedCpus();
    const int repeats = absl::GetFlag(FLAGS_repeats);
    if (repeats < 1) {
      std::fprintf(stderr, "--repeats must be >= 1\n");
      return 2;
    }
    const double turn = seconds / repeats;
    // Every thread this process starts from here on runs where its role says: gRPC's threads
    // (the workers') inherit the sender's CPU; the baselines pin their own threads.
    PinThisThread(sender_cpu);
    // The model comes first: the least-work baseline needs its update size.
    const uint64_t update_bytes = DescribeServer();
    if (update_bytes == 0) return 1;
    double tcp_sum = 0, staged_sum = 0;
    double tcp_busy_sum = 0, staged_busy_sum = 0;  // of the receiving CPU (--pin)
    Result r;
    std::vector<std::string> turns;
    const int slots = absl::GetFlag(FLAGS_staged_slots);
    for (int k = 0; k < repeats; ++k) {
      double tcp_busy = -1, staged_busy = -1;
      const double tcp_k = RawTcpGbps(workers, turn, receiver_cpu, sender_cpu, &tcp_busy);
      const double staged_k = pull ? 0
                                   : StagedTcpGbps(workers, turn, update_bytes, slots, receiver_cpu,
                                                   sender_cpu, &staged_busy);
      const Result r_k = RunWorkers(workers, turn, pull ? 0 : round, *watched, pull, receiver_cpu);
      tcp_busy_sum += tcp_busy;
      staged_busy_sum += staged_busy;
      const double gbps_k =
          r_k.seconds > 0 ? static_cast<double>(r_k.bytes) / r_k.seconds / 1e9 : 0;
      tcp_sum += tcp_k;
      staged_sum += staged_k;
      MergeInto(r, r_k);
      turns.push_back(pull ? absl::StrFormat("%.2f", tcp_k > 0 ? gbps_k / tcp_k : 0.0)
                           : absl::StrFormat("%.2f (least work %.2f)",
                                             tcp_k > 0 ? gbps_k / tcp_k : 0.0,
                                             tcp_k > 0 ? staged_k / tcp_k : 0.0));
    }
    const double tcp = tcp_sum / repeats;
    const double staged = staged_sum / repeats;
    std::printf("raw loopback TCP, %d streams: %.3f GB/s%s\n", workers, tcp,
                receiver_cpu >= 0 ? absl::StrFormat(" (readers on CPU %d, writers on CPU %d)",
                                                    receiver_cpu, sender_cpu)
                                        .c_str()
                                  : "");
    if (!pull) {
      std::printf(
          "raw loopback TCP with the least work of a push path (%.1f MiB updates received into "
          "%d staging buffers, screened, SGD-applied): %.3f GB/s = %.2f of raw TCP\n",
          update_bytes / 1048576.0, slots, staged, tcp > 0 ? staged / tcp : 0.0);
    }
    std::printf("%d turns of %.1f s each (raw TCP, %sthe server): ratio per turn %s\n", repeats,
                turn, pull ? "" : "least work, ", absl::StrJoin(turns, ", ").c_str());
    const double gbps = static_cast<double>(r.bytes) / r.seconds / 1e9;
    std::printf(
        "aloe-server, %d %sers: %llu %s of %.1f MiB in %.1f s, %.3f GB/s, "
        "%s p50 %.1f ms p99 %.1f ms, %d errors\n",
        workers, ops, static_cast<unsigned long long>(r.updates), pull ? "pulls" : "updates",
        r.updates ? r.bytes / 1048576.0 / r.updates : 0.0, r.seconds, gbps, ops,
        1e3 * Percentile(r.latencies, 0.5), 1e3 * Percentile(r.latencies, 0.99), r.errors);
    std::string cpu = absl::StrFormat("aloe-bench-push %.2f", r.bench_cores);
    for (size_t i = 0; i < watched->size(); ++i) {
      absl::StrAppendFormat(&cpu, ", %s %.2f", names[i], r.watched_cores[i]);
    }
    std::printf("CPU while %sing (cores of %u): %s\n", ops, std::thread::hardware_concurrency(),
                cpu.c_str());
    if (receiver_cpu >= 0 && !pull && r.receiver_busy >= 0 && staged_busy_sum >= 0) {
      // Where the gap to the least work is: the receiving core's time per byte, or its idle time.
      const double staged_busy = staged_busy_sum / repeats;
      const double per_gb_staged = staged > 0 ? staged_busy / staged : 0;
      const double per_gb_server = gbps > 0 ? r.receiver_busy / gbps : 0;
      std::printf(
          "CPU %d (the receiving side) busy while measuring: raw TCP %.0f%%, least work %.0f%%, "
          "the server %.0f%%; its busy seconds per GB: least work %.3f, the server %.3f (%.2fx)\n",
          receiver_cpu, 100 * tcp_busy_sum / repeats, 100 * staged_busy, 100 * r.receiver_busy,
          per_gb_staged, per_gb_server, per_gb_staged > 0 ? per_gb_server / per_gb_staged : 0.0);
    }
    if (!watched->empty()) {
      std::printf("peak RSS MiB (%s): %s\n", absl::StrJoin(names, "/").c_str(),
                  PeakRssList(*watched).c_str());
    }
    const std::string least =
        pull ? "" : absl::StrFormat("; raw TCP with a push's least work %.3f GB/s", staged);
    std::printf("%s: %s_gbps=%.3f ratio=%.2f (raw TCP %.3f GB/s, %d streams%s)\n", mode.c_str(),
                pull ? "served" : "accepted", gbps, tcp > 0 ? gbps / tcp : 0.0, tcp, workers,
                least.c_str());
    return r.errors == 0 && r.updates > 0 ? 0 : 1;
  }
  if (mode == "scale") {
    std::vector<int> counts;
    for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',')) {
      int n = 0;
      if (!absl::SimpleAtoi(s, &n) || n < 1) {
        std::fprintf(stderr, "--workers: bad count '%s'\n", std::string(s).c_str());
        return 2;
      }
      counts.push_back(n);
    }
    const uint64_t update_bytes = DescribeServer();
    if (update_bytes == 0) return 1;
    if (round > 0) {
      std::printf(
          "each worker: push, then %.1f s of simulated training; first push at a random "
          "phase in [0, %.1f s), seed %llu\n",
          round, round, static_cast<unsigned long long>(absl::GetFlag(FLAGS_seed)));
    } else {
      std::printf("each worker pushes back to back (no training between pushes)\n");
    }
    std::printf("offered = workers x update bytes / round; cpu = cores used while pushing");
    if (!watched->empty()) {
      std::printf("; peak RSS so far of %s", absl::StrJoin(names, "/").c_str());
    }
    std::printf("; server ms/push = the server processes' CPU time per accepted push");
    std::printf("\n%8s %12s %12s %10s %10s %10s %7s %10s %10s %14s %16s\n", "workers",
                "offered GB/s", "accept GB/s", "updates/s", "p50 ms", "p99 ms", "errors",
                "cpu bench", "cpu server", "server ms/push", "peak RSS MiB");
    double p50_at_16 = 0, p99_at_max = 0;
    double cpu_ms_at_16 = 0;       // the server's CPU time per push with 16 workers
    double p99_alone_at_max = 0;   // of the pushes that overlapped no other, at the last count
    double overlapped_at_max = 0;  // the share of pushes that overlapped another, there
    int errors = 0;
    std::vector<std::string> overlap_rows;
    for (int n : counts) {
      const Result r = RunWorkers(n, seconds, round, *watched);
      // Where the tail comes from: pushes that shared the machine with others take longer.
      std::string row = absl::StrFormat("%8d", n);
      const std::array<std::vector<double>, 3> by_overlap = LatenciesByOverlap(r);
      for (const std::vector<double>& v : by_overlap) {
        absl::StrAppendFormat(&row, " %7d %6.1f %6.1f", v.size(), 1e3 * Percentile(v, 0.5),
                              1e3 * Percentile(v, 1.0));
      }
      overlap_rows.push_back(row);
      const size_t counted = by_overlap[0].size() + by_overlap[1].size() + by_overlap[2].size();
      p99_alone_at_max = 1e3 * Percentile(by_overlap[0], 0.99);
      overlapped_at_max =
          counted > 0 ? 1.0 - static_cast<double>(by_overlap[0].size()) / counted : 0.0;
      const double p50 = 1e3 * Percentile(r.latencies, 0.5);
      const double p99 = 1e3 * Percentile(r.latencies, 0.99);
      double server_cores = 0;
      for (double c : r.watched_cores) server_cores += c;
      const std::string server_cpu = watched->empty() ? "-" : absl::StrFormat("%.2f", server_cores);
      // How long one push keeps the server's cores busy: when it is about a lone push's latency,
      // pushes are bound by those cores, and k pushes at once take about k times as long.
      const double cpu_ms = r.updates > 0 ? 1e3 * server_cores * r.seconds / r.updates : 0.0;
      const std::string server_ms =
          watched->empty() || r.updates == 0 ? "-" : absl::StrFormat("%.1f", cpu_ms);
      const std::string offered =
          round > 0 ? absl::StrFormat("%.3f", n * static_cast<double>(update_bytes) / round / 1e9)
                    : "-";
      std::printf("%8d %12s %12.3f %10.2f %10.1f %10.1f %7d %10.2f %10s %14s %16s\n", n,
                  offered.c_str(), r.bytes / r.seconds / 1e9, r.updates / r.seconds, p50, p99,
                  r.errors, r.bench_cores, server_cpu.c_str(), server_ms.c_str(),
                  PeakRssList(*watched).c_str());
      std::fflush(stdout);
      if (n == 16) {
        p50_at_16 = p50;
        cpu_ms_at_16 = cpu_ms;
      }
      p99_at_max = p99;
      errors += r.errors;
    }
    std::printf(
        "pushes by how many other pushes overlapped them: count, p50 ms, max ms\n"
        "%8s %22s %22s %22s\n",
        "workers", "alone", "beside 1 other", "beside 2+ others");
    for (const std::string& row : overlap_rows) std::printf("%s\n", row.c_str());
    if (p50_at_16 > 0) {
      // The tail split in two: the pushes that had the server to themselves at the last count
      // (does the server slow down as workers are added?), and how many shared it.
      std::printf(
          "at %d workers: the pushes that overlapped no other p99 %.1f ms = %.2f x p50 at 16; "
          "%.0f%% overlapped another\n",
          counts.back(), p99_alone_at_max, p99_alone_at_max / p50_at_16, 100 * overlapped_at_max);
      if (cpu_ms_at_16 > 0) {
        std::printf(
            "at 16 workers the server's cores were busy %.1f ms per push, %.0f%% of the p50 "
            "latency (%.1f ms)\n",
            cpu_ms_at_16, 100 * cpu_ms_at_16 / p50_at_16, p50_at_16);
      }
    }
    std::printf("scale: p99_at_%d=%.1f ms ratio=%.2f (p50 at 16 workers: %.1f ms)\n", counts.back(),
                p99_at_max, p50_at_16 > 0 ? p99_at_max / p50_at_16 : 0.0, p50_at_16);
    return errors == 0 ? 0 : 1;
  }
  std::fprintf(stderr, "--mode must be ingest, egress or scale\n");
  return 2;
}

}  // namespace
}  // namespace aloe::bench

int main(int argc, char** argv) {
  aloe::KeepLargeBuffersInHeap(argv);                                   // as aloe-worker does
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as aloe-worker does
  aloe::SetUsage(
      "aloe-bench-push --server HOST:PORT --mode ingest|egress|scale [flags]\n"
      "Measures how fast a running aloe-server (plain async mode; single-process or the\n"
      "coordinator of a layer-sharded one) accepts pseudo-gradient pushes from simulated\n"
      "workers, against raw loopback TCP in the same run (ingest), serves pulls of the latest\n"
      "version to them (egress), or push latency and updates/s per number of concurrent\n"
      "workers, each training --round_seconds between pushes (scale). See\n"
      "scripts/bench/ingest.sh, egress.sh and scale.sh.");
  absl::ParseCommandLine(argc, argv);
  return aloe::bench::Main();
}
