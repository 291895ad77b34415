"""Helpers of the `shard --engine vllm-cpu` tests: one vLLM worker process shared by a whole session
(vLLM's import and initialisation cost ~6-10 s a process); see the `shared_vllm_worker` fixture in
tests/shard/conftest.py."""

from __future__ import annotations

from dataclasses import dataclass

from streamctl.shard.engines.vllm_cpu.client import VllmWorker, start_worker


@dataclass
class SharedWorker:
    python: str
    worker: VllmWorker | None = None
    started: int = 0  # how many worker processes this session needed

    def get(self) -> VllmWorker:
        """The running worker; a fresh one when there is none yet or the last run broke it."""
        if self.worker is None or self.worker.broken is not None or self.worker.process.poll() is not None:
            if self.worker is not None:
                self.worker.close()
            self.worker = start_worker(self.python)
            self.started += 1
        return self.worker

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
