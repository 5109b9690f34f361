#include "worker/launcher.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe::worker {
namespace {

std::atomic<int> g_forward{0};
void RecordSignal(int sig) { g_forward.store(sig); }

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

absl::StatusOr<int> LaunchRanks(int argc, char** argv, int nproc) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string rendezvous =
      absl::StrFormat("%s/aloe-worker-%d-%d.rendezvous", tmp != nullptr && *tmp ? tmp : "/tmp",
                      getpid(), std::chrono::steady_clock::now().time_since_epoch().count());
  std::remove(rendezvous.c_str());
  signal(SIGINT, RecordSignal);
  signal(SIGTERM, RecordSignal);
  std::vector<pid_t> ranks;
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> args(argv, argv + argc);
    args.push_back(absl::StrFormat("--rank=%d", r));
    args.push_back("--rendezvous=" + rendezvous);
    if (r > 0) args.push_back("--metrics=off");  // rank 0 reports for the node
    std::vector<char*> c_args;
    for (std::string& a : args) c_args.push_back(a.data());
    c_args.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      for (pid_t p : ranks) kill(p, SIGKILL);
      return absl::InternalError(
          absl::StrFormat("cannot start rank %d: %s", r, std::strerror(errno)));
    }
    if (pid == 0) {
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      execv("/proc/self/exe", c_args.data());
      std::fprintf(stderr, "aloe-worker: cannot exec rank %d: %s\n", r, std::strerror(errno));
      _exit(127);
    }
    ranks.push_back(pid);
  }
  ALOE_LOG_INFO("worker", "started %d ranks (rendezvous %s)", nproc, rendezvous);
  int result = 0;
  size_t running = ranks.size();
  std::vector<bool> done(ranks.size(), false);
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_at{};
  while (running > 0) {
    if (const int sig = g_forward.exchange(0); sig != 0) {
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (!done[i]) kill(ranks[i], sig);
      }
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (ranks[i] != pid) continue;
        done[i] = true;
        --running;
        const int code = ExitCode(status);
        if (code != 0 && result == 0) {
          result = code;
          ALOE_LOG_ERROR("worker", "rank %d exited with %d; stopping the other ranks", i, code);
        }
      }
      if (result != 0 && !stopping) {
        stopping = true;
        kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        for (size_t i = 0; i < ranks.size(); ++i) {
          if (!done[i]) kill(ranks[i], SIGTERM);
        }
      }
      continue;
    }
    if (stopping && std::chrono::steady_clock::now() > kill_at) {
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (!done[i]) kill(ranks[i], SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::remove(rendezvous.c_str());
  return result;
}

}  // namespace aloe::worker
