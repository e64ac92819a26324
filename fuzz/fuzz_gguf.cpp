// libFuzzer target: the GGUF parser on arbitrary bytes.
#include <cstddef>
#include <cstdint>

#include "common/error.hpp"
#include "io/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ep_moe::io::MemorySource src(data, size, "fuzz.gguf");
  try {
    const auto g = ep_moe::io::parse_gguf(src, 0);
    for (const auto& t : g.tensors)
      if (t.offset > size || t.bytes > size - t.offset || t.offset % g.alignment) __builtin_trap();
  } catch (const ep_moe::Error&) {
  }
  return 0;
}
