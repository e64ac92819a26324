//! Raw FFI declarations of ep_moe's C API, generated from `ep_moe.h`
//! (`tools/header_model.py rust-ffi`). Everything here is `unsafe`; the
//! `ep-moe` crate wraps it safely.
mod ffi;
pub use ffi::*;
