"""Service configuration from the environment (`TRIDENT_*`), the same under compose and `trident up`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.bus import BusConfig
from common.planner.forecast import ForecastConfig
from common.planner.limits import Limits, parse_counts
from common.secrets import DeploymentSecrets, with_credentials
from common.tls import Tls


class ServiceSettings(BaseSettings):
    """What every service needs: the model, the broker, the store, and how to be reached."""

    model_config = SettingsConfigDict(env_prefix="TRIDENT_", env_file=None, extra="ignore")

    model: Path = Field(Path(".trident/models/tiny-llava"), description="HF-format checkpoint directory")
    model_name: str = Field("", description="Name served in the API; default: the directory's name")
    nats_url: str = "nats://127.0.0.1:4222"
    nats_stream_replicas: int = Field(
        1, ge=1, le=5, description="Copies JetStream keeps of the task stream: 3 on a three-node NATS cluster"
    )
    redis_url: str = "redis://127.0.0.1:6379/0"
    secrets_dir: Path | None = Field(
        None,
        description="Folder of the deployment's secrets (nats-token, redis-password, transfer-secret, "
        "planner-key)",
    )
    transfer_secret: str = Field("", description="Asked of every bulk-transfer pull; empty: none")
    tls_dir: Path | None = Field(
        None,
        description="Folder of the deployment's TLS files (ca.pem, cert.pem, key.pem; `trident certs` "
        "writes them): NATS, Redis, bulk transfers and the workers' HTTP then speak mutual TLS; empty: plain",
    )
    transfer_inline_max_bytes: int = Field(
        256 * 1024, ge=0, description="Tensors up to this size ride inside the NATS message, not by handle"
    )
    transfer_host_local: bool = Field(
        True,
        description="Pulls between processes of one host copy straight from the owner's memory (shared "
        "memory for CPU tensors, CUDA IPC GPU to GPU) instead of taking the bytes over the transfer port; "
        "off: every pull streams",
    )
    # The gateway's API and the planner's write endpoints ask for one of them; empty: open.
    api_keys: str = Field("", description="Comma-separated Bearer keys; empty disables auth")
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
    namespace: str = "trident"
    bind_host: str = "127.0.0.1"  # compose sets 0.0.0.0
    advertise_host: str = "127.0.0.1"  # what peers dial to reach this instance (compose: its hostname)
    http_port: int = Field(0, description="Health/metrics port; 0 picks a free one")
    instance_id: str = Field("", description="Unique id; default: <roles>-<host>-<pid>")
    log_level: str = "INFO"
    # The latency objectives (seconds). Workers size their per-iteration budgets from them; the
    # gateway judges each request against them. The defaults suit the tiny model on a CPU.
    ttft_slo: float = Field(5.0, gt=0, description="Time-to-first-token objective, seconds")
    tbt_slo: float = Field(0.5, gt=0, description="Time-between-tokens objective (p90), seconds")
    # A task whose instance stops answering (killed, frozen) is redelivered after this long; a
    # live instance extends its held tasks every third of it. Failover (below) hands a dead
    # instance's tasks on much sooner; this is the backstop.
    task_ack_wait: float = Field(10.0, ge=1, description="Seconds before a dead instance's task is retried")
    heartbeat_interval: float = Field(0.5, gt=0, description="Seconds between heartbeats")
    failover_after: float = Field(
        1.5,
        gt=0,
        description="Seconds of silence after which an instance is taken for dead and its work handed on",
    )
    unresponsive_after: float = Field(
        5.0,
        gt=0,
        description="Seconds of silence after which one whose /health hangs (frozen) is taken for dead",
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
            url=self.nats_url, prefix=self.namespace, name=name, ack_wait=self.task_ack_wait,
            stream_replicas=self.nats_stream_replicas, tls=self.tls,
        )  # fmt: skip

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model.name


class WorkerSettings(ServiceSettings):
    """An encoder, prefill or decode instance, or a hybrid of them."""

    roles: str = Field("encode,prefill,decode", description="Subset of encode,prefill,decode")
    policy: str = Field("stage", description="stage | prefill-first | decode-first")
    device: str = "cpu"
    num_threads: int = Field(0, description="torch CPU threads; 0 keeps torch's default")
    core_board: str = Field(
        "",
        description="A file every worker on this host shares: each step then takes the cores the others "
        "leave idle (services/worker/cores.py); empty: num_threads throughout",
    )
    host_cores: int = Field(0, ge=0, description="Cores the core board shares out; 0: this process's CPUs")
    kv_cache_bytes: int = 256 << 20
    block_size: int = 16
    # Upper caps: with profiling on, the budgets in use are the largest within the SLO-derived
    # iteration latency limit, at most these.
    token_budget: int = 2048
    image_budget: int = 8
    profile: Literal["auto", "measure", "off"] = Field(
        "auto",
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

    max_num_seqs: int = 256
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
    decode_graphs: Literal["auto", "off", "eager"] = Field(
        "auto",
        description="Decode-only steps padded to fixed batch and context buckets and replayed from CUDA "
        "graphs: auto (on CUDA devices; the CPU path stays as it is) | off | eager (padded, not captured)",
    )
    packed_weights: Literal["auto", "off"] = Field(
        "auto",
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
    transfer: str = Field("auto", description="auto (UCX when importable) | ucx | tcp")
    transfer_device_bytes: int = Field(
        4 << 30,
        ge=0,
        description="Bytes of published KV and features a GPU instance keeps on its GPU for host-local "
        "pullers (past it the oldest move to host memory); 0: all are served from host memory",
    )
    kv_layer_group: int = Field(4, description="Layers per KV transfer (002 §3.3)")
    kv_wire: Literal["native", "int8"] = Field(
        "native",
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
    heartbeat_ttl: float = 5.0
    drain_timeout: float = 30.0
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


class GatewaySettings(ServiceSettings):
    """The OpenAI-compatible front door."""

    port: int = 8000
    http_port: int = 8000
    max_images: int = 8
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = Field(50_000_000, description="Pixels an image may declare in its header")
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
    image_fetch_timeout: float = Field(10.0, description="Seconds for one image URL's whole fetch")
    max_videos: int = Field(2, ge=0, description="Video clips one request may carry (Qwen2-VL, Qwen2.5-VL)")
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
    allow_private_image_urls: bool = False
    default_max_tokens: int = 256
    request_timeout: float = Field(
        300.0, gt=0, description="Seconds a request may take in all (image fetch and processing "
        "included); past it, 504 and the request is cancelled everywhere",
    )  # fmt: skip
    max_in_flight: int = Field(1024, description="Requests served at once; beyond it, 429")
    max_queued_tasks: int = Field(
        512, description="Tasks waiting in any stage's queue beyond which new requests get 429"
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
        256, ge=0,
        description="Prompt tokens one request waiting at an instance is taken to cost, when its "
        "queue is weighed against the tokens its cache saves",
    )  # fmt: skip
    kv_routing_take_back: float = Field(
        1.0, gt=0,
        description="Seconds a request sent to one instance waits for it (busy, slow or dead) before it "
        "goes to the shared queue",
    )  # fmt: skip


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
    planner_budget_unit: Literal["cores", "gpus"] = "cores"
    planner_instance_cost: float = Field(
        1.0, gt=0, description="Cores (or GPUs) one instance takes, as the budget counts them"
    )
    planner_min_replicas: str = Field(
        "", description="Per-kind minimum replicas, e.g. `d=1,ep=1` (kinds: e p d ep ed epd)"
    )
    planner_max_replicas: str = Field("", description="Per-kind maximum replicas, e.g. `e=2,d=8`")
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
    planner_actuator: Literal["advisory", "launcher", "compose"] = "advisory"
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
