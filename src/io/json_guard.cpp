#include "io/json_guard.hpp"

#include <nlohmann/json.hpp>
#include <unordered_set>
#include <vector>

#include "common/error.hpp"

namespace ep_moe {
namespace io {

namespace {

using json = nlohmann::json;

// SAX events only: nothing is built, each event costs O(1) (a top-level
// key one hash insert).
class Guard : public nlohmann::json_sax<json> {
 public:
  explicit Guard(const JsonLimits& l) : limits_(l) {}
  std::string error;

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(false); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(true); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    if (limits_.unique_top_keys && stack_.size() == 1 && !top_keys_.insert(k).second) {
      error = "key '" + k + "' appears twice";
      return false;
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    error = std::string("not valid JSON: ") + e.what();
    return false;
  }

 private:
  struct Level {
    bool array;
    uint64_t count;
  };
  // One element more in the enclosing array, if it is one.
  bool value() {
    if (!stack_.empty() && stack_.back().array && ++stack_.back().count > limits_.max_array) {
      error = "an array has more than " + std::to_string(limits_.max_array) + " elements";
      return false;
    }
    return true;
  }
  bool open(bool array) {
    if (!value()) return false;
    if (static_cast<int>(stack_.size()) >= limits_.max_depth) {
      error = "nested deeper than " + std::to_string(limits_.max_depth) + " levels";
      return false;
    }
    stack_.push_back(Level{array, 0});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }
  JsonLimits limits_;
  std::vector<Level> stack_;
  std::unordered_set<std::string> top_keys_;
};

}  // namespace

void check_json(const std::string& text, const std::string& name, const JsonLimits& limits) {
  Guard g(limits);
  bool ok = false;
  try {
    ok = json::sax_parse(text, &g);
  } catch (const json::exception& e) {
    g.error = std::string("not valid JSON: ") + e.what();
  }
  if (!ok || !g.error.empty())
    fail(EP_MOE_ERR_FORMAT, "%s: %s", name.c_str(), g.error.empty() ? "not valid JSON" : g.error.c_str());
}

}  // namespace io
}  // namespace ep_moe
