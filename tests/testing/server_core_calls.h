// ServerCore calls made the way a worker makes them, for the server's unit tests. Header-only:
// the test library does not link the server.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "common/config.h"
#include "common/status_matchers.h"
#include "server/core/server_core.h"

namespace aloe::testing {

// A validated config of a tiny model (2 layers, d_model 8): sync rounds of 2 trainers, H = 5,
// outer SGD with lr 0.5.
inline v1::ServerConfig TinyServerConfig() {
  v1::ServerConfig config;
  config.mutable_model()->set_vocab_size(16);
  config.mutable_model()->set_seq_len(8);
  config.mutable_model()->set_d_model(8);
  config.mutable_model()->set_num_layers(2);
  config.mutable_model()->set_num_heads(2);
  config.set_corpus_dir("unused");
  config.set_local_steps(5);
  config.mutable_aggregation()->set_min_workers(2);
  config.mutable_outer_optimizer()->set_type(v1::OUTER_SGD);
  config.mutable_outer_optimizer()->set_lr(0.5f);
  FillServerDefaults(&config);
  EXPECT_THAT(ValidateServerConfig(config), IsOk());
  return config;
}

// Joins a trainer named "w"; its worker id (0 after a failure, which the test reports).
inline uint64_t JoinTrainer(server::ServerCore& core) {
  v1::JoinRequest request;
  request.set_name("w");
  request.set_role(v1::ROLE_TRAINER);
  absl::StatusOr<v1::JoinReply> reply = core.Join(request);
  EXPECT_THAT(reply, IsOk());
  return reply.ok() ? reply->worker_id() : 0;
}

// RequestTask of `worker`; with `start_group`, the StartGroup of that layer group. An empty task
// after a failure (which the test reports).
inline v1::Task RequestTaskOf(server::ServerCore& core, uint64_t worker,
                              std::optional<uint32_t> start_group = std::nullopt) {
  v1::TaskRequest request;
  request.set_worker_id(worker);
  if (start_group) {
    request.set_start_group(true);
    request.set_group(*start_group);
  }
  absl::StatusOr<v1::Task> task = core.RequestTask(request);
  EXPECT_THAT(task, IsOk());
  return task.ok() ? *task : v1::Task();
}

}  // namespace aloe::testing
