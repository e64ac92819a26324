// The matrix engine (cpu/matrix_engine.hpp, libep_moe_onednn.so) on the
// layer's own bf16 panels, against a double product of the same bf16
// values; and the FFN with the engine against the FFN without it.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <cstring>
#include <vector>

#include "common/dtype.hpp"
#include "common/source.hpp"
#include "cpu/isa.hpp"
#include "cpu/kernels.hpp"
#include "cpu/matrix_engine.hpp"
#include "cpu/pack.hpp"

using namespace ep_moe;

namespace {

// The module beside libep_moe.so in the build tree (this test links the
// internal archive, whose own directory is the test's).
const int module_dir_set = setenv("EP_MOE_BACKEND_DIR", EP_MOE_MODULE_DIR, 0);

// The engine on panels nr wide for these depths, any ISA oneDNN picks, or
// null after a WARN saying why (not built, no AVX512_BF16 for oneDNN's
// bf16 brgemm).
std::unique_ptr<cpu::MatrixEngine> engine_here(int32_t nr, std::vector<int32_t> depths, int threads = 1) {
  (void)module_dir_set;
  cpu::MatrixEngineDesc d;
  d.threads = threads;
  d.nr = nr;
  d.tile_panels = 256 / nr;
  d.depths = std::move(depths);
  d.need_amx = false;
  std::string why;
  auto e = cpu::make_matrix_engine(d, &why);
  if (!e) WARN("skipped: no matrix engine here: " << why);
  return e;
}

}  // namespace

TEST_CASE("the matrix engine reads the bf16 panels in place: a double product's values", "[unit][engine]") {
  const cpu::Kernels& kern = cpu::kernels_for(cpu::detect_isa());
  const int32_t nr = kern.nr;
  auto eng = engine_here(nr, {256, 768});
  if (!eng) return;
  INFO("engine: " << eng->name());
  CHECK(eng->shape_of(256) == 0);
  CHECK(eng->shape_of(768) == 1);
  CHECK(eng->shape_of(512) == -1);
  const int32_t cols = eng->tile_cols();
  REQUIRE(cols == 256 / nr * nr);
  std::mt19937 rng(Catch::rngSeed() + 11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const int32_t k : {256, 768}) {
    // Two tiles of columns, the second read from its panel: a run of
    // panels anywhere in a weight.
    const int32_t n = 2 * cols;
    std::vector<uint16_t> w(static_cast<size_t>(n) * static_cast<size_t>(k));
    for (auto& v : w) v = f32_to_bf16(u(rng));
    cpu::PackedWeight pw;
    cpu::pack(pw, Source{w.data(), EP_MOE_DTYPE_BF16, k}, n, k, nr, EP_MOE_DTYPE_BF16);
    for (const int64_t m : {int64_t{1}, int64_t{17}, int64_t{64}, int64_t{300}, eng->max_rows()}) {
      const int64_t mp = eng->padded_rows(m);
      REQUIRE(mp >= m);
      std::vector<uint16_t> a(static_cast<size_t>(mp) * static_cast<size_t>(k));
      for (auto& v : a) v = f32_to_bf16(u(rng));
      std::vector<float> c(static_cast<size_t>(mp) * static_cast<size_t>(cols), std::nanf(""));
      for (int tile = 0; tile < 2; ++tile) {
        eng->gemm(eng->shape_of(k), m, a.data(), pw.panel(tile * cols / nr), c.data(), 0);
        int bad = 0;
        for (int64_t i = 0; i < m; ++i)
          for (int32_t j = 0; j < cols; ++j) {
            double ref = 0, mag = 0;
            for (int32_t kk = 0; kk < k; ++kk) {
              const double p =
                  static_cast<double>(bf16_to_f32(a[static_cast<size_t>(i * k + kk)])) *
                  bf16_to_f32(
                      w[static_cast<size_t>(tile * cols + j) * static_cast<size_t>(k) + static_cast<size_t>(kk)]);
              ref += p;
              mag += std::fabs(p);
            }
            // f32 accumulation of k products: a few units in the last
            // place of the sum of magnitudes.
            const double got = c[static_cast<size_t>(i * cols + j)];
            if (!(std::fabs(got - ref) <= 1e-5 * mag + 1e-6)) ++bad;
          }
        INFO("k " << k << ", rows " << m << ", tile " << tile);
        CHECK(bad == 0);
      }
    }
  }
}

namespace {
int process_threads() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  int n = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "Threads: %d", &n) == 1) break;
  std::fclose(f);
  return n;
}
}  // namespace

TEST_CASE("the matrix engine starts no OpenMP team: its calls stay on the calling thread", "[unit][engine]") {
  // Debian's oneDNN runs on OpenMP, whose teams' threads stay alive with
  // the native thread that started them: a fresh thread here, so that
  // teams of earlier tests' threads are not this one's (and a sanitizer's
  // background thread, started with the process's first thread, is
  // already there).
  const cpu::Kernels& kern = cpu::kernels_for(cpu::detect_isa());
  auto eng = engine_here(kern.nr, {2048});
  if (!eng) return;
  const int32_t k = 2048, n = eng->tile_cols();
  std::vector<uint16_t> w(static_cast<size_t>(n) * k, f32_to_bf16(0.5f));
  cpu::PackedWeight pw;
  cpu::pack(pw, Source{w.data(), EP_MOE_DTYPE_BF16, k}, n, k, kern.nr, EP_MOE_DTYPE_BF16);
  std::vector<uint16_t> a(static_cast<size_t>(eng->max_rows()) * k, f32_to_bf16(1.0f));
  std::vector<float> c(static_cast<size_t>(eng->max_rows()) * n);
  int before = -1, after = -1;
  std::thread caller([&] {
    before = process_threads();
    for (int i = 0; i < 3; ++i) eng->gemm(0, eng->max_rows(), a.data(), pw.panel(0), c.data(), 0);
    after = process_threads();
  });
  caller.join();
  CHECK(c[0] == 1024.0f);  // 2048 products of 0.5, exact
  CHECK(after == before);
}

TEST_CASE("the matrix engine refuses what it cannot run", "[unit][engine]") {
  const cpu::Kernels& kern = cpu::kernels_for(cpu::detect_isa());
  std::string why;
  cpu::MatrixEngineDesc d;
  d.nr = kern.nr;
  d.tile_panels = 256 / kern.nr;
  d.need_amx = false;
  d.depths = {100};  // not a multiple of 32: the panels are not oneDNN's format
  CHECK(cpu::make_matrix_engine(d, &why) == nullptr);
  CHECK(!why.empty());
  d.depths = {256};
  d.nr = 24;  // no oneDNN format of that width
  why.clear();
  CHECK(cpu::make_matrix_engine(d, &why) == nullptr);
  CHECK(!why.empty());
  // need_amx: refused exactly where oneDNN's kernels have no AMX.
  d.nr = kern.nr;
  d.need_amx = true;
  why.clear();
  auto e = cpu::make_matrix_engine(d, &why);
  if (e) CHECK(e->amx());
  else CHECK(!why.empty());
}

TEST_CASE("AMX detection agrees with /proc/cpuinfo; the engine policy follows the environment", "[unit][engine]") {
  // The kernel lists amx_tile and amx_bf16 where the CPU has them and the
  // kernel supports them; has_amx() then also needs the tile permission,
  // which such a kernel grants.
  bool tile = false, bf16 = false;
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[8192];
    while (std::fgets(line, sizeof line, f))
      if (std::strncmp(line, "flags", 5) == 0) {
        tile = std::strstr(line, " amx_tile") != nullptr;
        bf16 = std::strstr(line, " amx_bf16") != nullptr;
        break;
      }
    std::fclose(f);
  }
  CHECK(cpu::has_amx() == (tile && bf16));
  if (!cpu::has_amx()) WARN("skipped: the AMX path (this CPU has no AMX): only its absence is checked");

  const char* names[] = {"EP_MOE_MATRIX_ENGINE", "EP_MOE_CPU_ISA"};
  std::string saved[2];
  bool had[2];
  for (int i = 0; i < 2; ++i) {
    const char* v = std::getenv(names[i]);
    had[i] = v != nullptr;
    if (had[i]) saved[i] = v;
  }
  const auto policy = [&](const char* engine, const char* isa) {
    if (engine) setenv(names[0], engine, 1);
    else unsetenv(names[0]);
    if (isa) setenv(names[1], isa, 1);
    else unsetenv(names[1]);
    return cpu::matrix_engine_policy();
  };
  const cpu::EnginePolicy by_cpu = cpu::has_amx() ? cpu::EnginePolicy::Amx : cpu::EnginePolicy::Off;
  CHECK(policy(nullptr, nullptr) == by_cpu);
  CHECK(policy("auto", nullptr) == by_cpu);
  CHECK(policy(nullptr, "amx") == by_cpu);
  CHECK(policy("off", nullptr) == cpu::EnginePolicy::Off);
  CHECK(policy("onednn", nullptr) == cpu::EnginePolicy::Force);
  CHECK(policy("onednn", "avx2") == cpu::EnginePolicy::Force);  // named: taken as it is
  for (const char* lower : {"generic", "avx2", "avx512", "avx512bf16"}) {
    INFO("EP_MOE_CPU_ISA=" << lower);
    CHECK(policy(nullptr, lower) == cpu::EnginePolicy::Off);
  }
  // `amx` names no lower kernel table: the CPU's best.
  policy(nullptr, "amx");
  const cpu::Isa named_amx = cpu::detect_isa();
  unsetenv(names[1]);
  CHECK(named_amx == cpu::detect_isa());
  for (int i = 0; i < 2; ++i) {
    if (had[i]) setenv(names[i], saved[i].c_str(), 1);
    else unsetenv(names[i]);
  }
}
