// The benchmark drivers' Join: a simulated worker joins as a trainer, retrying while the server
// answers UNAVAILABLE (a layer-sharded server until its shard processes follow the coordinator).
#pragma once

#include <chrono>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "worker/client.h"

namespace aloe::bench {

// Joins `client` as trainer `name`, retrying every 100 ms while the server answers UNAVAILABLE
// for up to `seconds`. Returns the last answer.
inline absl::StatusOr<v1::JoinReply> JoinWithRetry(worker::ServerClient& client,
                                                   const std::string& name, double seconds) {
  v1::JoinRequest request;
  request.set_name(name);
  request.set_role(v1::ROLE_TRAINER);
  const auto t0 = std::chrono::steady_clock::now();
  while (true) {
    absl::StatusOr<v1::JoinReply> reply = client.Join(request);
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (reply.ok() || reply.status().code() != absl::StatusCode::kUnavailable || waited > seconds) {
      return reply;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace aloe::bench
