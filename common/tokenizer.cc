#include "common/tokenizer.h"

namespace aloe {

std::vector<uint32_t> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size());
  // Through unsigned char: plain char is signed on x86, and bytes >= 0x80 must map to 128..255.
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

}  // namespace aloe
