//! `shim/include/kvsan.h` is written by hand; the hooks are one list
//! (`kvsan_sanitizer::for_each_hook!`). The header's `KvsanHookTable` has
//! the list's hooks, in its order, with the listed function types; each of
//! those typedefs takes `void *ctx` and the listed C arguments; and each
//! `kvsan_*` function of the list is declared with the arguments its shape
//! gives it; so is each batch check of `for_each_batch_layout!`, over host
//! and over device buffers, and each function of `for_each_query!`; the
//! header declares no function outside the three lists. (Sizes and offsets:
//! `shim_header_matches_the_rust_layout.rs`.)

use std::path::Path;

/// A hook of the table: name, function type, C argument types.
struct TableHook {
    name: &'static str,
    fn_type: &'static str,
    args: Vec<&'static str>,
}

/// A plain C function of the list: name, shape, argument types, and for
/// each argument the size argument that follows it (if any).
struct Export {
    name: &'static str,
    shape: &'static str,
    args: Vec<(&'static str, &'static [&'static str])>,
}

macro_rules! table_hooks {
    ($(
        $(#[$doc:meta])*
        $variant:ident = $name:ident($($arg:ident: $ty:ty $([$size:ident])?),*), $minor:literal, $fn:ident;
    )*) => {
        vec![$(TableHook {
            name: stringify!($name),
            fn_type: stringify!($fn),
            args: vec![$(stringify!($ty)),*],
        }),*]
    };
}

macro_rules! exports {
    ($(
        $(#[$doc:meta])*
        $name:ident($($arg:ident: $ty:ty $([$size:ident])?),*), $export:ident, $shape:ident;
    )*) => {
        vec![$(Export {
            name: stringify!($export),
            shape: stringify!($shape),
            args: vec![$((stringify!($ty), &[$(stringify!($size)),*])),*],
        }),*]
    };
}

fn header() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("shim/include/kvsan.h");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The C spelling of a listed Rust argument type, with no space before `*`.
fn c_type(rust: &str) -> String {
    let rust = rust
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("* ", "*");
    if let Some(pointee) = rust.strip_prefix("*const ") {
        return format!("const {}*", c_type(pointee));
    }
    if let Some(pointee) = rust.strip_prefix("*mut ") {
        return format!("{}*", c_type(pointee));
    }
    match rust.as_str() {
        "u16" => "uint16_t".into(),
        "u32" => "uint32_t".into(),
        "u64" => "uint64_t".into(),
        "i32" => "int32_t".into(),
        "usize" => "size_t".into(),
        "c_char" => "char".into(),
        "AbiStatus" => "int32_t".into(),
        other => other.into(),
    }
}

/// The text from `open` (just after a `(`) to its matching `)`.
fn parenthesised(text: &str, open: usize) -> &str {
    let mut depth = 1;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return &text[open..open + i];
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced parentheses after byte {open}");
}

/// The types of a C parameter list, each without its name and with no
/// space before `*`.
fn parameter_types(params: &str) -> Vec<String> {
    if params.trim() == "void" {
        return Vec::new();
    }
    params
        .split(',')
        .map(|p| {
            let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
            let name_at = p
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(0, |i| i + 1);
            p[..name_at].trim_end().replace(" *", "*")
        })
        .collect()
}

#[test]
fn the_headers_hook_table_has_the_listed_hooks_in_order() {
    let header = header();
    let start = header
        .find("typedef struct KvsanHookTable {")
        .expect("the table");
    let end = start + header[start..].find("} KvsanHookTable;").expect("its end");
    let body = &header[start..end];
    let after_ctx = body.find("void *ctx;").expect("ctx") + "void *ctx;".len();
    let fields: Vec<(String, String)> = body[after_ctx..]
        .lines()
        .map(|l| l.split("/*").next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (ty, name) = l.trim_end_matches(';').split_once(' ').expect("type name;");
            (ty.trim().to_string(), name.trim().to_string())
        })
        .collect();
    let listed: Vec<TableHook> = kvsan_sanitizer::for_each_hook!(table => table_hooks);
    let want: Vec<(String, String)> = listed
        .iter()
        .map(|h| (format!("Kvsan{}", h.fn_type), h.name.to_string()))
        .collect();
    assert_eq!(
        fields, want,
        "kvsan.h's KvsanHookTable drifted from the list"
    );
}

#[test]
fn each_hook_function_type_of_the_header_takes_the_listed_arguments() {
    let header = header();
    for hook in kvsan_sanitizer::for_each_hook!(table => table_hooks) {
        let typedef = format!("typedef KvsanVerdict (*Kvsan{})(", hook.fn_type);
        let at = header
            .find(&typedef)
            .unwrap_or_else(|| panic!("kvsan.h lacks `{typedef}`"));
        let got = parameter_types(parenthesised(&header, at + typedef.len()));
        let mut want = vec!["void*".to_string()];
        want.extend(hook.args.iter().map(|t| c_type(t)));
        assert_eq!(
            got, want,
            "Kvsan{} (the `{}` hook)",
            hook.fn_type, hook.name
        );
    }
}

#[test]
fn each_listed_c_function_is_declared_with_the_arguments_of_its_shape() {
    let header = header();
    let exports: Vec<Export> = kvsan_sanitizer::for_each_hook!(export => exports);
    assert!(!exports.is_empty());
    for export in exports {
        let call = format!(" {}(", export.name);
        let at = header
            .find(&call)
            .unwrap_or_else(|| panic!("kvsan.h does not declare {}", export.name));
        if export.shape == "by_hand" {
            continue;
        }
        let returns = header[..at].split_whitespace().last();
        assert_eq!(returns, Some("int32_t"), "{}", export.name);
        let got = parameter_types(parenthesised(&header, at + call.len()));
        let mut want = Vec::new();
        for (ty, sized) in &export.args {
            want.push(c_type(ty));
            want.extend(sized.iter().map(|_| "size_t".to_string()));
        }
        match export.shape {
            "verdict" => want.push("KvsanVerdict*".into()),
            "status" => {}
            other => panic!("{}: unknown shape {other}", export.name),
        }
        assert_eq!(got, want, "{}", export.name);
    }
}

/// The C parameter types of a batch check of the list
/// (`kvsan_sanitizer::for_each_batch_layout!`): over host buffers, or over
/// device buffers (then `device` after `pool`, and each buffer a device
/// address).
fn batch_check_types(layout: kvsan_sanitizer::BatchLayout, device: bool) -> Vec<String> {
    use kvsan_sanitizer::layouts::{Extent, Param};
    let mut want = vec!["uint32_t".to_string()];
    if device {
        want.push("int32_t".into());
    }
    want.extend(["const KvsanOwner*".into(), "size_t".into()]);
    for param in layout.params() {
        match *param {
            Param::Array { array, value } => {
                want.push(if device {
                    "uint64_t".into()
                } else {
                    format!("const {value}*")
                });
                if let Extent::Own(_) = array.extent {
                    want.push("size_t".into());
                }
            }
            Param::Scalar(_) => want.push("size_t".into()),
        }
    }
    want.extend([
        "KvsanRange".into(),
        "uint64_t".into(),
        "KvsanVerdict*".into(),
    ]);
    want
}

#[test]
fn each_listed_batch_check_is_declared_for_host_and_device_buffers() {
    let header = header();
    let layouts = kvsan_sanitizer::BatchLayout::ALL;
    assert_eq!(layouts.len(), 4);
    for &layout in layouts {
        let (host, device) = layout.exports();
        for (name, on_device) in [(host, false), (device, true)] {
            let call = format!(" {name}(");
            let at = header
                .find(&call)
                .unwrap_or_else(|| panic!("kvsan.h does not declare {name}"));
            let returns = header[..at].split_whitespace().last();
            assert_eq!(returns, Some("int32_t"), "{name}");
            let got = parameter_types(parenthesised(&header, at + call.len()));
            assert_eq!(got, batch_check_types(layout, on_device), "{name}");
        }
    }
}

/// One of the library's other functions (`for_each_query!`).
struct Query {
    name: &'static str,
    args: Vec<&'static str>,
    returns: &'static str,
}

macro_rules! queries {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {
        vec![$(Query {
            name: stringify!($name),
            args: vec![$(stringify!($ty)),*],
            returns: stringify!($ret),
        }),*]
    };
}

/// `kvsan.h` without its comments.
fn declarations() -> String {
    let header = header();
    let mut out = String::with_capacity(header.len());
    let mut rest = header.as_str();
    while let Some(start) = rest.find("/*") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("*/").expect("a closed comment");
        rest = &rest[start + end + 2..];
    }
    out.push_str(rest);
    out
}

/// Where `name(` is declared: its byte offset after the `(`, and the
/// return type before it (no space before `*`).
fn declared(decls: &str, name: &str) -> Option<(usize, String)> {
    let call = format!("{name}(");
    decls.match_indices(&call).find_map(|(at, _)| {
        let before = decls[..at].chars().last()?;
        if before != ' ' && before != '*' {
            return None;
        }
        let line_start = decls[..at].rfind('\n').map_or(0, |i| i + 1);
        let returns = decls[line_start..at]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace(" *", "*");
        Some((at + call.len(), returns))
    })
}

#[test]
fn each_listed_query_is_declared_with_the_listed_c_types() {
    let decls = declarations();
    let queries: Vec<Query> = kvsan_sanitizer::for_each_query!(queries);
    assert!(queries.len() >= 16);
    for query in queries {
        let (open, returns) = declared(&decls, query.name)
            .unwrap_or_else(|| panic!("kvsan.h does not declare {}", query.name));
        assert_eq!(
            returns,
            c_type(query.returns),
            "{}'s return type",
            query.name
        );
        let got = parameter_types(parenthesised(&decls, open));
        let want: Vec<String> = query.args.iter().map(|t| c_type(t)).collect();
        assert_eq!(got, want, "{}", query.name);
    }
}

#[test]
fn the_header_declares_no_function_outside_the_lists() {
    let decls = declarations();
    let mut listed: Vec<String> = kvsan_sanitizer::for_each_hook!(export => exports)
        .into_iter()
        .map(|e| e.name.to_string())
        .collect();
    for layout in kvsan_sanitizer::BatchLayout::ALL {
        let (host, device) = layout.exports();
        listed.extend([host.to_string(), device.to_string()]);
    }
    let queries: Vec<Query> = kvsan_sanitizer::for_each_query!(queries);
    listed.extend(queries.iter().map(|q| q.name.to_string()));
    let mut seen = 0;
    for (at, _) in decls.match_indices("kvsan_") {
        let before = decls[..at].chars().last();
        let name: String = decls[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let declares =
            matches!(before, Some(' ' | '*')) && decls[at + name.len()..].starts_with('(');
        if declares {
            seen += 1;
            assert!(
                listed.contains(&name),
                "kvsan.h declares {name}, which no list has"
            );
        }
    }
    assert_eq!(
        seen,
        listed.len(),
        "kvsan.h declares each listed function once"
    );
}
