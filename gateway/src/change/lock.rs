//! What keeps changes to the live registry apart (`change/` carries
//! them out): one at a time, a second change to an app or pool being
//! changed refused, the deleted ones still finishing what they hold, and
//! whether the API may change anything at all.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::{Error, ErrorKind};

/// What keeps changes to the registry apart: one at a time, a second
/// change to an app or pool being changed refused, the deleted ones still
/// finishing what they hold, and whether the API may change anything.
pub struct ChangeLock {
    /// Held by whoever changes the registry.
    one: tokio::sync::Mutex<()>,
    /// Apps and pools a change is being applied to (a second change to
    /// one of them meanwhile gets 409).
    busy: Mutex<HashSet<String>>,
    /// Deleted pools still finishing their tasks.
    pub(crate) retiring_pools: Mutex<HashSet<String>>,
    /// Deleted apps still finishing their requests.
    pub(crate) retiring_apps: Mutex<HashSet<String>>,
    /// Cleared under the operator: apps and pools come from resources,
    /// and the API may not change them.
    api: AtomicBool,
}

impl Default for ChangeLock {
    fn default() -> ChangeLock {
        ChangeLock {
            one: tokio::sync::Mutex::new(()),
            busy: Mutex::default(),
            retiring_pools: Mutex::default(),
            retiring_apps: Mutex::default(),
            api: AtomicBool::new(true),
        }
    }
}

impl ChangeLock {
    /// Waits for the registry's other changes to end; the registry is
    /// this caller's to change while the guard lives.
    pub(crate) async fn one_at_a_time(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.one.lock().await
    }

    /// Refuses every change through the API from now on.
    pub(crate) fn refuse_api(&self) {
        self.api.store(false, Ordering::Release);
    }

    /// 409 when changes through the API are refused.
    pub(crate) fn check_api_allowed(&self) -> Result<(), Error> {
        if self.api.load(Ordering::Acquire) {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Conflict,
            "this gateway is run by `warmgate operator`: change its apps and pools through their ServingApp and WarmPool resources",
        ))
    }

    /// Marks `what` as being changed while the guard lives; 409 when it
    /// is already.
    pub(crate) fn claim(&self, what: &str) -> Result<BusyGuard<'_>, Error> {
        let mut busy = self.busy.lock();
        if !busy.insert(what.to_string()) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!("another change to {what} is being applied; try again when it is done"),
            ));
        }
        Ok(BusyGuard {
            changes: self,
            what: what.to_string(),
        })
    }
}

/// Marks an app or pool as being changed while it lives.
pub(crate) struct BusyGuard<'a> {
    changes: &'a ChangeLock,
    what: String,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.changes.busy.lock().remove(&self.what);
    }
}
