"""Who may use the server: API keys, TLS and browser origins, as vLLM has them (`--api-key`, `--ssl-keyfile` /
`--ssl-certfile` / `--ssl-ca-certs`, `--allowed-origins`).

- With keys, every /v1 route answers a request that does not carry `Authorization: Bearer <one of them>` with 401
  and OpenAI's error object, before its body is read or anything is queued; /health and /metrics stay open (a
  monitor reads them; close /metrics behind a proxy where that matters). Keys are compared in constant time
  (`hmac.compare_digest`, every key, no early exit) and never written anywhere.
- TLS is uvicorn's; the files are loaded once at start-up, before the model, so a missing or unreadable one is one
  line, not a failure after minutes of loading.
- CORS is Starlette's middleware, outermost, so a browser's preflight is answered without a key; no origin is
  allowed unless named (`*` names them all).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass, field

from k2trt.errors import K2Error

API_KEY_ENV = "K2TRT_API_KEY"  # comma-separated keys, besides --api-key (vLLM reads VLLM_API_KEY)


@dataclass(frozen=True)
class Access:
    """What the server asks of a client: `api_keys` (none: open), and which browser origins may call it."""
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("GET", "POST")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type")
    tls: dict = field(default_factory=dict)  # uvicorn.Config's ssl_* arguments, checked


def _listed(values: list[str] | None) -> tuple[str, ...]:
    """Repeated and comma-separated flag values, in order, blanks dropped."""
    return tuple(v.strip() for value in values or [] for v in value.split(",") if v.strip())


def api_keys(flags: list[str] | None, environ=os.environ) -> tuple[str, ...]:
    """--api-key (repeatable, for rotation) and K2TRT_API_KEY (comma-separated), together."""
    given = [*(flags or []), *([environ[API_KEY_ENV]] if environ.get(API_KEY_ENV) else [])]
    if any(not k.strip() for k in flags or []):
        raise K2Error("--api-key must not be empty")
    return _listed(given)


def tls_settings(keyfile: str | None, certfile: str | None, ca_certs: str | None) -> dict:
    """uvicorn's ssl_* arguments, after loading the files as uvicorn will: a missing, unreadable or mismatched
    file is one line now."""
    if keyfile is None and certfile is None:
        if ca_certs is not None:
            raise K2Error("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return {}
    if keyfile is None or certfile is None:
        raise K2Error("TLS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise K2Error(f"{flag} {path}: no such file")
        if path is not None and not os.access(path, os.R_OK):
            raise K2Error(f"{flag} {path}: cannot be read")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise K2Error(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: cannot be loaded "
                      f"({getattr(e, 'reason', None) or e.strerror or e})") from None
    settings = {"ssl_keyfile": keyfile, "ssl_certfile": certfile}
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise K2Error(f"--ssl-ca-certs {ca_certs}: cannot be loaded "
                          f"({getattr(e, 'reason', None) or e.strerror or e})") from None
        settings |= {"ssl_ca_certs": ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}  # clients must show a cert
    return settings


def access_from_args(args, environ=os.environ) -> Access:
    return Access(api_keys(args.api_key, environ), _listed(args.allowed_origins),
                  _listed(args.allowed_methods) or Access.allowed_methods,
                  _listed(args.allowed_headers) or Access.allowed_headers,
                  tls_settings(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs))


def open_to_the_network(host: str, access: Access) -> str | None:
    """The warning line for a server without keys on an address other machines reach, else None."""
    if access.api_keys:
        return None
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
            return None
    except (socket.gaierror, ValueError):
        pass  # check_listen says what is wrong with the host
    return (f"k2trt serve: warning: listening on {host} without --api-key: anyone who can reach this port can use "
            "the model")


class RequireApiKey:
    """ASGI middleware: a /v1 request without `Authorization: Bearer <key>` of one of `keys` is answered 401 before
    the app (or its body) is touched."""

    def __init__(self, app, keys: tuple[str, ...], refuse):
        self.app, self.keys, self.refuse = app, tuple(k.encode() for k in keys), refuse

    def _allowed(self, header: bytes | None) -> bool:
        scheme, _, token = (header or b"").partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        ok = False
        for key in self.keys:  # every key compared, whichever matches: the time says nothing of which
            ok |= hmac.compare_digest(token, key)
        return ok and bool(token)

    async def __call__(self, scope, receive, send):
        # a browser's preflight never gets here: the CORS middleware outside answers it
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope.get("headers") or [])
            if not self._allowed(headers.get(b"authorization")):
                return await self.refuse(scope, receive, send)
        return await self.app(scope, receive, send)
