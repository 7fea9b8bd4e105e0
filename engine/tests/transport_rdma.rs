//! The RDMA link (feature `rdma`), plain and authenticated with a peer
//! key. The loopback tests need an RDMA device
//! (`KVSAN_RDMA_DEVICE` names it, default the first; `KVSAN_RDMA_GID_INDEX`
//! picks the GID, default automatic); the rest runs anywhere.
#![cfg(feature = "rdma")]

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use crossbeam_channel::{Receiver, unbounded};
use half::f16;
use kvsan_engine::EngineError;
use kvsan_engine::kv_pool::KvPool;
use kvsan_engine::request::{ErrorKind, RequestError};
use kvsan_engine::sampler::SamplingParams;
use kvsan_engine::transport::peer_auth::{PeerAuthError, PeerKey};
use kvsan_engine::transport::rdma::{
    RdmaConfig, RdmaDecodeEndpoint, RdmaDevice, RdmaPrefillEndpoint, RegisteredPool, rdma_devices,
};
use kvsan_engine::transport::{
    Inbound, KvPayload, KvTransfer, Link, NodeInfo, PrefillOrder, ToDecode, ToPrefill, kv_checksum,
    kv_slices, landing_digests,
};
use kvsan_kernels::attention::KvGeometry;
use kvsan_sanitizer::{Manifest, Owner, PageRef, PoolId, RequestId};

#[test]
fn listing_rdma_devices_returns_a_list_or_an_error_without_panicking() {
    match rdma_devices() {
        Ok(devices) => assert!(devices.iter().all(|d| !d.is_empty()), "{devices:?}"),
        Err(e) => assert!(e.to_string().contains("list devices"), "{e}"),
    }
}

#[test]
fn opening_a_device_that_does_not_exist_is_an_error() {
    let config = RdmaConfig {
        device: Some("kvsan-no-such-device".into()),
        ..RdmaConfig::default()
    };
    let err = RdmaDevice::open(&config).unwrap_err().to_string();
    // Without RDMA support the list itself fails; with it, the name is missing.
    assert!(
        err.contains("list devices") || err.contains("named 'kvsan-no-such-device'"),
        "{err}"
    );
}

fn config() -> RdmaConfig {
    RdmaConfig {
        device: std::env::var("KVSAN_RDMA_DEVICE").ok(),
        gid_index: std::env::var("KVSAN_RDMA_GID_INDEX")
            .ok()
            .map(|s| s.parse().expect("KVSAN_RDMA_GID_INDEX is a number")),
        ..RdmaConfig::default()
    }
}

fn geometry() -> KvGeometry {
    KvGeometry {
        page_slots: 16,
        n_layers: 4,
        n_kv_heads: 3,
        head_dim: 64,
    }
}

fn recv<M>(inbox: &Receiver<Inbound<M>>) -> M {
    match inbox.recv_timeout(Duration::from_secs(10)) {
        Ok(Inbound::Message(m)) => m,
        Ok(Inbound::Disconnected { reason }) => panic!("link down: {reason}"),
        Err(e) => panic!("nothing arrived: {e}"),
    }
}

#[test]
#[ignore = "requires an RDMA device"]
fn loopback_kv_lands_in_the_decode_pool_byte_for_byte_and_messages_keep_their_order() {
    kv_lands_byte_for_byte(None);
}

#[test]
#[ignore = "requires an RDMA device"]
fn with_a_peer_key_kv_lands_as_it_does_without_one() {
    kv_lands_byte_for_byte(Some(PeerKey::from_bytes(&[0x5a; 32]).unwrap()));
}

#[test]
#[ignore = "requires an RDMA device"]
fn a_prefill_node_with_another_key_is_refused_and_never_learns_the_pool() {
    let device = RdmaDevice::open(&config()).expect("open the RDMA device");
    let decode_pool = RegisteredPool::register(&device, KvPool::new(geometry(), 8).unwrap())
        .expect("register the decode pool");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let prefill_device = device.clone();
    let prefill = std::thread::spawn(move || {
        let stream = TcpStream::connect(addr).unwrap();
        let wrong = PeerKey::from_bytes(&[0x33; 32]).unwrap();
        RdmaPrefillEndpoint::handshake(stream, &prefill_device, unbounded().0, Some(&wrong))
            .map(|_| ())
    });
    let (stream, _) = listener.accept().unwrap();
    let right = PeerKey::from_bytes(&[0x5a; 32]).unwrap();
    let err =
        RdmaDecodeEndpoint::handshake(stream, &decode_pool.region(), unbounded().0, Some(&right))
            .map(|_| ())
            .unwrap_err();
    assert!(
        matches!(err, EngineError::PeerAuth(PeerAuthError::BadProof { .. })),
        "{err}"
    );
    let theirs = prefill.join().unwrap().unwrap_err();
    assert!(
        matches!(
            theirs,
            EngineError::PeerAuth(PeerAuthError::BadProof { .. })
        ),
        "{theirs}"
    );
}

fn kv_lands_byte_for_byte(auth: Option<PeerKey>) {
    let device = RdmaDevice::open(&config()).expect("open the RDMA device");

    // Prefill's pool, every value distinct.
    let mut src = KvPool::new(geometry(), 16).unwrap();
    for (i, v) in src.data_mut().iter_mut().enumerate() {
        *v = f16::from_f32((i % 4093) as f32 * 0.125 - 100.0);
    }
    let src_pages: Vec<PageRef> = (0..5).map(|_| src.alloc().unwrap()).collect();

    // Decode's pool, registered; pages reserved out of order.
    let mut dst = KvPool::new(geometry(), 32).unwrap();
    let mut reserved: Vec<PageRef> = (0..9).map(|_| dst.alloc().unwrap()).collect();
    reserved.reverse();
    let dst_pages = reserved[..5].to_vec();
    let decode_pool = RegisteredPool::register(&device, dst).expect("register the decode pool");

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (prefill_tx, prefill_inbox) = unbounded();
    let prefill_device = device.clone();
    let prefill_auth = auth.clone();
    let prefill = std::thread::spawn(move || {
        let stream = TcpStream::connect(addr).unwrap();
        RdmaPrefillEndpoint::handshake(stream, &prefill_device, prefill_tx, prefill_auth.as_ref())
    });
    let (decode_tx, decode_inbox) = unbounded();
    let (stream, _) = listener.accept().unwrap();
    let decode =
        RdmaDecodeEndpoint::handshake(stream, &decode_pool.region(), decode_tx, auth.as_ref())
            .unwrap();
    let prefill = prefill.join().unwrap().unwrap();

    // Decode → prefill on the side channel.
    let order = ToPrefill::Prefill(PrefillOrder {
        owner: Owner::new(1, 0),
        prompt: (0..70).collect(),
        sampling: SamplingParams::greedy(),
        dst_pool: PoolId(1),
        dst_pages: dst_pages.clone(),
        cache_salt: Default::default(),
    });
    decode.send(order.clone()).unwrap();
    assert_eq!(recv(&prefill_inbox), order);

    let hello = ToDecode::Hello(NodeInfo {
        pool_tokens: 256,
        page_slots: 16,
        n_layers: 4,
        kv_dim: 192,
        context_length: 8192,
    });
    prefill.send(hello.clone()).unwrap();
    assert_eq!(recv(&decode_inbox), hello);

    // Tokens 3..70 over two transfers: a partial first page and full pages,
    // then the rest, with a subset of layers in the first.
    for (first_token, tokens, layers) in [(3u32, 45u32, 0..4u32), (48, 22, 0..4), (0, 3, 1..3)] {
        let mut manifest = Manifest {
            request: Owner::new(1, 0),
            src_pool: PoolId(0),
            src_pages: src_pages.clone(),
            dst_pool: PoolId(1),
            dst_pages: dst_pages.clone(),
            first_token,
            tokens,
            layers: layers.clone(),
            checksum: 0,
        };
        let mut payload = Vec::new();
        for (idx, slots) in kv_slices(&manifest, 16) {
            src.pack_slots(
                src_pages[idx].page,
                slots,
                layers.start as usize..layers.end as usize,
                &mut payload,
            );
        }
        manifest.checksum = kv_checksum(&payload);
        let digests = landing_digests(&manifest, 16, 192, &payload);
        prefill
            .send(ToDecode::Kv(KvTransfer {
                manifest: manifest.clone(),
                payload: KvPayload::Bytes(payload.clone()),
                digests: digests.clone(),
            }))
            .unwrap();
        let done = ToDecode::PrefillDone {
            request: RequestId(1),
            first_token: 42,
            cached_tokens: 0,
            queued_us: 0,
        };
        prefill.send(done.clone()).unwrap();

        assert_eq!(
            recv(&decode_inbox),
            ToDecode::Kv(KvTransfer {
                manifest: manifest.clone(),
                payload: KvPayload::Landed,
                digests,
            }),
            "the completion carries the sender's landing digests"
        );
        let mut landed = Vec::new();
        for (idx, slots) in kv_slices(&manifest, 16) {
            decode_pool.pool().pack_slots(
                dst_pages[idx].page,
                slots,
                layers.start as usize..layers.end as usize,
                &mut landed,
            );
        }
        assert_eq!(landed.len(), payload.len());
        assert!(
            landed == payload,
            "tokens {first_token}+{tokens}: landed bytes differ"
        );
        assert_eq!(kv_checksum(&landed), manifest.checksum);
        assert_eq!(recv(&decode_inbox), done);
    }

    // A manifest naming a page outside decode's pool is refused before any
    // write, and the link stays up.
    let mut bad = Manifest {
        request: Owner::new(1, 0),
        src_pool: PoolId(0),
        src_pages: src_pages.clone(),
        dst_pool: PoolId(1),
        dst_pages: dst_pages.clone(),
        first_token: 0,
        tokens: 16,
        layers: 0..4,
        checksum: 0,
    };
    bad.dst_pages[0].page.0 = 1000;
    let err = prefill
        .send(ToDecode::Kv(KvTransfer {
            manifest: bad,
            payload: KvPayload::Bytes(vec![0; 16 * 4 * 2 * 192 * 2]),
            digests: vec![0],
        }))
        .unwrap_err();
    assert!(err.reason.contains("outside the decode pool"), "{err}");
    let failed = ToDecode::PrefillFailed {
        request: RequestId(2),
        error: RequestError::new(ErrorKind::Internal, "x".repeat(10_000)),
    };
    prefill.send(failed.clone()).unwrap();
    assert_eq!(recv(&decode_inbox), failed);

    // Prefill going away disconnects decode.
    drop(prefill);
    match decode_inbox.recv_timeout(Duration::from_secs(10)) {
        Ok(Inbound::Disconnected { .. }) => {}
        other => panic!("expected a disconnect, got {other:?}"),
    }
    drop(decode);
    let pool = decode_pool.into_pool();
    assert_eq!(pool.free_pages(), 32 - 9);
}
