"""A Redis 7 ACL user restricted to one queue, as docs/protocol.md documents it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def queue_user(server, user: str, queue: str, prefix: str = "emq") -> Iterator[str]:
    """The user, with the URL that connects as it; deleted at the end."""
    admin = server.client()
    tag = f"{{{prefix}:{queue}}}:*"
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", f"~{tag}", f"&{tag}",
                          "+@all", "-@dangerous", "+function")
    try:
        yield f"redis://{user}:pw@127.0.0.1:{server.port}/0"
    finally:
        admin.execute_command("ACL", "DELUSER", user)
