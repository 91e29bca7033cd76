"""Shared-secret admission for a job's processes.

torch.distributed's store has no authentication, so before the process group forms,
each process proves it knows the job secret: it publishes HMAC(secret, nonce|rank)
under its rank, and every process checks all the others. A process without the
secret cannot join, and the error names the rank that failed.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from datetime import timedelta

from ..errors import UserError

SECRET_ENV = "HETRAIN_SECRET"


class AuthError(RuntimeError):
    """A peer did not present the job's shared secret."""


def new_secret() -> str:
    return secrets.token_hex(16)


def load_secret(explicit: str | None = None, path: str | None = None) -> str:
    if explicit:
        return explicit
    if path:
        with open(path) as fh:
            secret = fh.read().strip()
        if len(secret) < 16:
            raise UserError(f"secret file {path} holds fewer than 16 characters; use e.g. `openssl rand -hex 16 > {path}`")
        return secret
    env = os.environ.get(SECRET_ENV)
    if env:
        return env
    raise UserError(f"no job secret: set {SECRET_ENV} or pass --secret-file (the same on every node)")


def tag(secret: str, nonce: str, rank: int) -> str:
    return hmac.new(secret.encode(), f"{nonce}|{rank}".encode(), hashlib.sha256).hexdigest()


def admit(store, secret: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Publish this rank's proof and verify every other rank's (raises AuthError)."""
    store.set_timeout(timedelta(seconds=timeout_s))
    nonce = store.get("hetrain/nonce").decode()
    store.set(f"hetrain/auth/{rank}", tag(secret, nonce, rank))
    for peer in range(world_size):
        if peer == rank:
            continue
        got = store.get(f"hetrain/auth/{peer}").decode()
        if not hmac.compare_digest(got, tag(secret, nonce, peer)):
            raise AuthError(f"rank {peer} did not present this job's shared secret; every node must use the "
                            f"same {SECRET_ENV} / --secret-file. Refusing to train with it.")
