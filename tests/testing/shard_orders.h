// ShardOrders for tests of the layer-sharded server (server/core/shard_state.h).
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

#include "proto/aloe.pb.h"

namespace aloe::testing {

// A COMMIT producing `version` from the (worker_id, update_id, weight) entries, keeping the
// older versions `keep`.
inline v1::ShardOrder CommitOrder(uint64_t version,
                                  const std::vector<std::tuple<uint64_t, uint64_t, float>>& entries,
                                  const std::vector<uint64_t>& keep = {}) {
  v1::ShardOrder order;
  order.set_kind(v1::ShardOrder::COMMIT);
  order.set_version(version);
  for (const auto& [worker, update, weight] : entries) {
    v1::CommitEntry* e = order.add_entries();
    e->set_worker_id(worker);
    e->set_update_id(update);
    e->set_weight(weight);
  }
  for (uint64_t v : keep) order.add_keep_versions(v);
  return order;
}

}  // namespace aloe::testing
