//! The violation kinds: one declarative list drives the enum, the stable
//! kebab-case names, the descriptions, the counters and display
//! (compiler-rt's `ASAN_FOR_EACH_ERROR_KIND` pattern).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Serialize, Serializer};

use crate::ids::{PageId, PoolId, RequestId, TenantId};

/// Calls `$m!` with the list of every violation kind:
/// `Variant = code => "stable-name", "description";`.
///
/// The code is the kind's number in the C ABI (`KvsanVerdict.kind`), written
/// here, never counted: an engine and a library built from different
/// versions agree on it whatever the order of this list. A code is never
/// reused; a new kind takes the next one. `stable_codes` in the tests below
/// fails when one changes.
macro_rules! for_each_violation_kind {
    ($m:ident) => {
        $m! {
            StaleRead = 0 => "stale-read", "read of a slot the current owner never wrote in this generation";
            ForeignRead = 1 => "foreign-read", "read of a page owned by another request and not shared with the reader";
            GenerationMismatch = 2 => "generation-mismatch", "access through a PageRef whose page was freed and re-allocated since";
            ReadFreePage = 3 => "read-free-page", "read of a free or quarantined page";
            ReadDuringTransfer = 4 => "read-during-transfer", "read of a page whose incoming transfer has not been committed";
            ForeignWrite = 5 => "foreign-write", "write into a page the writer does not own, or by anyone into a page shared read-only (a prefix-cache page)";
            WriteAfterFree = 6 => "write-after-free", "a write (often a late DMA/RDMA write) lands in a freed page";
            DoubleAlloc = 7 => "double-alloc", "allocation of a page that is already allocated";
            DoubleFree = 8 => "double-free", "free of a page already free, or through a stale generation";
            ForeignFree = 9 => "foreign-free", "free of a page by a request that neither owns nor shares it";
            TerminalRequestActivity = 10 => "terminal-request-activity", "a rejected, aborted or finished request allocates, computes, sends, receives or reads, or a rejected/aborted request gets another lifecycle event";
            ShortTransfer = 11 => "short-transfer", "a transfer is committed with fewer received tokens than the receiver commits to read";
            UnwrittenTransfer = 12 => "unwritten-transfer", "a sender ships slots it never wrote";
            PageLeak = 13 => "page-leak", "a request ends while it still holds pages";
            IllegalTransition = 14 => "illegal-transition", "a lifecycle event that is not a legal transition from the request's state";
            PoisonRead = 15 => "poison-read", "the poison a freed page is filled with reached attention output, through a slot the shadow holds written";
            CrossDomainShare = 16 => "cross-domain-share", "the prefix cache shares a page with a request the isolation policy keeps apart from the page's writer";
            UnwrittenShare = 17 => "unwritten-share", "the prefix cache shares a page before its owner wrote every slot of every layer of it";
            MisdirectedTransfer = 18 => "misdirected-transfer", "received KV is copied into a page the receiving request does not hold, or holds but did not reserve for an incoming transfer";
            TransferDigestMismatch = 19 => "transfer-digest-mismatch", "the KV found in a destination page after a transfer is not what the sender sent for those tokens";
            TierBlockAliased = 20 => "tier-block-aliased", "a store into a tier block that still holds, or is still storing, another page's KV: two pages would map to one block";
            TierStoreSourceReused = 21 => "tier-store-source-reused", "a tier store's source page was freed or re-allocated before the store completed";
            TierLoadUnstored = 22 => "tier-load-unstored", "a load from a tier block whose store never completed, failed, or was released";
            TierForeignLoad = 23 => "tier-foreign-load", "a tier block is loaded for a request it does not belong to: not the request stored, and not a sharer the isolation policy allows for a prefix-cache block";
            TierDigestMismatch = 24 => "tier-digest-mismatch", "the KV found in a page after a tier load is not what the store put in the tier block";
        }
    };
}

macro_rules! define_violation_kinds {
    ($($variant:ident = $code:literal => $name:literal, $help:literal;)*) => {
        /// A kind of breach of the invariant or of the rules that protect it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum ViolationKind {
            $(
                #[doc = concat!("`", $name, "`: ", $help, ".")]
                $variant,
            )*
        }

        impl ViolationKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [ViolationKind] = &[$(ViolationKind::$variant),*];
            /// Number of kinds.
            pub const COUNT: usize = Self::ALL.len();

            /// The stable kebab-case name (`stale-read`).
            #[must_use]
            pub const fn name(self) -> &'static str {
                match self { $(ViolationKind::$variant => $name,)* }
            }

            /// One sentence saying what happened.
            #[must_use]
            pub const fn description(self) -> &'static str {
                match self { $(ViolationKind::$variant => $help,)* }
            }

            /// The kind with this stable name.
            #[must_use]
            pub fn from_name(name: &str) -> Option<ViolationKind> {
                match name { $($name => Some(ViolationKind::$variant),)* _ => None }
            }

            /// The kind's stable number in the C ABI.
            #[must_use]
            pub const fn code(self) -> u32 {
                match self { $(ViolationKind::$variant => $code,)* }
            }

            /// The kind with this ABI number.
            #[must_use]
            pub const fn from_code(code: u32) -> Option<ViolationKind> {
                match code { $($code => Some(ViolationKind::$variant),)* _ => None }
            }
        }
    };
}

for_each_violation_kind!(define_violation_kinds);

impl ViolationKind {
    /// Dense index `0..COUNT`, for counter arrays.
    #[must_use]
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for ViolationKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Process-unique number of one violation, shown as `KV-000001`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ViolationId(pub u64);

static NEXT_VIOLATION_ID: AtomicU64 = AtomicU64::new(1);

impl ViolationId {
    /// A fresh id, unique within this process (also for violations an
    /// engine finds on its own, such as a checked kernel's refusal).
    #[must_use]
    pub fn next() -> ViolationId {
        ViolationId(NEXT_VIOLATION_ID.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for ViolationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KV-{:06}", self.0)
    }
}

impl std::str::FromStr for ViolationId {
    type Err = String;

    /// Parses `KV-000042` (the form [`fmt::Display`] writes).
    fn from_str(s: &str) -> Result<ViolationId, String> {
        s.strip_prefix("KV-")
            .and_then(|n| n.parse().ok())
            .map(ViolationId)
            .ok_or_else(|| format!("not a violation id (KV-NNNNNN): {s:?}"))
    }
}

impl Serialize for ViolationId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One detected breach, as kept in the sanitizer's bounded list of recent
/// violations ([`Sanitizer::violations`](crate::Sanitizer::violations)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// Its process-unique id.
    pub id: ViolationId,
    /// What happened.
    pub kind: ViolationKind,
    /// The request whose action was found wrong.
    pub request: RequestId,
    /// That request's tenant.
    pub tenant: TenantId,
    /// The pool involved, if any.
    pub pool: Option<PoolId>,
    /// The page involved, if any.
    pub page: Option<PageId>,
}

/// What a check tells the engine: go on, or abort the request it concerns.
#[must_use = "a violation verdict must be acted on (abort the request)"]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing found, or `on_violation=report`.
    Continue,
    /// Abort the request; the client's error should name `violation`.
    Abort {
        /// The violation found.
        violation: ViolationId,
        /// Its kind.
        kind: ViolationKind,
    },
}

impl Verdict {
    /// `true` for [`Verdict::Continue`].
    #[must_use]
    pub fn is_continue(&self) -> bool {
        matches!(self, Verdict::Continue)
    }

    /// The violation kind of an [`Verdict::Abort`].
    #[must_use]
    pub fn kind(&self) -> Option<ViolationKind> {
        match self {
            Verdict::Continue => None,
            Verdict::Abort { kind, .. } => Some(*kind),
        }
    }
}

/// Per-kind violation counters (counting continues past `print_limit`).
pub(crate) struct Counters {
    counts: [AtomicU64; ViolationKind::COUNT],
}

impl Counters {
    pub(crate) fn new() -> Counters {
        Counters {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    pub(crate) fn bump(&self, kind: ViolationKind) -> u64 {
        self.counts[kind.index()].fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn get(&self, kind: ViolationKind) -> u64 {
        self.counts[kind.index()].load(Ordering::Relaxed)
    }

    pub(crate) fn total(&self) -> u64 {
        ViolationKind::ALL.iter().map(|k| self.get(*k)).sum()
    }

    /// `kvsan: N violations (stale-read: 2, double-free: 1)`.
    pub(crate) fn summary(&self) -> String {
        let total = self.total();
        let noun = if total == 1 {
            "violation"
        } else {
            "violations"
        };
        let parts: Vec<String> = ViolationKind::ALL
            .iter()
            .filter(|k| self.get(**k) > 0)
            .map(|k| format!("{}: {}", k.name(), self.get(*k)))
            .collect();
        if parts.is_empty() {
            format!("kvsan: {total} {noun}")
        } else {
            format!("kvsan: {total} {noun} ({})", parts.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_kebab_case_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for kind in ViolationKind::ALL {
            let name = kind.name();
            assert!(seen.insert(name), "duplicate {name}");
            assert!(name.chars().all(|c| c.is_ascii_lowercase() || c == '-'));
            assert_eq!(ViolationKind::from_name(name), Some(*kind));
            assert_eq!(ViolationKind::ALL[kind.index()], *kind);
        }
        assert_eq!(ViolationKind::from_name("no-such-kind"), None);
    }

    /// The ABI codes, frozen: an engine and a library built from different
    /// versions must agree on them. Change this table only to append a new
    /// kind with the next code.
    #[test]
    fn stable_codes() {
        let frozen = [
            ("stale-read", 0),
            ("foreign-read", 1),
            ("generation-mismatch", 2),
            ("read-free-page", 3),
            ("read-during-transfer", 4),
            ("foreign-write", 5),
            ("write-after-free", 6),
            ("double-alloc", 7),
            ("double-free", 8),
            ("foreign-free", 9),
            ("terminal-request-activity", 10),
            ("short-transfer", 11),
            ("unwritten-transfer", 12),
            ("page-leak", 13),
            ("illegal-transition", 14),
            ("poison-read", 15),
            ("cross-domain-share", 16),
            ("unwritten-share", 17),
            ("misdirected-transfer", 18),
            ("transfer-digest-mismatch", 19),
            ("tier-block-aliased", 20),
            ("tier-store-source-reused", 21),
            ("tier-load-unstored", 22),
            ("tier-foreign-load", 23),
            ("tier-digest-mismatch", 24),
        ];
        assert_eq!(
            frozen.len(),
            ViolationKind::COUNT,
            "a kind without a frozen code"
        );
        for (name, code) in frozen {
            let kind = ViolationKind::from_name(name).expect(name);
            assert_eq!(kind.code(), code, "{name}'s ABI code changed");
            assert_eq!(ViolationKind::from_code(code), Some(kind));
        }
        assert_eq!(ViolationKind::from_code(25), None);
    }

    #[test]
    fn violation_ids_print_with_six_digits() {
        assert_eq!(ViolationId(7).to_string(), "KV-000007");
    }

    #[test]
    fn summary_lists_only_kinds_seen() {
        let c = Counters::new();
        assert_eq!(c.summary(), "kvsan: 0 violations");
        c.bump(ViolationKind::StaleRead);
        c.bump(ViolationKind::StaleRead);
        c.bump(ViolationKind::DoubleFree);
        assert_eq!(
            c.summary(),
            "kvsan: 3 violations (stale-read: 2, double-free: 1)"
        );
    }
}
