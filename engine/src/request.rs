//! What a client submits and what it gets back: a request, and a stream of
//! events ending in `Finished` or `Error`.

use kvsan_sanitizer::{Owner, RequestId, TenantId};
use kvsan_sanitizer::{Verdict, ViolationId, ViolationKind};
use serde::{Deserialize, Serialize};

use crate::sampler::SamplingParams;

/// A generation request.
#[derive(Clone, Debug)]
pub struct Request {
    /// Who pays (the API key's tenant).
    pub tenant: TenantId,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: SamplingParams,
    /// Tokens that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// The prefix-cache salt (vLLM's `cache_salt`): pages of a salted
    /// request are shared only with requests of the same salt.
    pub cache_salt: CacheSalt,
}

/// A request's prefix-cache salt, in its two kinds: set by the server for
/// the API key (the keys file's third column) and sent by the client
/// (`cache_salt`). Both narrow sharing; neither is ever logged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheSalt {
    /// The API key's salt, set server-side.
    pub server: Option<String>,
    /// The request's own `cache_salt`.
    pub client: Option<String>,
}

impl CacheSalt {
    /// No salt of either kind.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.server.is_none() && self.client.is_none()
    }

    /// The salt's typed encoding: each kind a tag byte, a 4-byte length and
    /// its bytes, so that no two kinds (or two splits of one string) can
    /// encode alike. Empty when there is no salt.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (tag, part) in [
            (SALT_SERVER_TAG, &self.server),
            (SALT_CLIENT_TAG, &self.client),
        ] {
            if let Some(s) = part {
                out.push(tag);
                out.extend_from_slice(&u32::try_from(s.len()).unwrap_or(u32::MAX).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        }
        out
    }

    /// The number the sanitizer knows the salt by (`declare_salt`): a
    /// 64-bit hash of [`CacheSalt::encode`], never 0; 0 when there is no salt.
    #[must_use]
    pub fn id(&self) -> u64 {
        if self.is_empty() {
            return 0;
        }
        xxhash_rust::xxh3::xxh3_64(&self.encode()).max(1)
    }
}

/// Tag of the server-side salt in [`CacheSalt::encode`].
pub(crate) const SALT_SERVER_TAG: u8 = 0x53;
/// Tag of the client's salt in [`CacheSalt::encode`].
pub(crate) const SALT_CLIENT_TAG: u8 = 0x43;

/// Why a request finished normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

/// The kind of a request error: a stable name for clients and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// Refused at admission (too long for the context or a pool); nothing was
    /// allocated, computed or sent for it.
    Rejected,
    /// Cancelled by the client.
    Cancelled,
    /// The node's KV pool cannot hold the request's context even alone (only
    /// possible when the pool is configured smaller than the context).
    Capacity,
    /// Aborted by the sanitizer: the message names the violation.
    Violation,
    /// The peer node failed or the link dropped while the request needed it.
    Transport,
    /// The request is malformed (empty prompt, a token outside the vocabulary, bad sampling).
    InvalidRequest,
    /// The engine is shutting down or failed internally.
    Internal,
    /// Ended by the anomaly monitor (`--anomaly abort`): the message names
    /// what it saw ([`crate::anomaly`]).
    Anomaly,
}

impl ErrorKind {
    /// The stable kebab-case name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Rejected => "rejected",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Capacity => "capacity",
            ErrorKind::Violation => "violation",
            ErrorKind::Transport => "transport",
            ErrorKind::InvalidRequest => "invalid-request",
            ErrorKind::Internal => "internal",
            ErrorKind::Anomaly => "anomaly",
        }
    }
}

/// Why a request was rejected at admission.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// What was exceeded (`"prompt exceeds the prefill pool"`, …).
    pub reason: String,
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
    /// The limit it broke, in tokens.
    pub limit: usize,
    /// The node that rejected it (`unified`, `prefill`, `decode`).
    pub node: String,
}

impl Rejection {
    /// The kind of limit broken: `"context"` (prompt + `max_tokens` over
    /// the context window) or `"pool"` (the prompt over a node's KV pool) —
    /// a metric label.
    #[must_use]
    pub fn limit_kind(&self) -> &'static str {
        if self.reason.ends_with(CONTEXT_REASON) {
            "context"
        } else {
            "pool"
        }
    }
}

/// How a rejection's `reason` for the context window ends.
pub(crate) const CONTEXT_REASON: &str = "exceeds the context window";

/// A request's error, as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestError {
    /// The stable kind.
    pub kind: ErrorKind,
    /// A message for a person: names the input and the limit, or the
    /// violation id and kind. Never contains prompt text or KV contents.
    pub message: String,
    /// For [`ErrorKind::Rejected`]: the details.
    pub rejection: Option<Box<Rejection>>,
    /// For [`ErrorKind::Violation`]: the violation the request was aborted for.
    pub violation: Option<Violated>,
}

/// The violation a request was aborted for: its id (`KV-000001`, the one
/// the report names) and kind. Serialized as `{"id": "KV-000001", "kind":
/// "stale-read"}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violated {
    /// The violation's id.
    pub id: ViolationId,
    /// Its kind.
    pub kind: ViolationKind,
}

impl Serialize for Violated {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Violated", 2)?;
        st.serialize_field("id", &self.id.to_string())?;
        st.serialize_field("kind", self.kind.name())?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for Violated {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Violated, D::Error> {
        #[derive(Deserialize)]
        struct Raw {
            id: String,
            kind: String,
        }
        let raw = Raw::deserialize(d)?;
        Violated::parse(&raw.id, &raw.kind).map_err(serde::de::Error::custom)
    }
}

impl Violated {
    /// The violation of `id` (`KV-000001`) and `kind` (`stale-read`).
    ///
    /// # Errors
    /// A message naming the id or kind that is not one.
    pub fn parse(id: &str, kind: &str) -> Result<Violated, String> {
        Ok(Violated {
            id: id.parse()?,
            kind: ViolationKind::from_name(kind)
                .ok_or_else(|| format!("unknown violation kind {kind:?}"))?,
        })
    }
}

impl RequestError {
    /// An error of `kind` with `message`.
    #[must_use]
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> RequestError {
        RequestError {
            kind,
            message: message.into(),
            rejection: None,
            violation: None,
        }
    }

    /// A rejection at admission.
    #[must_use]
    pub fn rejected(rejection: Rejection) -> RequestError {
        RequestError {
            kind: ErrorKind::Rejected,
            message: format!(
                "rejected by the {} node: {} (prompt of {} tokens, limit {} tokens)",
                rejection.node, rejection.reason, rejection.prompt_tokens, rejection.limit
            ),
            rejection: Some(Box::new(rejection)),
            violation: None,
        }
    }

    /// The error of a request a hook's `verdict` aborted on the `node` node.
    #[must_use]
    pub fn aborted_by(verdict: Verdict, node: &str) -> RequestError {
        match verdict {
            Verdict::Abort { violation, kind } => RequestError {
                kind: ErrorKind::Violation,
                message: format!(
                    "aborted by kvsan on the {node} node: violation {violation} ({})",
                    kind.name()
                ),
                rejection: None,
                violation: Some(Violated {
                    id: violation,
                    kind,
                }),
            },
            Verdict::Continue => {
                RequestError::new(ErrorKind::Internal, "aborted without a violation")
            }
        }
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for RequestError {}

/// One event of a request's stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token.
    Token(u32),
    /// The request finished; no more events follow.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt length.
        prompt_tokens: usize,
        /// Tokens generated.
        generated: usize,
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: usize,
    },
    /// The request failed; no more events follow.
    Error(RequestError),
}

/// The owner tag of request `id` of `tenant`.
#[must_use]
pub fn owner(id: RequestId, tenant: TenantId) -> Owner {
    Owner {
        request: id,
        tenant,
    }
}
