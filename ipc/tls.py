"""TLS on the API port (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs: vLLM's and uvicorn's names).

The supervisor builds the context once before anything starts, so that a missing file, a key that is not its
certificate's or one under a passphrase is one line and exit 2, not an API server dying at start. Then it keeps a
copy of the files in the group's runtime directory (`keep_files`), and every API server builds its own context
from that copy (an SSLContext does not cross processes). An API server restarted after a crash therefore reads
what was checked, whatever has become of the operator's files since: a renewal half written, or refused at SIGHUP,
had made every replacement die at start, and the restarts' budget then took the whole group down. A renewed
certificate is served after a rolling restart (SIGHUP, `systemctl reload`), which the supervisor begins only once
the new files make a context and their copy is in place; else it logs why and the servers serve on with the last.
"""
from __future__ import annotations

import os
import shutil
import ssl
import tempfile

from ipc.config import ServeConfig

KEPT = "tls"  # the runtime directory's link to the last checked copy of the files
_NAMES = ("cert.pem", "key.pem", "ca.pem")

# --ssl-cert-reqs: Python's ssl module's values, as vLLM and uvicorn take them.
CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


class BadTls(ValueError):
    """The TLS options cannot make a server context; the message says why, in one line."""


def tls_problem(config: ServeConfig) -> str | None:
    """Why the TLS options cannot serve, in one line (a context is built now, from the files); None when they can.
    The supervisor asks at start and before a rolling restart (SIGHUP), which reads the files again."""
    if config.ssl_certfile is None:
        if config.ssl_keyfile or config.ssl_ca_certs or config.ssl_cert_reqs:
            return "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs go with --ssl-certfile"
        return None
    if config.ssl_cert_reqs and not config.ssl_ca_certs:
        return f"--ssl-cert-reqs {config.ssl_cert_reqs} needs --ssl-ca-certs (what client certificates chain to)"
    try:
        server_context(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, config.ssl_cert_reqs)
    except BadTls as exc:
        return str(exc)
    return None


def keep_files(config: ServeConfig) -> str | None:
    """Check the TLS files, then copy them where the API servers read them (`kept_files`): a new directory under
    the runtime directory, checked again (the files may change while they are read), then put in place of the
    last one at once (a link replaced). Why not, in one line; None once done."""
    problem = tls_problem(config)
    if problem is not None or config.ssl_certfile is None:
        return problem
    fresh = tempfile.mkdtemp(prefix="tls-", dir=config.runtime_dir)  # mode 0700: the key is readable by us alone
    originals = (config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    try:
        for name, original in zip(_NAMES, originals):
            if original:
                shutil.copyfile(original, os.path.join(fresh, name))
        copies = _files_in(fresh, originals)
        server_context(copies[0], copies[1], copies[2], config.ssl_cert_reqs)
    except (OSError, BadTls) as exc:
        shutil.rmtree(fresh, ignore_errors=True)
        return f"the TLS files changed while they were read; try again ({exc})"
    link = os.path.join(config.runtime_dir, KEPT)
    os.symlink(fresh, link + ".new")
    os.replace(link + ".new", link)
    _remove_older_copies(config.runtime_dir, fresh)
    return None


def _remove_older_copies(runtime_dir: str, kept: str) -> None:
    """Every copy but the one the link names: no server reads one again (a running server holds its context, a
    new one opens the files through the link), and a group renewed by SIGHUP each day would keep them all."""
    for entry in os.scandir(runtime_dir):
        if entry.name.startswith("tls-") and entry.path != kept:
            shutil.rmtree(entry.path, ignore_errors=True)


def kept_files(config: ServeConfig) -> tuple[str, str | None, str | None]:
    """The certificate, key and CA files an API server reads: the last checked copy (keep_files)."""
    return _files_in(os.path.join(config.runtime_dir, KEPT), (config.ssl_certfile, config.ssl_keyfile,
                                                                config.ssl_ca_certs))


def _files_in(directory: str, originals: tuple[str | None, ...]) -> tuple[str, str | None, str | None]:
    cert, key, ca = (os.path.join(directory, name) if original else None for name, original in zip(_NAMES, originals))
    assert cert is not None
    return cert, key, ca


def server_context(certfile: str, keyfile: str | None, ca_certs: str | None, cert_reqs: int,
                   alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    """A server context (TLS 1.2 or later) from PEM files. `alpn`: what a client may negotiate (HTTP/1.1 only:
    curl and browsers offer h2 first, which this server does not speak)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION  # a client asking again and again costs the server a handshake each
    try:
        # A passphrase is refused rather than asked for on a terminal that a service does not have.
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except FileNotFoundError as exc:
        raise BadTls(f"--ssl-certfile/--ssl-keyfile: no such file: {exc.filename or certfile}") from None
    except (ssl.SSLError, OSError) as exc:
        raise BadTls(f"--ssl-certfile {certfile}{f' --ssl-keyfile {keyfile}' if keyfile else ''}: not a PEM "
                     f"certificate and its unencrypted private key ({_reason(exc)})") from None
    if ca_certs:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise BadTls(f"--ssl-ca-certs {ca_certs}: not PEM CA certificates ({_reason(exc)})") from None
    context.verify_mode = CERT_REQS[cert_reqs]
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def _no_passphrase() -> bytes:
    raise BadTls("the private key is encrypted: give one without a passphrase")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
