#include "common/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace aloe {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(ByteTokenizerTest, MapsEachByteToItsUnsignedValue) {
  ByteTokenizer tokenizer;
  EXPECT_THAT(tokenizer.Encode("Hi!"), ElementsAre(72, 105, 33));
}

TEST(ByteTokenizerTest, HighBytesAreNotSignExtended) {
  ByteTokenizer tokenizer;
  // "é" in UTF-8 is C3 A9; plain char is signed on x86, so a naive cast would give negatives.
  EXPECT_THAT(tokenizer.Encode("\xc3\xa9\xff"), ElementsAre(0xc3, 0xa9, 0xff));
}

TEST(ByteTokenizerTest, KeepsNulAndControlBytes) {
  ByteTokenizer tokenizer;
  EXPECT_THAT(tokenizer.Encode(std::string("a\0\n", 3)), ElementsAre(97, 0, 10));
}

TEST(ByteTokenizerTest, EmptyTextGivesNoTokens) {
  EXPECT_THAT(ByteTokenizer().Encode(""), IsEmpty());
}

TEST(ByteTokenizerTest, EveryTokenIsBelowVocabSize) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  ByteTokenizer tokenizer;
  const std::vector<uint32_t> ids = tokenizer.Encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(ids[b], static_cast<uint32_t>(b));
    EXPECT_LT(ids[b], tokenizer.vocab_size());
  }
}

TEST(ByteTokenizerTest, DescribesItselfThroughTheInterface) {
  std::unique_ptr<Tokenizer> tokenizer = std::make_unique<ByteTokenizer>();
  EXPECT_EQ(tokenizer->vocab_size(), 256u);
  EXPECT_EQ(tokenizer->name(), "byte");
  EXPECT_THAT(tokenizer->Encode("A"), ElementsAre(65));
}

}  // namespace
}  // namespace aloe
