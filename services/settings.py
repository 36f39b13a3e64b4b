"""Service configuration from the environment (`TRIDENT_*`), the same under compose and `trident up`."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.bus import BusConfig
from common.engine.config import DecodeGraphMode, PackedWeightMode, Policy
from common.planner.forecast import ForecastConfig
from common.planner.limits import Limits, parse_counts
from common.protocol.tensors import KvWire
from common.roles import InstanceKind, parse_roles
from common.secrets import DeploymentSecrets, with_credentials
from common.tls import Tls


def parse_memory_shares(text: str) -> dict[InstanceKind, float]:
    """TRIDENT_GPU_MEMORY_SHARE: `0.4` (every kind) or `e=0.08,p=0.42` (per kind) → a share per kind,
    each in (0, 1]; empty → none. A ValueError names the part that is wrong."""
    text = text.strip()
    if not text:
        return {}
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if "=" not in text:  # one share for every kind
        parts = [f"{kind.value}={text}" for kind in InstanceKind]
    shares: dict[InstanceKind, float] = {}
    for part in parts:
        name, _, value = part.partition("=")
        shown = part if "=" in text else text
        try:
            kind, share = InstanceKind(name.strip().lower()), float(value)
        except ValueError:
            raise ValueError(
                f"TRIDENT_GPU_MEMORY_SHARE: {shown!r} is neither one share (0.4) nor KIND=SHARE with KIND "
                f"one of {', '.join(InstanceKind)}"
            ) from None
        if not 0 < share <= 1:
            raise ValueError(f"TRIDENT_GPU_MEMORY_SHARE: {shown!r}: a share is above 0 and at most 1")
        shares[kind] = share
    return shares


class ServiceSettings(BaseSettings):
    """What every service needs: the model, the broker, the store, and how to be reached."""

    model_config = SettingsConfigDict(env_prefix="TRIDENT_", env_file=None, extra="ignore")

    model: Path = Field(Path(".trident/models/tiny-llava"), description="HF-format checkpoint directory")
    model_name: str = Field("", description="The model name served in the API; empty: the directory's name")
    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS (JetStream) server; a cluster's nodes comma-separated: the client takes any and "
        "moves to another when one dies",
    )
    nats_stream_replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="Copies JetStream keeps of the task stream and its consumers: 3 on a three-node NATS "
        "cluster (`trident up --ha` and the Kubernetes manifests set it)",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis server and database; or `redis+sentinel://h1:26379,h2:26379/SERVICE/DB`: the "
        "primary the sentinels name for SERVICE, asked again at every connect, so a failover is followed",
    )
    secrets_dir: Path | None = Field(
        None,
        description="Folder of the deployment's secrets, a file each: nats-token, redis-password, "
        "transfer-secret, planner-key (compose's secrets-init or `trident up` make them). Each goes into the "
        "NATS and Redis URLs, TRIDENT_TRANSFER_SECRET and TRIDENT_PLANNER_KEY unless those carry their own",
    )
    transfer_secret: str = Field(
        "",
        description="Asked of every bulk-transfer pull (UCX and TCP): a puller without it is refused and "
        "recomputes; empty: the transfer port answers anyone who reaches it",
    )
    tls_dir: Path | None = Field(
        None,
        description="Folder of the deployment's TLS files (ca.pem, cert.pem, key.pem; `trident certs` "
        "writes them): NATS, Redis, bulk transfers (TCP: UCX has no encryption, so `auto` never picks it "
        "and `ucx` is refused) and the workers' HTTP speak mutual TLS, each end accepting only the "
        "deployment CA's certificate; a missing file stops the service at start; unset: plain",
    )
    transfer_inline_max_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Tensors (image features, KV) up to this many bytes ride inside the NATS message; larger "
        "ones are pulled by handle over the transfer port. 0: every tensor by handle",
    )
    transfer_host_local: bool = Field(
        True,
        description="Pulls between processes of one host copy straight from the owner's memory (shared "
        "memory for CPU tensors, CUDA IPC GPU to GPU) instead of taking the bytes over the transfer port; "
        "off: every pull streams",
    )
    # The gateway's API and the planner's write endpoints ask for one of them; empty: open.
    api_keys: str = Field(
        "",
        description="Comma-separated Bearer keys: the gateway asks one of every API call, the planner takes "
        "them for its writes; empty: the gateway is open (for one behind its own authenticating proxy)",
    )
    # The operator's key: the planner's writes take it, and the gateway's /v1/cluster shows the
    # instances' addresses only to it.
    planner_key: str = Field(
        "",
        description="The operator's Bearer key: the planner's writes take it besides TRIDENT_API_KEYS, and "
        "the gateway's /v1/cluster shows instances' addresses only to it; default: the secrets folder's "
        "planner-key",
    )

    @property
    def api_key_set(self) -> set[str]:
        return {k.strip() for k in self.api_keys.split(",") if k.strip()}

    # The prefix of every NATS subject and Redis key, so several deployments can share servers.
    namespace: str = Field(
        "trident", description="Prefix of every NATS subject and Redis key, so deployments can share servers"
    )
    bind_host: str = Field(
        "127.0.0.1", description="Address the service's servers listen on (compose: 0.0.0.0)"
    )
    advertise_host: str = Field(
        "127.0.0.1",
        description="Host peers dial to reach this instance, carried by the registry and every transfer "
        "handle; `auto`: this machine's hostname (compose, Kubernetes)",
    )
    http_port: int = Field(
        0,
        description="Health, readiness and metrics port (the planner's REST too); 0 picks a free one "
        "(compose: 9000 on workers)",
    )
    instance_id: str = Field("", description="Unique id in the registry; empty: <roles>-<host>-<pid>")
    log_level: str = Field("INFO", description="Log level (compose interpolates it from your shell)")
    otlp_endpoint: str = Field(
        "",
        description="OTLP/HTTP collector spans are exported to (a base URL: /v1/traces is added), one span "
        "per stage of each request under the client's W3C trace; empty: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing",
    )
    transfer_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port the bulk-transfer server listens on (a gateway's pixels, a worker's features and "
        "KV, over TCP); 0 picks a free one. Fixed where a firewall or NetworkPolicy must name it",
    )
    # The latency objectives (seconds). Workers size their per-iteration budgets from them; the
    # gateway judges each request against them. The defaults suit the tiny model on a CPU.
    ttft_slo: float = Field(
        5.0,
        gt=0,
        description="Time-to-first-token objective, seconds: workers without decode keep a step under half "
        "of it; the gateway judges each request and the planner plans against it",
    )
    tbt_slo: float = Field(
        0.5,
        gt=0,
        description="Time-between-tokens objective (p90 of a request's gaps), seconds: workers with decode "
        "keep a step under it",
    )
    # A task whose instance stops answering (killed, frozen) is redelivered after this long; a
    # live instance extends its held tasks every third of it. Failover (below) hands a dead
    # instance's tasks on much sooner; this is the backstop.
    task_ack_wait: float = Field(
        10.0,
        ge=1,
        description="Seconds before a task held by an instance that stopped answering goes to another, "
        "whatever else happens: the backstop behind failover. Live instances extend their tasks every third "
        "of it; the consumers take the last starting service's value, so give every service the same",
    )
    heartbeat_interval: float = Field(
        0.5, gt=0, description="Seconds between heartbeats (to Redis for the registry, on NATS for failover)"
    )
    failover_after: float = Field(
        1.5,
        gt=0,
        description="Seconds of heartbeat silence after which an instance that refuses its /health (or "
        "answers as another) is taken for dead: fenced, and its tasks handed to live replicas at once",
    )
    unresponsive_after: float = Field(
        5.0,
        gt=0,
        description="Seconds of silence after which an instance whose /health hangs (frozen, or its host "
        "cut off) is taken for dead",
    )

    @property
    def tls(self) -> Tls | None:
        return Tls(self.tls_dir.resolve()) if self.tls_dir is not None else None

    @model_validator(mode="after")
    def _check_tls(self) -> ServiceSettings:
        if self.tls_dir is not None:
            Tls.at(self.tls_dir)  # a missing or mismatched file is named at start, not at a first connect
        return self

    @model_validator(mode="after")
    def _apply_secrets(self) -> ServiceSettings:
        """Credentials from `secrets_dir` go into the URLs, unless the URLs carry their own."""
        if self.secrets_dir is not None:
            found = DeploymentSecrets.read(self.secrets_dir)
            self.nats_url = with_credentials(self.nats_url, found.nats_token, "")
            self.redis_url = with_credentials(self.redis_url, "", found.redis_password)
            self.transfer_secret = self.transfer_secret or found.transfer_secret
            self.planner_key = self.planner_key or found.planner_key
        return self

    def bus_config(self, name: str) -> BusConfig:
        return BusConfig(
            url=self.nats_url,
            prefix=self.namespace,
            name=name,
            ack_wait=self.task_ack_wait,
            stream_replicas=self.nats_stream_replicas,
            tls=self.tls,
        )

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model.name


class ProfileMode(StrEnum):
    """Where a worker's stage profile (its budgets and curves) comes from (services/worker/profiling.py)."""

    AUTO = "auto"  # a profile in Redis with the same fingerprint, else measured and stored
    MEASURE = "measure"  # measured at every start
    OFF = "off"  # the budgets as configured; nothing published


class WorkerSettings(ServiceSettings):
    """An encoder, prefill or decode instance, or a hybrid of them."""

    roles: str = Field(
        "encode,prefill,decode",
        description="This instance's roles, a subset of encode,prefill,decode (`python -m services.worker`; "
        "each stage's own entry point sets its own)",
    )
    policy: Policy = Field(
        Policy.STAGE,
        description="Batching policy: stage (Algorithm 1) | prefill-first | decode-first (ablations)",
    )
    device: str = Field("cpu", description="torch device (`cuda` under compose.gpu.yaml)")
    num_threads: int = Field(
        0, description="torch CPU threads; 0 keeps torch's default (`trident up` splits the cores)"
    )
    core_board: str = Field(
        "",
        description="A file every worker on this host shares: each step then takes the cores the others "
        "leave idle (services/worker/cores.py); empty: num_threads throughout",
    )
    host_cores: int = Field(0, ge=0, description="Cores the core board shares out; 0: this process's CPUs")
    kv_cache_bytes: int = Field(256 << 20, description="Bytes of the paged KV cache, allocated once at start")
    block_size: int = Field(16, description="Tokens per KV block")
    # Upper caps: with profiling on, the budgets in use are the largest within the SLO-derived
    # iteration latency limit, at most these.
    token_budget: int = Field(
        2048, description="Most tokens in one engine step (τt); with profiling on, the cap of its search"
    )
    image_budget: int = Field(
        8, description="Most images encoded in one engine step (τe); with profiling on, the cap of its search"
    )
    profile: ProfileMode = Field(
        ProfileMode.AUTO,
        description="auto (reuse a profile in Redis with the same fingerprint, else measure and store it) "
        "| measure (always) | off (use the budgets as configured, publish nothing)",
    )
    profile_repeats: int = Field(2, ge=1, description="Timed runs per profiled point (the least time counts)")
    adapt_budgets: bool = Field(
        True,
        description="Scale the profiled budgets down while full steps run slower than profiled "
        "(cores shared with other processes), and back up when they do not",
    )
    tbt_stretch: float = Field(
        1.5,
        ge=0,
        description="On an instance that decodes and prefills: long prompts' chunks go into steps with "
        "decodes only so far as those take on average this many times a decode-only step (above 1; 0: off)",
    )
    long_prefill: int = Field(1024, ge=1, description="Prompts longer than this many tokens are paced")

    max_num_seqs: int = Field(256, description="Most sequences an engine holds at once")
    prefix_caching: bool = Field(
        True,
        description="Keep full KV blocks for reuse by the hash of what they hold: a request computes "
        "only what follows its longest cached prefix (cached blocks give way to any allocation)",
    )
    decode_prefill_tokens: int = Field(
        0,
        ge=0,
        description="On a decode instance without the prefill role: prefill, from its own mailbox, a "
        "conversation's next turn when at most this many of its tokens are not cached here (it holds "
        "the earlier turns' prompt and answer); gateways send such turns here. 0: never",
    )
    feature_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="Bytes of image features an engine keeps by content hash; unset: 512 MiB on an "
        "encode-only instance (which holds no KV), 64 MiB on any other",
    )
    served_feature_bytes: int = Field(
        1 << 30,
        ge=0,
        description="On an encoder that hands on to prefill: bytes of image features it serves for prefill "
        "instances to pull (each image's once, by content hash); past it the least recently used are "
        "dropped (and leave the feature index), and a prefill instance that still wanted one recomputes "
        "or re-encodes it. The newest request's features are always kept; idle ones also go after 600 s",
    )
    decode_graphs: DecodeGraphMode = Field(
        DecodeGraphMode.AUTO,
        description="Decode-only steps padded to fixed batch and context buckets and replayed from CUDA "
        "graphs: auto (on CUDA devices; the CPU path stays as it is) | off | eager (padded, not captured)",
    )
    packed_weights: PackedWeightMode = Field(
        PackedWeightMode.AUTO,
        description="auto: on a CPU in float32, a decoding instance also keeps the language model's "
        "weights packed for MKL's GEMM (decode batches of 2-64 sequences about twice as fast, for a "
        "second copy of the decoder's weights in memory) | off",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The KV cache's dtype: auto (the model's) | float16 | bfloat16 — on a CPU under a "
        "float32 model, half the cache's bytes (twice the sequences in the same TRIDENT_KV_CACHE_BYTES) and "
        "faster decode attention, for keys and values rounded to half precision (greedy outputs may part "
        "from HF's at near-ties); refused on a GPU unless it is the model's dtype",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The dtype the engine computes in: auto (float32 on a CPU, bfloat16 on a GPU) | float32 "
        "(on a GPU too: answers token-identical to HF's float32 model) | bfloat16 | float16",
    )
    gpu_memory_share: str = Field(
        "",
        description="Where instances share one GPU: the share of its memory this instance holds in all "
        "(weights, KV cache, working memory), as one number (0.4) or per instance kind (e=0.08,p=0.42,"
        "d=0.45; kinds: e p d ep ed epd, one absent takes what is free); empty: the GPU is this instance's",
    )
    transfer: str = Field(
        "auto", description="Bulk transfer backend: auto (UCX when it loads, TCP with TLS) | ucx | tcp"
    )
    transfer_device_bytes: int = Field(
        4 << 30,
        ge=0,
        description="Bytes of published KV and features a GPU instance keeps on its GPU for host-local "
        "pullers (past it the oldest move to host memory); 0: all are served from host memory",
    )
    kv_layer_group: int = Field(4, description="Layers per KV transfer (002 §3.3)")
    kv_wire: KvWire = Field(
        KvWire.NATIVE,
        description="How a prefill instance sends KV to decode: native (the KV cache's dtype) | int8 (int8 "
        "values with a float32 scale per layer, block and head: about half a bfloat16 cache's bytes, a "
        "quarter of a float32 one's; decoders of either setting read both)",
    )
    kv_stream: bool = Field(
        True,
        description="A prefill instance streams each group of layers' KV as its last prefill step computes "
        "it, and queues the decode task as that step starts, so decode pulls while prefill runs (002 "
        "§3.3); off: KV is exported after the step. KV small enough to ride in the task never streams",
    )
    prefetch: bool = Field(
        True,
        description="Fetch a prefill task's image features as soon as it arrives (002 §3.2); "
        "off: only when the engine would run it",
    )
    heartbeat_ttl: float = Field(5.0, description="Seconds a silent worker stays in the registry")
    drain_timeout: float = Field(
        30.0,
        description="Seconds to finish held work on SIGTERM; what is still held then goes back to its queue "
        "(at once on a second signal). Draining, /ready answers 503 while /health and /metrics answer",
    )
    finals_window: float = Field(
        120.0,
        gt=0,
        description="Seconds a request that ended here keeps its tokens and final, to be said again to a "
        "gateway that asks (it missed them while NATS restarted)",
    )
    check_integrity: bool = Field(
        False,
        description="Check that the request ledger and the engine agree whenever requests come and go "
        "(tests); a failure is logged and counted in trident_integrity_failures_total",
    )

    @model_validator(mode="after")
    def _check_stretch(self) -> WorkerSettings:
        if 0 < self.tbt_stretch <= 1:
            raise ValueError(f"TRIDENT_TBT_STRETCH must be above 1 (or 0: off), not {self.tbt_stretch}")
        return self

    @model_validator(mode="after")
    def _check_share(self) -> WorkerSettings:
        self.memory_share()  # a bad share stops the worker at start, saying which part
        return self

    def memory_share(self) -> float | None:
        """This instance's share of a shared GPU's memory (TRIDENT_GPU_MEMORY_SHARE), by its roles."""
        kind = InstanceKind.of(parse_roles(self.roles))
        return parse_memory_shares(self.gpu_memory_share).get(kind) if kind else None


class GatewaySettings(ServiceSettings):
    """The OpenAI-compatible front door."""

    port: int = Field(
        8000, description="The gateway's API port (compose publishes it on the host as ${TRIDENT_PORT:-8000})"
    )
    http_port: int = 8000
    max_images: int = Field(8, description="Most images in one request")
    max_image_bytes: int = Field(20 << 20, description="Largest image, fetched or inline; beyond it, 413")
    max_image_pixels: int = Field(
        50_000_000,
        description="Pixels an image may declare in its header, checked before decoding; beyond, 413",
    )
    max_request_pixels: int = Field(
        100_000_000,
        gt=0,
        description="Pixels all of a request's images may declare together; beyond it, 413 (a decoded "
        "image takes 3 bytes a pixel, and the processor copies it)",
    )
    image_workers: int = Field(
        0,
        ge=0,
        description="Threads that decode and preprocess images, and requests with images processed at "
        "once; 0: min(4, CPUs). Text-only requests have their own thread and never wait for images",
    )
    max_body_bytes: int = Field(64 << 20, description="Largest request body; beyond it, 413")
    body_timeout_floor: float = Field(
        5.0, gt=0, description="Seconds any request body may take to arrive, however small; past it, 408"
    )
    body_timeout_per_mb: float = Field(
        2.0, ge=0, description="Seconds more a body may take per MB of its size (declared, or so far)"
    )
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send a request's headers; then closed"
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="Seconds an idle keep-alive connection stays open between requests"
    )
    image_fetch_timeout: float = Field(
        10.0, description="Seconds for one image URL's whole fetch (connect, every byte), not per read"
    )
    max_videos: int = Field(2, ge=0, description="Video clips one request may carry (Qwen-VL families)")
    max_video_bytes: int = Field(
        64 << 20, gt=0, description="Largest video file, fetched or inline; beyond it, 413"
    )
    video_fps: float = Field(
        2.0, gt=0, description="Frames sampled per second of video, unless a request asks"
    )
    video_max_fps: float = Field(8.0, gt=0, description="The most frames per second a request may ask for")
    video_frames: int = Field(
        32, ge=2, description="The most frames sampled from a clip, unless a request asks"
    )
    video_max_frames: int = Field(
        128, ge=2, description="The most frames a request may ask for from one clip"
    )
    video_max_seconds: float = Field(
        600.0, gt=0, description="The longest clip, by its frames' times; beyond it, 413"
    )
    video_decode_timeout: float = Field(
        30.0, gt=0, description="Seconds a clip's reading and decoding may take; beyond it, 413"
    )
    allow_private_image_urls: bool = Field(
        False,
        description="Allow image and video URLs on addresses that are not global (private, loopback, "
        "link-local, CGNAT, reserved); every address a name resolves to is checked",
    )
    default_max_tokens: int = Field(256, description="`max_tokens` of a request that gives none")
    request_timeout: float = Field(
        300.0,
        gt=0,
        description="Seconds a request may take in all (image fetch and processing "
        "included); past it, 504 and the request is cancelled everywhere",
    )
    max_in_flight: int = Field(
        1024, description="Requests served at once, counted once a body has arrived whole; beyond it, 429"
    )
    hold_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds a request waits at the gateway for a live instance of a stage it needs (one "
        "scaled to zero, or starting); past it, 503",
    )
    max_held: int = Field(
        256, ge=0, description="Requests waiting for an instance at once; beyond it, 503 at once"
    )
    max_queued_tasks: int = Field(
        512,
        description="Undelivered tasks in any stage's queue (read every 0.25 s) beyond which new requests "
        "get 429 with Retry-After",
    )
    sse_keepalive: float = Field(
        10.0, gt=0, description="Seconds of silence after which a stream gets an SSE comment"
    )
    kv_routing: bool = Field(
        True,
        description="Send a request whose prompt prefix a prefill instance holds in its cache to that "
        "instance (weighing the tokens it saves against the instance's queue), not the shared queue",
    )
    kv_routing_min_tokens: int = Field(
        64, ge=1, description="Cached prefix tokens a request must find at an instance to be sent there"
    )
    kv_routing_load_tokens: int = Field(
        256,
        ge=0,
        description="Prompt tokens one request waiting at an instance is taken to cost, when its "
        "queue is weighed against the tokens its cache saves",
    )
    kv_routing_take_back: float = Field(
        1.0,
        gt=0,
        description="Seconds a request sent to one instance waits for it (busy, slow or dead) before it "
        "goes to the shared queue",
    )


class PlannerSettings(ServiceSettings):
    """The planner service and its what-if jobs worker (docs/running.md, "Planner")."""

    http_port: int = Field(8100, description="REST API, health and metrics")
    planner_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="CPU niceness of the planner and its jobs worker: on cores shared with workers, a plan "
        "being computed takes what the serving path leaves",
    )
    planner_interval: float = Field(60.0, gt=0, description="Seconds between re-plans")
    planner_shift_threshold: float = Field(
        0.2, ge=0, le=1, description="Workload distance since the last plan that triggers a re-plan"
    )
    planner_shift_check_interval: float = Field(5.0, gt=0, description="Seconds between trace reads")
    planner_window: int = Field(2000, ge=1, description="Most recent finished requests planned for")
    planner_min_requests: int = Field(50, ge=1, description="Finished requests needed before the first plan")
    planner_instances: int = Field(0, ge=0, description="Instances to partition; 0: as many as are live")
    planner_calibrate: bool = Field(
        True, description="Fit the stage curves to the steps instances ran in service (their StepStats)"
    )
    planner_attainment: float = Field(
        0.9, gt=0, le=1, description="Share of requests that must meet the SLOs"
    )
    planner_profiles: str = Field(
        "cluster", description="cluster (what instances publish) | paper:<model> | a ProfileSet JSON file"
    )
    planner_budget: float = Field(
        0.0,
        ge=0,
        description="Cores (or GPUs: planner_budget_unit) all instances may take together; capacity is "
        "never recommended beyond it. 0: this host's cores (with gpus, 0 is refused)",
    )
    planner_budget_unit: Literal["cores", "gpus"] = Field(
        "cores", description="What the budget and the instance cost count: cores | gpus"
    )
    planner_instance_cost: float = Field(
        1.0, gt=0, description="Cores (or GPUs) one instance takes, as the budget counts them"
    )
    planner_min_replicas: str = Field(
        "", description="Per-kind minimum replicas, e.g. `d=1,ep=1` (kinds: e p d ep ed epd)"
    )
    planner_max_replicas: str = Field("", description="Per-kind maximum replicas, e.g. `e=2,d=8`")
    planner_start: str = Field(
        "",
        description="Per-kind counts published as trident_planner_desired_instances until the first sizing, "
        "with whatever runs besides: the method a deployment starts with, e.g. `ep=1,d=1`. Empty: what "
        "runs, or no count at all (an autoscaler then keeps what runs)",
    )
    planner_forecast_bin: float = Field(
        10.0, gt=0, description="Seconds per point of the arrival-rate series"
    )
    planner_forecast_window: float = Field(300.0, gt=0, description="Seconds of arrivals the forecast fits")
    planner_forecast_horizon: float = Field(
        60.0, ge=0, description="Seconds ahead capacity is planned for (about a replica's start-up)"
    )
    planner_forecast_alpha: float = Field(0.5, gt=0, le=1, description="Holt's level smoothing")
    planner_forecast_beta: float = Field(0.3, gt=0, le=1, description="Holt's trend smoothing")
    planner_capacity_change: float = Field(
        0.1, ge=0, description="Relative change of the forecast rate that re-sizes capacity between plans"
    )
    planner_capacity_min_interval: float = Field(
        30.0, ge=0, description="Fewest seconds between two sizings that a forecast change triggers"
    )
    planner_actuator: Literal["advisory", "launcher", "compose"] = Field(
        "advisory",
        description="What a decision does beyond being published: advisory (nothing) | launcher (`trident up "
        "--follow-plan` applies it) | compose (logs, or runs, the `docker compose` command that applies it)",
    )
    planner_follow_capacity: bool = Field(
        False,
        description="Hand each capacity recommendation that differs from what runs to the actuator, so "
        "instances are added and removed to match it; off: only plans (a split of what runs) are",
    )
    planner_compose_run: bool = Field(False, description="compose actuator: run the command, not just log it")
    planner_compose_file: Path = Field(
        Path("compose.yaml"), description="The file the compose actuator scales"
    )
    planner_open_writes: bool = Field(
        False,
        description="Let POST /plan/replan and /plan/jobs through without a key when no key is configured "
        "(only on a network nobody else reaches); off: with no key configured they are refused",
    )
    planner_jobs_url: str = Field("", description="Celery broker and result backend; default: redis_url")
    planner_job_time_limit: float = Field(
        600.0, gt=0, description="Seconds a what-if job may run before its worker kills it"
    )

    @model_validator(mode="after")
    def _limits(self) -> PlannerSettings:
        self.capacity_limits()  # a bad count or budget stops the planner at start, saying which
        return self

    def capacity_limits(self) -> Limits:
        """What capacity recommendations must fit (common/planner/capacity.py)."""
        budget = self.planner_budget
        if budget == 0:
            if self.planner_budget_unit == "gpus":
                raise ValueError(
                    "TRIDENT_PLANNER_BUDGET: give the GPUs the deployment may use (0 is for cores)"
                )
            budget = float(os.cpu_count() or 1)
        return Limits(
            minimum=parse_counts(self.planner_min_replicas, "TRIDENT_PLANNER_MIN_REPLICAS"),
            maximum=parse_counts(self.planner_max_replicas, "TRIDENT_PLANNER_MAX_REPLICAS"),
            budget=budget,
            cost=self.planner_instance_cost,
            unit=self.planner_budget_unit,
        )

    def forecast_config(self) -> ForecastConfig:
        return ForecastConfig(
            bin_s=self.planner_forecast_bin,
            window_s=max(self.planner_forecast_window, self.planner_forecast_bin),
            horizon_s=self.planner_forecast_horizon,
            alpha=self.planner_forecast_alpha,
            beta=self.planner_forecast_beta,
        )

    @property
    def write_keys(self) -> set[str]:
        """The keys the planner's write endpoints take: TRIDENT_API_KEYS and the planner key."""
        return self.api_key_set | ({self.planner_key} if self.planner_key else set())
