//! The decode node's side of a long-lived deployment: it accepts prefill
//! nodes on its peer listener for as long as it runs.
//!
//! ```text
//!  kvsan-peer-accept ── accept ──▶ kvsan-peer-handshake ── attach(stream, addr) ──▶ link attached
//!        │  (for ever)                 (one per connection,        │ Ok(peer)     "prefill node connected (peer)"
//!        │                              at most MAX_HANDSHAKES)    │ PeerAuth(e)  "refused a prefill node: e"
//!        ▼                                                         └ Err(e)       "accepting a prefill node ADDR failed: e"
//!  connection beyond MAX_HANDSHAKES: "refused a prefill node: … handshakes are already in progress"
//! ```
//!
//! What attaching means (a TCP link, an RDMA handshake offering the
//! registered pool) is the caller's: the loop only bounds the handshakes,
//! keeps a stalled one from delaying the others, and says on stderr what
//! became of each connection.

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::tcp::Listener;
use crate::error::EngineError;

/// Peer handshakes in progress at most; a connection beyond them is refused.
pub const MAX_HANDSHAKES: usize = 16;

/// Starts the `kvsan-peer-accept` thread, which accepts prefill nodes on
/// `peers` and attaches each with `attach` for the rest of the process.
///
/// # Errors
/// The thread cannot be started.
pub fn spawn_accept_thread<F>(peers: Listener, attach: F) -> std::io::Result<JoinHandle<()>>
where
    F: Fn(TcpStream, &str) -> Result<String, EngineError> + Send + Sync + 'static,
{
    thread::Builder::new()
        .name("kvsan-peer-accept".into())
        .spawn(move || accept_prefill_nodes(&peers, attach))
}

/// Attaches every prefill node that connects; a new connection replaces
/// the previous link (requests still waiting on that one are aborted). A
/// connection that fails authentication is refused before it replaces
/// anything. Each handshake (`attach`, given the connection and its peer's
/// address: it returns the peer's name once the link is attached) runs on
/// its own thread, bounded by its deadline and by [`MAX_HANDSHAKES`], so a
/// peer that stalls it delays nobody else.
fn accept_prefill_nodes<F>(peers: &Listener, attach: F)
where
    F: Fn(TcpStream, &str) -> Result<String, EngineError> + Send + Sync + 'static,
{
    let attach = Arc::new(attach);
    let handshakes = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = match peers.accept(None) {
            Ok(stream) => stream,
            Err(e) => {
                eprintln!("kvsan: accepting a prefill node failed: {e}");
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let addr = stream
            .peer_addr()
            .map_or_else(|_| "unknown peer".to_string(), |a| a.to_string());
        if handshakes.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
            handshakes.fetch_sub(1, Ordering::AcqRel);
            eprintln!(
                "kvsan: refused a prefill node: peer prefill@{addr}: {MAX_HANDSHAKES} handshakes are already in progress"
            );
            continue;
        }
        let (attach, count) = (Arc::clone(&attach), Arc::clone(&handshakes));
        let who = addr.clone();
        let spawned = thread::Builder::new()
            .name("kvsan-peer-handshake".into())
            .spawn(move || {
                let attached = attach(stream, &who);
                count.fetch_sub(1, Ordering::AcqRel);
                match attached {
                    // Said once attached: a request submitted after this
                    // line reaches the decode node after the link.
                    Ok(peer) => eprintln!("kvsan: prefill node connected ({peer})"),
                    Err(EngineError::PeerAuth(e)) => {
                        eprintln!("kvsan: refused a prefill node: {e}");
                    }
                    Err(e) => eprintln!("kvsan: accepting a prefill node {who} failed: {e}"),
                }
            });
        if let Err(e) = spawned {
            handshakes.fetch_sub(1, Ordering::AcqRel);
            eprintln!("kvsan: cannot start a handshake thread for {addr}: {e}");
        }
    }
}
