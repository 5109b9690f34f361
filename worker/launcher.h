// Starts the ranks of one multi-rank worker node (aloe-worker --nproc N) and supervises them:
// N copies of this binary with --rank=r and a fresh --rendezvous file, SIGINT/SIGTERM forwarded
// to every rank, and the other ranks stopped when one fails (a dead rank would leave the rest
// blocked in a collective).
#pragma once

#include "absl/status/statusor.h"

namespace aloe::worker {

// argv: this process' command line (argv[0] included). Returns the exit code for the launcher:
// 0 when every rank exited 0, else the first failing rank's code (128 + signal when a rank was
// killed). kInternal when a rank cannot be started.
absl::StatusOr<int> LaunchRanks(int argc, char** argv, int nproc);

}  // namespace aloe::worker
