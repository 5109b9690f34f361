// ParameterService with both methods on raw messages (common/push_wire.h), the wire format
// unchanged: a pushed chunk's payload goes from the received slices straight into the staging
// buffer (no copy into a std::string by protobuf parsing), and a pulled chunk's payload is sent
// from the version's own parameter buffer (no copy into a ParamChunk, none to serialise it).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/push_wire.h"
#include "proto/aloe.grpc.pb.h"
#include "server/core/update_assembler.h"

namespace aloe::server {

// A Push stream's messages, parsed as they are read, and the stream's framing rules: the first
// message carries the header (alone, or with the first chunk), no later message does.
class PushStreamReader {
 public:
  explicit PushStreamReader(grpc::ServerReaderInterface<grpc::ByteBuffer>* reader)
      : reader_(reader) {}

  // Reads the first message and returns its header. kInvalidArgument for an empty stream, a
  // first message without a header, or one that does not parse.
  absl::StatusOr<v1::PushHeader> ReadHeader();
  // After ReadHeader: adds the first message's chunk (if it has data) and every later message's
  // to `assembler`, to the end of the stream. kInvalidArgument for a repeated header or a message
  // that does not parse; else the first error of assembler.AddChunk.
  absl::Status ReadChunks(UpdateAssembler& assembler);

 private:
  // Reads the next message into chunk_, whose data views stay valid until the next Read: true.
  // False at the end of the stream, or for a message that does not parse (status_ says so).
  bool Read();

  grpc::ServerReaderInterface<grpc::ByteBuffer>* reader_;
  grpc::ByteBuffer message_;
  std::vector<grpc::Slice> slices_;
  std::vector<std::string_view> pieces_;
  PushChunkView chunk_;
  absl::Status status_;
};

// A Pull stream's writer.
using PullStreamWriter = grpc::internal::WriterInterface<grpc::ByteBuffer>;

// The ParamChunk of elements [begin, end) of a layer of `version`, its payload lent to gRPC
// from `layer` itself: the buffer stays alive (and, copy-on-write, unchanged) until gRPC has
// sent it. group_version: a pull by layer group's ParamChunk.group_version (0 = none).
grpc::ByteBuffer ParamChunkMessage(uint64_t version, uint32_t layer_id,
                                   std::shared_ptr<const std::vector<float>> layer, size_t begin,
                                   size_t end, uint64_t group_version = 0);

// A ParameterService whose Push and Pull are served by ServePush and ServePull below.
class WireParameterService : public v1::ParameterService::Service {
 public:
  WireParameterService();

  virtual grpc::Status ServePush(grpc::ServerContext* context, PushStreamReader* reader,
                                 v1::PushReply* reply) = 0;
  virtual grpc::Status ServePull(grpc::ServerContext* context, const v1::PullRequest* request,
                                 PullStreamWriter* writer) = 0;

 private:
  // The generated handlers are replaced in the constructor and never run.
  grpc::Status Push(grpc::ServerContext*, grpc::ServerReader<v1::PushChunk>*, v1::PushReply*) final;
  grpc::Status Pull(grpc::ServerContext*, const v1::PullRequest*,
                    grpc::ServerWriter<v1::ParamChunk>*) final;
};

}  // namespace aloe::server
