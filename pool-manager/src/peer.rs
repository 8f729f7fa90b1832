//! The `peer` backend: an operator replica that does not lead serves the
//! replicas its leader runs. It starts and stops nothing. Its targets'
//! replicas are the leader's ready ones, as the leader lists them
//! ([`PeerBackend::update`]); each is taken by one replica slot here
//! (probed like any replica before it is routed to), and one the leader
//! no longer lists ends here too, so it is not routed to again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::backend::{Adopted, Backend, Launch, Process};
use crate::{Error, Result};

/// One replica the leader routes to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Route {
    /// Its id on the leader (`m-00002-3`).
    pub replica: String,
    /// Where it listens.
    pub addr: crate::Endpoint,
}

/// The leader's ready replicas, by target (an app revision's name,
/// `m-00002`).
pub type Routes = BTreeMap<String, Vec<Route>>;

/// Replicas as the leader lists them.
pub struct PeerBackend {
    routes: watch::Sender<Arc<Routes>>,
    /// Replicas taken by a slot here, by id.
    taken: Arc<Mutex<BTreeSet<String>>>,
}

impl Default for PeerBackend {
    fn default() -> Self {
        PeerBackend {
            routes: watch::channel(Arc::new(Routes::new())).0,
            taken: Arc::default(),
        }
    }
}

impl PeerBackend {
    /// A backend with no replica listed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The leader's replicas now.
    pub fn update(&self, routes: Routes) {
        self.routes.send_if_modified(|r| {
            if **r == routes {
                false
            } else {
                *r = Arc::new(routes);
                true
            }
        });
    }

    /// How many replicas the leader lists for `target`: how many this
    /// gateway's target should have.
    pub fn listed(&self, target: &str) -> u32 {
        let n = self.routes.borrow().get(target).map_or(0, Vec::len);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Takes a listed replica of the launch's target no slot has, if any.
    fn take(&self, launch: &Launch) -> Option<PeerProcess> {
        let routes = self.routes.borrow().clone();
        let mut taken = self.taken.lock();
        let route = routes
            .get(&launch.revision)?
            .iter()
            .find(|r| !taken.contains(&r.replica))?
            .clone();
        taken.insert(route.replica.clone());
        Some(PeerProcess {
            target: launch.revision.clone(),
            route,
            routes: self.routes.subscribe(),
            stopped: watch::channel(false).0,
            taken: self.taken.clone(),
        })
    }
}

#[async_trait]
impl Backend for PeerBackend {
    /// Waits for the leader to list a replica of the target that no slot
    /// here has.
    async fn spawn(&self, launch: &Launch) -> Result<Box<dyn Process>> {
        let mut changed = self.routes.subscribe();
        loop {
            if let Some(p) = self.take(launch) {
                return Ok(Box::new(p));
            }
            if changed.changed().await.is_err() {
                return Err(Error::SpawnFailed {
                    program: launch.revision.clone(),
                    reason: "the leader's replica list is gone".into(),
                });
            }
        }
    }

    /// The leader's pods are placed by the cluster, not by this machine.
    fn places_gpus(&self) -> bool {
        true
    }

    fn adoptable(&self, launch: &Launch) -> usize {
        let taken = self.taken.lock();
        self.routes.borrow().get(&launch.revision).map_or(0, |rs| {
            rs.iter().filter(|r| !taken.contains(&r.replica)).count()
        })
    }

    /// A listed replica, under the leader's name for it.
    fn adopt(&self, launch: &Launch) -> Option<Adopted> {
        let p = self.take(launch)?;
        Some(Adopted {
            replica: p.route.replica.clone(),
            env: BTreeMap::new(),
            process: Box::new(p),
        })
    }
}

/// A leader's replica, as one slot here has it.
struct PeerProcess {
    target: String,
    route: Route,
    routes: watch::Receiver<Arc<Routes>>,
    /// Set when this gateway lets it go.
    stopped: watch::Sender<bool>,
    taken: Arc<Mutex<BTreeSet<String>>>,
}

impl PeerProcess {
    fn listed(&self) -> bool {
        self.routes
            .borrow()
            .get(&self.target)
            .is_some_and(|rs| rs.contains(&self.route))
    }
}

#[async_trait]
impl Process for PeerProcess {
    fn addr(&self) -> crate::Endpoint {
        self.route.addr.clone()
    }

    fn pid(&self) -> Option<u32> {
        None
    }

    fn log(&self) -> String {
        format!("on the leader: replica {}", self.route.replica)
    }

    async fn wait(&mut self) -> String {
        let mut stopped = self.stopped.subscribe();
        loop {
            if *stopped.borrow_and_update() {
                return "was let go by this gateway".into();
            }
            if !self.listed() {
                return "is no longer listed by the leader".into();
            }
            tokio::select! {
                r = self.routes.changed() => if r.is_err() {
                    return "the leader's replica list is gone".into();
                },
                _ = stopped.changed() => {}
            }
        }
    }

    /// Lets it go; the leader stops it, or not.
    fn terminate(&self) {
        self.stopped.send_replace(true);
    }

    fn kill(&self) {
        self.stopped.send_replace(true);
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        self.taken.lock().remove(&self.route.replica);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(revision: &str) -> Launch {
        Launch {
            replica: format!("{revision}-1"),
            target: "m".into(),
            revision: revision.into(),
            command: Vec::new(),
            env: BTreeMap::new(),
            gpus: Vec::new(),
            workdir: None,
            checkpoint: None,
            image: None,
            pod: Default::default(),
            gpu_count: 0,
            pool: false,
            health: Default::default(),
            listen: Default::default(),
            startup_timeout: std::time::Duration::from_secs(1),
        }
    }

    fn route(replica: &str, port: u16) -> Route {
        Route {
            replica: replica.into(),
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], port)).into(),
        }
    }

    #[tokio::test]
    async fn each_listed_replica_is_taken_once_and_ends_when_the_leader_drops_it() {
        let b = Arc::new(PeerBackend::new());
        let l = launch("m-00001");
        assert_eq!(b.adoptable(&l), 0);
        assert!(b.adopt(&l).is_none());
        // A slot waits for the leader to list one.
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.spawn(&launch("m-00001")).await }
        });
        b.update(Routes::from([(
            "m-00001".into(),
            vec![route("m-00001-1", 1), route("m-00001-2", 2)],
        )]));
        let held = waiting.await.expect("joined").expect("taken");
        let first = held.addr();
        assert_eq!(b.listed("m-00001"), 2);
        assert_eq!(b.adoptable(&l), 1, "one is taken");
        let mut second = b.adopt(&l).expect("the other one").process;
        assert_ne!(second.addr(), first);
        assert!(b.adopt(&l).is_none(), "none left");
        assert!(b.adopt(&launch("m-00002")).is_none(), "another target's");
        // The leader drops the second: it ends here.
        let kept = if first.tcp().map(|a| a.port()) == Some(1) {
            route("m-00001-1", 1)
        } else {
            route("m-00001-2", 2)
        };
        b.update(Routes::from([("m-00001".into(), vec![kept])]));
        assert_eq!(second.wait().await, "is no longer listed by the leader");
        drop(second);
        assert_eq!(b.adoptable(&l), 0);
    }

    #[tokio::test]
    async fn a_replica_let_go_here_is_free_again() {
        let b = PeerBackend::new();
        let l = launch("m-00001");
        b.update(Routes::from([(
            "m-00001".into(),
            vec![route("m-00001-1", 1)],
        )]));
        let mut p = b.adopt(&l).expect("taken").process;
        p.terminate();
        assert_eq!(p.wait().await, "was let go by this gateway");
        drop(p);
        assert_eq!(b.adoptable(&l), 1);
    }
}
