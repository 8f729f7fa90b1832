"""An ``https://`` gateway whose certificate a private CA signed: the
clients refuse it on the system's roots alone, and trust it with
``cacert`` or ``$WARMGATE_CACERT``, as the CLI's ``--cacert``."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path
from typing import Callable, Tuple

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import warmgate
from warmgate.aio import AsyncClient

from conftest import Gateway


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def private_ca(folder: Path) -> Tuple[Path, Path, Path]:
    """A CA, and a certificate for 127.0.0.1 it signed: the CA's PEM file,
    the certificate's and its key's."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("warmgate test CA"))
        .issuer_name(_name("warmgate test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_file, cert_file, key_file


@pytest.fixture
def tls_gateway(make_gateway: Callable[..., Gateway], tmp_path: Path) -> Tuple[Gateway, Path]:
    ca, cert, key = private_ca(tmp_path)
    gw = make_gateway(f'[tls]\ncert = "{cert}"\nkey = "{key}"\n')
    assert gw.url.startswith("https://"), gw.url
    return gw, ca


def test_the_clients_trust_a_private_ca_only_when_given_it(
    tls_gateway: Tuple[Gateway, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, ca = tls_gateway
    token = gw.admin_token
    monkeypatch.delenv("WARMGATE_CACERT", raising=False)
    with warmgate.Client(gw.url, token=token, max_retries=0) as c:
        with pytest.raises(warmgate.UnreachableError) as e:
            c.status()
        assert "certificate" in str(e.value).lower(), e.value
    with warmgate.Client(gw.url, token=token, cacert=str(ca)) as c:
        assert "apps" in c.status()
    monkeypatch.setenv("WARMGATE_CACERT", str(ca))
    with warmgate.Client(gw.url, token=token) as c:
        assert "apps" in c.status()

    async def aio() -> None:
        async with AsyncClient(gw.url, token=token, cacert=str(ca)) as c:
            assert "apps" in await c.status()

    asyncio.run(aio())


def test_a_cacert_that_cannot_be_read_is_an_error_at_once(tmp_path: Path) -> None:
    with pytest.raises(warmgate.WarmgateError, match="cacert"):
        warmgate.Client("https://127.0.0.1:1", cacert=str(tmp_path / "missing.pem"))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(warmgate.WarmgateError, match="cacert"):
        AsyncClient("https://127.0.0.1:1", cacert=str(bad))
