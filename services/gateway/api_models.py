"""The OpenAI request bodies the gateway accepts, validated by pydantic (errors become 400s)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from common.errors import clip
from common.protocol import SamplingParams
from common.protocol.sampling import INT32, INT64, TokenId

# Numbers as the OpenAI API takes them: a JSON number, never a string ("12") or a boolean; an
# integer field takes no 12.0 either. (pydantic's lax mode would accept all three.)
Int = Annotated[int, Strict()]
Finite = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # NaN and ±inf name their own error


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


class VideoURL(_Lenient):
    url: str


class VideoPart(_Lenient):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class VideoControls(BaseModel):
    """How a request's clips are sampled (`mm_processor_kwargs`, vLLM's name for them); the
    server's defaults where absent, within its caps."""

    model_config = ConfigDict(extra="forbid")  # a key we do not honour is named, not ignored
    fps: Finite | None = Field(None, gt=0.0)
    max_frames: Int | None = Field(None, ge=2, le=INT32)


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions. A field the engine's sampler does not honour
    is refused when set (400 naming it), never accepted and ignored; null or absent is fine."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = Field(None, ge=1, le=INT32)
    temperature: Finite = Field(1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=0, le=INT32)
    seed: Int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[TokenId, Strict()]] | None = (
        None  # vLLM's extension; the engine stops on them
    )
    n: Int = 1
    ignore_eos: bool = False
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    repetition_penalty: Finite = 1.0  # vLLM's extension; `vllm bench serve` sends 1.0
    logprobs: Annotated[bool, Strict()] | Int | None = None
    # OpenAI's and vLLM's sampling fields the engine does not implement: refused unless neutral.
    logit_bias: dict[str, Any] | None = None
    top_logprobs: Int | None = None
    min_p: Finite = 0.0
    min_tokens: Int = 0
    best_of: Int | None = None
    use_beam_search: bool = False
    length_penalty: Finite = 1.0
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Every string (and key) in the body must be valid Unicode: a lone UTF-16 surrogate such as
        "\\ud800" parses as JSON but cannot be encoded, tokenised or logged."""
        if (path := _invalid_unicode(data)) is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                "not valid Unicode; send the text as valid UTF-8",
                {"param": path},
            )
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send separate requests for more choices")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value:
            raise ValueError("presence_penalty and frequency_penalty are not supported; leave them at 0")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("stop takes at most 4 strings")
        return stop

    @model_validator(mode="after")
    def _supported(self):
        """Each field the sampler would ignore, named as the error's field (`_unsupported`)."""
        neutral = {
            "repetition_penalty": self.repetition_penalty == 1.0,
            "logprobs": not self.logprobs,
            "logit_bias": not self.logit_bias,
            "top_logprobs": not self.top_logprobs,
            "min_p": self.min_p == 0.0,
            "min_tokens": self.min_tokens == 0,
            "best_of": self.best_of in (None, 1),
            "use_beam_search": not self.use_beam_search,
            "length_penalty": self.length_penalty == 1.0,
            "response_format": not self.response_format or self.response_format.get("type") == "text",
            "tools": not self.tools,
        }
        for name, ok in neutral.items():
            if not ok:
                raise _unsupported(name, UNSUPPORTED[name])
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
            stop_token_ids=tuple(self.stop_token_ids or ()),
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
    max_completion_tokens: Int | None = Field(None, ge=1, le=INT32)
    mm_processor_kwargs: VideoControls | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> tuple[list[dict], list[str]]:
        """Messages in the chat template's shape (image parts become `{"type": "image"}`, video
        parts `{"type": "video"}`) and the image URLs in prompt order (`video_urls`: the clips')."""
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
                elif isinstance(p, VideoPart):
                    parts.append({"type": "video"})
                else:
                    parts.append({"type": "text", "text": p.text})
            out.append({"role": role, "content": parts})
        return out, urls

    def video_urls(self) -> list[str]:
        """The clips' URLs, in prompt order."""
        return [
            p.video_url.url
            for m in self.messages
            if isinstance(m.content, list)
            for p in m.content
            if isinstance(p, VideoPart)
        ]


class CompletionRequest(SamplingFields):
    """`/v1/completions`: one prompt, as text or as token ids."""

    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1, le=INT32)

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


UNSUPPORTED = {
    "repetition_penalty": "repetition_penalty is not supported; leave it at 1.0",
    "logprobs": "logprobs are not supported; leave logprobs out or false",
    "logit_bias": "logit_bias is not supported by this server's sampler; leave it out or null",
    "top_logprobs": "top_logprobs is not supported (no logprobs are returned); leave it out or 0",
    "min_p": "min_p is not supported; leave it at 0",
    "min_tokens": "min_tokens is not supported; leave it at 0 (ignore_eos makes a reply run to max_tokens)",
    "best_of": "best_of is not supported; leave it at 1",
    "use_beam_search": "beam search is not supported; leave use_beam_search false",
    "length_penalty": "length_penalty is not supported (it applies to beam search); leave it at 1.0",
    "response_format": 'only response_format {"type": "text"} is supported; structured output is not',
    "tools": "tools (function calling) are not supported; leave tools out",
}


def _unsupported(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_field", message, {"param": field})


def _invalid_unicode(data: Any) -> str | None:
    """The path (`messages.0.content.1.text`) of the first string or key in `data` that does not
    encode as UTF-8 (a lone surrogate), or None. Iterative: JSON nests as deep as it likes."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path or "body"
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                name = key if isinstance(key, str) and _encodes(key) else clip(_escaped(str(key)), 40)
                child = f"{path}.{name}" if path else name
                if name is not key:
                    return f"{child} (the key)"
                stack.append((child, item))
        elif isinstance(value, list):
            indexed = [(f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value)]
            stack.extend(reversed(indexed))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
