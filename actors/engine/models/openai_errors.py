"""What an OpenAI-compatible endpoint's errors mean to the recovery policy: a refusal's status,
code and headers mapped onto the typed model errors (:mod:`bus.errors`), with how long a rate
limit asks to wait, and the endpoint's words scrubbed of anything that looks like a key.

The mapping is listed in :mod:`actors.engine.models.openai_chat`, which raises what this returns.
"""

from __future__ import annotations

import contextlib
import email.utils
import re
import time
from collections.abc import Iterator, Mapping

import openai

from bus.errors import (
    ContextLengthError,
    FatalLLMError,
    LLMError,
    RateLimitedLLMError,
    RetryableLLMError,
)

__all__ = [
    "RATE_LIMIT_CODES",
    "RETRYABLE_STATUS",
    "retry_after_s",
    "scrub",
    "sdk_errors",
    "status_error",
    "with_cause",
]

#: What looks like an API key inside an endpoint's error message (OpenAI quotes a masked one).
_KEYLIKE = re.compile(r"\b(sk|key|pk)-[A-Za-z0-9_\-*]{6,}")

#: HTTP statuses worth asking again (OpenAI's own guidance, and what its SDK retries); 429 is
#: a rate limit, its own case.
RETRYABLE_STATUS = frozenset({408, 409})

#: The provider codes of a rate-limit refusal (OpenAI's; others answer 429).
RATE_LIMIT_CODES = frozenset({"rate_limit_exceeded", "rate_limit_error"})

#: One part of a duration as OpenAI writes ``x-ratelimit-reset-*``: ``6m0s``, ``1.5s``, ``20ms``.
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_RESET_HEADERS = ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")


def with_cause(exc: BaseException) -> str:
    """The SDK's words and what is under them (its "Connection error." alone says nothing:
    refused, reset, a name that does not resolve ...)."""
    what = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) != str(exc):
        what += f" ({type(cause).__name__}: {cause})"
    return what


def scrub(text: str) -> str:
    """An endpoint's words without anything that looks like a key."""
    return _KEYLIKE.sub(r"\1-***", text)


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """How long a rate-limit refusal asks to wait, from its headers, in the order a provider
    means them: ``retry-after-ms``, ``retry-after`` (seconds or an HTTP date), the longest of
    ``x-ratelimit-reset-requests`` and ``-tokens`` (``1s``, ``6m0s``, ``20ms``). None when no
    header says (or none can be read)."""
    lower = {k.lower(): v.strip() for k, v in headers.items()}
    try:
        if "retry-after-ms" in lower:
            return max(0.0, float(lower["retry-after-ms"]) / 1000)
        if "retry-after" in lower:
            value = lower["retry-after"]
            try:
                return max(0.0, float(value))
            except ValueError:
                when = email.utils.parsedate_to_datetime(value)
                return max(0.0, when.timestamp() - time.time())
    except (ValueError, TypeError, OverflowError):
        pass
    resets = [_duration_s(lower[k]) for k in _RESET_HEADERS if k in lower]
    known = [r for r in resets if r is not None]
    return max(known) if known else None


def _duration_s(text: str) -> float | None:
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        return None
    return sum(float(n) * _SECONDS[u] for n, u in parts)


def status_error(exc: openai.APIStatusError) -> LLMError:
    what = scrub(f"HTTP {exc.status_code}: {exc.message}")
    if exc.status_code == 429 or exc.code in RATE_LIMIT_CODES:
        return RateLimitedLLMError(
            what,
            retry_after_s=retry_after_s(exc.response.headers),
            status=exc.status_code,
            code=exc.code,
            request_id=exc.request_id,
        )
    kind: type[LLMError] = FatalLLMError
    if exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500:
        kind = RetryableLLMError
    elif exc.code == "context_length_exceeded" or "context_length_exceeded" in str(exc.body):
        kind = ContextLengthError
    return kind(what, status=exc.status_code, code=exc.code, request_id=exc.request_id)


@contextlib.contextmanager
def sdk_errors() -> Iterator[None]:
    """The ``openai`` SDK's errors as the recovery policy's: a status by :func:`status_error`,
    a connection error or timeout and a reply the protocol does not allow as transient."""
    try:
        yield
    except openai.APIStatusError as exc:
        raise status_error(exc) from None
    except openai.APIConnectionError as exc:  # APITimeoutError included
        raise RetryableLLMError(scrub(with_cause(exc))) from None
    except openai.OpenAIError as exc:  # e.g. a reply that is not what the protocol says
        raise RetryableLLMError(f"{type(exc).__name__}: {scrub(str(exc))}") from None
