// Worker membership with leases. A worker joins, renews its lease with heartbeats, and leaves;
// one whose lease runs out is dropped by ExpireLeases. Time comes from the injected Clock.
// Not thread-safe: the owner serialises calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/aloe.pb.h"

namespace aloe::server {

// Whether a member of `role` trains (ROLE_UNSPECIFIED means trainer); evaluators and observers
// do not.
inline bool IsTrainerRole(v1::Role role) {
  return role == v1::ROLE_TRAINER || role == v1::ROLE_UNSPECIFIED;
}

struct Member {
  uint64_t id = 0;
  std::string name;
  v1::Role role = v1::ROLE_TRAINER;
  absl::Time joined;
  absl::Time lease_expiry;
  double steps_per_second = 0;  // last reported, 0 = unknown
};

class Membership {
 public:
  // `clock` must outlive this.
  Membership(const Clock& clock, absl::Duration lease) : clock_(clock), lease_(lease) {}

  // Adds a member with a fresh lease and returns its id (ids are never reused).
  uint64_t Join(const std::string& name, v1::Role role);
  // Renews the lease. kNotFound when the worker is unknown (never joined, left or expired).
  absl::Status Renew(uint64_t id, double steps_per_second);
  // kNotFound when unknown.
  absl::Status Leave(uint64_t id);
  // Drops every member whose lease expired; returns their ids.
  std::vector<uint64_t> ExpireLeases();

  const Member* Find(uint64_t id) const;
  std::vector<uint64_t> LiveIds(v1::Role role) const;
  size_t size() const { return members_.size(); }
  absl::Duration lease() const { return lease_; }

  uint64_t next_id() const { return next_id_; }
  // After a restart: ids keep increasing past those handed out before it.
  void set_next_id(uint64_t id) { next_id_ = std::max(next_id_, id); }
  uint64_t joined_total() const { return next_id_ - 1; }
  uint64_t left_total() const { return left_total_; }
  uint64_t expired_total() const { return expired_total_; }

 private:
  const Clock& clock_;
  const absl::Duration lease_;
  uint64_t next_id_ = 1;
  uint64_t left_total_ = 0;
  uint64_t expired_total_ = 0;
  std::map<uint64_t, Member> members_;
};

}  // namespace aloe::server
