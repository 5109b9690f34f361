// aloe-bench-push: how fast a running aloe-server accepts pseudo-gradients, against raw loopback
// TCP measured in the same run.
//
// Every simulated worker is a real gRPC client (worker/client.h, the code path of aloe-worker):
// it joins as a trainer, then loops RequestTask -> Push of a full fp32 update (every value 0, so
// the model does not drift) without training. The server must run in plain async mode
// (aggregation { mode: AGGREGATION_ASYNC }, no grace window) so that every push is applied as it
// arrives, and with no stop condition.
//
//   --mode ingest: --pushers concurrent workers for --seconds; GB/s of pseudo-gradient accepted
//     (bytes of acknowledged pushes / wall time) vs the GB/s of --pushers concurrent loopback TCP
//     streams (1 MiB writes, a reader thread per stream) measured first in the same process.
//     Last line: "ingest: accepted_gbps=<X> ratio=<X / tcp> (raw TCP <Y> GB/s, N streams)".
//   --mode scale: for each worker count in --workers, that many concurrent workers for --seconds:
//     push latency p50/p99 (first byte sent to reply), updates/s. Last line:
//     "scale: p99_at_<max>=<ms> ms ratio=<p99 at max / p50 at 16> (p50 at 16: <ms> ms)".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/allocator.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "worker/client.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7070", "aloe-server address (plain async mode)");
ABSL_FLAG(std::string, mode, "ingest", "ingest | scale");
ABSL_FLAG(int32_t, pushers, 4, "ingest: concurrent workers (and TCP streams of the baseline)");
ABSL_FLAG(std::string, workers, "8,16,32,64", "scale: worker counts, comma-separated");
ABSL_FLAG(double, seconds, 10, "Measured seconds per configuration");

namespace aloe::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// GB/s of `streams` concurrent loopback TCP connections, each written with 1 MiB send()s for
// `seconds` and drained by its own reader thread.
double RawTcpGbps(int streams, double seconds) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, streams) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("raw TCP listener");
    return 0;
  }
  std::atomic<uint64_t> received{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  std::vector<int> senders;
  for (int s = 0; s < streams; ++s) {
    const int out = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(out, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      std::perror("raw TCP connect");
      return 0;
    }
    const int in = accept(listener, nullptr, nullptr);
    senders.push_back(out);
    threads.emplace_back([in, &received] {
      std::vector<char> buffer(1 << 20);
      ssize_t n;
      while ((n = recv(in, buffer.data(), buffer.size(), 0)) > 0) received += n;
      close(in);
    });
  }
  const auto t0 = Clock::now();
  std::atomic<uint64_t> at_start{0};
  std::vector<std::thread> writers;
  for (int out : senders) {
    writers.emplace_back([out, &stop] {
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
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const double elapsed = Since(t0);
  const uint64_t bytes = received.load() - at_start.load();
  stop = true;
  for (std::thread& t : writers) t.join();
  for (int out : senders) shutdown(out, SHUT_RDWR), close(out);
  for (std::thread& t : threads) t.join();
  close(listener);
  return static_cast<double>(bytes) / elapsed / 1e9;
}

struct Result {
  uint64_t updates = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  std::vector<double> latencies;  // seconds per push
  int errors = 0;
};

// `workers` concurrent simulated workers pushing full updates for `seconds` (after each joined and
// got its first task).
Result RunWorkers(int workers, double seconds) {
  worker::ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  std::vector<std::unique_ptr<worker::ServerClient>> clients;
  std::vector<v1::JoinReply> joined(workers);
  for (int w = 0; w < workers; ++w) {
    clients.push_back(std::make_unique<worker::ServerClient>(options));
    v1::JoinRequest request;
    request.set_name("bench-" + std::to_string(w));
    request.set_role(v1::ROLE_TRAINER);
    absl::StatusOr<v1::JoinReply> reply = clients[w]->Join(request);
    if (!reply.ok()) {
      std::fprintf(stderr, "join: %s\n", reply.status().ToString().c_str());
      std::exit(1);
    }
    joined[w] = *reply;
    // A layer-sharded server: the pushes go to its shard processes, as aloe-worker's do.
    absl::Status shards =
        clients[w]->SetShards({reply->shard_addresses().begin(), reply->shard_addresses().end()});
    if (!shards.ok()) {
      std::fprintf(stderr, "shard addresses: %s\n", shards.ToString().c_str());
      std::exit(1);
    }
  }
  const v1::ModelSpec& spec = joined[0].model_spec();
  std::vector<std::vector<float>> zeros;
  for (const v1::LayerSpec& layer : spec.layers()) zeros.emplace_back(layer.num_elements(), 0.0f);
  std::atomic<bool> go{false};
  std::atomic<bool> stop{false};
  std::vector<Result> per_worker(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      worker::ServerClient& client = *clients[w];
      const uint64_t id = joined[w].worker_id();
      Result& r = per_worker[w];
      uint64_t update_id = 0;
      while (!go.load()) std::this_thread::yield();
      while (!stop.load()) {
        absl::StatusOr<v1::Task> task = client.RequestTask(id);
        if (!task.ok() || task->kind() == v1::Task::STOP) {
          if (!task.ok()) std::fprintf(stderr, "task: %s\n", task.status().ToString().c_str());
          ++r.errors;
          return;
        }
        if (task->kind() != v1::Task::TRAIN) continue;  // WAIT: the server held it a while
        v1::PushHeader header;
        header.set_worker_id(id);
        header.set_task_id(task->task_id());
        header.set_update_id(++update_id);
        header.set_base_version(task->base_version());
        header.set_steps_done(task->local_steps());
        header.set_tokens_learned(1);
        header.set_codec(v1::CODEC_FP32);
        uint64_t bytes = 0;
        const auto t0 = Clock::now();
        absl::StatusOr<v1::PushReply> reply =
            client.Push(header, spec, zeros, {}, 256, nullptr, &bytes);
        const double latency = Since(t0);
        if (!reply.ok()) {
          std::fprintf(stderr, "push: %s\n", reply.status().ToString().c_str());
          ++r.errors;
          continue;
        }
        if (stop.load()) break;  // finished after the window: not counted
        ++r.updates;
        r.bytes += bytes;
        r.latencies.push_back(latency);
      }
    });
  }
  const auto t0 = Clock::now();
  go = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  Result total;
  total.seconds = Since(t0);
  for (std::thread& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    total.updates += per_worker[w].updates;
    total.bytes += per_worker[w].bytes;
    total.errors += per_worker[w].errors;
    total.latencies.insert(total.latencies.end(), per_worker[w].latencies.begin(),
                           per_worker[w].latencies.end());
    (void)clients[w]->Leave(joined[w].worker_id());
  }
  std::sort(total.latencies.begin(), total.latencies.end());
  return total;
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(p * (sorted.size() - 1) + 0.5));
  return sorted[i];
}

int Main() {
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "ingest") {
    const int pushers = absl::GetFlag(FLAGS_pushers);
    const double tcp = RawTcpGbps(pushers, seconds);
    std::printf("raw loopback TCP, %d streams: %.3f GB/s\n", pushers, tcp);
    const Result r = RunWorkers(pushers, seconds);
    const double gbps = static_cast<double>(r.bytes) / r.seconds / 1e9;
    std::printf(
        "aloe-server, %d pushers: %llu updates of %.1f MiB in %.1f s, %.3f GB/s, "
        "push p50 %.1f ms p99 %.1f ms, %d errors\n",
        pushers, static_cast<unsigned long long>(r.updates),
        r.updates ? r.bytes / 1048576.0 / r.updates : 0.0, r.seconds, gbps,
        1e3 * Percentile(r.latencies, 0.5), 1e3 * Percentile(r.latencies, 0.99), r.errors);
    std::printf("ingest: accepted_gbps=%.3f ratio=%.2f (raw TCP %.3f GB/s, %d streams)\n", gbps,
                tcp > 0 ? gbps / tcp : 0.0, tcp, pushers);
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
    std::printf("%8s %10s %12s %12s %12s %8s\n", "workers", "updates/s", "p50 ms", "p99 ms", "GB/s",
                "errors");
    double p50_at_16 = 0, p99_at_max = 0;
    int errors = 0;
    for (int n : counts) {
      const Result r = RunWorkers(n, seconds);
      const double p50 = 1e3 * Percentile(r.latencies, 0.5);
      const double p99 = 1e3 * Percentile(r.latencies, 0.99);
      std::printf("%8d %10.2f %12.1f %12.1f %12.3f %8d\n", n, r.updates / r.seconds, p50, p99,
                  r.bytes / r.seconds / 1e9, r.errors);
      std::fflush(stdout);
      if (n == 16) p50_at_16 = p50;
      p99_at_max = p99;
      errors += r.errors;
    }
    std::printf("scale: p99_at_%d=%.1f ms ratio=%.2f (p50 at 16 workers: %.1f ms)\n", counts.back(),
                p99_at_max, p50_at_16 > 0 ? p99_at_max / p50_at_16 : 0.0, p50_at_16);
    return errors == 0 ? 0 : 1;
  }
  std::fprintf(stderr, "--mode must be ingest or scale\n");
  return 2;
}

}  // namespace
}  // namespace aloe::bench

int main(int argc, char** argv) {
  aloe::KeepLargeBuffersInHeap(argv);  // as aloe-worker does
  aloe::SetUsage(
      "aloe-bench-push --server HOST:PORT --mode ingest|scale [flags]\n"
      "Measures how fast a running aloe-server (plain async mode) accepts pseudo-gradient pushes\n"
      "from simulated workers, against raw loopback TCP in the same run (ingest), or push latency\n"
      "and updates/s per number of concurrent workers (scale). See scripts/bench/ingest.sh.");
  absl::ParseCommandLine(argc, argv);
  return aloe::bench::Main();
}
