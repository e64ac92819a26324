#include "io/safetensors.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "io/json_guard.hpp"
#include "io/json_release.hpp"

#include "common/error.hpp"

namespace ep_moe {
namespace io {

namespace {

struct DtypeDesc {
  const char* name;
  uint64_t size;
  Elem elem;
};
// Every dtype the safetensors format defines; the loader accepts three.
const DtypeDesc kDtypes[] = {
    {"BOOL", 1, Elem::Other},      {"U8", 1, Elem::Other},  {"I8", 1, Elem::Other},  {"F8_E5M2", 1, Elem::Other},
    {"F8_E4M3", 1, Elem::F8_E4M3}, {"I16", 2, Elem::Other}, {"U16", 2, Elem::Other}, {"F16", 2, Elem::F16},
    {"BF16", 2, Elem::BF16},       {"I32", 4, Elem::Other}, {"U32", 4, Elem::Other}, {"F32", 4, Elem::F32},
    {"F64", 8, Elem::Other},       {"I64", 8, Elem::Other}, {"U64", 8, Elem::Other},
};

const DtypeDesc* find_dtype(const std::string& s) {
  for (const auto& d : kDtypes)
    if (s == d.name) return &d;
  return nullptr;
}

}  // namespace

namespace {

// The JSON header (rejecting duplicate top-level keys, which JSON libraries
// keep the last of silently, and shapes no header has: json_guard.hpp);
// *header_len: its length in bytes.
void read_header(const ByteSource& src, nlohmann::json* root, uint64_t* header_len) {
  const char* fname = src.name().c_str();
  const uint64_t fsize = src.size();
  if (fsize < 8)
    fail(EP_MOE_ERR_FORMAT, "%s: %llu bytes is too small for a safetensors file", fname,
         static_cast<unsigned long long>(fsize));
  uint8_t lenb[8];
  src.read(0, lenb, 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | lenb[i];
  if (n > kSafetensorsMaxHeader)
    fail(EP_MOE_ERR_FORMAT, "%s: header length %llu is above the 100 MB limit", fname,
         static_cast<unsigned long long>(n));
  if (n > fsize - 8)
    fail(EP_MOE_ERR_FORMAT, "%s: header length %llu runs past the end of the file (%llu bytes)", fname,
         static_cast<unsigned long long>(n), static_cast<unsigned long long>(fsize));
  std::string text(static_cast<size_t>(n), '\0');
  src.read(8, &text[0], static_cast<size_t>(n));
  // A header is an object of tensors (objects of a dtype string and two
  // short arrays) and __metadata__ (an object of strings): three levels.
  check_json(text, src.name() + ": the header", JsonLimits{3, kMaxHeaderArray, true});
  try {
    *root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(EP_MOE_ERR_FORMAT, "%s: the header is not valid JSON: %s", fname, e.what());
  }
  if (!root->is_object()) fail(EP_MOE_ERR_FORMAT, "%s: the header is not a JSON object", fname);
  *header_len = n;
}

// One tensor's entry, checked against the data section of `data_len`
// bytes; *range: its [begin, end) there.
TensorInfo parse_tensor(const char* fname, const std::string& name, const nlohmann::json& v, uint64_t data_start,
                        uint64_t data_len, std::pair<uint64_t, uint64_t>* range) {
  const char* tn = name.c_str();
  if (!v.is_object()) fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': entry is not an object", fname, tn);
  const auto dt = v.find("dtype");
  const auto sh = v.find("shape");
  const auto off = v.find("data_offsets");
  if (dt == v.end() || !dt->is_string())
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': missing or non-string dtype", fname, tn);
  if (sh == v.end() || !sh->is_array())
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': missing or non-array shape", fname, tn);
  if (off == v.end() || !off->is_array() || off->size() != 2)
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': data_offsets must be [begin, end]", fname, tn);
  const std::string dts = dt->get<std::string>();
  const DtypeDesc* d = find_dtype(dts);
  if (!d) fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%s'", fname, tn, dts.c_str());
  if (sh->size() > 8) fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': %zu dimensions (at most 8)", fname, tn, sh->size());

  TensorInfo t;
  t.name = name;
  t.type_name = d->name;
  t.elem = d->elem;
  t.block_bytes = d->size;
  uint64_t count = 1;
  bool overflow = false;
  for (const auto& x : *sh) {
    if (!x.is_number_unsigned())
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': shape entries must be non-negative integers", fname, tn);
    const uint64_t dim = x.get<uint64_t>();
    if (dim > (1ull << 62)) overflow = true;
    if (dim != 0 && count > UINT64_MAX / dim) overflow = true;
    if (!overflow) count *= dim;
    t.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(dim, 1ull << 62)));
  }
  if (overflow || count > UINT64_MAX / d->size)
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': the byte size of its shape overflows", fname, tn);
  const uint64_t bytes = count * d->size;
  for (const auto& x : *off)
    if (!x.is_number_unsigned())
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': data_offsets must be non-negative integers", fname, tn);
  const uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
  if (e < b)
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': data_offsets end %llu is before begin %llu", fname, tn,
         static_cast<unsigned long long>(e), static_cast<unsigned long long>(b));
  if (e - b != bytes)
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': shape and dtype give %llu bytes but data_offsets span %llu", fname, tn,
         static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(e - b));
  if (e > data_len)
    fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': data_offsets end %llu is past the data (%llu bytes)", fname, tn,
         static_cast<unsigned long long>(e), static_cast<unsigned long long>(data_len));
  t.offset = data_start + b;
  t.bytes = bytes;
  *range = {b, e};
  return t;
}

// The data must be tiled exactly: sorted by begin, each tensor starts where
// the previous ended, and the last one ends at the end of the file.
void check_tiling(const char* fname, const SafetensorsFile& f, const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                  uint64_t data_len) {
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  uint64_t at = 0;
  for (size_t i : order) {
    const char* tn = f.tensors[i].name.c_str();
    if (ranges[i].first > at)
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': gap of %llu bytes before its data", fname, tn,
           static_cast<unsigned long long>(ranges[i].first - at));
    if (ranges[i].first < at)
      fail(EP_MOE_ERR_FORMAT, "%s: tensor '%s': its data overlaps the previous tensor's", fname, tn);
    at = ranges[i].second;
  }
  if (at != data_len)
    fail(EP_MOE_ERR_FORMAT, "%s: %llu trailing bytes after the last tensor's data", fname,
         static_cast<unsigned long long>(data_len - at));
}

}  // namespace

SafetensorsFile parse_safetensors(const ByteSource& src, int file_index) {
  const char* fname = src.name().c_str();
  nlohmann::json root;
  const JsonRelease release{root};
  uint64_t n = 0;
  read_header(src, &root, &n);
  SafetensorsFile out;
  out.data_start = 8 + n;
  const uint64_t data_len = src.size() - out.data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (begin, end) per tensor
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(EP_MOE_ERR_FORMAT, "%s: __metadata__ is not an object", fname);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(EP_MOE_ERR_FORMAT, "%s: __metadata__ value of '%s' is not a string", fname, m.key().c_str());
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    ranges.emplace_back();
    out.tensors.push_back(parse_tensor(fname, name, v, out.data_start, data_len, &ranges.back()));
    out.tensors.back().file = file_index;
  }
  check_tiling(fname, out, ranges, data_len);
  return out;
}

}  // namespace io
}  // namespace ep_moe
