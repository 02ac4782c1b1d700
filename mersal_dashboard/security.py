"""Who may change things on the dashboard: the token, sessions, and cross-site request checks.

Looking needs nothing (bind the dashboard where only operators reach it: 127.0.0.1 by
default). Every action needs the token, given once on the sign-in page (a session cookie,
HttpOnly and SameSite=Strict, follows) or as `Authorization: Bearer <token>`, and a form from
the dashboard itself: its CSRF field must match the session, and a browser's Origin or
Sec-Fetch-Site header must not name another site. Without a token the dashboard is read-only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from mersal.errors import ConfigurationError

COOKIE = "mersal_dashboard"
"""The session cookie's name."""

TOKEN_VARIABLE = "MERSAL_DASHBOARD_TOKEN"
"""The environment variable `mersal dashboard` reads the token from when --token is not given."""

MIN_TOKEN = 16
"""The fewest characters a token may have: a short one can be guessed."""


def checked_token(token: str | None) -> str | None:
    """The token as given, or a ConfigurationError saying why it will not do."""
    if token is None or token == "":
        return None
    if len(token) < MIN_TOKEN or token.strip() != token:
        raise ConfigurationError(
            f"the dashboard's token must have at least {MIN_TOKEN} characters and no spaces at "
            "its ends: make one with `python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )
    return token


@dataclass
class Guard:
    """The token's keeper: signs sessions in, checks the session and CSRF field of an action."""

    token: str | None
    read_only: bool = False
    _secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    _sessions: set[str] = field(default_factory=set, repr=False)

    @property
    def actions_allowed(self) -> bool:
        """Whether anything may be changed at all (a token, and not read-only)."""
        return self.token is not None and not self.read_only

    def token_matches(self, given: str) -> bool:
        """Whether `given` is the token (compared in constant time)."""
        if self.token is None:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    def sign_in(self) -> str:
        """A new session's cookie value."""
        session = secrets.token_urlsafe(24)
        self._sessions.add(session)
        return f"{session}.{self._sign(session, 'session')}"

    def sign_out(self, cookie: str | None) -> None:
        """End the session of `cookie`, if it is one."""
        session = self.session_of(cookie)
        if session is not None:
            self._sessions.discard(session)

    def session_of(self, cookie: str | None) -> str | None:
        """The session a cookie value stands for, if it is a live one signed here."""
        if not cookie or "." not in cookie:
            return None
        session, _, signature = cookie.partition(".")
        if not hmac.compare_digest(signature, self._sign(session, "session")):
            return None
        return session if session in self._sessions else None

    def csrf_of(self, session: str | None) -> str:
        """The CSRF field the forms of `session` carry (empty without a session)."""
        return "" if session is None else self._sign(session, "csrf")

    def refusal(
        self,
        *,
        cookie: str | None,
        authorization: str | None,
        csrf: str | None,
        origin: str | None,
        fetch_site: str | None,
        own_origin: str,
    ) -> str | None:
        """Why an action may not run, or None when it may."""
        if self.token is None:
            return "this dashboard is read-only: it was started without a token (--token)"
        if self.read_only:
            return "this dashboard is read-only (--read-only)"
        if fetch_site is not None and fetch_site not in ("same-origin", "none"):
            return "refused: the request came from another site"
        if origin is not None and origin != own_origin:
            return "refused: the request came from another site"
        if authorization is not None and authorization.startswith("Bearer "):
            if self.token_matches(authorization.removeprefix("Bearer ")):
                return None
            return "refused: the token is wrong"
        session = self.session_of(cookie)
        if session is None:
            return "sign in with the dashboard's token to do this"
        if not csrf or not hmac.compare_digest(csrf, self.csrf_of(session)):
            return "refused: the form did not come from this dashboard (reload the page)"
        return None

    def _sign(self, value: str, purpose: str) -> str:
        message = f"{purpose}:{value}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()
