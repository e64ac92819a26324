// This machine's own peaks, measured in the same run as the benchmark so
// every result can be given as a fraction of them.
#pragma once

namespace bench {

// f32 FMA throughput of `threads` threads (GFLOP/s, 2 flops per FMA lane)
// with the widest vector FMA the CPU has, for about `seconds`.
double fma_peak_gflops(int threads, double seconds, const char** isa);

// Read bandwidth of `threads` threads streaming a `megabytes` buffer, GB/s.
double read_bandwidth_gbs(int threads, double seconds, int megabytes);

}  // namespace bench
