// gMock matchers for absl::Status / absl::StatusOr (Debian's Abseil has none):
//   EXPECT_THAT(s, IsOk());
//   EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer")));
#pragma once

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace aloe::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s.ToString();
  return s.ok();
}

MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

}  // namespace aloe::testing
