"""API keys: who may use the router's front doors.

With ``router.api_keys_file`` set, every gRPC call except health checking must
carry ``authorization: Bearer KEY`` in its metadata, and every HTTP request to
``/v1/...`` the ``Authorization: Bearer KEY`` header (what the OpenAI SDK sends
for ``api_key``). A call without a valid key ends with ``UNAUTHENTICATED`` (gRPC)
or 401 (HTTP) and a sentence, before the router does any work for it.

- **The file**: one key per line; blank lines and lines starting with ``#`` are
  ignored. ``ApiKeys`` owns the keys in memory (only their SHA-256 digests) and
  reloads the file when it changes (checked every ``poll_s``) or on ``reload()``
  (SIGHUP in ``splitserve serve``). A reload that cannot read the file keeps the
  keys it had and logs why; a file with no keys locks everyone out, as it says.
- **Constant time**: a presented key is hashed and compared with every known
  digest by ``hmac.compare_digest``, all of them, whichever matches; neither the
  key's length nor which key matched changes the work done.
- **Never shown**: keys and presented tokens appear in no log line, trace,
  metric or status (log lines name the file and the number of keys only).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web

log = logging.getLogger(__name__)

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)  # load balancers' probes need no key
UNAUTHENTICATED_MESSAGE = (
    "this server requires an API key: send 'authorization: Bearer <key>' "
    "(the SDK's api_key=, the CLI's --api-key, or SPLITSERVE_API_KEY)"
)
INVALID_KEY_MESSAGE = "the API key is not valid for this server"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _digests_in(path: str | Path) -> frozenset[bytes]:
    """The digests of the keys in ``path`` (maybe none). Raises ``ValueError`` with a
    sentence when it cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the API keys file {path}: {e.__class__.__name__}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return frozenset(_digest(k) for k in keys)


def read_keys(path: str | Path) -> frozenset[bytes]:
    """The digests of the keys in ``path``. Raises ``ValueError`` with a sentence when it
    cannot be read or holds no key."""
    digests = _digests_in(path)
    if not digests:
        raise ValueError(f"the API keys file {path} holds no key (one per line)")
    return digests


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` value (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class ApiKeys:
    """The valid keys, reloaded when the file changes. One owner: the cluster."""

    def __init__(self, path: str | Path, poll_s: float = 1.0):
        self.path = Path(path)
        self.poll_s = poll_s
        self._digests = read_keys(self.path)  # a bad file at start-up is a start-up error
        self._stamp = self._file_stamp()
        log.info("API keys: %d loaded from %s", len(self._digests), self.path)

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, token: str | None) -> bool:
        """Whether ``token`` is one of the keys, in constant time (see the module docstring)."""
        presented = _digest(token or "")
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(presented, digest)
        return ok and token is not None

    def reload(self) -> bool:
        """Read the file again; returns whether the keys now in use came from it."""
        self._stamp = self._file_stamp()
        try:
            self._digests = _digests_in(self.path)
        except ValueError as e:
            log.error("API keys: %s; keeping the %d keys in use", e, len(self._digests))
            return False
        if self._digests:
            log.info("API keys: %d loaded from %s", len(self._digests), self.path)
        else:
            log.warning("API keys: %s holds no key; every call is refused until one is added", self.path)
        return True

    def reload_if_changed(self) -> None:
        if self._file_stamp() != self._stamp:
            self.reload()

    async def watch(self) -> None:
        """Reload whenever the file changes (its mtime, size or inode), until cancelled."""
        while True:
            await asyncio.sleep(self.poll_s)
            self.reload_if_changed()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        return None


def _refusal(token: str | None) -> str:
    return UNAUTHENTICATED_MESSAGE if token is None else INVALID_KEY_MESSAGE


class GrpcAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checking without a valid key, before its handler runs."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        token = bearer_token(header if isinstance(header, str) else None)
        if self.keys.check(token):
            return handler
        return _refusing_handler(handler, _refusal(token))


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached; makes this an async generator, as a streaming handler is

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, des, ser)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, des, ser)


def http_auth_middleware(keys: ApiKeys, error_body: Callable[[str], dict]) -> Callable:
    """An aiohttp middleware requiring a valid key on ``/v1/...``, ``/tokenize`` and
    ``/detokenize`` (``/health``, ``/version`` and ``/metrics`` stay open);
    ``error_body(message)`` shapes the 401's JSON."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable):
        if request.path.startswith("/v1/") or request.path in ("/tokenize", "/detokenize"):
            token = bearer_token(request.headers.get("Authorization"))
            if not keys.check(token):
                return web.json_response(
                    error_body(_refusal(token)), status=401, headers={"WWW-Authenticate": "Bearer"}
                )
        return await handler(request)

    return middleware
