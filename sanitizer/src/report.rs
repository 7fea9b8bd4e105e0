//! Reports: one violation → one AddressSanitizer-style human block and/or one
//! JSON line with the same fields. Everything here is cold.
//!
//! A report holds tags, states, a per-slot map and the page's history; it
//! never holds KV bytes (the sanitizer never sees them) nor prompt text, so a
//! report cannot itself leak what it is about.
//!
//! ```text
//!  slot map (one character per slot, 32 per row, row start on the left):
//!    0  WWWWWWWWwww.....
//!              ^          the faulting slot
//!  W all layers written by the owner   w some layers   . never written
//!  ~ received, not committed (in flight)   F page is free
//! ```

use std::fmt::Write as _;
use std::io::Write;

use serde::Serialize;

use crate::geometry::NodeRole;
use crate::history::HistoryEvent;
use crate::ids::{Generation, Owner, PageId, PoolId, RequestId};
use crate::violation::{ViolationId, ViolationKind};

/// The legend printed under every slot map.
pub const SLOT_MAP_LEGEND: &str = "legend: W all layers written by the owner   w some layers   . never written\n          ~ received, not committed (in flight)   F page is free   ^ faulting slot";

/// The page side of a report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PageReport {
    /// The pool.
    pub pool: PoolId,
    /// The pool's node.
    pub node: String,
    /// The node's role.
    pub role: NodeRole,
    /// The page.
    pub page: PageId,
    /// The generation the accessor's `PageRef` carried.
    pub tag: Generation,
    /// The page's generation now.
    pub generation: Generation,
    /// The page's state now (`owned`, `receiving`, `quarantined`, …).
    pub state: &'static str,
    /// The request recorded at the page's last allocation (for a free page:
    /// the last owner; `None` if never allocated).
    pub owner: Option<Owner>,
    /// The owner's lifecycle state, if known.
    pub owner_state: Option<&'static str>,
    /// Whether the owner let go while sharers still hold the page.
    pub owner_released: bool,
    /// Read-only sharers.
    pub sharers: Vec<Owner>,
    /// Slots per page.
    pub page_slots: u32,
    /// Layers per slot.
    pub layers: u32,
    /// One character per slot (see [`SLOT_MAP_LEGEND`]).
    pub slot_map: String,
    /// The slot at fault, if one.
    pub faulting_slot: Option<u32>,
}

/// One violation report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The violation id.
    pub id: ViolationId,
    /// Its kind.
    pub kind: ViolationKind,
    /// The one-line summary (`kvsan: stale-read in request 7 (tenant 2) reading …`).
    pub summary: String,
    /// The request whose action was found wrong (or the prefix cache,
    /// [`RequestId::PREFIX_CACHE`], whose share was refused).
    pub accessor: Owner,
    /// Its lifecycle state, if known.
    pub accessor_state: Option<&'static str>,
    /// What it was doing (`reading`, `writing`, …).
    pub action: String,
    /// The engine step, where the hook carries one.
    pub step: Option<u64>,
    /// What exactly is wrong (slot, token, layers, counts).
    pub detail: String,
    /// The page, if the violation concerns one.
    pub page: Option<PageReport>,
    /// The page's recent history, oldest first.
    pub history: Vec<HistoryEvent>,
}

fn rule() -> &'static str {
    "================================================================="
}

impl Report {
    /// The human block.
    #[cold]
    #[must_use]
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}", rule());
        let _ = writeln!(
            out,
            "{}",
            self.summary.replacen("kvsan: ", "kvsan: ERROR: ", 1)
        );
        let mut place = format!("  violation {}", self.id);
        if let Some(page) = &self.page {
            let _ = write!(place, " on node {} ({})", page.node, page.role.name());
        }
        if let Some(step) = self.step {
            let _ = write!(place, " at step {step}");
        }
        let _ = writeln!(out, "{place}");
        let _ = writeln!(out, "  {}", self.detail);
        let _ = writeln!(out, "  ({})", self.kind.description());
        if let Some(page) = &self.page {
            render_page(&mut out, self, page);
        }
        let _ = writeln!(
            out,
            "SUMMARY: kvsan: {} in {} [{}]",
            self.kind, self.accessor, self.id
        );
        let _ = writeln!(out, "{}", rule());
        out
    }

    /// The JSON line (no trailing newline).
    #[cold]
    #[must_use]
    pub fn render_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            format!(
                "{{\"id\":\"{}\",\"kind\":\"{}\",\"error\":\"report serialisation failed: {e}\"}}",
                self.id, self.kind
            )
        })
    }
}

fn render_page(out: &mut String, report: &Report, page: &PageReport) {
    let owner = |f: fn(&Owner) -> String| page.owner.as_ref().map_or("-".to_string(), f);
    let _ = writeln!(out);
    let _ = writeln!(out, "  {:<14}{:<24}page", "", "accessor");
    let _ = writeln!(
        out,
        "  {:<14}{:<24}{}",
        "request",
        request_cell(report.accessor.request),
        owner(|o| request_cell(o.request))
    );
    let _ = writeln!(
        out,
        "  {:<14}{:<24}{}",
        "tenant",
        report.accessor.tenant.0,
        owner(|o| o.tenant.0.to_string())
    );
    let tag = format!("{} (tag)", page.tag.0);
    let _ = writeln!(
        out,
        "  {:<14}{:<24}{} (current)",
        "generation", tag, page.generation.0
    );
    let mut page_state = page.state.to_string();
    if page.owner_released {
        page_state.push_str(", owner released");
    }
    if let Some(s) = page.owner_state {
        let _ = write!(page_state, ", owner {s}");
    }
    let _ = writeln!(
        out,
        "  {:<14}{:<24}{}",
        "state",
        report
            .accessor_state
            .unwrap_or(if report.accessor.request.is_prefix_cache() {
                // The cache holds pages; it has no lifecycle to show.
                "-"
            } else {
                "unknown"
            }),
        page_state
    );
    if !page.sharers.is_empty() {
        let list: Vec<String> = page.sharers.iter().map(ToString::to_string).collect();
        let _ = writeln!(out, "  {:<14}{:<24}{}", "shared with", "", list.join(", "));
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "  slot map of {} {}@gen {} ({} slots x {} layers):",
        page.pool, page.page, page.generation.0, page.page_slots, page.layers
    );
    let chars: Vec<char> = page.slot_map.chars().collect();
    for (row, chunk) in chars.chunks(32).enumerate() {
        let start = row * 32;
        let _ = writeln!(out, "    {start:>4}  {}", chunk.iter().collect::<String>());
        if let Some(slot) = page.faulting_slot {
            let slot = slot as usize;
            if (start..start + chunk.len()).contains(&slot) {
                let _ = writeln!(out, "          {}^", " ".repeat(slot - start));
            }
        }
    }
    let _ = writeln!(out, "  {SLOT_MAP_LEGEND}");
    let _ = writeln!(out);
    if report.history.is_empty() {
        let _ = writeln!(out, "  history of {} {}: none kept", page.pool, page.page);
    } else {
        let _ = writeln!(
            out,
            "  history of {} {} on node {} (oldest first):",
            page.pool, page.page, page.node
        );
        for e in &report.history {
            let who = Owner {
                request: e.request,
                tenant: e.tenant,
            };
            let mut line = format!("    {:<7} gen {:<4} {who}", e.kind.name(), e.generation.0);
            if let Some(step) = e.step {
                let _ = write!(line, "  step {step}");
            }
            if let Some((a, b)) = e.slots {
                let _ = write!(line, "  slots {a}..{b}");
            }
            let _ = writeln!(out, "{line}");
        }
    }
    let _ = writeln!(out);
}

/// A request in the accessor/page table: its number, or `prefix cache`
/// for the cache's reserved id.
fn request_cell(request: RequestId) -> String {
    if request.is_prefix_cache() {
        "prefix cache".to_string()
    } else {
        request.0.to_string()
    }
}

/// Where reports go.
pub(crate) enum Sink {
    Stderr,
    File(std::fs::File),
    Writer(Box<dyn Write + Send>),
}

impl Sink {
    pub(crate) fn emit(&mut self, text: &str) {
        // A report that cannot be written has nowhere else to go; stderr is
        // the last resort for a failing file or writer.
        let result = match self {
            Sink::Stderr => std::io::stderr().lock().write_all(text.as_bytes()),
            Sink::File(f) => f.write_all(text.as_bytes()),
            Sink::Writer(w) => w.write_all(text.as_bytes()).and_then(|()| w.flush()),
        };
        if let Err(e) = result {
            let _ = writeln!(std::io::stderr(), "kvsan: cannot write report: {e}\n{text}");
        }
    }

    pub(crate) fn flush(&mut self) {
        let _ = match self {
            Sink::Stderr => std::io::stderr().flush(),
            Sink::File(f) => f.flush(),
            Sink::Writer(w) => w.flush(),
        };
    }
}

/// Ends the process with `code`: the one exit path of `on_violation=halt`.
#[cold]
pub fn exit_process(code: i32) -> ! {
    std::process::exit(code)
}

/// Reports kept in memory, for a caller that shows or checks them itself
/// (a replay that prints the report next to its verdict, a test): hand a
/// clone to [`crate::Sanitizer::with_writer`] and read [`ReportBuffer::text`].
#[derive(Clone, Debug, Default)]
pub struct ReportBuffer(std::sync::Arc<parking_lot::Mutex<Vec<u8>>>);

impl ReportBuffer {
    /// Everything written so far (reports are UTF-8; a stray byte shows as
    /// U+FFFD rather than failing).
    #[must_use]
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock()).into_owned()
    }
}

impl Write for ReportBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
