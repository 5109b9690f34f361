// TLS for raw push connections (common/raw_push.h), under the rules of the gRPC channels: the
// server presents its certificate (security.tls_cert_file), the client verifies it against its CA
// (aloe-worker --tls_ca_file) for the name it dialled or --tls_server_name, and under mutual TLS
// (security.tls_client_ca_file) the server requires a client certificate issued by that CA.
// TLS 1.3 only, no session resumption. Who the caller is still comes from the token in the push's
// prelude, as for gRPC calls.
//
// The socket is non-blocking; every read and write waits for progress at most the stream's
// timeout. Reads and writes go through OpenSSL in large pieces: the writer's whole buffer per
// SSL_write, the reader's socket reads ahead of the record it decrypts.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/raw_push.h"

struct ssl_ctx_st;
struct ssl_st;

namespace aloe {

// A server's certificates, PEM.
struct TlsServerOptions {
  std::string cert_pem;       // certificate chain, leaf first
  std::string key_pem;        // its private key
  std::string client_ca_pem;  // "" = no client certificates; else required and verified
};

// A client's certificates, PEM.
struct TlsClientOptions {
  std::string ca_pem;       // verifies the server's certificate
  std::string cert_pem;     // client certificate chain for mutual TLS; "" = none
  std::string key_pem;      // its private key
  std::string server_name;  // the name checked in the server's certificate; "" = the host dialled
};

// One connection's TLS session over a connected socket. Not thread-safe.
class TlsStream final : public ByteStream {
 public:
  // Takes `ssl`, a session TlsContext set up on `fd`; the socket stays the caller's to close.
  TlsStream(ssl_st* ssl, int fd, absl::Duration timeout) : ssl_(ssl), fd_(fd), timeout_(timeout) {}
  TlsStream(const TlsStream&) = delete;
  TlsStream& operator=(const TlsStream&) = delete;
  ~TlsStream() override;

  // kUnavailable naming the TLS error for a broken or refused session (an alert the peer sent
  // says why), "the connection was closed" when the peer closed it.
  absl::Status ReadExactly(char* out, size_t n) override;
  absl::Status WriteAll(const char* data, size_t n) override;
  bool HasBuffered() const override;
  void set_timeout(absl::Duration timeout) { timeout_ = timeout; }
  // The protocol negotiated: "TLSv1.3".
  std::string protocol() const;
  // Tells the peer that nothing more comes (close_notify), without waiting for its answer.
  void Close();

 private:
  // Moves n bytes, `step` moving some after the first `done` (an SSL_*_ex call: 1 and *moved,
  // or a failure), waiting for the socket as OpenSSL asks.
  absl::Status Transfer(size_t n, const char* what,
                        absl::FunctionRef<int(size_t done, size_t* moved)> step);
  // The status of a failed SSL call that returned `result`, OK when waiting for the socket
  // helped (it then waited).
  absl::Status Retry(int result, const char* what);

  ssl_st* const ssl_;
  const int fd_;
  absl::Duration timeout_;
};

// Certificates and settings shared by every connection of one side. Thread-safe.
class TlsContext {
 public:
  // kInvalidArgument naming what does not parse or does not match (a key that is not the
  // certificate's, a CA without certificates).
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForServer(
      const TlsServerOptions& options);
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForClient(
      const TlsClientOptions& options);
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  ~TlsContext();

  // The server's handshake on accepted socket `fd` (made non-blocking), at most `timeout`
  // without progress. kUnauthenticated naming the reason when the client or its certificate is
  // refused, kUnavailable when the connection broke, kDeadlineExceeded on timeout. A failed
  // handshake has told the client why (an alert) where TLS allows.
  absl::StatusOr<std::unique_ptr<TlsStream>> Accept(int fd, absl::Duration timeout) const;
  // The client's handshake on connected socket `fd` (made non-blocking) to `host` (a name or an
  // IP literal: the certificate must name it, unless options.server_name does instead); errors
  // as Accept's. Under TLS 1.3 a server that refuses this client's certificate says so only at
  // the first read.
  absl::StatusOr<std::unique_ptr<TlsStream>> Connect(int fd, const std::string& host,
                                                     absl::Duration timeout) const;

 private:
  TlsContext(ssl_ctx_st* ctx, bool server, std::string server_name)
      : ctx_(ctx), server_(server), server_name_(std::move(server_name)) {}
  absl::StatusOr<std::unique_ptr<TlsStream>> Handshake(int fd, const std::string& host,
                                                       absl::Duration timeout) const;

  ssl_ctx_st* const ctx_;
  const bool server_;
  const std::string server_name_;
};

}  // namespace aloe
