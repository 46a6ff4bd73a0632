"""Who may call what: per-role credentials (bearer tokens, client-certificate CNs) and the TLS set-up.

Roles (least privilege, docs/service.md):
- `collector`: Telemetry.StreamSweeps only, for the node named by its subject (`collector:node-17`), or
  for every node with the explicit wildcard `collector:*`.
- `job`: the Jobs calls of its own job (subject = job id; `job:*` for a scheduler acting for every job):
  register, report steps, deregister, watch and acknowledge its directives, list them.
  These two roles need a subject: a bare `collector` or `job` is refused where it is read (token file,
  certificate CN), never taken as the wildcard, so a forgotten subject cannot grant every node or job.
- `operator`: everything in Risk and Jobs, including CancelDirective, DrainNode and listing every job.
- `shard`: Coordinator.ForwardAlarms only, for the shard named by its subject (`shard:leaf-group-3`): a
  scoring shard forwarding its alarms to the jobs coordinator (service/coordinator.py).
Health checking and server reflection are open (probes and grpcurl need no secret; they reveal no data).

A caller is identified by `authorization: Bearer <token>` metadata (tokens are compared by their
SHA-256, never stored in the clear after loading), or else by the CN of a verified client certificate
(mutual TLS) of the form `role` or `role:subject`, e.g. `collector:node-17`, `job:llama-70b`.
Insecure loopback mode (tests, the demo) grants every role to unauthenticated callers and says so.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from foreshock.ratelimit import LogLimiter
from foreshock.service.errors import InvalidArgument

log = logging.getLogger(__name__)

ROLES = ("collector", "job", "operator", "shard")
SCOPED_ROLES = frozenset({"collector", "job", "shard"})   # act for the node / job / shard of their subject only
WILDCARD = "*"                                   # the subject that acts for every node / job
PACKAGE = "/foreshock.v1."

# Method -> roles that may call it. Methods outside foreshock.v1 (health, reflection) are open.
PERMISSIONS: dict[str, frozenset[str]] = {
    "/foreshock.v1.Telemetry/StreamSweeps": frozenset({"collector"}),
    "/foreshock.v1.Risk/GetNodeRisk": frozenset({"operator"}),
    "/foreshock.v1.Risk/ListRiskiest": frozenset({"operator"}),
    "/foreshock.v1.Risk/WatchRisk": frozenset({"operator"}),
    "/foreshock.v1.Jobs/RegisterJob": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/ReportStep": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/ReportStepTimes": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/DeregisterJob": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/WatchDirectives": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/AckDirective": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/ListDirectives": frozenset({"job", "operator"}),
    "/foreshock.v1.Jobs/CancelDirective": frozenset({"operator"}),
    "/foreshock.v1.Jobs/DrainNode": frozenset({"operator"}),
    "/foreshock.v1.Coordinator/ForwardAlarms": frozenset({"shard"}),
}


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the roles it holds and what it acts for (a node, a job, a person)."""

    roles: frozenset[str]
    subject: str = ""          # the node, job or person; WILDCARD: every node / job (SCOPED_ROLES)
    via: str = "token"         # token | certificate | insecure-loopback

    def __post_init__(self):
        if self.roles & SCOPED_ROLES and not self.subject:
            raise InvalidArgument(f"role {'/'.join(sorted(self.roles & SCOPED_ROLES))} needs a subject: "
                                  f"role:<node or job>, or role:{WILDCARD} for every one")

    def may(self, method: str) -> bool:
        allowed = PERMISSIONS.get(method)
        return allowed is None or bool(self.roles & allowed)

    def may_act_for_job(self, job_id: str) -> bool:
        if "operator" in self.roles:
            return True
        return "job" in self.roles and self.subject in (WILDCARD, job_id)

    def may_report_node(self, node: str) -> bool:
        return "collector" in self.roles and self.subject in (WILDCARD, node)

    def may_forward_for(self, shard: str) -> bool:
        return "shard" in self.roles and self.subject in (WILDCARD, shard)

    @property
    def is_operator(self) -> bool:
        return "operator" in self.roles


INSECURE = Principal(frozenset(ROLES), WILDCARD, "insecure-loopback")


def parse_identity(spec: str) -> Principal:
    """`role` or `role:subject` -> Principal (used for token files and certificate CNs)."""
    role, _, subject = spec.strip().partition(":")
    if role not in ROLES:
        raise InvalidArgument(f"credential {spec!r}: role {role!r} is not one of {', '.join(ROLES)}")
    try:
        return Principal(frozenset({role}), subject)
    except InvalidArgument as exc:
        raise InvalidArgument(f"credential {spec!r}: {exc}") from None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def load_token_file(path: str | Path) -> dict[str, Principal]:
    """A token file: one `role[:subject] TOKEN` per line; `#` comments. Tokens shorter than 16 refused."""
    path = Path(path)
    out: dict[str, Principal] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"token file {path}: {exc.strerror}") from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InvalidArgument(f"token file {path} line {n}: expected `role[:subject] TOKEN`")
        identity, token = parts
        if len(token) < 16:
            raise InvalidArgument(f"token file {path} line {n}: token shorter than 16 characters")
        try:
            out[token] = parse_identity(identity)
        except InvalidArgument as exc:
            raise InvalidArgument(f"token file {path} line {n}: {exc}") from None
    return out


class Authenticator:
    """Maps a call's metadata and peer certificate to a Principal (or None: unauthenticated)."""

    def __init__(self, tokens: Mapping[str, Principal] | None = None, *, insecure: bool = False,
                 trust_client_cn: bool = True):
        self._tokens = {_digest(t): p for t, p in (tokens or {}).items()}
        self.insecure = insecure
        self.trust_client_cn = trust_client_cn
        self._refused_cn = LogLimiter(log)

    def principal(self, context) -> Principal | None:
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                scheme, _, token = str(value).partition(" ")
                if scheme.lower() == "bearer" and token:
                    found = self._tokens.get(_digest(token.strip()))
                    if found is not None:
                        return found
                return None  # a credential was offered and it is wrong: never fall back
        if self.trust_client_cn:
            try:
                auth = context.auth_context() or {}
            except Exception:
                auth = {}
            cns = auth.get("x509_common_name") or []
            if cns:
                cn = cns[0].decode() if isinstance(cns[0], bytes) else str(cns[0])
                try:
                    p = parse_identity(cn)
                    return Principal(p.roles, p.subject, "certificate")
                except InvalidArgument as exc:
                    self._refused_cn.warning(cn, "client certificate refused: %s", exc)
                    return None
        if self.insecure:
            return INSECURE
        return None


def _wrap(handler, check):
    """The same handler with an authorisation check run first, for each of the four call shapes."""
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            await check(context)
            return await inner(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            await check(context)
            async for item in inner_us(request, context):
                yield item
        return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(request_iterator, context):
            await check(context)
            return await inner_su(request_iterator, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                    handler.response_serializer)
    inner_ss = handler.stream_stream
    if inspect.iscoroutinefunction(inner_ss):
        # A handler on context.read()/write() (StreamSweeps): no generator layer per message.
        async def stream_stream_rw(request_iterator, context):
            await check(context)
            await inner_ss(request_iterator, context)
        return grpc.stream_stream_rpc_method_handler(stream_stream_rw, handler.request_deserializer,
                                                     handler.response_serializer)

    async def stream_stream(request_iterator, context):
        await check(context)
        async for item in inner_ss(request_iterator, context):
            yield item
    return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer,
                                                 handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to foreshock.v1 methods without a credential (UNAUTHENTICATED) or the role
    (PERMISSION_DENIED) before the servicer runs; the servicers then check job and node scope."""

    def __init__(self, authenticator: Authenticator):
        self.authenticator = authenticator

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(PACKAGE):
            return handler
        authenticator = self.authenticator

        async def check(context):
            principal = authenticator.principal(context)
            if principal is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    f"{method}: no valid credential (bearer token or client certificate)")
            if not principal.may(method):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{method}: role {'/'.join(sorted(principal.roles))} may not call it")
        return _wrap(handler, check)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None) -> grpc.ServerCredentials:
    """TLS (server certificate) or, with a client CA, mutual TLS that requires a client certificate."""
    def read(path, what):
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"{what} {path}: {exc.strerror}") from None
    cert, key = read(cert_file, "TLS certificate"), read(key_file, "TLS key")
    ca = read(client_ca_file, "client CA") if client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def tokens_from(specs: Iterable[str]) -> dict[str, Principal]:
    """`role[:subject]=TOKEN` strings (flags, config) -> token table."""
    out = {}
    for spec in specs:
        identity, sep, token = spec.partition("=")
        if not sep or len(token) < 16:
            raise InvalidArgument(f"token {identity!r}: expected role[:subject]=TOKEN with a token of >= 16 characters")
        out[token] = parse_identity(identity)
    return out
