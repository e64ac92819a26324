// The command-line parser of the demo, the benchmarks and the tools: options
// are declared once (name, destination, range, help), parsed with every
// number checked whole (an "8x" or a value out of range is an error, not
// an 8 or a wrap), and the usage text is generated from the declarations.
// Header-only, C++17, no library of ours.
#pragma once

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace cli {

// "a,b,c" -> {"a", "b", "c"} (empty items dropped).
inline std::vector<std::string> split(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// A whole decimal integer in [lo, hi]; false (and *err says why) otherwise.
inline bool to_int(const std::string& s, long long lo, long long hi, long long* out, std::string* err) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end == s.c_str() || *end != '\0' || errno == ERANGE) {
    *err = "'" + s + "' is not an integer";
    return false;
  }
  if (v < lo || v > hi) {
    *err = std::to_string(v) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    return false;
  }
  *out = v;
  return true;
}

// A whole finite decimal number in [lo, hi].
inline bool to_double(const std::string& s, double lo, double hi, double* out, std::string* err) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end == s.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    *err = "'" + s + "' is not a number";
    return false;
  }
  if (v < lo || v > hi) {
    std::ostringstream m;
    m << v << " is outside [" << lo << ", " << hi << "]";
    *err = m.str();
    return false;
  }
  *out = v;
  return true;
}

class Parser {
 public:
  // What parse() says: go on, or exit with this status (0 after --help).
  static constexpr int kRun = -1;

  // `usage_line`: e.g. "ep_moe_demo [options]"; `about`: a paragraph printed
  // under it by --help.
  Parser(std::string usage_line, std::string about = "") : usage_(std::move(usage_line)), about_(std::move(about)) {}

  // A flag without a value.
  Parser& flag(const char* name, bool* out, const char* help) {
    return add(name, nullptr, help, [out](const std::string&, std::string*) {
      *out = true;
      return true;
    });
  }
  Parser& option(const char* name, int* out, const char* help, long long lo = INT_MIN, long long hi = INT_MAX) {
    return add(name, "N", help, [out, lo, hi](const std::string& v, std::string* err) {
      long long x = 0;
      if (!to_int(v, lo, hi, &x, err)) return false;
      *out = static_cast<int>(x);
      return true;
    });
  }
  Parser& option(const char* name, unsigned* out, const char* help) {
    return add(name, "N", help, [out](const std::string& v, std::string* err) {
      long long x = 0;
      if (!to_int(v, 0, UINT_MAX, &x, err)) return false;
      *out = static_cast<unsigned>(x);
      return true;
    });
  }
  Parser& option(const char* name, double* out, const char* help, double lo = -HUGE_VAL, double hi = HUGE_VAL) {
    return add(name, "X", help,
               [out, lo, hi](const std::string& v, std::string* err) { return to_double(v, lo, hi, out, err); });
  }
  Parser& option(const char* name, std::string* out, const char* help, const char* metavar = "S") {
    return add(name, metavar, help, [out](const std::string& v, std::string*) {
      *out = v;
      return true;
    });
  }
  // A comma-separated list of integers in [lo, hi].
  Parser& list(const char* name, std::vector<int>* out, const char* help, long long lo = INT_MIN,
               long long hi = INT_MAX) {
    return add(name, "N,N,..", help, [out, lo, hi](const std::string& v, std::string* err) {
      std::vector<int> xs;
      for (const std::string& item : split(v)) {
        long long x = 0;
        if (!to_int(item, lo, hi, &x, err)) return false;
        xs.push_back(static_cast<int>(x));
      }
      if (xs.empty()) {
        *err = "the list is empty";
        return false;
      }
      *out = xs;
      return true;
    });
  }
  // A comma-separated list of names.
  Parser& list(const char* name, std::vector<std::string>* out, const char* help) {
    return add(name, "A,B,..", help, [out](const std::string& v, std::string* err) {
      *out = split(v);
      if (out->empty()) *err = "the list is empty";
      return !out->empty();
    });
  }
  // Any other value: `take` stores it or returns false with *err set.
  Parser& custom(const char* name, const char* metavar, const char* help,
                 std::function<bool(const std::string&, std::string*)> take) {
    return add(name, metavar, help, std::move(take));
  }

  // A required argument without a name (in the order declared).
  Parser& positional(const char* name, std::string* out, const char* help) {
    positionals_.push_back(Opt{name, name, help, [out](const std::string& v, std::string*) {
                                 *out = v;
                                 return true;
                               }});
    return *this;
  }

  // Parses argv[1..]: kRun to go on, or the status to exit with (usage
  // printed: to stdout for --help, else to stderr with what was wrong).
  int parse(int argc, char** argv) const {
    size_t given = 0;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        usage(stdout);
        return 0;
      }
      const Opt* o = find(a);
      if (!o && (a.empty() || a[0] != '-') && given < positionals_.size()) {
        std::string err;
        if (!positionals_[given++].take(a, &err)) return error(a + ": " + err);
        continue;
      }
      if (!o) return error("unknown argument " + a);
      std::string v, err;
      if (o->metavar) {
        if (i + 1 >= argc) return error(a + " needs a value");
        v = argv[++i];
      }
      if (!o->take(v, &err)) return error(a + ": " + err);
    }
    if (given < positionals_.size()) return error(std::string(positionals_[given].name) + " is missing");
    return kRun;
  }

  void usage(FILE* f) const {
    std::fprintf(f, "usage: %s\n", usage_.c_str());
    if (!about_.empty()) std::fprintf(f, "%s\n", about_.c_str());
    for (const Opt& o : positionals_) std::fprintf(f, "  %-24s %s\n", o.name, o.help);
    std::fprintf(f, "options:\n");
    for (const Opt& o : opts_) {
      const std::string left = std::string(o.name) + (o.metavar ? std::string(" ") + o.metavar : "");
      std::fprintf(f, "  %-24s %s\n", left.c_str(), o.help);
    }
    std::fprintf(f, "  %-24s %s\n", "-h, --help", "this text");
  }

 private:
  struct Opt {
    const char* name;
    const char* metavar;  // null: a flag
    const char* help;
    std::function<bool(const std::string&, std::string*)> take;
  };
  Parser& add(const char* name, const char* metavar, const char* help,
              std::function<bool(const std::string&, std::string*)> take) {
    opts_.push_back(Opt{name, metavar, help, std::move(take)});
    return *this;
  }
  const Opt* find(const std::string& name) const {
    for (const Opt& o : opts_)
      if (name == o.name) return &o;
    return nullptr;
  }
  int error(const std::string& what) const {
    std::fprintf(stderr, "%s\n", what.c_str());
    usage(stderr);
    return 2;
  }

  std::string usage_, about_;
  std::vector<Opt> opts_, positionals_;
};

}  // namespace cli
