// Status propagation helpers. Debian's Abseil (20220623) has absl::Status/StatusOr but no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN; these are ours, prefixed to stay clear of glog macros.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ALOE_CONCAT_INNER_(a, b) a##b
#define ALOE_CONCAT_(a, b) ALOE_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define ALOE_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status aloe_status_ = (expr);        \
    if (!aloe_status_.ok()) return aloe_status_; \
  } while (false)

// `lhs = value of expr` when expr (an absl::StatusOr<T>) is OK, otherwise returns its status.
#define ALOE_ASSIGN_OR_RETURN(lhs, expr) \
  ALOE_ASSIGN_OR_RETURN_IMPL_(ALOE_CONCAT_(aloe_statusor_, __LINE__), lhs, expr)
#define ALOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
