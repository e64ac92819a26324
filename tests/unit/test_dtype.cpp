// Scalar dtype conversions against the hardware F16C conversion (when the
// CPU has it) and exhaustive round trips.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>

#include "common/dtype.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#endif

using namespace ep_moe;

TEST_CASE("f16 -> f32 -> f16 round-trips every non-NaN value", "[dtype]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    REQUIRE(f32_to_f16(f) == h);
  }
}

TEST_CASE("bf16 -> f32 -> bf16 round-trips every non-NaN value", "[dtype]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    REQUIRE(f32_to_bf16(f) == h);
  }
}

TEST_CASE("f32 -> f16 rounds like the hardware", "[dtype]") {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("f16c")) {
    WARN("skipped: CPU has no F16C");
    return;
  }
  std::mt19937 rng(Catch::rngSeed() + 1);
  for (int i = 0; i < 2000000; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    float f;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    INFO("bits=" << std::hex << bits);
    REQUIRE(f32_to_f16(f) == hw_f32_to_f16(f));
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = f16_to_f32(static_cast<uint16_t>(h)), b = hw_f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(a)) {
      CHECK(std::isnan(b));
    } else {
      REQUIRE(a == b);
    }
  }
#else
  WARN("skipped: not x86-64");
#endif
}

TEST_CASE("f32 -> bf16 rounds to nearest even", "[dtype]") {
  CHECK(f32_to_bf16(1.0f) == 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
  CHECK(f32_to_bf16(1.0f + 1.0f / 256) == 0x3f80);
  CHECK(f32_to_bf16(1.0f + 3.0f / 256) == 0x3f82);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  CHECK(std::isinf(bf16_to_f32(f32_to_bf16(INFINITY))));
}
