//! What a hook found, and the cold path that numbers, counts, records and
//! reports it.

use super::Sanitizer;
use crate::ids::{Owner, PageRef, PoolId};
use crate::lifecycle::RequestState;
use crate::options::{OnViolation, ReportFormat};
use crate::report::{PageReport, Report, exit_process};
use crate::shadow::{FLAG_OWNER_RELEASED, PageState};
use crate::violation::{Verdict, Violation, ViolationId, ViolationKind};
use std::sync::atomic::Ordering;

/// What a hook was doing when it found a violation.
#[derive(Clone, Debug)]
pub(crate) struct Finding {
    kind: ViolationKind,
    accessor: Owner,
    action: String,
    pool: Option<PoolId>,
    page: Option<PageRef>,
    slot: Option<u32>,
    step: Option<u64>,
    detail: String,
}

impl Finding {
    pub(super) fn new(kind: ViolationKind, accessor: Owner, action: &str) -> Finding {
        Finding {
            kind,
            accessor,
            action: action.to_string(),
            pool: None,
            page: None,
            slot: None,
            step: None,
            detail: String::new(),
        }
    }

    pub(super) fn at(mut self, pool: PoolId, page: PageRef) -> Finding {
        self.pool = Some(pool);
        self.page = Some(page);
        self
    }

    pub(super) fn slot(mut self, slot: Option<u32>) -> Finding {
        self.slot = slot;
        self
    }

    pub(super) fn step(mut self, step: Option<u64>) -> Finding {
        self.step = step;
        self
    }

    pub(super) fn detail(mut self, detail: String) -> Finding {
        self.detail = detail;
        self
    }
}

impl Sanitizer {
    /// Numbers, counts, records and reports a violation, then applies
    /// `on_violation`.
    #[cold]
    #[inline(never)]
    pub(super) fn violation(&self, finding: Finding) -> Verdict {
        let id = ViolationId::next();
        self.counters.bump(finding.kind);
        {
            let mut recent = self.recent.lock();
            if self.options.max_recorded > 0 {
                while recent.len() >= self.options.max_recorded as usize {
                    recent.pop_front();
                }
                recent.push_back(Violation {
                    id,
                    kind: finding.kind,
                    request: finding.accessor.request,
                    tenant: finding.accessor.tenant,
                    pool: finding.pool,
                    page: finding.page.map(|p| p.page),
                });
            }
        }
        let limit = u64::from(self.options.print_limit);
        if limit == 0 || self.printed.fetch_add(1, Ordering::Relaxed) < limit {
            let report = self.build_report(id, &finding);
            let text = match self.options.report_format {
                ReportFormat::Text => report.render_text(),
                ReportFormat::Json => format!("{}\n", report.render_json()),
                ReportFormat::Both => format!("{}{}\n", report.render_text(), report.render_json()),
            };
            self.sink.lock().emit(&text);
        }
        tracing::debug!(kind = finding.kind.name(), %id, "kvsan violation");
        match self.options.on_violation {
            OnViolation::Abort => Verdict::Abort {
                violation: id,
                kind: finding.kind,
            },
            OnViolation::Report => Verdict::Continue,
            OnViolation::Halt => {
                let mut sink = self.sink.lock();
                sink.emit(&format!("{}\n", self.summary()));
                sink.flush();
                exit_process(self.options.exitcode)
            }
        }
    }

    /// The report a finding makes: page snapshot, slot map and history.
    #[cold]
    fn build_report(&self, id: ViolationId, f: &Finding) -> Report {
        let accessor_state = match f.pool {
            Some(pool) => self.lifecycle.state_at(f.accessor.request, pool),
            None => self.lifecycle.state(f.accessor.request),
        }
        .map(RequestState::name);
        let page = f.pool.zip(f.page).and_then(|(pool, page)| {
            let shadow = self.pool(pool).ok()?;
            let view = shadow.page(page.page).ok()?;
            Some((shadow, view, page))
        });
        let mut summary = format!("kvsan: {} in {}", f.kind, f.accessor);
        let mut history = Vec::new();
        let page_report = page.map(|(shadow, view, page)| {
            let word = view.rec.load();
            let owner = (word.generation().0 > 0).then(|| view.rec.owner());
            let state = word.state();
            let _ = std::fmt::Write::write_fmt(
                &mut summary,
                format_args!(" {} {} {page}", f.action, shadow.id),
            );
            match owner {
                Some(o) if !state.is_free() => {
                    let _ = std::fmt::Write::write_fmt(&mut summary, format_args!(" owned by {o}"));
                }
                Some(o) => {
                    let _ = std::fmt::Write::write_fmt(
                        &mut summary,
                        format_args!(" which is {} (last owned by {o})", state.name()),
                    );
                }
                None => summary.push_str(" which was never allocated"),
            }
            shadow.flush_kernel_write(page.page);
            history = shadow.history(page.page);
            let layers = shadow.geometry.layers;
            let slot_map = (0..shadow.geometry.page_slots)
                .map(|s| {
                    let n = view.written_layers(s, &(0..layers));
                    match state {
                        _ if state.is_free() => 'F',
                        PageState::Receiving if n > 0 => '~',
                        _ if n == layers => 'W',
                        _ if n > 0 => 'w',
                        _ => '.',
                    }
                })
                .collect();
            PageReport {
                pool: shadow.id,
                node: shadow.geometry.node.clone(),
                role: shadow.geometry.role,
                page: page.page,
                tag: page.generation,
                generation: word.generation(),
                state: state.name(),
                owner,
                owner_state: owner
                    .and_then(|o| self.lifecycle.state_at(o.request, shadow.id))
                    .map(RequestState::name),
                owner_released: word.has(FLAG_OWNER_RELEASED),
                sharers: shadow.sharers_of(page.page),
                page_slots: shadow.geometry.page_slots,
                layers,
                slot_map,
                faulting_slot: f.slot,
            }
        });
        if page_report.is_none() {
            summary.push_str(&format!(" {}", f.action));
        }
        Report {
            id,
            kind: f.kind,
            summary,
            accessor: f.accessor,
            accessor_state,
            action: f.action.clone(),
            step: f.step,
            detail: f.detail.clone(),
            page: page_report,
            history,
        }
    }
}

/// `word` with its indefinite article: "an aborted", "a rejected".
pub(super) fn with_article(word: &str) -> String {
    let article = if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {word}")
}
