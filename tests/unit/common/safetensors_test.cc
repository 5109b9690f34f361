#include "common/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/byte_io.h"
#include "common/model_spec.h"
#include "common/safetensors_model.h"
#include "common/status_matchers.h"

namespace aloe {
namespace {

using ::aloe::testing::IsOk;
using ::aloe::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A file as another writer would make it: `header` JSON, then `data`.
std::string File(const std::string& header, const std::string& data) {
  std::string out;
  AppendPod<uint64_t>(header.size(), &out);
  return out + header + data;
}

std::string Floats(std::initializer_list<float> values) {
  std::string out;
  for (float v : values) AppendPod<float>(v, &out);
  return out;
}

TEST(SafetensorsTest, EncodesTheDocumentedLayout) {
  const std::string bytes = EncodeSafetensors({{"a", {2}, {1.5f, -2.0f}}}, {{"k", "v"}});
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})");
  EXPECT_EQ(bytes.substr(8 + n), Floats({1.5f, -2.0f}));
}

TEST(SafetensorsTest, RoundTripsAndReadsOtherWritersOrderAndDtypes) {
  const SafetensorsFile mine =
      DecodeSafetensors(EncodeSafetensors({{"w", {2, 2}, {1, 2, 3, 4}}, {"b", {}, {7}}}, {}), "f")
          .value();
  ASSERT_EQ(mine.tensors.size(), 2u);
  EXPECT_EQ(mine.tensors[0].name, "w");
  EXPECT_THAT(mine.tensors[0].shape, ElementsAre(2, 2));
  EXPECT_THAT(mine.tensors[0].values, ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(mine.tensors[1].shape, ElementsAre());
  EXPECT_THAT(mine.tensors[1].values, ElementsAre(7));
  // BF16 1.5 = 0x3FC0, -2 = 0xC000; F16 1.5 = 0x3E00, 2^-24 (smallest subnormal) = 0x0001.
  std::string data;
  for (uint16_t h : {0x3FC0, 0xC000, 0x3E00, 0x0001}) AppendPod<uint16_t>(h, &data);
  const std::string header = R"({"h":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},)"
                             R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  const SafetensorsFile other = DecodeSafetensors(File(header, data), "f").value();
  ASSERT_EQ(other.tensors.size(), 2u);
  EXPECT_EQ(other.tensors[0].name, "b");  // data order
  EXPECT_THAT(other.tensors[0].values, ElementsAre(1.5f, -2.0f));
  EXPECT_THAT(other.tensors[1].values, ElementsAre(1.5f, std::ldexp(1.0f, -24)));
}

TEST(SafetensorsTest, MalformedFilesAreRefusedNamingTheFileTensorAndOffset) {
  const std::string good = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data = Floats({1, 2});
  struct Case {
    std::string bytes, expect;
  };
  const Case cases[] = {
      {"abc", "no 8-byte header length"},
      {File(good, data).substr(0, 20), "runs past the end"},
      {File(good, data).substr(0, 8 + good.size() + 5), "truncated: tensor t ends at byte"},
      {File("{not json", data), "does not parse"},
      {File(R"({"t":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", data), "dtype I64"},
      {File(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data),
       "shape [3] of F32 needs 12 bytes"},
      {File(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("u":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
            data),
       "tensor u: its data at byte"},
      {File(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", data),
       "not a whole number"},
      {File(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", data), "needs a string dtype"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(DecodeSafetensors(c.bytes, "model.safetensors").status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("model.safetensors: "), HasSubstr(c.expect))))
        << c.expect;
  }
}

TEST(SafetensorsTest, EmptyTensorsAtTheOffsetOfAnotherAreNotOverlaps) {
  // Writers put a tensor of no elements where the next one starts. Whatever order the header
  // lists them in, the file reads, empty tensors first at an offset, then by name.
  const std::string e0 = R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]})";
  const std::string x = R"("x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  const std::string d4 = R"("d":{"dtype":"BF16","shape":[2,0],"data_offsets":[4,4]})";
  const std::string c4 = R"("c":{"dtype":"F32","shape":[0],"data_offsets":[4,4]})";
  const std::string y = R"("y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})";
  for (const std::string& header : {absl::StrCat("{", x, ",", e0, ",", y, ",", d4, ",", c4, "}"),
                                    absl::StrCat("{", y, ",", c4, ",", d4, ",", e0, ",", x, "}")}) {
    const absl::StatusOr<SafetensorsFile> file =
        DecodeSafetensors(File(header, Floats({1, 2})), "f");
    ASSERT_THAT(file, IsOk()) << header;
    std::vector<std::string> names;
    for (const SafetensorsTensor& t : file->tensors) names.push_back(t.name);
    EXPECT_THAT(names, ElementsAre("e", "x", "c", "d", "y"));
    EXPECT_THAT(file->tensors[1].values, ElementsAre(1));
    EXPECT_THAT(file->tensors[3].values, ElementsAre());
    EXPECT_THAT(file->tensors[4].values, ElementsAre(2));
  }
}

TEST(SafetensorsTest, ConsecutiveEmptyTensorsReadByNameSoThatRewritingIsStable) {
  // Nothing with bytes lies between "z" at offset 0 and "a" at 4, so they read by name: ALOE's
  // writer puts both at one offset, and the rewritten file must read in the same order.
  const std::string header = R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                             R"("m":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                             R"("a":{"dtype":"F32","shape":[0,2],"data_offsets":[4,4]},)"
                             R"("b":{"dtype":"F32","shape":[3,0],"data_offsets":[0,0]}})";
  const absl::StatusOr<SafetensorsFile> file = DecodeSafetensors(File(header, Floats({1, 2})), "f");
  ASSERT_THAT(file, IsOk());
  std::vector<std::string> names;
  for (const SafetensorsTensor& t : file->tensors) names.push_back(t.name);
  EXPECT_THAT(names, ElementsAre("a", "b", "z", "m"));
  const std::string encoded = EncodeSafetensors(file->tensors, file->metadata);
  const absl::StatusOr<SafetensorsFile> back = DecodeSafetensors(encoded, "g");
  ASSERT_THAT(back, IsOk());
  std::vector<std::string> back_names;
  for (const SafetensorsTensor& t : back->tensors) back_names.push_back(t.name);
  EXPECT_EQ(back_names, names);
  EXPECT_EQ(EncodeSafetensors(back->tensors, back->metadata), encoded);
  EXPECT_THAT(back->tensors[3].values, ElementsAre(2));
}

TEST(SafetensorsTest, ShapesWhoseByteSizeWrapsAroundAreRefused) {
  // 2^31 * 2^31 floats are 2^64 bytes, which wrap to the 0 bytes of data_offsets [0, 0]; 2^32 *
  // 2^32 elements wrap to none. Neither may pass as an empty tensor or reach an allocation.
  for (const std::string shape : {"2147483648,2147483648", "4294967296,4294967296"}) {
    const std::string header =
        absl::StrCat(R"({"t":{"dtype":"F32","shape":[)", shape, R"(],"data_offsets":[0,0]}})");
    EXPECT_THAT(DecodeSafetensors(File(header, ""), "model.safetensors").status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("model.safetensors: tensor t: shape ["),
                               HasSubstr("needs more than 2^64 bytes"))))
        << shape;
  }
  EXPECT_THAT(WriteSafetensors(::testing::TempDir() + "/st_wraps.safetensors",
                               {{"t", {int64_t{1} << 32, int64_t{1} << 32}, {}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("0 values for shape [4294967296, 4294967296]")));
}

TEST(SafetensorsTest, WriterRefusesDuplicateNamesAndValuesThatMissTheShape) {
  const std::string path = ::testing::TempDir() + "/st_refused.safetensors";
  EXPECT_THAT(WriteSafetensors(path, {{"a", {1}, {1}}, {"a", {1}, {2}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"a\"")));
  EXPECT_THAT(WriteSafetensors(path, {{"a", {2, 2}, {1, 2, 3}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 values for shape [2, 2]")));
}

v1::TransformerConfig Tiny() {
  v1::TransformerConfig c;
  c.set_vocab_size(16);
  c.set_seq_len(4);
  c.set_d_model(8);
  c.set_num_layers(2);
  c.set_num_heads(2);
  FillTransformerDefaults(&c);
  return c;
}

TEST(SafetensorsModelTest, Gpt2StyleNamesOfTheBuiltInTransformer) {
  EXPECT_EQ(Gpt2StyleName("tok_emb.weight"), "transformer.wte.weight");
  EXPECT_EQ(Gpt2StyleName("pos_emb.weight"), "transformer.wpe.weight");
  EXPECT_EQ(Gpt2StyleName("blocks.11.attn.qkv.weight"), "transformer.h.11.attn.c_attn.weight");
  EXPECT_EQ(Gpt2StyleName("blocks.0.attn.proj.bias"), "transformer.h.0.attn.c_proj.bias");
  EXPECT_EQ(Gpt2StyleName("blocks.1.ln2.weight"), "transformer.h.1.ln_2.weight");
  EXPECT_EQ(Gpt2StyleName("blocks.1.mlp.fc1.weight"), "transformer.h.1.mlp.c_fc.weight");
  EXPECT_EQ(Gpt2StyleName("blocks.1.mlp.fc2.bias"), "transformer.h.1.mlp.c_proj.bias");
  EXPECT_EQ(Gpt2StyleName("ln_f.bias"), "transformer.ln_f.bias");
  EXPECT_EQ(Gpt2StyleName("head.weight"), "lm_head.weight");
  EXPECT_EQ(Gpt2StyleName("encoder.weight"), "");
  EXPECT_EQ(Gpt2StyleName("blocks.x.ln1.weight"), "");
  // Every tensor of the built-in spec has one, and no two share it.
  std::set<std::string> seen;
  const v1::ModelSpec spec = BuildTransformerSpec(Tiny(), 1);
  for (const auto& layer : spec.layers()) {
    for (const auto& t : layer.tensors()) {
      const std::string name = Gpt2StyleName(t.name());
      EXPECT_FALSE(name.empty()) << t.name();
      EXPECT_TRUE(seen.insert(name).second) << name;
    }
  }
}

TEST(SafetensorsModelTest, ExportedTensorsSetTheInitialParametersBack) {
  const v1::ModelSpec spec = BuildTransformerSpec(Tiny(), 1);
  const std::vector<std::vector<float>> params = InitializeParameters(spec, 5);
  for (const bool gpt2 : {true, false}) {
    const std::vector<SafetensorsTensor> tensors = ModelTensors(spec, params, gpt2).value();
    EXPECT_EQ(tensors.front().name, gpt2 ? "transformer.wte.weight" : "tok_emb.weight");
    const SafetensorsFile file = DecodeSafetensors(EncodeSafetensors(tensors, {}), "f").value();
    std::vector<std::vector<float>> initial = InitializeParameters(spec, 6);
    ASSERT_THAT(SetInitialParameters(file, "f", spec, &initial), IsOk());
    EXPECT_EQ(initial, params);
  }
}

TEST(SafetensorsModelTest, AFileThatDoesNotFitTheModelChangesNothing) {
  const v1::ModelSpec spec = BuildTransformerSpec(Tiny(), 1);
  const std::vector<std::vector<float>> params = InitializeParameters(spec, 5);
  const std::vector<SafetensorsTensor> tensors = ModelTensors(spec, params, true).value();
  const auto refused = [&](std::vector<SafetensorsTensor> edited) {
    std::vector<std::vector<float>> initial = InitializeParameters(spec, 6);
    const std::vector<std::vector<float>> before = initial;
    const absl::Status s =
        SetInitialParameters(DecodeSafetensors(EncodeSafetensors(edited, {}), "f").value(),
                             "init.safetensors", spec, &initial);
    EXPECT_EQ(initial, before);
    return s;
  };
  std::vector<SafetensorsTensor> missing = tensors;
  missing.erase(missing.begin() + 3);
  EXPECT_THAT(refused(missing),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("init.safetensors"), HasSubstr("no tensor"))));
  std::vector<SafetensorsTensor> extra = tensors;
  extra.push_back({"rotary.freqs", {2}, {1, 2}});
  EXPECT_THAT(refused(extra), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("rotary.freqs is not one of the model's")));
  std::vector<SafetensorsTensor> reshaped = tensors;
  reshaped[0].shape = {8, 16};
  EXPECT_THAT(refused(reshaped),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("transformer.wte.weight has shape [8, 16], the model [16, 8]")));
  std::vector<SafetensorsTensor> nan = tensors;
  nan[1].values[3] = std::nanf("");
  EXPECT_THAT(refused(nan),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at element 3")));
  std::vector<SafetensorsTensor> twice = tensors;
  twice.push_back(twice[0]);
  twice.back().name = "tok_emb.weight";
  EXPECT_THAT(refused(twice),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("there twice")));
}

TEST(SafetensorsModelTest, ConfigJsonNamesTheSizes) {
  const std::string json = TransformerConfigJson(Tiny());
  EXPECT_THAT(json, HasSubstr("\"n_layer\": 2,"));
  EXPECT_THAT(json, HasSubstr("\"n_embd\": 8,"));
  EXPECT_THAT(json, HasSubstr("\"n_inner\": 32,"));
  EXPECT_THAT(json, HasSubstr("\"block_size\": 4,"));
  EXPECT_THAT(json, HasSubstr("\"vocab_size\": 16,"));
}

}  // namespace
}  // namespace aloe
