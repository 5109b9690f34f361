#include "server/core/membership.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/status_matchers.h"

namespace aloe::server {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::ElementsAre;

TEST(MembershipTest, LeasesExpireUnlessRenewed) {
  FakeClock clock;
  Membership members(clock, absl::Seconds(10));
  const uint64_t a = members.Join("a", v1::ROLE_TRAINER);
  const uint64_t b = members.Join("b", v1::ROLE_TRAINER);
  const uint64_t e = members.Join("e", v1::ROLE_EVALUATOR);
  EXPECT_NE(a, b);
  EXPECT_THAT(members.LiveIds(v1::ROLE_TRAINER), ElementsAre(a, b));
  EXPECT_THAT(members.LiveIds(v1::ROLE_EVALUATOR), ElementsAre(e));

  clock.Advance(absl::Seconds(9));
  ASSERT_THAT(members.Renew(a, 3.5), IsOk());
  EXPECT_DOUBLE_EQ(members.Find(a)->steps_per_second, 3.5);
  EXPECT_TRUE(members.ExpireLeases().empty());
  clock.Advance(absl::Seconds(1));  // b and e reach their expiry exactly
  EXPECT_THAT(members.ExpireLeases(), ElementsAre(b, e));
  EXPECT_EQ(members.Find(b), nullptr);
  EXPECT_THAT(members.Renew(b, 0), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(members.expired_total(), 2u);

  ASSERT_THAT(members.Leave(a), IsOk());
  EXPECT_THAT(members.Leave(a), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_EQ(members.size(), 0u);
  // Ids are never reused.
  EXPECT_GT(members.Join("c", v1::ROLE_TRAINER), e);
}

}  // namespace
}  // namespace aloe::server
