#include "server/service/push_ingest.h"

#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "server/core/server_metrics.h"
#include "server/service/grpc_services.h"

namespace aloe::server {

grpc::Status PushIngestService::ServePush(grpc::ServerContext* context, PushStreamReader* reader,
                                          v1::PushReply* reply) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> identity = auth_.Identify(*context);
  if (!identity.ok()) return ToGrpcStatus(Rejected(identity.status()));
  absl::StatusOr<v1::PushHeader> header = reader->ReadHeader();
  if (!header.ok()) return ToGrpcStatus(Rejected(header.status()));
  absl::StatusOr<v1::PushReply> result = AcceptPush(
      *header, *identity, [context] { return context->IsCancelled(); },
      [reader](UpdateAssembler& assembler) { return reader->ReadChunks(assembler); }, start);
  if (result.ok()) *reply = *std::move(result);
  return ToGrpcStatus(result.status());
}

absl::StatusOr<v1::PushReply> PushIngestService::ServeRawPush(
    const RawPushRequest& request, ByteReader& in, const std::function<bool()>& cancelled) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> identity = auth_.IdentifyToken(request.token);
  if (!identity.ok()) return Rejected(identity.status());
  absl::StatusOr<std::vector<RawPushRange>> ranges =
      CheckRawPush(spec_, shard_, request, layer_groups_);
  if (!ranges.ok()) return Rejected(ranges.status());
  const uint64_t expected = request.payload_bytes;
  absl::Status received = absl::UnknownError("not read");  // OK: the payload came whole
  auto read = [&](UpdateAssembler& a) { return received = ReadRawPayload(*ranges, in, a); };
  absl::StatusOr<v1::PushReply> result =
      AcceptPush(request.header, *identity, cancelled, read, start);
  // Counted after AcceptPush counted them in aloe_received_bytes_total: a scrape in between
  // never sees more raw bytes than received ones (a raw share above 1).
  if (received.ok()) {
    metrics_.Add(kRawPushBytes, static_cast<double>(expected));
    raw_push_bytes_ += expected;
  }
  return result;
}

}  // namespace aloe::server
