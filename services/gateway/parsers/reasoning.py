"""`<think>…</think>` reasoning (DeepSeek-R1 and Qwen3 styles; Seed-OSS with its own tags).

- deepseek_r1: the template may already have opened `<think>` in the prompt, so output is
  reasoning from its start (an optional leading `<think>` is dropped) until `</think>`;
  without `</think>` all of it is reasoning.
- qwen3: reasoning only inside a leading `<think>…</think>` (leading whitespace allowed);
  output that does not start with `<think>` is all content (thinking disabled). An
  unclosed `<think>` (cut by max_tokens) leaves the rest as reasoning.
- seed_oss: `<seed:think>…</seed:think>`, read as deepseek_r1 reads its tags (as vLLM does: the
  output is reasoning from its start, an optional leading `<seed:think>` dropped).
Text after the end tag is content, verbatim."""
from __future__ import annotations

from services.gateway.parsers.base import ReasoningParser, held_prefix_len

START, END = "<think>", "</think>"


class ThinkReasoningParser(ReasoningParser):
    def __init__(self, starts_in_reasoning: bool, start: str = START, end: str = END) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.start, self.end = start, end
        self._state = "start"   # start -> reasoning -> content, or start -> content
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if self.start.startswith(head):        # empty, whitespace or a partial "<think>"
                return "", ""
            if head.startswith(self.start):
                self._buf, self._state = head[len(self.start):], "reasoning"
            elif self.starts_in_reasoning:
                self._state = "reasoning"
            else:
                self._state = "content"
        if self._state == "content":
            out, self._buf = self._buf, ""
            return "", out
        end = self._buf.find(self.end)
        if end >= 0:
            reasoning, rest = self._buf[:end], self._buf[end + len(self.end):]
            self._buf, self._state = "", "content"
            return reasoning, rest
        keep = held_prefix_len(self._buf, self.end)
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "start" and self.starts_in_reasoning):
            return buf, ""
        return "", buf

    def parse(self, text: str) -> tuple[str, str]:
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return "", text
        end = body.find(self.end)
        if end < 0:
            return body, ""
        return body[:end], body[end + len(self.end):]


def deepseek_r1() -> ThinkReasoningParser:
    return ThinkReasoningParser(starts_in_reasoning=True)


def qwen3() -> ThinkReasoningParser:
    return ThinkReasoningParser(starts_in_reasoning=False)


def seed_oss() -> ThinkReasoningParser:
    return ThinkReasoningParser(starts_in_reasoning=True, start="<seed:think>", end="</seed:think>")
