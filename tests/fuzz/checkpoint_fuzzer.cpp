// libFuzzer target: reading a checkpoint file (ddpkit::decode_tensors), as resume does with
// whatever a crash or a full disk left in the directory. Every input must decode or be refused
// with an error; never read out of bounds, never allocate what the bytes merely claim.
//
//   scripts/sanitize.sh fuzz 600        (builds build-asan/ with clang 14, ASan + UBSan)
#include <ddpkit/training/checkpoint.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

void decode(const std::string& bytes) {
  try {
    const ddpkit::TensorDict dict = ddpkit::decode_tensors(bytes, "fuzz input");
    // What decodes must survive a round trip (entries come back sorted by name, so compare the
    // re-encoded form, not the input).
    const std::string encoded = ddpkit::encode_tensors(dict);
    if (ddpkit::encode_tensors(ddpkit::decode_tensors(encoded, "re-encoded")) != encoded) __builtin_trap();
  } catch (const c10::Error&) {
  }
}

// The format's trailer (64-bit FNV-1a over 8-byte words, src/training/checkpoint.cpp), recomputed
// so that mutations get past the checksum into the entries.
std::string with_valid_checksum(std::string bytes) {
  const size_t n = bytes.size() - 8;
  uint64_t h = 0xcbf29ce484222325ULL ^ n;
  size_t i = 0;
  for (uint64_t w; i + 8 <= n; i += 8) {
    std::memcpy(&w, bytes.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ULL;
  }
  for (; i < n; ++i) h = (h ^ static_cast<unsigned char>(bytes[i])) * 0x100000001b3ULL;
  std::memcpy(&bytes[n], &h, 8);
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  decode(bytes);
  if (size >= 24) decode(with_valid_checksum(bytes));
  return 0;
}
