"""Environment models: what surrounds the cache in SGLang, built the same for every
implementation.

``pools``: the KV pool behind SGLang's allocator interface; ``kvcheck``: a real (small) KV
pool whose contents say which token each slot holds; ``workload``: the built-in request
workloads."""
