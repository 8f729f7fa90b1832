//! Who may call the gateway: the control plane's bearer token and the
//! data plane's tenants (their API keys and quotas).

/// Who may call: checked by `http/` on every request.
pub struct Access {
    /// `WARMGATE_ADMIN_TOKEN` (or the one `serve` made): the control
    /// plane's bearer token. `None`: the control plane is open.
    pub(crate) admin_token: Option<String>,
    /// Data-plane API keys and quotas (`None`: the data plane is open).
    pub(crate) tenants: Option<crate::tenants::Tenants>,
}

/// The admin token: from the environment when set and not empty, else the
/// one `warmgate serve` made for itself ([`use_generated_admin_token`]).
pub fn admin_token() -> Option<String> {
    std::env::var("WARMGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| GENERATED_ADMIN_TOKEN.get().cloned())
}

/// The token `warmgate serve` keeps in its state folder when it was given
/// none (see `runtime::admin_token`); set once, before the gateway is made.
static GENERATED_ADMIN_TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The token `serve` made for itself, when it did.
pub(crate) fn generated_admin_token() -> Option<String> {
    GENERATED_ADMIN_TOKEN.get().cloned()
}

/// Makes `token` the admin token of the gateway this process runs, when
/// the environment gives none.
pub(crate) fn use_generated_admin_token(token: String) {
    let _ = GENERATED_ADMIN_TOKEN.set(token);
}
