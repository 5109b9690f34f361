#include "server/core/order_journal.h"

#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <google/protobuf/util/delimited_message_util.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"

namespace aloe::server {

absl::StatusOr<std::unique_ptr<OrderJournal>> OrderJournal::Open(const std::string& path) {
  std::unique_ptr<OrderJournal> journal(new OrderJournal(path));
  absl::MutexLock lock(&journal->mu_);
  journal->out_.open(path, std::ios::binary | std::ios::app);
  if (!journal->out_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("cannot open the order journal %s for appending", path));
  }
  return journal;
}

void OrderJournal::Append(const v1::ShardOrder& order) {
  if (!status_.ok()) return;
  if (!google::protobuf::util::SerializeDelimitedToOstream(order, &out_) || !out_.flush()) {
    status_ = absl::DataLossError(absl::StrFormat(
        "writing the order journal %s failed; it ends before version %d", path_, order.version()));
    ALOE_LOG_ERROR("coordinator", "%s", status_.message());
  }
}

void OrderJournal::CatchUp(absl::Span<const v1::ShardOrder> log, uint64_t first) {
  absl::MutexLock lock(&mu_);
  written_ = std::max(written_, first);
  for (; written_ < first + log.size(); ++written_) Append(log[written_ - first]);
}

void OrderJournal::Assembled(uint64_t version) {
  absl::MutexLock lock(&mu_);
  v1::ShardOrder restore;
  restore.set_kind(v1::ShardOrder::RESTORE);
  restore.set_version(version);
  Append(restore);
  written_ = 0;
}

absl::Status OrderJournal::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::StatusOr<std::vector<v1::ShardOrder>> ReadOrderJournal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrFormat("no order journal at %s", path));
  google::protobuf::io::IstreamInputStream stream(&in);
  std::vector<v1::ShardOrder> orders;
  while (true) {
    v1::ShardOrder order;
    bool clean_eof = false;
    if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&order, &stream, &clean_eof)) {
      if (clean_eof) return orders;
      return absl::DataLossError(absl::StrFormat(
          "order journal %s: entry %d is truncated or unparsable (%d entries before it are "
          "whole)",
          path, orders.size(), orders.size()));
    }
    orders.push_back(std::move(order));
  }
}

absl::StatusOr<std::vector<v1::ShardOrder>> CommittedHistory(
    absl::Span<const v1::ShardOrder> journal) {
  std::vector<v1::ShardOrder> commits;
  bool started = false;
  uint64_t base = 0;  // the version before commits.front()
  for (size_t i = 0; i < journal.size(); ++i) {
    const v1::ShardOrder& order = journal[i];
    if (order.kind() == v1::ShardOrder::RESTORE) {
      if (!started) {
        started = true;
        base = order.version();
      } else if (order.version() < base) {
        // Back before the first RESTORE's version: the history restarts there.
        commits.clear();
        base = order.version();
      } else if (order.version() > base + commits.size()) {
        return absl::DataLossError(absl::StrFormat(
            "order journal entry %d restores version %d, but the commits so far reach only %d", i,
            order.version(), base + commits.size()));
      }
      commits.resize(order.version() - base);
    } else if (order.kind() == v1::ShardOrder::COMMIT) {
      if (!started || order.version() != base + commits.size() + 1) {
        return absl::DataLossError(absl::StrFormat(
            "order journal entry %d commits version %d, expected %s", i, order.version(),
            started ? absl::StrCat(base + commits.size() + 1) : "a RESTORE first"));
      }
      commits.push_back(order);
    }
  }
  return commits;
}

}  // namespace aloe::server
