#include "common/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/corpus_manifest.h"
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
  return WriteFileAtomically(path, EncodeTokenShard(tokens, vocab_size));
}

std::string EncodeTokenShard(absl::Span<const uint32_t> tokens, uint32_t vocab_size) {
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
  } else if (!tokens.empty()) {  // an empty span may hold null, which memcpy may not take
    std::memcpy(body, tokens.data(), tokens.size() * 4);
  }
  return buf;
}

const char* TokenFileFormatName(TokenFileFormat format) {
  switch (format) {
    case TokenFileFormat::kAloe:
      return "aloe";
    case TokenFileFormat::kLlmc:
      return "llmc";
    case TokenFileFormat::kUint16:
      return "uint16";
  }
  return "?";
}

absl::StatusOr<TokenFileFormat> ParseTokenFileFormat(std::string_view name) {
  for (TokenFileFormat f :
       {TokenFileFormat::kAloe, TokenFileFormat::kLlmc, TokenFileFormat::kUint16}) {
    if (name == TokenFileFormatName(f)) return f;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown token file format \"%s\" (aloe, llmc or uint16)", std::string(name)));
}

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path) {
  return Open(path, TokenFileFormat::kAloe, 0);
}

namespace {

// The layout of a mapped file, from its header: where tokens start, their width and count.
struct Layout {
  size_t header_bytes;
  uint32_t dtype;
  uint64_t tokens;
  uint32_t vocab_size;
};

absl::StatusOr<Layout> AloeLayout(const std::string& path, const unsigned char* h,
                                  uint64_t file_bytes) {
  if (file_bytes < kTokenShardHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated header (%d bytes; a token shard starts with a %d-byte header)", path,
        file_bytes, kTokenShardHeaderBytes));
  }
  if (std::memcmp(h, kTokenShardMagic, sizeof(kTokenShardMagic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: bad magic \"%s\" (expected \"ALOETOKS\"; not a token shard)", path,
                        absl::CHexEscape(absl::string_view(reinterpret_cast<const char*>(h), 8))));
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(h + 8, 4));
  if (version != kTokenShardFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: unsupported format_version %u (this build reads version %u)", path,
                        version, kTokenShardFormatVersion));
  }
  const uint32_t dtype = static_cast<uint32_t>(GetLe(h + 12, 4));
  if (dtype != 2 && dtype != 4) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: unsupported dtype %u (expected 2 for uint16 or 4 for uint32 tokens)", path, dtype));
  }
  const uint32_t vocab_size = static_cast<uint32_t>(GetLe(h + 24, 4));
  if (vocab_size == 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: vocab_size is 0 in the header", path));
  }
  return Layout{kTokenShardHeaderBytes, dtype, GetLe(h + 16, 8), vocab_size};
}

absl::StatusOr<Layout> LlmcLayout(const std::string& path, const unsigned char* h,
                                  uint64_t file_bytes) {
  // The magic first: a short file of another kind is told so, not called truncated.
  const int32_t magic = file_bytes >= 4 ? static_cast<int32_t>(GetLe(h, 4)) : kLlmcMagic;
  if (magic != kLlmcMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: byte offset 0: magic %d, expected %d (not an llm.c token file; a headerless nanoGPT "
        "file is --input_format uint16)",
        path, magic, kLlmcMagic));
  }
  if (file_bytes < kLlmcHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: truncated header: the file ends at byte offset %d, inside the %d-byte llm.c header",
        path, file_bytes, kLlmcHeaderBytes));
  }
  const int32_t version = static_cast<int32_t>(GetLe(h + 4, 4));
  if (version != 1 && version != 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: byte offset 4: version %d, expected 1 (uint16 tokens) or 2 (uint32 tokens)", path,
        version));
  }
  const int32_t count = static_cast<int32_t>(GetLe(h + 8, 4));
  if (count <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: byte offset 8: token count %d, expected > 0", path, count));
  }
  return Layout{kLlmcHeaderBytes, version == 1 ? 2u : 4u, static_cast<uint64_t>(count), 0};
}

// Only an ALOE token shard records its vocabulary.
absl::Status CheckVocabGiven(const std::string& path, TokenFileFormat format, uint32_t vocab_size) {
  if (format != TokenFileFormat::kAloe && vocab_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: a %s token file needs the vocab_size of its tokens", path,
                        TokenFileFormatName(format)));
  }
  return absl::OkStatus();
}

// The layout of the `file_bytes` bytes at `h` as a token file of `format`, checked against
// the size; Open's contract.
absl::StatusOr<Layout> CheckedLayout(const std::string& path, const unsigned char* h,
                                     uint64_t file_bytes, TokenFileFormat format,
                                     uint32_t vocab_size) {
  ALOE_RETURN_IF_ERROR(CheckVocabGiven(path, format, vocab_size));
  if (file_bytes == 0) {
    return absl::InvalidArgumentError(
        format == TokenFileFormat::kAloe
            ? absl::StrFormat(
                  "%s: truncated header (0 bytes; a token shard starts with a %d-byte header)",
                  path, kTokenShardHeaderBytes)
            : absl::StrFormat("%s: empty file: no tokens", path));
  }
  absl::StatusOr<Layout> parsed = format == TokenFileFormat::kAloe ? AloeLayout(path, h, file_bytes)
                                  : format == TokenFileFormat::kLlmc
                                      ? LlmcLayout(path, h, file_bytes)
                                      : Layout{0, 2, file_bytes / 2, vocab_size};
  ALOE_ASSIGN_OR_RETURN(Layout layout, std::move(parsed));
  if (format == TokenFileFormat::kAloe && vocab_size != 0 && layout.vocab_size != vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: byte offset 24: vocab_size %d, but the corpus manifest says %d", path,
                        layout.vocab_size, vocab_size));
  }
  if (format != TokenFileFormat::kAloe) layout.vocab_size = vocab_size;
  const uint64_t dtype = layout.dtype;
  const uint64_t body_bytes = file_bytes - layout.header_bytes;
  // Compare by division so a corrupt token count cannot overflow the multiplication.
  if (body_bytes % dtype != 0 || body_bytes / dtype != layout.tokens) {
    if (format == TokenFileFormat::kAloe) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: truncated: header says %u tokens but the file holds %u (%u body bytes, %u per "
          "token)",
          path, layout.tokens, body_bytes / dtype, body_bytes, dtype));
    }
    if (format == TokenFileFormat::kUint16) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: truncated: byte offset %d starts half a uint16 token (the size must be even)", path,
          file_bytes - 1));
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s: the header (byte offset 8) says %d tokens, which end at byte offset %d, but the "
        "file ends at byte offset %d",
        path, body_bytes / dtype < layout.tokens ? "truncated" : "trailing bytes", layout.tokens,
        layout.header_bytes + layout.tokens * dtype, file_bytes));
  }
  return layout;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path,
                                                             TokenFileFormat format,
                                                             uint32_t vocab_size) {
  ALOE_RETURN_IF_ERROR(CheckVocabGiven(path, format, vocab_size));
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
  // mmap refuses zero bytes; no format is empty.
  if (file_bytes == 0) return CheckedLayout(path, nullptr, 0, format, vocab_size).status();
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (mapping == MAP_FAILED) return ErrnoError(path, "mmap", errno);
  // The mapping stays valid after the descriptor closes.
  absl::StatusOr<Layout> layout = CheckedLayout(path, static_cast<const unsigned char*>(mapping),
                                                file_bytes, format, vocab_size);
  if (!layout.ok()) {
    ::munmap(mapping, file_bytes);
    return layout.status();
  }
  return std::unique_ptr<TokenShard>(new TokenShard(path, mapping, file_bytes, "",
                                                    layout->header_bytes, layout->dtype,
                                                    layout->tokens, layout->vocab_size));
}

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::FromBytes(std::string path,
                                                                  std::string bytes,
                                                                  TokenFileFormat format,
                                                                  uint32_t vocab_size) {
  ALOE_ASSIGN_OR_RETURN(const Layout layout,
                        CheckedLayout(path, reinterpret_cast<const unsigned char*>(bytes.data()),
                                      bytes.size(), format, vocab_size));
  return std::unique_ptr<TokenShard>(new TokenShard(std::move(path), nullptr, 0, std::move(bytes),
                                                    layout.header_bytes, layout.dtype,
                                                    layout.tokens, layout.vocab_size));
}

TokenShard::TokenShard(std::string path, void* mapping, size_t mapping_bytes, std::string bytes,
                       size_t header_bytes, uint32_t dtype_bytes, uint64_t num_tokens,
                       uint32_t vocab_size)
    : path_(std::move(path)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      bytes_(std::move(bytes)),
      header_bytes_(header_bytes),
      dtype_bytes_(dtype_bytes),
      num_tokens_(num_tokens),
      vocab_size_(vocab_size) {}

TokenShard::~TokenShard() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

void TokenShard::Read(uint64_t offset, uint64_t count, int64_t* out) const {
  assert(offset <= num_tokens_ && count <= num_tokens_ - offset);
  const char* body = data() + header_bytes_;
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

absl::Status TokenShard::CheckTokenRange() const {
  constexpr uint64_t kChunk = 1 << 16;
  std::vector<int64_t> tokens(std::min(kChunk, num_tokens_));
  for (uint64_t from = 0; from < num_tokens_; from += kChunk) {
    const uint64_t n = std::min(kChunk, num_tokens_ - from);
    Read(from, n, tokens.data());
    for (uint64_t i = 0; i < n; ++i) {
      if (static_cast<uint64_t>(tokens[i]) >= vocab_size_) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: byte offset %d: token %d is outside the vocabulary (vocab_size %d)", path_,
            header_bytes_ + (from + i) * dtype_bytes_, tokens[i], vocab_size_));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<const TokenShard*> TokenShardCache::Get(const std::string& file) {
  auto it = shards_.find(file);
  if (it != shards_.end()) return it->second.get();
  if (!read_manifest_) {
    absl::StatusOr<CorpusInfo> corpus = LoadCorpusInfo(dir_);
    if (corpus.ok()) {
      format_ = corpus->format;
      vocab_size_ = corpus->vocab_size;
    } else if (corpus.status().code() != absl::StatusCode::kNotFound) {
      return corpus.status();
    }
    read_manifest_ = true;
  }
  ALOE_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard,
                        TokenShard::Open(absl::StrCat(dir_, "/", file), format_, vocab_size_));
  const TokenShard* raw = shard.get();
  shards_.emplace(file, std::move(shard));
  return raw;
}

}  // namespace aloe
