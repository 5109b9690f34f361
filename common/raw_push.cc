#include "common/raw_push.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "common/model_spec.h"

namespace aloe {
namespace {

void PutU32(uint32_t v, std::string* out) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>(v >> (8 * i));
  out->append(b, 4);
}

void PutU64(uint64_t v, std::string* out) {
  PutU32(static_cast<uint32_t>(v), out);
  PutU32(static_cast<uint32_t>(v >> 32), out);
}

uint64_t GetLE(const char* b, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
  return v;
}

absl::StatusOr<uint32_t> ReadU32(ByteReader& in) {
  char b[4];
  if (absl::Status s = in.ReadExactly(b, 4); !s.ok()) return s;
  return static_cast<uint32_t>(GetLE(b, 4));
}

// A length-prefixed field of at most `limit` bytes; `what` names it in errors.
absl::StatusOr<std::string> ReadField(ByteReader& in, uint32_t limit, const char* what) {
  absl::StatusOr<uint32_t> n = ReadU32(in);
  if (!n.ok()) return n.status();
  if (*n > limit) {
    return absl::InvalidArgumentError(
        absl::StrFormat("raw push: %s of %d bytes, over the limit of %d", what, *n, limit));
  }
  std::string field(*n, '\0');
  if (absl::Status s = in.ReadExactly(field.data(), field.size()); !s.ok()) return s;
  return field;
}

}  // namespace

absl::Status WaitForSocket(int fd, short events, absl::Duration timeout) {
  pollfd p{fd, events, 0};
  const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
  while (true) {
    const int r = poll(&p, 1, ms);
    if (r > 0) return absl::OkStatus();
    if (r == 0) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "raw push: no progress on the connection for %s", absl::FormatDuration(timeout)));
    }
    if (errno != EINTR) {
      return absl::UnavailableError(absl::StrFormat("raw push: poll: %s", std::strerror(errno)));
    }
  }
}

absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address) {
  std::string host, port;
  if (!address.empty() && address[0] == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrFormat("bad address '%s'", address));
    }
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("bad address '%s': expected HOST:PORT", address));
    }
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  int number = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &number) || number < 0 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bad address '%s': expected HOST:PORT", address));
  }
  return std::make_pair(host, port);
}

namespace {

struct FreeAddrInfo {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfoList = std::unique_ptr<addrinfo, FreeAddrInfo>;

// The socket addresses of "host:port" (passive: to bind).
absl::StatusOr<AddrInfoList> Resolve(const std::string& address, bool passive) {
  absl::StatusOr<std::pair<std::string, std::string>> hp = SplitHostPort(address);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  if (const int e = getaddrinfo(hp->first.c_str(), hp->second.c_str(), &hints, &found); e != 0) {
    return absl::Status(
        passive ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kUnavailable,
        absl::StrFormat("cannot resolve '%s': %s", address, gai_strerror(e)));
  }
  return AddrInfoList(found);
}

}  // namespace

std::vector<RawPushRange> RawPushRanges(const v1::ModelSpec& spec,
                                        std::optional<uint32_t> shard_process,
                                        const v1::PushHeader& header,
                                        absl::Span<const uint32_t> layer_groups) {
  std::vector<RawPushRange> ranges;
  for (int l = 0; l < spec.layers_size(); ++l) {
    const v1::LayerSpec& layer = spec.layers(l);
    if (shard_process.has_value() && layer.shard() != *shard_process) continue;
    if (!layer_groups.empty() &&
        (static_cast<size_t>(l) >= layer_groups.size() || layer_groups[l] != header.group())) {
      continue;
    }
    RawPushRange range{static_cast<uint32_t>(l), 0, layer.num_elements()};
    if (header.slices() > 1) {
      const auto [begin, end] = SliceRange(layer.num_elements(), header.slices(), header.slice());
      range.first = begin;
      range.count = end - begin;
    }
    ranges.push_back(range);
  }
  return ranges;
}

uint64_t RawPushPayloadBytes(const std::vector<RawPushRange>& ranges) {
  uint64_t bytes = 0;
  for (const RawPushRange& r : ranges) bytes += r.count * sizeof(float);
  return bytes;
}

std::string EncodeRawPushPrelude(std::string_view token, const v1::PushHeader& header,
                                 uint64_t payload_bytes) {
  const std::string serialized = header.SerializeAsString();
  std::string out;
  out.reserve(24 + token.size() + serialized.size());
  PutU32(kRawPushMagic, &out);
  PutU32(kRawPushVersion, &out);
  PutU32(static_cast<uint32_t>(token.size()), &out);
  out.append(token);
  PutU32(static_cast<uint32_t>(serialized.size()), &out);
  out.append(serialized);
  PutU64(payload_bytes, &out);
  return out;
}

std::string EncodeRawPushReply(const absl::Status& status, const v1::PushReply& reply) {
  const std::string message(status.message().substr(0, kMaxRawPushMessageBytes));
  const std::string serialized = status.ok() ? reply.SerializeAsString() : std::string();
  std::string out;
  PutU32(static_cast<uint32_t>(status.code()), &out);
  PutU32(static_cast<uint32_t>(message.size()), &out);
  out.append(message);
  PutU32(static_cast<uint32_t>(serialized.size()), &out);
  out.append(serialized);
  return out;
}

absl::StatusOr<RawPushRequest> ReadRawPushPrelude(ByteReader& in, bool* nothing_read) {
  if (nothing_read != nullptr) *nothing_read = true;
  char fixed[8];
  if (absl::Status s = in.ReadExactly(fixed, 1); !s.ok()) return s;
  if (nothing_read != nullptr) *nothing_read = false;
  if (absl::Status s = in.ReadExactly(fixed + 1, 7); !s.ok()) return s;
  const uint32_t magic = static_cast<uint32_t>(GetLE(fixed, 4));
  const uint32_t version = static_cast<uint32_t>(GetLE(fixed + 4, 4));
  if (magic != kRawPushMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "raw push: not a raw push (magic 0x%08x, expected 0x%08x)", magic, kRawPushMagic));
  }
  if (version != kRawPushVersion) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "raw push: version %d, this server speaks version %d", version, kRawPushVersion));
  }
  RawPushRequest request;
  absl::StatusOr<std::string> token = ReadField(in, kMaxRawPushTokenBytes, "token");
  if (!token.ok()) return token.status();
  request.token = *std::move(token);
  absl::StatusOr<std::string> header = ReadField(in, kMaxRawPushMessageBytes, "push header");
  if (!header.ok()) return header.status();
  if (!request.header.ParseFromString(*header)) {
    return absl::InvalidArgumentError("raw push: the push header does not parse");
  }
  char size[8];
  if (absl::Status s = in.ReadExactly(size, 8); !s.ok()) return s;
  request.payload_bytes = GetLE(size, 8);
  return request;
}

absl::Status ReadRawPushReply(ByteReader& in, absl::Status* carried, v1::PushReply* reply) {
  auto malformed = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kInvalidArgument ? absl::DataLossError(s.message()) : s;
  };
  absl::StatusOr<uint32_t> code = ReadU32(in);
  if (!code.ok()) return code.status();
  if (*code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::DataLossError(absl::StrFormat("raw push reply: unknown status code %d", *code));
  }
  absl::StatusOr<std::string> message = ReadField(in, kMaxRawPushMessageBytes, "reply message");
  if (!message.ok()) return malformed(message.status());
  absl::StatusOr<std::string> body = ReadField(in, kMaxRawPushMessageBytes, "reply");
  if (!body.ok()) return malformed(body.status());
  *carried = absl::Status(static_cast<absl::StatusCode>(*code), *message);
  if (carried->ok() && !reply->ParseFromString(*body)) {
    return absl::DataLossError("raw push reply: the PushReply does not parse");
  }
  return absl::OkStatus();
}

absl::Status SocketStream::ReadExactly(char* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = recv(fd_, out + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return absl::UnavailableError("raw push: the connection was closed");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return absl::UnavailableError(absl::StrFormat("raw push: recv: %s", std::strerror(errno)));
    }
    if (absl::Status s = WaitForSocket(fd_, POLLIN, timeout_); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const char* data, size_t n, absl::Duration timeout) {
  size_t sent = 0;
  while (sent < n) {
    const ssize_t r = send(fd, data + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      sent += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      return absl::UnavailableError(absl::StrFormat("raw push: send: %s", std::strerror(errno)));
    }
    if (absl::Status s = WaitForSocket(fd, POLLOUT, timeout); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SocketStream::WriteAll(const char* data, size_t n) {
  return ::aloe::WriteAll(fd_, data, n, timeout_);
}

absl::StatusOr<int> ConnectTcp(const std::string& address, absl::Duration timeout) {
  absl::StatusOr<AddrInfoList> found = Resolve(address, /*passive=*/false);
  if (!found.ok()) return found.status();
  std::string last = "no address";
  for (addrinfo* a = found->get(); a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int r = connect(fd, a->ai_addr, a->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      absl::Status waited = WaitForSocket(fd, POLLOUT, timeout);
      int error = 0;
      socklen_t len = sizeof(error);
      if (waited.ok() && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0) {
        r = 0;
      } else {
        errno = waited.ok() ? error : ETIMEDOUT;
      }
    }
    if (r == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    last = std::strerror(errno);
    close(fd);
  }
  return absl::UnavailableError(
      absl::StrFormat("raw push: cannot connect to %s: %s", address, last));
}

absl::StatusOr<int> ListenTcp(const std::string& address, int* port) {
  absl::StatusOr<AddrInfoList> found = Resolve(address, /*passive=*/true);
  if (!found.ok()) return found.status();
  std::string last = "no address";
  for (addrinfo* a = found->get(); a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 256) == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
      *port = bound.ss_family == AF_INET6
                  ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                  : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      return fd;
    }
    last = std::strerror(errno);
    close(fd);
  }
  return absl::UnavailableError(absl::StrFormat("cannot listen on %s: %s", address, last));
}

}  // namespace aloe
