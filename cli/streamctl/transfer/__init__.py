"""Copy a model (Hugging Face repo, local folder or bucket prefix) into a bucket or folder.

- plan: list both sides, choose the files, decide copy or skip, and what --force removes (writes nothing);
- hashing: the sha256 (and git blob sha1) each file is checked by;
- engine: parts read, hashed in order and uploaded by one pool of threads, within a byte budget, resumable;
- run: the write phase under DEST's lease, the manifest, and the whole command (`run_transfer`).

The names callers use are re-exported here.
"""

from streamctl.transfer.engine import Engine
from streamctl.transfer.hashing import GIT_SHA1_KEY, HASH_CHUNK, Digests, hash_object
from streamctl.transfer.plan import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_BUFFER,
    DEFAULT_PART_SIZE,
    FilePlan,
    TransferOptions,
    TransferPlan,
    plan_transfer,
)
from streamctl.transfer.run import TransferResult, TransferRun, execute_transfer, run_transfer, transfer_manifest

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MAX_BUFFER",
    "DEFAULT_PART_SIZE",
    "GIT_SHA1_KEY",
    "HASH_CHUNK",
    "Digests",
    "Engine",
    "FilePlan",
    "TransferOptions",
    "TransferPlan",
    "TransferResult",
    "TransferRun",
    "execute_transfer",
    "hash_object",
    "plan_transfer",
    "run_transfer",
    "transfer_manifest",
]
