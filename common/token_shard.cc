#include "common/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

// The body is read by memcpy into native integers; the header is decoded byte by byte anyway.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token shards are little-endian; big-endian hosts need a byte-swapping reader");

namespace aloe {
namespace {

constexpr uint32_t kMaxUint16Vocab = 65536;

void PutLe(uint64_t value, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint64_t GetLe(const unsigned char* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(in[i]) << (8 * i);
  return value;
}

absl::Status ErrnoError(const std::string& path, const char* what, int err) {
  return absl::InternalError(absl::StrFormat("%s: %s failed: %s", path, what, std::strerror(err)));
}

// Closes a file descriptor on scope exit.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  int get() const { return fd_; }
  // Closes now (idempotent) and returns close()'s result, which can carry a deferred write
  // error.
  int Close() {
    if (fd_ < 0) return 0;
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

}  // namespace

absl::Status WriteTokenShard(const std::string& path, absl::Span<const uint32_t> tokens,
                             uint32_t vocab_size) {
  if (vocab_size == 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: vocab_size must be > 0", path));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: token %u at index %d is outside the vocab (vocab_size %u)", path,
                          tokens[i], i, vocab_size));
    }
  }
  const uint32_t dtype = vocab_size <= kMaxUint16Vocab ? 2 : 4;
  std::string buf(kTokenShardHeaderBytes + tokens.size() * dtype, '\0');
  char* p = buf.data();
  std::memcpy(p, kTokenShardMagic, sizeof(kTokenShardMagic));
  PutLe(kTokenShardFormatVersion, 4, p + 8);
  PutLe(dtype, 4, p + 12);
  PutLe(tokens.size(), 8, p + 16);
  PutLe(vocab_size, 4, p + 24);
  PutLe(0, 4, p + 28);
  char* body = p + kTokenShardHeaderBytes;
  if (dtype == 2) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      const uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(body + 2 * i, &t, 2);
    }
  } else {
    std::memcpy(body, tokens.data(), tokens.size() * 4);
  }
  return WriteFileAtomically(path, buf);
}

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path) {
  FdCloser fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrFormat("%s: no such file", path));
    }
    return ErrnoError(path, "open", errno);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(path, "fstat", errno);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: not a regular file", path));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kTokenShardHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated header (%d bytes; a token shard starts with a %d-byte header)", path,
        file_bytes, kTokenShardHeaderBytes));
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (mapping == MAP_FAILED) return ErrnoError(path, "mmap", errno);
  // The mapping stays valid after the descriptor closes.
  auto unmap_and = [&](absl::Status status) {
    ::munmap(mapping, file_bytes);
    return status;
  };

  const auto* h = static_cast<const unsigned char*>(mapping);
  if (std::memcmp(h, kTokenShardMagic, sizeof(kTokenShardMagic)) != 0) {
    return unmap_and(absl::InvalidArgumentError(
        absl::StrFormat("%s: bad magic \"%s\" (expected \"ALOETOKS\"; not a token shard)", path,
                        absl::CHexEscape(absl::string_view(reinterpret_cast<const char*>(h), 8)))));
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(h + 8, 4));
  if (version != kTokenShardFormatVersion) {
    return unmap_and(absl::InvalidArgumentError(
        absl::StrFormat("%s: unsupported format_version %u (this build reads version %u)", path,
                        version, kTokenShardFormatVersion)));
  }
  const uint32_t dtype = static_cast<uint32_t>(GetLe(h + 12, 4));
  if (dtype != 2 && dtype != 4) {
    return unmap_and(absl::InvalidArgumentError(absl::StrFormat(
        "%s: unsupported dtype %u (expected 2 for uint16 or 4 for uint32 tokens)", path, dtype)));
  }
  const uint64_t token_count = GetLe(h + 16, 8);
  const uint32_t vocab_size = static_cast<uint32_t>(GetLe(h + 24, 4));
  if (vocab_size == 0) {
    return unmap_and(
        absl::InvalidArgumentError(absl::StrFormat("%s: vocab_size is 0 in the header", path)));
  }
  const uint64_t body_bytes = file_bytes - kTokenShardHeaderBytes;
  // Compare by division so a corrupt token_count cannot overflow the multiplication.
  if (body_bytes % dtype != 0 || body_bytes / dtype != token_count) {
    return unmap_and(absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated: header says %u tokens but the file holds %u (%u body bytes, %u per "
        "token)",
        path, token_count, body_bytes / dtype, body_bytes, dtype)));
  }
  return std::unique_ptr<TokenShard>(
      new TokenShard(path, mapping, file_bytes, dtype, token_count, vocab_size));
}

TokenShard::TokenShard(std::string path, void* mapping, size_t mapping_bytes, uint32_t dtype_bytes,
                       uint64_t num_tokens, uint32_t vocab_size)
    : path_(std::move(path)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      dtype_bytes_(dtype_bytes),
      num_tokens_(num_tokens),
      vocab_size_(vocab_size) {}

TokenShard::~TokenShard() { ::munmap(mapping_, mapping_bytes_); }

void TokenShard::Read(uint64_t offset, uint64_t count, int64_t* out) const {
  assert(offset <= num_tokens_ && count <= num_tokens_ - offset);
  const char* body = static_cast<const char*>(mapping_) + kTokenShardHeaderBytes;
  if (dtype_bytes_ == 2) {
    const char* p = body + 2 * offset;
    for (uint64_t i = 0; i < count; ++i) {
      uint16_t t;
      std::memcpy(&t, p + 2 * i, 2);
      out[i] = t;
    }
  } else {
    const char* p = body + 4 * offset;
    for (uint64_t i = 0; i < count; ++i) {
      uint32_t t;
      std::memcpy(&t, p + 4 * i, 4);
      out[i] = t;
    }
  }
}

absl::StatusOr<const TokenShard*> TokenShardCache::Get(const std::string& file) {
  auto it = shards_.find(file);
  if (it != shards_.end()) return it->second.get();
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard,
                        TokenShard::Open(absl::StrCat(dir_, "/", file)));
  const TokenShard* raw = shard.get();
  shards_.emplace(file, std::move(shard));
  return raw;
}

}  // namespace aloe
