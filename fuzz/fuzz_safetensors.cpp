// libFuzzer target: the safetensors header parser on arbitrary bytes. Any
// outcome but a clean parse or an ep_moe::Error is a bug (ASan/UBSan report
// the rest).
#include <cstddef>
#include <cstdint>

#include "common/error.hpp"
#include "io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ep_moe::io::MemorySource src(data, size, "fuzz.safetensors");
  try {
    const auto f = ep_moe::io::parse_safetensors(src, 0);
    // Every accepted tensor must lie inside the input.
    for (const auto& t : f.tensors)
      if (t.offset > size || t.bytes > size - t.offset) __builtin_trap();
  } catch (const ep_moe::Error&) {
  }
  return 0;
}
