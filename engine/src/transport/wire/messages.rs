//! The messages' fields, type by type: [`ToPrefill`] and [`ToDecode`].

use super::WireError;
use super::fields::{Put, Take, no_bulk};
use super::{
    FrameHeader, TYPE_CANCEL, TYPE_HELLO, TYPE_KV, TYPE_PREFILL, TYPE_PREFILL_DONE,
    TYPE_PREFILL_FAILED, WireLimits, WireMessage,
};
use crate::request::{CacheSalt, ErrorKind, Rejection, RequestError};
use crate::sampler::SamplingParams;
use crate::transport::{KvPayload, KvTransfer, NodeInfo, PrefillOrder, ToDecode, ToPrefill};
use kvsan_sanitizer::{Manifest, PoolId, RequestId};

impl WireMessage for ToPrefill {
    const DIRECTION: &'static str = "decode → prefill";
    const ACCEPTED: &'static str = "1 prefill, 2 cancel";

    fn msg_type(&self) -> u8 {
        match self {
            ToPrefill::Prefill(_) => TYPE_PREFILL,
            ToPrefill::Cancel { .. } => TYPE_CANCEL,
        }
    }

    fn request(&self) -> Option<RequestId> {
        Some(match self {
            ToPrefill::Prefill(o) => o.owner.request,
            ToPrefill::Cancel { request } => *request,
        })
    }

    fn accepts(msg_type: u8) -> bool {
        matches!(msg_type, TYPE_PREFILL | TYPE_CANCEL)
    }

    fn bulk(&self) -> Option<&[u8]> {
        None
    }

    fn encode_fields(&self, out: &mut Vec<u8>) {
        let mut p = Put(out);
        match self {
            ToPrefill::Prefill(o) => {
                p.owner(o.owner);
                p.f32(o.sampling.temperature);
                p.usize(o.sampling.top_k);
                p.f32(o.sampling.top_p);
                p.u64(o.sampling.seed);
                p.u32(o.dst_pool.0);
                p.pages(&o.dst_pages);
                p.tokens(&o.prompt);
                for part in [&o.cache_salt.server, &o.cache_salt.client] {
                    p.u8(u8::from(part.is_some()));
                    if let Some(s) = part {
                        p.str(s);
                    }
                }
            }
            ToPrefill::Cancel { request } => p.u64(request.0),
        }
    }

    fn decode(
        header: &FrameHeader,
        fields: &[u8],
        bulk: Option<Vec<u8>>,
        _limits: &WireLimits,
    ) -> Result<Self, WireError> {
        no_bulk(header, bulk.as_ref())?;
        let mut t = Take::new(fields, header);
        let msg = match header.msg_type {
            TYPE_PREFILL => {
                let owner = t.owner("owner")?;
                let sampling = SamplingParams {
                    temperature: t.f32("sampling.temperature")?,
                    top_k: t.usize("sampling.top_k")?,
                    top_p: t.f32("sampling.top_p")?,
                    seed: t.u64("sampling.seed")?,
                };
                let dst_pool = PoolId(t.u32("dst_pool")?);
                let dst_pages = t.pages("dst_pages")?;
                let prompt = t.tokens("prompt")?;
                let mut salt = |field| -> Result<Option<String>, WireError> {
                    Ok(if t.flag(field)? {
                        Some(t.str(field)?)
                    } else {
                        None
                    })
                };
                let cache_salt = CacheSalt {
                    server: salt("cache_salt.server")?,
                    client: salt("cache_salt.client")?,
                };
                ToPrefill::Prefill(PrefillOrder {
                    owner,
                    prompt,
                    sampling,
                    dst_pool,
                    dst_pages,
                    cache_salt,
                })
            }
            _ => ToPrefill::Cancel {
                request: RequestId(t.u64("request")?),
            },
        };
        t.finish()?;
        Ok(msg)
    }
}

const KV_BYTES: u8 = 0;
const KV_LANDED: u8 = 1;

/// The kind named `name` (its stable kebab-case name, as serde spells it),
/// so that kinds added later travel without a change here.
fn error_kind_named(name: &str) -> Option<ErrorKind> {
    use serde::Deserialize;
    use serde::de::value::{Error, StrDeserializer};
    ErrorKind::deserialize(StrDeserializer::<Error>::new(name)).ok()
}

/// [`super::kv_payload_len`], checked: `None` when it overflows (a hostile
/// manifest).
fn checked_kv_len(manifest: &Manifest, kv_dim: usize) -> Option<usize> {
    let layers = manifest.layers.end.saturating_sub(manifest.layers.start) as usize;
    (manifest.tokens as usize)
        .checked_mul(layers)?
        .checked_mul(kv_dim)?
        .checked_mul(4)
}

impl WireMessage for ToDecode {
    const DIRECTION: &'static str = "prefill → decode";
    const ACCEPTED: &'static str = "16 hello, 17 kv, 18 prefill-done, 19 prefill-failed";

    fn msg_type(&self) -> u8 {
        match self {
            ToDecode::Hello(_) => TYPE_HELLO,
            ToDecode::Kv(_) => TYPE_KV,
            ToDecode::PrefillDone { .. } => TYPE_PREFILL_DONE,
            ToDecode::PrefillFailed { .. } => TYPE_PREFILL_FAILED,
        }
    }

    fn request(&self) -> Option<RequestId> {
        match self {
            ToDecode::Hello(_) => None,
            ToDecode::Kv(kv) => Some(kv.manifest.request.request),
            ToDecode::PrefillDone { request, .. } | ToDecode::PrefillFailed { request, .. } => {
                Some(*request)
            }
        }
    }

    fn accepts(msg_type: u8) -> bool {
        matches!(
            msg_type,
            TYPE_HELLO | TYPE_KV | TYPE_PREFILL_DONE | TYPE_PREFILL_FAILED
        )
    }

    fn bulk(&self) -> Option<&[u8]> {
        match self {
            ToDecode::Kv(KvTransfer {
                payload: KvPayload::Bytes(b),
                ..
            }) => Some(b),
            _ => None,
        }
    }

    fn encode_fields(&self, out: &mut Vec<u8>) {
        let mut p = Put(out);
        match self {
            ToDecode::Hello(info) => {
                p.usize(info.pool_tokens);
                p.usize(info.page_slots);
                p.usize(info.n_layers);
                p.usize(info.kv_dim);
                p.usize(info.context_length);
            }
            ToDecode::Kv(kv) => {
                let m = &kv.manifest;
                p.owner(m.request);
                p.u32(m.src_pool.0);
                p.pages(&m.src_pages);
                p.u32(m.dst_pool.0);
                p.pages(&m.dst_pages);
                p.u32(m.first_token);
                p.u32(m.tokens);
                p.u32(m.layers.start);
                p.u32(m.layers.end);
                p.u64(m.checksum);
                p.u64s(&kv.digests);
                p.u8(match kv.payload {
                    KvPayload::Bytes(_) => KV_BYTES,
                    KvPayload::Landed => KV_LANDED,
                });
            }
            ToDecode::PrefillDone {
                request,
                first_token,
                cached_tokens,
                queued_us,
            } => {
                p.u64(request.0);
                p.u32(*first_token);
                p.u32(*cached_tokens);
                p.u64(*queued_us);
            }
            ToDecode::PrefillFailed { request, error } => {
                p.u64(request.0);
                p.str(error.kind.name());
                p.str(&error.message);
                match &error.rejection {
                    None => p.u8(0),
                    Some(r) => {
                        p.u8(1);
                        p.str(&r.reason);
                        p.usize(r.prompt_tokens);
                        p.usize(r.limit);
                        p.str(&r.node);
                    }
                }
                match error.violation {
                    None => p.u8(0),
                    Some(v) => {
                        p.u8(1);
                        p.str(&v.id.to_string());
                        p.str(v.kind.name());
                    }
                }
            }
        }
    }

    fn decode(
        header: &FrameHeader,
        fields: &[u8],
        bulk: Option<Vec<u8>>,
        limits: &WireLimits,
    ) -> Result<Self, WireError> {
        let mut t = Take::new(fields, header);
        let msg = match header.msg_type {
            TYPE_HELLO => {
                no_bulk(header, bulk.as_ref())?;
                ToDecode::Hello(NodeInfo {
                    pool_tokens: t.usize("hello.pool_tokens")?,
                    page_slots: t.usize("hello.page_slots")?,
                    n_layers: t.usize("hello.n_layers")?,
                    kv_dim: t.usize("hello.kv_dim")?,
                    context_length: t.usize("hello.context_length")?,
                })
            }
            TYPE_KV => {
                let manifest = Manifest {
                    request: t.owner("manifest.request")?,
                    src_pool: PoolId(t.u32("manifest.src_pool")?),
                    src_pages: t.pages("manifest.src_pages")?,
                    dst_pool: PoolId(t.u32("manifest.dst_pool")?),
                    dst_pages: t.pages("manifest.dst_pages")?,
                    first_token: t.u32("manifest.first_token")?,
                    tokens: t.u32("manifest.tokens")?,
                    layers: t.u32("manifest.layers")?..t.u32("manifest.layers")?,
                    checksum: t.u64("manifest.checksum")?,
                };
                let digests = t.u64s("digests")?;
                if manifest.layers.start > manifest.layers.end {
                    return Err(t.err(
                        "manifest.layers",
                        format!(
                            "range {}..{} is reversed",
                            manifest.layers.start, manifest.layers.end
                        ),
                    ));
                }
                let payload = match (t.u8("payload kind")?, bulk) {
                    (KV_LANDED, None) => KvPayload::Landed,
                    (KV_BYTES, Some(bytes)) => {
                        let Some(kv_dim) = limits.kv_dim else {
                            return Err(t.err(
                                "bulk",
                                "KV bytes arrived before the sender's hello: kv_dim is unknown"
                                    .into(),
                            ));
                        };
                        match checked_kv_len(&manifest, kv_dim) {
                            Some(want) if want == bytes.len() => KvPayload::Bytes(bytes),
                            want => {
                                return Err(t.err(
                                    "bulk",
                                    format!(
                                        "{} KV bytes, the manifest ({} tokens × {} layers, kv_dim {kv_dim}) needs {}",
                                        bytes.len(),
                                        manifest.tokens,
                                        manifest.layers.end - manifest.layers.start,
                                        want.map_or("more than usize holds".into(), |w| w.to_string())
                                    ),
                                ));
                            }
                        }
                    }
                    (KV_LANDED, Some(b)) => {
                        return Err(t.err(
                            "bulk",
                            format!("a landed transfer carries no bytes, found {}", b.len()),
                        ));
                    }
                    (KV_BYTES, None) => {
                        return Err(t.err("bulk", "a transfer of bytes has no bulk section".into()));
                    }
                    (kind, _) => {
                        return Err(t.err(
                            "payload kind",
                            format!("{kind}, expected {KV_BYTES} (bytes) or {KV_LANDED} (landed)"),
                        ));
                    }
                };
                ToDecode::Kv(KvTransfer {
                    manifest,
                    payload,
                    digests,
                })
            }
            TYPE_PREFILL_DONE => {
                no_bulk(header, bulk.as_ref())?;
                ToDecode::PrefillDone {
                    request: RequestId(t.u64("request")?),
                    first_token: t.u32("first_token")?,
                    cached_tokens: t.u32("cached_tokens")?,
                    queued_us: t.u64("queued_us")?,
                }
            }
            _ => {
                no_bulk(header, bulk.as_ref())?;
                let request = RequestId(t.u64("request")?);
                let name = t.str("error.kind")?;
                let kind = error_kind_named(&name).ok_or_else(|| {
                    let shown: String = name.chars().take(32).collect();
                    t.err(
                        "error.kind",
                        format!("{shown:?} is not an error kind's name (rejected, transport, …)"),
                    )
                })?;
                let message = t.str("error.message")?;
                let rejection = if t.flag("error.rejection")? {
                    Some(Box::new(Rejection {
                        reason: t.str("error.rejection.reason")?,
                        prompt_tokens: t.usize("error.rejection.prompt_tokens")?,
                        limit: t.usize("error.rejection.limit")?,
                        node: t.str("error.rejection.node")?,
                    }))
                } else {
                    None
                };
                let violation = if t.flag("error.violation")? {
                    let id = t.str("error.violation.id")?;
                    let kind = t.str("error.violation.kind")?;
                    Some(
                        crate::request::Violated::parse(&id, &kind)
                            .map_err(|what| t.err("error.violation", what))?,
                    )
                } else {
                    None
                };
                ToDecode::PrefillFailed {
                    request,
                    error: RequestError {
                        kind,
                        message,
                        rejection,
                        violation,
                    },
                }
            }
        };
        t.finish()?;
        Ok(msg)
    }
}
