"""cache_unfinished_req / cache_finished_req over the request model, with hand-computed
expectations, invariants checked after every step."""

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.spec import queries
from uniradix.spec.config import CacheConfig


class Driver:
    def __init__(self, **config):
        self.a = SpecAdapter(CacheConfig(**config))
        self.i = 0

    def __call__(self, op, **args):
        obs = self.a.apply({"i": self.i, "op": op, "args": args})
        self.i += 1
        assert self.a.violations() == []
        return obs

    @property
    def state(self):
        return self.a.state


def test_chunked_prefill_then_finish_page_4():
    d = Driver(page_size=4, kv_slots=64)
    d("req_arrive", rid="a", tokens=list(range(1, 12)))  # 11 prompt tokens
    assert d("req_admit", rid="a") == {"prefix_len": 0}
    # chunk of 5: the row gets 2 pages (slots 4..11); 4 aligned tokens are cached and protected
    assert d("req_chunk", rid="a", n=5) == {"ok": True, "evicted": 0, "freed": []}
    req = d.state.requests["a"]
    assert req.row == list(range(4, 12)) and req.cache_protected_len == 4
    assert queries.protected_size(d.state) == 4 and queries.evictable_size(d.state) == 0
    # the other 6 prompt tokens: 11 computed -> 3 pages; 8 aligned tokens cached and protected
    assert d("req_chunk", rid="a", n=6, chunked=False)["ok"]
    assert req.cache_protected_len == 8 and len(req.row) == 12
    assert queries.protected_size(d.state) == 8
    assert d("req_decode", rid="a", n=3)["ok"]  # 14 tokens -> 4 pages (slots 4..19)
    assert req.row == list(range(4, 20))
    # finish: 12 aligned tokens go to the tree, slots 16..19 (tokens 12, 13 and the unused
    # rest of the page) go back to the pool; the lock is released
    assert d("req_finish", rid="a") == {"freed": [16, 17, 18, 19]}
    assert queries.evictable_size(d.state) == 12 and queries.protected_size(d.state) == 0
    assert d.state.requests == {} and d.state.handles == {}


def test_second_request_reuses_prefix_and_abort_frees_only_its_own_slots():
    d = Driver(page_size=1, kv_slots=64)
    d("req_arrive", rid="a", tokens=[1, 2, 3, 4, 5, 6])
    d("req_admit", rid="a")
    d("req_chunk", rid="a", n=6, chunked=False)  # slots 1..6
    d("req_finish", rid="a")
    d("req_arrive", rid="b", tokens=[1, 2, 3, 4, 9, 9])
    # b matches [1,2,3,4] (its last token is always computed): the node splits at 4
    assert d("req_admit", rid="b") == {"prefix_len": 4}
    assert queries.protected_size(d.state) == 4 and queries.evictable_size(d.state) == 2
    assert d("req_chunk", rid="b", n=2, chunked=False)["ok"]  # slots 7, 8
    req = d.state.requests["b"]
    assert req.row == [1, 2, 3, 4, 7, 8] and req.cache_protected_len == 6
    assert d("req_abort", rid="b") == {"freed": []}  # nothing of its own left: all cached
    assert queries.evictable_size(d.state) == 8


def test_reservation_evicts_then_gives_up_cleanly():
    d = Driver(page_size=1, kv_slots=8)
    d("req_arrive", rid="a", tokens=[1, 2, 3, 4, 5, 6])
    d("req_admit", rid="a")
    d("req_chunk", rid="a", n=6, chunked=False)
    d("req_finish", rid="a")  # 6 cached, 2 free
    d("req_arrive", rid="b", tokens=[7, 8, 9, 10])
    d("req_admit", rid="b")
    # 4 needed, 2 free: the oldest leaf (all 6 tokens) is evicted as a whole
    assert d("req_chunk", rid="b", n=4, chunked=False) == {
        "ok": True, "evicted": 6, "freed": [1, 2, 3, 4, 5, 6]}
    d("req_arrive", rid="c", tokens=list(range(20, 30)))
    d("req_admit", rid="c")
    # 10 needed: b's 4 are locked by b, so at most 4 free: refused, nothing allocated
    before = d.state.kv.available_size()
    assert d("req_chunk", rid="c", n=10, chunked=False) == {"ok": False, "evicted": 0, "freed": []}
    assert d.state.kv.available_size() == before
    assert d("req_abort", rid="c") == {"freed": []}


def test_eagle_finish_caches_bigrams():
    d = Driver(page_size=1, kv_slots=32, eagle=True)
    d("req_arrive", rid="a", tokens=[5, 6, 7, 8])
    d("req_admit", rid="a")
    d("req_chunk", rid="a", n=4, chunked=False)  # slots 1..4; 3 bigrams cached (1..3)
    assert queries.protected_size(d.state) == 3
    # finish: 3 bigram units cached, the slot of the last token (4) is freed
    assert d("req_finish", rid="a") == {"freed": [4]}
    assert queries.evictable_size(d.state) == 3


def test_disabled_cache_frees_the_whole_row():
    d = Driver(page_size=1, kv_slots=16, disable=True)
    d("req_arrive", rid="a", tokens=[1, 2, 3])
    assert d("req_admit", rid="a") == {"prefix_len": 0}
    d("req_chunk", rid="a", n=3, chunked=False)
    assert d("req_finish", rid="a") == {"freed": [1, 2, 3]}
    assert d.state.kv.available_size() == 16
