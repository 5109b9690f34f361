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

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/model_spec.h"
#include "common/status_macros.h"
#include "worker/trainer.h"

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

absl::StatusOr<std::string> SetRankDevice(const std::string& device, int nproc, int rank,
                                          bool has_rendezvous) {
  if (nproc < 1 || nproc > static_cast<int>(kMaxSlices)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--nproc must be in [1, %d], got %d", kMaxSlices, nproc));
  }
  if (nproc > 1 && (rank >= nproc || (rank >= 0 && !has_rendezvous))) {
    return absl::InvalidArgumentError("--rank and --rendezvous are set by --nproc, not by hand");
  }
  if (nproc == 1 && rank >= 0) {
    return absl::InvalidArgumentError("--rank is set by --nproc > 1, not by hand");
  }
  std::string chosen = device;
  if (nproc > 1 && (device == "cuda" || (device == "auto" && VisibleGpus() > 0))) {
    // One GPU per rank (with none, SetTrainerDevice says why).
    if (VisibleGpus() > 0 && VisibleGpus() < nproc) {
      return absl::FailedPreconditionError(
          absl::StrFormat("--nproc %d on GPUs needs a GPU per rank; LibTorch sees %d (give "
                          "--device cpu to train on the CPU)",
                          nproc, VisibleGpus()));
    }
    if (VisibleGpus() > 0) chosen = absl::StrCat("cuda:", rank);
  } else if (nproc > 1 && absl::StartsWith(device, "cuda:")) {
    return absl::InvalidArgumentError(
        "--device cuda:I is for one-process workers; with --nproc N give --device cuda (rank r "
        "trains on GPU r)");
  }
  absl::StatusOr<std::string> set = SetTrainerDevice(chosen);
  if (!set.ok())
    return absl::Status(set.status().code(), absl::StrCat("--", set.status().message()));
  ALOE_LOG_INFO("worker", "%straining on %s",
                nproc > 1 ? absl::StrFormat("rank %d: ", rank) : std::string(), *set);
  return set;
}

absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectRank(const std::string& rendezvous,
                                                                      int rank, int nproc,
                                                                      int groups) {
  if (nproc == 1) return std::vector<std::unique_ptr<Collectives>>();
  ALOE_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Collectives>> connected,
                        ConnectNodeGroups(rendezvous, rank, nproc, groups));
  ALOE_LOG_INFO("worker", "rank %d of %d connected", rank, nproc);
  return connected;
}

}  // namespace aloe::worker
