"""Checks on a backend URL, run before anything connects or writes.

Every entry point that takes a URL (:func:`~sagaguard.idempotency.stores.open_store`,
:func:`sagaguard.saga.journals.open_journal`, the outbox relay, the CLI) calls :func:`check_url` first, so a
URL that is not a string, cannot be parsed, or leaves the database to a driver's default is a
:class:`~sagaguard.idempotency.errors.ConfigurationError` that names the problem, never a ``TypeError`` from
deep inside a driver or a silent write to libpq's default database. Messages show the URL with its
password masked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode, urlsplit

from sagaguard.idempotency.errors import ConfigurationError

__all__ = [
    "CLUSTER_SCHEMES",
    "ClusterURL",
    "check_url",
    "cluster_url",
    "driver_hint",
    "masked",
    "postgres_hosts",
]

_EXAMPLES = (
    "memory://, sqlite:///file.db, postgresql://user@host/db, redis://host:6379/0 "
    "or redis+cluster://host:7000,host:7001"
)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""The schemes of a Redis Cluster URL (``rediss+cluster``: TLS to every node)."""
# A password in the query (libpq takes ?password=...).
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&]*", re.IGNORECASE)


def masked(url: str) -> str:
    """``url`` with any password replaced by ``***``, also when the URL cannot be parsed.

    A mistyped separator (``redis//``, ``postgresql:/``) or a missing scheme must not print the
    password either, so the user information is found without the parser: everything before the
    last ``@`` (ahead of any query), after the scheme's slashes if there are any; from its first
    ``:`` on, it is masked.
    """
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    head, sep, query = url.partition("?")
    at = head.rfind("@")
    if at < 0:
        return url
    start = 0
    for marker in ("//", ":/"):  # the first one found ends the (perhaps mistyped) scheme
        found = head.find(marker)
        if 0 <= found < at:
            start = found + len(marker)
            break
    userinfo = head[start:at]
    colon = userinfo.find(":")
    if colon < 0:
        return url
    return head[: start + colon] + ":***" + head[at:] + sep + query


_EXTRAS = {"redis": "redis", "psycopg": "postgres"}
"""The extra that installs each backend driver."""


def driver_hint(exc: ImportError) -> str:
    """``pip install 'sagaguard[postgres]'`` when ``exc`` is a backend driver that is not installed
    (psycopg, redis), else ``""``."""
    extra = _EXTRAS.get((exc.name or "").split(".")[0])
    return f"pip install 'sagaguard[{extra}]'" if extra else ""


def check_url(url: object, *, what: str = "store") -> str:
    """Check a backend URL and return its scheme (lower case).

    Args:
        url: the URL as the caller gave it.
        what: what the URL is for ("store", "journal", "outbox database"), named in errors.

    Returns:
        The scheme: ``memory``, ``sqlite``, ``postgresql`` (any ``postgres`` spelling or driver),
        ``redis``, ``rediss``, ``unix``, ``redis+cluster`` or ``rediss+cluster``.

    Raises:
        ConfigurationError: ``url`` is not a string; its scheme is unknown; it cannot be parsed; a
            Postgres URL names no host or no database, or a malformed host list (see
            :func:`postgres_hosts`); a Redis URL has a bad port or database number;
            a Redis Cluster URL names no node or a database other than 0 (see :func:`cluster_url`).
    """
    if not isinstance(url, str):
        raise ConfigurationError(
            f"the {what} URL must be a string such as 'sqlite:///sagaguard.db', not {type(url).__name__}"
        )
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "memory":
        return scheme
    if scheme.startswith("sqlite"):
        _parse(url, what)
        return "sqlite"
    if scheme.startswith("postgres"):
        _check_postgres(url, what)
        return "postgresql"
    if scheme in ("redis", "rediss", "unix"):
        _check_redis(url, scheme, what)
        return scheme
    if scheme in CLUSTER_SCHEMES:
        cluster_url(url, what=what)
        return scheme
    raise ConfigurationError(f"unknown {what} URL scheme {scheme or masked(url)!r}: use {_EXAMPLES}")


def _parse(url: str, what: str) -> tuple[str | None, str | None, dict[str, list[str]]]:
    """Host, path and query of ``url``; a URL the standard parser refuses is a ConfigurationError."""
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises on a port that is not a number
    except ValueError as exc:
        # The parser's message never holds the URL; ours masks the password.
        raise ConfigurationError(f"malformed {what} URL {masked(url)!r}: {exc}") from exc
    return host, parts.path, parse_qs(parts.query)


def _check_postgres(url: str, what: str) -> None:
    host, path, query = _parse(postgres_hosts(url, what=what), what)
    _check_host_list(url, query, what)
    # Without a host or a database, libpq falls back to $PGHOST / the local socket and to a database
    # named after the user: records would land somewhere nobody chose.
    if not host and not query.get("host"):
        raise ConfigurationError(
            f"the {what} URL {masked(url)!r} names no host: use postgresql://user@host/db "
            "(or ?host=/path/to/socket for a Unix socket)"
        )
    if not (path or "").lstrip("/") and not query.get("dbname"):
        raise ConfigurationError(
            f"the {what} URL {masked(url)!r} names no database: use postgresql://user@host/db"
        )


def postgres_hosts(url: str, *, what: str = "store") -> str:
    """``url`` with a libpq multi-host list in its authority moved into the query, where SQLAlchemy
    passes it on to libpq; any other URL unchanged.

    libpq takes ``postgresql://user@host1:5432,host2:5433/db?target_session_attrs=read-write`` (try
    the hosts in order, keep the first that accepts writes: the primary after a failover), but the
    standard URL parser and SQLAlchemy read the authority as one host and one port and refuse it.
    The same list in the query, ``postgresql://user@/db?host=host1,host2&port=5432,5433&...``, is
    what libpq also accepts and SQLAlchemy hands over untouched, so that is what this returns.

    Args:
        url: a ``postgresql://`` URL (any ``postgres`` spelling or driver).
        what: what the URL is for, named in errors.

    Returns:
        The URL, its host list (if any) in the query.

    Raises:
        ConfigurationError: the list has an empty node, a node that is not ``host[:port]``, a port
            that is not a number from 1 to 65535, or the query names hosts as well.
    """
    scheme, sep, rest = url.partition("://")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    if not sep or not scheme.lower().startswith("postgres") or "," not in hosts:
        return url
    names: list[str] = []
    ports: list[str] = []
    for part in hosts.split(","):
        try:
            parsed = urlsplit("//" + part)
            host, port = parsed.hostname, parsed.port
        except ValueError as exc:
            raise ConfigurationError(f"malformed {what} URL {masked(url)!r}: {exc}") from exc
        if not host or parsed.path or parsed.username is not None or parsed.query:
            raise ConfigurationError(
                f"the {what} URL {masked(url)!r} has a malformed host {part!r} in its list: "
                "use host:port,host:port"
            )
        names.append(host)  # an IPv6 address without its brackets, as libpq's host= wants it
        ports.append(str(port if port is not None else 5432))
    path, _, query = tail.partition("?")
    if "host" in parse_qs(query) or "port" in parse_qs(query):
        raise ConfigurationError(
            f"the {what} URL {masked(url)!r} lists hosts both before the path and in its query"
        )
    extra = urlencode({"host": ",".join(names), "port": ",".join(ports)}, safe=",:")
    return f"{scheme}://{userinfo}{at}{path or '/'}?{extra}" + (f"&{query}" if query else "")


def _check_host_list(url: str, query: dict[str, list[str]], what: str) -> None:
    """A ``?host=a,b&port=1,2`` list in the query: ports are numbers, one for all hosts or one each
    (libpq's rule; otherwise it fails at the first connect, which would read as an outage)."""
    hosts = ",".join(query.get("host", [])).split(",") if query.get("host") else []
    ports = ",".join(query.get("port", [])).split(",") if query.get("port") else []
    if any(not h for h in hosts):
        raise ConfigurationError(f"the {what} URL {masked(url)!r} has an empty host in its list")
    for port in ports:
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigurationError(
                f"the {what} URL {masked(url)!r}: port {port!r} is not a number from 1 to 65535"
            )
    if hosts and len(ports) > 1 and len(ports) != len(hosts):
        raise ConfigurationError(
            f"the {what} URL {masked(url)!r} names {len(hosts)} hosts and {len(ports)} ports: "
            "give one port for all of them or one for each"
        )


def _check_redis(url: str, scheme: str, what: str) -> None:
    host, path, query = _parse(url, what)
    if scheme == "unix":
        if not path:
            raise ConfigurationError(
                f"the {what} URL {masked(url)!r} names no socket: use unix:///path/redis.sock"
            )
        db = query.get("db", ["0"])[0]
    else:
        if not host:
            raise ConfigurationError(f"the {what} URL {masked(url)!r} names no host: use redis://host:6379/0")
        db = (path or "/").lstrip("/") or query.get("db", ["0"])[0]
    if not db.isdigit():
        raise ConfigurationError(f"the {what} URL {masked(url)!r}: the database must be a number, not {db!r}")


@dataclass(frozen=True)
class ClusterURL:
    """A Redis Cluster URL taken apart: the nodes to discover the cluster from, and one plain Redis
    URL that carries the connection options (credentials, TLS, query parameters) every node shares.

    Attributes:
        nodes: ``(host, port)`` of each node the URL lists, in its order (port 6379 when omitted).
        node_url: ``redis://`` (or ``rediss://``) with the URL's user information and query, its
            first node, and database 0.
    """

    nodes: tuple[tuple[str, int], ...]
    node_url: str


def cluster_url(url: str, *, what: str = "store") -> ClusterURL:
    """Take a ``redis+cluster://[user:password@]host:port[,host:port...][/][?option=value...]`` URL
    apart (``rediss+cluster://`` for TLS).

    Any node of the cluster is enough to discover the others; listing more lets a client start
    while some of them are down. A cluster has only database 0, so the path is empty, ``/`` or ``/0``.

    Args:
        url: the URL.
        what: what the URL is for, named in errors.

    Returns:
        The nodes and the plain URL of the options they share.

    Raises:
        ConfigurationError: the scheme is not a cluster scheme, a node is empty or has a port that
            is not a number from 1 to 65535, or the path names a database other than 0.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ConfigurationError(
            f"not a Redis Cluster URL: {masked(url)!r} (use redis+cluster://host:port,...)"
        )
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    path, _, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        try:
            parsed = urlsplit("//" + part)
            host, port = parsed.hostname, parsed.port
        except ValueError as exc:
            raise ConfigurationError(f"malformed {what} URL {masked(url)!r}: {exc}") from exc
        if not host or parsed.path or parsed.username is not None:
            raise ConfigurationError(
                f"the {what} URL {masked(url)!r} has a malformed node {part!r}: use host:port"
            )
        nodes.append((host, port if port is not None else 6379))
    if path.strip("/") not in ("", "0"):
        raise ConfigurationError(
            f"the {what} URL {masked(url)!r}: a Redis Cluster has only database 0, not {path.strip('/')!r}"
        )
    plain = "rediss" if scheme.lower() == "rediss+cluster" else "redis"
    first = hosts.split(",")[0]
    node_url = f"{plain}://{userinfo}{at}{first}/0" + (f"?{query}" if query else "")
    return ClusterURL(tuple(nodes), node_url)
