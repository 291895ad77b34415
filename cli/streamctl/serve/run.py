"""`streamctl serve` end to end, all but the printing: the pre-flight, the launch plan, `--tune`, the
Kubernetes manifests, and the exec that hands this process over to vLLM."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NoReturn

from streamctl.errors import MissingProgramError, UsageError
from streamctl.k8s import ENGINE_START_S, ServeManifestOptions, StartupBudget, serve_pod_yaml
from streamctl.k8s_kserve import kserve_yaml
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.serve.plan import (
    POD_SECRET_WARNING,
    CheckpointFacts,
    LaunchPlan,
    ServeOptions,
    cuda_available,
    expert_notes,
    find_vllm,
    host_memory_bytes,
    plan_launch,
)
from streamctl.serve.preflight import check_checkpoint
from streamctl.serve.tune import TuneResult, top_level_shards, tune_concurrency
from streamctl.storage import open_location

UNSIZED_STARTUP_WARNING = (
    f"the checkpoint's size is unknown (--no-preflight with the layout given reads nothing): the startup probe "
    f"waits {ENGINE_START_S} s, the engine's start only; run the pre-flight, or drop --sharded/--not-sharded, "
    "to size it for the weights"
)


@dataclass(frozen=True)
class ServeResult:
    """A checked launch: what `--dry-run`, `--json` and `--k8s` print, and what `exec_vllm` runs."""

    options: ServeOptions
    plan: LaunchPlan
    facts: CheckpointFacts | None  # None without the pre-flight
    tune: TuneResult | None  # with --tune: the measurements; `plan` uses the best concurrency
    environ: Mapping[str, str] = field(repr=False)  # the environment vLLM inherits (plan.launch_env() on top)
    checkpoint_bytes: int | None = None  # the pre-flight's, or --no-preflight's one listing's; None: not read

    @property
    def startup(self) -> StartupBudget:
        """The pod's startup budget: the checkpoint's bytes at the --tune figure, else at the default rate."""
        best = self.tune.best if self.tune is not None else None
        measured = best.bytes / best.seconds if best is not None and best.seconds > 0 else None
        return StartupBudget.for_checkpoint(self.checkpoint_bytes, measured)

    def to_json(self) -> dict[str, object]:
        """`serve --json`'s document: the plan, secrets masked, and the measurements with --tune."""
        document = self.plan.to_json()
        if self.tune is not None:
            document["tune"] = self.tune.to_json()
        return document

    def warnings_for(self, kubernetes: ServeManifestOptions | None) -> tuple[str, ...]:
        """The plan's warnings, less what a pod with a cloud identity needs not hear (a key for its --secret)."""
        if kubernetes is None or kubernetes.identity is None:
            return self.plan.warnings
        return tuple(warning for warning in self.plan.warnings if POD_SECRET_WARNING not in warning)

    def kubernetes_yaml(self, kubernetes: ServeManifestOptions) -> str:
        """`serve --k8s`'s YAML (`--kserve`'s); UsageError when it would hold a secret in clear text."""
        if kubernetes.kserve:
            return kserve_yaml(self.plan, self.facts, self.options, kubernetes, startup=self.startup)
        return serve_pod_yaml(self.plan, self.facts, self.options, kubernetes, startup=self.startup)


def prepare_launch(
    options: ServeOptions,
    *,
    for_kubernetes: bool = False,
    progress: Progress = NULL_PROGRESS,
    environ: Mapping[str, str] | None = None,
) -> ServeResult:
    """Check the checkpoint (unless options.preflight is off), plan the launch, measure with options.tune.

    For a manifest the plan is about the pod, never this host: it has one GPU per TP rank and its own memory.
    """
    options.validate()
    if options.engram.enabled and not options.preflight:
        raise UsageError(
            "--cpu-weight-files needs the pre-flight: it checks that the index places the Engram tensors in those files",
            hint="drop --no-preflight",
        )
    environ = dict(os.environ if environ is None else environ)
    # The pre-flight reads what vLLM will: vLLM opens a local folder's links wherever they lead (a Hugging
    # Face cache snapshot is all links), so they are followed here too; FIFOs and devices are still refused.
    location = open_location(options.model, replace(options.storage, follow_symlinks=True))
    checked = check_checkpoint(location, options, progress)
    target_cuda, target_memory = (True, None) if for_kubernetes else (cuda_available(environ), host_memory_bytes())

    def plan_for(chosen: ServeOptions) -> LaunchPlan:
        plan = plan_launch(
            replace(chosen, vllm_args=checked.vllm_args + chosen.vllm_args),
            checked.facts,
            sharded=checked.sharded,
            environ=environ,
            cuda_available=target_cuda,
            host_memory_bytes=target_memory,
            for_kubernetes=for_kubernetes,
        )
        return replace(plan, warnings=checked.warnings + plan.warnings)

    plan = plan_for(options)
    notes, expert_warnings = expert_notes(options, checked.experts, sharded=checked.sharded)
    tune_result = None
    if options.tune:
        tune_result = tune_concurrency(location, top_level_shards(location), plan.launch_env(), progress=progress)
        plan = plan_for(replace(options, concurrency=tune_result.best.concurrency))
    plan = replace(plan, notes=(*plan.notes, *notes), warnings=(*plan.warnings, *expert_warnings))
    if for_kubernetes and checked.checkpoint_bytes is None:
        plan = replace(plan, warnings=(*plan.warnings, UNSIZED_STARTUP_WARNING))
    return ServeResult(options, plan, checked.facts, tune_result, environ, checkpoint_bytes=checked.checkpoint_bytes)


def exec_vllm(result: ServeResult) -> NoReturn:
    """Replace this process with `vllm serve`: signals and the exit code are then vLLM's own."""
    executable = find_vllm(result.environ)
    if executable is None:
        raise MissingProgramError("vllm is not installed (no `vllm` on PATH)", hint="pip install 'streamctl[vllm]'")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, [executable, *result.plan.argv[1:]], {**result.environ, **result.plan.launch_env()})
