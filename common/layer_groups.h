// Layer groups for partial synchronization (ServerConfig.partial_sync, paper 003 and Streaming
// DiLoCo): the model's layers, in spec order, split into K contiguous groups that are
// synchronized separately. Server and workers compute the same split from the spec.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/aloe.pb.h"

namespace aloe {

// The group of each layer of `spec`: K = `groups` contiguous, non-empty groups in spec order,
// balanced by elements (a layer goes to the group whose share of the model its midpoint falls
// in, moving on early where the layers left are just enough to give every later group one).
// groups = 1 puts every layer in group 0. kInvalidArgument for groups = 0 or more groups than
// layers.
absl::StatusOr<std::vector<uint32_t>> AssignLayerGroups(const v1::ModelSpec& spec, uint32_t groups);

// The layers of each group, in spec order (group_of_layer as AssignLayerGroups returns it).
std::vector<std::vector<uint32_t>> LayersOfGroups(const std::vector<uint32_t>& group_of_layer);

}  // namespace aloe
