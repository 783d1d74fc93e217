"""Self-signed certificates for the TLS tests, made by the openssl command."""
import pathlib
import shutil
import subprocess


def make_cert(directory: pathlib.Path, name: str = "ps.test", san: str = "DNS:ps.test"):
    """A self-signed certificate and its key (PEM paths).

    Raises:
      RuntimeError: the openssl command is missing (the TLS tests need it; it
        comes with Debian's `openssl` package).
    """
    if shutil.which("openssl") is None:
        raise RuntimeError("the TLS tests need the openssl command: apt-get install openssl")
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key
