#include "worker/client.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/model_spec.h"
#include "common/tensor_codec.h"

namespace aloe::worker {
namespace {

void SetDeadline(grpc::ClientContext* context, int seconds) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

constexpr int kControlDeadlineSeconds = 30;
constexpr int kTransferDeadlineSeconds = 600;

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

ServerClient::ServerClient(const ClientOptions& options) : token_(options.token) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(2 << 20);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_cert_pem;
    ssl.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  channel_ = grpc::CreateCustomChannel(options.address, credentials, args);
  coordinator_ = v1::Coordinator::NewStub(channel_);
  parameters_ = v1::ParameterService::NewStub(channel_);
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

absl::StatusOr<v1::Task> ServerClient::RequestTask(uint64_t worker_id, bool ahead) {
  v1::TaskRequest request;
  request.set_worker_id(worker_id);
  request.set_ahead(ahead);
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

absl::StatusOr<uint64_t> ServerClient::Pull(uint64_t worker_id, uint64_t version, bool latest,
                                            const v1::ModelSpec& spec,
                                            std::vector<std::vector<float>>* layers,
                                            uint64_t* bytes, uint32_t slice, uint32_t slices) {
  grpc::ClientContext context;
  PrepareContext(&context, kTransferDeadlineSeconds);
  v1::PullRequest request;
  request.set_worker_id(worker_id);
  request.set_version(version);
  request.set_latest(latest);
  slices = std::max<uint32_t>(1, slices);
  if (slices > 1) {
    request.set_slice(slice);
    request.set_slices(slices);
  }
  std::unique_ptr<grpc::ClientReader<v1::ParamChunk>> reader =
      parameters_->Pull(&context, request);
  layers->resize(spec.layers_size());
  std::vector<uint64_t> filled(spec.layers_size(), 0);  // elements received, from the slice start
  std::vector<uint64_t> first(spec.layers_size()), length(spec.layers_size());
  for (int i = 0; i < spec.layers_size(); ++i) {
    const auto [begin, end] = SliceRange(spec.layers(i).num_elements(), slices, slice);
    first[i] = begin;
    length[i] = end - begin;
    (*layers)[i].resize(length[i]);
  }
  bool have_version = false;
  uint64_t received_version = 0;
  v1::ParamChunk chunk;
  absl::Status bad;
  while (bad.ok() && reader->Read(&chunk)) {
    if (!have_version) {
      received_version = chunk.version();
      have_version = true;
    }
    const uint32_t id = chunk.layer_id();
    if (chunk.version() != received_version) {
      bad = absl::DataLossError("pull stream mixes model versions");
    } else if (id >= static_cast<uint32_t>(spec.layers_size()) ||
               chunk.layer_elements() != spec.layers(id).num_elements() ||
               chunk.offset() != first[id] + filled[id] ||
               chunk.data().size() % sizeof(float) != 0 ||
               filled[id] + chunk.data().size() / sizeof(float) > length[id]) {
      bad = absl::DataLossError(absl::StrFormat("pull stream: bad chunk for layer %d", id));
    } else {
      const size_t count = chunk.data().size() / sizeof(float);
      absl::Status s =
          DecodeFloats(chunk.data(), absl::MakeSpan((*layers)[id].data() + filled[id], count));
      if (!s.ok()) bad = absl::DataLossError(absl::StrCat("pull stream: ", s.message()));
      filled[id] += count;
      *bytes += chunk.data().size();
    }
  }
  if (!bad.ok()) {
    context.TryCancel();
    reader->Finish();
    return bad;
  }
  absl::Status s = FromGrpcStatus(reader->Finish());
  if (!s.ok()) return s;
  for (int i = 0; i < spec.layers_size(); ++i) {
    if (filled[i] != length[i]) {
      return absl::DataLossError(absl::StrFormat("pull stream: layer %d incomplete", i));
    }
  }
  return received_version;
}

absl::StatusOr<v1::PushReply> ServerClient::Push(
    const v1::PushHeader& header, const v1::ModelSpec& spec,
    const std::vector<std::vector<float>>& layers, const std::vector<v1::Codec>& codecs,
    size_t int8_block_size, std::vector<std::vector<float>>* residuals, uint64_t* bytes) {
  if (residuals != nullptr) {
    residuals->resize(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) (*residuals)[l].resize(layers[l].size());
  }
  // Encode everything first: a value that cannot be encoded must not leave half an update on
  // the wire.
  std::vector<v1::PushChunk> chunks;
  for (size_t layer = 0; layer < layers.size(); ++layer) {
    const v1::Codec codec = layer < codecs.size() ? codecs[layer] : v1::CODEC_FP32;
    const size_t max_elements = MaxChunkElements(codec, int8_block_size);
    // Where this buffer starts in the layer: a slice's first element, or 0.
    uint64_t first = 0;
    if (header.slices() > 1 && layer < static_cast<size_t>(spec.layers_size())) {
      first = SliceRange(spec.layers(layer).num_elements(), header.slices(), header.slice()).first;
    }
    for (auto [begin, end] : ChunkRanges(layers[layer].size(), max_elements)) {
      v1::PushChunk chunk;
      chunk.set_layer_id(static_cast<uint32_t>(layer));
      chunk.set_offset(first + begin);
      chunk.set_codec(codec);
      float* residual = residuals ? (*residuals)[layer].data() + begin : nullptr;
      absl::Status s =
          EncodeChunk(codec, absl::MakeConstSpan(layers[layer].data() + begin, end - begin),
                      int8_block_size, chunk.mutable_data(), residual);
      if (!s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("layer %d at offset %d: %s", layer, begin, s.message()));
      }
      chunks.push_back(std::move(chunk));
    }
  }
  if (chunks.empty()) chunks.emplace_back();
  *chunks.front().mutable_header() = header;

  grpc::ClientContext context;
  PrepareContext(&context, kTransferDeadlineSeconds);
  v1::PushReply reply;
  std::unique_ptr<grpc::ClientWriter<v1::PushChunk>> writer =
      parameters_->Push(&context, &reply);
  for (const v1::PushChunk& chunk : chunks) {
    *bytes += chunk.data().size();
    if (!writer->Write(chunk)) break;  // the server ended the stream early; Finish() says why
  }
  writer->WritesDone();
  absl::Status s = FromGrpcStatus(writer->Finish());
  if (!s.ok()) return s;
  return reply;
}

}  // namespace aloe::worker
