"""uniradix.fast.storage: the backends of the storage tier (L3).

    StorageBackend   upstream SGLang's HiCacheStorage interface (base.py), sglang not needed
    FileStore        the embedded default: checksummed, atomically written page files with an
                     LRU capacity bound (file_store.py)
    MooncakeStore    Mooncake's distributed store, zero-copy against the registered host pool
                     (mooncake_store.py; needs the `mooncake` package)
    FaultyBackend    any backend with injected failures, timeouts and short reads (faults.py)
    PageLayout       where a host pool's pages lie in memory (uniradix.kernels layouts)

`uniradix.fast.storage.sglang_backend` wraps FileStore and MooncakeStore as subclasses of
sglang's own HiCacheStorage, for `--hicache-storage-backend dynamic` (docs/STORAGE.md).
"""
from .base import STORAGE_BATCH_SIZE, PageLayout, StorageBackend, StorageInputError, StorageStats
from .faults import Fault, FaultyBackend, InjectedStorageError
from .file_store import FileStore
from .mooncake_store import MooncakeMaster, MooncakeStore, mooncake_available

__all__ = [
    "STORAGE_BATCH_SIZE", "Fault", "FaultyBackend", "FileStore", "InjectedStorageError", "MooncakeMaster",
    "MooncakeStore",
    "PageLayout", "StorageBackend", "StorageInputError", "StorageStats", "mooncake_available",
]
