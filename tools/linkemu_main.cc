// aloe-linkemu: a long, slow network link between workers and servers on one host
// (tools/link_emulator.h): a TCP proxy that delays, rate-limits and, on a signal, cuts or stalls
// what crosses it.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/flags_usage.h"
#include "tools/link_emulator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "host:port to listen on (port 0: any); several, comma-separated, one per --upstream");
ABSL_FLAG(std::string, upstream, "",
          "host:port each --listen address forwards to, comma-separated in the same order");
ABSL_FLAG(double, delay_ms, 0, "One-way delay of each direction, milliseconds (RTT = 2x)");
ABSL_FLAG(double, rate_mbit, 0, "Rate of each direction, Mbit/s (10^6 bits); 0 = no limit");
ABSL_FLAG(double, jitter_ms, 0,
          "Extra delay of each piece of a stream, uniform in [0, jitter], order kept");
ABSL_FLAG(uint64_t, window_kib, 65536,
          "Unacknowledged bytes per connection and direction (the TCP window of the emulated "
          "endpoints), KiB: a connection moves at most one window per round trip");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the jitter");
ABSL_FLAG(std::string, port_file, "",
          "Once listening, write \"route0=PORT route1=PORT ...\" here (with --listen port 0)");

namespace aloe::tools {
namespace {

int Main() {
  const std::vector<std::string> listen = absl::StrSplit(absl::GetFlag(FLAGS_listen), ',');
  const std::vector<std::string> upstream =
      absl::StrSplit(absl::GetFlag(FLAGS_upstream), ',', absl::SkipEmpty());
  if (upstream.empty() || upstream.size() != listen.size()) {
    std::fprintf(stderr, "aloe-linkemu: --upstream needs one address per --listen (see --help)\n");
    return 2;
  }
  LinkEmulatorOptions options;
  for (size_t i = 0; i < listen.size(); ++i) options.routes.push_back({listen[i], upstream[i]});
  options.up.rate_bps = absl::GetFlag(FLAGS_rate_mbit) * 1e6;
  options.up.delay = absl::Microseconds(1e3 * absl::GetFlag(FLAGS_delay_ms));
  options.up.jitter = absl::Microseconds(1e3 * absl::GetFlag(FLAGS_jitter_ms));
  options.up.window_bytes = absl::GetFlag(FLAGS_window_kib) << 10;
  options.down = options.up;
  options.seed = absl::GetFlag(FLAGS_seed);

  // The control signals are taken by sigwait below, not by any thread the emulator starts.
  sigset_t signals;
  sigemptyset(&signals);
  for (int s : {SIGINT, SIGTERM, SIGUSR1, SIGUSR2}) sigaddset(&signals, s);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<LinkEmulator>> link = LinkEmulator::Start(options);
  if (!link.ok()) {
    std::fprintf(stderr, "aloe-linkemu: %s\n", std::string(link.status().message()).c_str());
    return 1;
  }
  std::vector<std::string> ports;
  for (size_t i = 0; i < listen.size(); ++i) {
    ports.push_back(absl::StrCat("route", i, "=", (*link)->port(i)));
    std::printf("aloe-linkemu: %s -> %s\n", (*link)->address(i).c_str(), upstream[i].c_str());
  }
  std::printf(
      "aloe-linkemu: one-way delay %.3f ms, jitter %.3f ms, rate %.1f Mbit/s, window %llu "
      "KiB, each direction; SIGUSR1 cuts every connection, SIGUSR2 stalls / resumes\n",
      absl::GetFlag(FLAGS_delay_ms), absl::GetFlag(FLAGS_jitter_ms), absl::GetFlag(FLAGS_rate_mbit),
      static_cast<unsigned long long>(absl::GetFlag(FLAGS_window_kib)));
  std::fflush(stdout);
  if (const std::string file = absl::GetFlag(FLAGS_port_file); !file.empty()) {
    std::ofstream(file) << absl::StrJoin(ports, " ") << "\n";
  }
  bool stalled = false;
  while (true) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGUSR1) {
      (*link)->Cut();
      std::printf("aloe-linkemu: cut every connection\n");
    } else if (sig == SIGUSR2) {
      stalled = !stalled;
      if (stalled) {
        (*link)->Stall();
      } else {
        (*link)->Resume();
      }
      std::printf("aloe-linkemu: %s\n", stalled ? "stalled" : "resumed");
    } else {
      break;
    }
    std::fflush(stdout);
  }
  const LinkStats stats = (*link)->Stats();
  (*link)->Shutdown();
  std::printf("aloe-linkemu: %llu connections, %llu bytes up, %llu bytes down\n",
              static_cast<unsigned long long>(stats.connections),
              static_cast<unsigned long long>(stats.up_bytes),
              static_cast<unsigned long long>(stats.down_bytes));
  return 0;
}

}  // namespace
}  // namespace aloe::tools

int main(int argc, char** argv) {
  aloe::SetUsage(
      "aloe-linkemu --listen HOST:PORT --upstream HOST:PORT [--delay_ms D] [--rate_mbit R]\n"
      "A long, slow network link on one host: a TCP proxy whose connections to --upstream cross\n"
      "an emulated link of one-way delay D and rate R per direction (optional jitter, a TCP\n"
      "window per connection). Faults: SIGUSR1 resets every open connection; SIGUSR2 stalls\n"
      "every byte in the link, and again resumes. SIGTERM or SIGINT stops it.");
  absl::ParseCommandLine(argc, argv);
  return aloe::tools::Main();
}
