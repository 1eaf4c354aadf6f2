"""Test certificates made with `cryptography`: a CA, and certificates it signs for a given
common name, usable by servers (SAN localhost and 127.0.0.1) and as client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class Issued:
    cert: bytes  # PEM
    key: bytes  # PEM


class CA:
    """A certificate authority; `cert` is its PEM certificate."""

    def __init__(self, name: str = "pdserve test CA") -> None:
        self.name, self._key = name, _key()
        self.cert = self._sign(name, self._key.public_key(), ca=True, hosts=False)

    def issue(self, common_name: str, hosts: bool = True) -> Issued:
        """A certificate for `common_name`; with `hosts`, also valid for serving on
        localhost and 127.0.0.1 (its SAN names)."""
        key = _key()
        return Issued(self._sign(common_name, key.public_key(), ca=False, hosts=hosts),
                      _pem_key(key))

    def _sign(self, subject: str, public_key, ca: bool, hosts: bool) -> bytes:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)]))
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        return builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
