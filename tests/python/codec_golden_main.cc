// aloe-codec-golden (test-only): encodes float32 values with the C++ push encoder, so that the
// Python worker's encoder (worker/python/aloe/codec.py) is checked byte for byte against it.
//   aloe-codec-golden CODEC BLOCK_SIZE < values.f32 > payload
// CODEC is fp32, bf16 or int8; stdin holds little-endian float32 values; stdout gets the
// payload, then the float32 residual (values - decode(payload)). Exit 1 with the error on stderr
// when the encoder refuses the values.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "common/tensor_codec.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s fp32|bf16|int8 BLOCK_SIZE < values.f32 > payload\n", argv[0]);
    return 2;
  }
  const std::string name = argv[1];
  aloe::v1::Codec codec = aloe::v1::CODEC_FP32;
  if (name == "bf16") {
    codec = aloe::v1::CODEC_BF16;
  } else if (name == "int8") {
    codec = aloe::v1::CODEC_INT8_BLOCKWISE;
  } else if (name != "fp32") {
    std::fprintf(stderr, "unknown codec %s\n", name.c_str());
    return 2;
  }
  const std::string in((std::istreambuf_iterator<char>(std::cin)),
                       std::istreambuf_iterator<char>());
  std::vector<float> values(in.size() / sizeof(float));
  std::memcpy(values.data(), in.data(), values.size() * sizeof(float));
  std::vector<float> residual(values.size());
  std::string out;
  const absl::Status s =
      aloe::EncodeChunk(codec, values, std::strtoul(argv[2], nullptr, 10), &out, residual.data());
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 1;
  }
  out.append(reinterpret_cast<const char*>(residual.data()), residual.size() * sizeof(float));
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}
