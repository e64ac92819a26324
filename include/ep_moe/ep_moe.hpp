/*
 * ep_moe.hpp — optional header-only C++17 wrappers of the C API.
 *
 * Owning handles with RAII (move-only), and calls that throw ep_moe::error
 * (carrying the status and the message) instead of returning a status. The
 * C API stays the stable interface; this header only adds convenience.
 */
#ifndef EP_MOE_EP_MOE_HPP
#define EP_MOE_EP_MOE_HPP

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ep_moe/ep_moe.h"

/** \brief C++ wrappers (header-only, optional). */
namespace ep_moe {

/** \brief Thrown by the wrappers when a C call fails. */
class error : public std::runtime_error {
 public:
  /**
   * \brief An error with its status and message.
   * \param[in] status  The status the C call returned.
   * \param[in] message The message (from the handle or the thread's slot).
   */
  error(ep_moe_status_t status, const std::string& message)
      : std::runtime_error(std::string(ep_moe_status_string(status)) + ": " + message), status_(status) {}
  /** \brief The status of the failed call. \return The status. */
  ep_moe_status_t status() const noexcept { return status_; }

 private:
  ep_moe_status_t status_;
};

/**
 * \brief Throws ep_moe::error unless `s` is ::EP_MOE_OK.
 * \param[in] s       A status.
 * \param[in] message The message to carry (e.g. a handle's last error).
 */
inline void check(ep_moe_status_t s, const char* message) {
  if (s != EP_MOE_OK) throw error(s, message ? message : "");
}

/** \cond DETAIL */
namespace detail {
struct map_deleter {
  void operator()(ep_moe_expert_map_t* p) const noexcept { ep_moe_expert_map_destroy(p); }
};
struct comm_deleter {
  void operator()(ep_moe_comm_t* p) const noexcept { ep_moe_comm_destroy(p); }
};
struct layer_deleter {
  void operator()(ep_moe_layer_t* p) const noexcept { ep_moe_layer_destroy(p); }
};
struct checkpoint_deleter {
  void operator()(ep_moe_checkpoint_t* p) const noexcept { ep_moe_checkpoint_close(p); }
};
}  // namespace detail
/** \endcond */

/** \brief Owning pointer of an expert map. */
using expert_map_ptr = std::unique_ptr<ep_moe_expert_map_t, detail::map_deleter>;
/** \brief Owning pointer of a communicator handle. */
using comm_ptr = std::unique_ptr<ep_moe_comm_t, detail::comm_deleter>;
/** \brief Owning pointer of a layer. */
using layer_ptr = std::unique_ptr<ep_moe_layer_t, detail::layer_deleter>;
/** \brief Owning pointer of a checkpoint. */
using checkpoint_ptr = std::unique_ptr<ep_moe_checkpoint_t, detail::checkpoint_deleter>;

/** \brief An expert map (see ep_moe_expert_map_create()). */
class expert_map {
 public:
  /**
   * \brief Creates the map of one rank.
   * \param[in] config Filled with ep_moe_expert_map_config_init().
   */
  explicit expert_map(const ep_moe_expert_map_config_t& config) {
    ep_moe_expert_map_t* p = nullptr;
    check(ep_moe_expert_map_create(&p, &config), ep_moe_last_error());
    ptr_.reset(p);
  }
  /** \brief One attribute. \param[in] a Which. \return Its value. */
  int32_t attr(ep_moe_map_attr_t a) const {
    int32_t v = 0;
    check(ep_moe_expert_map_get_attr(&v, ptr_.get(), a), ep_moe_expert_map_last_error(ptr_.get()));
    return v;
  }
  /** \brief Local id of a global expert. \param[in] g Global id. \return Local id, or -1. */
  int32_t global_to_local(int32_t g) const {
    int32_t v = 0;
    check(ep_moe_expert_map_global_to_local(&v, ptr_.get(), g), ep_moe_expert_map_last_error(ptr_.get()));
    return v;
  }
  /** \brief A whole table. \param[in] t Which. \return Its entries. */
  std::vector<int32_t> table(ep_moe_map_table_t t) const {
    size_t n = 0;
    check(ep_moe_expert_map_table_length(&n, ptr_.get(), t), ep_moe_expert_map_last_error(ptr_.get()));
    std::vector<int32_t> v(n);
    check(ep_moe_expert_map_copy_table(v.data(), v.size(), ptr_.get(), t), ep_moe_expert_map_last_error(ptr_.get()));
    return v;
  }
  /** \brief The "local->global" description. \return The text. */
  std::string describe() const {
    size_t need = 0;
    check(ep_moe_expert_map_describe(nullptr, 0, &need, ptr_.get()), ep_moe_expert_map_last_error(ptr_.get()));
    std::string s(need + 1, '\0');
    check(ep_moe_expert_map_describe(&s[0], s.size(), nullptr, ptr_.get()), ep_moe_expert_map_last_error(ptr_.get()));
    s.resize(need);
    return s;
  }
  /** \brief The C handle (still owned by this object). \return The handle. */
  ep_moe_expert_map_t* get() const noexcept { return ptr_.get(); }

 private:
  expert_map_ptr ptr_;
};

/**
 * \brief Creates `size` in-process ranks (see ep_moe_comm_create_local()).
 * \param[in] size       Number of ranks.
 * \param[in] timeout_ms Timeout of every blocking call.
 * \return One owning handle per rank.
 */
inline std::vector<comm_ptr> local_comms(int32_t size, int32_t timeout_ms = 60000) {
  ep_moe_comm_config_t c;
  check(ep_moe_comm_config_init(&c), ep_moe_last_error());
  c.timeout_ms = timeout_ms;
  std::vector<ep_moe_comm_t*> raw(static_cast<size_t>(size > 0 ? size : 0), nullptr);
  check(ep_moe_comm_create_local(raw.data(), size, &c), ep_moe_last_error());
  std::vector<comm_ptr> out;
  for (auto* h : raw) out.emplace_back(h);
  return out;
}

/** \brief One rank's MoE layer (see ep_moe_layer_create()). */
class layer {
 public:
  /**
   * \brief Creates the layer; the communicators are borrowed for its lifetime.
   * \param[in] config  Filled with ep_moe_layer_config_init().
   * \param[in] map     This rank's expert map (copied).
   * \param[in] ep_comm The EP group, or nullptr.
   * \param[in] dp_comm The DP group, or nullptr.
   */
  layer(const ep_moe_layer_config_t& config, const expert_map& map, ep_moe_comm_t* ep_comm,
        ep_moe_comm_t* dp_comm = nullptr) {
    ep_moe_layer_t* p = nullptr;
    check(ep_moe_layer_create(&p, &config, map.get(), ep_comm, dp_comm), ep_moe_last_error());
    ptr_.reset(p);
  }
  /**
   * \brief Gives one weight (see ep_moe_layer_set_weight()).
   * \param[in] which  Which tensor.
   * \param[in] expert Global expert id for routed tensors, else -1.
   * \param[in] data   rows * cols elements of `dtype`.
   * \param[in] dtype  Element type.
   * \param[in] rows   Rows.
   * \param[in] cols   Columns.
   * \return Whether this rank stored it (false: another rank's expert).
   */
  bool set_weight(ep_moe_weight_t which, int32_t expert, const void* data, ep_moe_dtype_t dtype, int64_t rows,
                  int64_t cols) {
    int32_t stored = 0;
    check(ep_moe_layer_set_weight(&stored, ptr_.get(), which, expert, data, dtype, rows, cols),
          ep_moe_layer_last_error(ptr_.get()));
    return stored != 0;
  }
  /** \brief Runs the layer (see ep_moe_layer_forward()). \param[in] args The arguments. */
  void forward(const ep_moe_forward_args_t& args) {
    check(ep_moe_layer_forward(ptr_.get(), &args), ep_moe_layer_last_error(ptr_.get()));
  }
  /** \brief One attribute. \param[in] a Which. \return Its value. */
  int64_t attr(ep_moe_layer_attr_t a) const {
    int64_t v = 0;
    check(ep_moe_layer_get_attr(&v, ptr_.get(), a), ep_moe_layer_last_error(ptr_.get()));
    return v;
  }
  /**
   * \brief Per-expert load of the window (see ep_moe_layer_expert_load()).
   * \param[in] across_ranks Sum over the EP group (collective).
   * \param[in] reset        Start a new window after reading.
   * \return num_experts counts.
   */
  std::vector<int64_t> expert_load(bool across_ranks, bool reset) {
    std::vector<int64_t> out(static_cast<size_t>(attr(EP_MOE_LAYER_ATTR_NUM_EXPERTS)));
    check(ep_moe_layer_expert_load(out.data(), out.size(), ptr_.get(), across_ranks ? 1 : 0, reset ? 1 : 0),
          ep_moe_layer_last_error(ptr_.get()));
    return out;
  }
  /**
   * \brief Applies a new placement (collective; see ep_moe_layer_replace()).
   * \param[in] map         This rank's map of the new placement.
   * \param[in] new_ep_comm The new EP group, or nullptr to keep the current one.
   * \param[in] checkpoint  Where missing weights may be read, or nullptr.
   * \param[in] layer_index The checkpoint's layer index.
   */
  void replace(const expert_map& map, ep_moe_comm_t* new_ep_comm = nullptr,
               const ep_moe_checkpoint_t* checkpoint = nullptr, int32_t layer_index = 0) {
    check(ep_moe_layer_replace(ptr_.get(), map.get(), new_ep_comm, checkpoint, layer_index),
          ep_moe_layer_last_error(ptr_.get()));
  }
  /** \brief The C handle (still owned by this object). \return The handle. */
  ep_moe_layer_t* get() const noexcept { return ptr_.get(); }

 private:
  layer_ptr ptr_;
};

/**
 * \brief A balanced placement from per-expert load (see ep_moe_rebalance()).
 * \param[in] load          One load per logical expert.
 * \param[in] num_slots     Physical slots (experts + redundant), a multiple of num_ranks.
 * \param[in] num_ranks     Ranks of the EP group.
 * \param[in] ranks_per_node Ranks per node, 0 for one node.
 * \param[in] num_groups    Expert groups, 0 for none.
 * \param[out] imbalance    Optional: max rank load / mean.
 * \param[in] current       The placement in use (slot -> expert), or empty.
 * \return The custom placement table (slot -> expert).
 */
inline std::vector<int32_t> rebalance(const std::vector<double>& load, int32_t num_slots, int32_t num_ranks,
                                      int32_t ranks_per_node = 0, int32_t num_groups = 0, double* imbalance = nullptr,
                                      const std::vector<int32_t>& current = {}) {
  ep_moe_rebalance_config_t c;
  check(ep_moe_rebalance_config_init(&c), ep_moe_last_error());
  c.num_experts = static_cast<int32_t>(load.size());
  c.num_slots = num_slots;
  c.num_ranks = num_ranks;
  c.ranks_per_node = ranks_per_node;
  c.num_expert_groups = num_groups;
  c.num_current_slots = static_cast<int32_t>(current.size());
  c.current_slots = current.empty() ? nullptr : current.data();
  std::vector<int32_t> out(num_slots > 0 ? static_cast<size_t>(num_slots) : 0);
  check(ep_moe_rebalance(out.data(), out.size(), imbalance, load.data(), load.size(), &c), ep_moe_last_error());
  return out;
}

}  // namespace ep_moe

#endif /* EP_MOE_EP_MOE_HPP */
