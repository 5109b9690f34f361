#include "worker/inner_state_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "common/durable_file.h"
#include "common/status_matchers.h"

namespace aloe::worker {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

InnerState Sample() {
  return InnerState{/*steps=*/42, {{1.5f, -2.0f, 3.25f}, {}}, {{0.5f, 4.0f, 1e-8f}, {}}};
}

std::string Dir(const std::string& name) {
  return ::testing::TempDir() + "/inner_state_store_" + name + "_" + std::to_string(getpid());
}

TEST(InnerStateStoreTest, RoundTripsExactly) {
  const InnerStateStore store(Dir("round_trip"), {0xABCD, 1, 2});
  EXPECT_THAT(store.path(), HasSubstr("/inner-state-1-of-2.aloeinner"));
  EXPECT_THAT(store.Load().status(), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  ASSERT_THAT(store.Save(Sample()), IsOk());
  absl::StatusOr<InnerState> loaded = store.Load();
  ASSERT_THAT(loaded.status(), IsOk());
  EXPECT_EQ(loaded->steps, 42u);
  EXPECT_THAT(loaded->first, ElementsAre(ElementsAre(1.5f, -2.0f, 3.25f), ElementsAre()));
  EXPECT_THAT(loaded->second, ElementsAre(ElementsAre(0.5f, 4.0f, 1e-8f), ElementsAre()));
}

TEST(InnerStateStoreTest, EncodingIsTheDocumentedLayout) {
  const InnerState state{7, {{2.0f}}, {{3.0f}}};
  const std::string bytes = EncodeInnerState({9, 0, 1}, state);
  // magic 8 | format, rank, ranks, digest 4 x 4 | steps 8 | layers 4 | n 8 | 2 floats | crc 4
  ASSERT_EQ(bytes.size(), 8u + 16 + 8 + 4 + 8 + 8 + 4);
  EXPECT_EQ(bytes.substr(0, 8), "ALOEINNR");
  EXPECT_EQ(bytes[8], 1);   // format
  EXPECT_EQ(bytes[20], 9);  // digest
  EXPECT_EQ(bytes[24], 7);  // steps
}

TEST(InnerStateStoreTest, DamagedOrTruncatedFilesAreRefusedNamingTheFile) {
  const InnerStateOwner owner{5, 0, 1};
  const std::string bytes = EncodeInnerState(owner, Sample());
  std::string flipped = bytes;
  flipped[40] ^= 0x10;
  EXPECT_THAT(DecodeInnerState(flipped, owner, "f.aloeinner").status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("f.aloeinner"), HasSubstr("checksum"))));
  for (size_t cut : {size_t{0}, size_t{7}, size_t{30}, bytes.size() - 1}) {
    EXPECT_THAT(DecodeInnerState(bytes.substr(0, cut), owner, "f.aloeinner").status(),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("f.aloeinner")))
        << "cut at " << cut;
  }
  std::string other = bytes;
  other[0] = 'X';
  EXPECT_THAT(DecodeInnerState(other, owner, "f").status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad magic")));
}

TEST(InnerStateStoreTest, AStateOfAnotherModelOrRankIsRefused) {
  const std::string bytes = EncodeInnerState({5, 0, 2}, Sample());
  EXPECT_THAT(DecodeInnerState(bytes, {6, 0, 2}, "f").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another model")));
  EXPECT_THAT(DecodeInnerState(bytes, {5, 1, 2}, "f").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("saved by rank 0 of 2, this is rank 1 of 2")));
  EXPECT_THAT(DecodeInnerState(bytes, {5, 0, 1}, "f").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
}

TEST(InnerStateStoreTest, SpecDigestFollowsNamesAndShapes) {
  v1::ModelSpec a;
  v1::TensorSpec* t = a.add_layers()->add_tensors();
  t->set_name("w");
  t->add_shape(2);
  t->add_shape(3);
  v1::ModelSpec b = a;
  EXPECT_EQ(ModelSpecDigest(a), ModelSpecDigest(b));
  b.mutable_layers(0)->mutable_tensors(0)->set_shape(1, 4);
  EXPECT_NE(ModelSpecDigest(a), ModelSpecDigest(b));
  v1::ModelSpec c = a;
  c.mutable_layers(0)->mutable_tensors(0)->set_name("v");
  EXPECT_NE(ModelSpecDigest(a), ModelSpecDigest(c));
  // The same tensors split into two layers are another model's transfer units.
  v1::ModelSpec d;
  d.add_layers()->add_tensors()->CopyFrom(a.layers(0).tensors(0));
  d.add_layers();
  EXPECT_NE(ModelSpecDigest(a), ModelSpecDigest(d));
}

}  // namespace
}  // namespace aloe::worker
