"""Built-in workloads, driven through any adapter as request-level trace steps.

``shared-prefix``: requests share system prompts drawn with Zipf popularity; each request is a
system prompt plus its own question, is prefilled, decodes some tokens and finishes, with a
fixed number of requests in flight; the pool is bounded, so the cache evicts on demand.

The driver decides each next step from the previous observations only (an ``ok: false``
reservation aborts the request), so every conforming implementation produces the same steps.

Hybrid models: with ``components`` naming SWA and/or Mamba the same workload runs through the
request model's SWA windows and Mamba states (spec/requests.py); an admission that gets no
Mamba state slot (``mamba_pool_idx`` null) aborts the request.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator

from uniradix.spec.config import CacheConfig


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    requests: int = 20_000
    prompts: int = 300
    prompt_min: int = 100
    prompt_max: int = 2_000
    question_min: int = 8
    question_max: int = 64
    decode_min: int = 1
    decode_max: int = 32
    kv_slots: int = 200_000
    inflight: int = 16
    zipf_s: float = 1.1
    page_size: int = 1
    seed: int = 0
    # hybrid models: the components; SWA's window and its pool as a share of the KV pool;
    # Mamba's state slots (0: two per request in flight) and chunk size
    components: tuple = ("full",)
    sliding_window: int = 64
    swa_share: float = 0.5
    mamba_slots: int = 0
    mamba_cache_chunk_size: int = 4

    def config(self) -> CacheConfig:
        if tuple(self.components) == ("full",):
            return CacheConfig(page_size=self.page_size, kv_slots=self.kv_slots)
        ps = self.page_size
        extra: dict = {}
        if "swa" in self.components:
            extra.update(sliding_window=self.sliding_window,
                         swa_slots=max(ps, int(self.kv_slots * self.swa_share) // ps * ps))
        if "mamba" in self.components:
            extra.update(mamba_slots=self.mamba_slots or 2 * self.inflight,
                         mamba_cache_chunk_size=self.mamba_cache_chunk_size)
        return CacheConfig(page_size=ps, kv_slots=self.kv_slots,
                           components=tuple(self.components), **extra)

    def scaled(self, requests: int) -> SharedPrefix:
        """The same workload with fewer requests and a pool and prompt set shrunk to match,
        so that eviction stays about as frequent."""
        f = max(requests / self.requests, 0.01)
        ps = self.page_size
        longest = self.prompt_max + self.question_max + self.decode_max
        kv = max(int(self.kv_slots * f), 2 * self.inflight * longest)
        kv = -(-kv // ps) * ps
        return dataclasses.replace(self, requests=requests, kv_slots=kv,
                                   prompts=max(10, int(self.prompts * f ** 0.5)))


def shared_prefix_requests(w: SharedPrefix) -> Iterator[tuple[str, list, int]]:
    """(rid, prompt tokens, tokens to decode) for each request, deterministic in the seed."""
    rng = random.Random(w.seed)
    prompts = [[rng.randrange(1, 32000) for _ in range(rng.randint(w.prompt_min, w.prompt_max))]
               for _ in range(w.prompts)]
    weights = [1.0 / (k + 1) ** w.zipf_s for k in range(w.prompts)]
    for r in range(w.requests):
        (sys_prompt,) = rng.choices(prompts, weights)
        question = [rng.randrange(1, 32000) for _ in range(rng.randint(w.question_min, w.question_max))]
        yield f"r{r}", sys_prompt + question, rng.randint(w.decode_min, w.decode_max)


@dataclasses.dataclass
class WorkloadStats:
    """What a run of the workload did (the bench harness, conformance/bench/loop.py, times it)."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0
    steps: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_shared_prefix(adapter, w: SharedPrefix, progress: Callable[[int, int], None] | None = None,
                      record: list | None = None) -> WorkloadStats:
    """Drive ``adapter`` through the workload as request-level trace steps (``record``, when
    given, receives each step with its ``ret``)."""
    stats = WorkloadStats()
    i = 0

    def step(op: str, **args) -> dict:
        nonlocal i
        s = {"i": i, "op": op, "args": args}
        obs = adapter.apply(s)
        if "error" in obs:
            raise RuntimeError(f"workload step {i} ({op}) was rejected: {obs}")
        if record is not None:
            s["ret"] = {k: v for k, v in obs.items() if k != "message"}
            record.append(s)
        i += 1
        return obs

    inflight: list[list] = []  # [rid, decode tokens left]
    source = shared_prefix_requests(w)
    done = 0
    waiting = None  # Mamba: a request that arrived but got no state slot yet
    while done < w.requests:
        while len(inflight) < w.inflight:
            nxt = waiting or next(source, None)
            if nxt is None:
                break
            rid, tokens, n_decode = nxt
            if waiting is None:
                step("req_arrive", rid=rid, tokens=tokens, extra_key=None)
            waiting = None
            admitted = step("req_admit", rid=rid)
            if admitted.get("mamba_pool_idx", 0) is None:  # no Mamba state slot to be had
                if inflight:  # wait until a running request finishes
                    waiting = nxt
                    break
                step("req_abort", rid=rid)
                stats.aborted += 1
                done += 1
                continue
            prefix = admitted["prefix_len"]
            stats.prompt_tokens += len(tokens)
            stats.hit_tokens += prefix
            r = step("req_chunk", rid=rid, n=len(tokens) - prefix, chunked=False)
            stats.evicted_tokens += r["evicted"]
            if not r["ok"]:
                step("req_abort", rid=rid)
                stats.aborted += 1
                done += 1
                continue
            inflight.append([rid, n_decode])
        if not inflight:
            break
        # one decode round: every running request makes progress; the oldest may finish
        for entry in list(inflight):
            rid, left = entry
            n = min(left, 8)
            r = step("req_decode", rid=rid, n=n)
            stats.evicted_tokens += r["evicted"]
            if not r["ok"]:
                step("req_abort", rid=rid)
                stats.aborted += 1
                inflight.remove(entry)
                done += 1
                continue
            entry[1] -= n
            if entry[1] <= 0:
                step("req_finish", rid=rid)
                inflight.remove(entry)
                stats.requests += 1
                done += 1
                if progress is not None:
                    progress(done, w.requests)
    stats.steps = i
    return stats
