#include "cpu/isa.hpp"

#include "common/cpuid.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ep_moe {
namespace cpu {

namespace {
Isa hardware_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma"))
    return __builtin_cpu_supports("avx512bf16") ? Isa::Avx512Bf16 : Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
#endif
  return Isa::Generic;
}

// EP_MOE_CPU_ISA's level: its text up to the first comma.
bool env_level_is(const char* env, const char* level) {
  const size_t n = std::strlen(level);
  return std::strncmp(env, level, n) == 0 && (env[n] == '\0' || env[n] == ',');
}
// Whether EP_MOE_CPU_ISA lists ",-feature" after its level.
bool env_disables(const char* feature) {
  const char* env = std::getenv("EP_MOE_CPU_ISA");
  if (!env) return false;
  const size_t n = std::strlen(feature);
  for (const char* p = std::strchr(env, ','); p; p = std::strchr(p + 1, ','))
    if (p[1] == '-' && std::strncmp(p + 2, feature, n) == 0 && (p[2 + n] == '\0' || p[2 + n] == ',')) return true;
  return false;
}
}  // namespace

Isa detect_isa() {
  Isa hw = hardware_isa();
  const char* env = std::getenv("EP_MOE_CPU_ISA");
  if (env) {
    Isa want = hw;
    if (env_level_is(env, "generic")) want = Isa::Generic;
    else if (env_level_is(env, "avx2")) want = Isa::Avx2;
    else if (env_level_is(env, "avx512")) want = Isa::Avx512;
    else if (env_level_is(env, "avx512bf16") || env_level_is(env, "amx")) want = Isa::Avx512Bf16;
    if (static_cast<int>(want) < static_cast<int>(hw)) hw = want;
  }
  return hw;
}

bool has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return hardware_isa() >= Isa::Avx512 && __builtin_cpu_supports("avx512vnni") && !env_disables("vnni");
#else
  return false;
#endif
}

bool has_avx512_vbmi() {
#if defined(__x86_64__) || defined(__i386__)
  return has_avx512_vnni() && __builtin_cpu_supports("avx512vbmi") && !env_disables("vbmi");
#else
  return false;
#endif
}

bool has_avx_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return hardware_isa() >= Isa::Avx2 && __builtin_cpu_supports("avxvnni") && !env_disables("avxvnni");
#else
  return false;
#endif
}

size_t decode_prefetch_bytes_for(bool amd, unsigned family, unsigned model) {
  // Zen 3 (and 3+): family 19h models 00-0F, 20-2F, 40-5F; Zen 4 is 10-1F, 60-7F, A0-AF.
  const bool zen3 =
      family == 0x19 && (model <= 0x0F || (model >= 0x20 && model <= 0x2F) || (model >= 0x40 && model <= 0x5F));
  return amd && (family == 0x17 || zen3) ? 3072 : 6144;
}

size_t decode_prefetch_bytes() {
  static const size_t bytes = [] {
    const CpuSignature s = cpu_signature();
    return decode_prefetch_bytes_for(s.amd(), s.family, s.model);
  }();
  return bytes;
}

bool has_amx() {
#if defined(__x86_64__) && defined(__linux__)
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, nullptr) < 7) return;
    __cpuid_count(7, 0, a, b, c, d);
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    __cpuid(1, a, b, c, d);
    const bool osxsave = (c >> 27) & 1;
    if (!tile || !bf16 || !osxsave) return;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return;  // XTILECFG and XTILEDATA
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return ok;
#else
  return false;
#endif
}

EnginePolicy matrix_engine_policy() {
  const char* eng = std::getenv("EP_MOE_MATRIX_ENGINE");
  if (eng && std::strcmp(eng, "off") == 0) return EnginePolicy::Off;
  if (eng && std::strcmp(eng, "onednn") == 0) return EnginePolicy::Force;
  const char* isa = std::getenv("EP_MOE_CPU_ISA");
  if (isa && !env_level_is(isa, "amx")) return EnginePolicy::Off;
  return has_amx() ? EnginePolicy::Amx : EnginePolicy::Off;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Generic: return "generic";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Bf16: return "avx512bf16";
  }
  return "?";
}

}  // namespace cpu
}  // namespace ep_moe
