//! Shared fixtures: a sanitizer with a prefill and a decode pool in
//! SmolLM2-135M's geometry, reports captured in memory.
#![allow(dead_code)]

use std::ops::Range;

use kvsan_sanitizer::block_table::entry_slots;
use kvsan_sanitizer::{
    Manifest, NodeRole, Options, Owner, PageId, PageLanding, PageRef, PoolGeometry, PoolId,
    ReportBuffer, Sanitizer, SanitizerError, Verdict,
};

pub const LAYERS: u32 = 30;
pub const SLOTS: u32 = 16;
pub const ALL: Range<u32> = 0..LAYERS;

pub struct Fixture {
    pub san: Sanitizer,
    pub decode: PoolId,
    pub prefill: PoolId,
    pub out: ReportBuffer,
}

pub fn geometry(role: NodeRole, node: &str, pages: u32) -> PoolGeometry {
    PoolGeometry {
        pages,
        page_slots: SLOTS,
        layers: LAYERS,
        bytes_per_slot: 2 * 3 * 64 * 2,
        role,
        node: node.into(),
    }
}

/// The fixture's pools quarantine freed pages (64 per pool) unless
/// `options` says otherwise, so the Quarantined state is covered; the
/// default is no quarantine.
pub fn fixture_with(options: &str) -> Fixture {
    let out = ReportBuffer::default();
    let options = if options.contains("quarantine_pages") {
        options.to_string()
    } else {
        format!("quarantine_pages=64:{options}")
    };
    let san = Sanitizer::with_writer(Options::parse(&options).expect("test options"), out.clone());
    let decode = san
        .pool_register(geometry(NodeRole::Decode, "decode-0", 8))
        .unwrap();
    let prefill = san
        .pool_register(geometry(NodeRole::Prefill, "prefill-0", 8))
        .unwrap();
    Fixture {
        san,
        decode,
        prefill,
        out,
    }
}

pub fn fixture() -> Fixture {
    fixture_with("")
}

pub const A: Owner = Owner::new(4, 1);
pub const B: Owner = Owner::new(7, 2);
/// Another request of `A`'s tenant: the prefix cache may share `A`'s pages
/// with it under the default policy (`prefix_share=tenant`).
pub const A2: Owner = Owner::new(9, 1);

impl Fixture {
    pub fn alloc(&self, pool: PoolId, page: u32, owner: Owner, step: u64) -> PageRef {
        let (v, generation) = self.san.alloc(pool, PageId(page), owner, step).unwrap();
        assert!(v.is_continue(), "alloc of page {page} by {owner}: {v:?}");
        PageRef {
            page: PageId(page),
            generation,
        }
    }

    pub fn write_all(
        &self,
        pool: PoolId,
        owner: Owner,
        page: PageRef,
        slots: Range<u32>,
        step: u64,
    ) {
        let v = self.san.write(pool, owner, page, slots, ALL, step).unwrap();
        assert!(v.is_continue(), "write by {owner}: {v:?}");
    }

    /// A transfer arrives (`transfer_recv`) and a correct copy puts every
    /// piece where the manifest says (`transfer_land`, then
    /// `transfer_verify` with matching digests): the first refusal, or
    /// `Continue`.
    pub fn receive(&self, pool: PoolId, m: &Manifest) -> Result<Verdict, SanitizerError> {
        receive(&self.san, pool, m)
    }

    pub fn free(&self, pool: PoolId, owner: Owner, page: PageRef, step: u64) {
        let v = self.san.free(pool, owner, page, step).unwrap();
        assert!(v.is_continue(), "free by {owner}: {v:?}");
    }
}

pub fn manifest(
    request: Owner,
    src: &[PageRef],
    dst: &[PageRef],
    first: u32,
    tokens: u32,
) -> Manifest {
    Manifest {
        request,
        src_pool: PoolId(1),
        src_pages: src.to_vec(),
        dst_pool: PoolId(0),
        dst_pages: dst.to_vec(),
        first_token: first,
        tokens,
        layers: ALL,
        checksum: 0x5eed,
    }
}

/// Replaces violation ids (`KV-000123`) with `KV-NNNNNN`.
pub fn normalise(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("KV-") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 3..];
        let digits = after.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 {
            out.push_str("KV-NNNNNN");
        } else {
            out.push_str("KV-");
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// Compares `text` (normalised) with `tests/golden/<name>.txt`;
/// `KVSAN_BLESS=1` rewrites the file instead.
pub fn assert_golden(name: &str, text: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.txt"));
    let text = normalise(text);
    if std::env::var("KVSAN_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with KVSAN_BLESS=1 to create)", path.display()));
    assert_eq!(
        text,
        expected,
        "report differs from {} (KVSAN_BLESS=1 rewrites it)",
        path.display()
    );
}

/// [`Fixture::receive`] on any sanitizer.
pub fn receive(san: &Sanitizer, pool: PoolId, m: &Manifest) -> Result<Verdict, SanitizerError> {
    let v = san.transfer_recv(pool, m)?;
    if !v.is_continue() {
        return Ok(v);
    }
    for (i, slots) in entry_slots(m.token_range(), SLOTS) {
        let landing = landing_of(m, i, slots);
        for v in [
            san.transfer_land(pool, &landing)?,
            san.transfer_verify(pool, &landing)?,
        ] {
            if !v.is_continue() {
                return Ok(v);
            }
        }
    }
    Ok(Verdict::Continue)
}

/// The landing of `m`'s piece for block-table entry `entry` (slots
/// `slots`), where the manifest says, with matching digests.
pub fn landing_of(m: &Manifest, entry: usize, slots: Range<u32>) -> PageLanding {
    PageLanding {
        request: m.request,
        page: m.dst_pages[entry],
        first_token: entry as u64 * u64::from(SLOTS) + u64::from(slots.start),
        slots,
        layers: m.layers.clone(),
        sent_digest: 0xd16e57,
        landed_digest: 0xd16e57,
    }
}
