//! The unified node: one pool, prefill and decode in the same batches,
//! driven by the shared step loop ([`crate::node::step_loop`]).

use crossbeam_channel::Receiver;
use kvsan_sanitizer::Owner;

use crate::node::Command;
use crate::node::admission::{self, PoolLimit};
use crate::node::executor::Executor;
use crate::node::scheduler::Scheduler;
use crate::node::step_loop::{cancel, new_sequence, queue, shutdown, stats, step};
use crate::request::Request;

/// The unified node's loop.
pub(crate) fn run(mut core: Executor, mut sched: Scheduler, context: usize, rx: Receiver<Command>) {
    loop {
        let first = if sched.is_idle() {
            core.idle();
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match cmd {
                Command::Submit {
                    owner,
                    request,
                    events,
                } => submit(&mut core, &mut sched, context, owner, request, events),
                Command::Cancel(id) => {
                    cancel(&mut core, &mut sched, id);
                }
                Command::Stats(tx) => {
                    let _ = tx.send(stats(&core, &sched));
                }
                Command::Shutdown => {
                    shutdown(&mut core, &mut sched);
                    return;
                }
                Command::AttachPrefill { .. } | Command::FromPrefill { .. } => {
                    tracing::warn!(node = %core.name, "a unified node has no prefill link; message dropped");
                }
            }
        }
        step(&mut core, &mut sched);
    }
}

fn submit(
    core: &mut Executor,
    sched: &mut Scheduler,
    context: usize,
    owner: Owner,
    request: Request,
    events: crossbeam_channel::Sender<crate::request::Event>,
) {
    let limits = [PoolLimit {
        node: &core.name,
        tokens: core.capacity_tokens(),
    }];
    let checked = admission::check(&request, &core.model, &core.name, context, &limits);
    let seq = checked
        .and_then(|()| new_sequence(owner, request, core.pool.page_slots(), Some(events.clone())));
    match seq {
        Ok(seq) => sched.waiting.extend(queue(core, seq)),
        Err(e) => {
            // Refused either way; a move the lifecycle refuses is logged there.
            let _ = core.lifecycle.refuse(owner, &e);
            tracing::info!(node = %core.name, request = owner.request.0, tenant = owner.tenant.0, "request refused: {}", e.message);
            let _ = events.send(crate::request::Event::Error(e));
        }
    }
}
