//! `kvsan serve --transport rdma`: the flag belongs to the decode and
//! prefill roles; a build without the `rdma` feature refuses it at start
//! saying how to get it; a build with it, on a machine without an RDMA
//! device, fails at start naming the device problem. With a device
//! (`KVSAN_RDMA_DEVICE` names it, default the first; `KVSAN_RDMA_GID_INDEX`
//! picks the GID) a decode and a prefill process linked over RDMA answer
//! like a unified process (ignored without one).

use std::thread;
use std::time::{Duration, Instant};

mod serve_common;
use serve_common::Server;

/// How long a start-up failure may take.
const BOUND: Duration = Duration::from_secs(30);

/// Waits for `server` to exit; its status.
fn exit_status(server: &mut Server) -> std::process::ExitStatus {
    let deadline = Instant::now() + BOUND;
    loop {
        if let Some(s) = server.try_wait() {
            return s;
        }
        assert!(Instant::now() < deadline, "the process did not exit");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `kvsan serve args`, expects it to exit non-zero after printing a
/// line containing `pattern`; returns the line.
fn fails_with(args: &[&str], pattern: &str) -> String {
    let mut server = Server::start("serve", args);
    let line = server.wait_for(pattern, BOUND);
    let status = exit_status(&mut server);
    assert!(!status.success(), "{status}");
    line
}

const DECODE_RDMA: &[&str] = &[
    "--role",
    "decode",
    "--synthetic",
    "--listen",
    "127.0.0.1:0",
    "--peer-listen",
    "127.0.0.1:0",
    "--transport",
    "rdma",
];

#[test]
fn transport_is_refused_by_name_for_roles_without_a_peer_link() {
    for role in ["unified", "disagg"] {
        for transport in ["rdma", "tcp"] {
            let args = [
                "--role",
                role,
                "--synthetic",
                "--listen",
                "127.0.0.1:0",
                "--transport",
                transport,
            ];
            let line = fails_with(&args, "--transport is not used by");
            assert!(
                line.contains(&format!("--role {role}")) && line.contains("decode|prefill"),
                "{line}"
            );
        }
    }
}

#[test]
fn rdma_device_flags_need_the_rdma_transport() {
    let args = [
        "--role",
        "decode",
        "--synthetic",
        "--listen",
        "127.0.0.1:0",
        "--peer-listen",
        "127.0.0.1:0",
        "--rdma-device",
        "mlx5_0",
    ];
    fails_with(&args, "--rdma-device is used only with --transport rdma");
}

#[cfg(not(feature = "rdma"))]
#[test]
fn a_build_without_rdma_refuses_the_rdma_transport_at_start_saying_how_to_get_it() {
    let expect = "this kvsan was built without RDMA support; rebuild with --features rdma";
    fails_with(DECODE_RDMA, expect);
    fails_with(
        &[
            "--role",
            "prefill",
            "--synthetic",
            "--peer",
            "127.0.0.1:9",
            "--transport",
            "rdma",
        ],
        expect,
    );
}

#[cfg(feature = "rdma")]
#[test]
fn without_an_rdma_device_the_rdma_transport_fails_at_start_naming_the_device() {
    if kvsan_engine::transport::rdma::rdma_devices().is_ok_and(|d| !d.is_empty()) {
        eprintln!("this machine has an RDMA device: nothing to check here");
        return;
    }
    let line = fails_with(DECODE_RDMA, "cannot open the RDMA device");
    assert!(line.contains("--transport rdma"), "{line}");
    let mut named = DECODE_RDMA.to_vec();
    named.extend(["--rdma-device", "kvsan-no-such-device"]);
    let line = fails_with(&named, "cannot open the RDMA device kvsan-no-such-device");
    assert!(line.contains("--transport rdma"), "{line}");
}

/// A decode and a prefill process over RDMA on this machine's device, and a
/// unified process: the same greedy tokens for the same prompts.
#[cfg(feature = "rdma")]
#[test]
#[ignore = "requires an RDMA device"]
fn a_decode_and_a_prefill_process_over_rdma_serve_the_tokens_a_unified_process_serves() {
    over_rdma_serves_what_unified_serves(&[]);
}

/// As above, with the side channel authenticated by the deployment's key.
#[cfg(feature = "rdma")]
#[test]
#[ignore = "requires an RDMA device"]
fn with_a_peer_key_the_rdma_processes_serve_what_a_unified_process_serves() {
    let key = serve_common::peer_key_file("rdma", 0x55);
    let key = key.to_str().expect("a UTF-8 temp path").to_string();
    over_rdma_serves_what_unified_serves(&["--peer-key".into(), key]);
}

#[cfg(feature = "rdma")]
fn over_rdma_serves_what_unified_serves(extra: &[String]) {
    use serve_common::START_BOUND;
    use serve_common::client::Client;

    let mut rdma_args: Vec<String> = vec!["--transport".into(), "rdma".into()];
    rdma_args.extend(extra.iter().cloned());
    if let Ok(device) = std::env::var("KVSAN_RDMA_DEVICE") {
        rdma_args.extend(["--rdma-device".into(), device]);
    }
    if let Ok(gid) = std::env::var("KVSAN_RDMA_GID_INDEX") {
        rdma_args.extend(["--rdma-gid-index".into(), gid]);
    }
    let with_rdma = |base: &[&'static str]| -> Vec<String> {
        base.iter()
            .map(|s| s.to_string())
            .chain(rdma_args.iter().cloned())
            .collect()
    };
    let start = |name: &'static str, args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start(name, &args)
    };
    let decode = start("decode", with_rdma(&DECODE_RDMA[..DECODE_RDMA.len() - 2]));
    let addrs = decode.serving();
    let peer = addrs.peer_listen.expect("decode prints peer-listen=");
    let prefill = start(
        "prefill",
        with_rdma(&["--role", "prefill", "--synthetic", "--peer"])
            .into_iter()
            .chain([peer])
            .collect(),
    );
    decode.wait_for("over RDMA)", START_BOUND);
    let unified_server = Server::synthetic("unified", "unified", &[]);
    let unified = Client::new(&unified_server.listen());
    let over_rdma = Client::new(&addrs.listen.expect("listen="));
    for (len, salt, n) in [
        (1u64, 1u64, 8usize),
        (17, 2, 16),
        (300, 3, 8),
        (1000, 4, 12),
    ] {
        let prompt: Vec<u64> = (0..len).map(|i| (i * 31 + salt * 7 + 3) % 251).collect();
        let disagg = over_rdma.complete(&prompt, n);
        disagg.assert_finished(prompt.len(), n);
        let alone = unified.complete(&prompt, n);
        alone.assert_finished(prompt.len(), n);
        assert_eq!(
            disagg.tokens, alone.tokens,
            "prompt of {len} tokens: disaggregated over RDMA and unified differ"
        );
    }
    drop(prefill);
}

/// `--peer-key` goes with the RDMA transport: a decode node listening off
/// loopback with a key passes the peer-link check and stops only at the
/// missing device; without the key it stops at the peer-link check.
#[cfg(feature = "rdma")]
#[test]
fn the_rdma_transport_takes_a_peer_key_for_a_link_off_this_host() {
    if kvsan_engine::transport::rdma::rdma_devices().is_ok_and(|d| !d.is_empty()) {
        eprintln!("this machine has an RDMA device: nothing to check here");
        return;
    }
    let mut off_host: Vec<&str> = DECODE_RDMA.to_vec();
    let at = off_host.iter().position(|a| *a == "--peer-listen").unwrap() + 1;
    off_host[at] = "0.0.0.0:0";
    fails_with(&off_host, "is not a loopback address");
    let key = serve_common::peer_key_file("rdma-cli", 0x66);
    let key = key.to_str().expect("a UTF-8 temp path").to_string();
    off_host.extend(["--peer-key", key.as_str()]);
    fails_with(&off_host, "cannot open the RDMA device");
}
