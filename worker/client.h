// gRPC client of aloe-server for one worker: control calls with deadlines, Pull into per-layer
// buffers with full validation of what arrives, Push of a pseudo-gradient as a stream of
// <= 1 MiB layer chunks. Thread-safe (gRPC stubs are), but one Pull/Push at a time per buffer.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/aloe.grpc.pb.h"

namespace aloe::worker {

// The one place where grpc::Status becomes absl::Status on the worker side.
absl::Status FromGrpcStatus(const grpc::Status& status);

// How to reach the server: plaintext, or TLS verified against a CA (with an optional client
// certificate for mutual TLS), plus the shared token sent as x-aloe-token on every call.
struct ClientOptions {
  std::string address;
  std::string token;             // "" = none
  std::string tls_ca_pem;        // "" = plaintext
  std::string tls_cert_pem;      // client certificate chain (mutual TLS), optional
  std::string tls_key_pem;
  std::string tls_server_name;   // overrides the name checked in the server certificate
};

class ServerClient {
 public:
  explicit ServerClient(const ClientOptions& options);

  // Sets a call's deadline and token.
  void PrepareContext(grpc::ClientContext* context, int seconds) const;

  absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest& request);
  absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request);
  // ahead: a look-ahead task while the open one is still to be pushed (TaskRequest.ahead).
  absl::StatusOr<v1::Task> RequestTask(uint64_t worker_id, bool ahead = false);
  absl::Status ReportEval(const v1::EvalReport& report);
  absl::Status Leave(uint64_t worker_id);

  // Pulls `version` (or the latest when latest is true) into layers, resized per spec. With
  // slices > 1 only slice `slice` of every layer is pulled (SliceRange, common/model_spec.h) and
  // layers[l] holds just that slice. Returns the version received. kDataLoss when the stream is
  // inconsistent (mixed versions, gaps, wrong sizes, non-finite values).
  absl::StatusOr<uint64_t> Pull(uint64_t worker_id, uint64_t version, bool latest,
                                const v1::ModelSpec& spec, std::vector<std::vector<float>>* layers,
                                uint64_t* bytes, uint32_t slice = 0, uint32_t slices = 1);

  // Pushes a pseudo-gradient (one buffer per spec layer) under `header`, layer l encoded with
  // codecs[l] (empty: FP32 everywhere) in chunks of <= 1 MiB. With header.slices() > 1, layers[l]
  // is slice header.slice() of layer l and the chunk offsets are placed accordingly. When
  // residuals is not null it receives, per layer, layers - decode(encode(layers)) for error
  // feedback. kInvalidArgument (nothing sent) when a value cannot be encoded.
  absl::StatusOr<v1::PushReply> Push(const v1::PushHeader& header, const v1::ModelSpec& spec,
                                     const std::vector<std::vector<float>>& layers,
                                     const std::vector<v1::Codec>& codecs, size_t int8_block_size,
                                     std::vector<std::vector<float>>* residuals, uint64_t* bytes);

 private:

  std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  std::unique_ptr<v1::ParameterService::Stub> parameters_;
};

}  // namespace aloe::worker
