#include "common/tls_stream.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace aloe {
namespace {

// How much the reader's socket reads ahead of the record it decrypts: many records per recv().
constexpr int kReadAheadBytes = 256 << 10;

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;
using CtxPtr = std::unique_ptr<SSL_CTX, CtxFree>;

// The reasons OpenSSL queued on this thread, oldest first, and clears them; `fallback` when none.
std::string TakeErrors(const char* fallback) {
  std::string reasons;
  while (const unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    char buffer[256];
    if (reason == nullptr) {
      ERR_error_string_n(e, buffer, sizeof(buffer));
      reason = buffer;
    }
    if (reasons.find(reason) == std::string::npos) {
      absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", reason);
    }
  }
  return reasons.empty() ? std::string(fallback) : reasons;
}

BioPtr MemoryBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate of PEM text `pem`; kInvalidArgument naming `what` when there is none.
absl::StatusOr<std::vector<X509Ptr>> ReadCertificates(const std::string& pem, const char* what) {
  BioPtr bio = MemoryBio(pem);
  std::vector<X509Ptr> certificates;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certificates.emplace_back(x);
  }
  ERR_clear_error();  // the read past the last certificate
  if (certificates.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS: ", what, " holds no PEM certificate"));
  }
  return certificates;
}

// Presents certificate chain `cert_pem` with key `key_pem`.
absl::Status UseCertificate(SSL_CTX* ctx, const std::string& cert_pem, const std::string& key_pem) {
  ALOE_ASSIGN_OR_RETURN(std::vector<X509Ptr> chain, ReadCertificates(cert_pem, "the certificate"));
  if (SSL_CTX_use_certificate(ctx, chain[0].get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: the certificate: ", TakeErrors("refused")));
  }
  for (size_t i = 1; i < chain.size(); ++i) {
    if (SSL_CTX_add1_chain_cert(ctx, chain[i].get()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS: the certificate chain: ", TakeErrors("refused")));
    }
  }
  BioPtr bio = MemoryBio(key_pem);
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: the private key does not parse: ", TakeErrors("no PEM key")));
  }
  if (SSL_CTX_use_PrivateKey(ctx, key.get()) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: the private key is not the certificate's: ", TakeErrors("mismatch")));
  }
  return absl::OkStatus();
}

// Trusts the certificates of `ca_pem` (each one an anchor, as gRPC's roots are); a server also
// names them to clients as the issuers it accepts.
absl::Status TrustCertificates(SSL_CTX* ctx, const std::string& ca_pem, const char* what,
                               bool name_to_clients) {
  ALOE_ASSIGN_OR_RETURN(std::vector<X509Ptr> certificates, ReadCertificates(ca_pem, what));
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  for (const X509Ptr& x : certificates) {
    if (X509_STORE_add_cert(store, x.get()) != 1 ||
        (name_to_clients && SSL_CTX_add_client_CA(ctx, x.get()) != 1)) {
      return absl::InvalidArgumentError(absl::StrCat("TLS: ", what, ": ", TakeErrors("refused")));
    }
  }
  X509_STORE_set_flags(store, X509_V_FLAG_PARTIAL_CHAIN);
  return absl::OkStatus();
}

// A context with the settings both sides share: TLS 1.3 only, no session resumption, large reads
// and writes.
absl::StatusOr<CtxPtr> NewContext(bool server) {
  CtxPtr ctx(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()));
  if (ctx == nullptr) {
    return absl::InternalError(absl::StrCat("TLS: ", TakeErrors("cannot create a context")));
  }
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(ctx.get(), TLS1_3_VERSION);
  // Every push frames its own length, so a connection cut without close_notify is no truncation
  // that could pass unnoticed: it reads as a closed connection.
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_TICKET | SSL_OP_IGNORE_UNEXPECTED_EOF);
  SSL_CTX_set_session_cache_mode(ctx.get(), SSL_SESS_CACHE_OFF);
  if (server) SSL_CTX_set_num_tickets(ctx.get(), 0);
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_read_ahead(ctx.get(), 1);
  SSL_CTX_set_default_read_buffer_len(ctx.get(), kReadAheadBytes);
  return ctx;
}

absl::Status MakeNonBlocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return absl::UnavailableError(absl::StrFormat("raw push: fcntl: %s", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

TlsStream::~TlsStream() { SSL_free(ssl_); }

absl::Status TlsStream::Retry(int result, const char* what) {
  const int error = SSL_get_error(ssl_, result);
  switch (error) {
    case SSL_ERROR_WANT_READ:
      return WaitForSocket(fd_, POLLIN, timeout_);
    case SSL_ERROR_WANT_WRITE:
      return WaitForSocket(fd_, POLLOUT, timeout_);
    case SSL_ERROR_ZERO_RETURN:
      return absl::UnavailableError("raw push: the connection was closed");
    case SSL_ERROR_SYSCALL:
      if (ERR_peek_error() == 0) {
        return absl::UnavailableError(
            errno == 0 ? std::string("raw push: the connection was closed")
                       : absl::StrFormat("raw push: %s: %s", what, std::strerror(errno)));
      }
      [[fallthrough]];
    default:
      return absl::UnavailableError(
          absl::StrCat("raw push: TLS ", what, ": ", TakeErrors("failed")));
  }
}

absl::Status TlsStream::Transfer(size_t n, const char* what,
                                 absl::FunctionRef<int(size_t done, size_t* moved)> step) {
  for (size_t done = 0; done < n;) {
    ERR_clear_error();
    errno = 0;
    size_t moved = 0;
    const int r = step(done, &moved);
    if (r == 1) {
      done += moved;
      continue;
    }
    ALOE_RETURN_IF_ERROR(Retry(r, what));
  }
  return absl::OkStatus();
}

absl::Status TlsStream::ReadExactly(char* out, size_t n) {
  return Transfer(n, "read", [&](size_t done, size_t* moved) {
    return SSL_read_ex(ssl_, out + done, std::min<size_t>(n - done, INT_MAX), moved);
  });
}

absl::Status TlsStream::WriteAll(const char* data, size_t n) {
  return Transfer(n, "write", [&](size_t done, size_t* moved) {
    return SSL_write_ex(ssl_, data + done, std::min<size_t>(n - done, INT_MAX), moved);
  });
}

std::string TlsStream::protocol() const { return SSL_get_version(ssl_); }

bool TlsStream::HasBuffered() const { return SSL_has_pending(ssl_) == 1; }

void TlsStream::Close() {
  ERR_clear_error();
  SSL_shutdown(ssl_);
  ERR_clear_error();
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForServer(
    const TlsServerOptions& options) {
  ALOE_ASSIGN_OR_RETURN(CtxPtr ctx, NewContext(/*server=*/true));
  ALOE_RETURN_IF_ERROR(UseCertificate(ctx.get(), options.cert_pem, options.key_pem));
  if (!options.client_ca_pem.empty()) {
    ALOE_RETURN_IF_ERROR(TrustCertificates(ctx.get(), options.client_ca_pem, "the client CA",
                                           /*name_to_clients=*/true));
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return std::shared_ptr<const TlsContext>(new TlsContext(ctx.release(), true, ""));
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForClient(
    const TlsClientOptions& options) {
  ALOE_ASSIGN_OR_RETURN(CtxPtr ctx, NewContext(/*server=*/false));
  ALOE_RETURN_IF_ERROR(TrustCertificates(ctx.get(), options.ca_pem, "the CA",
                                         /*name_to_clients=*/false));
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  if (!options.cert_pem.empty()) {
    ALOE_RETURN_IF_ERROR(UseCertificate(ctx.get(), options.cert_pem, options.key_pem));
  }
  return std::shared_ptr<const TlsContext>(
      new TlsContext(ctx.release(), false, options.server_name));
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

absl::StatusOr<std::unique_ptr<TlsStream>> TlsContext::Accept(int fd,
                                                              absl::Duration timeout) const {
  return Handshake(fd, "", timeout);
}

absl::StatusOr<std::unique_ptr<TlsStream>> TlsContext::Connect(int fd, const std::string& host,
                                                               absl::Duration timeout) const {
  return Handshake(fd, server_name_.empty() ? host : server_name_, timeout);
}

absl::StatusOr<std::unique_ptr<TlsStream>> TlsContext::Handshake(int fd, const std::string& name,
                                                                 absl::Duration timeout) const {
  ALOE_RETURN_IF_ERROR(MakeNonBlocking(fd));
  SSL* ssl = SSL_new(ctx_);
  if (ssl == nullptr) {
    return absl::InternalError(absl::StrCat("TLS: ", TakeErrors("cannot start a session")));
  }
  auto stream = std::make_unique<TlsStream>(ssl, fd, timeout);  // owns ssl from here
  SSL_set_fd(ssl, fd);
  if (!server_) {
    // The certificate must name `name`: as an IP address for a literal, else as a DNS name
    // (which goes out as SNI too).
    unsigned char ip[16];
    const bool literal =
        inet_pton(AF_INET, name.c_str(), ip) == 1 || inet_pton(AF_INET6, name.c_str(), ip) == 1;
    X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
    const bool named = literal ? X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) == 1
                               : SSL_set1_host(ssl, name.c_str()) == 1 &&
                                     SSL_set_tlsext_host_name(ssl, name.c_str()) == 1;
    if (!named) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS: cannot verify the server as \"", name, "\": ", TakeErrors("refused")));
    }
  }
  while (true) {
    ERR_clear_error();
    errno = 0;
    const int r = server_ ? SSL_accept(ssl) : SSL_connect(ssl);
    if (r == 1) return stream;
    const int error = SSL_get_error(ssl, r);
    if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) {
      ALOE_RETURN_IF_ERROR(
          WaitForSocket(fd, error == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, timeout));
      continue;
    }
    if (error == SSL_ERROR_SSL) {
      std::string reason = TakeErrors("failed");
      const long verified = SSL_get_verify_result(ssl);
      if (verified != X509_V_OK) {
        absl::StrAppend(&reason, " (", X509_verify_cert_error_string(verified), ")");
      }
      return absl::UnauthenticatedError(absl::StrCat("TLS handshake: ", reason));
    }
    return absl::UnavailableError(absl::StrCat(
        "TLS handshake: ", errno != 0 ? std::strerror(errno) : "the connection was closed"));
  }
}

}  // namespace aloe
