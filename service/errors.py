"""Domain errors of the control plane, each carrying the gRPC status it maps to (docs/service.md).

The domain modules (store, jobs, ingest, policy) raise these and never import grpc; the servicers
translate them into `context.abort(code, message)`. A message always names the input it refuses.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses; `code` is the name of a grpc.StatusCode member."""

    code = "INTERNAL"


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class PermissionDenied(ServiceError):
    code = "PERMISSION_DENIED"


class Unauthenticated(ServiceError):
    code = "UNAUTHENTICATED"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class AlreadyExists(ServiceError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class WrongShard(FailedPrecondition):
    """A node this shard does not serve (service/shardmap.py): `shard` and `address` name the one that does."""

    def __init__(self, message: str, shard: str, address: str):
        super().__init__(message)
        self.shard = shard
        self.address = address
