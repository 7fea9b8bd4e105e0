//! A man in the middle of an authenticated peer link, for the tests: it
//! relays prefill → decode connections and meddles with the first record
//! after the handshake of the first ones. Used by the engine's link tests
//! and, through `#[path]`, by the `kvsan serve` process tests.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;

/// Bytes the prefill side sends in the handshake: hello (43) and proof (32).
const HANDSHAKE_BYTES: usize = 75;

/// What the relay does to the prefill → decode bytes after the handshake.
#[derive(Clone, Copy, Debug)]
pub enum Meddle {
    /// Flips one bit of the first record.
    Alter,
    /// Sends the first record twice.
    Replay,
}

/// Relays connections to `decode`, meddling with the first ones as `plan`
/// says (one entry per connection), then relaying faithfully; returns the
/// address prefill connects to.
pub fn relay(decode: String, plan: Vec<Meddle>) -> String {
    let front = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = front.local_addr().unwrap().to_string();
    thread::spawn(move || {
        let mut plan = plan.into_iter();
        for from_prefill in front.incoming() {
            let Ok(mut from_prefill) = from_prefill else {
                continue;
            };
            let mut to_decode = TcpStream::connect(&decode).unwrap();
            let (mut from_decode, mut to_prefill) = (
                to_decode.try_clone().unwrap(),
                from_prefill.try_clone().unwrap(),
            );
            thread::spawn(move || {
                let _ = std::io::copy(&mut from_decode, &mut to_prefill);
                let _ = to_prefill.shutdown(Shutdown::Write);
            });
            let meddle = plan.next();
            thread::spawn(move || {
                if let Some(meddle) = meddle {
                    // The handshake goes through first: decode answers
                    // prefill's hello before prefill sends any record.
                    let mut handshake = [0u8; HANDSHAKE_BYTES];
                    from_prefill.read_exact(&mut handshake).unwrap();
                    to_decode.write_all(&handshake).unwrap();
                    let mut len = [0u8; 4];
                    from_prefill.read_exact(&mut len).unwrap();
                    let mut record = len.to_vec();
                    record.resize(4 + u32::from_le_bytes(len) as usize + 32, 0);
                    from_prefill.read_exact(&mut record[4..]).unwrap();
                    match meddle {
                        Meddle::Alter => {
                            record[4] ^= 1;
                            to_decode.write_all(&record).unwrap();
                        }
                        Meddle::Replay => {
                            to_decode.write_all(&record).unwrap();
                            to_decode.write_all(&record).unwrap();
                        }
                    }
                }
                let _ = std::io::copy(&mut from_prefill, &mut to_decode);
                let _ = to_decode.shutdown(Shutdown::Write);
            });
        }
    });
    addr
}
