//! A decode node believes "the KV already landed in your pages"
//! (`KvPayload::Landed`, an RDMA completion notice) only on an RDMA link set
//! up with its own registered pool. On any other link — here the in-process
//! one, standing for a TCP peer that forges the notice — nothing could have
//! landed, so the transfer is refused by name, the request is aborted with a
//! transport error, prefill is told to stop, and the pages go back to the
//! pool. The same request with the bytes in the message is accepted.
//!
//! The accepting path is tested without a NIC in `src/node/decode.rs` (the
//! node driven by hand, the bytes written into the pages by the test), and
//! between real processes over RDMA in `tests/serve_transport_rdma.rs`
//! (ignored without a device).

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use kvsan_engine::engine::{Engine, EngineConfig};
use kvsan_engine::model::{Model, SyntheticSpec};
use kvsan_engine::request::{ErrorKind, Request};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::transport::in_process::{self, ChannelLink};
use kvsan_engine::transport::{
    Inbound, KvPayload, KvTransfer, Link, NodeInfo, PrefillOrder, ToDecode, ToPrefill, kv_checksum,
    kv_payload_len, landing_digests,
};
use kvsan_sanitizer::{Manifest, PoolId, TenantId};

const CONTEXT: usize = 256;
const PAGE_SLOTS: usize = 16;

/// A decode node alone, linked in-process to a prefill side this test plays.
struct Decode {
    engine: Engine,
    model: Arc<Model>,
    to_decode: ChannelLink<ToDecode>,
    prefill_inbox: Receiver<Inbound<ToPrefill>>,
}

fn decode_node() -> Decode {
    let model = Arc::new(
        SyntheticSpec {
            context_length: CONTEXT,
            ..SyntheticSpec::default()
        }
        .build()
        .expect("synthetic model"),
    );
    let cfg = EngineConfig {
        page_slots: PAGE_SLOTS,
        ..EngineConfig::default()
    };
    let engine = Engine::decode_only(model.clone(), &cfg).expect("decode node");
    let pair = in_process::pair();
    engine.attach_prefill(Box::new(pair.to_prefill), pair.decode_inbox);
    let c = model.config();
    pair.to_decode
        .send(ToDecode::Hello(NodeInfo {
            pool_tokens: CONTEXT,
            page_slots: PAGE_SLOTS,
            n_layers: c.n_layers,
            kv_dim: c.n_kv_heads * c.head_dim,
            context_length: CONTEXT,
        }))
        .unwrap();
    Decode {
        engine,
        model,
        to_decode: pair.to_decode,
        prefill_inbox: pair.prefill_inbox,
    }
}

fn request(prompt_len: u32) -> Request {
    Request {
        tenant: TenantId(1),
        prompt: (0..prompt_len).map(|i| (i * 7 + 3) % 100).collect(),
        max_tokens: 3,
        sampling: SamplingParams::greedy(),
        stop_tokens: Vec::new(),
        cache_salt: Default::default(),
    }
}

impl Decode {
    fn next_order(&self) -> ToPrefill {
        match self.prefill_inbox.recv_timeout(Duration::from_secs(10)) {
            Ok(Inbound::Message(m)) => m,
            other => panic!("expected an order from decode, got {other:?}"),
        }
    }

    fn prefill_order(&self) -> PrefillOrder {
        match self.next_order() {
            ToPrefill::Prefill(order) => order,
            other => panic!("expected a prefill order, got {other:?}"),
        }
    }

    /// The manifest of the whole prompt of `order`, for `bytes`.
    fn manifest(&self, order: &PrefillOrder, bytes: &[u8]) -> Manifest {
        Manifest {
            request: order.owner,
            src_pool: PoolId(0),
            src_pages: order.dst_pages.clone(),
            dst_pool: order.dst_pool,
            dst_pages: order.dst_pages.clone(),
            first_token: 0,
            tokens: order.prompt.len() as u32,
            layers: 0..self.model.config().n_layers as u32,
            checksum: kv_checksum(bytes),
        }
    }

    /// A transfer of `bytes` for `order`'s whole prompt, with the sender's
    /// landing digests.
    fn transfer(&self, order: &PrefillOrder, bytes: &[u8], payload: KvPayload) -> KvTransfer {
        let c = self.model.config();
        let manifest = self.manifest(order, bytes);
        let digests = landing_digests(&manifest, PAGE_SLOTS, c.n_kv_heads * c.head_dim, bytes);
        KvTransfer {
            manifest,
            payload,
            digests,
        }
    }

    fn payload(&self, order: &PrefillOrder) -> Vec<u8> {
        let c = self.model.config();
        let mut m = self.manifest(order, &[]);
        m.checksum = 0;
        let len = kv_payload_len(&m, c.n_kv_heads * c.head_dim);
        (0..len).map(|i| (i % 61) as u8).collect()
    }
}

#[test]
fn a_landed_notice_on_a_link_without_rdma_aborts_its_request_by_name() {
    let d = decode_node();
    let handle = d.engine.submit(request(20));
    let order = d.prefill_order();
    let bytes = d.payload(&order);
    // Correct in every other way: the request's own pages, its tokens, the
    // checksum of what the pages would hold.
    d.to_decode
        .send(ToDecode::Kv(d.transfer(&order, &bytes, KvPayload::Landed)))
        .unwrap();
    // Its completion follows at once, as an RDMA link sends it: it is
    // dropped, the request having ended at the refusal.
    d.to_decode
        .send(ToDecode::PrefillDone {
            request: order.owner.request,
            first_token: 1,
            cached_tokens: 0,
            queued_us: 0,
        })
        .unwrap();
    let err = handle
        .wait()
        .expect_err("a landed notice over a non-RDMA link");
    assert_eq!(err.kind, ErrorKind::Transport, "{err:?}");
    assert!(
        err.message.contains("KV transfer refused")
            && err
                .message
                .contains("not an RDMA link with this node's registered pool"),
        "{}",
        err.message
    );
    assert_eq!(
        d.next_order(),
        ToPrefill::Cancel {
            request: order.owner.request
        },
        "prefill is told to stop"
    );
    // The pages are back.
    let stats = d.engine.stats().front;
    assert_eq!(stats.free_pages, stats.total_pages);
    assert_eq!(stats.running, 0);
}

#[test]
fn the_same_transfer_with_its_bytes_in_the_message_is_accepted() {
    let d = decode_node();
    let handle = d.engine.submit(request(20));
    let order = d.prefill_order();
    let bytes = d.payload(&order);
    d.to_decode
        .send(ToDecode::Kv(d.transfer(
            &order,
            &bytes,
            KvPayload::Bytes(bytes.clone()),
        )))
        .unwrap();
    d.to_decode
        .send(ToDecode::PrefillDone {
            request: order.owner.request,
            first_token: 1,
            cached_tokens: 0,
            queued_us: 0,
        })
        .unwrap();
    let out = handle.wait().expect("the transfer is accepted");
    assert_eq!(out.tokens.len(), 3, "{out:?}");
    assert_eq!(out.tokens[0], 1, "the first token is prefill's");
    let stats = d.engine.stats().front;
    assert_eq!(stats.transfers, 1);
    assert_eq!(stats.free_pages, stats.total_pages);
}
