// This machine's own peaks, measured in the same run as the benchmark so
// every result can be given as a fraction of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace bench {

// f32 FMA throughput of `threads` threads (GFLOP/s, 2 flops per FMA lane)
// with the widest vector FMA the CPU has: the best of 8 windows over about
// `seconds`.
double fma_peak_gflops(int threads, double seconds, const char** isa);

// bf16 pair-dot throughput (AVX512_BF16 vdpbf16ps: 32 multiply-adds per
// instruction, 2 flops each) of `threads` threads, the best of 8 windows
// over about `seconds`; 0 when the CPU lacks AVX512_BF16.
double bf16_dot_peak_gflops(int threads, double seconds);

// int8 dot-product throughput (AVX512-VNNI vpdpbusd: 64 u8 x s8
// multiply-adds per instruction, 2 ops each) of `threads` threads, the best
// of 8 windows over about `seconds`; 0 when the CPU lacks AVX512_VNNI. The
// peak of the block-format int8 tiles (src/cpu/qtile_avx512vnni.cpp).
double int8_dot_peak_gops(int threads, double seconds);

// int8 multiply throughput of AVX2's vpmaddubsw (32 u8 x s8 products into
// 16 i16 pair sums an instruction, each product counted as a multiply-add,
// 2 ops), of `threads` threads, the best of 8 windows over about
// `seconds`; 0 without AVX2. The peak of the block-format kernels of the
// tables without AVX512_VNNI (src/cpu/qgroups8.inc, qtile_avx2.cpp: every
// product goes through it; an AVX-VNNI CPU's vpdpbusd takes the same 32).
double int8_maddubs_peak_gops(int threads, double seconds);

// Read bandwidth of `threads` threads streaming a `megabytes` buffer with
// vector loads, GB/s: the best of 8 windows of seconds / 8 each. The buffer
// is allocated and touched once, so the bandwidth can be measured again next
// to each result: on a shared machine it moves by tens of per cent within
// minutes.
class ReadBandwidth {
 public:
  ReadBandwidth(int threads, int megabytes);
  ~ReadBandwidth();
  ReadBandwidth(const ReadBandwidth&) = delete;
  ReadBandwidth& operator=(const ReadBandwidth&) = delete;
  double measure(double seconds);  // GB/s; 0 if the buffer could not be allocated

 private:
  int threads_;
  size_t n_ = 0;  // uint64_t elements
  void* buf_ = nullptr;
};

// The sum of the n 64-bit words at p (32-byte aligned): the read loop
// ReadBandwidth times, with the same loads, for a caller that times a
// plain read of its own buffer against the probe.
uint64_t sum_words(const uint64_t* p, size_t n);

// memcpy rate of ONE of `threads` threads running at the same time, each
// copying its own `bytes`-byte buffer over and over (bytes copied per
// second, GB/s, the mean over the threads): the baseline for moving the
// same volume of rows with the same number of concurrent copiers. Source
// and destination are 4 KiB-aligned; the copy is timed (seconds / 2 each)
// with the destination at two offsets from a 4 KiB boundary, and each
// thread's faster one counts (a destination a few bytes past the source
// modulo 4 KiB can make memcpy 20x slower: 4K aliasing). The timing starts when
// every thread has touched its buffers. 0 when a buffer could not be had.
double memcpy_gbs_per_thread(int threads, double seconds, size_t bytes);

// The CPU the figures come from, for the report and its JSON: the brand
// string and, on x86, vendor, family and model as CPUID gives them (the
// displayed family and model, extended fields added), e.g. "AMD EPYC
// (AuthenticAMD family 26 model 2)". Printable ASCII only, no quotes or
// backslashes; "unknown CPU" where CPUID is not available.
std::string cpu_description();

}  // namespace bench
