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
 * \brief The ep_moe C API: base (statuses, versions, features, logging),
 *        expert map manager, communicators, MoE layer, checkpoints and
 *        expert load balancing.
 *
 * Conventions shared by every function of this header:
 * - Every function that can fail returns an ::ep_moe_status_t. ::EP_MOE_OK is
 *   0; every other value is an error. A failed call leaves its out-parameters
 *   untouched and its handle usable.
 * - Out-parameters come first and are named `out` (or `out_<what>`).
 * - Handles are opaque. `ep_moe_<x>_create()` allocates one; the matching
 *   `ep_moe_<x>_destroy()` frees it and accepts NULL. Functions taking a
 *   `const` handle may run on it from several threads at once; a function
 *   taking a non-const handle must not overlap with any other call on that
 *   handle (the caller synchronises), except ep_moe_comm_abort(). Where a
 *   layer's calls overlap all the same, the later one returns
 *   ::EP_MOE_ERR_STATE naming the call in flight; a destroy or close waits
 *   for the calls in flight on its handle (a layer's load from a checkpoint
 *   holds both) and later calls return ::EP_MOE_ERR_INVALID_HANDLE.
 * - Configuration structs start with `size_t struct_size` and must be filled
 *   by their `*_config_init()` function before fields are changed. A struct
 *   whose `struct_size` this library does not know is rejected with
 *   ::EP_MOE_ERR_STRUCT_SIZE.
 * - The library never prints, aborts or throws; it talks only through return
 *   values, ep_moe_last_error(), the per-handle `*_last_error()` functions and
 *   an optional log callback (ep_moe_set_log_callback(); or stderr, when the
 *   environment sets `EP_MOE_LOG_LEVEL`).
 */

/** \defgroup ep_moe_base Base: export macro, versions, statuses, errors, logging
 *  @{ */

/** \brief Marks a symbol exported from libep_moe (everything else is hidden). */
#if defined(_WIN32)
#if defined(EP_MOE_BUILDING_LIBRARY)
#define EP_MOE_API __declspec(dllexport)
#else
#define EP_MOE_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define EP_MOE_API __attribute__((visibility("default")))
#else
#define EP_MOE_API
#endif

/** \brief Major version: bumped on an incompatible ABI change (it is also the
 *  shared library's SOVERSION). */
#define EP_MOE_VERSION_MAJOR 0
/** \brief Minor version: bumped when features are added compatibly. */
#define EP_MOE_VERSION_MINOR 4
/** \brief Patch version: bumped for fixes only. */
#define EP_MOE_VERSION_PATCH 0
/** \brief The version as one number: major * 10000 + minor * 100 + patch. */
#define EP_MOE_VERSION_NUMBER (EP_MOE_VERSION_MAJOR * 10000 + EP_MOE_VERSION_MINOR * 100 + EP_MOE_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/**
 * \brief Status codes. The numbers are fixed; new codes are only appended.
 */
typedef enum ep_moe_status {
  EP_MOE_OK = 0,                   /**< Success. */
  EP_MOE_ERR_INVALID_ARGUMENT = 1, /**< An argument is NULL, out of range or inconsistent. */
  EP_MOE_ERR_OUT_OF_MEMORY = 2,    /**< An allocation failed. */
  EP_MOE_ERR_UNSUPPORTED = 3,      /**< The feature is not built into this library or not available here. */
  EP_MOE_ERR_BUFFER_TOO_SMALL = 4, /**< A caller buffer is smaller than the data to copy. */
  EP_MOE_ERR_STRUCT_SIZE =
      5, /**< A config struct's `struct_size` is unknown (uninitialised, or from a newer header). */
  EP_MOE_ERR_INVALID_HANDLE = 6, /**< A handle is NULL, destroyed, or of the wrong type. */
  EP_MOE_ERR_INTERNAL = 7,       /**< A bug in ep_moe; the message says where. */
  EP_MOE_ERR_TIMEOUT = 8,        /**< A blocking operation did not complete in time. */
  EP_MOE_ERR_ABORTED = 9,        /**< The operation was aborted. */
  EP_MOE_ERR_REMOTE = 10,        /**< A peer rank failed; the communicator is broken. */
  EP_MOE_ERR_IO = 11,            /**< A file could not be opened or read. */
  EP_MOE_ERR_FORMAT = 12,        /**< A file or buffer is malformed. */
  EP_MOE_ERR_NOT_FOUND = 13,     /**< A named item (tensor, key) does not exist. */
  EP_MOE_ERR_STATE = 14,         /**< The call is not valid in the handle's current state. */
  EP_MOE_ERR_DEVICE = 15,        /**< A CUDA or cuBLASLt call failed; the message names it and the CUDA error. */
  /** \cond RANGE */
  EP_MOE_STATUS_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_STATUS_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
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
 * \brief Features a library may have, as bits for ep_moe_has_feature().
 *
 * The CUDA, NCCL and cuBLASLt features live in the module
 * `libep_moe_cuda.so`, MPI in `libep_moe_mpi.so`, installed beside
 * libep_moe.so and loaded at their first use (`EP_MOE_BACKEND_DIR` names
 * another directory): libep_moe.so itself needs none of their libraries, so
 * it loads and runs its CPU path on a host without them.
 */
typedef enum ep_moe_feature {
  EP_MOE_FEATURE_CPU = 1u << 0,        /**< CPU kernels (always built). */
  EP_MOE_FEATURE_CUDA = 1u << 1,       /**< CUDA layer backend loaded (layers with a `device`; cuBLASLt). */
  EP_MOE_FEATURE_NCCL = 1u << 2,       /**< NCCL communicator loaded. */
  EP_MOE_FEATURE_CUBLASLT = 1u << 3,   /**< cuBLASLt expert GEMMs loaded. */
  EP_MOE_FEATURE_MPI = 1u << 4,        /**< MPI communicator loaded. */
  EP_MOE_FEATURE_LOCAL_COMM = 1u << 5, /**< In-process communicator (always built). */
  EP_MOE_FEATURE_CALLBACKS = 1u << 6,  /**< Host-callback communicator (always built). */
  EP_MOE_FEATURE_ONEDNN = 1u << 7,     /**< oneDNN matrix engine loaded (libep_moe_onednn.so: bf16 prefill on AMX). */
  /** \cond RANGE */
  EP_MOE_FEATURE_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_FEATURE_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_feature_t;

/**
 * \brief Whether this library has every feature in a mask.
 *
 * Asking for a module's feature loads the module (once; a missing module,
 * or one whose CUDA / NCCL / MPI libraries are missing, is logged at
 * ::EP_MOE_LOG_INFO with the loader's reason, and the feature is absent).
 * A loaded CUDA backend does not mean a GPU is present: creating a layer on
 * a device says so.
 * \param[in] features A bitwise OR of ::ep_moe_feature_t values.
 * \return 1 when every bit is a known feature this library has, 0
 *         otherwise (also for 0 and for unknown bits).
 */
EP_MOE_API int ep_moe_has_feature(uint32_t features);

/** \brief Severity of a log message; a callback receives levels up to the
 *  maximum it was installed with. */
typedef enum ep_moe_log_level {
  EP_MOE_LOG_ERROR = 0, /**< An operation failed. */
  EP_MOE_LOG_WARN = 1,  /**< Something was changed or ignored (e.g. a placement fallback). */
  EP_MOE_LOG_INFO = 2,  /**< One line per significant event (a layout, a mode choice). */
  EP_MOE_LOG_DEBUG = 3, /**< Details for debugging. */
  /** \cond RANGE */
  EP_MOE_LOG_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_LOG_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_log_level_t;

/**
 * \brief A log callback.
 * \param[in] level     Severity of the message.
 * \param[in] message   NUL-terminated text, valid only during the call.
 * \param[in] user_data The pointer given to ep_moe_set_log_callback().
 *
 * It may be called from any thread that calls into ep_moe; the library
 * serialises the calls. It may call back into ep_moe on its thread (to
 * read ep_moe_last_error(), or to replace or remove itself): what those
 * nested calls would log is not passed to it, and a nested call that fails
 * replaces the thread's ep_moe_last_error(). It must not wait for another
 * thread that calls into ep_moe.
 */
typedef void (*ep_moe_log_fn)(ep_moe_log_level_t level, const char* message, void* user_data);

/**
 * \brief Installs (or, with NULL, removes) the process-wide log callback.
 *
 * Without a callback ep_moe writes nothing anywhere, unless the environment
 * variable `EP_MOE_LOG_LEVEL` (`error`, `warn`, `info`, `debug` or 0-3) was
 * set when the library was loaded: messages up to that level then go to
 * stderr until a callback is installed (or logging removed with NULL).
 * Every failed call is logged at ::EP_MOE_LOG_ERROR with its message;
 * ep_moe_layer_load() reports its progress at ::EP_MOE_LOG_INFO.
 * \param[in] fn        The callback, or NULL to stop logging.
 * \param[in] max_level The most verbose level passed to `fn`.
 * \param[in] user_data Passed to every call of `fn`; borrowed until the
 *                      callback is replaced or removed.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT for a level outside
 *         ::ep_moe_log_level_t.
 */
EP_MOE_API ep_moe_status_t ep_moe_set_log_callback(ep_moe_log_fn fn, ep_moe_log_level_t max_level, void* user_data);

/** \brief Element types of tensors. Weights and activations use the three
 *  floating-point types; routed experts' weights may also be in one of the
 *  GGUF block formats (see below); communicator collectives also move
 *  integers.
 *
 *  The block formats are exactly GGUF's (ggml's block_q8_0, block_q4_0,
 *  block_q4_K, ... of the same names): a row of
 *  `cols` elements is `cols / block_elems` blocks of `block_bytes` each, the
 *  rows one after another (a [rows, cols] matrix is rows x cols / block_elems
 *  blocks). `cols` must be a multiple of the block's elements:
 *  Q8_0, Q4_0, MXFP4 32 elements in 34, 18, 17 bytes; Q4_K, Q5_K, Q6_K and
 *  IQ4_XS 256 elements in 144, 176, 210 and 136 bytes; Q4_1, Q5_0, Q5_1,
 *  IQ4_NL 32 in 20, 22, 24, 18; Q2_K, Q3_K, IQ2_XXS, IQ2_XS, IQ2_S,
 *  IQ3_XXS, IQ3_S, IQ1_S, IQ1_M 256 in 84, 110, 66, 74, 82, 98, 110, 50, 56;
 *  FP8_E4M3 (ep_moe's block-scaled FP8) 128 in 132 (ep_moe_dtype_block()). CPU layers keep routed and shared experts in
 *  these formats and compute on them (the shared expert's down where this
 *  rank's columns of it are whole blocks; docs/quantization.md); the router
 *  is dequantized at store, as is every weight of a CUDA layer. */
typedef enum ep_moe_dtype {
  EP_MOE_DTYPE_F32 = 0,     /**< IEEE binary32. */
  EP_MOE_DTYPE_BF16 = 1,    /**< bfloat16 (upper half of a binary32). */
  EP_MOE_DTYPE_F16 = 2,     /**< IEEE binary16. */
  EP_MOE_DTYPE_I32 = 3,     /**< int32_t (collectives only). */
  EP_MOE_DTYPE_I64 = 4,     /**< int64_t (collectives only). */
  EP_MOE_DTYPE_U8 = 5,      /**< uint8_t, raw bytes (collectives only; sums wrap). */
  EP_MOE_DTYPE_Q8_0 = 6,    /**< GGUF Q8_0: 32 int8 and an f16 scale (weights only). */
  EP_MOE_DTYPE_Q4_0 = 7,    /**< GGUF Q4_0: 32 4-bit values, offset 8, f16 scale (weights only). */
  EP_MOE_DTYPE_Q4_K = 8,    /**< GGUF Q4_K: 256 4-bit values, 8 6-bit scales and mins (weights only). */
  EP_MOE_DTYPE_Q5_K = 9,    /**< GGUF Q5_K: 256 5-bit values, 8 6-bit scales and mins (weights only). */
  EP_MOE_DTYPE_Q6_K = 10,   /**< GGUF Q6_K: 256 6-bit values, 16 int8 scales (weights only). */
  EP_MOE_DTYPE_IQ4_XS = 11, /**< GGUF IQ4_XS: 256 4-bit indices into a non-linear table, 6-bit scales (weights only). */
  EP_MOE_DTYPE_MXFP4 = 12,  /**< GGUF MXFP4 (OCP MX): 32 FP4 E2M1 values, an E8M0 scale (weights only). */
  EP_MOE_DTYPE_Q2_K = 13,   /**< GGUF Q2_K: 256 2-bit values, 16 4-bit scales and mins (weights only). */
  EP_MOE_DTYPE_Q3_K = 14,   /**< GGUF Q3_K: 256 3-bit values, 16 6-bit scales (weights only). */
  EP_MOE_DTYPE_Q4_1 = 15,   /**< GGUF Q4_1: 32 4-bit values, f16 scale and min (weights only). */
  EP_MOE_DTYPE_Q5_0 = 16,   /**< GGUF Q5_0: 32 5-bit values, offset 16, f16 scale (weights only). */
  EP_MOE_DTYPE_Q5_1 = 17,   /**< GGUF Q5_1: 32 5-bit values, f16 scale and min (weights only). */
  EP_MOE_DTYPE_IQ4_NL = 18, /**< GGUF IQ4_NL: 32 4-bit indices into a non-linear table (weights only). */
  EP_MOE_DTYPE_IQ2_XXS = 19, /**< GGUF IQ2_XXS: 8-value grid points and signs, 2.06 bits a value (weights only). */
  EP_MOE_DTYPE_IQ2_XS = 20,  /**< GGUF IQ2_XS: a 512-point grid and signs, 2.31 bits a value (weights only). */
  EP_MOE_DTYPE_IQ2_S = 21,   /**< GGUF IQ2_S: a 1024-point grid and signs, 2.56 bits a value (weights only). */
  EP_MOE_DTYPE_IQ3_XXS = 22, /**< GGUF IQ3_XXS: 4-value grid points and signs, 3.06 bits a value (weights only). */
  EP_MOE_DTYPE_IQ3_S = 23,   /**< GGUF IQ3_S: a 512-point grid and signs, 3.44 bits a value (weights only). */
  EP_MOE_DTYPE_IQ1_S = 24,   /**< GGUF IQ1_S: a ternary grid with a shift, 1.56 bits a value (weights only). */
  EP_MOE_DTYPE_IQ1_M = 25,   /**< GGUF IQ1_M: a ternary grid, scales per 16, 1.75 bits a value (weights only). */
  /** FP8 E4M3 (OCP E4M3FN: no infinities, S.1111.111 is NaN) with one f32
   *  scale per 128 elements of a row, the block-scaled FP8 of the
   *  DeepSeek-V3, Kimi-K2 and Qwen3 -FP8 releases: a block is the f32 scale
   *  (little endian) then 128 E4M3 codes, 132 bytes; an element is the
   *  scale times its code's value. ep_moe_fp8_pack() builds these rows from
   *  a checkpoint's [rows, cols] codes and [ceil(rows/128), cols/128]
   *  weight_scale_inv (weights only). */
  EP_MOE_DTYPE_FP8_E4M3 = 26,
  /** \cond RANGE */
  EP_MOE_DTYPE_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_DTYPE_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_dtype_t;

/**
 * \brief The block geometry of a dtype: a row of `cols` elements takes
 * cols / *out_elems blocks of *out_bytes bytes (1 element of its size for
 * the plain types).
 * \param[out] out_elems Elements per block (may be NULL).
 * \param[out] out_bytes Bytes per block (may be NULL).
 * \param[in]  dtype     Any ::ep_moe_dtype_t value.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT for a value that is
 *         not a dtype (the outputs are then left as they were).
 * \since 0.4
 */
EP_MOE_API ep_moe_status_t ep_moe_dtype_block(int64_t* out_elems, int64_t* out_bytes, ep_moe_dtype_t dtype);

/**
 * \brief The name of a dtype as the demo and the benchmarks take it: "f32",
 * "bf16", "f16", "i32", "i64", "u8", and for the block formats GGUF's type
 * name in lower case ("q4_k", "iq2_xxs", ...).
 * \param[in] dtype Any value.
 * \return A static string, or NULL for a value that is not a dtype.
 * \since 0.4
 */
EP_MOE_API const char* ep_moe_dtype_name(ep_moe_dtype_t dtype);

/**
 * \brief Quantizes a [rows, cols] f32 matrix into a block format, row by
 * row (ep_moe's own quantizers: one scale per sub-block from its range,
 * values rounded to the nearest level or grid point; docs/quantization.md).
 * For weights a caller holds in floats and wants kept in blocks of
 * another format than the layer's weight_dtype (a down projection in
 * Q3_K beside gate/up in IQ2_XXS, as GGUF "dynamic" quants lay out).
 * \param[out] out   rows x cols / block_elems blocks (ep_moe_dtype_block()).
 * \param[in]  dtype A block format (EP_MOE_DTYPE_Q8_0 ...).
 * \param[in]  in    rows x cols finite floats, row-major.
 * \param[in]  rows  >= 0.
 * \param[in]  cols  >= 0, a multiple of the format's block elements.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT (a dtype that is
 *         not a block format, NULL pointers with elements to convert, a
 *         shape that is not whole blocks, a non-finite input, named by
 *         its row and column); `out` is untouched on failure.
 * \since 0.4
 */
EP_MOE_API ep_moe_status_t ep_moe_quantize(void* out, ep_moe_dtype_t dtype, const float* in, int64_t rows,
                                           int64_t cols);

/**
 * \brief Dequantizes a [rows, cols] matrix of blocks into f32, exactly as
 * GGUF defines each format (bit for bit gguf.quants.dequantize's values).
 * \param[out] out   rows x cols floats.
 * \param[in]  in    rows x cols / block_elems blocks of dtype.
 * \param[in]  dtype A block format.
 * \param[in]  rows  >= 0.
 * \param[in]  cols  >= 0, a multiple of the format's block elements.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT as for
 *         ep_moe_quantize().
 * \since 0.4
 */
EP_MOE_API ep_moe_status_t ep_moe_dequantize(float* out, const void* in, ep_moe_dtype_t dtype, int64_t rows,
                                             int64_t cols);

/**
 * \brief Packs block-scaled FP8 weights as the DeepSeek-V3 release stores
 * them (`weight` F8_E4M3 [rows, cols], `weight_scale_inv` F32
 * [ceil(rows / 128), cols / 128], element (r, c) = code(r, c) x
 * scale_inv[r / 128][c / 128]) into ::EP_MOE_DTYPE_FP8_E4M3 rows, which
 * ep_moe_layer_set_weight() keeps as they are (1 byte a weight).
 * \param[out] out       rows x cols / 128 blocks of 132 bytes.
 * \param[in]  weight    rows x cols E4M3FN codes, row-major.
 * \param[in]  scale_inv ceil(rows / 128) x cols / 128 finite floats.
 * \param[in]  rows      >= 0 (a last partial block of rows is allowed).
 * \param[in]  cols      >= 0, a multiple of 128.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT (columns that are
 *         not whole blocks, NULL pointers with elements to pack, a
 *         non-finite scale or an E4M3 NaN code, named by its row and
 *         column); `out` is untouched on failure.
 * \since 0.4
 */
EP_MOE_API ep_moe_status_t ep_moe_fp8_pack(void* out, const uint8_t* weight, const float* scale_inv, int64_t rows,
                                           int64_t cols);

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
  EP_MOE_PLACEMENT_CUSTOM = 2,
  /** \cond RANGE */
  EP_MOE_PLACEMENT_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_PLACEMENT_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
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
EP_MOE_API ep_moe_status_t ep_moe_expert_map_update(ep_moe_expert_map_t* map, const ep_moe_expert_map_config_t* config);

/**
 * \brief The message of the last failed call on this map.
 * \param[in] map The handle (NULL gives a fixed message).
 * \return A NUL-terminated copy owned by the library, valid in the calling
 *         thread until its next ep_moe call; "" when no call on the map failed.
 */
EP_MOE_API const char* ep_moe_expert_map_last_error(const ep_moe_expert_map_t* map);

/** \brief Integer attributes of an expert map, for ep_moe_expert_map_get_attr(). */
typedef enum ep_moe_map_attr {
  EP_MOE_MAP_ATTR_EP_SIZE = 0,             /**< Ranks in the EP group. */
  EP_MOE_MAP_ATTR_EP_RANK = 1,             /**< This rank. */
  EP_MOE_MAP_ATTR_GLOBAL_NUM_EXPERTS = 2,  /**< Logical routed experts E. */
  EP_MOE_MAP_ATTR_NUM_FUSED_SHARED = 3,    /**< Fused shared experts S. */
  EP_MOE_MAP_ATTR_NUM_PHYSICAL = 4,        /**< Physical slots P over all ranks. */
  EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED = 5,    /**< Slots of routed experts on this rank (may be 0). */
  EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL = 6,     /**< Local routed slots + S. */
  EP_MOE_MAP_ATTR_PLACEMENT = 7,           /**< Effective ::ep_moe_placement_t. */
  EP_MOE_MAP_ATTR_REQUESTED_PLACEMENT = 8, /**< Placement the config asked for. */
  EP_MOE_MAP_ATTR_FELL_BACK = 9,           /**< 1 when the requested placement fell back to linear. */
  EP_MOE_MAP_ATTR_NUM_REDUNDANT = 10,      /**< P - E. */
  EP_MOE_MAP_ATTR_MAX_SLOTS_PER_RANK = 11, /**< Largest number of routed slots on any rank. */
  /** \cond RANGE */
  EP_MOE_MAP_ATTR_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_MAP_ATTR_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
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
EP_MOE_API ep_moe_status_t ep_moe_expert_map_global_to_local(int32_t* out, const ep_moe_expert_map_t* map,
                                                             int32_t global_id);

/**
 * \brief Maps a local id of this rank to its global expert id.
 * \param[out] out      Receives the global id (E + i for fused shared expert i).
 * \param[in]  map      The handle.
 * \param[in]  local_id In [0, NUM_LOCAL_TOTAL).
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (id out of range, NULL out).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_local_to_global(int32_t* out, const ep_moe_expert_map_t* map,
                                                             int32_t local_id);

/**
 * \brief Whether a global expert has a slot on this rank.
 * \param[out] out       Receives 1 or 0.
 * \param[in]  map       The handle.
 * \param[in]  global_id In [0, E + S).
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_is_local(int32_t* out, const ep_moe_expert_map_t* map, int32_t global_id);

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
  EP_MOE_MAP_TABLE_REPLICA_COUNT = 7,
  /** \cond RANGE */
  EP_MOE_MAP_TABLE_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_MAP_TABLE_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_map_table_t;

/**
 * \brief Number of int32 entries of a table.
 * \param[out] out   Receives the length.
 * \param[in]  map   The handle.
 * \param[in]  table Which table.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or
 *         ::EP_MOE_ERR_INVALID_ARGUMENT (NULL out, unknown table).
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_table_length(size_t* out, const ep_moe_expert_map_t* map,
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
EP_MOE_API ep_moe_status_t ep_moe_expert_map_copy_table(int32_t* out, size_t out_len, const ep_moe_expert_map_t* map,
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

/** \brief What ep_moe_mask_and_remap() writes for pairs whose expert is not
 *  on this rank. */
typedef enum ep_moe_remap_mode {
  /** The seed's rule: local id = global id % n_local (spreads the dead pairs
   *  over the local experts so none is inflated), weight 0. A rank with no
   *  routed experts writes -1. */
  EP_MOE_REMAP_SPREAD = 0,
  /** Local id -1, weight 0: for kernels that skip negative ids. */
  EP_MOE_REMAP_MINUS_ONE = 1,
  /** \cond RANGE */
  EP_MOE_REMAP_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_REMAP_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
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

/** \defgroup ep_moe_comm Communicators
 *  \brief Groups of ranks and their collectives.
 *
 * A communicator handle is one rank's view of a group. Collectives are
 * blocking and must be called by every rank of the group in the same order.
 * Each blocking call honours the communicator's timeout and an abort
 * (ep_moe_comm_abort()) from another thread, and then returns an error
 * instead of hanging. After ::EP_MOE_ERR_TIMEOUT, ::EP_MOE_ERR_ABORTED or
 * ::EP_MOE_ERR_REMOTE from a collective the group is broken: every later
 * collective on it fails at once. When one rank passes bad arguments, the
 * others are told (they return ::EP_MOE_ERR_REMOTE) and the group stays
 * usable.
 *
 * Reductions of f32, bf16 and f16 accumulate in f32 in rank order, so
 * every rank receives bit-identical results; i32 and i64 sum exactly.
 * `stream` arguments carry a `cudaStream_t` for device backends and are
 * ignored by the CPU backends.
 *  @{ */

/** \brief One rank's handle on a communicator. Opaque. */
typedef struct ep_moe_comm ep_moe_comm_t;

/** \brief Communicator settings; fill with ep_moe_comm_config_init() first. */
typedef struct ep_moe_comm_config {
  /** Size of this struct as the caller compiled it; set by ep_moe_comm_config_init(). */
  size_t struct_size;
  /** Longest a blocking call waits for the other ranks, in milliseconds
   *  (1 .. 86400000). Default 60000. */
  int32_t timeout_ms;
} ep_moe_comm_config_t;

/**
 * \brief Fills a communicator config with defaults and sets its struct_size.
 * \param[out] out The struct to fill.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_config_init(ep_moe_comm_config_t* out);

/**
 * \brief Creates a group of `size` in-process ranks (the `local` backend).
 *
 * Each handle is one rank and must be driven by its own thread (collectives
 * block until every rank has joined).
 * \param[out] out    Array of `size` entries; out[i] receives rank i's
 *                    handle, each owned by the caller (free each with
 *                    ep_moe_comm_destroy()). Untouched on failure.
 * \param[in]  size   Number of ranks (1 .. 4096).
 * \param[in]  config Settings, or NULL for the defaults.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_ARGUMENT, ::EP_MOE_ERR_STRUCT_SIZE
 *         or ::EP_MOE_ERR_OUT_OF_MEMORY.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_create_local(ep_moe_comm_t** out, int32_t size,
                                                    const ep_moe_comm_config_t* config);

/**
 * \brief Creates a communicator from the caller's MPI communicator (the
 *        `mpi` backend; ::EP_MOE_FEATURE_MPI).
 *
 * ep_moe duplicates the communicator (so its traffic never mixes with the
 * caller's) and uses only non-blocking collectives polled against the
 * timeout. MPI must be initialised; the rank's calls must come from a thread
 * the MPI threading level allows. Reductions are computed by ep_moe (f32 in
 * rank order), so results are bit-identical to the in-process backend's.
 * ep_moe_comm_abort() ends this process's blocked call; the other processes
 * see a timeout. Collective call (MPI_Comm_dup).
 * \param[out] out           Receives the handle (owned by the caller).
 * \param[in]  mpi_comm      Address of the caller's `MPI_Comm`.
 * \param[in]  mpi_comm_size `sizeof(MPI_Comm)` as the caller compiled it (a
 *                           check that caller and library use the same MPI).
 * \param[in]  config        Settings, or NULL for the defaults.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_UNSUPPORTED (built without MPI);
 *         ::EP_MOE_ERR_STATE (MPI not initialised);
 *         ::EP_MOE_ERR_INVALID_ARGUMENT; ::EP_MOE_ERR_REMOTE (an MPI error).
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_create_mpi(ep_moe_comm_t** out, const void* mpi_comm, size_t mpi_comm_size,
                                                  const ep_moe_comm_config_t* config);

/**
 * \brief Creates a communicator over the caller's NCCL communicator (the
 *        `nccl` backend; ::EP_MOE_FEATURE_NCCL). Buffers are device memory;
 *        collectives are enqueued on the `stream` given to each call, and the
 *        call waits for them (polling, with the timeout) unless the stream is
 *        being captured into a CUDA graph.
 * \param[out] out       Receives the handle (owned by the caller).
 * \param[in]  nccl_comm The caller's `ncclComm_t`, borrowed: never destroyed
 *                       or aborted by ep_moe; it must outlive the handle.
 * \param[in]  config    Settings, or NULL for the defaults.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_UNSUPPORTED (built without NCCL, or no
 *         CUDA device); ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_create_nccl(ep_moe_comm_t** out, void* nccl_comm,
                                                   const ep_moe_comm_config_t* config);

/**
 * \brief Creates an NCCL unique id (on one rank; send it to the others).
 * \param[out] out      Buffer for the id.
 * \param[in]  out_size Its size: at least 128 bytes (`sizeof(ncclUniqueId)`).
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_UNSUPPORTED, ::EP_MOE_ERR_INVALID_ARGUMENT
 *         or ::EP_MOE_ERR_REMOTE.
 */
EP_MOE_API ep_moe_status_t ep_moe_nccl_get_unique_id(void* out, size_t out_size);

/**
 * \brief Creates an NCCL communicator of its own from a unique id (collective
 *        over the `size` ranks; each calls it with its rank on its current
 *        CUDA device). ep_moe owns it: ep_moe_comm_destroy() destroys it, and
 *        a rank's failure aborts it so the peers never wait forever.
 * \param[out] out            Receives the handle.
 * \param[in]  unique_id      From ep_moe_nccl_get_unique_id().
 * \param[in]  unique_id_size Bytes of `unique_id` (128).
 * \param[in]  rank           This rank, in [0, size).
 * \param[in]  size           Number of ranks.
 * \param[in]  config         Settings (the timeout bounds the initialisation too), or NULL.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_UNSUPPORTED; ::EP_MOE_ERR_TIMEOUT;
 *         ::EP_MOE_ERR_REMOTE; ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_create_nccl_from_id(ep_moe_comm_t** out, const void* unique_id,
                                                           size_t unique_id_size, int32_t rank, int32_t size,
                                                           const ep_moe_comm_config_t* config);

/**
 * \brief The host runtime's collectives as callbacks (the `callbacks`
 *        backend). Fill with ep_moe_comm_callbacks_init() first.
 *
 * Every operation starts a collective and returns at once: it stores a
 * request in `*out_request` (NULL when it completed already); ep_moe then
 * polls `test` until the request is done, the communicator's timeout passes
 * (then `cancel`, if given, is called) or the communicator is aborted.
 * Buffers are those given to ep_moe; byte counts are per rank, blocks are
 * packed in rank order. Every function returns ::EP_MOE_OK or an error
 * status (which breaks the communicator). `user_data` is passed to each call.
 */
typedef struct ep_moe_comm_callbacks {
  /** Size of this struct as the caller compiled it (the table's version). */
  size_t struct_size;
  /** This rank in the host's group. */
  int32_t rank;
  /** Ranks in the host's group. */
  int32_t size;
  /** Ranks of the group in this process (threads per rank are chosen from
   *  it); 0 means 1. */
  int32_t ranks_in_process;
  /** Passed to every callback. */
  void* user_data;
  /** Required: gather `bytes` from every rank into `out` (size * bytes). */
  ep_moe_status_t (*all_gather)(void** out_request, void* out, const void* in, size_t bytes, void* user_data);
  /** Required: gather `bytes[p]` from rank p, packed in rank order. */
  ep_moe_status_t (*all_gather_v)(void** out_request, void* out, const void* in, const size_t* bytes, void* user_data);
  /** Required: send `in_bytes[p]` to rank p, receive `out_bytes[p]` from it. */
  ep_moe_status_t (*all_to_all_v)(void** out_request, void* out, const size_t* out_bytes, const void* in,
                                  const size_t* in_bytes, void* user_data);
  /** Optional (NULL: ep_moe reduces through all_to_all_v/all_gather_v): sum
   *  `count` elements of `dtype`. */
  ep_moe_status_t (*all_reduce)(void** out_request, void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                void* stream, void* user_data);
  /** Optional: sum and scatter `count` elements per rank. */
  ep_moe_status_t (*reduce_scatter)(void** out_request, void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                    void* stream, void* user_data);
  /** Optional: a barrier (NULL: the header exchange ep_moe does anyway serves). */
  ep_moe_status_t (*barrier)(void** out_request, void* user_data);
  /** Required: `*out_done` = 1 when the request completed (it is then released). */
  ep_moe_status_t (*test)(int32_t* out_done, void* request, void* user_data);
  /** Optional: give up a request after a timeout or abort. */
  void (*cancel)(void* request, void* user_data);
} ep_moe_comm_callbacks_t;

/**
 * \brief Fills a callbacks table with NULLs and sets its struct_size.
 * \param[out] out The table to fill.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_callbacks_init(ep_moe_comm_callbacks_t* out);

/**
 * \brief Creates a communicator that runs on the host's callbacks.
 * \param[out] out       Receives the handle (owned by the caller).
 * \param[in]  callbacks The table; copied (the functions and user_data must
 *                       stay valid for the handle's lifetime).
 * \param[in]  config    Settings, or NULL for the defaults.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT naming a missing
 *         required callback or a bad rank/size; ::EP_MOE_ERR_STRUCT_SIZE.
 *         Such a communicator cannot be split (::EP_MOE_ERR_UNSUPPORTED).
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_create_callbacks(ep_moe_comm_t** out, const ep_moe_comm_callbacks_t* callbacks,
                                                        const ep_moe_comm_config_t* config);

/**
 * \brief Whether the communicator is broken, and by whom.
 *
 * May be called from any thread, also while another thread is blocked in a
 * collective on the same handle (e.g. by a watchdog).
 * \param[out] out_status ::EP_MOE_OK while healthy, else the status that
 *                        broke it (::EP_MOE_ERR_TIMEOUT, ::EP_MOE_ERR_ABORTED,
 *                        ::EP_MOE_ERR_REMOTE).
 * \param[out] out_peer   The rank that failed or did not arrive, or -1 when
 *                        the backend cannot tell; may be NULL.
 * \param[in]  comm       The handle.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_get_async_error(ep_moe_status_t* out_status, int32_t* out_peer,
                                                       const ep_moe_comm_t* comm);

/**
 * \brief The backend of a communicator: "local", "mpi", "nccl" or "callbacks".
 * \param[in] comm The handle.
 * \return A static string; "invalid handle" for a NULL or dead handle.
 */
EP_MOE_API const char* ep_moe_comm_backend(const ep_moe_comm_t* comm);

/**
 * \brief Splits a communicator into sub-groups (collective over `comm`).
 *
 * Ranks passing the same `color` form one new group, ordered by `key` and
 * then by their rank in `comm`. The new group inherits the timeout; an
 * abort of `comm` also aborts the groups split from it.
 * \param[out] out   Receives the new handle (owned by the caller), or NULL
 *                   for a rank that passed a negative color.
 * \param[in]  comm  The parent communicator.
 * \param[in]  color Group selector (>= 0), or negative to join no group.
 * \param[in]  key   Ordering within the new group.
 * \return ::EP_MOE_OK or the statuses of a collective.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_split(ep_moe_comm_t** out, ep_moe_comm_t* comm, int32_t color, int32_t key);

/**
 * \brief Frees one rank's handle. NULL is accepted. Other ranks' handles
 *        stay valid; collectives they start afterwards time out or, if the
 *        group was aborted, fail at once.
 * \param[in] comm The handle; invalid after the call.
 */
EP_MOE_API void ep_moe_comm_destroy(ep_moe_comm_t* comm);

/**
 * \brief Aborts the group: blocked and later collectives on every rank of it
 *        (and of groups split from it) return ::EP_MOE_ERR_ABORTED.
 *
 * Unlike every other function taking a non-const handle, this one may be
 * called from any thread while another thread is blocked in a call on the
 * same handle. Aborting twice is harmless.
 * \param[in] comm The handle.
 * \return ::EP_MOE_OK or ::EP_MOE_ERR_INVALID_HANDLE.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_abort(ep_moe_comm_t* comm);

/**
 * \brief This rank's index in the group.
 * \param[out] out  Receives the rank.
 * \param[in]  comm The handle.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_get_rank(int32_t* out, const ep_moe_comm_t* comm);

/**
 * \brief The number of ranks in the group.
 * \param[out] out  Receives the size.
 * \param[in]  comm The handle.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_get_size(int32_t* out, const ep_moe_comm_t* comm);

/**
 * \brief Changes this rank's timeout for blocking calls.
 * \param[in,out] comm       The handle.
 * \param[in]     timeout_ms 1 .. 86400000 milliseconds.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_set_timeout(ep_moe_comm_t* comm, int32_t timeout_ms);

/**
 * \brief The message of the last failed call on this communicator.
 * \param[in] comm The handle (NULL gives a fixed message).
 * \return A NUL-terminated copy, valid in the calling thread until its next
 *         ep_moe call; "" when no call on the handle failed.
 */
EP_MOE_API const char* ep_moe_comm_last_error(const ep_moe_comm_t* comm);

/**
 * \brief Sum over all ranks: every rank receives the element-wise sum.
 * \param[out] out    `count` elements; may equal `in` (in place).
 * \param[in]  in     `count` elements of this rank.
 * \param[in]  count  Elements per rank (the same on every rank).
 * \param[in]  dtype  Any ::ep_moe_dtype_t.
 * \param[in,out] comm The handle.
 * \param[in]  stream Device stream, ignored on CPU backends.
 * \return ::EP_MOE_OK or an error status (see \ref ep_moe_comm).
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_all_reduce(void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                                  ep_moe_comm_t* comm, void* stream);

/**
 * \brief Sum over all ranks, scattered: rank r receives elements
 *        [r*count, (r+1)*count) of the sum.
 * \param[out] out    `count` elements.
 * \param[in]  in     `size * count` elements of this rank.
 * \param[in]  count  Elements each rank receives (the same on every rank).
 * \param[in]  dtype  Any ::ep_moe_dtype_t.
 * \param[in,out] comm The handle.
 * \param[in]  stream Device stream, ignored on CPU backends.
 * \return ::EP_MOE_OK or an error status.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_reduce_scatter(void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                                      ep_moe_comm_t* comm, void* stream);

/**
 * \brief Gathers equal-sized blocks: out holds rank 0's block, then rank 1's...
 * \param[out] out    `size * count` elements.
 * \param[in]  in     `count` elements of this rank.
 * \param[in]  count  Elements per rank (the same on every rank).
 * \param[in]  dtype  Any ::ep_moe_dtype_t.
 * \param[in,out] comm The handle.
 * \param[in]  stream Device stream, ignored on CPU backends.
 * \return ::EP_MOE_OK or an error status.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_all_gather(void* out, const void* in, size_t count, ep_moe_dtype_t dtype,
                                                  ep_moe_comm_t* comm, void* stream);

/**
 * \brief Gathers variable-sized blocks, packed in rank order (no padding).
 * \param[out] out    sum(counts) elements.
 * \param[in]  in     counts[rank] elements of this rank.
 * \param[in]  counts `size` entries, the same on every rank.
 * \param[in]  dtype  Any ::ep_moe_dtype_t.
 * \param[in,out] comm The handle.
 * \param[in]  stream Device stream, ignored on CPU backends.
 * \return ::EP_MOE_OK or an error status (also when ranks disagree on counts).
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_all_gather_v(void* out, const void* in, const size_t* counts,
                                                    ep_moe_dtype_t dtype, ep_moe_comm_t* comm, void* stream);

/**
 * \brief Personalised exchange: in_counts[p] elements go to rank p, and
 *        out_counts[p] elements arrive from rank p; both buffers are packed
 *        in rank order.
 * \param[out] out        sum(out_counts) elements.
 * \param[in]  out_counts `size` entries; must equal what each peer sends here.
 * \param[in]  in         sum(in_counts) elements.
 * \param[in]  in_counts  `size` entries.
 * \param[in]  dtype      Any ::ep_moe_dtype_t.
 * \param[in,out] comm    The handle.
 * \param[in]  stream     Device stream, ignored on CPU backends.
 * \return ::EP_MOE_OK or an error status (also when counts do not match).
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_all_to_all_v(void* out, const size_t* out_counts, const void* in,
                                                    const size_t* in_counts, ep_moe_dtype_t dtype, ep_moe_comm_t* comm,
                                                    void* stream);

/**
 * \brief Returns when every rank has called it (or on timeout/abort).
 * \param[in,out] comm The handle.
 * \return ::EP_MOE_OK or an error status.
 */
EP_MOE_API ep_moe_status_t ep_moe_comm_barrier(ep_moe_comm_t* comm);

/** @} */

/** \defgroup ep_moe_layer MoE layer
 *  \brief One MoE layer, run across the ranks of an expert-parallel group.
 *
 * Data flow of ep_moe_layer_forward() on one rank:
 * route (or take the caller's top-k) -> gather the tokens of every DP
 * replica (DP attention only) -> plan the (token, expert) pairs whose expert
 * lives on this rank (the others are skipped entirely) -> expert FFNs ->
 * weighted combine in token order -> + this rank's shard of the shared
 * expert -> ONE all-reduce over the EP group, or ONE reduce-scatter under DP
 * attention -> output rows of this rank's tokens.
 *
 * Topology (as in the seeds): the EP group is also the tensor-parallel group
 * of the shared expert, whose intermediate dimension is split over it; routed
 * experts keep their full size on their owner. Without DP attention every
 * EP rank passes the same tokens. With DP attention each rank passes its own
 * replica's tokens, and `dp_comm` groups one rank of every replica (when it
 * is the EP group itself, the reduction is a reduce-scatter).
 *  @{ */

/** \brief One rank's MoE layer. Opaque. */
typedef struct ep_moe_layer ep_moe_layer_t;

/** \brief Gated activation of the expert FFN: act(x W_gate^T) * (x W_up^T),
 *  with g = x W_gate^T (+ gate bias) and u = x W_up^T (+ up bias). */
typedef enum ep_moe_activation {
  EP_MOE_ACT_SILU = 0,      /**< SiLU (Qwen, DeepSeek, Mixtral): silu(g) * u. */
  EP_MOE_ACT_GELU = 1,      /**< GELU, erf form: gelu(g) * u. */
  EP_MOE_ACT_GELU_TANH = 2, /**< GELU, tanh approximation. */
  /** GPT-OSS's clamped SwiGLU: with g' = min(g, 7) and
   *  u' = clamp(u, -7, 7), (u' + 1) * g' * sigmoid(1.702 g') (GPT-OSS's
   *  alpha and swiglu_limit; a checkpoint stating another limit is refused
   *  at ep_moe_checkpoint_layer_config()). CPU layers only. */
  EP_MOE_ACT_SWIGLU_OAI = 3,
  /** \cond RANGE */
  EP_MOE_ACT_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_ACT_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_activation_t;

/** \brief How router logits become expert scores. */
typedef enum ep_moe_scoring {
  EP_MOE_SCORING_SOFTMAX = 0, /**< Softmax over all experts. */
  EP_MOE_SCORING_SIGMOID = 1, /**< Independent sigmoid per expert (DeepSeek-V3). */
  /** \cond RANGE */
  EP_MOE_SCORING_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_SCORING_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_scoring_t;

/** \brief What happens to (token, expert) pairs whose expert is on another rank. */
typedef enum ep_moe_skip_mode {
  /** Skipped entirely: no GEMM row is spent on them (the default). */
  EP_MOE_SKIP_TOKENS = 0,
  /** The seed's strategy, kept to measure the difference: they are computed
   *  on local expert `id % n_local` with weight 0. */
  EP_MOE_SKIP_WEIGHT_ZERO = 1,
  /** \cond RANGE */
  EP_MOE_SKIP_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_SKIP_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_skip_mode_t;

/** \brief How token rows reach the experts of other ranks. */
typedef enum ep_moe_dispatch_mode {
  /** The seeds' flow: tokens are on every rank (or gathered from the DP
   *  replicas), each rank computes its experts' pairs, ONE all-reduce or
   *  reduce-scatter sums the partials (the default). */
  EP_MOE_DISPATCH_ALLGATHER = 0,
  /** DeepEP-style: tokens stay on their rank; each token row goes once to
   *  every rank that owns one of its experts (a local replica is preferred),
   *  the weighted partial sums come back and are added in token order. Each
   *  rank holds the whole shared expert and runs it on its own tokens. */
  EP_MOE_DISPATCH_ALLTOALL = 1,
  /** Per step, the mode that moves fewer bytes, decided the same way on every
   *  rank from the exchanged send counts (see ::EP_MOE_LAYER_ATTR_LAST_DISPATCH). */
  EP_MOE_DISPATCH_AUTO = 2,
  /** \cond RANGE */
  EP_MOE_DISPATCH_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_DISPATCH_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_dispatch_mode_t;

/** \brief Configuration of a layer; fill with ep_moe_layer_config_init() first. */
typedef struct ep_moe_layer_config {
  /** Size of this struct as the caller compiled it; set by ep_moe_layer_config_init(). */
  size_t struct_size;
  /** Hidden size H (>= 1). Must be set. */
  int32_t hidden_size;
  /** Intermediate size I of each routed expert (>= 1). Must be set. */
  int32_t intermediate_size;
  /** Routed experts E; must equal the expert map's. Must be set. */
  int32_t num_experts;
  /** Experts per token K (1 .. E). Must be set. */
  int32_t top_k;
  /** ::ep_moe_activation_t. Default ::EP_MOE_ACT_SILU. */
  int32_t activation;
  /** ::ep_moe_dtype_t of stored weights: f32, bf16 or f16; on CPU layers
   *  also a GGUF block format (hidden_size and intermediate_size whole
   *  blocks of it), which expert weights given in floats are quantized to.
   *  Weights given in a block format keep it whatever this says
   *  (docs/quantization.md). Default f32. */
  int32_t weight_dtype;
  /** ::ep_moe_dtype_t of hidden states and output: f32, bf16 or f16
   *  (arithmetic accumulates in f32). Default f32. */
  int32_t act_dtype;
  /** ::ep_moe_dtype_t of router logits passed to forward. Default f32. */
  int32_t router_dtype;
  /** ::ep_moe_scoring_t. Default ::EP_MOE_SCORING_SOFTMAX. */
  int32_t scoring;
  /** Nonzero: the top-k weights are divided by their sum. Default 1. */
  int32_t renormalize;
  /** Grouped top-k: number of expert groups (0 = off; else divides E). */
  int32_t num_expert_group;
  /** Grouped top-k: groups kept per token (1 .. num_expert_group). */
  int32_t topk_group;
  /** Nonzero: a per-expert score-correction bias (::EP_MOE_WEIGHT_SCORE_BIAS)
   *  is added to the scores for choosing experts (not for their weights).
   *  With it, a group's score is the sum of its two best biased scores;
   *  without it, its best score. Default 0. */
  int32_t use_score_bias;
  /** Multiplies every routed weight (after renormalisation). Default 1. */
  float routed_scaling_factor;
  /** Intermediate size of the shared expert (0 = none). Default 0. */
  int32_t shared_intermediate_size;
  /** Nonzero: the shared expert's output is scaled by sigmoid(x . w), with w
   *  given as ::EP_MOE_WEIGHT_SHARED_EXPERT_GATE (Qwen2-MoE). Default 0. */
  int32_t shared_expert_gate;
  /** Most tokens this rank passes to one forward call (>= 1). With DP
   *  attention the gathered batch may be dp_size times as large; workspace
   *  is sized for it at create time and forward allocates nothing. Default 256. */
  int32_t max_tokens;
  /** CPU threads this rank uses (0 = the machine's cores divided by the
   *  ranks of an in-process group). Default 0. */
  int32_t num_threads;
  /** ::ep_moe_skip_mode_t. Default ::EP_MOE_SKIP_TOKENS. */
  int32_t skip_mode;
  /** ::ep_moe_dispatch_mode_t. The all-to-all and auto modes need `ep_comm`,
   *  and `dp_comm` NULL or the EP group's handle (every rank its own DP
   *  replica); they keep the shared expert whole on every rank. Default
   *  ::EP_MOE_DISPATCH_ALLGATHER. */
  int32_t dispatch_mode;
  /** Where the layer runs: -1 on the CPU (default); a CUDA device ordinal
   *  for the CUDA backend (::EP_MOE_FEATURE_CUDA), whose forward takes device
   *  pointers and runs on the forward's `stream`. A CUDA layer needs
   *  `ep_comm` NULL or a device communicator (NCCL, or callbacks that take
   *  device buffers), no DP group and the all-gather dispatch; other
   *  combinations return ::EP_MOE_ERR_UNSUPPORTED at create. */
  int32_t device;
  /** CUDA layers: forwards of at most this many tokens run without any host
   *  synchronisation (device-side plan, grouped kernel that reads the
   *  per-expert counts on the device), so they can be captured in a CUDA
   *  graph; larger ones synchronise once to read the per-expert counts and
   *  call cuBLASLt per non-empty expert. A forward on a stream that is being
   *  captured always takes the synchronisation-free path. 0 .. max_tokens;
   *  default 64. Ignored on the CPU. */
  int32_t sync_free_tokens;
} ep_moe_layer_config_t;

/**
 * \brief Fills a layer config with defaults and sets its struct_size.
 * \param[out] out The struct to fill.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_config_init(ep_moe_layer_config_t* out);

/**
 * \brief Sets the fields of an expert map config that a layer config
 *        determines: `global_num_experts` (the layer's num_experts) and
 *        `num_expert_group` (its grouped top-k groups). The other fields
 *        (ep_size, ep_rank, placement, ...) are kept.
 *
 * With ep_moe_checkpoint_layer_config() this builds a rank's map from a
 * checkpoint: init both configs, derive the layer config, call this, set
 * ep_size / ep_rank, create the map.
 * \param[in,out] config A map config initialised with ep_moe_expert_map_config_init().
 * \param[in]     layer  A layer config initialised with ep_moe_layer_config_init().
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT (a NULL pointer, or a
 *         layer config with num_experts < 1 or negative num_expert_group);
 *         ::EP_MOE_ERR_STRUCT_SIZE. On failure `config` is unchanged.
 */
EP_MOE_API ep_moe_status_t ep_moe_expert_map_config_from_layer(ep_moe_expert_map_config_t* config,
                                                               const ep_moe_layer_config_t* layer);

/**
 * \brief Creates one rank's layer (without weights; see ep_moe_layer_set_weight()).
 * \param[out] out     Receives the handle (owned by the caller; free it with
 *                     ep_moe_layer_destroy()).
 * \param[in]  config  The configuration; read during the call only.
 * \param[in]  map     This rank's expert map; copied, so it may be destroyed
 *                     after the call. Its ep_size/ep_rank must match `ep_comm`.
 * \param[in]  ep_comm The EP group (borrowed for the layer's lifetime), or
 *                     NULL: then no collective runs and forward returns this
 *                     rank's partial sum for the caller to reduce.
 * \param[in]  dp_comm The DP-attention group (borrowed for the layer's
 *                     lifetime; may be the same handle as `ep_comm`), or NULL
 *                     without DP attention. Its size must divide the EP size.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT naming the bad field;
 *         ::EP_MOE_ERR_STRUCT_SIZE; ::EP_MOE_ERR_INVALID_HANDLE;
 *         ::EP_MOE_ERR_OUT_OF_MEMORY.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_create(ep_moe_layer_t** out, const ep_moe_layer_config_t* config,
                                               const ep_moe_expert_map_t* map, ep_moe_comm_t* ep_comm,
                                               ep_moe_comm_t* dp_comm);

/**
 * \brief Frees a layer and its weights. NULL is accepted.
 * \param[in] layer The handle; invalid after the call.
 */
EP_MOE_API void ep_moe_layer_destroy(ep_moe_layer_t* layer);

/**
 * \brief The message of the last failed call on this layer.
 * \param[in] layer The handle (NULL gives a fixed message).
 * \return A NUL-terminated copy, valid in the calling thread until its next
 *         ep_moe call; "" when no call on the layer failed.
 */
EP_MOE_API const char* ep_moe_layer_last_error(const ep_moe_layer_t* layer);

/** \brief Which weight tensor ep_moe_layer_set_weight() receives, in the
 *  checkpoint's orientation (row-major, [out_features, in_features]). */
typedef enum ep_moe_weight {
  EP_MOE_WEIGHT_EXPERT_GATE = 0,        /**< Routed expert gate_proj (w1), [I, H]. */
  EP_MOE_WEIGHT_EXPERT_UP = 1,          /**< Routed expert up_proj (w3), [I, H]. */
  EP_MOE_WEIGHT_EXPERT_DOWN = 2,        /**< Routed expert down_proj (w2), [H, I]. */
  EP_MOE_WEIGHT_EXPERT_GATE_UP = 3,     /**< Fused gate_up_proj, [2I, H]: gate rows, then up rows. */
  EP_MOE_WEIGHT_SHARED_GATE = 4,        /**< Shared expert gate_proj, full size [Is, H]. */
  EP_MOE_WEIGHT_SHARED_UP = 5,          /**< Shared expert up_proj, full size [Is, H]. */
  EP_MOE_WEIGHT_SHARED_DOWN = 6,        /**< Shared expert down_proj, full size [H, Is]. */
  EP_MOE_WEIGHT_SHARED_GATE_UP = 7,     /**< Shared expert fused gate_up_proj, [2 Is, H]. */
  EP_MOE_WEIGHT_SHARED_EXPERT_GATE = 8, /**< Sigmoid gate of the shared expert, [1, H]. */
  EP_MOE_WEIGHT_SCORE_BIAS = 9,         /**< Score-correction bias, [1, E]. */
  EP_MOE_WEIGHT_ROUTER = 10,            /**< Router (gate) weight, [E, H], kept in f32: with it,
                                             forward computes the logits when given neither
                                             router_logits nor topk_ids. */
  /** Routed expert gate_proj bias, [1, I] (GPT-OSS). Once any routed
   *  expert bias is given, every local expert needs all three (gate, up,
   *  down) before forward; an expert's output is then
   *  act(g + b_gate, u + b_up) W_down^T + b_down. CPU layers only. */
  EP_MOE_WEIGHT_EXPERT_GATE_BIAS = 11,
  EP_MOE_WEIGHT_EXPERT_UP_BIAS = 12,      /**< Routed expert up_proj bias, [1, I]. */
  EP_MOE_WEIGHT_EXPERT_DOWN_BIAS = 13,    /**< Routed expert down_proj bias, [1, H]. */
  EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS = 14, /**< Fused gate_up_proj bias, [1, 2I]: gate, then up. */
  EP_MOE_WEIGHT_ROUTER_BIAS = 15,         /**< Router bias, [1, E], kept in f32: added to the
                                               logits forward computes with ::EP_MOE_WEIGHT_ROUTER
                                               (GPT-OSS). CPU layers only. */
  /** \cond RANGE */
  EP_MOE_WEIGHT_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_WEIGHT_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_weight_t;

/**
 * \brief Gives the layer one weight tensor from a caller buffer.
 *
 * Routed-expert tensors are addressed by global expert id; a tensor of an
 * expert with no slot on this rank is skipped (`*out_stored` = 0) and not
 * read. The shared expert is given full size; this rank keeps its shard
 * (gate/up rows, down columns). Data is converted to the layer's weight
 * dtype and repacked; the buffer is read during the call only. A CUDA layer
 * (config `device` >= 0) takes host or device memory: a device buffer
 * already in the weight dtype is copied on the device, others are converted
 * through the host.
 * \param[out] out_stored 1 when stored, 0 when skipped as non-local; may be NULL.
 * \param[in,out] layer   The handle.
 * \param[in]  which      ::ep_moe_weight_t.
 * \param[in]  expert     Global expert id in [0, E) for routed tensors;
 *                        ignored (pass -1) for the others.
 * \param[in]  data       rows * cols elements of `dtype`, row-major.
 * \param[in]  dtype      f32, bf16, f16, or a GGUF block format (rows of
 *                        whole blocks: CPU layers keep routed experts as
 *                        they are, CUDA layers widen them on the host, from
 *                        host memory only).
 * \param[in]  rows       Must match the tensor's shape.
 * \param[in]  cols       Must match the tensor's shape.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT (shape, id, dtype,
 *         NULL data, a tensor the configuration does not use);
 *         ::EP_MOE_ERR_UNSUPPORTED (block-format data in device memory; a
 *         bias on a CUDA layer); ::EP_MOE_ERR_INVALID_HANDLE;
 *         ::EP_MOE_ERR_OUT_OF_MEMORY.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_set_weight(int32_t* out_stored, ep_moe_layer_t* layer, ep_moe_weight_t which,
                                                   int32_t expert, const void* data, ep_moe_dtype_t dtype, int64_t rows,
                                                   int64_t cols);

/** \brief Arguments of ep_moe_layer_forward(); fill with
 *  ep_moe_forward_args_init() first. */
typedef struct ep_moe_forward_args {
  /** Size of this struct as the caller compiled it; set by ep_moe_forward_args_init(). */
  size_t struct_size;
  /** Tokens T of this rank (0 .. max_tokens). Zero-token ranks still take
   *  part in every collective. */
  int64_t num_tokens;
  /** [T, H] hidden states of act_dtype. */
  const void* hidden;
  /** [T, E] router logits of router_dtype; NULL when topk_ids is given or
   *  when the layer holds a router weight (::EP_MOE_WEIGHT_ROUTER). */
  const void* router_logits;
  /** [T, K] global expert ids chosen by the caller; NULL when router_logits
   *  is given. */
  const int32_t* topk_ids;
  /** [T, K] weights of topk_ids (used as given: no renormalisation or
   *  scaling is applied). */
  const float* topk_weights;
  /** [T, H] output of act_dtype. May be the same buffer as `hidden`. */
  void* out;
  /** DP attention: dp_size token counts, one per replica, the same on every
   *  rank; entry dp_rank must equal num_tokens. NULL without DP attention. */
  const int32_t* dp_token_counts;
  /** DP attention: dp_size flags, nonzero where that replica decodes; NULL
   *  means "not all decode". */
  const int32_t* dp_is_decode;
  /** Nonzero when the step is captured in a graph (forces the padded gather). */
  int32_t is_graph;
  /** Nonzero for prefill steps (forces the padded gather). */
  int32_t is_prefill;
  /** Device stream (cudaStream_t); ignored on CPU. */
  void* stream;
} ep_moe_forward_args_t;

/**
 * \brief Fills forward arguments with defaults (all NULL/0) and sets struct_size.
 * \param[out] out The struct to fill.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_forward_args_init(ep_moe_forward_args_t* out);

/**
 * \brief Runs the MoE layer for this rank's tokens (collective over the
 *        layer's communicators: every rank calls it).
 *
 * DP gather (seed 001): the padded all-gather is used for graph steps,
 * prefill steps or when not every replica decodes; otherwise the compact
 * (variable-length) gather. The padded gather is reduced with ONE
 * reduce-scatter when the DP group is the EP group, else with an all-reduce
 * and a slice, as is the compact gather.
 *
 * CUDA layers: `hidden`, `router_logits`, `topk_ids`, `topk_weights` and
 * `out` are device pointers (`dp_*` stay on the host), and the work is
 * enqueued on `stream`. A forward of at most `sync_free_tokens` rows (after
 * the DP gather) in the all-gather flow, or any forward on a stream being
 * captured, returns without waiting for the device, can be captured in a
 * CUDA graph (with an NCCL communicator or none), and does not check
 * device-resident values: NaN logits give NaN rows, out-of-range ids are
 * dropped. Larger forwards synchronise once to read the per-expert counts
 * and check the values. Without a collective the output may still be being
 * written on `stream` when the call returns. The all-to-all flow plans on
 * the host (it synchronises, and cannot be captured); host communicators are
 * staged through pinned memory (synchronising; capturing them returns
 * ::EP_MOE_ERR_UNSUPPORTED).
 * \param[in,out] layer The handle.
 * \param[in]     args  The tensors and DP metadata.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT (sizes, NULL buffers,
 *         ids out of range, NaN logits or weights, T above max_tokens,
 *         inconsistent DP counts: nothing is written to `out`);
 *         ::EP_MOE_ERR_STATE when a weight is missing; ::EP_MOE_ERR_REMOTE
 *         when another rank failed; ::EP_MOE_ERR_TIMEOUT;
 *         ::EP_MOE_ERR_ABORTED; ::EP_MOE_ERR_DEVICE when a CUDA call failed.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_forward(ep_moe_layer_t* layer, const ep_moe_forward_args_t* args);

/** \brief Integer attributes of a layer, for ep_moe_layer_get_attr(). */
typedef enum ep_moe_layer_attr {
  EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS = 0,  /**< Routed expert slots on this rank. */
  EP_MOE_LAYER_ATTR_NUM_THREADS = 1,        /**< CPU threads the layer uses. */
  EP_MOE_LAYER_ATTR_WEIGHT_BYTES = 2,       /**< Bytes of weights held by this rank. */
  EP_MOE_LAYER_ATTR_READY = 3,              /**< 1 when every needed weight is set. */
  EP_MOE_LAYER_ATTR_LAST_TOKENS = 4,        /**< Tokens the last forward computed (after the DP gather). */
  EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS = 5,   /**< (token, expert) pairs computed on this rank by the last forward. */
  EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS = 6, /**< Pairs the last forward skipped as non-local. */
  EP_MOE_LAYER_ATTR_LAST_GATHER = 7,        /**< Last DP gather: 0 none, 1 padded, 2 compact. */
  EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE = 8,  /**< Columns of the shared intermediate held here. */
  EP_MOE_LAYER_ATTR_CPU_ISA =
      9, /**< CPU kernels in use: 0 generic, 1 AVX2, 2 AVX-512, 3 AVX-512 with AVX512_BF16 (bf16 weights with bf16
            activations then run on bf16 pair dot products). A CPU with AVX512_BF16 reports 2 when its pair dot products
            measured slower than widening bf16 to f32 FMAs (timed once per process, at the first layer's creation,
            about 1.5 ms; the environment variable EP_MOE_CPU_ISA, when set, names the kernels instead, never above what
            the CPU has). */
  EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS = 10, /**< Local experts with at least one pair in the last forward. */
  EP_MOE_LAYER_ATTR_BYTES_LOADED = 11,        /**< Bytes read from checkpoint files by ep_moe_layer_load(). */
  EP_MOE_LAYER_ATTR_LAST_DISPATCH = 12,       /**< ::ep_moe_dispatch_mode_t the last forward used (never AUTO). */
  EP_MOE_LAYER_ATTR_LAST_ALLTOALL_BYTES =
      13, /**< Auto mode: bytes the all-to-all flow would have moved in the last step (all ranks). */
  EP_MOE_LAYER_ATTR_LAST_ALLGATHER_BYTES = 14, /**< Auto mode: the same for the all-gather flow. */
  EP_MOE_LAYER_ATTR_LOAD_STEPS =
      15, /**< Forward calls counted in the expert-load window (see ep_moe_layer_expert_load()). */
  EP_MOE_LAYER_ATTR_REPLACE_BYTES_SENT =
      16, /**< Weight bytes this rank sent to peers in the last ep_moe_layer_replace(). */
  EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED =
      17, /**< Weight bytes this rank received from peers in the last ep_moe_layer_replace(). */
  EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ =
      18, /**< Bytes this rank read from the checkpoint in the last ep_moe_layer_replace(). */
  EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT =
      19,                             /**< Routed experts the last ep_moe_layer_replace() kept in place on this rank. */
  EP_MOE_LAYER_ATTR_NUM_EXPERTS = 20, /**< Logical routed experts E of the layer (the config's num_experts). */
  EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS =
      21, /**< Nanoseconds the last forward spent on this rank moving token rows into the order the experts read
             (packing rows to send, unpacking received rows, widening inputs to f32 where the experts do not read bf16
             rows in place); collectives excluded. CUDA layers (attrs 21-25): CUDA-event times of the last forward not
             captured in a graph, this one covering routing, the plan (with its synchronisation on the prefill path) and
             the permutation. */
  EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES = 22, /**< Bytes of rows those steps wrote. */
  EP_MOE_LAYER_ATTR_LAST_EXPERT_NS =
      23, /**< Nanoseconds the last forward spent in expert FFNs on this rank (routed and shared; in all-gather mode it
             includes the weighted combine, which is fused into the down projection). */
  EP_MOE_LAYER_ATTR_LAST_COMBINE_NS =
      24, /**< Nanoseconds the last forward spent on this rank turning expert results into output rows (converting
             partial rows for the return or the reduction, adding returned rows per token, writing the output);
             collectives excluded. */
  EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES = 25, /**< Bytes of rows those steps read. */
  EP_MOE_LAYER_ATTR_DEVICE = 26, /**< The config's `device`: -1 for a CPU layer, else the CUDA device ordinal. */
  EP_MOE_LAYER_ATTR_LAST_SYNC_FREE = 27, /**< CUDA layers: 1 when the last forward took the synchronisation-free path, 0
                                            when it synchronised once for cuBLASLt; -1 on the CPU. */
  EP_MOE_LAYER_ATTR_HAS_ROUTER =
      28, /**< 1 when the layer holds a router weight (::EP_MOE_WEIGHT_ROUTER, given or loaded), so forward may be
             called with neither router_logits nor topk_ids; else 0. */
  EP_MOE_LAYER_ATTR_MATRIX_ENGINE =
      29, /**< The matrix engine of the layer's prefill: 0 none, 1 oneDNN on a CPU without AMX (only when asked for
             with EP_MOE_MATRIX_ENGINE=onednn), 2 oneDNN on AMX tiles. It takes the bf16 expert GEMMs (bf16 weights and
             activations) of an expert with enough rows in a forward: a threshold measured against the AVX-512 tiles
             once per process, or EP_MOE_MATRIX_MIN_ROWS. Where the CPU has AMX and libep_moe_onednn.so loads
             (::EP_MOE_FEATURE_ONEDNN) it is on, unless EP_MOE_MATRIX_ENGINE=off or EP_MOE_CPU_ISA names a level
             below `amx`. docs/architecture.md says more. */
  EP_MOE_LAYER_ATTR_LAST_ENGINE_PAIRS =
      30, /**< (token, expert) pairs whose expert GEMMs the matrix engine computed in the last forward. */
  /** \cond RANGE */
  EP_MOE_LAYER_ATTR_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_LAYER_ATTR_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_layer_attr_t;

/**
 * \brief Reads one integer attribute of the layer.
 * \param[out] out   Receives the value.
 * \param[in]  layer The handle.
 * \param[in]  attr  Which attribute.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_get_attr(int64_t* out, const ep_moe_layer_t* layer, ep_moe_layer_attr_t attr);

/** @} */

/** \defgroup ep_moe_checkpoint Checkpoints
 *  \brief Reading MoE layers from safetensors and GGUF checkpoints, each rank
 *  only its own experts.
 *
 * Formats: a `.safetensors` file, a sharded checkpoint through its
 * `model.safetensors.index.json`, a directory holding either, or a GGUF (v2
 * or v3) file. Every header is validated when the checkpoint is opened;
 * tensor data is read only by ep_moe_layer_load(), only the byte ranges the
 * rank needs. Loadable element types: F32, F16, BF16, and Q8_0 (GGUF,
 * dequantised while loading). The layer configuration comes from the
 * checkpoint (HF `config.json` beside it, or GGUF metadata) and tensor shapes.
 *
 * An open checkpoint may be used by several threads at once (all functions
 * taking it are const), e.g. by every in-process rank loading its layer.
 *  @{ */

/** \brief An open checkpoint. Opaque. */
typedef struct ep_moe_checkpoint ep_moe_checkpoint_t;

/** \brief Expert tensor naming schemes. */
typedef enum ep_moe_naming {
  EP_MOE_NAMING_AUTO = 0,     /**< Detect from the tensor names (default). */
  EP_MOE_NAMING_HF = 1,       /**< `layers.L.mlp.experts.e.{gate,up,down}_proj.weight` (Qwen2/3-MoE, DeepSeek). */
  EP_MOE_NAMING_MIXTRAL = 2,  /**< `layers.L.block_sparse_moe.experts.e.{w1,w3,w2}.weight`. */
  EP_MOE_NAMING_HF_FUSED = 3, /**< `layers.L.mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]. */
  EP_MOE_NAMING_HF_FUSED_TRANSPOSED = 4, /**< The same names stored [E, H, 2I] and [E, I, H]. */
  EP_MOE_NAMING_GGUF = 5,                /**< `blk.L.ffn_{gate,up,down}_exps.weight` [E, I, H] ... */
  /** \cond RANGE */
  EP_MOE_NAMING_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_NAMING_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_naming_t;

/** \brief How to open a checkpoint; fill with ep_moe_checkpoint_config_init() first. */
typedef struct ep_moe_checkpoint_config {
  /** Size of this struct as the caller compiled it. */
  size_t struct_size;
  /** ::ep_moe_naming_t; ::EP_MOE_NAMING_AUTO detects it. */
  int32_t naming;
  /** Only HF tensors whose name starts with this prefix (the part before
   *  `layers.`, e.g. "model.language_model."); NULL or "" detects it. Copied. */
  const char* name_prefix;
} ep_moe_checkpoint_config_t;

/**
 * \brief Fills a checkpoint config with defaults and sets its struct_size.
 * \param[out] out The struct to fill.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_checkpoint_config_init(ep_moe_checkpoint_config_t* out);

/**
 * \brief Opens a checkpoint and validates every header of it.
 * \param[out] out    Receives the handle (owned by the caller; free it with
 *                    ep_moe_checkpoint_close()).
 * \param[in]  path   A file or directory (see \ref ep_moe_checkpoint).
 * \param[in]  config Options, or NULL for the defaults.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_IO (cannot open or read);
 *         ::EP_MOE_ERR_FORMAT (a malformed file: the message names the file
 *         and the tensor); ::EP_MOE_ERR_NOT_FOUND (no checkpoint at the path,
 *         or no tensors of a forced naming); ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_checkpoint_open(ep_moe_checkpoint_t** out, const char* path,
                                                  const ep_moe_checkpoint_config_t* config);

/**
 * \brief Closes a checkpoint. NULL is accepted. Layers loaded from it keep
 *        their weights.
 * \param[in] checkpoint The handle; invalid after the call.
 */
EP_MOE_API void ep_moe_checkpoint_close(ep_moe_checkpoint_t* checkpoint);

/**
 * \brief The message of the last failed call on this checkpoint.
 * \param[in] checkpoint The handle (NULL gives a fixed message).
 * \return A NUL-terminated copy, valid in the calling thread until its next
 *         ep_moe call; "" when no call on the handle failed.
 */
EP_MOE_API const char* ep_moe_checkpoint_last_error(const ep_moe_checkpoint_t* checkpoint);

/**
 * \brief The architecture a checkpoint names: config.json's `model_type`
 *        (safetensors; `text_config`'s for multimodal models) or GGUF's
 *        `general.architecture`.
 *
 * ep_moe_checkpoint_layer_config() derives the routing and the activation
 * from it (docs/formats.md lists the architectures it knows).
 * \param[in] checkpoint The handle.
 * \return A NUL-terminated string owned by the checkpoint, valid until it is
 *         closed; "" when the checkpoint names no architecture or the handle
 *         is NULL or not live.
 */
EP_MOE_API const char* ep_moe_checkpoint_architecture(const ep_moe_checkpoint_t* checkpoint);

/** \brief Integer attributes of a checkpoint, for ep_moe_checkpoint_get_attr(). */
typedef enum ep_moe_checkpoint_attr {
  EP_MOE_CHECKPOINT_ATTR_FORMAT = 0,         /**< 0 safetensors, 1 GGUF. */
  EP_MOE_CHECKPOINT_ATTR_NAMING = 1,         /**< The ::ep_moe_naming_t in use. */
  EP_MOE_CHECKPOINT_ATTR_NUM_FILES = 2,      /**< Data files. */
  EP_MOE_CHECKPOINT_ATTR_NUM_TENSORS = 3,    /**< Tensors in all files. */
  EP_MOE_CHECKPOINT_ATTR_NUM_MOE_LAYERS = 4, /**< Layers with routed experts. */
  EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS = 5,     /**< Decoder layers (config, or the highest index + 1). */
  EP_MOE_CHECKPOINT_ATTR_HEADER_BYTES = 6,   /**< Bytes read to open it (headers, index, config). */
  /** \cond RANGE */
  EP_MOE_CHECKPOINT_ATTR_ENUM_MIN_ = -0x7fffffff - 1, /* range markers: every int32 value is a valid */
  EP_MOE_CHECKPOINT_ATTR_ENUM_MAX_ = 0x7fffffff       /* object of this type, so bad values are rejected, not UB */
  /** \endcond */
} ep_moe_checkpoint_attr_t;

/**
 * \brief Reads one integer attribute of a checkpoint.
 * \param[out] out        Receives the value.
 * \param[in]  checkpoint The handle.
 * \param[in]  attr       Which attribute.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_checkpoint_get_attr(int64_t* out, const ep_moe_checkpoint_t* checkpoint,
                                                      ep_moe_checkpoint_attr_t attr);

/**
 * \brief Lists the indices of the layers that hold routed experts, ascending.
 * \param[out] out       Buffer for up to `out_len` indices; may be NULL when
 *                       `out_len` is 0.
 * \param[in]  out_len   Capacity of `out`.
 * \param[out] out_count Receives the number of MoE layers (which may exceed
 *                       `out_len`; then only the first `out_len` are written).
 * \param[in]  checkpoint The handle.
 * \return ::EP_MOE_OK, ::EP_MOE_ERR_INVALID_HANDLE or ::EP_MOE_ERR_INVALID_ARGUMENT.
 */
EP_MOE_API ep_moe_status_t ep_moe_checkpoint_moe_layers(int32_t* out, size_t out_len, size_t* out_count,
                                                        const ep_moe_checkpoint_t* checkpoint);

/**
 * \brief Fills the model-shape fields of a layer config from the checkpoint.
 *
 * Sets hidden_size, intermediate_size, num_experts, top_k (when declared),
 * activation, weight_dtype, scoring, renormalize, num_expert_group,
 * topk_group, use_score_bias, routed_scaling_factor,
 * shared_intermediate_size and shared_expert_gate. weight_dtype is the
 * experts' dtype (bf16 and f16 as stored, other floats f32); for a GGUF block
 * format it is that format where its blocks divide the hidden and
 * intermediate sizes, else bf16, and bf16 when `device` >= 0 (CUDA layers
 * widen block formats as they are stored). act_dtype, router_dtype,
 * max_tokens, num_threads, skip_mode and device are kept.
 * The shapes come from the tensors; the routing and activation from a
 * table per architecture (ep_moe_checkpoint_architecture()), overridden by
 * every key the file states (docs/formats.md). An architecture the table
 * does not know is accepted only when the file states every semantic key.
 * ep_moe_expert_map_config_from_layer() then fills the map's fields.
 * \param[in,out] config     Initialised with ep_moe_layer_config_init().
 * \param[in]     checkpoint The handle.
 * \param[in]     layer      A layer index from ep_moe_checkpoint_moe_layers().
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_NOT_FOUND (no experts in that layer);
 *         ::EP_MOE_ERR_FORMAT (inconsistent shapes; an architecture routing
 *         with a score-correction bias the layer lacks);
 *         ::EP_MOE_ERR_UNSUPPORTED (routing the file does not state for an
 *         unknown architecture, a value ep_moe does not implement, or tensors
 *         in the layer's MoE block that the layer would ignore: the message
 *         names them); ::EP_MOE_ERR_STRUCT_SIZE;
 *         ::EP_MOE_ERR_INVALID_HANDLE; ::EP_MOE_ERR_INVALID_ARGUMENT. On
 *         failure `config` is unchanged.
 */
EP_MOE_API ep_moe_status_t ep_moe_checkpoint_layer_config(ep_moe_layer_config_t* config,
                                                          const ep_moe_checkpoint_t* checkpoint, int32_t layer);

/** \brief Where a weight lives in a checkpoint (for inspection tools). */
typedef struct ep_moe_tensor_info {
  /** Size of this struct as the caller compiled it; set by ep_moe_tensor_info_init(). */
  size_t struct_size;
  /** Name of the tensor holding the weight (NUL-terminated, truncated to fit). */
  char name[256];
  /** Element type as the file names it ("BF16", "Q8_0", ...); "MXFP4" for
   *  GPT-OSS's safetensors MXFP4 experts, which are two U8 tensors, the
   *  blocks (`name`, `dims`) and their scales (`<...>_scales`). */
  char dtype[16];
  /** Dimensions of that tensor, outermost first. */
  int32_t n_dims;
  /** The first n_dims entries are valid. */
  int64_t dims[8];
  /** Bytes of the whole tensor (an MXFP4 pair's: blocks and scales). */
  int64_t tensor_bytes;
  /** Bytes of this weight within it (one expert's block of a 3-D tensor;
   *  an MXFP4 pair's: its blocks and scales, 17 bytes per 32 elements). */
  int64_t bytes;
  /** Index of the file holding it. */
  int32_t file_index;
  /** Nonzero when the weight is stored transposed ([cols, rows]). */
  int32_t transposed;
} ep_moe_tensor_info_t;

/**
 * \brief Fills a tensor info with zeros and sets its struct_size.
 * \param[out] out The struct to fill.
 * \return ::EP_MOE_OK, or ::EP_MOE_ERR_INVALID_ARGUMENT when `out` is NULL.
 */
EP_MOE_API ep_moe_status_t ep_moe_tensor_info_init(ep_moe_tensor_info_t* out);

/**
 * \brief Describes where one weight of a layer is stored.
 * \param[in,out] out        Initialised with ep_moe_tensor_info_init(); filled.
 * \param[in]     checkpoint The handle.
 * \param[in]     layer      A MoE layer index.
 * \param[in]     which      ::ep_moe_weight_t. For checkpoints with fused
 *                           gate_up tensors, ask for ::EP_MOE_WEIGHT_EXPERT_GATE_UP.
 * \param[in]     expert     Global expert id for routed weights, else -1.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_NOT_FOUND when the checkpoint has no such
 *         weight; ::EP_MOE_ERR_INVALID_ARGUMENT; ::EP_MOE_ERR_INVALID_HANDLE.
 */
EP_MOE_API ep_moe_status_t ep_moe_checkpoint_tensor_info(ep_moe_tensor_info_t* out,
                                                         const ep_moe_checkpoint_t* checkpoint, int32_t layer,
                                                         ep_moe_weight_t which, int32_t expert);

/**
 * \brief Loads this rank's part of a checkpoint layer into a layer.
 *
 * Reads only: the experts with a slot on this rank, the router, the
 * score-correction bias and the shared-expert gate when configured, and this
 * rank's shard of the shared expert (gate/up rows, down columns). The bytes
 * read are added to ::EP_MOE_LAYER_ATTR_BYTES_LOADED. Shapes must match the
 * layer's configuration (see ep_moe_checkpoint_layer_config()).
 * \param[in,out] layer       The layer.
 * \param[in]     checkpoint  The open checkpoint (not retained).
 * \param[in]     layer_index A MoE layer index of the checkpoint.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT (shapes differ from the
 *         configuration); ::EP_MOE_ERR_NOT_FOUND (a needed tensor is
 *         missing); ::EP_MOE_ERR_UNSUPPORTED (an element type that cannot be
 *         loaded, or tensors in the layer's MoE block that the layer would
 *         ignore); ::EP_MOE_ERR_IO; ::EP_MOE_ERR_FORMAT;
 *         ::EP_MOE_ERR_INVALID_HANDLE. A failed load may leave some weights
 *         set; ::EP_MOE_LAYER_ATTR_READY tells whether the layer is complete.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_load(ep_moe_layer_t* layer, const ep_moe_checkpoint_t* checkpoint,
                                             int32_t layer_index);

/** @} */

/** \defgroup ep_moe_eplb Expert load balancing
 *  \brief Load statistics, rebalancing, live re-placement and elastic EP.
 *
 * The loop a runtime runs every few thousand steps:
 * 1. ep_moe_layer_expert_load() with `across_ranks` = 1 and `reset` = 1
 *    (collective): the routed (token, expert) pairs of every logical expert
 *    since the last reset, summed over the EP group.
 * 2. ep_moe_rebalance() (local, deterministic: every rank computes the same
 *    table from the same load): physical slot -> logical expert, with E/8 or
 *    so redundant slots going to replicas of the hot experts.
 * 3. ep_moe_expert_map_create() with ::EP_MOE_PLACEMENT_CUSTOM and that
 *    table, then ep_moe_layer_replace() (collective): experts that change
 *    rank are sent over the communicator; nothing else moves.
 *
 * A pair routed to an expert with several replicas goes to one of them by
 * this rule, the same on every rank: in the all-gather flow, replica
 * `(t + k) mod n` of the expert's n replicas (in slot order), t
 * being the row in the gathered batch; in the all-to-all flow, the replica
 * on the token's own rank when there is one, else the same rule with t the
 * rank's own token index. Replicas thus share an expert's load about evenly.
 *  @{ */

/**
 * \brief Reads (and optionally resets) the layer's per-expert load.
 *
 * Each forward adds, per logical expert, the (token, expert) pairs this
 * rank computed (real pairs only: skipped and weight-0 pairs, and DP
 * padding, are not counted). Summed over the EP group, every routed pair of
 * the window counts once. CUDA layers count on the device; the call waits
 * for the device first (the window then holds every forward enqueued).
 * \param[out] out          E counts (E = the layer's num_experts).
 * \param[in]  out_len      Entries of `out`; at least E.
 * \param[in,out] layer     The handle.
 * \param[in]  across_ranks Nonzero: sum over the EP group with one
 *                          all-reduce (collective: every rank of the EP
 *                          communicator calls it with the same value);
 *                          0: this rank's counts only.
 * \param[in]  reset        Nonzero: start a new window (counts and
 *                          ::EP_MOE_LAYER_ATTR_LOAD_STEPS to 0) after reading.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT (`out` NULL or short);
 *         ::EP_MOE_ERR_INVALID_HANDLE; a communicator status when the
 *         all-reduce fails (the counts are then left as they were).
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_expert_load(int64_t* out, size_t out_len, ep_moe_layer_t* layer,
                                                    int32_t across_ranks, int32_t reset);

/** \brief Parameters of ep_moe_rebalance(); fill with
 *  ep_moe_rebalance_config_init() first. */
typedef struct ep_moe_rebalance_config {
  /** Size of this struct as the caller compiled it; set by ep_moe_rebalance_config_init(). */
  size_t struct_size;
  /** Logical experts E (entries of the load). */
  int32_t num_experts;
  /** Physical slots P >= E, a multiple of num_ranks (E + redundant slots). */
  int32_t num_slots;
  /** Ranks of the EP group. */
  int32_t num_ranks;
  /** Ranks per node; 0 means one node. Must divide num_ranks. */
  int32_t ranks_per_node;
  /** Expert groups (as the router's num_expert_group); 0 means none. With
   *  more than one node and groups divisible by the nodes the placement is
   *  hierarchical: whole groups to nodes, replicas within each node, then
   *  to the node's ranks. Otherwise it is global over all ranks. */
  int32_t num_expert_groups;
  /** Entries of current_slots; 0 when there is none. */
  int32_t num_current_slots;
  /** Optional (NULL): the placement in use (slot -> expert, e.g. the
   *  ::EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL table of the current map, split
   *  over num_ranks like a custom table without per-rank counts). Each pack
   *  of replicas then goes to the rank (and each pack of groups to the
   *  node) that already holds most of it, so the re-placement moves as few
   *  experts as the balance allows: the same load gives back the current
   *  table's rank contents. Not read after the call. */
  const int32_t* current_slots;
} ep_moe_rebalance_config_t;

/**
 * \brief Fills a rebalance config with defaults (every count 0) and sets
 *        its struct_size.
 * \param[out] out The config.
 * \return ::EP_MOE_OK or ::EP_MOE_ERR_INVALID_ARGUMENT (NULL).
 */
EP_MOE_API ep_moe_status_t ep_moe_rebalance_config_init(ep_moe_rebalance_config_t* out);

/**
 * \brief Computes a balanced placement from per-expert load.
 *
 * Each of the P - E redundant slots goes, in turn, to the expert whose
 * load per replica is then the highest; the replicas (each carrying its
 * expert's load / replicas) are then packed onto the ranks, P / num_ranks
 * each, heaviest first into the least loaded rank with room, then pairs of
 * replicas are swapped out of the heaviest rank while a swap makes it
 * lighter (at most 2^22 pair evaluations per packing). Deterministic:
 * the same load and config give the same table on every rank and platform
 * (ties go to the lower index; with ep_moe_rebalance_config_t::current_slots,
 * packs are matched to the ranks that hold most of them). The result is the
 * custom placement table of
 * ep_moe_expert_map_config_t (slots [r*P/R, (r+1)*P/R) belong to rank r).
 * Limits: num_experts <= num_slots <= 8192, num_ranks <= 1024 (a call at
 * the limits, with a current placement, takes about a second).
 * \param[out] out_slots      P entries: physical slot -> logical expert.
 * \param[in]  out_len        Entries of `out_slots`; at least P.
 * \param[out] out_imbalance  Optional (NULL): the resulting max rank load /
 *                            mean rank load (1.0 is perfect), under the
 *                            even split among replicas.
 * \param[in]  load           E finite, non-negative loads (e.g. the counts
 *                            of ep_moe_layer_expert_load()).
 * \param[in]  load_len       Entries of `load`; must equal num_experts.
 * \param[in]  config         The shape.
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT naming the bad value;
 *         ::EP_MOE_ERR_STRUCT_SIZE.
 */
EP_MOE_API ep_moe_status_t ep_moe_rebalance(int32_t* out_slots, size_t out_len, double* out_imbalance,
                                            const double* load, size_t load_len,
                                            const ep_moe_rebalance_config_t* config);

/**
 * \brief Applies a new expert placement to a running layer (collective).
 *
 * Every rank of the new EP group calls it between forward calls, with its
 * own rank's map of the same placement. Each rank keeps the experts it
 * already holds; an expert it gains is sent by a rank that holds it (the
 * least busy sender; ties to the lower rank), in rounds of at most 256 MiB
 * over the communicator; an expert that no participant holds, and the
 * shared expert's shard that no participant holds, is read from
 * `checkpoint` when given. The shared expert is re-sharded over the new
 * group. Router, score bias and shared gate stay as they are.
 *
 * Elastic EP: pass the communicator of the surviving (or grown) group as
 * `new_ep_comm` and a map of that size. Ranks that left do not call it. A
 * rank that joins creates a layer with the new map and communicator, sets
 * its router/bias/gate weights, and calls this with that same map: it holds
 * nothing, so everything it needs is sent to it.
 *
 * Atomic: on any failure, on any rank, every rank returns an error and
 * keeps its old placement and weights. The load window is reset. CUDA
 * layers take part the same way: kept experts are copied on the device,
 * moved ones go through host memory (over NCCL, staged through device
 * memory), and the new layer's device workspace exists beside the old one
 * until the call returns.
 * \param[in,out] layer        The handle.
 * \param[in]     new_map      This rank's map of the new placement (copied):
 *                             same global_num_experts, no fused shared
 *                             experts, ep_size/ep_rank matching the
 *                             communicator.
 * \param[in]     new_ep_comm  The new EP group (borrowed for the layer's
 *                             lifetime from now on), or NULL to keep the
 *                             current one. A DP communicator that was the
 *                             EP handle itself follows it.
 * \param[in]     checkpoint   Where missing weights may be read, or NULL.
 * \param[in]     layer_index  The checkpoint's layer index (ignored
 *                             without a checkpoint).
 * \return ::EP_MOE_OK; ::EP_MOE_ERR_INVALID_ARGUMENT (maps that disagree
 *         between ranks, sizes that do not match); ::EP_MOE_ERR_NOT_FOUND (an
 *         expert or shared-expert shard no rank holds and no checkpoint);
 *         ::EP_MOE_ERR_INVALID_HANDLE; checkpoint and communicator statuses.
 */
EP_MOE_API ep_moe_status_t ep_moe_layer_replace(ep_moe_layer_t* layer, const ep_moe_expert_map_t* new_map,
                                                ep_moe_comm_t* new_ep_comm, const ep_moe_checkpoint_t* checkpoint,
                                                int32_t layer_index);

/** @} */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EP_MOE_EP_MOE_H */
