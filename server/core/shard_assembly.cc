#include "server/core/shard_assembly.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace aloe::server {

std::string ShardedModelFingerprint(const v1::ServerConfig& config, const v1::ModelSpec& spec,
                                    const std::string& model_fingerprint) {
  std::string f =
      absl::StrFormat("sharded1;outer=%s/N=%d;processes=%d;",
                      v1::OuterOptimizerType_Name(config.outer_optimizer().type()),
                      config.outer_optimizer().dn_buffer_size(), config.shard_processes());
  for (const v1::LayerSpec& layer : spec.layers()) {
    absl::StrAppendFormat(&f, "%s:%d@%d;", layer.name(), layer.num_elements(), layer.shard());
  }
  if (!model_fingerprint.empty()) absl::StrAppend(&f, "model=", model_fingerprint);
  // The shards hold the penalty statistics: every process must agree on whether there are any.
  if (config.penalty().enabled()) absl::StrAppend(&f, ";penalty");
  return f;
}

uint64_t ChooseCommonVersion(const std::vector<uint64_t>& coordinator_versions,
                             const std::vector<ShardStart>& shards) {
  std::vector<uint64_t> candidates = coordinator_versions;
  std::sort(candidates.rbegin(), candidates.rend());
  for (uint64_t v : candidates) {
    const bool everybody = std::all_of(shards.begin(), shards.end(), [&](const ShardStart& s) {
      return s.version == v ||
             std::find(s.checkpoints.begin(), s.checkpoints.end(), v) != s.checkpoints.end();
    });
    if (everybody) return v;
  }
  return 0;
}

}  // namespace aloe::server
