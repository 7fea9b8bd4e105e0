//! Messages and strategies shared by the transport tests.
#![allow(dead_code)]

use kvsan_engine::request::{CacheSalt, ErrorKind, Rejection, RequestError};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::transport::{
    KvPayload, KvTransfer, NodeInfo, PrefillOrder, ToDecode, ToPrefill, kv_checksum, kv_payload_len,
};
use kvsan_sanitizer::{Manifest, Owner, PageRef, PoolId, RequestId};
use proptest::prelude::*;

/// The geometry the tests announce in their hello.
pub const KV_DIM: usize = 8;

pub fn hello() -> ToDecode {
    ToDecode::Hello(NodeInfo {
        pool_tokens: 1024,
        page_slots: 16,
        n_layers: 4,
        kv_dim: KV_DIM,
        context_length: 8192,
    })
}

/// A KV transfer of `tokens` tokens over `layers` layers for `request`,
/// with bytes of the right length and a pattern that tells them apart.
pub fn kv(request: u64, first_token: u32, tokens: u32, layers: u32, kv_dim: usize) -> ToDecode {
    let pages = (first_token + tokens).div_ceil(16) as usize;
    let mut manifest = Manifest {
        request: Owner::new(request, 7),
        src_pool: PoolId(1),
        src_pages: (0..pages as u32).map(|p| PageRef::new(p, 1)).collect(),
        dst_pool: PoolId(2),
        dst_pages: (0..pages as u32)
            .map(|p| PageRef::new(100 + p, 3))
            .collect(),
        first_token,
        tokens,
        layers: 0..layers,
        checksum: 0,
    };
    let len = kv_payload_len(&manifest, kv_dim);
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i as u64).wrapping_mul(2_654_435_761).wrapping_add(request) as u8)
        .collect();
    manifest.checksum = kv_checksum(&bytes);
    let digests = (0..manifest.tokens.div_ceil(16).max(1))
        .map(|i| kv_checksum(&[i as u8, request as u8]))
        .collect();
    ToDecode::Kv(KvTransfer {
        manifest,
        payload: KvPayload::Bytes(bytes),
        digests,
    })
}

pub fn prefill_order(request: u64, prompt_len: usize) -> ToPrefill {
    ToPrefill::Prefill(PrefillOrder {
        owner: Owner::new(request, 3),
        prompt: (0..prompt_len as u32).map(|t| t * 7 % 49152).collect(),
        sampling: SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            seed: 42,
        },
        dst_pool: PoolId(2),
        dst_pages: (0..prompt_len.div_ceil(16) as u32)
            .map(|p| PageRef::new(p, 9))
            .collect(),
        cache_salt: CacheSalt {
            server: Some("key-salt".into()),
            client: None,
        },
    })
}

/// The time queued that [`done`] reports, in microseconds.
pub const DONE_QUEUED_US: u64 = 1_500_250;

pub fn done(request: u64) -> ToDecode {
    ToDecode::PrefillDone {
        request: RequestId(request),
        first_token: 1234,
        cached_tokens: 96,
        queued_us: DONE_QUEUED_US,
    }
}

pub fn failed(request: u64) -> ToDecode {
    ToDecode::PrefillFailed {
        request: RequestId(request),
        error: RequestError::rejected(Rejection {
            reason: "prompt exceeds the prefill pool".into(),
            prompt_tokens: 1100,
            limit: 1024,
            node: "prefill".into(),
        }),
    }
}

/// One message of every `ToDecode` kind.
pub fn every_to_decode() -> Vec<ToDecode> {
    vec![
        hello(),
        kv(5, 0, 20, 4, KV_DIM),
        ToDecode::Kv(KvTransfer {
            manifest: match kv(6, 16, 3, 2, KV_DIM) {
                ToDecode::Kv(t) => t.manifest,
                _ => unreachable!(),
            },
            payload: KvPayload::Landed,
            digests: vec![7, 8],
        }),
        done(5),
        failed(6),
        ToDecode::PrefillFailed {
            request: RequestId(9),
            error: RequestError {
                kind: ErrorKind::Violation,
                message: "stale-read on page 4".into(),
                rejection: None,
                violation: Some(kvsan_engine::request::Violated {
                    id: kvsan_sanitizer::ViolationId(1),
                    kind: kvsan_sanitizer::ViolationKind::StaleRead,
                }),
            },
        },
    ]
}

/// One message of every `ToPrefill` kind.
pub fn every_to_prefill() -> Vec<ToPrefill> {
    vec![
        prefill_order(5, 37),
        ToPrefill::Cancel {
            request: RequestId(5),
        },
    ]
}

// ------------------------------------------------------------ strategies

fn page_refs() -> impl Strategy<Value = Vec<PageRef>> {
    prop::collection::vec(
        (any::<u32>(), any::<u32>()).prop_map(|(p, g)| PageRef::new(p, g)),
        0..20,
    )
}

fn sampling() -> impl Strategy<Value = SamplingParams> {
    (any::<f32>(), any::<usize>(), any::<f32>(), any::<u64>()).prop_map(
        |(temperature, top_k, top_p, seed)| SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        },
    )
}

pub fn to_prefill() -> impl Strategy<Value = ToPrefill> {
    prop_oneof![
        (
            any::<u64>(),
            any::<u32>(),
            prop::collection::vec(any::<u32>(), 0..300),
            sampling(),
            any::<u32>(),
            page_refs(),
            prop::option::of("\\PC{0,24}"),
            prop::option::of("\\PC{0,24}"),
        )
            .prop_map(
                |(r, t, prompt, sampling, pool, dst_pages, server, client)| {
                    ToPrefill::Prefill(PrefillOrder {
                        owner: Owner::new(r, t),
                        prompt,
                        sampling,
                        dst_pool: PoolId(pool),
                        dst_pages,
                        cache_salt: CacheSalt { server, client },
                    })
                }
            ),
        any::<u64>().prop_map(|r| ToPrefill::Cancel {
            request: RequestId(r)
        }),
    ]
}

fn error_kind() -> impl Strategy<Value = ErrorKind> {
    prop_oneof![
        Just(ErrorKind::Rejected),
        Just(ErrorKind::Cancelled),
        Just(ErrorKind::Violation),
        Just(ErrorKind::Transport),
        Just(ErrorKind::InvalidRequest),
        Just(ErrorKind::Internal),
    ]
}

fn request_error() -> impl Strategy<Value = RequestError> {
    (
        error_kind(),
        ".{0,40}",
        prop::option::of((".{0,20}", any::<usize>(), any::<usize>(), "[a-z]{0,8}")),
        prop::option::of((
            0..1_000_000u64,
            prop::sample::select(kvsan_sanitizer::ViolationKind::ALL),
        )),
    )
        .prop_map(|(kind, message, rejection, violation)| RequestError {
            kind,
            message,
            rejection: rejection.map(|(reason, prompt_tokens, limit, node)| {
                Box::new(Rejection {
                    reason,
                    prompt_tokens,
                    limit,
                    node,
                })
            }),
            violation: violation.map(|(id, kind)| kvsan_engine::request::Violated {
                id: kvsan_sanitizer::ViolationId(id),
                kind,
            }),
        })
}

/// A KV transfer whose bytes have the length its manifest needs at
/// [`KV_DIM`] (or `Landed`).
fn kv_transfer() -> impl Strategy<Value = KvTransfer> {
    (
        any::<(u64, u32, u32, u32)>(),
        page_refs(),
        page_refs(),
        any::<u32>(),
        0u32..40,
        0u32..6,
        0u32..6,
        any::<u64>(),
        any::<bool>(),
        any::<u8>(),
        prop::collection::vec(any::<u64>(), 0..4),
    )
        .prop_map(
            |(
                (r, t, sp, dp),
                src_pages,
                dst_pages,
                first,
                tokens,
                l0,
                nl,
                checksum,
                landed,
                fill,
                digests,
            )| {
                let manifest = Manifest {
                    request: Owner::new(r, t),
                    src_pool: PoolId(sp),
                    src_pages,
                    dst_pool: PoolId(dp),
                    dst_pages,
                    first_token: first,
                    tokens,
                    layers: l0..l0 + nl,
                    checksum,
                };
                let payload = if landed {
                    KvPayload::Landed
                } else {
                    let n = kv_payload_len(&manifest, KV_DIM);
                    KvPayload::Bytes((0..n).map(|i| (i as u8) ^ fill).collect())
                };
                KvTransfer {
                    manifest,
                    payload,
                    digests,
                }
            },
        )
}

pub fn to_decode() -> impl Strategy<Value = ToDecode> {
    prop_oneof![
        any::<(usize, usize, usize, usize, usize)>().prop_map(|(a, b, c, d, e)| {
            ToDecode::Hello(NodeInfo {
                pool_tokens: a,
                page_slots: b,
                n_layers: c,
                kv_dim: d,
                context_length: e,
            })
        }),
        kv_transfer().prop_map(ToDecode::Kv),
        (any::<u64>(), any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(r, t, c, q)| {
            ToDecode::PrefillDone {
                request: RequestId(r),
                first_token: t,
                cached_tokens: c,
                queued_us: q,
            }
        }),
        (any::<u64>(), request_error()).prop_map(|(r, error)| ToDecode::PrefillFailed {
            request: RequestId(r),
            error,
        }),
    ]
}
