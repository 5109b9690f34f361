// The order journal of a layer-sharded server's coordinator (aloe-server --role coordinator
// --order_journal FILE): every order the shard processes are sent, written before it is sent, so
// the file says which updates, with which weights, formed each version.
//
// Format: length-delimited v1::ShardOrder messages (varint size, then the message), appended.
// Besides the COMMIT and DISCARD orders of the coordinator's log, a RESTORE of version v is
// written whenever the processes (re)assemble at v (at start and after a shard process restarts):
// every COMMIT of a version above v written before it was undone. CommittedHistory() applies that
// rule, so a journal replays to the exact state of the shard processes
// (tests/integration/sharded_server_test.cc does, against a single-process replay).
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

class OrderJournal {
 public:
  // Opens `path` for appending (creating it). kInvalidArgument naming the path when it cannot be
  // opened.
  static absl::StatusOr<std::unique_ptr<OrderJournal>> Open(const std::string& path);

  // Appends the orders of `log` not appended yet. `log` is the coordinator's order log since the
  // last Assembled() (ServerCore::orders()) from absolute index `first` on (the log grows at the
  // end and may be trimmed at the front, but only of orders that were sent, hence journaled).
  // Write errors are logged once and kept in status(); training goes on.
  void CatchUp(absl::Span<const v1::ShardOrder> log, uint64_t first = 0);
  // The processes (re)assembled at `version`: appends RESTORE `version`; the log passed to
  // CatchUp from now on is a new one (it starts empty).
  void Assembled(uint64_t version);
  // The first write error, OK when none.
  absl::Status status() const;

 private:
  explicit OrderJournal(std::string path) : path_(std::move(path)) {}
  void Append(const v1::ShardOrder& order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  std::ofstream out_ ABSL_GUARDED_BY(mu_);
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;  // absolute index of the next order to append
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Every order in the journal at `path`, in order. kNotFound for a missing file; kDataLoss naming
// the entry for a truncated or unparsable one (a journal cut by a crash loses only its last
// entry: ReadOrderJournal reports it, the caller may keep what came before).
absl::StatusOr<std::vector<v1::ShardOrder>> ReadOrderJournal(const std::string& path);

// The COMMITs that stand, in order: a RESTORE of version v removes every COMMIT of a version
// above v seen before it. kDataLoss when the COMMITs that stand do not count up by one from the
// first RESTORE's version (a journal with gaps cannot be replayed).
absl::StatusOr<std::vector<v1::ShardOrder>> CommittedHistory(
    absl::Span<const v1::ShardOrder> journal);

}  // namespace aloe::server
