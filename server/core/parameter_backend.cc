#include "server/core/parameter_backend.h"

#include <utility>

#include "common/layer_groups.h"
#include "common/status_macros.h"
#include "server/core/local_parameters.h"
#include "server/core/shard_commit_log.h"

namespace aloe::server {

absl::StatusOr<DeployedParameters> CreateParameterBackend(const v1::ServerConfig& config,
                                                          Executor& executor, const Clock& clock,
                                                          MetricsSink& metrics) {
  DeployedParameters deployed;
  if (config.shard_processes() > 0) {
    // The shard processes hold the parameters; the coordinator keeps only their layout.
    ALOE_ASSIGN_OR_RETURN(deployed.model, LoadServerModel(config, kNoLayers));
    std::vector<uint32_t> layer_groups;
    if (config.partial_sync().groups() > 1) {
      ALOE_ASSIGN_OR_RETURN(layer_groups,
                            AssignLayerGroups(deployed.model.spec, config.partial_sync().groups()));
    }
    auto log = std::make_unique<ShardCommitLog>(config, deployed.model.spec, layer_groups);
    deployed.shard_log = log.get();
    deployed.backend = std::move(log);
    return deployed;
  }
  ALOE_ASSIGN_OR_RETURN(deployed.model, LoadServerModel(config, kAllLayers));
  ALOE_ASSIGN_OR_RETURN(deployed.backend, LocalParameters::Create(config, deployed.model.spec,
                                                                  std::move(deployed.model.initial),
                                                                  executor, clock, metrics));
  deployed.model.initial.clear();
  return deployed;
}

}  // namespace aloe::server
