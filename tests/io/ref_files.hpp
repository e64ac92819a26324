// What the reference-writer checkers (quant_ref_test, fp8_ref_test) share:
// a failure count with its messages, and whole files read as arrays.
#pragma once

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace ref_files {

inline int& failures() {
  static int n = 0;
  return n;
}
inline void fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  ++failures();
}

// A file's bytes as T values (empty when it cannot be read).
template <class T>
std::vector<T> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const auto n = static_cast<size_t>(in.tellg());
  std::vector<T> v(n / sizeof(T));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

}  // namespace ref_files
