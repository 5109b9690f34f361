// Shared-token authentication with per-worker identities. Every RPC carries metadata
// "x-aloe-token"; a token file maps tokens to identities ("identity token" per line). The
// identity that joined a worker id owns it: any later call naming that worker id from another
// identity is refused. Without a token file every caller is the anonymous identity "".
// Thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace aloe::server {

inline constexpr char kTokenMetadata[] = "x-aloe-token";

class Authenticator {
 public:
  // No authentication: everybody is "".
  Authenticator() = default;
  // kNotFound for a missing file, kInvalidArgument naming the line for a malformed one or a
  // duplicate token, and for a file without tokens.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromTokenFile(const std::string& path);

  bool enabled() const { return !tokens_.empty(); }
  // Whether some token maps to `identity`.
  bool HasIdentity(const std::string& identity) const;

  // The caller's identity; kUnauthenticated for a missing or unknown token.
  absl::StatusOr<std::string> Identify(const grpc::ServerContext& context) const;
  // The same for a token carried outside gRPC metadata (a raw push, common/raw_push.h).
  absl::StatusOr<std::string> IdentifyToken(std::string_view token) const;

  // Records that `identity` owns worker `worker_id` (after a Join).
  void Bind(uint64_t worker_id, const std::string& identity);
  // kPermissionDenied when worker_id belongs to another identity. Unknown ids pass (the core
  // answers NOT_FOUND for them).
  absl::Status CheckOwner(uint64_t worker_id, const std::string& identity) const;
  // The identity that joined worker_id; "" when none did (or without a token file).
  std::string OwnerOf(uint64_t worker_id) const;

 private:
  std::map<std::string, std::string> tokens_;  // token -> identity; read-only after load
  mutable absl::Mutex mu_;
  std::map<uint64_t, std::string> owners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace aloe::server
