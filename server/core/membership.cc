#include "server/core/membership.h"

#include "absl/strings/str_format.h"

namespace aloe::server {

uint64_t Membership::Join(const std::string& name, v1::Role role) {
  Member m;
  m.id = next_id_++;
  m.name = name;
  m.role = role == v1::ROLE_UNSPECIFIED ? v1::ROLE_TRAINER : role;
  m.joined = clock_.Now();
  m.lease_expiry = m.joined + lease_;
  members_[m.id] = m;
  return m.id;
}

absl::Status Membership::Renew(uint64_t id, double steps_per_second) {
  auto it = members_.find(id);
  if (it == members_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "worker %d is not a member (never joined, left, or its lease expired)", id));
  }
  it->second.lease_expiry = clock_.Now() + lease_;
  if (steps_per_second > 0) it->second.steps_per_second = steps_per_second;
  return absl::OkStatus();
}

absl::Status Membership::Leave(uint64_t id) {
  if (members_.erase(id) == 0) {
    return absl::NotFoundError(absl::StrFormat("worker %d is not a member", id));
  }
  ++left_total_;
  return absl::OkStatus();
}

std::vector<uint64_t> Membership::ExpireLeases() {
  const absl::Time now = clock_.Now();
  std::vector<uint64_t> expired;
  for (auto it = members_.begin(); it != members_.end();) {
    if (it->second.lease_expiry <= now) {
      expired.push_back(it->first);
      it = members_.erase(it);
      ++expired_total_;
    } else {
      ++it;
    }
  }
  return expired;
}

const Member* Membership::Find(uint64_t id) const {
  auto it = members_.find(id);
  return it == members_.end() ? nullptr : &it->second;
}

std::vector<uint64_t> Membership::LiveIds(v1::Role role) const {
  std::vector<uint64_t> ids;
  for (const auto& [id, m] : members_) {
    if (m.role == role) ids.push_back(id);
  }
  return ids;
}

}  // namespace aloe::server
