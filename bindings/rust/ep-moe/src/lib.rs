//! Safe Rust bindings of ep_moe: an expert-parallel Mixture-of-Experts layer.
//!
//! Handles are owned types freed on `Drop`; every call returns
//! `Result<T, Error>`, where [`Error`] carries the C status and message;
//! tensors are slices whose lengths are checked against the shapes.
//!
//! Threading follows the C API's rules (`ep_moe.h`): functions taking a
//! `const` handle may run concurrently, others need exclusive access. Hence:
//! - [`ExpertMap`] and [`Checkpoint`] are `Send + Sync` (queries are `&self`
//!   and thread-safe in C; `update` takes `&mut self`).
//! - [`Comm`] is `Send + Sync`: collectives take `&mut self` (the C API needs
//!   exclusive access for them), while its `&self` methods call functions the
//!   C API allows from any thread. [`AbortHandle`] (`Send + Sync`) aborts from
//!   another thread while a collective is blocked — `ep_moe_comm_abort` is the
//!   one call allowed then — and keeps the C handle alive until both are
//!   dropped.
//! - [`Layer`] is `Send` (with its communicators, to its rank's thread) but
//!   not `Sync`: forward needs exclusive access.
use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::os::raw::c_void;
use std::ptr;
use std::sync::Arc;

pub use ep_moe_sys as sys;

// ---------------------------------------------------------------- errors ----

/// A status of the C API other than `EP_MOE_OK`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    InvalidArgument,
    OutOfMemory,
    Unsupported,
    BufferTooSmall,
    StructSize,
    InvalidHandle,
    Internal,
    Timeout,
    Aborted,
    Remote,
    Io,
    Format,
    NotFound,
    State,
    Device,
    /// A status this version of the bindings does not know.
    Other(i32),
}

impl Status {
    fn from_raw(s: sys::ep_moe_status_t) -> Status {
        match s {
            sys::EP_MOE_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::EP_MOE_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::EP_MOE_ERR_UNSUPPORTED => Status::Unsupported,
            sys::EP_MOE_ERR_BUFFER_TOO_SMALL => Status::BufferTooSmall,
            sys::EP_MOE_ERR_STRUCT_SIZE => Status::StructSize,
            sys::EP_MOE_ERR_INVALID_HANDLE => Status::InvalidHandle,
            sys::EP_MOE_ERR_INTERNAL => Status::Internal,
            sys::EP_MOE_ERR_TIMEOUT => Status::Timeout,
            sys::EP_MOE_ERR_ABORTED => Status::Aborted,
            sys::EP_MOE_ERR_REMOTE => Status::Remote,
            sys::EP_MOE_ERR_IO => Status::Io,
            sys::EP_MOE_ERR_FORMAT => Status::Format,
            sys::EP_MOE_ERR_NOT_FOUND => Status::NotFound,
            sys::EP_MOE_ERR_STATE => Status::State,
            sys::EP_MOE_ERR_DEVICE => Status::Device,
            other => Status::Other(other),
        }
    }
}

/// A failed call: its status and the library's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.status, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn c_str(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the library returns NUL-terminated strings valid until the next call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Turns a status into a Result; `message` reads the handle's (or the
/// thread's) last error only on failure.
fn check(status: sys::ep_moe_status_t, message: impl FnOnce() -> String) -> Result<()> {
    if status == sys::EP_MOE_OK {
        Ok(())
    } else {
        Err(Error { status: Status::from_raw(status), message: message() })
    }
}

fn thread_error() -> String {
    // SAFETY: always returns a valid string.
    c_str(unsafe { sys::ep_moe_last_error() })
}

fn invalid(message: String) -> Error {
    Error { status: Status::InvalidArgument, message }
}

// ------------------------------------------------------------- basics ----

/// The loaded library's version as (major, minor, patch).
pub fn version() -> (u32, u32, u32) {
    // SAFETY: no arguments.
    let v = unsafe { sys::ep_moe_version() };
    (v / 10000, (v / 100) % 100, v % 100)
}

/// Whether the library was built with every feature in `mask` (`sys::EP_MOE_FEATURE_*`).
pub fn has_feature(mask: u32) -> bool {
    // SAFETY: any value is accepted.
    unsafe { sys::ep_moe_has_feature(mask) == 1 }
}

/// The GGUF block formats routed experts' weights may be given in
/// (`Layer::set_weight_blocks`): rows of whole blocks, as GGUF stores them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    Q8_0,
    Q4_0,
    Q4K,
    Q5K,
    Q6K,
    Iq4Xs,
    Mxfp4,
    Q2K,
    Q3K,
    Q4_1,
    Q5_0,
    Q5_1,
    Iq4Nl,
    Iq2Xxs,
    Iq2Xs,
    Iq2S,
    Iq3Xxs,
    Iq3S,
    Iq1S,
    Iq1M,
    /// ep_moe's block-scaled FP8 (an f32 scale and 128 E4M3 codes a block;
    /// `sys::ep_moe_fp8_pack` builds it from a checkpoint's weight_scale_inv).
    Fp8E4m3,
}

impl BlockFormat {
    /// The `ep_moe_dtype_t` value.
    pub fn raw(self) -> sys::ep_moe_dtype_t {
        match self {
            BlockFormat::Q8_0 => sys::EP_MOE_DTYPE_Q8_0,
            BlockFormat::Q4_0 => sys::EP_MOE_DTYPE_Q4_0,
            BlockFormat::Q4K => sys::EP_MOE_DTYPE_Q4_K,
            BlockFormat::Q5K => sys::EP_MOE_DTYPE_Q5_K,
            BlockFormat::Q6K => sys::EP_MOE_DTYPE_Q6_K,
            BlockFormat::Iq4Xs => sys::EP_MOE_DTYPE_IQ4_XS,
            BlockFormat::Mxfp4 => sys::EP_MOE_DTYPE_MXFP4,
            BlockFormat::Q2K => sys::EP_MOE_DTYPE_Q2_K,
            BlockFormat::Q3K => sys::EP_MOE_DTYPE_Q3_K,
            BlockFormat::Q4_1 => sys::EP_MOE_DTYPE_Q4_1,
            BlockFormat::Q5_0 => sys::EP_MOE_DTYPE_Q5_0,
            BlockFormat::Q5_1 => sys::EP_MOE_DTYPE_Q5_1,
            BlockFormat::Iq4Nl => sys::EP_MOE_DTYPE_IQ4_NL,
            BlockFormat::Iq2Xxs => sys::EP_MOE_DTYPE_IQ2_XXS,
            BlockFormat::Iq2Xs => sys::EP_MOE_DTYPE_IQ2_XS,
            BlockFormat::Iq2S => sys::EP_MOE_DTYPE_IQ2_S,
            BlockFormat::Iq3Xxs => sys::EP_MOE_DTYPE_IQ3_XXS,
            BlockFormat::Iq3S => sys::EP_MOE_DTYPE_IQ3_S,
            BlockFormat::Iq1S => sys::EP_MOE_DTYPE_IQ1_S,
            BlockFormat::Iq1M => sys::EP_MOE_DTYPE_IQ1_M,
            BlockFormat::Fp8E4m3 => sys::EP_MOE_DTYPE_FP8_E4M3,
        }
    }
    /// (elements, bytes) of one block (`ep_moe_dtype_block`).
    pub fn block(self) -> (i64, i64) {
        let (mut elems, mut bytes) = (0i64, 0i64);
        // SAFETY: both out-pointers are valid; every BlockFormat is a dtype.
        let st = unsafe { sys::ep_moe_dtype_block(&mut elems, &mut bytes, self.raw()) };
        debug_assert_eq!(st, sys::EP_MOE_OK);
        (elems, bytes)
    }
}

/// Element types of tensors given to and returned by the layer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    fn raw(self) -> sys::ep_moe_dtype_t {
        match self {
            DType::F32 => sys::EP_MOE_DTYPE_F32,
            DType::Bf16 => sys::EP_MOE_DTYPE_BF16,
            DType::F16 => sys::EP_MOE_DTYPE_F16,
        }
    }
    fn from_raw(v: i32) -> Option<DType> {
        match v {
            x if x == sys::EP_MOE_DTYPE_F32 as i32 => Some(DType::F32),
            x if x == sys::EP_MOE_DTYPE_BF16 as i32 => Some(DType::Bf16),
            x if x == sys::EP_MOE_DTYPE_F16 as i32 => Some(DType::F16),
            _ => None,
        }
    }
}

/// A bfloat16 value (its bits).
#[repr(transparent)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds to nearest even.
    pub fn from_f32(v: f32) -> Bf16 {
        let u = v.to_bits();
        Bf16(((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16)
    }
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// An IEEE half-precision value (its bits).
#[repr(transparent)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct F16(pub u16);

impl F16 {
    /// Rounds to nearest even; overflow gives infinity.
    pub fn from_f32(v: f32) -> F16 {
        let u = v.to_bits();
        let sign = ((u >> 16) & 0x8000) as u16;
        let exp = ((u >> 23) & 0xff) as i32;
        let man = u & 0x7f_ffff;
        if exp == 0xff {
            return F16(sign | 0x7c00 | if man != 0 { 0x200 } else { 0 });
        }
        let e = exp - 127 + 15;
        if e >= 31 {
            return F16(sign | 0x7c00);
        }
        if e <= 0 {
            if e < -10 {
                return F16(sign);
            }
            let m = man | 0x80_0000;
            let shift = (14 - e) as u32;
            let half = 1u32 << (shift - 1);
            let rem = m & ((1u32 << shift) - 1);
            let mut h = m >> shift;
            if rem > half || (rem == half && (h & 1) == 1) {
                h += 1;
            }
            return F16(sign | h as u16);
        }
        let rem = man & 0x1fff;
        let mut h = ((e as u32) << 10) | (man >> 13);
        if rem > 0x1000 || (rem == 0x1000 && (h & 1) == 1) {
            h += 1; // may carry into the exponent, up to infinity: still correct
        }
        F16(sign | h as u16)
    }
    pub fn to_f32(self) -> f32 {
        let h = self.0 as u32;
        let sign = (h & 0x8000) << 16;
        let exp = (h >> 10) & 0x1f;
        let man = h & 0x3ff;
        let bits = if exp == 0 {
            if man == 0 {
                sign
            } else {
                // subnormal: normalise
                let mut e = 127 - 15 + 1;
                let mut m = man;
                while m & 0x400 == 0 {
                    m <<= 1;
                    e -= 1;
                }
                sign | ((e as u32) << 23) | ((m & 0x3ff) << 13)
            }
        } else if exp == 31 {
            sign | 0x7f80_0000 | (man << 13)
        } else {
            sign | ((exp + 127 - 15) << 23) | (man << 13)
        };
        f32::from_bits(bits)
    }
}

/// Types a tensor slice may hold.
pub trait Element: Copy {
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for Bf16 {
    const DTYPE: DType = DType::Bf16;
}
impl Element for F16 {
    const DTYPE: DType = DType::F16;
}

// ---------------------------------------------------------- expert map ----

/// Configuration of an expert map; dereferences to the C struct, whose
/// fields (`ep_size`, `ep_rank`, `global_num_experts`, `placement`, ...) are
/// set directly. Custom placements are given with [`ExpertMapConfig::custom`].
pub struct ExpertMapConfig {
    raw: sys::ep_moe_expert_map_config_t,
    slots: Vec<i32>,
    per_rank: Vec<i32>,
}

impl Default for ExpertMapConfig {
    fn default() -> Self {
        // SAFETY: zeroed then initialised by the library.
        let mut raw: sys::ep_moe_expert_map_config_t = unsafe { std::mem::zeroed() };
        unsafe { sys::ep_moe_expert_map_config_init(&mut raw) };
        ExpertMapConfig { raw, slots: Vec::new(), per_rank: Vec::new() }
    }
}

impl ExpertMapConfig {
    /// A map of rank `ep_rank` of `ep_size` over `experts` experts (linear).
    pub fn new(ep_size: i32, ep_rank: i32, experts: i32) -> Self {
        let mut c = Self::default();
        c.ep_size = ep_size;
        c.ep_rank = ep_rank;
        c.global_num_experts = experts;
        c
    }
    /// A custom placement: `slots[p]` is the expert of physical slot p;
    /// `per_rank` (may be empty) the slots of each rank.
    pub fn custom(mut self, slots: Vec<i32>, per_rank: Vec<i32>) -> Self {
        self.placement = sys::EP_MOE_PLACEMENT_CUSTOM;
        self.slots = slots;
        self.per_rank = per_rank;
        self
    }
    /// The C struct, its slot pointers and count always from the owned
    /// vectors: whatever safe code wrote into those fields through
    /// `DerefMut` is replaced, so no pointer of its making reaches C.
    fn as_raw(&self) -> sys::ep_moe_expert_map_config_t {
        let mut r = self.raw;
        r.custom_slots = if self.slots.is_empty() { ptr::null() } else { self.slots.as_ptr() };
        r.num_custom_slots = self.slots.len() as i32;
        r.custom_slots_per_rank = if self.per_rank.is_empty() { ptr::null() } else { self.per_rank.as_ptr() };
        r
    }
}

impl Deref for ExpertMapConfig {
    type Target = sys::ep_moe_expert_map_config_t;
    fn deref(&self) -> &Self::Target {
        &self.raw
    }
}
impl DerefMut for ExpertMapConfig {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.raw
    }
}

/// One rank's expert map (`ep_moe_expert_map_t`).
pub struct ExpertMap {
    ptr: *mut sys::ep_moe_expert_map_t,
}

// SAFETY: the C API allows const calls from several threads at once and any
// call from any thread; `&mut self` methods are the non-const ones.
unsafe impl Send for ExpertMap {}
unsafe impl Sync for ExpertMap {}

impl ExpertMap {
    pub fn new(config: &ExpertMapConfig) -> Result<ExpertMap> {
        let raw = config.as_raw();
        if i32::try_from(config.slots.len()).is_err() {
            return Err(invalid(format!("{} custom slots is more than an i32 counts", config.slots.len())));
        }
        // C reads ep_size entries of per_rank.
        if !config.per_rank.is_empty() && config.per_rank.len() as i64 != i64::from(raw.ep_size) {
            return Err(invalid(format!(
                "per_rank has {} entries, not ep_size = {}",
                config.per_rank.len(),
                raw.ep_size
            )));
        }
        let mut p = ptr::null_mut();
        // SAFETY: valid pointers; the slot vectors outlive the call.
        check(unsafe { sys::ep_moe_expert_map_create(&mut p, &raw) }, thread_error)?;
        Ok(ExpertMap { ptr: p })
    }

    fn err(&self) -> String {
        // SAFETY: live handle.
        c_str(unsafe { sys::ep_moe_expert_map_last_error(self.ptr) })
    }

    /// Recomputes the map for a new layout; on error the map is unchanged.
    pub fn update(&mut self, config: &ExpertMapConfig) -> Result<()> {
        let raw = config.as_raw();
        // SAFETY: exclusive access through &mut self.
        check(unsafe { sys::ep_moe_expert_map_update(self.ptr, &raw) }, || self.err())
    }

    /// An attribute (`sys::EP_MOE_MAP_ATTR_*`).
    pub fn attr(&self, attr: sys::ep_moe_map_attr_t) -> Result<i32> {
        let mut v = 0;
        // SAFETY: live handle, valid out pointer.
        check(unsafe { sys::ep_moe_expert_map_get_attr(&mut v, self.ptr, attr) }, || self.err())?;
        Ok(v)
    }

    /// This rank's local id of a global expert, or None when it is elsewhere.
    pub fn global_to_local(&self, global: i32) -> Result<Option<i32>> {
        let mut v = 0;
        // SAFETY: as above.
        check(unsafe { sys::ep_moe_expert_map_global_to_local(&mut v, self.ptr, global) }, || self.err())?;
        Ok(if v < 0 { None } else { Some(v) })
    }

    /// A table (`sys::EP_MOE_MAP_TABLE_*`).
    pub fn table(&self, table: sys::ep_moe_map_table_t) -> Result<Vec<i32>> {
        let mut n = 0usize;
        // SAFETY: as above; the vector has the length the library asked for.
        check(unsafe { sys::ep_moe_expert_map_table_length(&mut n, self.ptr, table) }, || self.err())?;
        let mut v = vec![0i32; n];
        check(unsafe { sys::ep_moe_expert_map_copy_table(v.as_mut_ptr(), n, self.ptr, table) }, || self.err())?;
        Ok(v)
    }

    /// The compressed "local->global" description.
    pub fn describe(&self) -> Result<String> {
        let mut need = 0usize;
        // SAFETY: snprintf-style: first the length, then the text.
        check(unsafe { sys::ep_moe_expert_map_describe(ptr::null_mut(), 0, &mut need, self.ptr) }, || self.err())?;
        let mut buf = vec![0u8; need + 1];
        check(
            unsafe { sys::ep_moe_expert_map_describe(buf.as_mut_ptr() as *mut _, buf.len(), ptr::null_mut(), self.ptr) },
            || self.err(),
        )?;
        buf.truncate(need);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    pub fn as_ptr(&self) -> *const sys::ep_moe_expert_map_t {
        self.ptr
    }
}

impl Drop for ExpertMap {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        unsafe { sys::ep_moe_expert_map_destroy(self.ptr) }
    }
}

// -------------------------------------------------------- communicators ----

struct CommHandle(*mut sys::ep_moe_comm_t);

// SAFETY: the handle is only used for collectives through `&mut Comm` and for
// abort, which the C API allows from any thread at any time.
unsafe impl Send for CommHandle {}
unsafe impl Sync for CommHandle {}

impl Drop for CommHandle {
    fn drop(&mut self) {
        // SAFETY: the last owner destroys it once.
        unsafe { sys::ep_moe_comm_destroy(self.0) }
    }
}

/// One rank's communicator handle (`ep_moe_comm_t`).
pub struct Comm {
    h: Arc<CommHandle>,
}

/// Aborts a communicator from any thread (see `ep_moe_comm_abort`).
#[derive(Clone)]
pub struct AbortHandle {
    h: Arc<CommHandle>,
}

impl AbortHandle {
    pub fn abort(&self) {
        // SAFETY: allowed concurrently with a blocked collective on the handle.
        unsafe { sys::ep_moe_comm_abort(self.h.0) };
    }
}

impl Comm {
    /// `size` in-process ranks; element i is rank i.
    pub fn local_group(size: i32, timeout_ms: i32) -> Result<Vec<Comm>> {
        // SAFETY: zeroed then initialised by the library.
        let mut cfg: sys::ep_moe_comm_config_t = unsafe { std::mem::zeroed() };
        unsafe { sys::ep_moe_comm_config_init(&mut cfg) };
        cfg.timeout_ms = timeout_ms;
        let mut raw = vec![ptr::null_mut(); size.max(0) as usize];
        // SAFETY: `raw` has `size` entries.
        check(unsafe { sys::ep_moe_comm_create_local(raw.as_mut_ptr(), size, &cfg) }, thread_error)?;
        Ok(raw.into_iter().map(|p| Comm { h: Arc::new(CommHandle(p)) }).collect())
    }

    fn ptr(&self) -> *mut sys::ep_moe_comm_t {
        self.h.0
    }
    fn err(&self) -> String {
        // SAFETY: live handle.
        c_str(unsafe { sys::ep_moe_comm_last_error(self.ptr()) })
    }

    pub fn rank(&self) -> i32 {
        let mut v = 0;
        // SAFETY: live handle.
        unsafe { sys::ep_moe_comm_get_rank(&mut v, self.ptr()) };
        v
    }
    pub fn size(&self) -> i32 {
        let mut v = 0;
        // SAFETY: live handle.
        unsafe { sys::ep_moe_comm_get_size(&mut v, self.ptr()) };
        v
    }

    /// In-place sum over all ranks (f32 accumulation for 16-bit types).
    pub fn all_reduce<T: Element>(&mut self, data: &mut [T]) -> Result<()> {
        let p = data.as_mut_ptr() as *mut c_void;
        // SAFETY: in place over `data`; every rank passes the same length.
        check(
            unsafe { sys::ep_moe_comm_all_reduce(p, p, data.len(), T::DTYPE.raw(), self.ptr(), ptr::null_mut()) },
            || self.err(),
        )
    }

    /// Blocks until every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::ep_moe_comm_barrier(self.ptr()) }, || self.err())
    }

    /// A handle that can abort this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { h: self.h.clone() }
    }

    /// The status that broke the communicator (None while healthy) and the peer.
    pub fn async_error(&self) -> Option<(Status, i32)> {
        let mut s = 0;
        let mut peer = -1;
        // SAFETY: callable from any thread.
        unsafe { sys::ep_moe_comm_get_async_error(&mut s, &mut peer, self.ptr()) };
        if s == sys::EP_MOE_OK {
            None
        } else {
            Some((Status::from_raw(s), peer))
        }
    }
}

// ---------------------------------------------------------------- layer ----

/// Configuration of a layer; dereferences to the C struct (`hidden_size`,
/// `intermediate_size`, `num_experts`, `top_k`, ...).
#[derive(Copy, Clone)]
pub struct LayerConfig(sys::ep_moe_layer_config_t);

impl Default for LayerConfig {
    fn default() -> Self {
        // SAFETY: zeroed then initialised by the library.
        let mut raw: sys::ep_moe_layer_config_t = unsafe { std::mem::zeroed() };
        unsafe { sys::ep_moe_layer_config_init(&mut raw) };
        LayerConfig(raw)
    }
}
impl Deref for LayerConfig {
    type Target = sys::ep_moe_layer_config_t;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}
impl DerefMut for LayerConfig {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// The communicators a layer uses (borrowed for its lifetime).
pub enum LayerComms<'c> {
    /// No collectives: forward returns this rank's partial sum.
    None,
    /// The EP group, without DP attention.
    Ep(&'c mut Comm),
    /// The EP group is also the DP group (every rank its own replica).
    EpIsDp(&'c mut Comm),
    /// Separate EP and DP groups.
    EpAndDp(&'c mut Comm, &'c mut Comm),
}

/// How the layer routes a batch.
pub enum Routing<'a> {
    /// Router logits [T, E] (f32: a layer whose router_dtype is bf16 or f16
    /// takes them as [`Routing::Logits16`]).
    Logits(&'a [f32]),
    /// Router logits [T, E] in the layer's 16-bit router_dtype (the bits).
    Logits16(&'a [u16]),
    /// The caller's choice: ids and weights [T, K].
    TopK { ids: &'a [i32], weights: &'a [f32] },
    /// The layer's own router weight (`EP_MOE_WEIGHT_ROUTER`).
    Router,
}

/// DP-attention metadata of a step.
pub struct Dp<'a> {
    pub token_counts: &'a [i32],
    pub is_decode: Option<&'a [i32]>,
    pub is_graph: bool,
    pub is_prefill: bool,
}

/// One rank's MoE layer (`ep_moe_layer_t`).
pub struct Layer<'c> {
    ptr: *mut sys::ep_moe_layer_t,
    hidden: usize,
    experts: usize,
    top_k: usize,
    // What forward's slices must hold (the C API takes untyped pointers).
    act_dtype: Option<DType>,
    router_dtype: Option<DType>,
    // DP replicas: the length of a step's Dp::token_counts (and is_decode);
    // whether the DP group is the EP handle (it then follows a new EP group).
    dp_size: usize,
    dp_is_ep: bool,
    _comms: PhantomData<&'c mut Comm>,
}

// SAFETY: a layer may move (with its communicators) to the thread that drives
// its rank; it is not Sync (forward needs exclusive access).
unsafe impl Send for Layer<'_> {}

impl<'c> Layer<'c> {
    pub fn new(config: &LayerConfig, map: &ExpertMap, comms: LayerComms<'c>) -> Result<Layer<'c>> {
        let (ep, dp, dp_size, dp_is_ep) = match comms {
            LayerComms::None => (ptr::null_mut(), ptr::null_mut(), 1, false),
            LayerComms::Ep(c) => (c.ptr(), ptr::null_mut(), 1, false),
            LayerComms::EpIsDp(c) => (c.ptr(), c.ptr(), c.size(), true),
            LayerComms::EpAndDp(e, d) => (e.ptr(), d.ptr(), d.size(), false),
        };
        let mut p = ptr::null_mut();
        // SAFETY: valid pointers; the communicators outlive the layer ('c).
        check(unsafe { sys::ep_moe_layer_create(&mut p, &config.0, map.as_ptr(), ep, dp) }, thread_error)?;
        Ok(Layer {
            ptr: p,
            hidden: config.hidden_size as usize,
            experts: config.num_experts as usize,
            top_k: config.top_k as usize,
            act_dtype: DType::from_raw(config.act_dtype),
            router_dtype: DType::from_raw(config.router_dtype),
            dp_size: dp_size.max(1) as usize,
            dp_is_ep,
            _comms: PhantomData,
        })
    }

    fn err(&self) -> String {
        // SAFETY: live handle.
        c_str(unsafe { sys::ep_moe_layer_last_error(self.ptr) })
    }

    /// Gives one weight (`sys::EP_MOE_WEIGHT_*`); returns whether this rank
    /// kept it (false: another rank's expert).
    /// One weight in a GGUF block format: `blocks` holds rows x cols /
    /// block-elements blocks (`BlockFormat::block`), row after row. A CPU
    /// layer keeps routed experts' weights in the format; others are
    /// dequantized. Returns whether this rank kept it.
    pub fn set_weight_blocks(
        &mut self,
        which: sys::ep_moe_weight_t,
        expert: i32,
        blocks: &[u8],
        format: BlockFormat,
        rows: i64,
        cols: i64,
    ) -> Result<bool> {
        let (elems, bytes) = format.block();
        if rows < 0 || cols < 0 || cols % elems != 0 || blocks.len() as i64 != rows * (cols / elems) * bytes {
            return Err(invalid(format!(
                "blocks has {} bytes, not rows * cols / {} * {} for [{}, {}] in {:?}",
                blocks.len(),
                elems,
                bytes,
                rows,
                cols,
                format
            )));
        }
        let mut stored = 0;
        // SAFETY: `blocks` holds the rows' blocks, checked above.
        check(
            unsafe {
                sys::ep_moe_layer_set_weight(
                    &mut stored,
                    self.ptr,
                    which,
                    expert,
                    blocks.as_ptr() as *const c_void,
                    format.raw(),
                    rows,
                    cols,
                )
            },
            || self.err(),
        )?;
        Ok(stored != 0)
    }

    pub fn set_weight<T: Element>(
        &mut self,
        which: sys::ep_moe_weight_t,
        expert: i32,
        data: &[T],
        rows: i64,
        cols: i64,
    ) -> Result<bool> {
        if rows < 0 || cols < 0 || data.len() as i64 != rows * cols {
            return Err(invalid(format!("data has {} elements, not rows * cols = {}", data.len(), rows * cols)));
        }
        let mut stored = 0;
        // SAFETY: `data` holds rows * cols elements of T's dtype.
        check(
            unsafe {
                sys::ep_moe_layer_set_weight(
                    &mut stored,
                    self.ptr,
                    which,
                    expert,
                    data.as_ptr() as *const c_void,
                    T::DTYPE.raw(),
                    rows,
                    cols,
                )
            },
            || self.err(),
        )?;
        Ok(stored != 0)
    }

    /// Loads this rank's part of a checkpoint layer.
    pub fn load(&mut self, checkpoint: &Checkpoint, layer_index: i32) -> Result<()> {
        // SAFETY: live handles.
        check(unsafe { sys::ep_moe_layer_load(self.ptr, checkpoint.ptr, layer_index) }, || self.err())
    }

    /// Runs the layer on `hidden` ([T, H] of the layer's act_dtype: `f32`,
    /// [`Bf16`] or [`F16`] slices, checked) into `out`.
    pub fn forward<T: Element>(&mut self, hidden: &[T], routing: Routing<'_>, out: &mut [T], dp: Option<Dp<'_>>) -> Result<()> {
        if Some(T::DTYPE) != self.act_dtype {
            return Err(invalid(format!(
                "hidden and out are {:?} slices, but the layer's act_dtype is {:?}: pass slices of that type",
                T::DTYPE,
                self.act_dtype
            )));
        }
        if self.hidden == 0 || hidden.len() % self.hidden != 0 {
            return Err(invalid(format!("hidden has {} elements, not a multiple of H = {}", hidden.len(), self.hidden)));
        }
        let tokens = hidden.len() / self.hidden;
        if out.len() != hidden.len() {
            return Err(invalid(format!("out has {} elements, hidden {}", out.len(), hidden.len())));
        }
        // SAFETY: zeroed then initialised by the library.
        let mut a: sys::ep_moe_forward_args_t = unsafe { std::mem::zeroed() };
        unsafe { sys::ep_moe_forward_args_init(&mut a) };
        a.num_tokens = tokens as i64;
        a.hidden = hidden.as_ptr() as *const c_void;
        a.out = out.as_mut_ptr() as *mut c_void;
        match routing {
            Routing::Logits(l) => {
                if self.router_dtype != Some(DType::F32) {
                    return Err(invalid(format!(
                        "f32 logits given, but the layer's router_dtype is {:?}: use Routing::Logits16",
                        self.router_dtype
                    )));
                }
                if l.len() != tokens * self.experts {
                    return Err(invalid(format!("logits have {} elements, not T * E = {}", l.len(), tokens * self.experts)));
                }
                a.router_logits = l.as_ptr() as *const c_void;
            }
            Routing::Logits16(l) => {
                if self.router_dtype == Some(DType::F32) {
                    return Err(invalid("16-bit logits given, but the layer's router_dtype is f32: use Routing::Logits".to_string()));
                }
                if l.len() != tokens * self.experts {
                    return Err(invalid(format!("logits have {} elements, not T * E = {}", l.len(), tokens * self.experts)));
                }
                a.router_logits = l.as_ptr() as *const c_void;
            }
            Routing::TopK { ids, weights } => {
                if ids.len() != tokens * self.top_k || weights.len() != ids.len() {
                    return Err(invalid(format!("top-k ids/weights must have T * K = {} elements", tokens * self.top_k)));
                }
                a.topk_ids = ids.as_ptr();
                a.topk_weights = weights.as_ptr();
            }
            Routing::Router => {}
        }
        if let Some(d) = &dp {
            // C reads dp_size entries of each.
            if d.token_counts.len() != self.dp_size {
                return Err(invalid(format!(
                    "Dp::token_counts has {} entries, not the layer's DP size {}",
                    d.token_counts.len(),
                    self.dp_size
                )));
            }
            if let Some(v) = d.is_decode {
                if v.len() != self.dp_size {
                    return Err(invalid(format!(
                        "Dp::is_decode has {} entries, not the layer's DP size {}",
                        v.len(),
                        self.dp_size
                    )));
                }
            }
            a.dp_token_counts = d.token_counts.as_ptr();
            a.dp_is_decode = d.is_decode.map_or(ptr::null(), |v| v.as_ptr());
            a.is_graph = d.is_graph as i32;
            a.is_prefill = d.is_prefill as i32;
        }
        // SAFETY: every buffer has the length the layer will read or write.
        check(unsafe { sys::ep_moe_layer_forward(self.ptr, &a) }, || self.err())
    }

    /// An attribute (`sys::EP_MOE_LAYER_ATTR_*`).
    pub fn attr(&self, attr: sys::ep_moe_layer_attr_t) -> Result<i64> {
        let mut v = 0;
        // SAFETY: live handle.
        check(unsafe { sys::ep_moe_layer_get_attr(&mut v, self.ptr, attr) }, || self.err())?;
        Ok(v)
    }

    /// The per-expert load of the window; `across_ranks` sums over the EP
    /// group (collective), `reset` starts a new window.
    pub fn expert_load(&mut self, across_ranks: bool, reset: bool) -> Result<Vec<i64>> {
        let mut out = vec![0i64; self.experts];
        // SAFETY: `out` has E entries.
        check(
            unsafe {
                sys::ep_moe_layer_expert_load(out.as_mut_ptr(), out.len(), self.ptr, across_ranks as i32, reset as i32)
            },
            || self.err(),
        )?;
        Ok(out)
    }

    /// Applies a new placement over the current communicator (collective);
    /// missing weights may come from `checkpoint`.
    pub fn replace(&mut self, map: &ExpertMap, checkpoint: Option<&Checkpoint>, layer_index: i32) -> Result<()> {
        let ck = checkpoint.map_or(ptr::null(), |c| c.ptr as *const _);
        // SAFETY: live handles; the communicators stay borrowed for 'c.
        check(
            unsafe { sys::ep_moe_layer_replace(self.ptr, map.as_ptr(), ptr::null_mut(), ck, layer_index) },
            || self.err(),
        )
    }

    /// Moves the layer to a new EP group (elastic EP; collective over
    /// `comm`). On failure the layer comes back unchanged with the error.
    /// A DP group that was the EP handle itself follows; a separate one is
    /// kept, hence `'c: 'n`.
    pub fn replace_with_comm<'n>(
        self,
        map: &ExpertMap,
        comm: &'n mut Comm,
        checkpoint: Option<&Checkpoint>,
        layer_index: i32,
    ) -> std::result::Result<Layer<'n>, (Layer<'c>, Error)>
    where
        'c: 'n,
    {
        let ck = checkpoint.map_or(ptr::null(), |c| c.ptr as *const _);
        // SAFETY: live handles; `comm` outlives the returned layer ('n).
        let s = unsafe { sys::ep_moe_layer_replace(self.ptr, map.as_ptr(), comm.ptr(), ck, layer_index) };
        if let Err(e) = check(s, || self.err()) {
            return Err((self, e));
        }
        let next = Layer {
            ptr: self.ptr,
            hidden: self.hidden,
            experts: self.experts,
            top_k: self.top_k,
            act_dtype: self.act_dtype,
            router_dtype: self.router_dtype,
            dp_size: if self.dp_is_ep { comm.size().max(1) as usize } else { self.dp_size },
            dp_is_ep: self.dp_is_ep,
            _comms: PhantomData,
        };
        std::mem::forget(self);
        Ok(next)
    }
}

/// A balanced placement from per-expert load (`ep_moe_rebalance`): the
/// custom placement table (slot -> expert) and its imbalance (max rank
/// load / mean). `current` (may be empty) is the placement in use; packs
/// then stay on the ranks that hold most of them.
pub fn rebalance(
    load: &[f64],
    num_slots: i32,
    num_ranks: i32,
    ranks_per_node: i32,
    num_groups: i32,
    current: &[i32],
) -> Result<(Vec<i32>, f64)> {
    // SAFETY: zeroed then initialised by the library.
    let mut c: sys::ep_moe_rebalance_config_t = unsafe { std::mem::zeroed() };
    check(unsafe { sys::ep_moe_rebalance_config_init(&mut c) }, thread_error)?;
    c.num_experts = load.len() as i32;
    c.num_slots = num_slots;
    c.num_ranks = num_ranks;
    c.ranks_per_node = ranks_per_node;
    c.num_expert_groups = num_groups;
    c.num_current_slots = current.len() as i32;
    c.current_slots = if current.is_empty() { ptr::null() } else { current.as_ptr() };
    let mut out = vec![0i32; num_slots.max(0) as usize];
    let mut imbalance = 0f64;
    // SAFETY: the buffers have the lengths passed.
    check(
        unsafe { sys::ep_moe_rebalance(out.as_mut_ptr(), out.len(), &mut imbalance, load.as_ptr(), load.len(), &c) },
        thread_error,
    )?;
    Ok((out, imbalance))
}

impl Drop for Layer<'_> {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once.
        unsafe { sys::ep_moe_layer_destroy(self.ptr) }
    }
}

// ----------------------------------------------------------- checkpoint ----

/// An open checkpoint (`ep_moe_checkpoint_t`).
pub struct Checkpoint {
    ptr: *mut sys::ep_moe_checkpoint_t,
}

// SAFETY: every function taking a checkpoint takes it const (thread-safe).
unsafe impl Send for Checkpoint {}
unsafe impl Sync for Checkpoint {}

impl Checkpoint {
    pub fn open(path: &str) -> Result<Checkpoint> {
        let c = CString::new(path).map_err(|_| invalid("path contains a NUL byte".into()))?;
        let mut p = ptr::null_mut();
        // SAFETY: valid C string; default config.
        check(unsafe { sys::ep_moe_checkpoint_open(&mut p, c.as_ptr(), ptr::null()) }, thread_error)?;
        Ok(Checkpoint { ptr: p })
    }
    fn err(&self) -> String {
        // SAFETY: live handle.
        c_str(unsafe { sys::ep_moe_checkpoint_last_error(self.ptr) })
    }
    /// Indices of the layers with routed experts.
    pub fn moe_layers(&self) -> Result<Vec<i32>> {
        let mut n = 0usize;
        // SAFETY: snprintf-style: first the count, then the list.
        check(unsafe { sys::ep_moe_checkpoint_moe_layers(ptr::null_mut(), 0, &mut n, self.ptr) }, || self.err())?;
        let mut v = vec![0i32; n];
        check(unsafe { sys::ep_moe_checkpoint_moe_layers(v.as_mut_ptr(), n, &mut n, self.ptr) }, || self.err())?;
        Ok(v)
    }
    /// `config` with the model-shape fields filled from the checkpoint.
    pub fn layer_config(&self, config: LayerConfig, layer: i32) -> Result<LayerConfig> {
        let mut c = config;
        // SAFETY: initialised struct.
        check(unsafe { sys::ep_moe_checkpoint_layer_config(&mut c.0, self.ptr, layer) }, || self.err())?;
        Ok(c)
    }
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        // SAFETY: owned handle.
        unsafe { sys::ep_moe_checkpoint_close(self.ptr) }
    }
}
