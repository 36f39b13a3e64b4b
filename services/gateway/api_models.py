"""The OpenAI request bodies the gateway accepts, validated by pydantic (errors become 400s)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator
from pydantic_core import PydanticCustomError

from common.errors import APIError, clip
from common.protocol import SamplingParams
from common.protocol.sampling import INT32, INT64, MAX_BIAS, MAX_CHOICES, MAX_TOP_LOGPROBS, TokenId

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
    is refused when set (400 naming it and saying why), never accepted and ignored; null or absent
    is fine."""

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
    n: Int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    presence_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Finite = Field(1.0, gt=0.0)  # vLLM's extension (HF's definition)
    # Token id (as a string, JSON's keys) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, Finite] | None = None
    min_p: Finite = Field(0.0, ge=0.0, le=1.0)
    min_tokens: Int = Field(0, ge=0, le=INT32)  # vLLM's extension
    # OpenAI's and vLLM's fields the engine does not implement: refused unless neutral (UNSUPPORTED).
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

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("stop takes at most 4 strings")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit() or int(key) > INT32:
                raise _invalid(
                    "logit_bias", f"logit_bias keys are token ids (non-negative integers); got {key[:40]!r}"
                )
            if not -MAX_BIAS <= value <= MAX_BIAS:
                raise _invalid(
                    "logit_bias", f"logit_bias values lie in [-100, 100]; token {key} has {value:g}"
                )
        return bias

    @model_validator(mode="after")
    def _supported(self):
        """Each field the sampler would ignore, named as the error's field (`_unsupported`)."""
        neutral = {
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

    def sampling_params(self, default_max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        """What the engine samples with; `vocab_size`, when known, bounds logit_bias's ids (a 400
        naming logit_bias past it)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_tokens = self.requested_max_tokens or default_max_tokens
        if self.min_tokens > max_tokens:
            message = f"min_tokens ({self.min_tokens}) may not exceed max_tokens ({max_tokens})"
            raise APIError(400, message, param="min_tokens")
        bias = tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        if vocab_size is not None and (past := [t for t, _ in bias if t >= vocab_size]):
            message = f"logit_bias token id {past[0]} is outside the vocabulary [0, {vocab_size})"
            raise APIError(400, message, param="logit_bias")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            n=self.n,
            logprobs=self.top_logprobs_asked,
            logit_bias=bias,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
        )

    @property
    def top_logprobs_asked(self) -> int | None:
        """None: no log-probabilities; k: each token's, and the k most likely at each position."""
        return None

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
    logprobs: Annotated[bool, Strict()] | None = None  # each output token's log-probability
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and the most likely, with logprobs

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise _invalid("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
    # The log-probabilities of each output token and of the `logprobs` most likely at its position.
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

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
    "best_of": (
        "best_of > 1 is not supported: it returns the most likely of several answers, so it must "
        "generate all of them before the first token can be sent; ask for n choices (with logprobs "
        "to rank them) instead"
    ),
    "use_beam_search": (
        "beam search is not supported: this server samples each choice token by token; ask for n "
        "choices with logprobs instead"
    ),
    "length_penalty": "length_penalty applies to beam search, which is not supported; leave it at 1.0",
    "response_format": 'only response_format {"type": "text"} is supported; structured output is not',
    "tools": "tools (function calling) are not supported; leave tools out",
}


def _unsupported(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_field", message, {"param": field})


def _invalid(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message, {"param": field})


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
