// Generated from include/ep_moe/ep_moe.h by tools/header_model.py; do not edit.
// (tests/abi/check_generated.sh fails when this file is out of date.)
#![allow(non_camel_case_types, non_upper_case_globals, dead_code)]
use std::os::raw::{c_char, c_int, c_void};

pub const EP_MOE_VERSION_MAJOR: u32 = 0;
pub const EP_MOE_VERSION_MINOR: u32 = 4;
pub const EP_MOE_VERSION_PATCH: u32 = 0;

pub type ep_moe_status_t = i32;
pub const EP_MOE_OK: ep_moe_status_t = 0;
pub const EP_MOE_ERR_INVALID_ARGUMENT: ep_moe_status_t = 1;
pub const EP_MOE_ERR_OUT_OF_MEMORY: ep_moe_status_t = 2;
pub const EP_MOE_ERR_UNSUPPORTED: ep_moe_status_t = 3;
pub const EP_MOE_ERR_BUFFER_TOO_SMALL: ep_moe_status_t = 4;
pub const EP_MOE_ERR_STRUCT_SIZE: ep_moe_status_t = 5;
pub const EP_MOE_ERR_INVALID_HANDLE: ep_moe_status_t = 6;
pub const EP_MOE_ERR_INTERNAL: ep_moe_status_t = 7;
pub const EP_MOE_ERR_TIMEOUT: ep_moe_status_t = 8;
pub const EP_MOE_ERR_ABORTED: ep_moe_status_t = 9;
pub const EP_MOE_ERR_REMOTE: ep_moe_status_t = 10;
pub const EP_MOE_ERR_IO: ep_moe_status_t = 11;
pub const EP_MOE_ERR_FORMAT: ep_moe_status_t = 12;
pub const EP_MOE_ERR_NOT_FOUND: ep_moe_status_t = 13;
pub const EP_MOE_ERR_STATE: ep_moe_status_t = 14;
pub const EP_MOE_ERR_DEVICE: ep_moe_status_t = 15;
pub const EP_MOE_STATUS_ENUM_MIN_: ep_moe_status_t = -2147483648;
pub const EP_MOE_STATUS_ENUM_MAX_: ep_moe_status_t = 2147483647;

pub type ep_moe_feature_t = i32;
pub const EP_MOE_FEATURE_CPU: ep_moe_feature_t = 1;
pub const EP_MOE_FEATURE_CUDA: ep_moe_feature_t = 2;
pub const EP_MOE_FEATURE_NCCL: ep_moe_feature_t = 4;
pub const EP_MOE_FEATURE_CUBLASLT: ep_moe_feature_t = 8;
pub const EP_MOE_FEATURE_MPI: ep_moe_feature_t = 16;
pub const EP_MOE_FEATURE_LOCAL_COMM: ep_moe_feature_t = 32;
pub const EP_MOE_FEATURE_CALLBACKS: ep_moe_feature_t = 64;
pub const EP_MOE_FEATURE_ONEDNN: ep_moe_feature_t = 128;
pub const EP_MOE_FEATURE_ENUM_MIN_: ep_moe_feature_t = -2147483648;
pub const EP_MOE_FEATURE_ENUM_MAX_: ep_moe_feature_t = 2147483647;

pub type ep_moe_log_level_t = i32;
pub const EP_MOE_LOG_ERROR: ep_moe_log_level_t = 0;
pub const EP_MOE_LOG_WARN: ep_moe_log_level_t = 1;
pub const EP_MOE_LOG_INFO: ep_moe_log_level_t = 2;
pub const EP_MOE_LOG_DEBUG: ep_moe_log_level_t = 3;
pub const EP_MOE_LOG_ENUM_MIN_: ep_moe_log_level_t = -2147483648;
pub const EP_MOE_LOG_ENUM_MAX_: ep_moe_log_level_t = 2147483647;

pub type ep_moe_dtype_t = i32;
pub const EP_MOE_DTYPE_F32: ep_moe_dtype_t = 0;
pub const EP_MOE_DTYPE_BF16: ep_moe_dtype_t = 1;
pub const EP_MOE_DTYPE_F16: ep_moe_dtype_t = 2;
pub const EP_MOE_DTYPE_I32: ep_moe_dtype_t = 3;
pub const EP_MOE_DTYPE_I64: ep_moe_dtype_t = 4;
pub const EP_MOE_DTYPE_U8: ep_moe_dtype_t = 5;
pub const EP_MOE_DTYPE_Q8_0: ep_moe_dtype_t = 6;
pub const EP_MOE_DTYPE_Q4_0: ep_moe_dtype_t = 7;
pub const EP_MOE_DTYPE_Q4_K: ep_moe_dtype_t = 8;
pub const EP_MOE_DTYPE_Q5_K: ep_moe_dtype_t = 9;
pub const EP_MOE_DTYPE_Q6_K: ep_moe_dtype_t = 10;
pub const EP_MOE_DTYPE_IQ4_XS: ep_moe_dtype_t = 11;
pub const EP_MOE_DTYPE_MXFP4: ep_moe_dtype_t = 12;
pub const EP_MOE_DTYPE_Q2_K: ep_moe_dtype_t = 13;
pub const EP_MOE_DTYPE_Q3_K: ep_moe_dtype_t = 14;
pub const EP_MOE_DTYPE_Q4_1: ep_moe_dtype_t = 15;
pub const EP_MOE_DTYPE_Q5_0: ep_moe_dtype_t = 16;
pub const EP_MOE_DTYPE_Q5_1: ep_moe_dtype_t = 17;
pub const EP_MOE_DTYPE_IQ4_NL: ep_moe_dtype_t = 18;
pub const EP_MOE_DTYPE_IQ2_XXS: ep_moe_dtype_t = 19;
pub const EP_MOE_DTYPE_IQ2_XS: ep_moe_dtype_t = 20;
pub const EP_MOE_DTYPE_IQ2_S: ep_moe_dtype_t = 21;
pub const EP_MOE_DTYPE_IQ3_XXS: ep_moe_dtype_t = 22;
pub const EP_MOE_DTYPE_IQ3_S: ep_moe_dtype_t = 23;
pub const EP_MOE_DTYPE_IQ1_S: ep_moe_dtype_t = 24;
pub const EP_MOE_DTYPE_IQ1_M: ep_moe_dtype_t = 25;
pub const EP_MOE_DTYPE_FP8_E4M3: ep_moe_dtype_t = 26;
pub const EP_MOE_DTYPE_ENUM_MIN_: ep_moe_dtype_t = -2147483648;
pub const EP_MOE_DTYPE_ENUM_MAX_: ep_moe_dtype_t = 2147483647;

pub type ep_moe_placement_t = i32;
pub const EP_MOE_PLACEMENT_LINEAR: ep_moe_placement_t = 0;
pub const EP_MOE_PLACEMENT_ROUND_ROBIN: ep_moe_placement_t = 1;
pub const EP_MOE_PLACEMENT_CUSTOM: ep_moe_placement_t = 2;
pub const EP_MOE_PLACEMENT_ENUM_MIN_: ep_moe_placement_t = -2147483648;
pub const EP_MOE_PLACEMENT_ENUM_MAX_: ep_moe_placement_t = 2147483647;

pub type ep_moe_map_attr_t = i32;
pub const EP_MOE_MAP_ATTR_EP_SIZE: ep_moe_map_attr_t = 0;
pub const EP_MOE_MAP_ATTR_EP_RANK: ep_moe_map_attr_t = 1;
pub const EP_MOE_MAP_ATTR_GLOBAL_NUM_EXPERTS: ep_moe_map_attr_t = 2;
pub const EP_MOE_MAP_ATTR_NUM_FUSED_SHARED: ep_moe_map_attr_t = 3;
pub const EP_MOE_MAP_ATTR_NUM_PHYSICAL: ep_moe_map_attr_t = 4;
pub const EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED: ep_moe_map_attr_t = 5;
pub const EP_MOE_MAP_ATTR_NUM_LOCAL_TOTAL: ep_moe_map_attr_t = 6;
pub const EP_MOE_MAP_ATTR_PLACEMENT: ep_moe_map_attr_t = 7;
pub const EP_MOE_MAP_ATTR_REQUESTED_PLACEMENT: ep_moe_map_attr_t = 8;
pub const EP_MOE_MAP_ATTR_FELL_BACK: ep_moe_map_attr_t = 9;
pub const EP_MOE_MAP_ATTR_NUM_REDUNDANT: ep_moe_map_attr_t = 10;
pub const EP_MOE_MAP_ATTR_MAX_SLOTS_PER_RANK: ep_moe_map_attr_t = 11;
pub const EP_MOE_MAP_ATTR_ENUM_MIN_: ep_moe_map_attr_t = -2147483648;
pub const EP_MOE_MAP_ATTR_ENUM_MAX_: ep_moe_map_attr_t = 2147483647;

pub type ep_moe_map_table_t = i32;
pub const EP_MOE_MAP_TABLE_EXPERT_MAP: ep_moe_map_table_t = 0;
pub const EP_MOE_MAP_TABLE_EXPERT_MASK: ep_moe_map_table_t = 1;
pub const EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL: ep_moe_map_table_t = 2;
pub const EP_MOE_MAP_TABLE_GLOBAL_TO_PHYSICAL: ep_moe_map_table_t = 3;
pub const EP_MOE_MAP_TABLE_PHYSICAL_TO_GLOBAL: ep_moe_map_table_t = 4;
pub const EP_MOE_MAP_TABLE_SLOT_RANK: ep_moe_map_table_t = 5;
pub const EP_MOE_MAP_TABLE_SLOTS_PER_RANK: ep_moe_map_table_t = 6;
pub const EP_MOE_MAP_TABLE_REPLICA_COUNT: ep_moe_map_table_t = 7;
pub const EP_MOE_MAP_TABLE_ENUM_MIN_: ep_moe_map_table_t = -2147483648;
pub const EP_MOE_MAP_TABLE_ENUM_MAX_: ep_moe_map_table_t = 2147483647;

pub type ep_moe_remap_mode_t = i32;
pub const EP_MOE_REMAP_SPREAD: ep_moe_remap_mode_t = 0;
pub const EP_MOE_REMAP_MINUS_ONE: ep_moe_remap_mode_t = 1;
pub const EP_MOE_REMAP_ENUM_MIN_: ep_moe_remap_mode_t = -2147483648;
pub const EP_MOE_REMAP_ENUM_MAX_: ep_moe_remap_mode_t = 2147483647;

pub type ep_moe_activation_t = i32;
pub const EP_MOE_ACT_SILU: ep_moe_activation_t = 0;
pub const EP_MOE_ACT_GELU: ep_moe_activation_t = 1;
pub const EP_MOE_ACT_GELU_TANH: ep_moe_activation_t = 2;
pub const EP_MOE_ACT_SWIGLU_OAI: ep_moe_activation_t = 3;
pub const EP_MOE_ACT_ENUM_MIN_: ep_moe_activation_t = -2147483648;
pub const EP_MOE_ACT_ENUM_MAX_: ep_moe_activation_t = 2147483647;

pub type ep_moe_scoring_t = i32;
pub const EP_MOE_SCORING_SOFTMAX: ep_moe_scoring_t = 0;
pub const EP_MOE_SCORING_SIGMOID: ep_moe_scoring_t = 1;
pub const EP_MOE_SCORING_ENUM_MIN_: ep_moe_scoring_t = -2147483648;
pub const EP_MOE_SCORING_ENUM_MAX_: ep_moe_scoring_t = 2147483647;

pub type ep_moe_skip_mode_t = i32;
pub const EP_MOE_SKIP_TOKENS: ep_moe_skip_mode_t = 0;
pub const EP_MOE_SKIP_WEIGHT_ZERO: ep_moe_skip_mode_t = 1;
pub const EP_MOE_SKIP_ENUM_MIN_: ep_moe_skip_mode_t = -2147483648;
pub const EP_MOE_SKIP_ENUM_MAX_: ep_moe_skip_mode_t = 2147483647;

pub type ep_moe_dispatch_mode_t = i32;
pub const EP_MOE_DISPATCH_ALLGATHER: ep_moe_dispatch_mode_t = 0;
pub const EP_MOE_DISPATCH_ALLTOALL: ep_moe_dispatch_mode_t = 1;
pub const EP_MOE_DISPATCH_AUTO: ep_moe_dispatch_mode_t = 2;
pub const EP_MOE_DISPATCH_ENUM_MIN_: ep_moe_dispatch_mode_t = -2147483648;
pub const EP_MOE_DISPATCH_ENUM_MAX_: ep_moe_dispatch_mode_t = 2147483647;

pub type ep_moe_weight_t = i32;
pub const EP_MOE_WEIGHT_EXPERT_GATE: ep_moe_weight_t = 0;
pub const EP_MOE_WEIGHT_EXPERT_UP: ep_moe_weight_t = 1;
pub const EP_MOE_WEIGHT_EXPERT_DOWN: ep_moe_weight_t = 2;
pub const EP_MOE_WEIGHT_EXPERT_GATE_UP: ep_moe_weight_t = 3;
pub const EP_MOE_WEIGHT_SHARED_GATE: ep_moe_weight_t = 4;
pub const EP_MOE_WEIGHT_SHARED_UP: ep_moe_weight_t = 5;
pub const EP_MOE_WEIGHT_SHARED_DOWN: ep_moe_weight_t = 6;
pub const EP_MOE_WEIGHT_SHARED_GATE_UP: ep_moe_weight_t = 7;
pub const EP_MOE_WEIGHT_SHARED_EXPERT_GATE: ep_moe_weight_t = 8;
pub const EP_MOE_WEIGHT_SCORE_BIAS: ep_moe_weight_t = 9;
pub const EP_MOE_WEIGHT_ROUTER: ep_moe_weight_t = 10;
pub const EP_MOE_WEIGHT_EXPERT_GATE_BIAS: ep_moe_weight_t = 11;
pub const EP_MOE_WEIGHT_EXPERT_UP_BIAS: ep_moe_weight_t = 12;
pub const EP_MOE_WEIGHT_EXPERT_DOWN_BIAS: ep_moe_weight_t = 13;
pub const EP_MOE_WEIGHT_EXPERT_GATE_UP_BIAS: ep_moe_weight_t = 14;
pub const EP_MOE_WEIGHT_ROUTER_BIAS: ep_moe_weight_t = 15;
pub const EP_MOE_WEIGHT_ENUM_MIN_: ep_moe_weight_t = -2147483648;
pub const EP_MOE_WEIGHT_ENUM_MAX_: ep_moe_weight_t = 2147483647;

pub type ep_moe_layer_attr_t = i32;
pub const EP_MOE_LAYER_ATTR_NUM_LOCAL_EXPERTS: ep_moe_layer_attr_t = 0;
pub const EP_MOE_LAYER_ATTR_NUM_THREADS: ep_moe_layer_attr_t = 1;
pub const EP_MOE_LAYER_ATTR_WEIGHT_BYTES: ep_moe_layer_attr_t = 2;
pub const EP_MOE_LAYER_ATTR_READY: ep_moe_layer_attr_t = 3;
pub const EP_MOE_LAYER_ATTR_LAST_TOKENS: ep_moe_layer_attr_t = 4;
pub const EP_MOE_LAYER_ATTR_LAST_LOCAL_PAIRS: ep_moe_layer_attr_t = 5;
pub const EP_MOE_LAYER_ATTR_LAST_SKIPPED_PAIRS: ep_moe_layer_attr_t = 6;
pub const EP_MOE_LAYER_ATTR_LAST_GATHER: ep_moe_layer_attr_t = 7;
pub const EP_MOE_LAYER_ATTR_SHARED_SHARD_SIZE: ep_moe_layer_attr_t = 8;
pub const EP_MOE_LAYER_ATTR_CPU_ISA: ep_moe_layer_attr_t = 9;
pub const EP_MOE_LAYER_ATTR_LAST_ACTIVE_EXPERTS: ep_moe_layer_attr_t = 10;
pub const EP_MOE_LAYER_ATTR_BYTES_LOADED: ep_moe_layer_attr_t = 11;
pub const EP_MOE_LAYER_ATTR_LAST_DISPATCH: ep_moe_layer_attr_t = 12;
pub const EP_MOE_LAYER_ATTR_LAST_ALLTOALL_BYTES: ep_moe_layer_attr_t = 13;
pub const EP_MOE_LAYER_ATTR_LAST_ALLGATHER_BYTES: ep_moe_layer_attr_t = 14;
pub const EP_MOE_LAYER_ATTR_LOAD_STEPS: ep_moe_layer_attr_t = 15;
pub const EP_MOE_LAYER_ATTR_REPLACE_BYTES_SENT: ep_moe_layer_attr_t = 16;
pub const EP_MOE_LAYER_ATTR_REPLACE_BYTES_RECEIVED: ep_moe_layer_attr_t = 17;
pub const EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ: ep_moe_layer_attr_t = 18;
pub const EP_MOE_LAYER_ATTR_REPLACE_EXPERTS_KEPT: ep_moe_layer_attr_t = 19;
pub const EP_MOE_LAYER_ATTR_NUM_EXPERTS: ep_moe_layer_attr_t = 20;
pub const EP_MOE_LAYER_ATTR_LAST_PERMUTE_NS: ep_moe_layer_attr_t = 21;
pub const EP_MOE_LAYER_ATTR_LAST_PERMUTE_BYTES: ep_moe_layer_attr_t = 22;
pub const EP_MOE_LAYER_ATTR_LAST_EXPERT_NS: ep_moe_layer_attr_t = 23;
pub const EP_MOE_LAYER_ATTR_LAST_COMBINE_NS: ep_moe_layer_attr_t = 24;
pub const EP_MOE_LAYER_ATTR_LAST_COMBINE_BYTES: ep_moe_layer_attr_t = 25;
pub const EP_MOE_LAYER_ATTR_DEVICE: ep_moe_layer_attr_t = 26;
pub const EP_MOE_LAYER_ATTR_LAST_SYNC_FREE: ep_moe_layer_attr_t = 27;
pub const EP_MOE_LAYER_ATTR_HAS_ROUTER: ep_moe_layer_attr_t = 28;
pub const EP_MOE_LAYER_ATTR_MATRIX_ENGINE: ep_moe_layer_attr_t = 29;
pub const EP_MOE_LAYER_ATTR_LAST_ENGINE_PAIRS: ep_moe_layer_attr_t = 30;
pub const EP_MOE_LAYER_ATTR_ENUM_MIN_: ep_moe_layer_attr_t = -2147483648;
pub const EP_MOE_LAYER_ATTR_ENUM_MAX_: ep_moe_layer_attr_t = 2147483647;

pub type ep_moe_naming_t = i32;
pub const EP_MOE_NAMING_AUTO: ep_moe_naming_t = 0;
pub const EP_MOE_NAMING_HF: ep_moe_naming_t = 1;
pub const EP_MOE_NAMING_MIXTRAL: ep_moe_naming_t = 2;
pub const EP_MOE_NAMING_HF_FUSED: ep_moe_naming_t = 3;
pub const EP_MOE_NAMING_HF_FUSED_TRANSPOSED: ep_moe_naming_t = 4;
pub const EP_MOE_NAMING_GGUF: ep_moe_naming_t = 5;
pub const EP_MOE_NAMING_ENUM_MIN_: ep_moe_naming_t = -2147483648;
pub const EP_MOE_NAMING_ENUM_MAX_: ep_moe_naming_t = 2147483647;

pub type ep_moe_checkpoint_attr_t = i32;
pub const EP_MOE_CHECKPOINT_ATTR_FORMAT: ep_moe_checkpoint_attr_t = 0;
pub const EP_MOE_CHECKPOINT_ATTR_NAMING: ep_moe_checkpoint_attr_t = 1;
pub const EP_MOE_CHECKPOINT_ATTR_NUM_FILES: ep_moe_checkpoint_attr_t = 2;
pub const EP_MOE_CHECKPOINT_ATTR_NUM_TENSORS: ep_moe_checkpoint_attr_t = 3;
pub const EP_MOE_CHECKPOINT_ATTR_NUM_MOE_LAYERS: ep_moe_checkpoint_attr_t = 4;
pub const EP_MOE_CHECKPOINT_ATTR_NUM_LAYERS: ep_moe_checkpoint_attr_t = 5;
pub const EP_MOE_CHECKPOINT_ATTR_HEADER_BYTES: ep_moe_checkpoint_attr_t = 6;
pub const EP_MOE_CHECKPOINT_ATTR_ENUM_MIN_: ep_moe_checkpoint_attr_t = -2147483648;
pub const EP_MOE_CHECKPOINT_ATTR_ENUM_MAX_: ep_moe_checkpoint_attr_t = 2147483647;

#[repr(C)]
pub struct ep_moe_expert_map_t {
    _private: [u8; 0],
    _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
}

#[repr(C)]
pub struct ep_moe_comm_t {
    _private: [u8; 0],
    _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
}

#[repr(C)]
pub struct ep_moe_layer_t {
    _private: [u8; 0],
    _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
}

#[repr(C)]
pub struct ep_moe_checkpoint_t {
    _private: [u8; 0],
    _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
}

pub type ep_moe_log_fn = Option<unsafe extern "C" fn(level: ep_moe_log_level_t, message: *const c_char, user_data: *mut c_void)>;

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_expert_map_config_t {
    pub struct_size: usize,
    pub ep_size: i32,
    pub ep_rank: i32,
    pub global_num_experts: i32,
    pub placement: i32,
    pub num_fused_shared_experts: i32,
    pub num_expert_group: i32,
    pub num_redundant_experts: i32,
    pub enable_eplb: i32,
    pub use_all2all_kernels: i32,
    pub all2all_supports_routing_tables: i32,
    pub num_custom_slots: i32,
    pub custom_slots: *const i32,
    pub custom_slots_per_rank: *const i32,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_comm_config_t {
    pub struct_size: usize,
    pub timeout_ms: i32,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_comm_callbacks_t {
    pub struct_size: usize,
    pub rank: i32,
    pub size: i32,
    pub ranks_in_process: i32,
    pub user_data: *mut c_void,
    pub all_gather: Option<unsafe extern "C" fn(out_request: *mut *mut c_void, out: *mut c_void, in_: *const c_void, bytes: usize, user_data: *mut c_void) -> ep_moe_status_t>,
    pub all_gather_v: Option<unsafe extern "C" fn(out_request: *mut *mut c_void, out: *mut c_void, in_: *const c_void, bytes: *const usize, user_data: *mut c_void) -> ep_moe_status_t>,
    pub all_to_all_v: Option<unsafe extern "C" fn(out_request: *mut *mut c_void, out: *mut c_void, out_bytes: *const usize, in_: *const c_void, in_bytes: *const usize, user_data: *mut c_void) -> ep_moe_status_t>,
    pub all_reduce: Option<unsafe extern "C" fn(out_request: *mut *mut c_void, out: *mut c_void, in_: *const c_void, count: usize, dtype: ep_moe_dtype_t, stream: *mut c_void, user_data: *mut c_void) -> ep_moe_status_t>,
    pub reduce_scatter: Option<unsafe extern "C" fn(out_request: *mut *mut c_void, out: *mut c_void, in_: *const c_void, count: usize, dtype: ep_moe_dtype_t, stream: *mut c_void, user_data: *mut c_void) -> ep_moe_status_t>,
    pub barrier: Option<unsafe extern "C" fn(out_request: *mut *mut c_void, user_data: *mut c_void) -> ep_moe_status_t>,
    pub test: Option<unsafe extern "C" fn(out_done: *mut i32, request: *mut c_void, user_data: *mut c_void) -> ep_moe_status_t>,
    pub cancel: Option<unsafe extern "C" fn(request: *mut c_void, user_data: *mut c_void)>,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_layer_config_t {
    pub struct_size: usize,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_experts: i32,
    pub top_k: i32,
    pub activation: i32,
    pub weight_dtype: i32,
    pub act_dtype: i32,
    pub router_dtype: i32,
    pub scoring: i32,
    pub renormalize: i32,
    pub num_expert_group: i32,
    pub topk_group: i32,
    pub use_score_bias: i32,
    pub routed_scaling_factor: f32,
    pub shared_intermediate_size: i32,
    pub shared_expert_gate: i32,
    pub max_tokens: i32,
    pub num_threads: i32,
    pub skip_mode: i32,
    pub dispatch_mode: i32,
    pub device: i32,
    pub sync_free_tokens: i32,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_forward_args_t {
    pub struct_size: usize,
    pub num_tokens: i64,
    pub hidden: *const c_void,
    pub router_logits: *const c_void,
    pub topk_ids: *const i32,
    pub topk_weights: *const f32,
    pub out: *mut c_void,
    pub dp_token_counts: *const i32,
    pub dp_is_decode: *const i32,
    pub is_graph: i32,
    pub is_prefill: i32,
    pub stream: *mut c_void,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_checkpoint_config_t {
    pub struct_size: usize,
    pub naming: i32,
    pub name_prefix: *const c_char,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_tensor_info_t {
    pub struct_size: usize,
    pub name: [c_char; 256],
    pub dtype: [c_char; 16],
    pub n_dims: i32,
    pub dims: [i64; 8],
    pub tensor_bytes: i64,
    pub bytes: i64,
    pub file_index: i32,
    pub transposed: i32,
}

#[repr(C)]
#[derive(Copy, Clone)]
pub struct ep_moe_rebalance_config_t {
    pub struct_size: usize,
    pub num_experts: i32,
    pub num_slots: i32,
    pub num_ranks: i32,
    pub ranks_per_node: i32,
    pub num_expert_groups: i32,
    pub num_current_slots: i32,
    pub current_slots: *const i32,
}

#[link(name = "ep_moe")]
extern "C" {
    pub fn ep_moe_version() -> u32;
    pub fn ep_moe_version_string() -> *const c_char;
    pub fn ep_moe_status_string(status: ep_moe_status_t) -> *const c_char;
    pub fn ep_moe_last_error() -> *const c_char;
    pub fn ep_moe_has_feature(features: u32) -> c_int;
    pub fn ep_moe_set_log_callback(fn_: ep_moe_log_fn, max_level: ep_moe_log_level_t, user_data: *mut c_void) -> ep_moe_status_t;
    pub fn ep_moe_dtype_block(out_elems: *mut i64, out_bytes: *mut i64, dtype: ep_moe_dtype_t) -> ep_moe_status_t;
    pub fn ep_moe_dtype_name(dtype: ep_moe_dtype_t) -> *const c_char;
    pub fn ep_moe_quantize(out: *mut c_void, dtype: ep_moe_dtype_t, in_: *const f32, rows: i64, cols: i64) -> ep_moe_status_t;
    pub fn ep_moe_dequantize(out: *mut f32, in_: *const c_void, dtype: ep_moe_dtype_t, rows: i64, cols: i64) -> ep_moe_status_t;
    pub fn ep_moe_fp8_pack(out: *mut c_void, weight: *const u8, scale_inv: *const f32, rows: i64, cols: i64) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_config_init(out: *mut ep_moe_expert_map_config_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_create(out: *mut *mut ep_moe_expert_map_t, config: *const ep_moe_expert_map_config_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_destroy(map: *mut ep_moe_expert_map_t);
    pub fn ep_moe_expert_map_update(map: *mut ep_moe_expert_map_t, config: *const ep_moe_expert_map_config_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_last_error(map: *const ep_moe_expert_map_t) -> *const c_char;
    pub fn ep_moe_expert_map_get_attr(out: *mut i32, map: *const ep_moe_expert_map_t, attr: ep_moe_map_attr_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_global_to_local(out: *mut i32, map: *const ep_moe_expert_map_t, global_id: i32) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_local_to_global(out: *mut i32, map: *const ep_moe_expert_map_t, local_id: i32) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_is_local(out: *mut i32, map: *const ep_moe_expert_map_t, global_id: i32) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_table_length(out: *mut usize, map: *const ep_moe_expert_map_t, table: ep_moe_map_table_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_copy_table(out: *mut i32, out_len: usize, map: *const ep_moe_expert_map_t, table: ep_moe_map_table_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_describe(out: *mut c_char, out_size: usize, out_needed: *mut usize, map: *const ep_moe_expert_map_t) -> ep_moe_status_t;
    pub fn ep_moe_mask_and_remap(out_ids: *mut i32, out_weights: *mut c_void, out_mask: *mut u8, map: *const ep_moe_expert_map_t, topk_ids: *const i32, topk_weights: *const c_void, weights_dtype: ep_moe_dtype_t, num_tokens: i64, top_k: i32, mode: ep_moe_remap_mode_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_config_init(out: *mut ep_moe_comm_config_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_create_local(out: *mut *mut ep_moe_comm_t, size: i32, config: *const ep_moe_comm_config_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_create_mpi(out: *mut *mut ep_moe_comm_t, mpi_comm: *const c_void, mpi_comm_size: usize, config: *const ep_moe_comm_config_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_create_nccl(out: *mut *mut ep_moe_comm_t, nccl_comm: *mut c_void, config: *const ep_moe_comm_config_t) -> ep_moe_status_t;
    pub fn ep_moe_nccl_get_unique_id(out: *mut c_void, out_size: usize) -> ep_moe_status_t;
    pub fn ep_moe_comm_create_nccl_from_id(out: *mut *mut ep_moe_comm_t, unique_id: *const c_void, unique_id_size: usize, rank: i32, size: i32, config: *const ep_moe_comm_config_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_callbacks_init(out: *mut ep_moe_comm_callbacks_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_create_callbacks(out: *mut *mut ep_moe_comm_t, callbacks: *const ep_moe_comm_callbacks_t, config: *const ep_moe_comm_config_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_get_async_error(out_status: *mut ep_moe_status_t, out_peer: *mut i32, comm: *const ep_moe_comm_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_backend(comm: *const ep_moe_comm_t) -> *const c_char;
    pub fn ep_moe_comm_split(out: *mut *mut ep_moe_comm_t, comm: *mut ep_moe_comm_t, color: i32, key: i32) -> ep_moe_status_t;
    pub fn ep_moe_comm_destroy(comm: *mut ep_moe_comm_t);
    pub fn ep_moe_comm_abort(comm: *mut ep_moe_comm_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_get_rank(out: *mut i32, comm: *const ep_moe_comm_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_get_size(out: *mut i32, comm: *const ep_moe_comm_t) -> ep_moe_status_t;
    pub fn ep_moe_comm_set_timeout(comm: *mut ep_moe_comm_t, timeout_ms: i32) -> ep_moe_status_t;
    pub fn ep_moe_comm_last_error(comm: *const ep_moe_comm_t) -> *const c_char;
    pub fn ep_moe_comm_all_reduce(out: *mut c_void, in_: *const c_void, count: usize, dtype: ep_moe_dtype_t, comm: *mut ep_moe_comm_t, stream: *mut c_void) -> ep_moe_status_t;
    pub fn ep_moe_comm_reduce_scatter(out: *mut c_void, in_: *const c_void, count: usize, dtype: ep_moe_dtype_t, comm: *mut ep_moe_comm_t, stream: *mut c_void) -> ep_moe_status_t;
    pub fn ep_moe_comm_all_gather(out: *mut c_void, in_: *const c_void, count: usize, dtype: ep_moe_dtype_t, comm: *mut ep_moe_comm_t, stream: *mut c_void) -> ep_moe_status_t;
    pub fn ep_moe_comm_all_gather_v(out: *mut c_void, in_: *const c_void, counts: *const usize, dtype: ep_moe_dtype_t, comm: *mut ep_moe_comm_t, stream: *mut c_void) -> ep_moe_status_t;
    pub fn ep_moe_comm_all_to_all_v(out: *mut c_void, out_counts: *const usize, in_: *const c_void, in_counts: *const usize, dtype: ep_moe_dtype_t, comm: *mut ep_moe_comm_t, stream: *mut c_void) -> ep_moe_status_t;
    pub fn ep_moe_comm_barrier(comm: *mut ep_moe_comm_t) -> ep_moe_status_t;
    pub fn ep_moe_layer_config_init(out: *mut ep_moe_layer_config_t) -> ep_moe_status_t;
    pub fn ep_moe_expert_map_config_from_layer(config: *mut ep_moe_expert_map_config_t, layer: *const ep_moe_layer_config_t) -> ep_moe_status_t;
    pub fn ep_moe_layer_create(out: *mut *mut ep_moe_layer_t, config: *const ep_moe_layer_config_t, map: *const ep_moe_expert_map_t, ep_comm: *mut ep_moe_comm_t, dp_comm: *mut ep_moe_comm_t) -> ep_moe_status_t;
    pub fn ep_moe_layer_destroy(layer: *mut ep_moe_layer_t);
    pub fn ep_moe_layer_last_error(layer: *const ep_moe_layer_t) -> *const c_char;
    pub fn ep_moe_layer_set_weight(out_stored: *mut i32, layer: *mut ep_moe_layer_t, which: ep_moe_weight_t, expert: i32, data: *const c_void, dtype: ep_moe_dtype_t, rows: i64, cols: i64) -> ep_moe_status_t;
    pub fn ep_moe_forward_args_init(out: *mut ep_moe_forward_args_t) -> ep_moe_status_t;
    pub fn ep_moe_layer_forward(layer: *mut ep_moe_layer_t, args: *const ep_moe_forward_args_t) -> ep_moe_status_t;
    pub fn ep_moe_layer_get_attr(out: *mut i64, layer: *const ep_moe_layer_t, attr: ep_moe_layer_attr_t) -> ep_moe_status_t;
    pub fn ep_moe_checkpoint_config_init(out: *mut ep_moe_checkpoint_config_t) -> ep_moe_status_t;
    pub fn ep_moe_checkpoint_open(out: *mut *mut ep_moe_checkpoint_t, path: *const c_char, config: *const ep_moe_checkpoint_config_t) -> ep_moe_status_t;
    pub fn ep_moe_checkpoint_close(checkpoint: *mut ep_moe_checkpoint_t);
    pub fn ep_moe_checkpoint_last_error(checkpoint: *const ep_moe_checkpoint_t) -> *const c_char;
    pub fn ep_moe_checkpoint_architecture(checkpoint: *const ep_moe_checkpoint_t) -> *const c_char;
    pub fn ep_moe_checkpoint_get_attr(out: *mut i64, checkpoint: *const ep_moe_checkpoint_t, attr: ep_moe_checkpoint_attr_t) -> ep_moe_status_t;
    pub fn ep_moe_checkpoint_moe_layers(out: *mut i32, out_len: usize, out_count: *mut usize, checkpoint: *const ep_moe_checkpoint_t) -> ep_moe_status_t;
    pub fn ep_moe_checkpoint_layer_config(config: *mut ep_moe_layer_config_t, checkpoint: *const ep_moe_checkpoint_t, layer: i32) -> ep_moe_status_t;
    pub fn ep_moe_tensor_info_init(out: *mut ep_moe_tensor_info_t) -> ep_moe_status_t;
    pub fn ep_moe_checkpoint_tensor_info(out: *mut ep_moe_tensor_info_t, checkpoint: *const ep_moe_checkpoint_t, layer: i32, which: ep_moe_weight_t, expert: i32) -> ep_moe_status_t;
    pub fn ep_moe_layer_load(layer: *mut ep_moe_layer_t, checkpoint: *const ep_moe_checkpoint_t, layer_index: i32) -> ep_moe_status_t;
    pub fn ep_moe_layer_expert_load(out: *mut i64, out_len: usize, layer: *mut ep_moe_layer_t, across_ranks: i32, reset: i32) -> ep_moe_status_t;
    pub fn ep_moe_rebalance_config_init(out: *mut ep_moe_rebalance_config_t) -> ep_moe_status_t;
    pub fn ep_moe_rebalance(out_slots: *mut i32, out_len: usize, out_imbalance: *mut f64, load: *const f64, load_len: usize, config: *const ep_moe_rebalance_config_t) -> ep_moe_status_t;
    pub fn ep_moe_layer_replace(layer: *mut ep_moe_layer_t, new_map: *const ep_moe_expert_map_t, new_ep_comm: *mut ep_moe_comm_t, checkpoint: *const ep_moe_checkpoint_t, layer_index: i32) -> ep_moe_status_t;
}
