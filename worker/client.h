// gRPC client of aloe-server for one worker: control calls with deadlines, Pull into per-layer
// buffers with full validation of what arrives, Push of a pseudo-gradient as a stream of
// <= 1 MiB layer chunks. Against a layer-sharded server (SetShards) Pull and Push talk to every
// shard process in parallel, each about the layers it owns; PullGroup and PushGroup to those
// that own a layer of the group. Thread-safe (gRPC stubs are; the
// shard set is swapped under a lock), but one Pull/Push at a time per buffer.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tls_stream.h"
#include "proto/aloe.grpc.pb.h"
#include "worker/server_api.h"

namespace aloe::worker {

// The one place where grpc::Status becomes absl::Status on the worker side.
absl::Status FromGrpcStatus(const grpc::Status& status);

// gRPC's wait between attempts to reconnect a channel, in milliseconds: from the first, doubling
// up to the last. Its default (1 s growing by 1.6x up to 120 s) kept a worker off a restarted
// server for many seconds after a short outage: a call fails at once while its channel waits
// to reconnect. Bounded at 1 s, the channel is up within a second of the server; how often the
// worker calls is bounded by its own RetryBackoff.
inline constexpr int kReconnectBackoffInitialMs = 100;
inline constexpr int kReconnectBackoffMaxMs = 1000;

// The arguments of every channel a worker opens to the coordinator, a single server or a shard
// process: the reconnect backoff above and a 2 MiB receive limit.
grpc::ChannelArguments WorkerChannelArguments();

// How to reach the server: plaintext, or TLS verified against a CA (with an optional client
// certificate for mutual TLS), plus the shared token sent as x-aloe-token on every call.
struct ClientOptions {
  std::string address;
  std::string token;         // "" = none
  std::string tls_ca_pem;    // "" = plaintext
  std::string tls_cert_pem;  // client certificate chain (mutual TLS), optional
  std::string tls_key_pem;
  std::string tls_server_name;  // overrides the name checked in the server certificate
  // Push float32 layers to shards that offer raw pushes (JoinReply.shard_push_addresses,
  // common/raw_push.h) over their own TCP connections instead of gRPC. With tls_ca_pem set they
  // use TLS with the certificates above (common/tls_stream.h), never plaintext.
  bool raw_push = true;
  // Concurrent streams of a whole-model pull from a single server, each carrying one slice of
  // every layer (PullRequest.slices) over a connection of its own. On long links each
  // connection starts with its own HTTP/2 windows, so several fill the link before gRPC's
  // probing has grown one connection's window to the bandwidth-delay product
  // (docs/operations.md, long links). 1 = one stream. Sharded servers already pull one stream
  // per shard, and slice pulls (FSDP) stay one stream.
  uint32_t pull_streams = 1;
};

// Files that hold a client's secrets; "" = none.
struct ClientFiles {
  std::string token_file;  // its first line is the access token
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
};

// Reads `files` into options' token (first line, trimmed), tls_ca_pem, tls_cert_pem and
// tls_key_pem. kNotFound naming the flag and path of a file that cannot be opened.
absl::Status LoadClientFiles(const ClientFiles& files, ClientOptions* options);

// The shard processes that own at least one layer of layer group `group` (layer_groups[l] ==
// group and spec.layers(l).shard() == s), in ascending order: where a group's pushes and
// pulls go. layer_groups has one entry per spec layer.
std::vector<uint32_t> ShardsOfGroup(const v1::ModelSpec& spec,
                                    absl::Span<const uint32_t> layer_groups, uint32_t group);

// One shard's part of a pull of a layer group: pulls shard `shard`'s layers of the group at
// group version `version` or later into the caller's buffers (replacing what an earlier pull
// of the same shard wrote) and returns the group version it sent; nullopt when it sent no chunk
// (its layers of the group are empty). Called for several shards at once.
using GroupShardPull =
    std::function<absl::StatusOr<std::optional<uint64_t>>(uint32_t shard, uint64_t version)>;

// Pulls a layer group from every shard of `shards` in parallel, first at min_version, then
// those behind the newest group version any of them sent at that version again, until they
// agree, for at most kGroupPullRounds rounds. Returns the agreed version (0 when no shard sent
// a chunk). The first failed pull in shard order is the error; kDataLoss naming each shard and
// its version when they still disagree after the last round.
inline constexpr int kGroupPullRounds = 4;
absl::StatusOr<uint64_t> PullAgreedGroupVersion(absl::Span<const uint32_t> shards, uint32_t group,
                                                uint64_t min_version, const GroupShardPull& pull);

class ServerClient final : public ServerApi {
 public:
  explicit ServerClient(const ClientOptions& options);

  // A gRPC channel whose connection broke fails calls at once until it reconnects, and it
  // reconnects only when a call asks it to: each try would only start the connection the next
  // one uses, a whole backoff wait later. This waits for the connections instead.
  absl::Duration AwaitServers(absl::Duration wait, const std::atomic<bool>* stop) override;
  ServerClient(const ServerClient&) = delete;
  ServerClient& operator=(const ServerClient&) = delete;

  // Sets a call's deadline and token.
  void PrepareContext(grpc::ClientContext* context, int seconds) const;

  absl::StatusOr<v1::JoinReply> Join(const v1::JoinRequest& request) override;
  absl::StatusOr<v1::HeartbeatReply> Heartbeat(const v1::HeartbeatRequest& request) override;
  // ahead: a look-ahead task while the open one is still to be pushed (TaskRequest.ahead);
  // dropped_task_id: the open task given up (TaskRequest.dropped_task_id), 0 for none.
  absl::StatusOr<v1::Task> RequestTask(uint64_t worker_id, bool ahead = false,
                                       uint64_t dropped_task_id = 0) override;
  absl::Status ReportEval(const v1::EvalReport& report) override;
  absl::Status Leave(uint64_t worker_id) override;

  // Where Pull and Push go: empty (the default) = the server at options.address; else
  // addresses[i] is shard process i, which serves the layers l with spec.layers(l).shard() == i
  // (JoinReply.shard_addresses; call it with every join reply). Channels use the credentials,
  // token and channel arguments of the main channel; setting the same list again keeps them.
  // kInvalidArgument (nothing changed) for an empty address. Pulls and pushes already under way
  // finish on the shards they started with. push_addresses (JoinReply.shard_push_addresses):
  // empty, or one per shard, "" where a shard takes no raw pushes; kInvalidArgument when there
  // are some but not one per shard. server_push_address (JoinReply.push_address): where a
  // single-process server (no shards) takes raw pushes, "" = none.
  absl::Status SetShards(const std::vector<std::string>& addresses,
                         const std::vector<std::string>& push_addresses = {},
                         const std::string& server_push_address = "") override;

  // Pulls `version` (or the latest when latest is true) into layers, resized per spec. With
  // slices > 1 only slice `slice` of every layer is pulled (SliceRange, common/model_spec.h) and
  // layers[l] holds just that slice. Returns the version received. kDataLoss when the stream is
  // inconsistent (mixed versions, gaps, wrong sizes, non-finite values). With shards every shard
  // streams its own layers in parallel; kDataLoss as well when a shard sends a layer it does not
  // own or the shards send different versions (for `latest`, shards that sent an older version
  // than another are pulled again at the newer one first: each shard applies a commit on its
  // own); kInvalidArgument when a spec layer names a shard that does not exist. A shard's failure
  // is its status, the message naming the shard.
  absl::StatusOr<uint64_t> Pull(uint64_t worker_id, uint64_t version, bool latest,
                                const v1::ModelSpec& spec, std::vector<std::vector<float>>* layers,
                                uint64_t* bytes, uint32_t slice = 0, uint32_t slices = 1) override;

  void SetLowRankEncoder(std::shared_ptr<LowRankPushEncoder> encoder) override {
    absl::MutexLock lock(&low_rank_mu_);
    low_rank_ = std::move(encoder);
  }

  // Pushes a pseudo-gradient (one buffer per spec layer) under `header`, layer l encoded with
  // codecs[l] (empty: FP32 everywhere) in chunks of <= 1 MiB; a CODEC_LOWRANK layer by the
  // SetLowRankEncoder encoder, whole layers only (kFailedPrecondition for a sliced push or
  // without one). With header.slices() > 1, layers[l]
  // is slice header.slice() of layer l and the chunk offsets are placed accordingly. When
  // residuals is not null it receives, per layer, layers - decode(encode(layers)) for error
  // feedback; block_sizes gives the int8 and int4 blocks. kInvalidArgument (nothing sent) when a
  // value cannot be encoded (NaN or Inf in a bf16, int8 or int4 layer); float32 values are sent as
  // they are, and the server refuses a NaN or Inf among them (kInvalidArgument naming the layer and
  // element). *bytes grows by the payload bytes sent.
  //
  // With shards every shard gets, in parallel, a stream of the chunks of its own layers under
  // the same header (a header-only message when it has none) and answers staged = true until
  // the shards' parts (and, sliced, all slices) are in. A shard that takes raw pushes gets its
  // layers that way (over one kept-open TCP connection, reopened once when a reused one turns
  // out closed) when all of them are float32 and ClientOptions.raw_push allows it (and so does a
  // single-process server that takes raw pushes, with every layer); kInvalidArgument
  // (nothing sent there) when a layer buffer's size is not its layer's (or slice's). The result
  // is the first shard error in
  // shard order; else the reply with staged = false; else staged = true with slices_received
  // the minimum and version the maximum over the shards. kInvalidArgument (nothing sent) when
  // a spec layer names a shard that does not exist or layers does not match the spec.
  absl::StatusOr<v1::PushReply> Push(const v1::PushHeader& header, const v1::ModelSpec& spec,
                                     const std::vector<std::vector<float>>& layers,
                                     const std::vector<v1::Codec>& codecs,
                                     const BlockSizes& block_sizes,
                                     std::vector<std::vector<float>>* residuals,
                                     uint64_t* bytes) override;

  // Partial synchronization (JoinReply.layer_groups). StartGroup: TaskRequest.start_group for
  // `group`, asked of the coordinator (or the single server).
  absl::StatusOr<v1::Task> StartGroup(uint64_t worker_id, uint32_t group) override;
  // Pulls the current version of layer group `group` (PullRequest.by_group, with
  // min_group_version as its least version) into the group's layers of *layers (resized per
  // spec; the other layers are left as they are) and returns the group's version. kDataLoss as
  // Pull's, and for a chunk of a layer outside the group; kInvalidArgument when layer_groups
  // does not have one entry per spec layer. With shards only the shard processes that own a
  // layer of the group are asked (ShardsOfGroup), in parallel; each waits until its version of
  // the group is at least min_group_version and streams its own layers of the group. They must
  // send the same group version: shards behind the newest one sent are pulled again at it
  // (each applies a group's commit on its own), a few rounds at most, then kDataLoss naming
  // every shard and its version.
  absl::StatusOr<uint64_t> PullGroup(uint64_t worker_id, uint32_t group, uint64_t min_group_version,
                                     const v1::ModelSpec& spec,
                                     absl::Span<const uint32_t> layer_groups,
                                     std::vector<std::vector<float>>* layers,
                                     uint64_t* bytes) override;
  // Push's contract for the layers of group header.group() (layer_groups[l] == group): only
  // they are encoded and sent (raw when they are all float32), and only their residuals
  // change; the other buffers are ignored and may be empty. With shards only the shard
  // processes that own a layer of the group get the push (ShardsOfGroup), each its own layers
  // of the group under the same header; the others get nothing, not even the header. The
  // replies combine as Push's; kInvalidArgument (nothing sent) for a group without layers.
  absl::StatusOr<v1::PushReply> PushGroup(const v1::PushHeader& header, const v1::ModelSpec& spec,
                                          absl::Span<const uint32_t> layer_groups,
                                          const std::vector<std::vector<float>>& layers,
                                          const std::vector<v1::Codec>& codecs,
                                          const BlockSizes& block_sizes,
                                          std::vector<std::vector<float>>* residuals,
                                          uint64_t* bytes) override;

 private:
  // Push, or with layer_groups PushGroup (both checked by the caller).
  absl::StatusOr<v1::PushReply> PushLayers(const v1::PushHeader& header, const v1::ModelSpec& spec,
                                           absl::Span<const uint32_t> layer_groups,
                                           const std::vector<std::vector<float>>& layers,
                                           const std::vector<v1::Codec>& codecs,
                                           const BlockSizes& block_sizes,
                                           std::vector<std::vector<float>>* residuals,
                                           uint64_t* bytes);
  // Pull of whole layers from the single server in pull_streams_ concurrent slice streams
  // (`request` without slices); the same contract as Pull.
  absl::StatusOr<uint64_t> PullInParts(const v1::PullRequest& request, const v1::ModelSpec& spec,
                                       std::vector<std::vector<float>>* layers, uint64_t* bytes);

  // One shard process of a layer-sharded server.
  // A kept-open raw push connection; one push at a time.
  struct RawConnection {
    absl::Mutex mu;
    int fd ABSL_GUARDED_BY(mu) = -1;
    std::unique_ptr<TlsStream> tls ABSL_GUARDED_BY(mu);  // set on fd under TLS
    // After a failed connect, pushes to this shard go over gRPC until then.
    absl::Time grpc_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
    // Ends the connection (the next push opens another).
    void Close() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
    ~RawConnection();
  };
  struct Shard {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::string push_address;            // "" = gRPC pushes only
    std::shared_ptr<RawConnection> raw;  // set with push_address
  };
  using ShardSet = std::vector<Shard>;

  // A channel to `address` with the options' credentials and arguments.
  std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) const;
  // The shard set now (empty = single server). Shared so that a Pull or Push keeps using the
  // set it started with while SetShards swaps in another.
  std::shared_ptr<const ShardSet> Shards() const;
  // A single-process server's raw push endpoint (null = none), shared likewise.
  std::shared_ptr<const Shard> ServerRaw() const;

  // One raw push of `layers`' ranges to shard `index` (nullopt: every layer, to a single-process
  // server), with layer_groups only those of group header.group() (RawPushRanges). *unreachable =
  // true (and nothing sent) when its listener cannot be connected, now or within kRawPushRetry of
  // the last failure: the caller pushes over gRPC instead. Under TLS a failed handshake is the
  // push's error (as a gRPC push's would be), naming the reason; so is a refusal of this client's
  // certificate.
  absl::StatusOr<v1::PushReply> SendRawPush(const Shard& shard, std::optional<uint32_t> index,
                                            const v1::PushHeader& header, const v1::ModelSpec& spec,
                                            const std::vector<std::vector<float>>& layers,
                                            uint64_t* bytes, bool* unreachable,
                                            absl::Span<const uint32_t> layer_groups = {}) const;

  std::string token_;
  mutable absl::Mutex low_rank_mu_;
  std::shared_ptr<LowRankPushEncoder> low_rank_ ABSL_GUARDED_BY(low_rank_mu_);
  bool raw_push_ = true;
  uint32_t pull_streams_ = 1;
  std::shared_ptr<const TlsContext> raw_tls_;  // null: raw pushes in plaintext
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  grpc::ChannelArguments channel_args_;
  std::shared_ptr<grpc::Channel> channel_;
  // Connections of their own for the parts of a pull after the first (pull_streams_ - 1).
  std::vector<std::shared_ptr<grpc::Channel>> pull_channels_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const ShardSet> shards_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Shard> server_raw_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe::worker
