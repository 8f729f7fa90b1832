//! The live desired state: the apps (by name and alias) and the pools the
//! gateway serves right now.
//!
//! A [`Registry`] is an immutable snapshot. The gateway holds the current
//! one behind an [`ArcSwap`], so the hot path reads it without a lock, and
//! a change (an API call, `warmgate apply`) builds the next snapshot and
//! swaps it in whole: a reader sees the old set or the new one, never a
//! mix.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use warmgate_deploy::TargetId;

use crate::serving::served::Served;
use crate::tasks::pool::Pool;

/// One snapshot of what is served.
#[derive(Default, Clone)]
pub struct Registry {
    /// Apps by name and by alias.
    routes: HashMap<String, Arc<Served>>,
    /// Apps by the name of an adapter they serve (`[apps.adapters]`).
    adapters: HashMap<String, Arc<Served>>,
    /// Apps in order (config order, then added ones).
    apps: Vec<Arc<Served>>,
    /// Pools by name.
    pools: BTreeMap<String, Arc<Pool>>,
    /// Pools by pool-manager target: their own and their on-demand one.
    by_target: HashMap<TargetId, Arc<Pool>>,
}

impl Registry {
    /// A snapshot of these apps and pools.
    pub fn new(apps: Vec<Arc<Served>>, pools: Vec<Arc<Pool>>) -> Self {
        let mut r = Registry::default();
        for a in apps {
            r.insert_app(a);
        }
        for p in pools {
            r.insert_pool(p);
        }
        r
    }

    fn insert_app(&mut self, app: Arc<Served>) {
        self.insert_routes(&app);
        match self.apps.iter_mut().find(|a| a.name == app.name) {
            Some(slot) => *slot = app,
            None => self.apps.push(app),
        }
    }

    /// Its name, aliases and adapters' names lead to it.
    fn insert_routes(&mut self, app: &Arc<Served>) {
        for name in std::iter::once(&app.name).chain(app.spec().aliases.iter()) {
            self.routes.insert(name.clone(), app.clone());
        }
        for a in &app.spec().adapters.models {
            for name in std::iter::once(&a.name).chain(a.aliases.iter()) {
                self.adapters.insert(name.clone(), app.clone());
            }
        }
    }

    fn insert_pool(&mut self, pool: Arc<Pool>) {
        self.by_target.retain(|_, p| p.name != pool.name);
        self.by_target.insert(pool.target(), pool.clone());
        if let Some(od) = pool.ondemand_target() {
            self.by_target.insert(od, pool.clone());
        }
        self.pools.insert(pool.name.clone(), pool);
    }

    /// This snapshot with `app` added, or in place of the app of its name
    /// (its aliases as they are now), where that app stood in the order.
    pub fn with_app(&self, app: Arc<Served>) -> Registry {
        self.with_apps(std::iter::once(app))
    }

    /// This snapshot with each of `apps` added or put in place, in one
    /// copy: a start with thousands of apps builds its registry once,
    /// not once per app.
    pub fn with_apps(&self, apps: impl IntoIterator<Item = Arc<Served>>) -> Registry {
        let mut next = self.clone();
        let mut index: HashMap<String, usize> = next
            .apps
            .iter()
            .enumerate()
            .map(|(i, a)| (a.name.clone(), i))
            .collect();
        for app in apps {
            let known = index.get(&app.name).copied();
            if known.is_some() {
                // The old app's aliases and adapters may not be the new one's.
                next.routes.retain(|_, a| a.name != app.name);
                next.adapters.retain(|_, a| a.name != app.name);
            }
            next.insert_routes(&app);
            match known {
                Some(i) => next.apps[i] = app,
                None => {
                    index.insert(app.name.clone(), next.apps.len());
                    next.apps.push(app);
                }
            }
        }
        next
    }

    /// This snapshot without the app `name` (and its aliases).
    pub fn without_app(&self, name: &str) -> Registry {
        let mut next = self.clone();
        next.apps.retain(|a| a.name != name);
        next.routes.retain(|_, a| a.name != name);
        next.adapters.retain(|_, a| a.name != name);
        next
    }

    /// This snapshot with `pool` added.
    pub fn with_pool(&self, pool: Arc<Pool>) -> Registry {
        let mut next = self.without_pool(&pool.name);
        next.insert_pool(pool);
        next
    }

    /// This snapshot without the pool `name`. Its targets still find it
    /// (its replicas report to it while it finishes its tasks) until
    /// [`Registry::forget_pool_targets`].
    pub fn without_pool(&self, name: &str) -> Registry {
        let mut next = self.clone();
        next.pools.remove(name);
        next
    }

    /// This snapshot with no target reporting to a pool named `name`
    /// that is no longer in it.
    pub fn forget_pool_targets(&self, name: &str) -> Registry {
        let mut next = self.clone();
        let current = next.pools.get(name).cloned();
        next.by_target
            .retain(|_, p| p.name != name || current.as_ref().is_some_and(|c| Arc::ptr_eq(c, p)));
        next
    }

    /// The app a name or alias routes to.
    pub fn app(&self, name: &str) -> Option<&Arc<Served>> {
        self.routes.get(name)
    }

    /// [`Registry::app`], or `not_found` naming it.
    pub fn find_app(&self, name: &str) -> Result<Arc<Served>, crate::error::Error> {
        self.app(name).cloned().ok_or_else(|| {
            crate::error::Error::new(
                crate::error::ErrorKind::NotFound,
                format!("app '{name}' not found"),
            )
        })
    }

    /// The app serving the adapter a request's `model` names on its
    /// replicas: by the adapter's name or alias, or `name@n` for one of
    /// its revisions.
    pub fn adapter(&self, model: &str) -> Option<&Arc<Served>> {
        self.adapters.get(model).or_else(|| {
            let (name, revision) = crate::serving::adapter_split::parse_model(model);
            revision.and_then(|_| self.adapters.get(name))
        })
    }

    /// Every app, in order.
    pub fn apps(&self) -> &[Arc<Served>] {
        &self.apps
    }

    /// Every name, alias and adapter that routes to an app.
    pub fn route_names(&self) -> impl Iterator<Item = &str> {
        self.routes
            .keys()
            .chain(self.adapters.keys())
            .map(String::as_str)
    }

    /// A pool by name.
    pub fn pool(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.get(name)
    }

    /// Every pool, by name.
    pub fn pools(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.pools.values()
    }

    /// The pool a pool-manager target belongs to (its own or its on-demand
    /// fallback).
    pub fn pool_of_target(&self, target: &TargetId) -> Option<&Arc<Pool>> {
        self.by_target.get(target)
    }
}

/// The current snapshot, shared by the gateway and the replica sink.
pub type Live = Arc<ArcSwap<Registry>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn app(name: &str, aliases: &[&str]) -> Arc<Served> {
        let spec = warmgate_deploy::AppSpec {
            name: name.into(),
            aliases: aliases.iter().map(|a| a.to_string()).collect(),
            ..warmgate_deploy::AppSpec::default()
        };
        Arc::new(Served::new(
            spec,
            warmgate_deploy::revision::History::default(),
        ))
    }

    #[test]
    fn apps_added_at_once_keep_their_order_and_a_replaced_one_its_place() {
        let names = |r: &Registry| r.apps().iter().map(|a| a.name.clone()).collect::<Vec<_>>();
        let r = Registry::default().with_apps((0..1000).map(|i| app(&format!("a{i}"), &[])));
        assert_eq!(r.apps().len(), 1000);
        assert_eq!(names(&r)[..3], ["a0", "a1", "a2"]);
        // In place, with new aliases: the old ones no longer lead to it.
        let r = r.with_app(app("a1", &["one"]));
        let r2 = r.with_app(app("a1", &["uno"]));
        assert_eq!(names(&r2)[..3], ["a0", "a1", "a2"]);
        assert!(r2.app("uno").is_some() && r2.app("one").is_none());
        assert!(r.app("one").is_some(), "the earlier snapshot is unchanged");
        let r3 = r2.with_app(app("b", &[]));
        assert_eq!(names(&r3).last().map(String::as_str), Some("b"));
        assert_eq!(r3.apps().len(), 1001);
    }
}
