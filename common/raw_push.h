// Raw pushes: the float32 part of a push sent to a shard process (or a single-process server)
// over a TCP connection of its own (TLS when the server has it configured) instead of a gRPC
// stream. gRPC costs a push its HTTP/2 framing, flow-control bookkeeping and a thread hand-off per
// message; on loopback that held one shard process to ~0.6 of what receiving, screening and
// applying the same bytes costs (`scripts/bench.sh ingest` measures both). Here the shard process
// receives the payload straight into its staging buffers and screens each piece as it lands. Only
// the bulk bytes move: admission, staging reports and commits stay on the coordinator's gRPC
// control plane, with the same all-or-nothing rules.
//
// One connection carries any number of pushes, one after the other. Per push, little-endian:
//
//   request   u32 magic "ALRP" (kRawPushMagic), u32 version (1)
//             u32 n, n bytes: the token (the x-aloe-token of gRPC calls; n <= 4096)
//             u32 n, n bytes: a serialised PushHeader (n <= 64 KiB)
//             u64 payload bytes, then the payload: float32 values of the receiver's layers in
//             layer order, each layer whole or, for a sliced push, its SliceRange (RawPushRanges)
//   reply     u32 status code (absl/gRPC numbering), u32 n, n bytes of message,
//             u32 n, n bytes: a serialised PushReply (n <= 64 KiB)
//
// A refused push ends the connection after its reply (the rest of its payload is not read); the
// client opens a new one for its next push. A server with TLS configured speaks TLS 1.3 on the
// connection first (common/tls_stream.h), and the same bytes flow inside it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/aloe.pb.h"

namespace aloe {

inline constexpr uint32_t kRawPushMagic = 0x50524c41;  // "ALRP" in little-endian byte order
inline constexpr uint32_t kRawPushVersion = 1;
inline constexpr uint32_t kMaxRawPushTokenBytes = 4096;
inline constexpr uint32_t kMaxRawPushMessageBytes = 64 << 10;

// What precedes a raw push's payload.
struct RawPushRequest {
  std::string token;
  v1::PushHeader header;
  uint64_t payload_bytes = 0;
};

// The elements of one layer a raw push carries: [first, first + count) of layer `layer_id`.
struct RawPushRange {
  uint32_t layer_id = 0;
  uint64_t first = 0;
  uint64_t count = 0;
};

// The payload layout of a push to shard process `shard_process` under `header`: every layer of
// the spec owned by it (layers[l].shard() == shard_process), or every layer of the spec when
// shard_process is nullopt (a single-process server), in layer order, whole or, when
// header.slices() > 1, slice header.slice() of it. The caller has checked the slice fields.
// layer_groups: a server's layer groups (partial synchronization, JoinReply.layer_groups) when it
// has more than one; a push then carries only the layers of group header.group(). Empty = every
// layer.
std::vector<RawPushRange> RawPushRanges(const v1::ModelSpec& spec,
                                        std::optional<uint32_t> shard_process,
                                        const v1::PushHeader& header,
                                        absl::Span<const uint32_t> layer_groups = {});
// Bytes of the payload those ranges take.
uint64_t RawPushPayloadBytes(const std::vector<RawPushRange>& ranges);

// The request bytes before the payload.
std::string EncodeRawPushPrelude(std::string_view token, const v1::PushHeader& header,
                                 uint64_t payload_bytes);
// A whole reply.
std::string EncodeRawPushReply(const absl::Status& status, const v1::PushReply& reply);

// Where a raw push's bytes come from: a socket, or memory in tests.
class ByteReader {
 public:
  virtual ~ByteReader() = default;
  // Fills out[0, n) or fails: kUnavailable when the peer closed or the connection broke,
  // kDeadlineExceeded when it sent nothing for too long.
  virtual absl::Status ReadExactly(char* out, size_t n) = 0;
};

// Reads a request's prelude. kInvalidArgument naming what is wrong: another magic or version,
// a token or header over its limit, a header that does not parse; a failure of `in` as it is.
// *nothing_read (when given) tells whether the failure came before the first byte: a connection
// the client closed between pushes.
absl::StatusOr<RawPushRequest> ReadRawPushPrelude(ByteReader& in, bool* nothing_read = nullptr);
// Reads a reply into *carried (the push's outcome as the server sent it) and, when that is OK,
// *reply. The returned status is the transport's: a failure of `in` as it is, kDataLoss for a
// malformed reply.
absl::Status ReadRawPushReply(ByteReader& in, absl::Status* carried, v1::PushReply* reply);

// Both directions of a raw push connection: plaintext (SocketStream) or TLS (TlsStream,
// common/tls_stream.h).
class ByteStream : public ByteReader {
 public:
  // Writes every byte or fails: kUnavailable when the connection broke, kDeadlineExceeded when
  // the peer took nothing for too long.
  virtual absl::Status WriteAll(const char* data, size_t n) = 0;
  // Whether received bytes wait inside the stream, where poll() on its socket does not see them.
  virtual bool HasBuffered() const { return false; }
};

// --- Sockets (POSIX; blocking with timeouts).

// A connected socket as it is; each read or write waits at most `timeout` for progress.
class SocketStream final : public ByteStream {
 public:
  SocketStream(int fd, absl::Duration timeout) : fd_(fd), timeout_(timeout) {}
  absl::Status ReadExactly(char* out, size_t n) override;
  absl::Status WriteAll(const char* data, size_t n) override;

 private:
  int fd_;
  absl::Duration timeout_;
};

// Waits until socket `fd` is readable (events POLLIN) or writable (POLLOUT): kDeadlineExceeded
// after `timeout`, kUnavailable when poll() fails.
absl::Status WaitForSocket(int fd, short events, absl::Duration timeout);
// Writes every byte; each write waits at most `timeout` for room. kUnavailable when the
// connection broke, kDeadlineExceeded on timeout.
absl::Status WriteAll(int fd, const char* data, size_t n, absl::Duration timeout);
// "host:port" or "[v6]:port" as (host, port); kInvalidArgument for anything else.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address);
// A connected TCP socket to "host:port" (IPv4 or IPv6 literal or name; "[v6]:port" too), with
// TCP_NODELAY. kInvalidArgument for a malformed address, kUnavailable when it cannot connect.
absl::StatusOr<int> ConnectTcp(const std::string& address, absl::Duration timeout);
// A listening TCP socket bound to "host:port" (port 0: any); *port gets the port bound.
// kInvalidArgument for a malformed address, kUnavailable when it cannot bind.
absl::StatusOr<int> ListenTcp(const std::string& address, int* port);

}  // namespace aloe
