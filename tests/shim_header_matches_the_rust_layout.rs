//! `shim/include/kvsan.h` compiled by a real C compiler: every struct's
//! size, alignment and field offsets, and every constant, equal the Rust
//! definitions in `kvsan_sanitizer::abi`, so the two cannot drift.

mod shim_common;

use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::process::Command;

use kvsan_sanitizer::abi::{
    self, HOOK_TABLE_VERSION_MAJOR, HOOK_TABLE_VERSION_MINOR, KVSAN_FLAG_POISON,
    KVSAN_POOL_REPORTS_LANDING, KVSAN_VERDICT_ABORT, KVSAN_VERDICT_CONTINUE, KVSAN_VERDICT_ERROR,
    REQUEST_EVENTS, STATUSES,
};
use kvsan_sanitizer::{AccessOp, NodeRole};

/// `(label, Rust value, C expression)` for every size, alignment and offset.
macro_rules! layout {
    ($($ty:ident { $($field:ident),* })*) => {{
        let mut rows: Vec<(String, i64, String)> = Vec::new();
        $(
            rows.push((
                format!("sizeof {}", stringify!($ty)),
                size_of::<abi::$ty>() as i64,
                format!("sizeof({})", stringify!($ty)),
            ));
            rows.push((
                format!("alignof {}", stringify!($ty)),
                align_of::<abi::$ty>() as i64,
                format!("_Alignof({})", stringify!($ty)),
            ));
            $(
                rows.push((
                    format!("offsetof {}.{}", stringify!($ty), stringify!($field)),
                    offset_of!(abi::$ty, $field) as i64,
                    format!("offsetof({}, {})", stringify!($ty), stringify!($field)),
                ));
            )*
        )*
        rows
    }};
}

fn rows() -> Vec<(String, i64, String)> {
    let mut rows = layout! {
        KvsanOwner { request, tenant, reserved }
        KvsanPageRef { page, generation }
        KvsanRange { start, end }
        KvsanPoolGeometry { pages, page_slots, layers, role, bytes_per_slot, node, node_len }
        KvsanManifest { request, src_pool, dst_pool, src_pages, src_len, dst_pages, dst_len,
                        first_token, tokens, layers, checksum }
        KvsanPageLanding { request, page, first_token, slots, layers, sent_digest,
                           landed_digest }
        KvsanVerdict { code, kind, violation_id }
        KvsanHookTable { size, version_major, version_minor, flags, quarantine_pages, ctx,
                         pool_register, request_event, alloc, free, write, read,
                         transfer_send, transfer_recv, transfer_commit,
                         kernel_shadow, kernel_refusal, request_event_at,
                         share, declare_salt, transfer_land, transfer_verify,
                         tier_store, tier_store_done, tier_load, tier_verify, tier_release }
        KvsanKernelShadow { size, layout_version, pages, page_slots, layers, record_size,
                            stride_words, reserved, records, bits, counters }
        KvsanKernelAccess { op, layer, page, slots, entry, reserved }
        KvsanNvtxPlane { base, page_stride, page_bytes }
    };
    let mut constant =
        |name: &str, value: i64| rows.push((name.to_string(), value, name.to_string()));
    for &(code, name) in STATUSES {
        constant(name, code.into());
    }
    constant("KVSAN_ABI_VERSION", abi::ABI_VERSION.into());
    constant("KVSAN_ABI_VERSION_MAJOR", HOOK_TABLE_VERSION_MAJOR.into());
    constant("KVSAN_ABI_VERSION_MINOR", HOOK_TABLE_VERSION_MINOR.into());
    constant("KVSAN_VERDICT_CONTINUE", KVSAN_VERDICT_CONTINUE.into());
    constant("KVSAN_VERDICT_ABORT", KVSAN_VERDICT_ABORT.into());
    constant("KVSAN_VERDICT_ERROR", KVSAN_VERDICT_ERROR.into());
    constant("KVSAN_FLAG_POISON", KVSAN_FLAG_POISON.into());
    constant(
        "KVSAN_POOL_REPORTS_LANDING",
        KVSAN_POOL_REPORTS_LANDING.into(),
    );
    // u64::MAX both sides, printed through `long long`.
    constant(
        "KVSAN_PREFIX_CACHE_REQUEST",
        kvsan_sanitizer::RequestId::PREFIX_CACHE.0 as i64,
    );
    for (name, op) in [
        ("KVSAN_ACCESS_READ", AccessOp::Read),
        ("KVSAN_ACCESS_STORE", AccessOp::Store),
        ("KVSAN_ACCESS_POISON", AccessOp::Poison),
    ] {
        constant(name, i64::from(op as u32));
    }
    for (name, role) in [
        ("KVSAN_ROLE_UNIFIED", NodeRole::Unified),
        ("KVSAN_ROLE_PREFILL", NodeRole::Prefill),
        ("KVSAN_ROLE_DECODE", NodeRole::Decode),
    ] {
        constant(name, abi::role_code(role).into());
    }
    for &kind in kvsan_sanitizer::ViolationKind::ALL {
        let name = format!(
            "KVSAN_KIND_{}",
            kind.name().to_uppercase().replace('-', "_")
        );
        constant(&name, kind.code().into());
    }
    for event in REQUEST_EVENTS {
        let name = format!("KVSAN_EVENT_{}", format!("{event:?}").to_uppercase());
        constant(&name, abi::event_code(event).into());
    }
    rows
}

#[test]
fn every_size_offset_and_constant_of_kvsan_h_equals_the_rust_abi() {
    let rows = rows();
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"kvsan.h\"\nint main(void) {\n",
    );
    for (label, _, expr) in &rows {
        writeln!(
            c,
            "    printf(\"%s %lld\\n\", \"{label}\", (long long)({expr}));"
        )
        .unwrap();
    }
    c.push_str("    return 0;\n}\n");
    let source = shim_common::scratch().join("layout.c");
    std::fs::write(&source, c).unwrap();
    let exe = shim_common::compile_c(&source, "layout");
    let out = Command::new(&exe).output().expect("run the layout program");
    assert!(out.status.success());
    let (stdout, _) = shim_common::texts(&out);
    let printed: Vec<(&str, i64)> = stdout
        .lines()
        .map(|l| {
            let (label, value) = l.rsplit_once(' ').expect("label value");
            (label, value.parse().expect("a number"))
        })
        .collect();
    assert_eq!(printed.len(), rows.len());
    let mismatches: Vec<String> = rows
        .iter()
        .zip(&printed)
        .filter(|((_, rust, _), (_, c))| rust != c)
        .map(|((label, rust, _), (_, c))| format!("{label}: Rust {rust}, C {c}"))
        .collect();
    assert!(
        mismatches.is_empty(),
        "kvsan.h drifted from kvsan_sanitizer::abi:\n{}",
        mismatches.join("\n")
    );
    // The documented LP64 sizes.
    for (label, want) in [
        ("sizeof KvsanHookTable", 192),
        ("offsetof KvsanHookTable.kernel_shadow", 96),
        ("offsetof KvsanHookTable.share", 120),
        ("offsetof KvsanHookTable.transfer_land", 136),
        ("offsetof KvsanHookTable.transfer_verify", 144),
        ("offsetof KvsanHookTable.tier_store", 152),
        ("offsetof KvsanHookTable.tier_release", 184),
        ("sizeof KvsanPageLanding", 64),
        ("sizeof KvsanKernelShadow", 56),
        ("sizeof KvsanKernelAccess", 32),
        ("sizeof KvsanManifest", 80),
        ("sizeof KvsanPoolGeometry", 40),
        ("sizeof KvsanOwner", 16),
        ("sizeof KvsanVerdict", 16),
    ] {
        assert!(printed.contains(&(label, want)), "{label} is not {want}");
    }
}
