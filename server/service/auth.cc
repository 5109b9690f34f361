#include "server/service/auth.h"

#include <fstream>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace aloe::server {

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromTokenFile(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrFormat("token file %s: cannot open", path));
  auto auth = std::make_unique<Authenticator>();
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    std::vector<std::string> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrFormat("token file %s line %d: expected 'identity token', got %d fields", path,
                          number, fields.size()));
    }
    if (fields[1].size() < 16) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token file %s line %d: token of identity %s is shorter than 16 characters", path, number,
          fields[0]));
    }
    if (!auth->tokens_.emplace(fields[1], fields[0]).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("token file %s line %d: duplicate token", path, number));
    }
  }
  if (auth->tokens_.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("token file %s has no tokens", path));
  }
  return auth;
}

absl::StatusOr<std::string> Authenticator::Identify(const grpc::ServerContext& context) const {
  if (!enabled()) return std::string();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kTokenMetadata);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("missing x-aloe-token metadata (see --token_file)");
  }
  return IdentifyToken(std::string_view(it->second.data(), it->second.size()));
}

bool Authenticator::HasIdentity(const std::string& identity) const {
  for (const auto& [token, who] : tokens_) {
    if (who == identity) return true;
  }
  return false;
}

absl::StatusOr<std::string> Authenticator::IdentifyToken(std::string_view token) const {
  if (!enabled()) return std::string();
  if (token.empty()) return absl::UnauthenticatedError("missing token (see --token_file)");
  auto found = tokens_.find(std::string(token));
  if (found == tokens_.end()) return absl::UnauthenticatedError("unknown token");
  return found->second;
}

void Authenticator::Bind(uint64_t worker_id, const std::string& identity) {
  absl::MutexLock lock(&mu_);
  owners_[worker_id] = identity;
}

absl::Status Authenticator::CheckOwner(uint64_t worker_id, const std::string& identity) const {
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(worker_id);
  if (it == owners_.end() || it->second == identity) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrFormat(
      "worker %d belongs to identity \"%s\", not \"%s\"", worker_id, it->second, identity));
}

std::string Authenticator::OwnerOf(uint64_t worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(worker_id);
  return it == owners_.end() ? "" : it->second;
}

}  // namespace aloe::server
