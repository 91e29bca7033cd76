"""Shared-secret admission for a job's processes.

torch.distributed's store has no authentication, so before the process group forms,
each process proves it knows the job secret: it publishes HMAC(secret, nonce|rank)
under its rank (first writer wins, so a late impostor cannot overwrite a genuine
proof), and every process checks all the others. A process without the secret cannot
join, and the error names the rank that failed.

Node launchers that join a running job (multi-node, a node coming back) prove the
secret the same way with `join_tag` before the job counts their machines.
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
    mine = tag(secret, nonce, rank)
    # first writer wins: a process that claims this rank later cannot overwrite our proof
    # (and make the others refuse us); one that claimed it first is named here
    got = store.compare_set(f"hetrain/auth/{rank}", "", mine).decode()
    if not hmac.compare_digest(got, mine):
        raise AuthError(f"another process claimed rank {rank} of this job first without this job's shared secret "
                        f"(or with another one); every node must use the same {SECRET_ENV} / --secret-file")
    for peer in range(world_size):
        if peer == rank:
            continue
        got = store.get(f"hetrain/auth/{peer}").decode()
        if not hmac.compare_digest(got, tag(secret, nonce, peer)):
            raise AuthError(f"rank {peer} did not present this job's shared secret; every node must use the "
                            f"same {SECRET_ENV} / --secret-file. Refusing to train with it.")


def join_tag(secret: str, nonce: str, node: int, instance: str) -> str:
    """A node launcher's proof of the job secret when it (re)joins a running job."""
    return hmac.new(secret.encode(), f"{nonce}|node|{node}|{instance}".encode(), hashlib.sha256).hexdigest()


def check_join(secret: str, nonce: str, node: int, instance: str, proof: str) -> bool:
    return hmac.compare_digest(proof, join_tag(secret, nonce, node, instance))
