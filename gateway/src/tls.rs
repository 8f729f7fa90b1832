//! TLS: the listener's certificate, reloaded in place, and the trust the
//! CLI puts in a gateway's.
//!
//! The listener's [`ServerTls`] keeps one `rustls` server config whose
//! certificate comes from a resolver holding the current chain and key;
//! [`ServerTls::reload`] reads the files again and swaps them, so a
//! renewed certificate takes effect for new connections without a
//! restart (on SIGHUP), and a pair that does not load changes nothing.
//! The CLI trusts the system's roots and, with `--cacert`, a private CA
//! ([`client_config`]). Both use rustls with the `ring` provider.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use warmgate_deploy::TlsConfig;

/// A certificate, key or CA file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file cannot be read or holds no PEM block of the kind needed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The key does not go with the certificate, or rustls refused them.
    #[error("{0}")]
    Pair(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The listener's TLS: an acceptor whose certificate can be swapped.
pub struct ServerTls {
    files: TlsConfig,
    current: Arc<Current>,
    acceptor: tokio_rustls::TlsAcceptor,
}

/// The certificate handed to every new connection.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().clone())
    }
}

impl ServerTls {
    /// Loads the certificate chain and key `files` names.
    pub fn load(files: &TlsConfig) -> Result<ServerTls, TlsError> {
        let key = certified_key(&files.cert, &files.key)?;
        let current = Arc::new(Current(RwLock::new(Arc::new(key))));
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Pair(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ServerTls {
            files: files.clone(),
            current,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// Reads the files again and serves the new pair to new connections;
    /// on an error the old pair stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let key = certified_key(&self.files.cert, &self.files.key)?;
        *self.current.0.write() = Arc::new(key);
        Ok(())
    }

    /// The acceptor for new connections.
    pub fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }

    /// The certificate file, for messages.
    pub fn cert_path(&self) -> &Path {
        &self.files.cert
    }
}

/// The chain in `cert` and the key in `key`, checked to go together.
fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates(cert)?;
    let der = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
        path: key.to_path_buf(),
        reason: format!("no private key read: {e}"),
    })?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| TlsError::File {
            path: key.to_path_buf(),
            reason: format!("the key cannot sign: {e}"),
        })?;
    let pair = CertifiedKey::new(chain, signing);
    pair.keys_match().map_err(|e| {
        TlsError::Pair(format!(
            "the key in {} does not go with the certificate in {}: {e}",
            key.display(),
            cert.display()
        ))
    })?;
    Ok(pair)
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |reason: String| TlsError::File {
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(format!("cannot be read: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// What a CLI trusts: the system's roots (when `system_roots`), and the
/// CA certificates in `cacert` when given (a private CA, or a self-signed
/// gateway).
pub fn client_config(
    cacert: Option<&Path>,
    system_roots: bool,
) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    if system_roots {
        // Unreadable system certificates are skipped, as curl does.
        let system = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(system.certs);
    }
    if let Some(path) = cacert {
        for c in certificates(path)? {
            roots.add(c).map_err(|e| TlsError::File {
                path: path.to_path_buf(),
                reason: format!("not a usable CA certificate: {e}"),
            })?;
        }
    }
    // No ALPN here: the connector names the protocols it enables.
    rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Pair(e.to_string()))
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA and a leaf for `127.0.0.1` signed by it, written to `dir`:
    /// (ca.pem, cert.pem, key.pem).
    fn make_pair(dir: &Path, tag: &str) -> (PathBuf, PathBuf, PathBuf) {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let ca = ca_params.self_signed(&ca_key).expect("ca");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf_key = rcgen::KeyPair::generate().expect("key");
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .expect("params")
            .signed_by(&leaf_key, &issuer)
            .expect("leaf");
        let paths = (
            dir.join(format!("{tag}-ca.pem")),
            dir.join(format!("{tag}-cert.pem")),
            dir.join(format!("{tag}-key.pem")),
        );
        std::fs::write(&paths.0, ca.pem()).expect("write");
        std::fs::write(&paths.1, leaf.pem()).expect("write");
        std::fs::write(&paths.2, leaf_key.serialize_pem()).expect("write");
        paths
    }

    #[test]
    fn a_pair_loads_and_a_mismatched_or_missing_one_is_refused_and_keeps_the_old() {
        let d = tempfile::tempdir().expect("tmp");
        let (_, cert_a, key_a) = make_pair(d.path(), "a");
        let (_, cert_b, key_b) = make_pair(d.path(), "b");
        let files = TlsConfig {
            cert: d.path().join("cert.pem"),
            key: d.path().join("key.pem"),
            worker_listen: None,
        };
        assert!(matches!(
            ServerTls::load(&files),
            Err(TlsError::File { .. })
        ));
        std::fs::copy(&cert_a, &files.cert).expect("cp");
        std::fs::copy(&key_b, &files.key).expect("cp");
        let err = ServerTls::load(&files).err().expect("mismatch");
        assert!(err.to_string().contains("does not go with"), "{err}");
        std::fs::copy(&key_a, &files.key).expect("cp");
        let tls = ServerTls::load(&files).expect("load");
        let before = tls.current.0.read().cert[0].clone();
        std::fs::write(&files.key, "not a key").expect("write");
        assert!(tls.reload().is_err());
        assert_eq!(tls.current.0.read().cert[0], before, "the old pair stays");
        std::fs::copy(&cert_b, &files.cert).expect("cp");
        std::fs::copy(&key_b, &files.key).expect("cp");
        tls.reload().expect("reload");
        assert_ne!(tls.current.0.read().cert[0], before, "the new pair serves");
    }

    #[test]
    fn a_cacert_that_is_not_pem_is_refused() {
        let d = tempfile::tempdir().expect("tmp");
        let p = d.path().join("ca.pem");
        std::fs::write(&p, "hello").expect("write");
        assert!(client_config(Some(&p), false).is_err());
        let (ca, _, _) = make_pair(d.path(), "c");
        assert!(client_config(Some(&ca), true).is_ok());
    }
}
