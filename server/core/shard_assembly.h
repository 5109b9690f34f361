// Pure decisions of a layer-sharded server (coordinator + shard processes) that both sides must
// agree on: the fingerprint that says a shard process belongs to this coordinator, and the
// version every process restarts from when the shards (re)assemble.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "proto/aloe.pb.h"

namespace aloe::server {

// Model layout (layer names, sizes and owning process) + outer optimizer type and buffer size
// + bring-your-own model fingerprint (or ""). A shard process whose fingerprint differs from its
// coordinator's is refused, and a shard checkpoint of another fingerprint is not restored.
std::string ShardedModelFingerprint(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                                    const std::string& model_fingerprint);

// What one shard process can restart from: the version it is at (with its state intact when
// it has not just started) and the versions of its checkpoints on disk.
struct ShardStart {
  uint64_t version = 0;
  std::vector<uint64_t> checkpoints;
};

// The newest version that the coordinator (at one of `coordinator_versions`: its current
// version and its checkpoints) and every shard (at its version, or one of its checkpoints) can
// all be at. Version 0, the initial model, is always possible.
uint64_t ChooseCommonVersion(const std::vector<uint64_t>& coordinator_versions,
                             const std::vector<ShardStart>& shards);

}  // namespace aloe::server
