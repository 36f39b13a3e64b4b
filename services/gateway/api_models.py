"""The OpenAI request bodies the gateway accepts, validated by pydantic (errors become 400s)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.protocol import SamplingParams
from common.protocol.sampling import INT32, INT64


class _Lenient(BaseModel):
    # Clients send fields we do not use (user, metadata, ...); they are accepted and ignored.
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str
    detail: str | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT32)
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension; `vllm bench serve` sends 1.0
    logprobs: bool | int | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError("only n=1 is supported; send separate requests for more choices")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; leave them at 0")
        if self.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty is not supported; leave it at 1.0")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 strings")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.requested_max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            ignore_eos=self.ignore_eos,
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> tuple[list[dict], list[str]]:
        """Messages in the chat template's shape (image parts become `{"type": "image"}`) and the
        image URLs in prompt order."""
        out, urls = [], []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            if m.content is None or isinstance(m.content, str):
                out.append({"role": role, "content": [{"type": "text", "text": m.content or ""}]})
                continue
            parts = []
            for p in m.content:
                if isinstance(p, ImagePart):
                    parts.append({"type": "image"})
                    urls.append(p.image_url.url)
                else:
                    parts.append({"type": "text", "text": p.text})
            out.append({"role": role, "content": parts})
        return out, urls


class CompletionRequest(SamplingFields):
    """`/v1/completions`: one prompt, as text or as token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT32)

    @model_validator(mode="after")
    def _one_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("only one prompt per request is supported")
            self.prompt = p[0]
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        return self
