"""The Redis key schema, in one place (docs/substrate.md has the same table).

<p>:req:<request_id>          hash   per-stage timestamps and sizes of one request      TTL request_ttl
<p>:req:<request_id>:out      list   output token ids the gateway has streamed (journal)  TTL outputs_ttl
<p>:req:<request_id>:cancelled string tombstone: workers drop the request's tasks unrun   TTL request_timeout
<p>:trace                     stream one TraceRecord per finished request (planner)  MAXLEN ~trace_maxlen
<p>:feat:<content_hash>       hash   owner + FeatureEntry of an image's features         TTL per entry
<p>:inst:<instance_id>        string Heartbeat of a live instance                        TTL heartbeat_ttl
<p>:inst:<instance_id>:reaped string the watcher that claimed this instance's death      TTL 5 min
<p>:inst:<instance_id>:fenced string taken for dead: it must publish nothing and leave  TTL 1 day
<p>:instances                 zset   instance id -> expiry time (index over inst:*)
<p>:profile:<profile_id>      string StageProfile
<p>:profiles                  set    profile ids
<p>:profile:<id>:claim        string instance measuring that profile now                  TTL claim_ttl
<p>:task:<stream>:<seq>:<msg id>:claim   who runs a mailbox task (instance, sender, failover)   TTL 10 min
<p>:steps                     hash   instance id -> its StepStats (engine steps in service)
<p>:plan                      string the current Plan
<p>:plan:seq                  int    last decision id (INCR)
<p>:plan:apply                string the Plan for `trident up --follow-plan` (the launcher actuator)
<p>:planjob:<job_id>          string a what-if job the planner accepted (its request summary)   TTL 1 day
<p>:deadletter                stream DeadLetter records                                  MAXLEN ~10000
<p>:deadletter:seen:<s>:<n>   string dedup marker per stream sequence                    TTL 7 days
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "trident"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def outputs(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:out"

    def cancelled(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}:cancelled"

    @property
    def trace(self) -> str:
        return f"{self.prefix}:trace"

    def feature(self, content_hash: str) -> str:
        return f"{self.prefix}:feat:{content_hash}"

    def instance(self, instance_id: str) -> str:
        return f"{self.prefix}:inst:{instance_id}"

    def fenced(self, instance_id: str) -> str:
        return f"{self.prefix}:inst:{instance_id}:fenced"

    def reaped(self, instance_id: str) -> str:
        return f"{self.prefix}:inst:{instance_id}:reaped"

    def task_claim(self, stream: str, seq: int, msg_id: str) -> str:
        return f"{self.prefix}:task:{stream}:{seq}:{msg_id}:claim"

    @property
    def instances(self) -> str:
        return f"{self.prefix}:instances"

    def profile(self, profile_id: str) -> str:
        return f"{self.prefix}:profile:{profile_id}"

    def profile_claim(self, profile_id: str) -> str:
        return f"{self.prefix}:profile:{profile_id}:claim"

    @property
    def profiles(self) -> str:
        return f"{self.prefix}:profiles"

    @property
    def plan(self) -> str:
        return f"{self.prefix}:plan"

    @property
    def steps(self) -> str:
        return f"{self.prefix}:steps"

    @property
    def plan_seq(self) -> str:
        return f"{self.prefix}:plan:seq"

    @property
    def plan_apply(self) -> str:
        return f"{self.prefix}:plan:apply"

    def plan_job(self, job_id: str) -> str:
        return f"{self.prefix}:planjob:{job_id}"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:deadletter"

    def dead_letter_seen(self, stream: str, seq: int) -> str:
        return f"{self.prefix}:deadletter:seen:{stream}:{seq}"
