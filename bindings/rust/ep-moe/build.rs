// Test and example binaries of this crate find libep_moe where pkg-config
// found it (passed on by ep-moe-sys as DEP_EP_MOE_LIBDIR).
fn main() {
    if let Ok(dir) = std::env::var("DEP_EP_MOE_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
