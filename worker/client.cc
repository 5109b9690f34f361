#include "worker/client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/low_rank_push.h"
#include "common/model_spec.h"
#include "common/push_wire.h"
#include "common/raw_push.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "kernels/cpu/outer_kernels.h"

namespace aloe::worker {
namespace {

void SetDeadline(grpc::ClientContext* context, int seconds) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

constexpr int kControlDeadlineSeconds = 30;
// A raw push listener is a shard on the job's network: connecting takes milliseconds, and one
// that does not answer within seconds is down, blocked or misnamed (--advertise_push).
constexpr absl::Duration kRawConnectTimeout = absl::Seconds(5);
// How long pushes to a shard whose listener could not be connected go over gRPC.
constexpr absl::Duration kRawPushRetry = absl::Minutes(5);
constexpr int kTransferDeadlineSeconds = 600;

}  // namespace

absl::Status LoadClientFiles(const ClientFiles& files, ClientOptions* options) {
  auto read = [](const char* what, const std::string& path, std::string* out) -> absl::Status {
    if (path.empty()) return absl::OkStatus();
    std::ifstream in(path);
    if (!in) return absl::NotFoundError(absl::StrCat(what, " ", path, ": cannot open"));
    std::stringstream buffer;
    buffer << in.rdbuf();
    *out = buffer.str();
    return absl::OkStatus();
  };
  ALOE_RETURN_IF_ERROR(read("--token_file", files.token_file, &options->token));
  options->token =
      std::string(absl::StripAsciiWhitespace(options->token.substr(0, options->token.find('\n'))));
  ALOE_RETURN_IF_ERROR(read("--tls_ca_file", files.tls_ca_file, &options->tls_ca_pem));
  ALOE_RETURN_IF_ERROR(read("--tls_cert_file", files.tls_cert_file, &options->tls_cert_pem));
  return read("--tls_key_file", files.tls_key_file, &options->tls_key_pem);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

grpc::ChannelArguments WorkerChannelArguments() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(2 << 20);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kReconnectBackoffInitialMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kReconnectBackoffMaxMs);
  return args;
}

ServerClient::ServerClient(const ClientOptions& options)
    : token_(options.token),
      raw_push_(options.raw_push),
      pull_streams_(std::max<uint32_t>(1, options.pull_streams)),
      credentials_(grpc::InsecureChannelCredentials()),
      channel_args_(WorkerChannelArguments()),
      shards_(std::make_shared<const ShardSet>()) {
  if (!options.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials_ = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      channel_args_.SetSslTargetNameOverride(options.tls_server_name);
    }
    if (raw_push_) {
      absl::StatusOr<std::shared_ptr<const TlsContext>> tls = TlsContext::ForClient(
          {options.tls_ca_pem, options.tls_cert_pem, options.tls_key_pem, options.tls_server_name});
      if (tls.ok()) {
        raw_tls_ = *std::move(tls);
      } else {
        // Pushes stay on gRPC (over TLS), which reports certificates it cannot use itself.
        raw_push_ = false;
        ALOE_LOG_WARNING("worker", "raw pushes off: %s", tls.status().message());
      }
    }
  }
  channel_ = MakeChannel(options.address);
  // The parts of a pull beyond the first each get a connection of their own: the HTTP/2
  // connection window, not a stream's, binds a long link before probing has grown it.
  for (uint32_t s = 1; s < pull_streams_; ++s) {
    grpc::ChannelArguments args = channel_args_;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    pull_channels_.push_back(grpc::CreateCustomChannel(options.address, credentials_, args));
  }
  coordinator_ = v1::Coordinator::NewStub(channel_);
}

std::shared_ptr<grpc::Channel> ServerClient::MakeChannel(const std::string& address) const {
  return grpc::CreateCustomChannel(address, credentials_, channel_args_);
}

void ServerClient::RawConnection::Close() {
  tls.reset();
  if (fd >= 0) close(fd);
  fd = -1;
}

ServerClient::RawConnection::~RawConnection() {
  absl::MutexLock lock(&mu);
  Close();
}

absl::Status ServerClient::SetShards(const std::vector<std::string>& addresses,
                                     const std::vector<std::string>& push_addresses,
                                     const std::string& server_push_address) {
  for (size_t i = 0; i < addresses.size(); ++i) {
    if (addresses[i].empty()) {
      return absl::InvalidArgumentError(absl::StrFormat("shard %d has no address", i));
    }
  }
  if (!push_addresses.empty() && push_addresses.size() != addresses.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("%d raw push addresses for %d shards",
                                                      push_addresses.size(), addresses.size()));
  }
  auto push_address = [&](size_t i) { return push_addresses.empty() ? "" : push_addresses[i]; };
  {
    // A single server's raw endpoint: kept (with its connection) while the address stays.
    absl::MutexLock lock(&mu_);
    const std::string current = server_raw_ != nullptr ? server_raw_->push_address : "";
    if (server_push_address != current) {
      server_raw_ =
          server_push_address.empty()
              ? nullptr
              : std::make_shared<const Shard>(Shard{"the server", channel_, server_push_address,
                                                    std::make_shared<RawConnection>()});
    }
  }
  const std::shared_ptr<const ShardSet> current = Shards();
  bool same = addresses.size() == current->size();
  for (size_t i = 0; same && i < addresses.size(); ++i) {
    same = addresses[i] == (*current)[i].address && push_address(i) == (*current)[i].push_address;
  }
  if (same) return absl::OkStatus();  // a re-join names the same shards: keep their connections
  auto next = std::make_shared<ShardSet>();
  for (size_t i = 0; i < addresses.size(); ++i) {
    Shard shard{addresses[i], MakeChannel(addresses[i]), push_address(i), nullptr};
    if (!shard.push_address.empty()) shard.raw = std::make_shared<RawConnection>();
    next->push_back(std::move(shard));
  }
  absl::MutexLock lock(&mu_);
  shards_ = std::move(next);
  return absl::OkStatus();
}

absl::Duration ServerClient::AwaitServers(absl::Duration wait, const std::atomic<bool>* stop) {
  std::vector<std::shared_ptr<grpc::Channel>> channels = {channel_};
  for (const Shard& shard : *Shards()) channels.push_back(shard.channel);
  bool all_up = true;
  for (const auto& channel : channels) {
    all_up &= channel->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY;
  }
  if (all_up) return wait;
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMicroseconds(wait);
  for (const auto& channel : channels) {
    // In slices, so that a stopping worker does not wait out a whole backoff.
    while (!channel->WaitForConnected(
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(100)))) {
      if ((stop != nullptr && stop->load()) || std::chrono::system_clock::now() >= deadline) {
        return absl::ZeroDuration();
      }
    }
  }
  return absl::ZeroDuration();
}

std::shared_ptr<const ServerClient::ShardSet> ServerClient::Shards() const {
  absl::MutexLock lock(&mu_);
  return shards_;
}

std::shared_ptr<const ServerClient::Shard> ServerClient::ServerRaw() const {
  absl::MutexLock lock(&mu_);
  return server_raw_;
}

namespace {

// One unary Coordinator call with the control deadline and the token.
template <typename Request, typename Reply>
absl::StatusOr<Reply> Unary(const ServerClient& client, v1::Coordinator::Stub* stub,
                            grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*,
                                                                          const Request&, Reply*),
                            const Request& request) {
  grpc::ClientContext context;
  client.PrepareContext(&context, kControlDeadlineSeconds);
  Reply reply;
  absl::Status s = FromGrpcStatus((stub->*method)(&context, request, &reply));
  // This client never cancels a unary call: CANCELLED is the server ending it, as a server
  // that shuts down does with the calls in flight. The worker takes it as the server away.
  if (s.code() == absl::StatusCode::kCancelled) {
    return absl::UnavailableError(absl::StrCat("the server ended the call: ", s.message()));
  }
  if (!s.ok()) return s;
  return reply;
}

}  // namespace

void ServerClient::PrepareContext(grpc::ClientContext* context, int seconds) const {
  SetDeadline(context, seconds);
  if (!token_.empty()) context->AddMetadata("x-aloe-token", token_);
}

absl::StatusOr<v1::JoinReply> ServerClient::Join(const v1::JoinRequest& request) {
  return Unary(*this, coordinator_.get(), &v1::Coordinator::Stub::Join, request);
}

absl::StatusOr<v1::HeartbeatReply> ServerClient::Heartbeat(const v1::HeartbeatRequest& request) {
  return Unary(*this, coordinator_.get(), &v1::Coordinator::Stub::Heartbeat, request);
}

absl::StatusOr<v1::Task> ServerClient::RequestTask(uint64_t worker_id, bool ahead,
                                                   uint64_t dropped_task_id) {
  v1::TaskRequest request;
  request.set_worker_id(worker_id);
  request.set_ahead(ahead);
  request.set_dropped_task_id(dropped_task_id);
  return Unary(*this, coordinator_.get(), &v1::Coordinator::Stub::RequestTask, request);
}

absl::Status ServerClient::ReportEval(const v1::EvalReport& report) {
  return Unary(*this, coordinator_.get(), &v1::Coordinator::Stub::ReportEval, report).status();
}

absl::Status ServerClient::Leave(uint64_t worker_id) {
  v1::LeaveRequest request;
  request.set_worker_id(worker_id);
  return Unary(*this, coordinator_.get(), &v1::Coordinator::Stub::Leave, request).status();
}

namespace {

// "shard i (address): ", the prefix of a sharded stream's errors; "" for the single server, whose
// messages stay as they were.
std::string StreamLabel(int shard, const std::string& address) {
  return shard < 0 ? "" : absl::StrFormat("shard %d (%s): ", shard, address);
}

// `status` with `label` in front of its message, code kept (the caller acts on the code).
absl::Status Labelled(const absl::Status& status, const std::string& label) {
  if (status.ok() || label.empty()) return status;
  return absl::Status(status.code(), absl::StrCat(label, status.message()));
}

// Runs fn(0), ..., fn(n - 1) at once (fn(0) on the calling thread) and returns when all have.
// One thread per shard: a handful of shards, and each call streams megabytes.
void RunInParallel(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) threads.emplace_back(fn, i);
  if (n > 0) fn(0);
  for (std::thread& t : threads) t.join();
}

// kInvalidArgument unless every spec layer names one of the `shards` shards (a spec and a
// shard list from different joins).
absl::Status CheckLayerOwners(const v1::ModelSpec& spec, size_t shards) {
  for (int l = 0; l < spec.layers_size(); ++l) {
    if (spec.layers(l).shard() >= shards) {
      return absl::InvalidArgumentError(
          absl::StrFormat("layer %d belongs to shard %d but the server has %d shards", l,
                          spec.layers(l).shard(), shards));
    }
  }
  return absl::OkStatus();
}

// The part of every layer a pull stream fills: elements [first, first + length) of layer l, the
// whole layer or one slice of it (PullRequest.slices), written from element `out` of the
// caller's buffer for layer l (0 unless the stream fills part of the caller's window).
struct PullWindows {
  std::vector<uint64_t> first, length, out;
};

// The version one Pull stream delivered.
struct PulledStream {
  bool have_version = false;  // false: the stream carried no chunk
  uint64_t version = 0;
  uint64_t group_version = 0;  // a pull by layer group: the group's version
};

// Streams one Pull from `stub` into layers, validating every chunk (one version, the layer's
// size, offsets contiguous from the window start, no overflow, finite values) and the stream's
// status. owner >= 0: the stream is shard `owner`'s and may carry only its own layers, so the
// streams of a sharded pull write disjoint layers and `filled` entries (elements received per
// layer, from the window start). *bytes grows by the payload bytes received. kDataLoss on a bad
// chunk; errors are prefixed by `label`.
absl::StatusOr<PulledStream> ReadPullStream(const ServerClient& client,
                                            const std::shared_ptr<grpc::Channel>& channel,
                                            const v1::PullRequest& request,
                                            const v1::ModelSpec& spec, const PullWindows& windows,
                                            int owner, const std::string& label,
                                            std::vector<std::vector<float>>* layers,
                                            std::vector<uint64_t>* filled, uint64_t* bytes) {
  grpc::ClientContext context;
  client.PrepareContext(&context, kTransferDeadlineSeconds);
  // Raw messages parsed in place (common/push_wire.h): the payload is decoded straight from the
  // received slices into the layer.
  const grpc::internal::RpcMethod method(kPullMethod, grpc::internal::RpcMethod::SERVER_STREAMING,
                                         channel);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), method, &context,
                                                                    request));
  PulledStream got;
  grpc::ByteBuffer message;
  std::vector<grpc::Slice> slices;
  std::vector<std::string_view> pieces;
  ParamChunkView chunk;
  absl::Status bad;
  while (bad.ok() && reader->Read(&message)) {
    slices.clear();
    pieces.clear();
    if (grpc::Status dumped = message.Dump(&slices); !dumped.ok()) {
      bad = absl::DataLossError(absl::StrCat(label, "pull stream: ", dumped.error_message()));
      break;
    }
    for (const grpc::Slice& slice : slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    if (absl::Status parsed = ParseParamChunk(pieces, &chunk); !parsed.ok()) {
      bad = absl::DataLossError(absl::StrCat(label, "pull stream: ", parsed.message()));
      break;
    }
    if (!got.have_version) {
      got.version = chunk.version;
      got.group_version = chunk.group_version;
      got.have_version = true;
    }
    const uint32_t id = chunk.layer_id;
    if (chunk.version != got.version || chunk.group_version != got.group_version) {
      bad = absl::DataLossError(absl::StrCat(label, "pull stream mixes model versions"));
    } else if (owner >= 0 && id < static_cast<uint32_t>(spec.layers_size()) &&
               spec.layers(id).shard() != static_cast<uint32_t>(owner)) {
      // Checked before anything is written: the owner's stream may be filling this layer.
      bad = absl::DataLossError(absl::StrFormat("%spull stream: layer %d belongs to shard %d",
                                                label, id, spec.layers(id).shard()));
    } else if (id >= static_cast<uint32_t>(spec.layers_size()) ||
               chunk.layer_elements != spec.layers(id).num_elements() ||
               chunk.offset != windows.first[id] + (*filled)[id] ||
               chunk.data_size % sizeof(float) != 0 ||
               (*filled)[id] + chunk.data_size / sizeof(float) > windows.length[id]) {
      bad =
          absl::DataLossError(absl::StrFormat("%spull stream: bad chunk for layer %d", label, id));
    } else {
      const size_t count = chunk.data_size / sizeof(float);
      float* out = (*layers)[id].data() + windows.out[id] + (*filled)[id];
      // Finite values only (NaN and +-Inf fail the magnitude check at any limit).
      const bool finite = ForEachFloatRun(chunk.data, out, [](const char* in, float* to, size_t n) {
        return kernels::CopyWithinMagnitude(in, to, n, std::numeric_limits<float>::max());
      });
      if (!finite) {
        // The slow path names the bad value.
        std::string joined;
        for (std::string_view p : chunk.data) joined.append(p);
        absl::Status s = DecodeFloats(joined, absl::MakeSpan(out, count));
        bad = absl::DataLossError(absl::StrCat(
            label, "pull stream: ", s.ok() ? "undecodable float32 payload" : s.message()));
      }
      (*filled)[id] += count;
      *bytes += chunk.data_size;
    }
  }
  if (!bad.ok()) {
    context.TryCancel();
    reader->Finish();
    return bad;
  }
  ALOE_RETURN_IF_ERROR(Labelled(FromGrpcStatus(reader->Finish()), label));
  return got;
}

// One message of a push: a chunk's fields and its payload, either encoded bytes or, for float32,
// the caller's floats themselves (sent from where they are, see SendPush).
struct OutgoingChunk {
  uint32_t layer_id = 0;
  uint64_t offset = 0;
  v1::Codec codec = v1::CODEC_UNSPECIFIED;
  std::string encoded;
  absl::Span<const float> floats;  // float32: the payload, not copied
};

// Payload slices that point into a caller's memory, counted so that the caller can wait until
// gRPC holds none of them any more (it may keep a slice past the end of the call, until its
// transport drops the stream).
class SliceLoans {
 public:
  grpc::Slice Lend(const void* data, size_t size) {
    absl::MutexLock lock(&mu_);
    ++lent_;
    return grpc::Slice(const_cast<void*>(data), size, &SliceLoans::Return, this);
  }
  // Blocks until every lent slice is back.
  void AwaitReturned() {
    absl::MutexLock lock(&mu_);
    while (
        !mu_.AwaitWithTimeout(absl::Condition(this, &SliceLoans::AllReturned), absl::Seconds(10))) {
      ALOE_LOG_WARNING("worker",
                       "push: gRPC still holds %d payload slices 10 s after the call "
                       "ended; waiting",
                       lent_);
    }
  }

 private:
  static void Return(void* self) {
    auto* loans = static_cast<SliceLoans*>(self);
    absl::MutexLock lock(&loans->mu_);
    --loans->lent_;
  }
  bool AllReturned() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return lent_ == 0; }

  absl::Mutex mu_;
  int lent_ ABSL_GUARDED_BY(mu_) = 0;
};

// Appends the chunks of low-rank layer `layer` (whole, or the slice of a rank of a multi-rank
// node: the encoder is configured with it) of a push under `header` to *chunks, and its
// error-feedback residual to (*residuals)[layer]. The effective ranks the encoder observed go to
// *observed (PushHeader.observed_ranks).
absl::Status EncodeLowRankLayer(LowRankPushEncoder* encoder, const v1::PushHeader& header,
                                size_t layer, const std::vector<float>& values,
                                std::vector<std::vector<float>>* residuals,
                                std::vector<OutgoingChunk>* chunks,
                                std::vector<v1::TensorRank>* observed) {
  if (encoder == nullptr) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "layer %d is low-rank, which only pushes with a low-rank encoder carry", layer));
  }
  std::vector<EncodedChunk> encoded;
  ALOE_RETURN_IF_ERROR(
      encoder->EncodeLayer(static_cast<uint32_t>(layer), header.task_id(), values,
                           residuals != nullptr ? (*residuals)[layer].data() : nullptr, &encoded,
                           kMaxChunkBytes, observed));
  for (EncodedChunk& e : encoded) {
    OutgoingChunk& chunk = chunks->emplace_back();
    chunk.layer_id = static_cast<uint32_t>(layer);
    chunk.offset = e.offset;
    chunk.codec = e.codec;
    chunk.encoded = std::move(e.payload);
  }
  return absl::OkStatus();
}

// Streams `chunks` to `channel` as one Push, the header in the first message; *bytes grows by
// the payload bytes written. Each message is framed by hand (common/push_wire.h): a few bytes of
// fields, then the payload straight from where it is (float32: the caller's buffers), with no
// copy into protobuf strings and none to serialise them.
absl::StatusOr<v1::PushReply> SendPush(const ServerClient& client,
                                       const std::shared_ptr<grpc::Channel>& channel,
                                       const v1::PushHeader& header,
                                       const std::vector<OutgoingChunk>& chunks, uint64_t* bytes) {
  SliceLoans loans;  // outlives the call and whatever its transport still holds
  absl::StatusOr<v1::PushReply> result;
  {
    grpc::ClientContext context;
    client.PrepareContext(&context, kTransferDeadlineSeconds);
    v1::PushReply reply;
    const grpc::internal::RpcMethod method(kPushMethod, grpc::internal::RpcMethod::CLIENT_STREAMING,
                                           channel);
    std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
        grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method,
                                                                      &context, &reply));
    for (size_t i = 0; i < chunks.size(); ++i) {
      const OutgoingChunk& c = chunks[i];
      const bool fp32 = !c.floats.empty();
      const size_t size = fp32 ? c.floats.size() * sizeof(float) : c.encoded.size();
      grpc::Slice parts[2] = {grpc::Slice(PushChunkPrefix(i == 0 ? &header : nullptr, c.layer_id,
                                                          c.offset, c.codec, size)),
                              size == 0
                                  ? grpc::Slice()
                                  : loans.Lend(fp32 ? static_cast<const void*>(c.floats.data())
                                                    : static_cast<const void*>(c.encoded.data()),
                                               size)};
      grpc::ByteBuffer message(parts, size > 0 ? 2 : 1);
      *bytes += size;
      if (!writer->Write(message)) break;  // the server ended the stream early; Finish() says why
    }
    writer->WritesDone();
    const absl::Status s = FromGrpcStatus(writer->Finish());
    result = s.ok() ? absl::StatusOr<v1::PushReply>(reply) : s;
  }
  loans.AwaitReturned();
  return result;
}

// The answer to a push from the answers of its shards: the first error in shard order; else the
// update's own reply (staged = false: this shard's report completed it at the coordinator); else
// still staged, as far as the least advanced shard got.
absl::StatusOr<v1::PushReply> CombineShardReplies(
    const std::vector<absl::StatusOr<v1::PushReply>>& replies) {
  for (const absl::StatusOr<v1::PushReply>& reply : replies) {
    if (!reply.ok()) return reply.status();
  }
  v1::PushReply staged;
  staged.set_staged(true);
  for (size_t i = 0; i < replies.size(); ++i) {
    const v1::PushReply& reply = *replies[i];
    if (!reply.staged()) return reply;
    staged.set_version(std::max(staged.version(), reply.version()));
    staged.set_slices_received(i == 0
                                   ? reply.slices_received()
                                   : std::min(staged.slices_received(), reply.slices_received()));
  }
  return staged;
}

}  // namespace

std::vector<uint32_t> ShardsOfGroup(const v1::ModelSpec& spec,
                                    absl::Span<const uint32_t> layer_groups, uint32_t group) {
  std::vector<uint32_t> shards;
  for (int l = 0; l < spec.layers_size() && static_cast<size_t>(l) < layer_groups.size(); ++l) {
    if (layer_groups[l] == group) shards.push_back(spec.layers(l).shard());
  }
  std::sort(shards.begin(), shards.end());
  shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
  return shards;
}

absl::StatusOr<uint64_t> PullAgreedGroupVersion(absl::Span<const uint32_t> shards, uint32_t group,
                                                uint64_t min_version, const GroupShardPull& pull) {
  std::vector<absl::StatusOr<std::optional<uint64_t>>> got(shards.size());
  std::vector<size_t> ask(shards.size());
  for (size_t i = 0; i < ask.size(); ++i) ask[i] = i;
  uint64_t version = min_version;
  for (int round = 1;; ++round) {
    RunInParallel(ask.size(), [&](size_t k) { got[ask[k]] = pull(shards[ask[k]], version); });
    for (const absl::StatusOr<std::optional<uint64_t>>& sent : got) {
      if (!sent.ok()) return sent.status();  // the first failure in shard order
    }
    uint64_t newest = 0;
    for (const absl::StatusOr<std::optional<uint64_t>>& sent : got) {
      if (sent->has_value()) newest = std::max(newest, **sent);
    }
    ask.clear();
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i]->has_value() && **got[i] < newest) ask.push_back(i);
    }
    if (ask.empty()) return newest;
    if (round == kGroupPullRounds) {
      std::string versions;
      for (size_t i = 0; i < got.size(); ++i) {
        if (!got[i]->has_value()) continue;
        absl::StrAppendFormat(&versions, "%sshard %d at %d", versions.empty() ? "" : ", ",
                              shards[i], **got[i]);
      }
      return absl::DataLossError(
          absl::StrFormat("layer group %d: the shards still sent different group versions after "
                          "%d pulls: %s",
                          group, kGroupPullRounds, versions));
    }
    // Each shard process applies a commit of the group on its own: those behind wait for the
    // newest version one of them already sent.
    version = newest;
  }
}

absl::StatusOr<uint64_t> ServerClient::Pull(uint64_t worker_id, uint64_t version, bool latest,
                                            const v1::ModelSpec& spec,
                                            std::vector<std::vector<float>>* layers,
                                            uint64_t* bytes, uint32_t slice, uint32_t slices) {
  const std::shared_ptr<const ShardSet> shards = Shards();
  if (!shards->empty()) ALOE_RETURN_IF_ERROR(CheckLayerOwners(spec, shards->size()));
  v1::PullRequest request;
  request.set_worker_id(worker_id);
  request.set_version(version);
  request.set_latest(latest);
  slices = std::max<uint32_t>(1, slices);
  if (slices > 1) {
    request.set_slice(slice);
    request.set_slices(slices);
  }
  layers->resize(spec.layers_size());
  std::vector<uint64_t> filled(spec.layers_size(), 0);
  PullWindows windows;
  windows.first.resize(spec.layers_size());
  windows.length.resize(spec.layers_size());
  for (int i = 0; i < spec.layers_size(); ++i) {
    const auto [begin, end] = SliceRange(spec.layers(i).num_elements(), slices, slice);
    windows.first[i] = begin;
    windows.length[i] = end - begin;
    (*layers)[i].resize(windows.length[i]);
  }
  windows.out.assign(spec.layers_size(), 0);
  if (shards->empty() && slices == 1 && pull_streams_ > 1) {
    return PullInParts(request, spec, layers, bytes);
  }
  // One stream from the single server, or one per shard at once.
  const size_t streams = shards->empty() ? 1 : shards->size();
  std::vector<absl::StatusOr<PulledStream>> got(streams);
  std::vector<uint64_t> received(streams, 0);
  RunInParallel(streams, [&](size_t i) {
    if (shards->empty()) {
      got[i] = ReadPullStream(*this, channel_, request, spec, windows, /*owner=*/-1, "", layers,
                              &filled, &received[i]);
    } else {
      const Shard& shard = (*shards)[i];
      got[i] = ReadPullStream(*this, shard.channel, request, spec, windows, static_cast<int>(i),
                              StreamLabel(static_cast<int>(i), shard.address), layers, &filled,
                              &received[i]);
    }
  });
  for (uint64_t n : received) *bytes += n;
  const PulledStream* first = nullptr;
  for (const absl::StatusOr<PulledStream>& stream : got) {
    if (!stream.ok()) return stream.status();  // the first failure in shard order
  }
  if (latest && streams > 1) {
    // Shards apply a commit each on their own, so "latest" may have caught some before the
    // newest commit: pull those again at the newest version any shard sent (they wait for it).
    uint64_t newest = 0;
    for (const absl::StatusOr<PulledStream>& stream : got) {
      if (stream->have_version) newest = std::max(newest, stream->version);
    }
    v1::PullRequest again = request;
    again.set_latest(false);
    again.set_version(newest);
    std::vector<size_t> behind;
    for (size_t i = 0; i < streams; ++i) {
      if (got[i]->have_version && got[i]->version != newest) behind.push_back(i);
    }
    for (int l = 0; l < spec.layers_size(); ++l) {
      for (size_t i : behind) {
        if (spec.layers(l).shard() == i) filled[l] = 0;
      }
    }
    std::fill(received.begin(), received.end(), 0);
    RunInParallel(behind.size(), [&](size_t k) {
      const size_t i = behind[k];
      const Shard& shard = (*shards)[i];
      got[i] = ReadPullStream(*this, shard.channel, again, spec, windows, static_cast<int>(i),
                              StreamLabel(static_cast<int>(i), shard.address), layers, &filled,
                              &received[i]);
    });
    for (uint64_t n : received) *bytes += n;
    for (const absl::StatusOr<PulledStream>& stream : got) {
      if (!stream.ok()) return stream.status();
    }
  }
  for (const absl::StatusOr<PulledStream>& stream : got) {
    if (!stream->have_version) continue;  // a shard whose layers are all empty
    if (first == nullptr) {
      first = &*stream;
    } else if (stream->version != first->version) {
      return absl::DataLossError(
          absl::StrFormat("shards sent versions %d and %d", first->version, stream->version));
    }
  }
  for (int i = 0; i < spec.layers_size(); ++i) {
    if (filled[i] != windows.length[i]) {
      return absl::DataLossError(absl::StrFormat("pull stream: layer %d incomplete", i));
    }
  }
  return first != nullptr ? first->version : 0;
}

absl::StatusOr<uint64_t> ServerClient::PullInParts(const v1::PullRequest& request,
                                                   const v1::ModelSpec& spec,
                                                   std::vector<std::vector<float>>* layers,
                                                   uint64_t* bytes) {
  // Stream s carries slice s of every layer into its place in the caller's whole layer.
  const uint32_t parts = pull_streams_;
  std::vector<v1::PullRequest> requests(parts, request);
  std::vector<PullWindows> windows(parts);
  for (uint32_t s = 0; s < parts; ++s) {
    requests[s].set_slice(s);
    requests[s].set_slices(parts);
    for (const v1::LayerSpec& layer : spec.layers()) {
      const auto [begin, end] = SliceRange(layer.num_elements(), parts, s);
      windows[s].first.push_back(begin);
      windows[s].length.push_back(end - begin);
      windows[s].out.push_back(begin);
    }
  }
  std::vector<std::vector<uint64_t>> filled(parts);
  std::vector<absl::StatusOr<PulledStream>> got(parts);
  std::vector<uint64_t> received(parts, 0);
  auto read = [&](size_t s) {
    filled[s].assign(spec.layers_size(), 0);
    got[s] = ReadPullStream(*this, s == 0 ? channel_ : pull_channels_[s - 1], requests[s], spec,
                            windows[s], /*owner=*/-1, "", layers, &filled[s], &received[s]);
  };
  RunInParallel(parts, read);
  for (const absl::StatusOr<PulledStream>& stream : got) {
    if (!stream.ok()) return stream.status();
  }
  if (request.latest()) {
    // A commit between the streams' starts: pull the parts behind again at the newest version.
    uint64_t newest = 0;
    for (const absl::StatusOr<PulledStream>& stream : got) {
      if (stream->have_version) newest = std::max(newest, stream->version);
    }
    std::vector<size_t> behind;
    for (size_t s = 0; s < parts; ++s) {
      if (got[s]->have_version && got[s]->version != newest) {
        requests[s].set_latest(false);
        requests[s].set_version(newest);
        behind.push_back(s);
      }
    }
    RunInParallel(behind.size(), [&](size_t k) { read(behind[k]); });
    for (const absl::StatusOr<PulledStream>& stream : got) {
      if (!stream.ok()) return stream.status();
    }
  }
  for (uint64_t n : received) *bytes += n;
  const PulledStream* first = nullptr;
  for (size_t s = 0; s < parts; ++s) {
    for (int i = 0; i < spec.layers_size(); ++i) {
      if (filled[s][i] != windows[s].length[i]) {
        return absl::DataLossError(absl::StrFormat("pull stream: layer %d incomplete", i));
      }
    }
    if (!got[s]->have_version) continue;  // every slice of this part is empty
    if (first == nullptr) {
      first = &*got[s];
    } else if (got[s]->version != first->version) {
      return absl::DataLossError(
          absl::StrFormat("pull streams sent versions %d and %d", first->version, got[s]->version));
    }
  }
  return first != nullptr ? first->version : 0;
}

absl::StatusOr<v1::Task> ServerClient::StartGroup(uint64_t worker_id, uint32_t group) {
  v1::TaskRequest request;
  request.set_worker_id(worker_id);
  request.set_start_group(true);
  request.set_group(group);
  return Unary(*this, coordinator_.get(), &v1::Coordinator::Stub::RequestTask, request);
}

absl::StatusOr<uint64_t> ServerClient::PullGroup(uint64_t worker_id, uint32_t group,
                                                 uint64_t min_group_version,
                                                 const v1::ModelSpec& spec,
                                                 absl::Span<const uint32_t> layer_groups,
                                                 std::vector<std::vector<float>>* layers,
                                                 uint64_t* bytes) {
  if (layer_groups.size() != static_cast<size_t>(spec.layers_size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d layer groups given for a model of %d layers", layer_groups.size(), spec.layers_size()));
  }
  const std::shared_ptr<const ShardSet> shards = Shards();
  if (!shards->empty()) ALOE_RETURN_IF_ERROR(CheckLayerOwners(spec, shards->size()));
  v1::PullRequest request;
  request.set_worker_id(worker_id);
  request.set_by_group(true);
  request.set_group(group);
  request.set_version(min_group_version);
  // The group's layers only: a chunk of any other layer overflows its empty window.
  layers->resize(spec.layers_size());
  PullWindows windows;
  windows.first.assign(spec.layers_size(), 0);
  windows.out.assign(spec.layers_size(), 0);
  for (int i = 0; i < spec.layers_size(); ++i) {
    const bool in_group = layer_groups[i] == group;
    windows.length.push_back(in_group ? spec.layers(i).num_elements() : 0);
    if (in_group) (*layers)[i].resize(spec.layers(i).num_elements());
  }
  std::vector<uint64_t> filled(spec.layers_size(), 0);
  uint64_t version = 0;
  if (shards->empty()) {
    absl::StatusOr<PulledStream> got = ReadPullStream(*this, channel_, request, spec, windows,
                                                      /*owner=*/-1, "", layers, &filled, bytes);
    if (!got.ok()) return got.status();
    version = got->group_version;
  } else {
    // Per shard: the payload bytes it sent over all its pulls (a pull again counts as well).
    std::vector<uint64_t> received(shards->size(), 0);
    const GroupShardPull pull = [&](uint32_t s,
                                    uint64_t at) -> absl::StatusOr<std::optional<uint64_t>> {
      // A pull again replaces what this shard sent before; the other shards' layers stay.
      for (int l = 0; l < spec.layers_size(); ++l) {
        if (spec.layers(l).shard() == s) filled[l] = 0;
      }
      v1::PullRequest shard_request = request;
      shard_request.set_version(at);
      const Shard& shard = (*shards)[s];
      absl::StatusOr<PulledStream> got = ReadPullStream(
          *this, shard.channel, shard_request, spec, windows, static_cast<int>(s),
          StreamLabel(static_cast<int>(s), shard.address), layers, &filled, &received[s]);
      if (!got.ok()) return got.status();
      if (!got->have_version) return std::nullopt;
      return got->group_version;
    };
    absl::StatusOr<uint64_t> agreed = PullAgreedGroupVersion(
        ShardsOfGroup(spec, layer_groups, group), group, min_group_version, pull);
    for (uint64_t n : received) *bytes += n;
    if (!agreed.ok()) return agreed.status();
    version = *agreed;
  }
  for (int i = 0; i < spec.layers_size(); ++i) {
    if (filled[i] != windows.length[i]) {
      return absl::DataLossError(
          absl::StrFormat("pull of layer group %d: layer %d incomplete", group, i));
    }
  }
  return version;
}

absl::StatusOr<v1::PushReply> ServerClient::Push(
    const v1::PushHeader& header, const v1::ModelSpec& spec,
    const std::vector<std::vector<float>>& layers, const std::vector<v1::Codec>& codecs,
    const BlockSizes& block_sizes, std::vector<std::vector<float>>* residuals, uint64_t* bytes) {
  return PushLayers(header, spec, {}, layers, codecs, block_sizes, residuals, bytes);
}

absl::StatusOr<v1::PushReply> ServerClient::PushGroup(
    const v1::PushHeader& header, const v1::ModelSpec& spec,
    absl::Span<const uint32_t> layer_groups, const std::vector<std::vector<float>>& layers,
    const std::vector<v1::Codec>& codecs, const BlockSizes& block_sizes,
    std::vector<std::vector<float>>* residuals, uint64_t* bytes) {
  if (layer_groups.size() != static_cast<size_t>(spec.layers_size()) ||
      layers.size() != layer_groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d layers and %d layer groups to push, the model has %d layers",
                        layers.size(), layer_groups.size(), spec.layers_size()));
  }
  return PushLayers(header, spec, layer_groups, layers, codecs, block_sizes, residuals, bytes);
}

absl::StatusOr<v1::PushReply> ServerClient::PushLayers(
    const v1::PushHeader& header, const v1::ModelSpec& spec,
    absl::Span<const uint32_t> layer_groups, const std::vector<std::vector<float>>& layers,
    const std::vector<v1::Codec>& codecs, const BlockSizes& block_sizes,
    std::vector<std::vector<float>>* residuals, uint64_t* bytes) {
  // With layer groups only the header's group is sent; the other layers are not touched.
  auto carried = [&](size_t layer) {
    return layer_groups.empty() || layer_groups[layer] == header.group();
  };
  const std::shared_ptr<const ShardSet> shards = Shards();
  // The shards the push goes to: every one, or with layer groups those that own a layer of the
  // group (the others take no part in the group's update).
  std::vector<uint32_t> targets;
  if (!shards->empty()) {
    // Every buffer needs an owner before anything is sent.
    if (layers.size() != static_cast<size_t>(spec.layers_size())) {
      return absl::InvalidArgumentError(absl::StrFormat("%d layers to push, the model has %d",
                                                        layers.size(), spec.layers_size()));
    }
    ALOE_RETURN_IF_ERROR(CheckLayerOwners(spec, shards->size()));
    if (layer_groups.empty()) {
      for (uint32_t s = 0; s < shards->size(); ++s) targets.push_back(s);
    } else {
      targets = ShardsOfGroup(spec, layer_groups, header.group());
      if (targets.empty()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer group %d has no layers", header.group()));
      }
    }
  }
  if (residuals != nullptr) {
    residuals->resize(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) {
      if (carried(l)) (*residuals)[l].resize(layers[l].size());
    }
  }
  // Encode everything first: a value that cannot be encoded must not leave half an update on
  // the wire. One stream of chunks for the single server, or one per shard with its layers.
  std::vector<std::vector<OutgoingChunk>> streams(shards->empty() ? 1 : shards->size());
  std::vector<v1::TensorRank> observed;
  for (size_t layer = 0; layer < layers.size(); ++layer) {
    if (!carried(layer)) continue;
    const v1::Codec codec = layer < codecs.size() ? codecs[layer] : v1::CODEC_FP32;
    const size_t max_elements = MaxChunkElements(codec, block_sizes.Of(codec));
    // Where this buffer starts in the layer: a slice's first element, or 0.
    uint64_t first = 0;
    if (header.slices() > 1 && layer < static_cast<size_t>(spec.layers_size())) {
      first = SliceRange(spec.layers(layer).num_elements(), header.slices(), header.slice()).first;
    }
    std::vector<OutgoingChunk>& chunks =
        streams[shards->empty() ? 0 : spec.layers(static_cast<int>(layer)).shard()];
    if (codec == v1::CODEC_LOWRANK) {
      std::shared_ptr<LowRankPushEncoder> encoder;
      {
        absl::MutexLock lock(&low_rank_mu_);
        encoder = low_rank_;
      }
      ALOE_RETURN_IF_ERROR(EncodeLowRankLayer(encoder.get(), header, layer, layers[layer],
                                              residuals, &chunks, &observed));
      continue;
    }
    for (auto [begin, end] : ChunkRanges(layers[layer].size(), max_elements)) {
      OutgoingChunk& chunk = chunks.emplace_back();
      chunk.layer_id = static_cast<uint32_t>(layer);
      chunk.offset = first + begin;
      chunk.codec = codec;
      const absl::Span<const float> values =
          absl::MakeConstSpan(layers[layer].data() + begin, end - begin);
      float* residual = residuals ? (*residuals)[layer].data() + begin : nullptr;
      absl::Status s;
      if (codec == v1::CODEC_FP32 || codec == v1::CODEC_UNSPECIFIED) {
        // Sent as it is. The server screens every value in the pass that streams it into staging
        // and refuses a NaN or Inf (or a value beyond its magnitude limit) naming the layer and
        // element, with nothing applied; a second full pass here cost the pushing core as much
        // as 8% of a shard's ingest on loopback.
        chunk.floats = values;
        if (residual != nullptr) std::fill(residual, residual + values.size(), 0.0f);
      } else {
        s = EncodeChunk(codec, values, block_sizes.Of(codec), &chunk.encoded, residual);
      }
      if (!s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer %d at offset %d: %s", layer, begin, s.message()));
      }
    }
  }
  // The header as sent: with the effective ranks the encoding observed (adaptive rank).
  v1::PushHeader sent_header = header;
  for (v1::TensorRank& r : observed) *sent_header.add_observed_ranks() = std::move(r);
  // Every stream sent carries the header, even one without chunks.
  for (std::vector<OutgoingChunk>& chunks : streams) {
    if (chunks.empty()) chunks.emplace_back();
  }
  if (shards->empty()) {
    // A single server that takes raw pushes gets every layer that way when all are float32.
    const std::shared_ptr<const Shard> server = raw_push_ ? ServerRaw() : nullptr;
    bool raw = server != nullptr && layers.size() == static_cast<size_t>(spec.layers_size());
    for (size_t l = 0; raw && l < layers.size(); ++l) {
      const v1::Codec codec = l < codecs.size() ? codecs[l] : v1::CODEC_FP32;
      raw = !carried(l) || codec == v1::CODEC_FP32 || codec == v1::CODEC_UNSPECIFIED;
    }
    if (raw) {
      bool unreachable = false;
      absl::StatusOr<v1::PushReply> reply = SendRawPush(*server, std::nullopt, sent_header, spec,
                                                        layers, bytes, &unreachable, layer_groups);
      if (!unreachable) return reply;
    }
    return SendPush(*this, channel_, sent_header, streams[0], bytes);
  }

  // replies[k] and sent[k] are shard targets[k]'s.
  std::vector<absl::StatusOr<v1::PushReply>> replies(targets.size());
  std::vector<uint64_t> sent(targets.size(), 0);
  RunInParallel(targets.size(), [&](size_t k) {
    const uint32_t i = targets[k];
    const Shard& shard = (*shards)[i];
    // Raw when the shard offers it and every layer it gets is float32.
    bool raw = raw_push_ && shard.raw != nullptr;
    for (size_t l = 0; raw && l < layers.size(); ++l) {
      const v1::Codec codec = l < codecs.size() ? codecs[l] : v1::CODEC_FP32;
      raw = spec.layers(static_cast<int>(l)).shard() != i || !carried(l) ||
            codec == v1::CODEC_FP32 || codec == v1::CODEC_UNSPECIFIED;
    }
    bool unreachable = false;
    if (raw) {
      replies[k] =
          SendRawPush(shard, i, sent_header, spec, layers, &sent[k], &unreachable, layer_groups);
    }
    if (!raw || unreachable) {
      replies[k] = SendPush(*this, shard.channel, sent_header, streams[i], &sent[k]);
    }
    if (!replies[k].ok()) {
      replies[k] = Labelled(replies[k].status(), StreamLabel(static_cast<int>(i), shard.address));
    }
  });
  for (uint64_t n : sent) *bytes += n;
  return CombineShardReplies(replies);
}

absl::StatusOr<v1::PushReply> ServerClient::SendRawPush(
    const Shard& shard, std::optional<uint32_t> index, const v1::PushHeader& header,
    const v1::ModelSpec& spec, const std::vector<std::vector<float>>& layers, uint64_t* bytes,
    bool* unreachable, absl::Span<const uint32_t> layer_groups) const {
  *unreachable = false;
  const std::vector<RawPushRange> ranges = RawPushRanges(spec, index, header, layer_groups);
  for (const RawPushRange& range : ranges) {
    if (layers[range.layer_id].size() != range.count) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d: %d values to push, its %s has %d", range.layer_id,
          layers[range.layer_id].size(), header.slices() > 1 ? "slice" : "layer", range.count));
    }
  }
  const uint64_t payload = RawPushPayloadBytes(ranges);
  const std::string prelude = EncodeRawPushPrelude(token_, header, payload);
  // The shard may hold a push unread while it waits for admission (up to 2 minutes).
  const absl::Duration timeout = absl::Seconds(kTransferDeadlineSeconds);
  RawConnection& connection = *shard.raw;
  absl::MutexLock lock(&connection.mu);
  for (int attempt = 0;; ++attempt) {
    const bool reused = connection.fd >= 0;
    if (!reused) {
      if (absl::Now() < connection.grpc_until) {
        *unreachable = true;
        return absl::UnavailableError("raw push listener unreachable");
      }
      absl::StatusOr<int> fd = ConnectTcp(shard.push_address, kRawConnectTimeout);
      if (!fd.ok()) {
        // Nothing was sent: the push can go over gRPC. The listener may come back (a restart),
        // so raw pushes are tried again after a while.
        connection.grpc_until = absl::Now() + kRawPushRetry;
        *unreachable = true;
        ALOE_LOG_WARNING("worker",
                         "raw pushes to %s at %s: %s; pushing to it over gRPC for the next %d s",
                         index ? absl::StrCat("shard ", *index) : "the server", shard.push_address,
                         fd.status().message(), absl::ToInt64Seconds(kRawPushRetry));
        return fd.status();
      }
      connection.fd = *fd;
      if (raw_tls_ != nullptr) {
        absl::StatusOr<std::pair<std::string, std::string>> host =
            SplitHostPort(shard.push_address);
        absl::StatusOr<std::unique_ptr<TlsStream>> tls =
            host.ok() ? raw_tls_->Connect(*fd, host->first, kRawConnectTimeout) : host.status();
        if (!tls.ok()) {
          connection.Close();
          return absl::Status(tls.status().code(), absl::StrCat("raw push to ", shard.push_address,
                                                                ": ", tls.status().message()));
        }
        connection.tls = *std::move(tls);
        connection.tls->set_timeout(timeout);
      }
    }
    SocketStream plain(connection.fd, timeout);
    ByteStream& stream =
        connection.tls != nullptr ? static_cast<ByteStream&>(*connection.tls) : plain;
    absl::Status sent = stream.WriteAll(prelude.data(), prelude.size());
    for (size_t r = 0; sent.ok() && r < ranges.size(); ++r) {
      const std::vector<float>& values = layers[ranges[r].layer_id];
      sent = stream.WriteAll(reinterpret_cast<const char*>(values.data()),
                             values.size() * sizeof(float));
    }
    absl::Status outcome;
    v1::PushReply reply;
    // A server that refuses this client's certificate after the handshake (TLS 1.3) says so here.
    const absl::Status received = sent.ok() ? ReadRawPushReply(stream, &outcome, &reply) : sent;
    if (received.ok() && outcome.ok()) {
      *bytes += payload;
      return reply;
    }
    // A refused push ends its connection on the server too; a broken one is useless.
    connection.Close();
    if (!received.ok()) {
      // A kept-open connection the shard has closed meanwhile (idle, or restarted): once more
      // on a new one. Pushes are idempotent by update id.
      if (reused && attempt == 0 && received.code() == absl::StatusCode::kUnavailable) continue;
      return absl::Status(received.code(), absl::StrCat("raw push to ", shard.push_address, ": ",
                                                        received.message()));
    }
    return outcome;
  }
}

}  // namespace aloe::worker
