"""TLS on the API port (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs): the openai client over
HTTPS, mutual TLS, gRPC over TLS, the options checked before anything starts, and what a careless or hostile client
does to a TLS port (plain HTTP, a handshake never begun, a body the server refuses)."""
import os
import signal
import socket
import ssl
import subprocess
import time

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc

from tests.supervise_process import SUPERVISE, Supervise, runtime_dir_of, title_of

MODEL = "sim:5"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the server's certificate for 127.0.0.1 with its key, and a client's certificate: PEM files."""
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@example.org")
    files = {"ca": where / "ca.pem", "cert": where / "server.pem", "key": where / "server.key",
             "client": where / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    other = trustme.CA().issue_cert("127.0.0.1")  # a pair from elsewhere, for the mismatched key
    files["other_key"] = where / "other.key"
    other.private_key_pem.write_to_path(str(files["other_key"]))
    return {name: str(path) for name, path in files.items()}


def trusting(pki: dict, certificate: str | None = None) -> ssl.SSLContext:
    """A client's context that trusts the CA, showing `certificate` (with its key) when given."""
    context = ssl.create_default_context(cafile=pki["ca"])
    if certificate:
        context.load_cert_chain(certificate)
    return context


@pytest.fixture(scope="module")
def https(pki):
    with Supervise("--model", MODEL, "--api-server-count", "2", "--ssl-certfile", pki["cert"], "--ssl-keyfile",
                   pki["key"], "--timeout-request-header", "2", "--max-request-body-bytes", "65536",
                   verify=trusting(pki)) as server:
        yield server


def test_the_openai_client_over_https(https, pki):
    assert https.url.startswith("https://") and "serving" in https.log()
    client = openai.OpenAI(base_url=https.base_url, api_key="none", http_client=httpx.Client(verify=trusting(pki)))
    answer = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    # HTTP/1.1 is what it offers (curl and browsers offer h2 first)
    with socket.create_connection(https.address) as raw:
        context = trusting(pki)
        context.set_alpn_protocols(["h2", "http/1.1"])
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.selected_alpn_protocol() == "http/1.1"


def test_a_client_that_does_not_trust_the_certificate_is_refused_by_its_own_check(https):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(https.url + "/health", timeout=10)


def open_connections(server: Supervise, pki: dict) -> int:
    text = httpx.get(server.url + "/metrics", timeout=10, verify=trusting(pki)).text
    return int(next(line for line in text.splitlines() if line.startswith("supervise_open_connections ")).split()[1])


def test_plain_http_and_silent_clients_on_the_tls_port_are_closed_and_leave_nothing(https, pki):
    """Plain HTTP gets no HTTP answer (the TLS layer refuses its bytes), a connection that never starts the handshake
    is closed after --timeout-request-header (2 s here), and neither holds a connection's slot or writes a log line."""
    log_before = len(https.log())
    plain = [socket.create_connection(https.address) for _ in range(4)]
    for s in plain:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    silent = [socket.create_connection(https.address) for _ in range(4)]
    started = time.monotonic()
    for s in plain + silent:
        s.settimeout(10)
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
        assert b"HTTP/1.1" not in data  # nothing but a TLS alert, if that
        s.close()
    assert time.monotonic() - started < 8
    deadline = time.monotonic() + 5
    while open_connections(https, pki) > 1:  # the scrape's own
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert https.log()[log_before:].strip() == ""
    assert httpx.get(https.url + "/health", timeout=10, verify=trusting(pki)).status_code == 200


def test_idle_tls_connections_close_at_once_and_do_not_hold_a_stop(pki):
    """An idle keep-alive connection that the server closes (its keep-alive timeout, or a stop) waited 30 s for the
    client's close_notify, which a client's idle pool never sends: it counted as open all that while, and SIGTERM
    took 30 s where clients kept pools. With every byte acknowledged it goes at once now (apiserver/idle_close.py)."""
    with Supervise("--model", MODEL, "--ssl-certfile", pki["cert"], "--ssl-keyfile", pki["key"],
                   "--timeout-keep-alive", "1", verify=trusting(pki)) as server:
        pool = httpx.Client(verify=trusting(pki))
        assert pool.get(server.url + "/health", timeout=10).status_code == 200  # then idle in the pool
        time.sleep(1.5)  # its keep-alive timeout passed: closed by the server
        deadline = time.monotonic() + 5
        while open_connections(server, pki) > 1:  # the scrape's own
            assert time.monotonic() < deadline, "the idle connection still counts as open"
            time.sleep(0.2)
        idle = [httpx.Client(verify=trusting(pki)) for _ in range(3)]
        for client in idle:
            assert client.get(server.url + "/health", timeout=10).status_code == 200
        started = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.wait_exit(25) == 0
        assert time.monotonic() - started < 10, time.monotonic() - started
        for client in [pool, *idle]:
            client.close()


def test_a_body_refused_over_tls_is_answered_413(https, pki):
    """A body over --max-request-body-bytes is refused before it is read, and the connection closes lingering (no
    write_eof over TLS): the client still sending reads the 413."""
    context = trusting(pki)
    with socket.create_connection(https.address) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000000\r\n\r\n" + b"x" * 32768)
        tls.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = tls.recv(4096)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ")
    time.sleep(0.5)  # the close, after the answer
    assert "Traceback" not in https.log()
    text = httpx.get(https.url + "/metrics", timeout=10, verify=trusting(pki)).text
    assert 'supervise_http_requests_total{model_name="sim:5",status="5xx"} 0' in text.splitlines()


def test_mutual_tls_serves_only_clients_with_a_certificate_of_the_ca(pki):
    with Supervise("--model", MODEL, "--ssl-certfile", pki["cert"], "--ssl-keyfile", pki["key"],
                   "--ssl-ca-certs", pki["ca"], "--ssl-cert-reqs", "2",
                   verify=trusting(pki, pki["client"])) as server:
        with pytest.raises(httpx.HTTPError):  # no certificate: the handshake fails
            httpx.get(server.url + "/health", timeout=10, verify=trusting(pki))
        with_certificate = httpx.Client(verify=trusting(pki, pki["client"]))
        client = openai.OpenAI(base_url=server.base_url, api_key="none", http_client=with_certificate)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_grpc_over_tls(pki):
    server = Supervise("--model", MODEL, "--grpc", "--ssl-certfile", pki["cert"], "--ssl-keyfile", pki["key"],
                       "--timeout-request-header", "2")
    try:
        deadline = time.monotonic() + 120
        while "on grpcs://" not in server.log():
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        target = server.log().split("on grpcs://", 1)[1].split()[0]
        with open(pki["ca"], "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        with grpc.secure_channel(target, credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                               wait_for_ready=True)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            info = pb_grpc.VllmEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.served_model_name == MODEL
        with grpc.insecure_channel(target) as channel:  # plaintext gRPC to the TLS port
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        # Plain bytes from anyone: grpcio's core logged each failed handshake, a line apiece past our throttle.
        host, port = target.rsplit(":", 1)
        for _ in range(200):
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(1)
        assert server.log().count("Handshake failed") < 5, server.log()[-2000:]
        # Half a ClientHello, then nothing: closed after --timeout-request-header (grpcio's own bound was 120 s).
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"\x16\x03\x01\x02\x00\x01")
            raw.settimeout(30)
            started = time.monotonic()
            try:
                while raw.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < 10
    finally:
        server.stop()


@pytest.mark.parametrize("args, words", [
    (["--ssl-certfile", "/nonexistent.pem"], "no such file: /nonexistent.pem"),
    (["--ssl-keyfile", "{key}"], "go with --ssl-certfile"),
    (["--ssl-certfile", "{cert}"], "not a PEM certificate and its unencrypted private key"),  # the key elsewhere
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{other_key}"], "not a PEM certificate and its unencrypted"),
    (["--ssl-certfile", "{key}", "--ssl-keyfile", "{key}"], "not a PEM certificate"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{key}", "--ssl-cert-reqs", "1"],
     "--ssl-ca-certs"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{encrypted}"], "the private key is encrypted"),
], ids=["missing", "key-alone", "no-key", "other-key", "key-as-cert", "reqs-no-ca", "ca-not-pem", "encrypted"])
def test_tls_options_are_checked_before_anything_starts(pki, tmp_path, args, words):
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", pki["key"], "-aes256", "-passout", "pass:secret", "-out",
                    str(encrypted)], check=True, capture_output=True)
    files = {**pki, "encrypted": str(encrypted)}
    result = subprocess.run([SUPERVISE, "--model", MODEL, "--port", "0", *(a.format(**files) for a in args)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    assert "serving" not in result.stderr


def test_sighup_serves_a_renewed_certificate_and_keeps_serving_when_the_files_are_broken(pki, tmp_path):
    """A renewed certificate is served after `systemctl reload` (SIGHUP: a rolling restart, whose new API servers
    read the files again); a broken one is refused before anything is restarted: one line in the log, and the
    group serves on with the certificate it has."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(open(pki["cert"], "rb").read())
    key.write_bytes(open(pki["key"], "rb").read())
    ca = trustme.CA()
    context = ssl.create_default_context(cafile=pki["ca"])
    ca.configure_trust(context)  # the renewed certificate comes from another CA

    def serial_served(server: Supervise) -> set[str]:
        serials = set()
        for _ in range(6):
            with socket.create_connection(server.address) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                serials.add(tls.getpeercert()["serialNumber"])
        return serials

    with Supervise("--model", MODEL, "--api-server-count", "2", "--ssl-certfile", str(cert), "--ssl-keyfile",
                   str(key), verify=context) as server:
        (first,) = serial_served(server)
        renewed = ca.issue_cert("127.0.0.1")
        renewed.cert_chain_pems[0].write_to_path(str(cert))
        renewed.private_key_pem.write_to_path(str(key))
        server.signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while "rolling restart done" not in server.log():  # looked at often: the moment it is logged matters
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.01)
        (second,) = serial_served(server)  # no old server accepts any more
        assert second != first
        cert.write_text("not a certificate")
        server.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "SIGHUP: no rolling restart" not in server.log():
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        assert "not a PEM certificate" in server.log().split("SIGHUP: no rolling restart")[1].splitlines()[0]
        assert serial_served(server) == {second}
        assert server.log().count("rolling restart done") == 1 and "Traceback" not in server.log()
        # One copy of the files is kept, the one served: not one more per SIGHUP.
        api_server = next(c for c in server.children() if title_of(c).startswith("supervise: ApiServer_"))
        runtime_dir = runtime_dir_of(api_server)
        copies = [name for name in os.listdir(runtime_dir) if name.startswith("tls-")]
        assert [os.path.join(runtime_dir, name) for name in copies] == [os.readlink(f"{runtime_dir}/tls")], copies


def test_an_api_server_restarted_after_the_files_broke_serves_what_was_checked(pki, tmp_path):
    """The operator's files are broken after start (a renewal half written, or one SIGHUP refused), then an API
    server dies (an OOM kill, a bug). Its replacement read the broken files and died at start, again and again,
    and the restarts' budget took the whole group down. It reads the copy the supervisor checked now."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(open(pki["cert"], "rb").read())
    key.write_bytes(open(pki["key"], "rb").read())
    with Supervise("--model", MODEL, "--api-server-count", "2", "--ssl-certfile", str(cert), "--ssl-keyfile",
                   str(key), "--max-restarts", "2", verify=trusting(pki)) as server:
        cert.write_text("half written")
        victim = server.child_titled("ApiServer_0")
        victim.kill()
        deadline = time.monotonic() + 60
        while not any(c.pid != victim.pid and "ApiServer_0" in " ".join(c.cmdline()) for c in server.children()) \
                or server.log().count("ApiServer_0 ready") < 1:
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        with httpx.Client(verify=trusting(pki), limits=httpx.Limits(max_keepalive_connections=0)) as client:
            for _ in range(8):  # fresh connections: both servers answer
                assert client.get(server.url + "/health", timeout=10).status_code == 200
        assert server.proc.poll() is None and "cannot serve TLS" not in server.log()
