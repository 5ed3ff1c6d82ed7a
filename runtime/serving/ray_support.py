"""What `tessera serve --ray` and `tessera batch --ray` share: the check that Ray is installed, and
connecting to a cluster (or starting a local one) for the length of one command.

Why a module of its own: Ray is optional (the ``serve`` extra), so nothing outside the ``--ray``
paths imports it; both paths say the same thing when it is missing and connect the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util

from tessera.runtime.errors import UsageError

RAY_MODULES = ("ray", "ray.serve", "ray.data")


def require_ray(what: str, modules: tuple[str, ...] = RAY_MODULES) -> None:
    """A UsageError naming the extra to install when Ray (or the part of it ``what`` needs) is absent."""
    try:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
    except ModuleNotFoundError:  # ray.serve's parent is missing
        missing = list(modules)
    if missing:
        raise UsageError(f"{what} needs Ray ({', '.join(missing)} not installed): pip install 'tessera[serve]' "
                         f"(it includes ray[serve,data])")


def check_reachable(address: str) -> None:
    """A UsageError at once when nothing listens at a HOST:PORT address (Ray itself retries for
    minutes before giving up); "auto" and other forms are left to Ray."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise UsageError(f"cannot reach Ray at {address}: {e.strerror or e} (start it with `ray start --head`, "
                         f"or leave out --address for a local Ray)") from None


@contextlib.contextmanager
def connected(address: str | None):
    """Ray connected for the block: ``address`` None starts a local Ray (stopped at the end); "auto"
    or "HOST:PORT" joins a running cluster (`ray start --head`); "ray://HOST:10001" is Ray Client.
    Yields whether this command started Ray itself. A driver that is already connected (tests, a
    notebook) is used as it is and left connected."""
    import ray

    if ray.is_initialized():
        yield False
        return
    if address is not None:
        check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False) if address is None else \
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise UsageError(f"cannot connect to Ray at {address!r}: {e}") from None
    try:
        yield address is None
    finally:
        ray.shutdown()
