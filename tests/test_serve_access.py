"""Who may use the server (runtime/serve/security.py): API keys on every /v1 route (401 before the body is read,
/health and /metrics open), TLS, CORS, the start-up checks, and the warning for a server open to the network."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl

import httpx
import openai
import pytest
from servers import HANG_S, InProcessServer, metric

from k2trt.runtime.serve.security import Access, open_to_the_network

KEYS = ("first-key", "second-key", "third-key")


def client(url: str, key: str, verify=True) -> openai.OpenAI:
    http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=HANG_S, verify=verify)
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=HANG_S, http_client=http)


def status_of_raw(port: int, request: bytes) -> bytes:
    """The status line and headers a raw request gets."""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as s:
        s.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


@pytest.fixture(scope="module")
def keyed(tiny_ckpt, tiny_export):
    """A server with a key on the command line and two more in K2TRT_API_KEY (rotation)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("K2TRT_API_KEY", f"{KEYS[1]}, {KEYS[2]}")
    try:  # read once, at start
        s = InProcessServer(tiny_ckpt, tiny_export, "--api-key", KEYS[0], "--allowed-origins", "https://ok.example")
    finally:
        mp.undo()
    with s:
        yield s


def test_the_right_key_serves_every_route_with_the_official_client(keyed):
    for key in KEYS:  # the flag's and both of the environment's
        c = client(keyed.url, key)
        assert [m.id for m in c.models.list()] == ["tiny"]
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
        done = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
        assert done.usage.completion_tokens >= 1
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("headers", [
    {},  # no key
    {"authorization": "Bearer wrong-key"},
    {"authorization": "Bearer"},  # an empty bearer (a trailing space is no header value HTTP allows)
    {"authorization": f"Basic {KEYS[0]}"},  # the key under another scheme
    {"x-api-key": KEYS[0]},  # the key in another header
    {"authorization": f"Bearer {KEYS[0]}x"},
], ids=["none", "wrong", "empty", "basic", "other-header", "longer"])
def test_without_the_right_key_every_v1_route_is_401(keyed, headers, capfd):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path, kwargs in [("GET", "/v1/models", {}), ("POST", "/v1/chat/completions", {"json": body}),
                                 ("POST", "/v1/chat/completions", {"json": {**body, "stream": True}}),
                                 ("POST", "/v1/completions", {"json": {"model": "tiny", "prompt": "x"}}),
                                 ("GET", "/v1/no-such-route", {})]:
        r = httpx.request(method, keyed.url + path, headers=headers, timeout=HANG_S, **kwargs)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert not keyed.scheduler.has_work()
    assert not any(k in capfd.readouterr().err for k in KEYS)  # no key is ever written


def test_health_and_metrics_stay_open_and_401s_are_counted(keyed):
    assert httpx.get(keyed.url + "/health", timeout=HANG_S).status_code == 200
    before = metric(keyed.url, "k2trt:requests_total", '{endpoint="/v1/models",status="401"}')
    assert httpx.get(keyed.url + "/v1/models", timeout=HANG_S).status_code == 401
    assert metric(keyed.url, "k2trt:requests_total", '{endpoint="/v1/models",status="401"}') == before + 1


def test_a_request_without_a_key_is_refused_before_its_body_is_read(keyed):
    """A body declared at 1 GB, never sent: the 401 comes at once (the body limit would say 413, and only after
    reading; the handler would wait for the body)."""
    answer = status_of_raw(keyed.port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                                       b"\r\ncontent-length: 1000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401"), answer


def test_cors_preflight_from_an_allowed_origin_needs_no_key_and_a_refused_one_gets_no_grant(keyed):
    ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    ok = httpx.options(keyed.url + "/v1/chat/completions", headers={"origin": "https://ok.example", **ask},
                       timeout=HANG_S)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = httpx.options(keyed.url + "/v1/chat/completions", headers={"origin": "https://evil.example", **ask},
                            timeout=HANG_S)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # a real request from the allowed origin carries the grant; it still needs its key
    r = httpx.get(keyed.url + "/v1/models", headers={"origin": "https://ok.example",
                                                     "authorization": f"Bearer {KEYS[0]}"}, timeout=HANG_S)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"


def test_without_allowed_origins_no_origin_is_granted(tiny_ckpt, tiny_export):
    with InProcessServer(tiny_ckpt, tiny_export) as s:
        r = httpx.options(s.url + "/v1/models", headers={"origin": "https://ok.example",
                                                         "access-control-request-method": "GET"}, timeout=HANG_S)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.get(s.url + "/v1/models", headers={"origin": "https://ok.example"}, timeout=HANG_S)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# ---- TLS ------------------------------------------------------------------------------------------------------

def self_signed(tmp_path, name: str = "server"):
    """A key and a self-signed certificate for 127.0.0.1, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


def test_tls_serves_https_and_refuses_plain_http(tiny_ckpt, tiny_export, tmp_path):
    key, cert = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    with InProcessServer(tiny_ckpt, tiny_export, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                         "--api-key", KEYS[0]) as s:
        assert s.url.startswith("https://")
        assert httpx.get(s.url + "/health", verify=trust, timeout=HANG_S).status_code == 200
        c = client(s.url, KEYS[0], verify=trust)
        done = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, temperature=0)
        assert done.usage.completion_tokens >= 1
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=HANG_S)
        with pytest.raises(httpx.ConnectError):  # a certificate nobody vouches for
            httpx.get(s.url + "/health", timeout=HANG_S)


# ---- start-up ----------------------------------------------------------------------------------------------------

def test_bad_access_flags_are_one_line_before_the_model_loads(tmp_path, capsys):
    from k2trt.cli import main

    key, cert = self_signed(tmp_path)
    other_key, _ = self_signed(tmp_path, "other")
    missing = str(tmp_path / "no-model")
    cases = [
        (["--ssl-certfile", str(cert)], "both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "none.pem")], "none.pem: no such file"),
        (["--ssl-keyfile", str(tmp_path / "none.key"), "--ssl-certfile", str(cert)], "none.key: no such file"),
        (["--ssl-keyfile", str(other_key), "--ssl-certfile", str(cert)], "cannot be loaded"),
        (["--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(tmp_path / "ca.pem")],
         "--ssl-ca-certs"),
        (["--ssl-ca-certs", str(cert)], "--ssl-ca-certs needs"),
        (["--api-key", ""], "--api-key must not be empty"),
    ]
    for extra, says in cases:
        rc = main(["serve", "--model", missing, "--port", "0", *extra])
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and not cap.out, (extra, rc, cap)
        assert lines[0].startswith("k2trt serve: error:") and says in lines[0], (extra, lines)


def test_a_server_open_to_the_network_says_so_once(tmp_path, capsys):
    from k2trt.cli import main

    assert open_to_the_network("127.0.0.1", Access()) is None and open_to_the_network("localhost", Access()) is None
    assert open_to_the_network("0.0.0.0", Access(api_keys=("k",))) is None
    line = open_to_the_network("0.0.0.0", Access())
    assert line and "without --api-key" in line
    rc = main(["serve", "--model", str(tmp_path / "no-model"), "--host", "0.0.0.0", "--port", "0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and lines[0] == line and sum("warning" in x for x in lines) == 1, lines


def test_bench_serve_drives_a_server_behind_a_key(keyed, capsys, monkeypatch):
    """`bench-serve --url` sends --api-key (or $OPENAI_API_KEY) as the bearer token; without one it says what is
    missing in one line."""
    from k2trt.cli import main

    load = ["bench-serve", "--url", keyed.url, "--concurrency", "1", "--requests", "2", "--prompt-len", "4",
            "--max-tokens", "2", "--json"]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main([*load, "--api-key", KEYS[1]]) == 0
    assert '"levels"' in capsys.readouterr().out
    assert main(load) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "asks for an API key: give --api-key" in err[0], err
