//! The TCP side channel's connection handshake. After it, the side channel
//! carries decode → prefill orders as [`crate::transport::wire`] frames.
//!
//! ```text
//!  handshake, each side sends its hello then reads the peer's:
//!    magic "KVSANRDMA" (9 bytes), version u16 = 1, role u8 (1 decode, 2 prefill)
//!    qp_num u32, psn u32, lid u16, gid [16], mtu u8
//!    decode only — its registered pool:
//!      addr u64, len u64, rkey u32, page_slots u32, n_layers u32,
//!      n_kv_heads u32, head_dim u32, n_pages u32
//!  then, once each side's queue pair is ready to send: one byte 'R' each way
//! ```
//!
//! All integers little-endian. With a peer key the handshake runs inside
//! the authenticated records of [`crate::transport::peer_auth`], after its
//! challenge–response: the pool's address and key reach only a peer that
//! proved it holds the deployment's key.

use std::io::{Read, Write};

use kvsan_kernels::attention::KvGeometry;

use super::RdmaError;
use super::verbs::{QpEndpoint, RemotePool};

const MAGIC: &[u8; 9] = b"KVSANRDMA";
const VERSION: u16 = 1;
const ROLE_DECODE: u8 = 1;
const ROLE_PREFILL: u8 = 2;
const READY: u8 = b'R';

/// One side's hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hello {
    Decode { qp: QpEndpoint, pool: RemotePool },
    Prefill { qp: QpEndpoint },
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(80);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        let qp = match self {
            Hello::Decode { qp, .. } => {
                out.push(ROLE_DECODE);
                qp
            }
            Hello::Prefill { qp } => {
                out.push(ROLE_PREFILL);
                qp
            }
        };
        out.extend_from_slice(&qp.qp_num.to_le_bytes());
        out.extend_from_slice(&qp.psn.to_le_bytes());
        out.extend_from_slice(&qp.lid.to_le_bytes());
        out.extend_from_slice(&qp.gid);
        out.push(qp.mtu);
        if let Hello::Decode { pool, .. } = self {
            out.extend_from_slice(&pool.addr.to_le_bytes());
            out.extend_from_slice(&pool.len.to_le_bytes());
            out.extend_from_slice(&pool.rkey.to_le_bytes());
            let g = &pool.geometry;
            for v in [g.page_slots, g.n_layers, g.n_kv_heads, g.head_dim] {
                out.extend_from_slice(&u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes());
            }
            out.extend_from_slice(&pool.n_pages.to_le_bytes());
        }
        out
    }
}

/// Sends `mine`, reads the peer's hello, and checks it has the other role.
pub(crate) fn exchange<S: Read + Write>(
    stream: &mut S,
    peer: &str,
    mine: &Hello,
) -> Result<Hello, RdmaError> {
    stream
        .write_all(&mine.encode())
        .and_then(|()| stream.flush())
        .map_err(|e| side_err(peer, "send connection data", e))?;
    let mut head = [0u8; 9 + 2 + 1 + 4 + 4 + 2 + 16 + 1];
    stream
        .read_exact(&mut head)
        .map_err(|e| side_err(peer, "read connection data", e))?;
    if &head[..9] != MAGIC {
        return Err(protocol(
            peer,
            format!(
                "not a kvsan RDMA peer: expected magic \"KVSANRDMA\", got {:02x?}",
                &head[..9]
            ),
        ));
    }
    let version = u16::from_le_bytes([head[9], head[10]]);
    if version != VERSION {
        return Err(protocol(
            peer,
            format!("handshake version {version}, this side speaks {VERSION}"),
        ));
    }
    let role = head[11];
    let u32_at = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&head[22..38]);
    let qp = QpEndpoint {
        qp_num: u32_at(12),
        psn: u32_at(16),
        lid: u16::from_le_bytes([head[20], head[21]]),
        gid,
        mtu: head[38],
    };
    let expected = match mine {
        Hello::Decode { .. } => ROLE_PREFILL,
        Hello::Prefill { .. } => ROLE_DECODE,
    };
    if role != expected {
        return Err(protocol(
            peer,
            format!("peer has role {role}, expected {expected} (1 = decode, 2 = prefill)"),
        ));
    }
    if role == ROLE_PREFILL {
        return Ok(Hello::Prefill { qp });
    }
    let mut body = [0u8; 8 + 8 + 4 + 5 * 4];
    stream
        .read_exact(&mut body)
        .map_err(|e| side_err(peer, "read pool registration", e))?;
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&body[i..i + 8]);
        u64::from_le_bytes(a)
    };
    let b32 = |i: usize| u32::from_le_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
    let geometry = KvGeometry {
        page_slots: b32(20) as usize,
        n_layers: b32(24) as usize,
        n_kv_heads: b32(28) as usize,
        head_dim: b32(32) as usize,
    };
    let pool = RemotePool {
        addr: u64_at(0),
        len: u64_at(8),
        rkey: b32(16),
        geometry,
        n_pages: b32(36),
    };
    let need = (geometry.page_elems() as u64 * 2).checked_mul(u64::from(pool.n_pages));
    if geometry.page_slots == 0 || need.is_none_or(|n| n > pool.len) {
        return Err(protocol(
            peer,
            format!(
                "registered pool of {} bytes cannot hold {} pages of {geometry:?}",
                pool.len, pool.n_pages
            ),
        ));
    }
    Ok(Hello::Decode { qp, pool })
}

/// Tells the peer this side's queue pair is ready, and waits for the peer's.
pub(crate) fn ready<S: Read + Write>(stream: &mut S, peer: &str) -> Result<(), RdmaError> {
    stream
        .write_all(&[READY])
        .and_then(|()| stream.flush())
        .map_err(|e| side_err(peer, "send ready", e))?;
    let mut b = [0u8; 1];
    stream
        .read_exact(&mut b)
        .map_err(|e| side_err(peer, "read ready", e))?;
    if b[0] != READY {
        return Err(protocol(
            peer,
            format!("expected the ready byte 0x52, got {:#04x}", b[0]),
        ));
    }
    Ok(())
}

fn side_err(peer: &str, op: &'static str, source: std::io::Error) -> RdmaError {
    RdmaError::SideChannel {
        peer: peer.to_string(),
        op,
        source,
    }
}

fn protocol(peer: &str, what: String) -> RdmaError {
    RdmaError::Protocol {
        peer: peer.to_string(),
        what,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    fn qp(n: u32) -> QpEndpoint {
        QpEndpoint {
            qp_num: n,
            psn: 0x12_3456,
            lid: 7,
            gid: [n as u8; 16],
            mtu: 5,
        }
    }

    fn pool() -> RemotePool {
        let geometry = KvGeometry {
            page_slots: 16,
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 8,
        };
        RemotePool {
            addr: 0x7f00_0000_1000,
            len: geometry.page_elems() as u64 * 2 * 10,
            rkey: 0xabcd,
            geometry,
            n_pages: 10,
        }
    }

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    #[test]
    fn both_sides_learn_the_other_sides_queue_pair_and_the_pool() {
        let (mut d, mut p) = pair();
        let decode = Hello::Decode {
            qp: qp(1),
            pool: pool(),
        };
        let prefill = Hello::Prefill { qp: qp(2) };
        let t = std::thread::spawn(move || {
            let got = exchange(&mut p, "decode", &prefill).unwrap();
            ready(&mut p, "decode").unwrap();
            got
        });
        assert_eq!(exchange(&mut d, "prefill", &decode).unwrap(), prefill);
        ready(&mut d, "prefill").unwrap();
        assert_eq!(t.join().unwrap(), decode);
    }

    #[test]
    fn a_peer_of_the_same_role_is_refused() {
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || exchange(&mut b, "a", &Hello::Prefill { qp: qp(2) }));
        let err = exchange(&mut a, "b", &Hello::Prefill { qp: qp(1) }).unwrap_err();
        assert!(
            err.to_string().contains("peer has role 2, expected 1"),
            "{err}"
        );
        assert!(t.join().unwrap().is_err());
    }

    #[test]
    fn a_pool_smaller_than_its_pages_is_refused() {
        let (mut d, mut p) = pair();
        let mut small = pool();
        small.len -= 1;
        let t = std::thread::spawn(move || {
            exchange(
                &mut d,
                "p",
                &Hello::Decode {
                    qp: qp(1),
                    pool: small,
                },
            )
        });
        let err = exchange(&mut p, "d", &Hello::Prefill { qp: qp(2) }).unwrap_err();
        assert!(err.to_string().contains("cannot hold 10 pages"), "{err}");
        let _ = t.join();
    }

    #[test]
    fn a_stranger_is_refused_by_its_magic() {
        let (mut a, mut b) = pair();
        b.write_all(&[b'G'; 80]).unwrap();
        let err = exchange(&mut a, "b", &Hello::Prefill { qp: qp(1) }).unwrap_err();
        assert!(err.to_string().contains("expected magic"), "{err}");
    }

    mod authenticated {
        use super::*;
        use crate::EngineError;
        use crate::transport::peer_auth::{PeerAuthError, PeerKey, PeerRole};
        use crate::transport::rdma::SideChannel;

        fn key(byte: u8) -> PeerKey {
            PeerKey::from_bytes(&[byte; 32]).unwrap()
        }

        #[test]
        fn with_the_same_key_both_sides_learn_the_connection_data() {
            let (d, p) = pair();
            let decode = Hello::Decode {
                qp: qp(1),
                pool: pool(),
            };
            let prefill = Hello::Prefill { qp: qp(2) };
            let t = std::thread::spawn(move || {
                let mut side =
                    SideChannel::open(&p, "decode", PeerRole::Prefill, Some(&key(7))).unwrap();
                let got = exchange(&mut side, "decode", &prefill).unwrap();
                ready(&mut side, "decode").unwrap();
                got
            });
            let mut side =
                SideChannel::open(&d, "prefill", PeerRole::Decode, Some(&key(7))).unwrap();
            assert_eq!(exchange(&mut side, "prefill", &decode).unwrap(), prefill);
            ready(&mut side, "prefill").unwrap();
            assert_eq!(t.join().unwrap(), decode);
        }

        #[test]
        fn a_peer_with_another_key_is_refused_before_any_connection_data() {
            let (d, p) = pair();
            let t = std::thread::spawn(move || {
                let opened = SideChannel::open(&p, "decode", PeerRole::Prefill, Some(&key(8)));
                (opened.err(), p)
            });
            let err = SideChannel::open(&d, "prefill", PeerRole::Decode, Some(&key(7)))
                .err()
                .expect("a wrong key is refused");
            assert!(
                matches!(err, EngineError::PeerAuth(PeerAuthError::BadProof { .. })),
                "{err}"
            );
            drop(d);
            let (theirs, mut p) = t.join().unwrap();
            assert!(
                matches!(
                    theirs,
                    Some(EngineError::PeerAuth(PeerAuthError::BadProof { .. }))
                ),
                "{theirs:?}"
            );
            // Nothing followed the proofs: the refused peer never saw a hello.
            p.set_read_timeout(Some(std::time::Duration::from_secs(5)))
                .unwrap();
            let mut rest = Vec::new();
            p.read_to_end(&mut rest).unwrap();
            assert!(rest.is_empty(), "{} bytes after the proofs", rest.len());
        }

        #[test]
        fn a_peer_without_a_key_is_refused_by_a_node_with_one() {
            let (d, mut p) = pair();
            let t = std::thread::spawn(move || {
                exchange(&mut p, "decode", &Hello::Prefill { qp: qp(2) }).unwrap_err()
            });
            let err = SideChannel::open(&d, "prefill", PeerRole::Decode, Some(&key(7)))
                .err()
                .expect("a plain peer is refused");
            assert!(
                matches!(
                    err,
                    EngineError::PeerAuth(PeerAuthError::NotAuthenticating { .. })
                ),
                "{err}"
            );
            // The plain peer sees the authenticated hello and stops there.
            let theirs = t.join().unwrap();
            assert!(theirs.to_string().contains("expected magic"), "{theirs}");
        }
    }
}
