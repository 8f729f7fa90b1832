//! A slot taken on a replica (`SlotGuard`): what the proxy asks of it, and
//! the slot given back (to the oldest held request, if any) when it drops.

use std::sync::Arc;
use std::time::Instant;

use warmgate_pool::ReplicaHandle;

use super::App;
use crate::serving::adapters::Ticket;

/// A slot on a replica. Dropping it frees the slot (and hands it to the
/// oldest held request, if any).
pub struct SlotGuard {
    pub(super) app: Arc<App>,
    pub(super) replica: Arc<ReplicaHandle>,
    /// The adapter the request asked for, released with the slot.
    pub(super) adapter: Option<Arc<str>>,
    /// What to do for it before forwarding.
    pub(super) ticket: Option<Ticket>,
    /// When the request asked for a slot: its end-to-end clock.
    pub(super) start: Instant,
    /// When it got the slot.
    pub(super) granted: Instant,
    /// The chunks of its prompt the replica was expected to miss (a
    /// request routed on its prompt): its time to first byte teaches the
    /// route what a chunk of prefill costs.
    pub(super) uncached: Option<u32>,
}

impl App {
    /// Gives a slot back (held `held`, when it was used) and hands it on.
    pub(super) fn release(
        &self,
        replica: &Arc<ReplicaHandle>,
        adapter: Option<&Arc<str>>,
        held: Option<std::time::Duration>,
    ) {
        let mut s = self.slots.lock();
        if let Some(d) = held {
            s.learned.held(d.as_secs_f64());
        }
        replica.release();
        if let Some(a) = adapter {
            s.adapters.release(&replica.id, a);
        }
        s.inflight -= 1;
        s.meter.completions = s.meter.completions.saturating_add(1);
        if replica.is_routable() && s.live_waiters > 0 {
            let spec = self.spec.load();
            s.dispatch(&spec);
        }
        s.update_meter(Instant::now());
    }
}

// === impl SlotGuard ===

impl crate::serving::proxy::Slot for SlotGuard {
    /// Notes the first byte of the answer's body (or its end, when it has
    /// none): the time to first byte, from the request's arrival.
    fn first_byte(&self) {
        self.app.ttfb.record(self.start.elapsed().as_secs_f64());
        if let Some(uncached) = self.uncached {
            let seconds = self.granted.elapsed().as_secs_f64();
            self.app.slots.lock().learned.first_byte(uncached, seconds);
        }
    }

    fn replica(&self) -> &Arc<ReplicaHandle> {
        &self.replica
    }

    fn eject(&self, cause: crate::serving::outlier::Cause) {
        crate::serving::outlier::eject_from_app(&self.app, &self.replica, cause);
    }

    /// Notes that the request is being forwarded now; the first forward to a
    /// fresh replica measures the gateway's share of the cold start.
    fn note_forward(&self) {
        if self.replica.take_first_forward() {
            let handoff = self.replica.ready_at.elapsed();
            *self.app.handoff.lock() = Some(handoff);
            metrics::histogram!("warmgate_cold_start_handoff_seconds", "app" => self.app.name.clone())
                .record(handoff.as_secs_f64());
        }
    }
}

impl SlotGuard {
    /// What the request must do for its adapter before it is forwarded
    /// (taken once).
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.ticket.take()
    }

    /// The replica the slot is on.
    pub fn replica_handle(&self) -> &Arc<ReplicaHandle> {
        &self.replica
    }

    /// The adapter the request asked for.
    pub fn adapter(&self) -> Option<&Arc<str>> {
        self.adapter.as_ref()
    }

    /// The revision whose slot this is.
    pub fn app(&self) -> &Arc<App> {
        &self.app
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        // A load this request was to start and never did: forget it.
        if let (Some(Ticket::Load { evict, .. }), Some(a)) = (&self.ticket, &self.adapter) {
            let mut s = self.app.slots.lock();
            s.adapters.loaded(&self.replica.id, a, false);
            if let Some(e) = evict {
                s.adapters.keep(&self.replica.id, e);
            }
        }
        self.app.duration.record(self.start.elapsed().as_secs_f64());
        self.app.release(
            &self.replica,
            self.adapter.as_ref(),
            Some(self.granted.elapsed()),
        );
    }
}
