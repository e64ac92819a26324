// The CPU's vendor, family and model as CPUID leaves 0 and 1 give them,
// the extended fields added as the vendors' manuals define them: the
// extended family where the base family is 0Fh, the extended model where
// it is 06h or 0Fh. Header-only, so that the benchmarks that link only the
// public library (bench/machine_peaks.cpp) read the CPU as the library's
// run-time choices (cpu/isa.cpp) do.
#pragma once

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace ep_moe {

struct CpuSignature {
  char vendor[13] = {};  // "AuthenticAMD", "GenuineIntel", ...; "" where CPUID is missing
  unsigned family = 0, model = 0;
  bool amd() const { return std::strcmp(vendor, "AuthenticAMD") == 0; }
};

inline CpuSignature cpu_signature() {
  CpuSignature s;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return s;
  std::memcpy(s.vendor, &b, 4);  // the vendor string is EBX, EDX, ECX
  std::memcpy(s.vendor + 4, &d, 4);
  std::memcpy(s.vendor + 8, &c, 4);
  if (a >= 1 && __get_cpuid(1, &a, &b, &c, &d)) {
    const unsigned base_family = (a >> 8) & 0xF, base_model = (a >> 4) & 0xF;
    s.family = base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family;
    s.model = base_family == 0xF || base_family == 0x6 ? base_model + (((a >> 16) & 0xF) << 4) : base_model;
  }
#endif
  return s;
}

}  // namespace ep_moe
