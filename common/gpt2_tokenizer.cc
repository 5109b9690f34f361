#include "common/gpt2_tokenizer.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/durable_file.h"
#include "common/json_reader.h"
#include "common/status_macros.h"

namespace aloe {
namespace {

enum class CodePointClass : uint8_t { kOther, kLetter, kNumber, kSpace };

struct CodePointRange {
  uint32_t first;
  uint32_t last;
  CodePointClass cls;
};

constexpr CodePointRange kLetterNumberRanges[] = {
#include "common/unicode_classes.inc"
};

// The Unicode White_Space property.
bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
         cp == 0x205f || cp == 0x3000;
}

CodePointClass Classify(uint32_t cp) {
  if (IsWhiteSpace(cp)) return CodePointClass::kSpace;
  if (cp < 0x80) {
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CodePointClass::kLetter;
    if (cp >= '0' && cp <= '9') return CodePointClass::kNumber;
    return CodePointClass::kOther;
  }
  const auto* end = std::end(kLetterNumberRanges);
  const auto* it =
      std::upper_bound(std::begin(kLetterNumberRanges), end, cp,
                       [](uint32_t c, const CodePointRange& r) { return c < r.first; });
  if (it == std::begin(kLetterNumberRanges)) return CodePointClass::kOther;
  --it;
  return cp <= it->last ? it->cls : CodePointClass::kOther;
}

// One decoded character: its code point (U+FFFD for a byte that starts no valid UTF-8
// sequence), where it starts in the text and how many bytes it spans.
struct Char {
  uint32_t cp;
  size_t offset;
  size_t length;
};

std::vector<Char> DecodeUtf8(std::string_view s) {
  std::vector<Char> chars;
  chars.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char b = p[i];
    size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
    uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1f) : n == 3 ? (b & 0x0f) : (b & 0x07);
    bool valid = n != 0 && i + n <= s.size();
    for (size_t k = 1; valid && k < n; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) valid = false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are invalid too.
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (valid && (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))) valid = false;
    if (!valid) {
      chars.push_back({0xfffd, i, 1});
      ++i;
    } else {
      chars.push_back({cp, i, n});
      i += n;
    }
  }
  return chars;
}

// GPT-2's table from bytes to printable characters: the printable Latin-1 bytes map to
// themselves, the other 68 to U+0100 onwards in byte order.
void ByteToUnicode(uint32_t out[256]) {
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  };
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) out[b] = printable(b) ? b : next++;
}

// Maps a token written through the byte table back to its bytes; false when a character is not
// in the table.
bool UnmapToken(std::string_view mapped, const absl::flat_hash_map<uint32_t, uint8_t>& byte_of,
                std::string* bytes) {
  bytes->clear();
  for (const Char& c : DecodeUtf8(mapped)) {
    auto it = byte_of.find(c.cp);
    if (c.cp == 0xfffd || it == byte_of.end()) return false;
    bytes->push_back(static_cast<char>(it->second));
  }
  return true;
}

// Whether chars[i] starts a match of `c+` (optionally after one space) for class `cls`; if so,
// *end is the index after the run.
bool MatchRun(const std::vector<Char>& chars, const std::vector<CodePointClass>& cls, size_t i,
              CodePointClass want, size_t* end) {
  size_t j = i;
  if (chars[j].cp == ' ' && j + 1 < chars.size()) ++j;
  if (cls[j] != want) return false;
  while (j < chars.size() && cls[j] == want) ++j;
  *end = j;
  return true;
}

}  // namespace

std::vector<std::string_view> Gpt2PreTokenize(std::string_view text) {
  const std::vector<Char> chars = DecodeUtf8(text);
  std::vector<CodePointClass> cls(chars.size());
  for (size_t i = 0; i < chars.size(); ++i) cls[i] = Classify(chars[i].cp);
  std::vector<std::string_view> out;
  auto emit = [&](size_t first, size_t end) {
    const size_t from = chars[first].offset;
    const size_t to = end < chars.size() ? chars[end].offset : text.size();
    out.push_back(text.substr(from, to - from));
  };
  size_t i = 0;
  const size_t n = chars.size();
  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (chars[i].cp == '\'' && i + 1 < n) {
      const uint32_t a = chars[i + 1].cp;
      const uint32_t b = i + 2 < n ? chars[i + 2].cp : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        len = 2;
      } else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        len = 3;
      }
      if (len > 0) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    size_t end = 0;
    //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+
    if (MatchRun(chars, cls, i, CodePointClass::kLetter, &end) ||
        MatchRun(chars, cls, i, CodePointClass::kNumber, &end) ||
        MatchRun(chars, cls, i, CodePointClass::kOther, &end)) {
      emit(i, end);
      i = end;
      continue;
    }
    // \s+(?!\S) | \s+ : a run of space keeps its last character for the next word, unless it
    // ends the text or that would leave it empty.
    size_t k = i;
    while (k < n && cls[k] == CodePointClass::kSpace) ++k;
    if (k < n && k - i > 1) --k;
    emit(i, k);
    i = k;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::Load(const std::string& encoder_json,
                                                                   const std::string& vocab_bpe) {
  ALOE_ASSIGN_OR_RETURN(const std::string json, ReadWholeFile(encoder_json));
  ALOE_ASSIGN_OR_RETURN(const std::string bpe, ReadWholeFile(vocab_bpe));
  std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());

  uint32_t to_unicode[256];
  ByteToUnicode(to_unicode);
  absl::flat_hash_map<uint32_t, uint8_t> byte_of;
  for (int b = 0; b < 256; ++b) byte_of[to_unicode[b]] = static_cast<uint8_t>(b);

  std::vector<std::pair<std::string, uint32_t>> entries;
  JsonReader reader(encoder_json, json);
  ALOE_RETURN_IF_ERROR(reader.ReadObject([&](const std::string& key) {
    uint32_t id = 0;
    ALOE_RETURN_IF_ERROR(reader.ReadUint(&id));
    entries.emplace_back(key, id);
    return absl::OkStatus();
  }));
  reader.SkipSpace();
  if (!reader.AtEnd()) return reader.Error("trailing data after the object");
  uint32_t max_id = 0;
  for (const auto& [mapped, id] : entries) max_id = std::max(max_id, id);
  if (max_id >= (1u << 24)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: id %d is implausibly large for a vocabulary", encoder_json, max_id));
  }
  t->tokens_.assign(max_id + 1, std::string());
  std::vector<bool> seen(max_id + 1, false);
  absl::flat_hash_map<std::string, uint32_t> id_of;
  std::string bytes;
  for (const auto& [mapped, id] : entries) {
    if (!UnmapToken(mapped, byte_of, &bytes) || bytes.empty()) {
      // The special "<|endoftext|>" is plain printable ASCII, so every token unmaps.
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: token \"%s\" has a character outside GPT-2's byte table", encoder_json, mapped));
    }
    if (seen[id]) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: id %d is given to two tokens", encoder_json, id));
    }
    seen[id] = true;
    t->tokens_[id] = bytes;
    id_of.emplace(bytes, id);
  }
  t->vocab_size_ = max_id + 1;
  for (int b = 0; b < 256; ++b) {
    auto it = id_of.find(std::string(1, static_cast<char>(b)));
    if (it == id_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: no token for byte 0x%02x", encoder_json, b));
    }
    t->byte_ids_[b] = it->second;
  }

  uint32_t rank = 0;
  size_t next = 0;
  while (next < bpe.size()) {
    const size_t line_offset = next;
    size_t eol = bpe.find('\n', next);
    if (eol == std::string::npos) eol = bpe.size();
    std::string_view line(bpe.data() + next, eol - next);
    next = eol + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line_offset == 0 && !line.empty() && line.front() == '#') continue;  // "#version: 0.2"
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: byte offset %d: expected a merge \"A B\", got \"%s\"", vocab_bpe,
                          line_offset, line));
    }
    std::string left, right;
    if (!UnmapToken(line.substr(0, space), byte_of, &left) ||
        !UnmapToken(line.substr(space + 1), byte_of, &right)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: byte offset %d: a character outside GPT-2's byte table", vocab_bpe, line_offset));
    }
    auto l = id_of.find(left);
    auto r = id_of.find(right);
    auto m = id_of.find(left + right);
    if (l == id_of.end() || r == id_of.end() || m == id_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: byte offset %d: merge \"%s\" names a token %s does not have",
                          vocab_bpe, line_offset, line, encoder_json));
    }
    const uint64_t key = (static_cast<uint64_t>(l->second) << 32) | r->second;
    t->merges_.try_emplace(key, Merge{rank++, m->second});
  }
  if (t->merges_.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: no merges", vocab_bpe));
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::LoadDir(const std::string& dir) {
  return Load(dir + "/encoder.json", dir + "/vocab.bpe");
}

void Gpt2Tokenizer::EncodeWord(std::string_view word, std::vector<uint32_t>* out) const {
  std::vector<uint32_t> symbols;
  symbols.reserve(word.size());
  for (char c : word) symbols.push_back(byte_ids_[static_cast<unsigned char>(c)]);
  while (symbols.size() > 1) {
    // The best-ranked adjacent pair.
    uint32_t best_rank = std::numeric_limits<uint32_t>::max();
    uint32_t left = 0, right = 0, merged = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merges_.find((static_cast<uint64_t>(symbols[i]) << 32) | symbols[i + 1]);
      if (it != merges_.end() && it->second.rank < best_rank) {
        best_rank = it->second.rank;
        left = symbols[i];
        right = symbols[i + 1];
        merged = it->second.merged;
      }
    }
    if (best_rank == std::numeric_limits<uint32_t>::max()) break;
    // Every occurrence, left to right, without overlaps.
    size_t w = 0;
    for (size_t i = 0; i < symbols.size(); ++i) {
      if (i + 1 < symbols.size() && symbols[i] == left && symbols[i + 1] == right) {
        symbols[w++] = merged;
        ++i;
      } else {
        symbols[w++] = symbols[i];
      }
    }
    symbols.resize(w);
  }
  out->insert(out->end(), symbols.begin(), symbols.end());
}

std::vector<uint32_t> Gpt2Tokenizer::Encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3);
  // Words repeat a lot in text: a cache of this call's pre-tokens keeps encoding linear in
  // practice without sharing mutable state between threads.
  constexpr size_t kMaxCacheEntries = 1 << 20;
  absl::flat_hash_map<std::string_view, std::pair<size_t, size_t>> cache;  // -> span of ids
  for (std::string_view word : Gpt2PreTokenize(text)) {
    auto it = cache.find(word);
    if (it != cache.end()) {
      const auto [from, count] = it->second;
      for (size_t k = 0; k < count; ++k) ids.push_back(ids[from + k]);
      continue;
    }
    const size_t from = ids.size();
    EncodeWord(word, &ids);
    if (cache.size() < kMaxCacheEntries)
      cache.emplace(word, std::make_pair(from, ids.size() - from));
  }
  return ids;
}

std::string Gpt2Tokenizer::Decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids) {
    if (id < tokens_.size()) out += tokens_[id];
  }
  return out;
}

}  // namespace aloe
