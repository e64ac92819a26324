// The CPU kernel tables the unit tests loop over.
#pragma once

#include <catch2/catch.hpp>

#include <vector>

#include "cpu/isa.hpp"

namespace ep_moe_test {

// The ISA tables this CPU runs, lowest first; the others are reported as
// skipped (a test that loops over these never passes one it did not run).
inline std::vector<ep_moe::cpu::Isa> isas_here() {
  namespace cpu = ep_moe::cpu;
  std::vector<cpu::Isa> v;
  const int top = static_cast<int>(cpu::detect_isa());
  for (int i = 0; i <= top; ++i) v.push_back(static_cast<cpu::Isa>(i));
  for (int i = top + 1; i <= static_cast<int>(cpu::Isa::Avx512Bf16); ++i)
    WARN("skipped: " << cpu::isa_name(static_cast<cpu::Isa>(i)) << " kernels (this CPU has none)");
  return v;
}

}  // namespace ep_moe_test
