// What the server's roles (single process, coordinator, shard process) share to run as a
// process: credentials, the gRPC server, the Prometheus endpoint, raw push listeners,
// checkpoints on disk and the port file.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "proto/aloe.pb.h"
#include "server/core/checkpoint_store.h"
#include "server/core/shard_sampler.h"
#include "server/service/auth.h"
#include "server/service/raw_push_listener.h"

namespace aloe::server {

// The corpus of config.corpus_dir: its training shards and its (first) held-out shard.
struct Corpus {
  std::vector<DataShard> train;
  std::string heldout_file;
};
// The manifest's errors; kInvalidArgument when it has no held-out shard or when the built-in
// model's vocab_size is below the corpus's (CorpusVocabSize, whose errors other than kNotFound
// it also returns).
absl::StatusOr<Corpus> LoadCorpus(const v1::ServerConfig& config);

// The whole of file `path`; kNotFound naming `what` when it cannot be opened.
absl::StatusOr<std::string> ReadWholeFile(const std::string& what, const std::string& path);

// Whether the host of HOST:PORT is a loopback address.
bool IsLoopback(const std::string& address);

// The address a shard process tells workers (`given`, default the one it listens on): one they
// can dial, so neither a wildcard host nor port 0. `flag` and `listen_flag` name the options in
// the error (kInvalidArgument).
absl::Status CheckAdvertised(const char* flag, const char* listen_flag, const std::string& given,
                             const std::string& listen);

// TLS (optionally mutual) when configured, else plaintext. A non-loopback address needs TLS and
// a token file unless security.insecure is set (kFailedPrecondition).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const v1::ServerConfig& config, const std::string& listen_address);

// The token authenticator of security.token_file (one that lets everybody in without it).
absl::StatusOr<std::unique_ptr<Authenticator>> LoadAuthenticator(const v1::ServerConfig& config);

// Builds, registers and starts the gRPC server on `address` (receive windows of
// config.receive_window_kib, probed with config.receive_window_probe); *port is the port bound.
// kUnavailable when it cannot listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc(
    const std::string& address, std::shared_ptr<grpc::ServerCredentials> credentials,
    const std::vector<grpc::Service*>& services, const v1::ServerConfig& config, int* port);

// The Prometheus endpoint of config.metrics_address (a sink that drops everything for "off");
// *port its port (0 for "off"); *endpoint, when given, the endpoint (null for "off"), to serve
// the status page on.
absl::StatusOr<std::unique_ptr<MetricsSink>> StartMetrics(const v1::ServerConfig& config, int* port,
                                                          PrometheusMetrics** endpoint = nullptr);

// The raw push listener on `push_listen` serving `handler`, or null for "". TLS when configured,
// with gRPC's certificates and client certificate rule; else plaintext. The same rule for
// non-loopback addresses as ServerCredentials' (kFailedPrecondition); kNotFound or
// kInvalidArgument for certificate files that cannot be read or used.
absl::StatusOr<std::unique_ptr<RawPushListener>> StartRawPushes(const v1::ServerConfig& config,
                                                                const std::string& push_listen,
                                                                RawPushListener::Handler handler);

// Writes "grpc=PORT metrics=PORT" to `path` atomically (a rename), for scripts and tests.
absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port);

// Writes one checkpoint and records it in the metrics. Logs and carries on when the disk fails:
// training continues, the next checkpoint tries again.
void WriteCheckpoint(CheckpointStore& store, const v1::ServerCheckpoint& checkpoint,
                     MetricsSink& metrics);

}  // namespace aloe::server
