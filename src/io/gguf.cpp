#include "io/gguf.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <set>

#include "common/error.hpp"
#include "common/quant.hpp"

namespace ep_moe {
namespace io {

namespace {

constexpr uint32_t kMagic = 0x46554747u;  // "GGUF" little-endian
constexpr uint64_t kMaxString = 64ull << 20;
constexpr uint64_t kMaxCount = 1ull << 24;
constexpr uint64_t kMaxNameLen = 4096;
constexpr int kMaxArrayDepth = 8;
constexpr uint64_t kKeepArray = 4096;

enum : uint32_t {
  T_U8 = 0,
  T_I8 = 1,
  T_U16 = 2,
  T_I16 = 3,
  T_U32 = 4,
  T_I32 = 5,
  T_F32 = 6,
  T_BOOL = 7,
  T_STRING = 8,
  T_ARRAY = 9,
  T_U64 = 10,
  T_I64 = 11,
  T_F64 = 12
};

// Smallest encoding of one value of a type (for "can the file hold N").
uint64_t min_bytes(uint32_t t) {
  switch (t) {
    case T_U8:
    case T_I8:
    case T_BOOL: return 1;
    case T_U16:
    case T_I16: return 2;
    case T_U32:
    case T_I32:
    case T_F32: return 4;
    case T_U64:
    case T_I64:
    case T_F64:
    case T_STRING: return 8;
    case T_ARRAY: return 12;
    default: return 0;
  }
}

struct GgmlType {
  uint32_t id;
  const char* name;
  uint64_t block, bytes;
};
const GgmlType kTypes[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},   {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},        {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
};

class Parser {
 public:
  Parser(const ByteSource& src) : src_(src), c_(src, 0) {}

  GgufValue value(uint32_t type, int depth, const std::string& key) {
    GgufValue v;
    v.type = type;
    switch (type) {
      case T_U8:
        v.u = c_.u8();
        v.i = static_cast<int64_t>(v.u);
        break;
      case T_I8: v.i = static_cast<int8_t>(c_.u8()); break;
      case T_BOOL: {
        const uint8_t b = c_.u8();
        if (b > 1) bad("metadata '%s': bool value %u is not 0 or 1", key.c_str(), b);
        v.u = b;
        v.i = b;
        break;
      }
      case T_U16: {
        uint8_t b[2];
        c_.bytes(b, 2);
        v.u = static_cast<uint64_t>(b[0] | b[1] << 8);
        v.i = static_cast<int64_t>(v.u);
        break;
      }
      case T_I16: {
        uint8_t b[2];
        c_.bytes(b, 2);
        v.i = static_cast<int16_t>(static_cast<uint16_t>(b[0] | b[1] << 8));
        break;
      }
      case T_U32:
        v.u = c_.u32();
        v.i = static_cast<int64_t>(v.u);
        break;
      case T_I32: v.i = static_cast<int32_t>(c_.u32()); break;
      case T_F32: {
        const uint32_t x = c_.u32();
        float f;
        std::memcpy(&f, &x, 4);
        v.f = f;
        break;
      }
      case T_U64:
        v.u = c_.u64();
        v.i = static_cast<int64_t>(v.u);
        break;
      case T_I64: v.i = static_cast<int64_t>(c_.u64()); break;
      case T_F64: {
        const uint64_t x = c_.u64();
        std::memcpy(&v.f, &x, 8);
        break;
      }
      case T_STRING: v.s = c_.string(kMaxString, ("metadata string of '" + key + "'").c_str()); break;
      case T_ARRAY: {
        if (depth >= kMaxArrayDepth) bad("metadata '%s': arrays nested deeper than %d", key.c_str(), kMaxArrayDepth);
        const uint32_t et = c_.u32();
        if (min_bytes(et) == 0) bad("metadata '%s': array element type %u is not a GGUF type", key.c_str(), et);
        const uint64_t n = c_.u64();
        if (n > c_.remaining() / min_bytes(et))
          bad("metadata '%s': array of %llu elements cannot fit in the %llu bytes left", key.c_str(),
              static_cast<unsigned long long>(n), static_cast<unsigned long long>(c_.remaining()));
        v.array_type = et;
        v.array_len = n;
        const bool keep = n <= kKeepArray && et != T_STRING && et != T_ARRAY;
        for (uint64_t k = 0; k < n; ++k) {
          if (et == T_STRING) {  // skip without keeping
            const uint64_t at = c_.pos();
            const uint64_t len = c_.u64();
            if (len > kMaxString || len > c_.remaining())
              bad("metadata '%s': string %llu of the array at offset %llu claims %llu bytes", key.c_str(),
                  static_cast<unsigned long long>(k), static_cast<unsigned long long>(at),
                  static_cast<unsigned long long>(len));
            c_.skip(len);
            continue;
          }
          const GgufValue e = value(et, depth + 1, key);
          if (keep) v.array.push_back(e.is_float() ? e.f : static_cast<double>(e.i));
        }
        break;
      }
      default: bad("metadata '%s': value type %u is not a GGUF type", key.c_str(), type);
    }
    return v;
  }

  GgufFile run(int file_index) {
    GgufFile g;
    if (src_.size() < 24) bad("%llu bytes is too small for a GGUF file", static_cast<unsigned long long>(src_.size()));
    const uint32_t magic = c_.u32();
    if (magic != kMagic) bad("bad magic 0x%08x (not a GGUF file)", magic);
    g.version = c_.u32();
    if (g.version != 2 && g.version != 3) bad("GGUF version %u is not supported (2 and 3 are)", g.version);
    const uint64_t n_tensors = c_.u64(), n_kv = c_.u64();
    if (n_tensors > kMaxCount || n_kv > kMaxCount)
      bad("header claims %llu tensors and %llu metadata entries (limit %llu each)",
          static_cast<unsigned long long>(n_tensors), static_cast<unsigned long long>(n_kv),
          static_cast<unsigned long long>(kMaxCount));
    // Each entry needs at least a key/name length: reject counts the file cannot hold.
    if (n_kv > c_.remaining() / 12 || n_tensors > c_.remaining() / 24)
      bad("header claims more entries than the file can hold");

    for (uint64_t k = 0; k < n_kv; ++k) {
      std::string key = c_.string(kMaxNameLen, "metadata key");
      const uint32_t type = c_.u32();
      GgufValue v = value(type, 0, key);
      if (!g.kv.emplace(key, std::move(v)).second) bad("metadata key '%s' appears twice", key.c_str());
    }
    if (const GgufValue* a = g.find("general.alignment")) {
      if (!a->is_int() || a->as_int() <= 0 || (a->as_int() & (a->as_int() - 1)) != 0 || a->as_int() > (1 << 20))
        bad("general.alignment must be a power of two up to 1 MiB");
      g.alignment = static_cast<uint64_t>(a->as_int());
    }

    std::set<std::string> names;
    std::vector<uint64_t> rel_offsets;
    for (uint64_t t = 0; t < n_tensors; ++t) {
      TensorInfo ti;
      ti.file = file_index;
      ti.name = c_.string(kMaxNameLen, "tensor name");
      const char* tn = ti.name.c_str();
      if (!names.insert(ti.name).second) bad("tensor '%s' appears twice", tn);
      const uint32_t n_dims = c_.u32();
      if (n_dims > 4) bad("tensor '%s': %u dimensions (at most 4)", tn, n_dims);
      uint64_t ne[4] = {1, 1, 1, 1};
      for (uint32_t d = 0; d < n_dims; ++d) ne[d] = c_.u64();
      const uint32_t type = c_.u32();
      uint64_t block = 0, bbytes = 0;
      const char* tname = nullptr;
      if (!ggml_type_size(type, &block, &bbytes, &tname)) bad("tensor '%s': ggml type %u is unknown", tn, type);
      ti.type_name = tname;
      ti.block = block;
      ti.block_bytes = bbytes;
      const int qdt = quant_dtype_of_gguf(static_cast<int>(type));
      ti.elem = type == 0    ? Elem::F32
                : type == 1  ? Elem::F16
                : type == 30 ? Elem::BF16
                : qdt >= 0   ? static_cast<Elem>(qdt)
                             : Elem::Other;
      if (ne[0] % block != 0)
        bad("tensor '%s': row of %llu elements is not a whole number of %s blocks (%llu)", tn,
            static_cast<unsigned long long>(ne[0]), tname, static_cast<unsigned long long>(block));
      uint64_t blocks = ne[0] / block;
      for (uint32_t d = 1; d < n_dims; ++d) {
        if (ne[d] != 0 && blocks > UINT64_MAX / ne[d]) bad("tensor '%s': its size overflows", tn);
        blocks *= ne[d];
      }
      if (blocks > UINT64_MAX / bbytes) bad("tensor '%s': its size overflows", tn);
      ti.bytes = blocks * bbytes;
      for (uint32_t d = 0; d < n_dims; ++d) {
        if (ne[d] > (1ull << 62)) bad("tensor '%s': dimension %u is absurd", tn, d);
        ti.shape.insert(ti.shape.begin(), static_cast<int64_t>(ne[d]));  // outermost first
      }
      const uint64_t off = c_.u64();
      if (off % g.alignment != 0)
        bad("tensor '%s': offset %llu is not a multiple of the alignment %llu", tn,
            static_cast<unsigned long long>(off), static_cast<unsigned long long>(g.alignment));
      rel_offsets.push_back(off);
      g.tensors.push_back(std::move(ti));
    }
    const uint64_t pos = c_.pos();
    if (pos > UINT64_MAX - g.alignment) bad("header size overflows");
    g.data_start = (pos + g.alignment - 1) / g.alignment * g.alignment;
    if (g.data_start > src_.size() && !g.tensors.empty()) bad("the data section starts past the end of the file");
    const uint64_t data_len = src_.size() >= g.data_start ? src_.size() - g.data_start : 0;
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      TensorInfo& ti = g.tensors[t];
      if (rel_offsets[t] > data_len || ti.bytes > data_len - rel_offsets[t])
        bad("tensor '%s': data [%llu, +%llu) is outside the %llu data bytes of the file (truncated?)", ti.name.c_str(),
            static_cast<unsigned long long>(rel_offsets[t]), static_cast<unsigned long long>(ti.bytes),
            static_cast<unsigned long long>(data_len));
      ti.offset = g.data_start + rel_offsets[t];
    }
    return g;
  }

 private:
  [[noreturn]]
#if defined(__GNUC__)
  __attribute__((format(printf, 2, 3)))
#endif
  void
  bad(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fail(EP_MOE_ERR_FORMAT, "%s: %s", src_.name().c_str(), buf);
  }

  const ByteSource& src_;
  Cursor c_;
};

}  // namespace

bool GgufValue::is_int() const {
  return type == T_U8 || type == T_I8 || type == T_U16 || type == T_I16 || type == T_U32 || type == T_I32 ||
         type == T_U64 || type == T_I64 || type == T_BOOL;
}
bool GgufValue::is_float() const { return type == T_F32 || type == T_F64; }
int64_t GgufValue::as_int() const { return is_float() ? static_cast<int64_t>(f) : i; }
double GgufValue::as_float() const { return is_float() ? f : static_cast<double>(i); }

int64_t GgufValue::checked_int(const std::string& key, int64_t lo, int64_t hi, const std::string& where) const {
  if (!is_int())
    fail(EP_MOE_ERR_FORMAT, "%s: metadata %s is %s, not an integer", where.c_str(), key.c_str(),
         is_float()         ? "a float"
         : type == T_STRING ? "a string"
                            : "an array");
  const bool unsigned_type = type == T_U8 || type == T_U16 || type == T_U32 || type == T_U64;
  if (unsigned_type ? u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo : i < lo || i > hi) {
    const std::string v = unsigned_type ? std::to_string(u) : std::to_string(i);
    fail(EP_MOE_ERR_FORMAT, "%s: metadata %s is %s, outside [%lld, %lld]", where.c_str(), key.c_str(), v.c_str(),
         static_cast<long long>(lo), static_cast<long long>(hi));
  }
  return unsigned_type ? static_cast<int64_t>(u) : i;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv.find(key);
  return it == kv.end() ? nullptr : &it->second;
}

bool ggml_type_size(uint32_t type, uint64_t* block, uint64_t* bytes, const char** name) {
  for (const auto& t : kTypes)
    if (t.id == type) {
      *block = t.block;
      *bytes = t.bytes;
      *name = t.name;
      return true;
    }
  return false;
}

GgufFile parse_gguf(const ByteSource& src, int file_index) { return Parser(src).run(file_index); }

}  // namespace io
}  // namespace ep_moe
