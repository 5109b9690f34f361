// Starts the ranks of one multi-rank worker node (aloe-worker --nproc N) and supervises them:
// N copies of this binary with --rank=r and a fresh --rendezvous file, SIGINT/SIGTERM forwarded
// to every rank, and the other ranks stopped when one fails (a dead rank would leave the rest
// blocked in a collective).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/fsdp.h"

namespace aloe::worker {

// argv: this process' command line (argv[0] included). Returns the exit code for the launcher:
// 0 when every rank exited 0, else the first failing rank's code (128 + signal when a rank was
// killed). kInternal when a rank cannot be started.
absl::StatusOr<int> LaunchRanks(int argc, char** argv, int nproc);

// Checks a process' place in its node (aloe-worker --nproc, --rank, --rendezvous: rank -1 for a
// one-process worker) and sets the training device (SetTrainerDevice, worker/trainer.h) from
// --device: with nproc > 1 on GPUs rank r trains on GPU r. Logs and returns the device chosen.
// kInvalidArgument naming the flag for a bad combination; kFailedPrecondition for GPUs this
// build or machine does not have.
absl::StatusOr<std::string> SetRankDevice(const std::string& device, int nproc, int rank,
                                          bool has_rendezvous);

// The process groups of rank `rank` of a node of `nproc` (ConnectNodeGroups, worker/fsdp.h);
// none for a one-process worker (nproc 1).
absl::StatusOr<std::vector<std::unique_ptr<Collectives>>> ConnectRank(const std::string& rendezvous,
                                                                      int rank, int nproc,
                                                                      int groups);

}  // namespace aloe::worker
