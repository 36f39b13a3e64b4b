"""A steady streaming load that judges how each request ended, for the fault benchmark.

`streams` clients each send one greedy streaming chat after another (a closed loop: the load stays
steady while a fault slows the server, instead of piling up). Every request ends as one of:

- identical: it finished and its text is the expected one (HF `generate`'s);
- different: it finished with other text: tokens were lost, repeated or changed;
- error: the server said why it could not answer (an HTTP error body or an SSE error event);
- hung: no end within `deadline` seconds of sending it.

A connection that is refused or cut (the gateway died) is retried at once from the start, as a
client behind a load balancer would; the request counts as retried. Its stall is the longest wait
for a token beyond those it already had, so a retry that streams the first tokens again does not
count as progress.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx

from trident.bench.oracle import Chat

RETRY_PAUSE = 0.2  # seconds between attempts while the gateway is away


@dataclass
class Outcome:
    chat: int
    sent: float  # time.monotonic()
    ended: float = 0.0
    status: str = "hung"  # identical | different | error | hung
    accepted: bool = False  # an attempt got its stream opened (200)
    attempts: int = 0
    stall: float = 0.0
    error: str = ""


class _Cut(Exception):
    """The stream ended without its last chunk: the connection was cut."""


class StreamingLoad:
    def __init__(
        self,
        url: str,
        model: str,
        chats: list[Chat],
        expected: list[str],
        max_tokens: int,
        streams: int,
        deadline: float,
    ) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.model, self.chats, self.expected = model, chats, expected
        self.max_tokens, self.streams, self.deadline = max_tokens, streams, deadline
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next = 0

    # -- the run ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.streams)]
        for t in self._threads:
            t.start()

    def stop(self) -> list[Outcome]:
        """Send no more; wait for every request out there to end (each is bounded by the deadline)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline + 30)
        with self._lock:
            done, self.outcomes = self.outcomes, []
        return done

    def _client(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(10.0, read=self.deadline)) as http:
            while not self._stop.is_set():
                with self._lock:
                    index, self._next = self._next % len(self.chats), self._next + 1
                    outcome = Outcome(chat=index, sent=time.monotonic())
                    self.outcomes.append(outcome)
                self._request(http, outcome)
                outcome.ended = time.monotonic()

    # -- one request ----------------------------------------------------------------------------
    def _request(self, http: httpx.Client, out: Outcome) -> None:
        body = {
            "model": self.model,
            "messages": self.chats[out.chat].messages(),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        progress = [0, out.sent]  # tokens the client has had, and when the last new one came
        while time.monotonic() - out.sent < self.deadline:
            out.attempts += 1
            try:
                text = self._attempt(http, body, out, progress)
            except (httpx.TimeoutException, TimeoutError):
                break  # nothing for `deadline`: hung
            except (httpx.TransportError, _Cut):
                time.sleep(RETRY_PAUSE)  # refused or cut: the gateway went away; ask again
                continue
            if text is not None:
                out.status = "identical" if text == self.expected[out.chat] else "different"
            return
        out.status = "hung"

    def _attempt(self, http: httpx.Client, body: dict, out: Outcome, progress: list) -> str | None:
        """The finished text, or None when the request ended in an error (noted in `out`)."""
        with http.stream("POST", self.url, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                out.status, out.error = "error", f"{resp.status_code}: {_message(resp.text)}"
                return None
            out.accepted = True
            pieces, tokens = [], 0
            for line in resp.iter_lines():
                if time.monotonic() - out.sent > self.deadline:
                    raise TimeoutError
                if not line.startswith("data: "):
                    continue  # blank separators and `: keep-alive` comments
                if line == "data: [DONE]":
                    raise _Cut  # [DONE] before a finish_reason: only after an error event
                event = json.loads(line[6:])
                if "error" in event:
                    out.status, out.error = "error", f"stream: {_message(line[6:])}"
                    return None
                choice = event["choices"][0] if event.get("choices") else {}
                delta = choice.get("delta", {})
                if "role" not in delta and delta.get("content") is not None:
                    tokens += 1
                    pieces.append(delta["content"])
                    if tokens > progress[0]:
                        now = time.monotonic()
                        out.stall = max(out.stall, now - progress[1])
                        progress[:] = [tokens, now]
                if choice.get("finish_reason"):
                    return "".join(pieces)
        raise _Cut


def _message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return body[:200]
