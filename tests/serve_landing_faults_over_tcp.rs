//! Received KV copied into the wrong place, over a real TCP peer link: a
//! decode process with a receive-path fault and a prefill process, driven
//! over HTTP. Under the preloaded shim the request is aborted with a 500
//! naming the violation the landing checks find; without it the same
//! deployment answers 200 with tokens that differ from a correct (unified)
//! engine's — the copy's damage, unseen by the checksum, which covers the
//! bytes sent and not where they land.
#![cfg(feature = "faults")]

use std::ffi::OsStr;

mod serve_common;
mod shim_common;

use serve_common::client::Client;
use serve_common::{START_BOUND, Server, peer_key_file};

/// The key file every process of these tests holds.
fn key() -> String {
    peer_key_file("landing-faults", 0x3c)
        .to_str()
        .expect("UTF-8 path")
        .to_string()
}

/// A decode process with `fault` injected (under the shim when `shim`) and
/// a prefill process connected to it; the decode process's client address.
fn deployment(fault: &str, shim: bool) -> (Server, Server, String) {
    let key = key();
    let lib = shim_common::shim_library();
    let env: Vec<(&str, &OsStr)> = if shim {
        vec![("LD_PRELOAD", lib.as_os_str())]
    } else {
        Vec::new()
    };
    let decode = Server::http(
        "decode",
        "decode",
        &["--synthetic", "--peer-key", &key, "--inject", fault],
        &env,
    );
    decode.wait_for("peer link authenticated", START_BOUND);
    let addrs = decode.serving();
    let peer = addrs.peer_listen.expect("decode prints peer-listen=");
    let prefill = Server::start(
        "prefill",
        &[
            "--role",
            "prefill",
            "--synthetic",
            "--peer",
            &peer,
            "--peer-key",
            &key,
        ],
    );
    decode.wait_for("prefill node connected", START_BOUND);
    (
        decode,
        prefill,
        addrs.listen.expect("decode prints listen="),
    )
}

/// 64 tokens: one KV message of four whole 16-slot pages.
fn prompt() -> Vec<u64> {
    (0..64u64).map(|i| (i * 29 + 11) % 251).collect()
}

#[test]
fn a_copy_that_lands_received_kv_in_the_wrong_place_is_caught_under_the_shim_and_leaks_without() {
    let unified = Server::synthetic("unified", "unified", &[]);
    let correct = Client::new(&unified.listen()).complete(&prompt(), 8);
    correct.assert_finished(64, 8);
    for fault in ["descriptor-offset-dropped", "block-size-mismatch"] {
        let (_decode, _prefill, listen) = deployment(fault, true);
        let caught = Client::new(&listen).complete(&prompt(), 8);
        assert_eq!(caught.status, 500, "{fault}: {caught:?}");
        let error = caught.error.as_ref().expect("an error body");
        assert_eq!(error["code"], "violation", "{fault}: {error}");
        assert_eq!(
            error["violation"]["kind"], "transfer-digest-mismatch",
            "{fault}: {error}"
        );

        let (_decode, _prefill, listen) = deployment(fault, false);
        let leaked = Client::new(&listen).complete(&prompt(), 8);
        leaked.assert_finished(64, 8);
        assert_ne!(
            leaked.tokens, correct.tokens,
            "{fault}: without the sanitizer the request decodes over pages the copy never filled"
        );
    }
}
