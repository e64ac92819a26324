// Finds libep_moe with `pkg-config` (run as a command: no crates), honouring
// PKG_CONFIG_PATH, links it, and records the C compiler's layout of the
// public structs for the layout test.
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn pkg_config(args: &[&str]) -> String {
    let out = Command::new("pkg-config")
        .args(args)
        .arg("ep_moe")
        .output()
        .unwrap_or_else(|e| panic!("cannot run pkg-config: {e} (install pkg-config)"));
    if !out.status.success() {
        panic!(
            "pkg-config cannot find ep_moe: {}\nInstall ep_moe or set PKG_CONFIG_PATH to <prefix>/lib/pkgconfig",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8(out.stdout).expect("pkg-config printed non-UTF-8").trim().to_string()
}

fn main() {
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-changed=layout_probe.c");
    let libdir = pkg_config(&["--variable=libdir"]);
    let includedir = pkg_config(&["--variable=includedir"]);
    for flag in pkg_config(&["--libs"]).split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
        } else if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={lib}");
        }
    }
    // Binaries find the library without LD_LIBRARY_PATH (this crate's own,
    // and, through DEP_EP_MOE_LIBDIR, those of crates that depend on it).
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    println!("cargo:libdir={libdir}");
    println!("cargo:include={includedir}");

    // The C side of the layout test: compile and run the probe.
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let exe = out_dir.join("layout_probe");
    let cc = env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args(["-std=c99", "-o"])
        .arg(&exe)
        .arg("layout_probe.c")
        .arg(format!("-I{includedir}"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc}: {e}"));
    assert!(status.success(), "compiling layout_probe.c failed");
    let out = Command::new(&exe).output().expect("running layout_probe failed");
    assert!(out.status.success(), "layout_probe failed");
    std::fs::write(out_dir.join("c_layout.txt"), out.stdout).unwrap();
}
