/*
 * ep_moe — expert-parallel Mixture-of-Experts layer, C API.
 *
 * This is the one stable public header of libep_moe. It is valid C99 and
 * C++ (it compiles with -Wall -Wextra -pedantic -Werror in both).
 */
#ifndef EP_MOE_EP_MOE_H
#define EP_MOE_EP_MOE_H

#include <stddef.h>
#include <stdint.h>

/**
 * \file ep_moe.h
 * \brief The ep_moe C API: statuses, versions, features, logging and the
 *        expert map manager.
 *
 * Conventions shared by every function of this header:
 * - Every function that can fail returns an ::ep_moe_status_t. ::EP_MOE_OK is
 *   0; every other value is an error. A failed call leaves its out-parameters
 *   untouched and its handle usable.
 * - Out-parameters come first and are named `out` (or `out_<what>`).
 * - Handles are opaque. `ep_moe_<x>_create()` allocates one; the matching
 *   `ep_moe_<x>_destroy()` frees it and accepts NULL. A handle passed as a
 *   `const` pointer may be used from several threads at once; a handle passed
 *   as a non-const pointer needs the caller's synchronisation.
 * - Configuration structs start with `size_t struct_size` and must be filled
 *   by their `*_config_init()` function before fields are changed. A struct
 *   whose `struct_size` this library does not know is rejected with
 *   ::EP_MOE_ERR_STRUCT_SIZE.
 * - The library never prints, aborts or throws; it talks only through return
 *   values, ep_moe_last_error(), the per-handle `*_last_error()` functions and
 *   an optional log callback (ep_moe_set_log_callback()).
 */

/** \defgroup ep_moe_base Base: export macro, versions, statuses, errors, logging
 *  @{ */

/** \brief Marks a symbol exported from libep_moe (everything else is hidden). */
#if defined(_WIN32)
#  if defined(EP_MOE_BUILDING_LIBRARY)
#    define EP_MOE_API __declspec(dllexport)
#  else
#    define EP_MOE_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) || defined(__clang__)
#  define EP_MOE_API __attribute__((visibility("default")))
#else
#  define EP_MOE_API
#endif

/** \brief Major version: bumped on an incompatible ABI change (it is also the
 *  shared library's SOVERSION). */
#define EP_MOE_VERSION_MAJOR 0
/** \brief Minor version: bumped when features are added compatibly. */
#define EP_MOE_VERSION_MINOR 1
/** \brief Patch version: bumped for fixes only. */
#define EP_MOE_VERSION_PATCH 0
/** \brief The version as one number: major * 10000 + minor * 100 + patch. */
#define EP_MOE_VERSION_NUMBER \
  (EP_MOE_VERSION_MAJOR * 10000 + EP_MOE_VERSION_MINOR * 100 + EP_MOE_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/**
 * \brief Status codes. The numbers are fixed; new codes are only appended.
 */
typedef enum ep_moe_status {
  EP_MOE_OK = 0,                    /**< Success. */
  EP_MOE_ERR_INVALID_ARGUMENT = 1,  /**< An argument is NULL, out of range or inconsistent. */
  EP_MOE_ERR_OUT_OF_MEMORY = 2,     /**< An allocation failed. */
  EP_MOE_ERR_UNSUPPORTED = 3,       /**< The feature is not built into this library or not available here. */
  EP_MOE_ERR_BUFFER_TOO_SMALL = 4,  /**< A caller buffer is smaller than the data to copy. */
  EP_MOE_ERR_STRUCT_SIZE = 5,       /**< A config struct's `struct_size` is unknown (uninitialised, or from a newer header). */
  EP_MOE_ERR_INVALID_HANDLE = 6,    /**< A handle is NULL, destroyed, or of the wrong type. */
  EP_MOE_ERR_INTERNAL = 7,          /**< A bug in ep_moe; the message says where. */
  EP_MOE_ERR_TIMEOUT = 8,           /**< A blocking operation did not complete in time. */
  EP_MOE_ERR_ABORTED = 9,           /**< The operation was aborted. */
  EP_MOE_ERR_REMOTE = 10,           /**< A peer rank failed; the communicator is broken. */
  EP_MOE_ERR_IO = 11,               /**< A file could not be opened or read. */
  EP_MOE_ERR_FORMAT = 12,           /**< A file or buffer is malformed. */
  EP_MOE_ERR_NOT_FOUND = 13,        /**< A named item (tensor, key) does not exist. */
  EP_MOE_ERR_STATE = 14             /**< The call is not valid in the handle's current state. */
} ep_moe_status_t;

/**
 * \brief The library's version number, computed like ::EP_MOE_VERSION_NUMBER.
 *
 * Compare it with ::EP_MOE_VERSION_NUMBER to detect a header/library mismatch.
 * \return major * 10000 + minor * 100 + patch of the loaded library.
 */
EP_MOE_API uint32_t ep_moe_version(void);

/**
 * \brief The library's version as text, e.g. "0.1.0".
 * \return A static NUL-terminated string; never NULL; do not free it.
 */
EP_MOE_API const char* ep_moe_version_string(void);

/**
 * \brief A short, constant description of a status code.
 * \param[in] status Any value; unknown values give "unknown status".
 * \return A static NUL-terminated string; never NULL; do not free it.
 */
EP_MOE_API const char* ep_moe_status_string(ep_moe_status_t status);

/**
 * \brief The message of the last failed ep_moe call made by this thread.
 *
 * Every failing call records its message here, including create functions
 * (which have no handle to hold it). Successful calls do not clear it.
 * \return A NUL-terminated string owned by the library, valid in this thread
 *         until its next ep_moe call; "" if nothing failed yet. Never NULL.
 */
EP_MOE_API const char* ep_moe_last_error(void);

/**
 * \brief Features a library may be built with, as bits for
 *        ep_moe_has_feature().
 */
typedef enum ep_moe_feature {
  EP_MOE_FEATURE_CPU = 1u << 0,      /**< CPU kernels (always built). */
  EP_MOE_FEATURE_CUDA = 1u << 1,     /**< CUDA backend built. */
  EP_MOE_FEATURE_NCCL = 1u << 2,     /**< NCCL communicator built. */
  EP_MOE_FEATURE_CUBLASLT = 1u << 3, /**< cuBLASLt expert GEMMs built. */
  EP_MOE_FEATURE_MPI = 1u << 4       /**< MPI communicator built. */
} ep_moe_feature_t;

/**
 * \brief Whether this library was built with every feature in a mask.
 * \param[in] features A bitwise OR of ::ep_moe_feature_t values.
 * \return 1 when every bit is a known feature built into this library,
 *         0 otherwise (also for 0 and for unknown bits).
 */
EP_MOE_API int ep_moe_has_feature(uint32_t features);

/** \brief Severity of a log message; a callback receives levels up to the
 *  maximum it was installed with. */
typedef enum ep_moe_log_level {
  EP_MOE_LOG_ERROR = 0, /**< An operation failed. */
  EP_MOE_LOG_WARN = 1,  /**< Something was changed or ignored (e.g. a placement fallback). */
  EP_MOE_LOG_INFO = 2,  /**< One line per significant event (a layout, a mode choice). */
  EP_MOE_LOG_DEBUG = 3  /**< Details for debugging. */
} ep_moe_log_level_t;

/**
 * \brief A log callback.
 * \param[in] level     Severity of the message.
 * \param[in] message   NUL-terminated text, valid only during the call.
 * \param[in] user_data The pointer given to ep_moe_set_log_callback().
 *
 * It may be called from any thread that calls into ep_moe, also from several
 * at once; it must not call back into ep_moe.
 */
typedef void (*ep_moe_log_fn)(ep_moe_log_level_t level, const char* message, void* user_data);

/**
 * \brief Installs (or, with NULL, removes) the process-wide log callback.
 *
 * Without a callback ep_moe writes nothing anywhere.
 * \param[in] fn        The callback, or NULL to stop logging.
 * \param[in] max_level The most verbose level passed to `fn`.
 * \param[in] user_data Passed to every call of `fn`; borrowed until the
 *                      callback is replaced or removed.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT for a level outside
 *         ::ep_moe_log_level_t.
 */
EP_MOE_API ep_moe_status_t ep_moe_set_log_callback(ep_moe_log_fn fn, ep_moe_log_level_t max_level,
                                                   void* user_data);

/** @} */

/** \defgroup ep_moe_map Expert map manager
 *  \brief Which rank owns which expert, and the tables that say it.
 *
 * Terms:
 * - A *logical* (global) expert id is the model's expert index in [0, E).
 *   Fused shared experts get global ids E .. E+S-1.
 * - A *physical slot* is one copy of an expert's weights. Slots are numbered
 *   rank by rank: rank 0's slots first, then rank 1's, and so on. Without
 *   redundancy there are E slots; with R redundant replicas there are E+R.
 * - A *local* id indexes this rank's slots: 0 .. n_local-1 for routed
 *   experts, then n_local .. n_local+S-1 for the fused shared experts.
 *  @{ */

/** \brief An expert map: the placement of experts over an EP group, seen
 *  from one rank. Opaque. */
typedef struct ep_moe_expert_map ep_moe_expert_map_t;

/** \brief How experts are placed on ranks. */
typedef enum ep_moe_placement {
  /** Contiguous blocks: rank r holds slots [r*base + min(r, rem), ...) where
   *  base = P / ep_size and the first rem = P % ep_size ranks hold one more
   *  (P = number of physical slots). With R redundant slots, slot p holds
   *  expert p % E. */
  EP_MOE_PLACEMENT_LINEAR = 0,
  /** Rank r holds experts r, r + ep_size, r + 2*ep_size, ... Requires expert
   *  groups (num_expert_group > 1) and no redundancy; otherwise the map falls
   *  back to linear and logs why. */
  EP_MOE_PLACEMENT_ROUND_ROBIN = 1,
  /** An explicit physical-slot -> logical-expert table for all ranks
   *  (ep_moe_expert_map_config_t::custom_slots); slots may repeat an expert
   *  (redundant replicas). */
  EP_MOE_PLACEMENT_CUSTOM = 2
} ep_moe_placement_t;

/** \brief Configuration of an expert map; fill with
 *  ep_moe_expert_map_config_init() first. */
typedef struct ep_moe_expert_map_config {
  /** Size of this struct as the caller compiled it; set by
   *  ep_moe_expert_map_config_init(). */
  size_t struct_size;
  /** Number of ranks in the expert-parallel group (>= 1). Default 1. */
  int32_t ep_size;
  /** This rank's index in the EP group, in [0, ep_size). Default 0. */
  int32_t ep_rank;
  /** Number of logical routed experts E (>= 1). Default 0 (must be set). */
  int32_t global_num_experts;
  /** Requested ::ep_moe_placement_t. Default ::EP_MOE_PLACEMENT_LINEAR. */
  int32_t placement;
  /** Number S of fused shared experts, held by every rank after its routed
   *  experts (local ids n_local .. n_local+S-1, global ids E .. E+S-1).
   *  Default 0. */
  int32_t num_fused_shared_experts;
  /** Number of expert groups of grouped top-k routing (0 or 1: none).
   *  Round-robin placement needs more than one group. Default 0. */
  int32_t num_expert_group;
  /** Number R of redundant slots for linear placement (slot p holds expert
   *  p % E, P = E + R slots). Round-robin placement falls back to linear
   *  when R > 0. Ignored for custom placement (its table says it). Default 0. */
  int32_t num_redundant_experts;
  /** Nonzero when expert-parallel load balancing will re-place experts;
   *  round-robin placement then falls back to linear. Default 0. */
  int32_t enable_eplb;
  /** Nonzero when the caller's expert kernels use all-to-all dispatch.
   *  Default 0. */
  int32_t use_all2all_kernels;
  /** Nonzero when those all-to-all kernels accept the round-robin routing
   *  tables; with use_all2all_kernels set and this 0, round-robin placement
   *  falls back to linear. Default 1. */
  int32_t all2all_supports_routing_tables;
  /** Number of entries of custom_slots (the physical slot count P >= E).
   *  Used only with ::EP_MOE_PLACEMENT_CUSTOM. Default 0. */
  int32_t num_custom_slots;
  /** Custom placement: custom_slots[p] is the logical expert held by
   *  physical slot p. Every expert in [0, E) must appear at least once.
   *  Copied at create/update time (borrowed only during the call). */
  const int32_t* custom_slots;
  /** Optional, length ep_size: how many consecutive slots each rank holds
   *  (summing to num_custom_slots). NULL splits the slots like linear
   *  placement. Copied at create/update time. */
  const int32_t* custom_slots_per_rank;
} ep_moe_expert_map_config_t;

/**
 * \brief Fills a config with defaults and sets its struct_size.
 * \param[out] out The struct to fill; must not be NULL.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_config_init(ep_moe_expert_map_config_t* out);

/**
 * \brief Creates the expert map of one rank.
 * \param[out] out    Receives the new handle (owned by the caller; free it
 *                    with ep_moe_expert_map_destroy()). Untouched on failure.
 * \param[in]  config The configuration; read only during the call.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT naming the bad field
 *         (ep_size <= 0, rank out of range, negative counts, a custom table
 *         that misses an expert, ...); ::EP_MOE_ERR_STRUCT_SIZE for an
 *         uninitialised config; ::EP_MOE_ERR_OUT_OF_MEMORY. The message is in
 *         ep_moe_last_error().
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_create(ep_moe_expert_map_t** out,
                                                    const ep_moe_expert_map_config_t* config);

/**
 * \brief Frees an expert map. NULL is accepted and ignored.
 * \param[in] map The handle; invalid after the call.
 */
EP_MOE_API void ep_moe_expert_map_destroy(ep_moe_expert_map_t* map);

/**
 * \brief Recomputes the map for a new layout (elastic re-layout: a new
 *        ep_size, rank, expert count or placement).
 * \param[in,out] map    The handle.
 * \param[in]     config The new configuration, validated like
 *                       ep_moe_expert_map_create().
 * \return ::EP_MOE_OK, or the statuses of ep_moe_expert_map_create(); on
 *         failure the map keeps its previous layout.
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_update(ep_moe_expert_map_t* map,
                                                    const ep_moe_expert_map_config_t* config);

/**
 * \brief The message of the last failed call on this map.
 * \param[in] map The handle (NULL gives a fixed message).
 * \return A NUL-terminated copy owned by the library, valid in the calling
 *         thread until its next ep_moe call; "" when no call on the map failed.
 */
EP_MOE_API const char* ep_moe_expert_map_last_error(const ep_moe_expert_map_t* map);

/** \brief Integer attributes of an expert map, for ep_moe_expert_map_get_attr(). */
typedef enum ep_moe_map_attr {
  EP_MOE_MAP_ATTR_EP_SIZE = 0,              /**< Ranks in the EP group. */
  EP_MOE_MAP_ATTR_EP_RANK = 1,              /**< This rank. */
  EP_MOE_MAP_ATTR_GLOBAL_NUM_EXPERTS = 2,   /**< Logical routed experts E. */
  EP_MOE_MAP_ATTR_NUM_FUSED_SHARED = 3,     /**< Fused shared experts S. */
  EP_MOE_MAP_ATTR_NUM_PHYSICAL = 4,         /**< Physical slots P over all ranks. */
  EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED = 5,     /**< Slots of routed experts on this rank (may be 0). */
  EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL = 6,      /**< Local routed slots + S. */
  EP_MOE_MAP_ATTR_PLACEMENT = 7,            /**< Effective ::ep_moe_placement_t. */
  EP_MOE_MAP_ATTR_REQUESTED_PLACEMENT = 8,  /**< Placement the config asked for. */
  EP_MOE_MAP_ATTR_FELL_BACK = 9,            /**< 1 when the requested placement fell back to linear. */
  EP_MOE_MAP_ATTR_NUM_REDUNDANT = 10,       /**< P - E. */
  EP_MOE_MAP_ATTR_MAX_SLOTS_PER_RANK = 11   /**< Largest number of routed slots on any rank. */
} ep_moe_map_attr_t;

/**
 * \brief Reads one integer attribute of the map.
 * \param[out] out  Receives the value.
 * \param[in]  map  The handle.
 * \param[in]  attr Which attribute.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE, or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (NULL out, unknown attr).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_get_attr(int32_t* out, const ep_moe_expert_map_t* map,
                                                      ep_moe_map_attr_t attr);

/**
 * \brief Maps a global expert id to this rank's local id.
 * \param[out] out       Receives the local id, or -1 when the expert has no
 *                       slot on this rank. With replicas on this rank, the
 *                       lowest local id.
 * \param[in]  map       The handle.
 * \param[in]  global_id In [0, E + S).
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (id out of range, NULL out).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_global_to_local(int32_t* out,
                                                             const ep_moe_expert_map_t* map,
                                                             int32_t global_id);

/**
 * \brief Maps a local id of this rank to its global expert id.
 * \param[out] out      Receives the global id (E + i for fused shared expert i).
 * \param[in]  map      The handle.
 * \param[in]  local_id In [0, NUM_LOCAL_TOTAL).
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (id out of range, NULL out).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_local_to_global(int32_t* out,
                                                             const ep_moe_expert_map_t* map,
                                                             int32_t local_id);

/**
 * \brief Whether a global expert has a slot on this rank.
 * \param[out] out       Receives 1 or 0.
 * \param[in]  map       The handle.
 * \param[in]  global_id In [0, E + S).
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_is_local(int32_t* out, const ep_moe_expert_map_t* map,
                                                      int32_t global_id);

/** \brief The tables an expert map can copy out; the lengths are in the
 *  documentation of each value and from ep_moe_expert_map_table_length(). */
typedef enum ep_moe_map_table {
  /** Global -> local id, -1 when not local (seed "expert_map"). Length E + S;
   *  entries E .. E+S-1 are the fused shared experts (n_local + i). */
  EP_MOE_MAP_TABLE_EXPERT_MAP = 0,
  /** 1 where the expert has a slot on this rank, then S ones for the shared
   *  experts, then a trailing 0 sentinel. Length E + S + 1. */
  EP_MOE_MAP_TABLE_EXPERT_MASK = 1,
  /** Local id -> global id. Length NUM_LOCAL_TOTAL. */
  EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL = 2,
  /** Global expert -> physical slot (its first replica). Length E. For
   *  linear placement without redundancy this is the identity. */
  EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL = 3,
  /** Physical slot -> global expert. Length P. */
  EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL = 4,
  /** Physical slot -> owning rank. Length P. */
  EP_MOE_MAP_TABLE_SLOT_RANK = 5,
  /** Number of slots of each rank. Length ep_size. */
  EP_MOE_MAP_TABLE_SLOTS_PER_RANK = 6,
  /** Number of replicas (slots) of each global expert. Length E. */
  EP_MOE_MAP_TABLE_REPLICA_COUNT = 7
} ep_moe_map_table_t;

/**
 * \brief Number of int32 entries of a table.
 * \param[out] out   Receives the length.
 * \param[in]  map   The handle.
 * \param[in]  table Which table.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (NULL out, unknown table).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_table_length(size_t* out,
                                                          const ep_moe_expert_map_t* map,
                                                          ep_moe_map_table_t table);

/**
 * \brief Copies a table into a caller buffer.
 * \param[out] out     Buffer of at least the table's length int32 entries.
 * \param[in]  out_len Capacity of `out` in entries.
 * \param[in]  map     The handle.
 * \param[in]  table   Which table.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_BUFFER_TOO_SMALL (nothing written) when
 *         `out_len` is less than the table's length; ::EP_MOE_ERR_INVALID_HANDLE;
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (NULL out with a non-empty table,
 *         unknown table).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_copy_table(int32_t* out, size_t out_len,
                                                        const ep_moe_expert_map_t* map,
                                                        ep_moe_map_table_t table);

/**
 * \brief Writes the compressed "local->global" description of this rank's
 *        experts, e.g. "0->4, 1->5, 2->6" ("[0..E-1]" when ep_size is 1),
 *        snprintf-style.
 * \param[out] out        Buffer for the NUL-terminated text; may be NULL
 *                        when `out_size` is 0. Truncated text is still
 *                        NUL-terminated.
 * \param[in]  out_size   Capacity of `out` in bytes.
 * \param[out] out_needed Receives the full length without the NUL; may be NULL.
 * \param[in]  map        The handle.
 * \return ::EP_MOE_OK (also when truncated: compare *out_needed with
 *         out_size), ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (NULL out with out_size > 0).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_describe(char* out, size_t out_size, size_t* out_needed,
                                                      const ep_moe_expert_map_t* map);

/** \brief Element types of tensors. */
typedef enum ep_moe_dtype {
  EP_MOE_DTYPE_F32 = 0,  /**< IEEE binary32. */
  EP_MOE_DTYPE_BF16 = 1, /**< bfloat16 (upper half of a binary32). */
  EP_MOE_DTYPE_F16 = 2   /**< IEEE binary16. */
} ep_moe_dtype_t;

/** \brief What ep_moe_mask_and_remap() writes for pairs whose expert is not
 *  on this rank. */
typedef enum ep_moe_remap_mode {
  /** The seed's rule: local id = global id % n_local (spreads the dead pairs
   *  over the local experts so none is inflated), weight 0. A rank with no
   *  routed experts writes -1. */
  EP_MOE_REMAP_SPREAD = 0,
  /** Local id -1, weight 0: for kernels that skip negative ids. */
  EP_MOE_REMAP_MINUS_ONE = 1
} ep_moe_remap_mode_t;

/**
 * \brief Masks non-local (token, expert) pairs and remaps global ids to local
 *        ids, for runtimes that run their own expert kernels.
 *
 * For each of the num_tokens * top_k pairs: when the expert has a slot on this
 * rank, the local id and the weight are kept and the mask is 1; otherwise the
 * id follows `mode`, the weight becomes 0 and the mask 0. Every id is checked
 * before anything is written, so a failed call writes nothing. The outputs may
 * alias the inputs (in-place).
 *
 * \param[out] out_ids     [num_tokens, top_k] local ids.
 * \param[out] out_weights [num_tokens, top_k] weights of `weights_dtype`.
 * \param[out] out_mask    [num_tokens, top_k] 1 for local pairs, else 0; may
 *                         be NULL.
 * \param[in]  map         The handle.
 * \param[in]  topk_ids    [num_tokens, top_k] global ids in [0, E + S).
 * \param[in]  topk_weights [num_tokens, top_k] routing weights.
 * \param[in]  weights_dtype Type of both weight arrays (f32, bf16 or f16).
 * \param[in]  num_tokens  Rows (>= 0; with 0 the pointers may be NULL).
 * \param[in]  top_k       Columns (>= 1).
 * \param[in]  mode        ::ep_moe_remap_mode_t.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT naming the bad argument
 *         (NULL buffer, negative count, unknown mode or dtype, an id out of
 *         range: the message names the token and slot);
 *         ::EP_MOE_ERR_INVALID_HANDLE.
 */
EP_MOE_API ep_moe_status_t ep_moe_mask_and_remap(int32_t* out_ids, void* out_weights, uint8_t* out_mask,
                                                 const ep_moe_expert_map_t* map, const int32_t* topk_ids,
                                                 const void* topk_weights, ep_moe_dtype_t weights_dtype,
                                                 int64_t num_tokens, int32_t top_k, ep_moe_remap_mode_t mode);

/** @} */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EP_MOE_EP_MOE_H */
