// libFuzzer target for the raw push wire format (common/raw_push.h): a shard reads the prelude
// of every raw push from an untrusted TCP connection, and a worker reads the shard's reply.
// Built with ASan + UBSan (tests/fuzz/CMakeLists.txt).
//
// Input: any bytes, read once as a request prelude and once as a reply, from memory.
//
// Oracle, on every input (a violation aborts, which libFuzzer reports as a crash):
//   - ReadRawPushPrelude accepts, or refuses with kInvalidArgument (malformed) or kUnavailable
//     (the input ended, as a closed connection); it never reads past what the prelude declares:
//     an accepted prelude consumed exactly 24 + token + header bytes, and the token and header
//     are within their limits. *nothing_read is true only for an empty input.
//   - An accepted prelude, encoded again with EncodeRawPushPrelude, reads back to the same
//     token, header (re-serialised) and payload size.
//   - ReadRawPushReply returns OK, kDataLoss (malformed) or kUnavailable; when OK, the carried
//     status has a known code and, encoded again with EncodeRawPushReply, reads back to the same
//     code, message and (for an OK outcome) PushReply.
#include <cstdint>
#include <cstring>
#include <string>

#include "common/raw_push.h"
#include "proto/aloe.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace aloe {
namespace {

class MemoryReader final : public ByteReader {
 public:
  MemoryReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  absl::Status ReadExactly(char* out, size_t n) override {
    if (size_ - at_ < n) {
      at_ = size_;
      return absl::UnavailableError("end of input");
    }
    if (n > 0) std::memcpy(out, data_ + at_, n);
    at_ += n;
    return absl::OkStatus();
  }
  size_t consumed() const { return at_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

void CheckPrelude(const uint8_t* data, size_t size) {
  MemoryReader in(data, size);
  bool nothing_read = false;
  absl::StatusOr<RawPushRequest> request = ReadRawPushPrelude(in, &nothing_read);
  FUZZ_CHECK(nothing_read == (size == 0 && !request.ok()), "nothing_read %d for %zu bytes",
             nothing_read, size);
  if (!request.ok()) {
    const absl::StatusCode code = request.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kUnavailable,
               "prelude refused with code %d", static_cast<int>(code));
    return;
  }
  FUZZ_CHECK(request->token.size() <= kMaxRawPushTokenBytes, "token of %zu bytes",
             request->token.size());
  uint32_t header_bytes = 0;
  std::memcpy(&header_bytes, data + 12 + request->token.size(), sizeof(header_bytes));
  FUZZ_CHECK(header_bytes <= kMaxRawPushMessageBytes, "header of %u bytes", header_bytes);
  FUZZ_CHECK(in.consumed() == 24 + request->token.size() + header_bytes,
             "consumed %zu bytes for a token of %zu and a header of %u", in.consumed(),
             request->token.size(), header_bytes);
  const std::string again =
      EncodeRawPushPrelude(request->token, request->header, request->payload_bytes);
  MemoryReader in2(reinterpret_cast<const uint8_t*>(again.data()), again.size());
  absl::StatusOr<RawPushRequest> back = ReadRawPushPrelude(in2);
  FUZZ_CHECK(back.ok(), "re-encoded prelude refused: %s", back.status().ToString().c_str());
  FUZZ_CHECK(back->token == request->token, "token changed");
  FUZZ_CHECK(back->header.SerializeAsString() == request->header.SerializeAsString(),
             "header changed");
  FUZZ_CHECK(back->payload_bytes == request->payload_bytes, "payload size changed");
  FUZZ_CHECK(in2.consumed() == again.size(), "re-encoded prelude not read whole");
}

void CheckReply(const uint8_t* data, size_t size) {
  MemoryReader in(data, size);
  absl::Status carried;
  v1::PushReply reply;
  const absl::Status read = ReadRawPushReply(in, &carried, &reply);
  if (!read.ok()) {
    FUZZ_CHECK(
        read.code() == absl::StatusCode::kDataLoss || read.code() == absl::StatusCode::kUnavailable,
        "reply refused with code %d", static_cast<int>(read.code()));
    return;
  }
  FUZZ_CHECK(
      static_cast<int>(carried.code()) >= 0 && carried.code() <= absl::StatusCode::kUnauthenticated,
      "carried code %d", static_cast<int>(carried.code()));
  const std::string again = EncodeRawPushReply(carried, reply);
  MemoryReader in2(reinterpret_cast<const uint8_t*>(again.data()), again.size());
  absl::Status carried2;
  v1::PushReply reply2;
  FUZZ_CHECK(ReadRawPushReply(in2, &carried2, &reply2).ok(), "re-encoded reply refused");
  FUZZ_CHECK(carried2.code() == carried.code(), "code changed");
  FUZZ_CHECK(carried2.message() == carried.message(), "message changed");
  if (carried.ok()) {
    FUZZ_CHECK(reply2.SerializeAsString() == reply.SerializeAsString(), "reply changed");
  }
}

}  // namespace
}  // namespace aloe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  aloe::CheckPrelude(data, size);
  aloe::CheckReply(data, size);
  return 0;
}
