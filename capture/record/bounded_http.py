"""GETs of a server's HTTP endpoints that may answer anything: capped in bytes and in time.

`kvscope record` (often root) reads the recorded server's /metrics and /v1/models; an endless
or slow-dripping answer must cost it a line in the recording's notes, not its memory or its
Ctrl-C.
"""

from __future__ import annotations

import time
import urllib.request

READ_STEP = 1 << 16


class AnswerRefused(ValueError):
    """An answer over its size cap or not complete within its time."""


def get(url: str, max_bytes: int, timeout_s: float = 10.0) -> bytes:
    """The body of `url`; AnswerRefused past `max_bytes` or `timeout_s` in all, OSError as
    urllib raises it."""
    deadline = time.monotonic() + timeout_s
    body = bytearray()
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        while chunk := response.read1(READ_STEP):
            body += chunk
            if len(body) > max_bytes:
                raise AnswerRefused(f"{url} answered more than {max_bytes} bytes; not read")
            if time.monotonic() > deadline:
                raise AnswerRefused(f"{url} did not finish its answer within {timeout_s:g} s")
    return bytes(body)
