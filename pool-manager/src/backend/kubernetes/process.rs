//! A replica pod as a [`Process`]: its address, how it ends (from the pod
//! watch), and stopping it by deleting the pod, or leaving it running for
//! the next leader.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tokio::sync::watch;

use super::{KubeBackend, PodView, Shared, delete};
use crate::backend::Process;

/// How a replica ends when its gateway stops leading.
const LEFT: &str = "was left running for the next leader";

impl KubeBackend {
    /// The replica of pod `name`, reached at `addr`, watched through `rx`.
    pub(super) fn process(
        &self,
        name: String,
        addr: SocketAddr,
        rx: watch::Receiver<PodView>,
    ) -> KubeProcess {
        KubeProcess {
            name,
            namespace: self.settings.namespace.clone(),
            addr,
            api: self.api.clone(),
            rx,
            grace: self.settings.stop_grace,
            shared: self.shared.clone(),
        }
    }
}

/// A replica pod.
pub(super) struct KubeProcess {
    name: String,
    namespace: String,
    addr: SocketAddr,
    api: Api<Pod>,
    rx: watch::Receiver<PodView>,
    grace: Duration,
    shared: Arc<Shared>,
}

#[async_trait]
impl Process for KubeProcess {
    fn addr(&self) -> crate::Endpoint {
        crate::Endpoint::Tcp(self.addr)
    }

    fn pid(&self) -> Option<u32> {
        None
    }

    fn log(&self) -> String {
        format!("kubectl logs -n {} pod/{}", self.namespace, self.name)
    }

    async fn wait(&mut self) -> String {
        loop {
            if let Some(how) = self.rx.borrow_and_update().ended.clone() {
                return how;
            }
            if self.rx.changed().await.is_err() {
                return "was lost with the pod watch".to_string();
            }
        }
    }

    fn terminate(&self) {
        if self.leave() {
            return;
        }
        delete(
            self.api.clone(),
            self.name.clone(),
            self.grace.as_secs().try_into().unwrap_or(u32::MAX),
        );
    }

    fn kill(&self) {
        if self.leave() {
            return;
        }
        delete(self.api.clone(), self.name.clone(), 0);
    }
}

impl KubeProcess {
    /// When the gateway stops leading: ends this replica here, with its pod
    /// left running. Returns whether it did.
    fn leave(&self) -> bool {
        if !self
            .shared
            .leaving
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return false;
        }
        if let Some(tx) = self.shared.pods.lock().get(&self.name) {
            tx.send_modify(|v| v.ended = Some(LEFT.to_string()));
        }
        true
    }
}

impl Drop for KubeProcess {
    fn drop(&mut self) {
        self.shared.pods.lock().remove(&self.name);
        if self
            .shared
            .leaving
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        // A pod that ended by itself (evicted, failed) stays as an object
        // until deleted; a replica that is gone must not leave it behind.
        if self.rx.borrow().ended.as_deref() != Some("was deleted") {
            delete(self.api.clone(), self.name.clone(), 0);
        }
    }
}
