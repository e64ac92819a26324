#!/usr/bin/env python3
"""A model of include/ep_moe/ep_moe.h (enums, structs, functions), read with
regular expressions: the header's own conventions make that reliable.

Used to generate the Rust FFI declarations (bindings/rust/ep-moe-sys) and the
layout checks (static_asserts in src/capi/abi_layout.cpp, the Rust layout
test), and by tests that check those generated files are current.

  header_model.py rust-ffi   HEADER            -> Rust extern declarations
  header_model.py layout-probe HEADER          -> a C program printing sizes/offsets
  header_model.py rust-layout-test HEADER      -> Rust test comparing with the probe
  header_model.py static-asserts HEADER PROBE_OUTPUT -> C++ static_asserts
"""
import re
import sys


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def parse(path):
    raw = open(path).read()
    text = strip_comments(raw)
    text = text.replace("\\\n", " ")                     # join continued lines
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M)     # drop preprocessor lines
    model = {"enums": [], "structs": [], "functions": [], "opaque": [], "fnptrs": []}
    for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        values = []
        for item in m.group(2).split(","):
            item = item.strip()
            if not item:
                continue
            name, expr = [x.strip() for x in item.split("=", 1)]
            expr = expr.replace("u <<", " <<").replace("u<<", "<<")
            values.append((name, int(eval(expr))))
        model["enums"].append((m.group(3), values))
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        body = re.sub(r"\s+", " ", m.group(2))
        for decl in body.split(";"):
            decl = decl.strip()
            if not decl:
                continue
            fp = re.match(r"(.+?)\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)$", decl)
            if fp:
                fields.append({"name": fp.group(2), "fnptr": (fp.group(1).strip(), split_params(fp.group(3)))})
                continue
            arr = re.match(r"(.+?)\s*(\w+)\s*\[(\d+)\]$", decl)
            if arr:
                fields.append({"name": arr.group(2), "type": arr.group(1).strip(), "array": int(arr.group(3))})
                continue
            t, name = re.match(r"(.+?)\s*(\w+)$", decl).groups()
            fields.append({"name": name, "type": t.strip()})
        model["structs"].append((m.group(3), fields))
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s+(\w+)\s*;", text):
        model["opaque"].append(m.group(2))
    for m in re.finditer(r"typedef\s+(\w+)\s*\(\s*\*\s*(\w+)\s*\)\s*\((.*?)\)\s*;", text, re.S):
        model["fnptrs"].append((m.group(2), m.group(1), split_params(m.group(3))))
    for m in re.finditer(r"EP_MOE_API\s+(.+?)\b(ep_moe_\w+)\s*\((.*?)\)\s*;", text, re.S):
        ret = re.sub(r"\s+", " ", m.group(1)).strip()
        model["functions"].append((m.group(2), ret, split_params(m.group(3))))
    return model


def split_params(s):
    s = re.sub(r"\s+", " ", s).strip()
    if s in ("", "void"):
        return []
    out = []
    for p in s.split(","):
        p = p.strip()
        t, name = re.match(r"(.+?)\s*(\w+)$", p).groups()
        out.append((t.strip(), name))
    return out


SCALARS = {
    "int32_t": "i32", "int64_t": "i64", "uint32_t": "u32", "uint8_t": "u8", "size_t": "usize",
    "float": "f32", "double": "f64", "char": "c_char", "int": "c_int", "void": "c_void",
}


def rust_type(t, model):
    t = t.strip()
    const = False
    stars = t.count("*")
    base = t.replace("*", " ").split()
    if base and base[0] == "const":
        const = True
        base = base[1:]
    base = " ".join(base)
    r = SCALARS.get(base, base)
    if stars == 0:
        return r
    inner = r
    for i in range(stars):
        qual = "*const" if (const and i == 0) else "*mut"
        inner = f"{qual} {inner}"
    return inner


def rust_ffi(model):
    out = ["// Generated from include/ep_moe/ep_moe.h by tools/header_model.py; do not edit.",
           "// (tests/abi/check_generated.sh fails when this file is out of date.)",
           "#![allow(non_camel_case_types, non_upper_case_globals, dead_code)]",
           "use std::os::raw::{c_char, c_int, c_void};", ""]
    out.append("pub const EP_MOE_VERSION_MAJOR: u32 = %s;" % VERSION["MAJOR"])
    out.append("pub const EP_MOE_VERSION_MINOR: u32 = %s;" % VERSION["MINOR"])
    out.append("pub const EP_MOE_VERSION_PATCH: u32 = %s;" % VERSION["PATCH"])
    out.append("")
    for name, values in model["enums"]:
        out.append(f"pub type {name} = i32;")
        for v, n in values:
            out.append(f"pub const {v}: {name} = {n};")
        out.append("")
    for name in model["opaque"]:
        out.append("#[repr(C)]")
        out.append(f"pub struct {name} {{")
        out.append("    _private: [u8; 0],")
        out.append("    _not_send_sync: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,")
        out.append("}")
        out.append("")
    for name, ret, params in model["fnptrs"]:
        args = ", ".join(f"{rust_ident(p)}: {rust_type(t, model)}" for t, p in params)
        out.append(f"pub type {name} = Option<unsafe extern \"C\" fn({args}){ret_rust(ret, model)}>;")
        out.append("")
    for name, fields in model["structs"]:
        out.append("#[repr(C)]")
        out.append("#[derive(Copy, Clone)]")
        out.append(f"pub struct {name} {{")
        for f in fields:
            if "fnptr" in f:
                ret, params = f["fnptr"]
                args = ", ".join(f"{rust_ident(p)}: {rust_type(t, model)}" for t, p in params)
                out.append(f"    pub {f['name']}: Option<unsafe extern \"C\" fn({args}){ret_rust(ret, model)}>,")
            elif "array" in f:
                out.append(f"    pub {f['name']}: [{rust_type(f['type'], model)}; {f['array']}],")
            else:
                out.append(f"    pub {f['name']}: {rust_type(f['type'], model)},")
        out.append("}")
        out.append("")
    out.append('#[link(name = "ep_moe")]')
    out.append('extern "C" {')
    for name, ret, params in model["functions"]:
        args = ", ".join(f"{rust_ident(p)}: {rust_type(t, model)}" for t, p in params)
        out.append(f"    pub fn {name}({args}){ret_rust(ret, model)};")
    out.append("}")
    return "\n".join(out) + "\n"


def rust_ident(n):
    return n + "_" if n in ("type", "fn", "ref", "in", "out_", "mod", "use", "where", "loop", "match") else n


def ret_rust(ret, model):
    r = rust_type(ret, model)
    return "" if r == "c_void" else f" -> {r}"


def probe(model):
    out = ['/* Generated by tools/header_model.py: prints the layout of every public struct. */',
           "#include <stddef.h>", "#include <stdio.h>", '#include "ep_moe/ep_moe.h"', "int main(void) {"]
    for name, fields in model["structs"]:
        out.append(f'  printf("{name} (sizeof) %zu\\n", sizeof({name}));')
        for f in fields:
            out.append(f'  printf("{name} {f["name"]} %zu\\n", offsetof({name}, {f["name"]}));')
    out.append("  return 0;\n}")
    return "\n".join(out) + "\n"


def rust_layout_test(model):
    out = ["// Generated by tools/header_model.py; do not edit.",
           "// Compares the Rust structs with the C compiler's layout (printed by",
           "// layout_probe.c at build time).", "use ep_moe_sys::*;", "",
           "fn c_layout() -> std::collections::HashMap<String, usize> {",
           '    include_str!(concat!(env!("OUT_DIR"), "/c_layout.txt"))',
           "        .lines()",
           "        .filter_map(|l| {",
           "            let mut it = l.rsplitn(2, ' ');",
           "            let v = it.next()?.parse().ok()?;",
           "            Some((it.next()?.to_string(), v))",
           "        })",
           "        .collect()",
           "}", "", "#[test]", "fn struct_layouts_match_the_c_header() {", "    let c = c_layout();",
           "    let get = |k: &str| *c.get(k).unwrap_or_else(|| panic!(\"{} missing from the C probe\", k));"]
    for name, fields in model["structs"]:
        out.append(f'    assert_eq!(std::mem::size_of::<{name}>(), get("{name} (sizeof)"), "sizeof {name}");')
        for f in fields:
            out.append(f'    assert_eq!(std::mem::offset_of!({name}, {f["name"]}), get("{name} {f["name"]}"), "{name}.{f["name"]}");')
    out.append("}")
    return "\n".join(out) + "\n"


def static_asserts(model, probe_output):
    vals = {}
    for line in probe_output.splitlines():
        k, v = line.rsplit(" ", 1)
        vals[k] = int(v)
    out = ["// Generated by tools/header_model.py from the layout the compiler gave on",
           "// x86-64 Linux (tests/abi/update.sh); do not edit. A change here is an ABI",
           "// change: see docs/abi.md.", "// clang-format off", "#include <cstddef>", "",
           '#include "ep_moe/ep_moe.h"', "",
           "#if defined(__x86_64__) && defined(__linux__)"]
    for name, fields in model["structs"]:
        out.append(f'static_assert(sizeof({name}) == {vals[name + " (sizeof)"]}, "ABI: sizeof({name})");')
        for f in fields:
            out.append(f'static_assert(offsetof({name}, {f["name"]}) == {vals[name + " " + f["name"]]}, '
                       f'"ABI: {name}::{f["name"]}");')
    out.append("#endif")
    return "\n".join(out) + "\n"


VERSION = {}

if __name__ == "__main__":
    what, header = sys.argv[1], sys.argv[2]
    text = open(header).read()
    for part in ("MAJOR", "MINOR", "PATCH"):
        VERSION[part] = re.search(r"#define EP_MOE_VERSION_%s (\d+)" % part, text).group(1)
    model = parse(header)
    if what == "rust-ffi":
        sys.stdout.write(rust_ffi(model))
    elif what == "layout-probe":
        sys.stdout.write(probe(model))
    elif what == "rust-layout-test":
        sys.stdout.write(rust_layout_test(model))
    elif what == "static-asserts":
        sys.stdout.write(static_asserts(model, open(sys.argv[3]).read()))
    else:
        sys.exit(f"unknown command {what}")
