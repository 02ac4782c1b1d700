"""Adapters found by entry point, so that a third-party one installs and works as ours do.

Three entry-point groups, declared in an adapter's `pyproject.toml`:

- `mersal.transports`: named by URL scheme (`amqp`), a callable taking the URL and returning a
  `Transport`; `App(transport="amqp://...")` and `MERSAL_TRANSPORT` pick it.
- `mersal.storages`: named by database URL scheme, without the driver (`postgresql` for
  `postgresql+asyncpg://...`), a callable taking the `App` and returning its `Storage`.
- `mersal.commands`: named by sub-command, a callable taking the `mersal` command's
  sub-parsers (`argparse._SubParsersAction`) and adding its commands; each command sets
  `handler=` to a function of the parsed arguments returning the exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from mersal.errors import ConfigurationError
from mersal.outbox import Storage
from mersal.transport import Transport
from mersal.transport.memory import MemoryTransport
from mersal.urls import mask

TRANSPORTS = "mersal.transports"
STORAGES = "mersal.storages"
COMMANDS = "mersal.commands"

TRANSPORT_EXTRA = "pip install 'mersal-bus[rabbitmq]' for amqp://"
STORAGE_EXTRA = "pip install 'mersal-bus[sqlalchemy]' for postgresql and sqlite"

log = logging.getLogger("mersal.plugins")


def transport_from(value: str | Transport | None) -> Transport:
    """The transport for a URL (`memory://`, `amqp://…`), an object, or `MERSAL_TRANSPORT`.

    `memory://` is built in; other schemes come from installed adapters.
    """
    if value is None:
        value = os.environ.get("MERSAL_TRANSPORT") or "memory://"
    if not isinstance(value, str):
        if not callable(getattr(value, "start", None)) or not callable(
            getattr(value, "stop", None)
        ):
            raise ConfigurationError(
                f"transport={value!r} is neither a URL ('memory://', "
                "'amqp://user:pass@host/vhost') nor a Transport object"
            )
        return value
    scheme, separator, _ = value.partition("://")
    if not separator:
        raise ConfigurationError(
            f"transport {mask(value)!r} is not a URL: use 'memory://', "
            "'amqp://user:pass@host/vhost' or pass a Transport object"
        )
    if scheme.lower() == "memory":
        return MemoryTransport(value)
    return transport_for(value, mask(value))


def transport_for(url: str, shown: str) -> Transport:
    """The transport an installed adapter makes for `url` (`shown`: the URL, password masked)."""
    scheme = url.partition("://")[0].lower()
    make: Callable[[str], Transport] = load(
        TRANSPORTS,
        scheme,
        f"transport {shown!r}",
        install=TRANSPORT_EXTRA,
        builtin=["memory"],
        suffix="://",
    )
    return make(url)


def storage_for(app: object, database: str) -> Storage:
    """The storage an installed adapter makes for `app` (the App) and its `database` URL."""
    shown = mask(database)
    scheme, separator, _ = database.partition("://")
    if not separator or not scheme.replace("+", "").isalnum():
        raise ConfigurationError(
            f"database {shown!r} is not a database URL: use "
            "'postgresql+asyncpg://user:password@host/name' or 'sqlite+aiosqlite:///file.db'"
        )
    scheme = scheme.partition("+")[0].lower()
    make: Callable[[object], Storage] = load(
        STORAGES, scheme, f"database {shown!r}", install=STORAGE_EXTRA
    )
    return make(app)


def add_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add the sub-commands of every installed adapter; one that fails is skipped, with a word.

    An adapter that is not importable (its extra is not installed) is skipped quietly; one
    that fails otherwise, or that takes a command name already there, with a warning.
    """
    for entry in sorted(_distinct(entry_points(group=COMMANDS)), key=lambda e: e.name):
        try:
            add: Callable[[argparse._SubParsersAction[Any]], None] = entry.load()
        except ImportError as error:
            log.debug("the %r commands are not available (%s)", entry.name, error)
            continue
        except Exception as error:
            log.warning("skipping the %r commands of %s: %r", entry.name, entry.value, error)
            continue
        try:
            add(commands)  # a name already taken raises (argparse: "conflicting subparser")
        except Exception as error:
            log.warning("skipping the %r commands of %s: %s", entry.name, entry.value, error)


def load(
    group: str,
    name: str,
    what: str,
    *,
    install: str,
    builtin: Sequence[str] = (),
    suffix: str = "",
) -> Any:
    """The object the entry point `name` of `group` names; a `ConfigurationError` if none can.

    `install` says how to get Mersal's own adapter; two adapters claiming one name are refused.
    """
    found = _distinct(entry for entry in entry_points(group=group) if entry.name == name)
    if not found:
        known = [*builtin, *sorted({entry.name for entry in entry_points(group=group)})]
        raise ConfigurationError(
            f"Mersal does not support {what}: no installed adapter handles {name + suffix!r} "
            f"(known: {', '.join(known_name + suffix for known_name in known) or 'none'}; "
            "Mersal's adapters are found only when Mersal is installed, `pip install -e .` for "
            f"a checkout); use one of those or install the adapter for it ({install})"
        )
    if len(found) > 1:
        raise ConfigurationError(
            f"{what}: {len(found)} installed adapters claim {name + suffix!r} "
            f"({', '.join(entry.value for entry in found)}): uninstall all but one"
        )
    return _loaded(found[0], what, install)


def _distinct(entries: Iterable[EntryPoint]) -> list[EntryPoint]:
    """One of each (name, value): a package found twice on the path counts once."""
    return list({(entry.name, entry.value): entry for entry in entries}.values())


def _loaded(entry: EntryPoint, what: str, install: str) -> Any:
    try:
        return entry.load()
    except ImportError as error:
        raise ConfigurationError(
            f"{what} needs {entry.module}, which cannot be imported ({error}): install what it "
            f"needs ({install})"
        ) from None
    except Exception as error:
        raise ConfigurationError(
            f"{what}: the adapter {entry.value} failed to load ({type(error).__name__}: "
            f"{error}): fix or uninstall it"
        ) from error
