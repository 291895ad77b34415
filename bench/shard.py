"""Benchmark `streamctl shard` against `cp` of the same bytes: a synthetic Llama (the table engine), a
synthetic Mixtral (`--engine vllm-cpu`), each ~3 GB, and three real models' shapes at two depths each.

    python bench/shard.py [--case llama|moe|llama-8b|qwen3-moe|gemma3|real|all] [--layers 6] [--tp 2 4]
        [--moe-layers 32] [--moe-tp 2] [--llama-8b-layers 2 6] [--qwen3-layers 2 4] [--gemma3-layers 4 16]
        [--real-tp 2] [--llama-8b-engine auto|vllm-cpu] [--vllm-python PATH] [--repeat 3] [--keep-page-cache]
        [--dir PARENT]

Cases (`--case`, default all, one after another; each generates its checkpoint, measures, removes it):
- llama: Llama-3-8B's layer shapes with Llama-2's vocabulary, 6 layers (3.1 GB, 4 files), sharded by the
  offline (table) engine at TP 2 and TP 4. Targets: end-to-end throughput >= 0.7 x cp; peak RSS <= 2 x the
  largest tensor + 256 MiB.
- moe: a Mixtral-8x7B-shaped model scaled to ~3 GB: hidden 768, 6 heads of 128 (2 KV heads), 8 experts of
  intermediate 2432 (top 2), vocabulary 32000, 32 layers like Mixtral-8x7B's, so one decoder layer (all
  experts) is ~3% of the checkpoint, as there (bf16, 9 files of 4 layers each). Sharded by `--engine
  vllm-cpu` at TP 2 (`--vllm-python`, default $STREAMCTL_VLLM_PYTHON, else the environment streamctl
  builds or reuses for its default `--vllm-version`, built before any timing). Targets: end-to-end throughput >= 0.5 x cp; the
  worker's peak RSS <= the largest decoder layer (all experts) + the largest layer / TP + 1 GiB (the issue's
  formula). The worker's idle baseline, measured in the same run (a worker that imported and initialised
  vLLM and answered the plan request, whose meta-device builds allocate no weights), is reported too, with
  the formula plus that baseline beside it: the formula alone is the target.
- real (`llama-8b`, `qwen3-moe`, `gemma3`; bench/shard_real.py, shapes in bench/shard_shapes.py): a dense, an
  MoE and a multimodal model with the tensor names and shapes of meta-llama/Llama-3.1-8B, Qwen/Qwen3-30B-A3B
  (128 experts) and google/gemma-3-4b-it (SigLIP tower included), generated from their published
  config.json values (random bf16 values), each at two depths (default 2 and 6 layers: 3.0 and 4.7 GB;
  2 and 4: 3.7 and 6.2 GB; 4 and 16 text layers: 2.9 and 5.2 GB; the deep checkpoint and one output at a
  time must fit the scratch folder), at TP 2 (`--real-tp`); Llama through the table engine (`auto`), the
  other two through `--engine vllm-cpu`. Each round times cp and shard at both depths; the marginal ratio
  is cp's extra seconds for the extra layers over streamctl's, and the fixed start is streamctl's seconds
  at zero bytes on the line through both depths. Targets (issue 24): marginal >= 0.5 x cp's, fixed start
  <= 20 s. Reported beside them: the whole-run ratio at each depth, seconds per extra decoder layer against
  cp's, CPU seconds and the marginal CPU seconds per GB, the load average of each round.

One run, one disk: the checkpoint is generated into a scratch folder (PARENT, default the system temp
folder), copied with `cp` (and `sync` of the copies, because streamctl fsyncs every file it completes), and
sharded by `streamctl shard` as a subprocess for each TP size; each output is removed before the next run.
Every measurement starts alike: dirty pages synced, the page cache dropped when this process may
(root: /proc/sys/vm/drop_caches), then the source read once so it is cached. Each is repeated (--repeat)
in rounds (cp, then each TP size, back to back); each run's ratio is taken against its own round's cp and
the median of those ratios is reported, because this machine's disk and memory speed drift within minutes.

On the VM these figures come from, dropping the page cache has a side effect: `cp` run right after a drop
sometimes takes 1.4 s instead of its usual 3.4-3.9 s for the same 3.1 GB (most likely freed memory that the
balloon driver has not yet handed back to the host), and which rounds get it is luck. --keep-page-cache
measures without the drop; both views are worth a look.

Reported per run: seconds end to end (plan, write, copy the serving files, and the checks after writing:
verify-index and the bit-for-bit reconstruction for the table engine; verify-index, every tensor's sha256
re-read from DEST and vLLM's own ShardedStateLoader for vllm-cpu; each reads everything back), seconds until
the weights were complete (the `write_seconds` of --json), throughput of each against cp, and peak RSS:
the child's own (os.wait4, which folds in the worker it waited for) and, sampled from /proc every 0.1 s,
each process's own (the parent, the vLLM worker); CPU seconds (user + system, the worker's included), which a
machine busy with other work inflates far less than wall time. For vllm-cpu also where the time went, from
the run's own --json: worker start + plan (vLLM's import, init, the meta-device plan), the write request,
and the checks after writing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import (
    STREAMCTL,
    GiB,
    MiB,
    Table,
    Targets,
    human_bytes,
    process_peak,
    run_measured,
    scratch_dir,
)
from shard_real import RealCase, run_real_case
from shard_shapes import REAL_SHAPES
from streamctl.checkpoint.safetensors import encode_safetensors_header
from streamctl.shard.engines.vllm_cpu.client import WORKER_MODULE, plan_request, start_worker

BLOCK = 64 * MiB  # random bytes repeated through every tensor: cheap to generate, never all zeros
LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# Llama-3-8B's layer shapes with Llama-2's vocabulary: 6 layers make ~3 GiB, and the embedding (250 MiB)
# stays the largest tensor, so the memory target is a tight one (the writer must not hold a layer or a file).
LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
}
# Mixtral-8x7B (hidden 4096, 32 heads of 128 / 8 KV, 8 experts of 14336, 32 layers) scaled to ~3 GB with
# its layer count kept: a decoder layer (93 MB, 8 x 3 expert matrices of 3.7 MB) is 1/33 of the checkpoint.
MIXTRAL_CONFIG: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 768,
    "intermediate_size": 2432,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 1e6,
    "sliding_window": None,
    "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}


def attention_shapes(config: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q_rows, kv_rows = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        prefix + "self_attn.q_proj.weight": (q_rows, hidden),
        prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
        prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
        prefix + "self_attn.o_proj.weight": (hidden, q_rows),
    }


def llama_layer(config: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    return {
        **attention_shapes(config, prefix),
        prefix + "mlp.gate_proj.weight": (inter, hidden),
        prefix + "mlp.up_proj.weight": (inter, hidden),
        prefix + "mlp.down_proj.weight": (hidden, inter),
        prefix + "input_layernorm.weight": (hidden,),
        prefix + "post_attention_layernorm.weight": (hidden,),
    }


def mixtral_layer(config: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    moe = prefix + "block_sparse_moe."
    shapes = {**attention_shapes(config, prefix), moe + "gate.weight": (experts, hidden)}
    for expert in range(experts):
        e = f"{moe}experts.{expert}."
        shapes |= {e + "w1.weight": (inter, hidden), e + "w2.weight": (hidden, inter), e + "w3.weight": (inter, hidden)}
    return shapes | {
        prefix + "input_layernorm.weight": (hidden,),
        prefix + "post_attention_layernorm.weight": (hidden,),
    }


@dataclass(frozen=True)
class Model:
    name: str
    config: dict[str, Any]
    layer: Callable[[dict[str, Any], str], dict[str, tuple[int, ...]]]
    layers_per_file: int

    def shapes(self, layers: int) -> dict[str, tuple[int, ...]]:
        hidden, vocab = self.config["hidden_size"], self.config["vocab_size"]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        for layer in range(layers):
            shapes |= self.layer(self.config, f"model.layers.{layer}.")
        return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


LLAMA = Model("Llama", LLAMA_CONFIG, llama_layer, layers_per_file=2)
MIXTRAL = Model("Mixtral", MIXTRAL_CONFIG, mixtral_layer, layers_per_file=4)


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    total: int  # bytes of tensor data
    files: int
    largest_tensor: int
    largest_layer: int  # bytes of the largest decoder layer's tensors (every expert)
    tensors: dict[str, dict[str, Any]]  # the worker's plan request "tensors": where each tensor lies


def layer_index(name: str) -> int | None:
    match = LAYER.match(name)
    return int(match.group(1)) if match else None


def file_groups(names: list[str], layers_per_file: int) -> list[list[str]]:
    """HF-style shards: the embedding alone, then `layers_per_file` layers each; norm and head with the last."""
    groups: list[list[str]] = []
    for name in names:
        layer = layer_index(name)
        first_of_layer = layer is not None and name == f"model.layers.{layer}.self_attn.q_proj.weight"
        if not groups or (first_of_layer and layer is not None and layer % layers_per_file == 0):
            groups.append([])
        groups[-1].append(name)
    return groups


def write_checkpoint(folder: Path, model: Model, layers: int) -> Checkpoint:
    """Write the checkpoint (bf16, HF shards + index + config + tokenizer)."""
    folder.mkdir(parents=True)
    shapes = model.shapes(layers)
    block = np.random.default_rng(0).integers(0, 2**16, BLOCK // 2, dtype=np.uint16)
    block[(block & 0x7F80) == 0x7F80] &= 0xBFFF  # no NaN or infinity: the bytes stand for real weights
    payload = memoryview(block).cast("B")
    groups = file_groups(list(shapes), model.layers_per_file)
    weight_map: dict[str, str] = {}
    tensors: dict[str, dict[str, Any]] = {}
    for index, group in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        sizes = {name: int(np.prod(shapes[name])) * 2 for name in group}
        header, offsets = encode_safetensors_header([(name, "BF16", shapes[name], sizes[name]) for name in group])
        with open(folder / file, "wb") as handle:
            handle.write(header)
            for name in group:
                left = sizes[name]
                while left:
                    handle.write(payload[: min(left, BLOCK)])
                    left -= min(left, BLOCK)
        for name, (begin, end) in zip(group, offsets, strict=True):
            tensors[name] = {
                "file": file, "dtype": "BF16", "shape": list(shapes[name]), "offset": len(header) + begin,
                "nbytes": end - begin,
            }  # fmt: skip
        weight_map.update(dict.fromkeys(group, file))
    total = sum(entry["nbytes"] for entry in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (folder / "config.json").write_text(json.dumps({**model.config, "num_hidden_layers": layers}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    per_layer: dict[int, int] = {}
    for name, entry in tensors.items():
        layer = layer_index(name)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + entry["nbytes"]
    largest = max(entry["nbytes"] for entry in tensors.values())
    return Checkpoint(folder, total, len(groups), largest, max(per_layer.values(), default=0), tensors)


def settle(source: Path, drop: bool) -> None:
    """The same starting point for every measurement: nothing dirty, the source (only) in the page cache."""
    subprocess.run(["sync"], check=True)
    try:
        if drop:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        pass  # not root: the page cache keeps whatever it holds
    for file in source.glob("*.safetensors"):
        with open(file, "rb") as handle:
            while handle.read(64 * MiB):
                pass


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_cp(source: Path, dest: Path, drop: bool, read_back: bool = False) -> tuple[float, float]:
    """cp of the weight files, then sync of the copies (streamctl fsyncs what it writes): (seconds, CPU s).
    `read_back`: then every copied byte read back and hashed (sha256sum, on as many processes as cores): the
    floor of a run that keeps the README's checks after writing, which read back everything written once the
    files are complete, so that pass cannot overlap the writes."""
    files = sorted(source.glob("*.safetensors"))
    dest.mkdir()
    settle(source, drop)
    cpu, started = children_cpu_seconds(), time.monotonic()
    subprocess.run(["cp", *map(str, files), str(dest)], check=True)
    copies = [str(dest / file.name) for file in files]
    subprocess.run(["sync", *copies], check=True)
    if read_back:
        processes = str(os.cpu_count() or 1)
        subprocess.run(["xargs", "-0", "-n", "1", "-P", processes, "sha256sum"], input="\0".join(copies).encode(),
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    seconds, cpu = time.monotonic() - started, children_cpu_seconds() - cpu
    shutil.rmtree(dest)
    return seconds, cpu


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@dataclass(frozen=True)
class ShardRun:
    seconds: float
    write_seconds: float
    peak_rss: int  # wait4 of the streamctl process: its own peak or its worker's, whichever is larger
    cpu_s: float  # user + system CPU seconds of streamctl and its worker
    bytes_written: int
    parent_rss: int | None  # sampled: the streamctl process itself
    worker_rss: int | None  # sampled: the vLLM worker process (vllm-cpu only), its whole life
    worker_write_rss: int | None  # the worker's own VmHWM when it had written every tensor (engine_report)
    worker_python: str | None  # the worker's interpreter, as it ran
    worker_write_seconds: float | None  # the worker's own time on the write request (engine_report)
    checks: tuple[str, ...]  # the checks after writing that ran (all passed)


def is_worker(argv: tuple[str, ...]) -> bool:
    return WORKER_MODULE in argv


def time_shard(scratch: Path, tp: int, drop: bool, engine: list[str], source: Path | None = None) -> ShardRun | None:
    """One `streamctl shard` run of `source` (default scratch/hf) from the same starting point as cp's; its
    output is removed afterwards."""
    out, source = scratch / f"tp{tp}", source or scratch / "hf"
    settle(source, drop)
    command = [*STREAMCTL, "shard", str(source), str(out), "-tp", str(tp), *engine, "--json"]
    run = run_measured(command, env=dict(os.environ), watch=scratch / f"watch{tp}", tree_rss=True)
    if run.returncode != 0:
        print(run.stdout, run.stderr, sep="\n", file=sys.stderr)
        return None
    document = json.loads(run.stdout)
    checks = {name: check for name, check in document["checks"].items() if isinstance(check, dict)}
    failed = [name for name, check in checks.items() if check.get("ok") is False]
    if "verify" not in checks or failed:
        print(f"checks after writing failed or missing: {failed or 'verify'}\n{run.stdout}", file=sys.stderr)
        return None
    shutil.rmtree(out)
    parent = [peak.peak_rss for peak in run.descendants if peak.argv[1:3] == ("-m", "streamctl")]
    workers = [peak for peak in run.descendants if is_worker(peak.argv)]
    report = document.get("engine_report") or {}
    write_mib, worker_seconds = report.get("peak_rss_mib"), report.get("seconds")
    return ShardRun(
        run.seconds,
        document["write_seconds"],
        run.peak_rss,
        run.cpu_s,
        document["bytes_written"],
        max(parent, default=None),
        max((peak.peak_rss for peak in workers), default=None),
        int(write_mib * MiB) if isinstance(write_mib, (int, float)) else None,
        workers[0].argv[0] if workers else None,
        float(worker_seconds) if isinstance(worker_seconds, (int, float)) else None,
        tuple(name for name, check in checks.items() if check.get("ok")),
    )


def worker_baseline(vllm_python: str, checkpoint: Checkpoint, tp: int) -> int:
    """Peak RSS of a worker (started as a shard run starts it) that imported and initialised vLLM and answered
    the plan request for this checkpoint (meta-device builds of every rank: no weight is allocated or read):
    what it holds before the first layer."""
    folder = str(checkpoint.folder)
    request = plan_request(folder, checkpoint.tensors, folder, tp, 1, False, "auto", None)
    with start_worker(vllm_python) as worker:
        worker.request(request)
        reply = worker.receive(None)
        assert reply["type"] == "plan", reply
        peak = process_peak(worker.process.pid)
        assert peak is not None
        return peak.peak_rss


@dataclass(frozen=True)
class Case:
    name: str
    model: Model
    layers: int
    tps: list[int]
    engine: list[str]  # extra shard options
    target: float  # end-to-end throughput, x cp


def run_case(case: Case, scratch: Path, args: argparse.Namespace, targets: Targets) -> list[str] | None:
    """Generate the case's checkpoint, measure cp and every TP size in rounds, print the table; its verdicts."""
    print(f"[{case.name}] generating a {case.layers}-layer synthetic {case.model.name} in {scratch} ...", flush=True)
    checkpoint = write_checkpoint(scratch / "hf", case.model, case.layers)
    subprocess.run(["sync"], check=True)
    print(
        f"[{case.name}] checkpoint: {human_bytes(checkpoint.total)} in {checkpoint.files} files, largest tensor "
        f"{human_bytes(checkpoint.largest_tensor)}, largest layer {human_bytes(checkpoint.largest_layer)}",
        flush=True,
    )
    drop = not args.keep_page_cache
    cp_bytes = sum(file.stat().st_size for file in (scratch / "hf").glob("*.safetensors"))
    cp_runs: list[float] = []
    cp_cpu: list[float] = []
    runs: dict[int, list[ShardRun]] = {tp: [] for tp in case.tps}
    # Rounds, not blocks: cp and every TP size run back to back in each round, and each streamctl run
    # is compared with its own round's cp. This machine's disk and memory drift by 3x within minutes
    # (cp + sync of the same 3.1 GB took 1.3 s and 4.0 s in one session); a ratio taken within a round
    # sees the same drift on both sides, a ratio of medians from separate blocks does not.
    for round_number in range(args.repeat):
        cp_seconds, cp_cpu_seconds = time_cp(scratch / "hf", scratch / "cp", drop)
        cp_runs.append(cp_seconds)
        cp_cpu.append(cp_cpu_seconds)
        for tp in case.tps:
            run = time_shard(scratch, tp, drop, case.engine)
            if run is None:
                return None
            runs[tp].append(run)
        print(
            f"[{case.name}] round {round_number + 1}: cp {cp_runs[-1]:.2f} s, "
            + ", ".join(f"TP {tp} {runs[tp][-1].seconds:.2f} s" for tp in case.tps),
            flush=True,
        )
    verdicts = throughput_table(case, cp_bytes, cp_runs, median(cp_cpu), runs, targets)
    print_bounds(cp_bytes, cp_runs, runs)
    if case.engine:
        verdicts += worker_memory(case, checkpoint, runs, targets)
    else:
        rss_limit = 2 * checkpoint.largest_tensor + 256 * MiB
        for tp in case.tps:
            peak_rss = max(run.peak_rss for run in runs[tp])
            verdicts.append(
                targets.check(
                    peak_rss <= rss_limit,
                    f"{case.name} peak RSS TP {tp}",
                    f"{human_bytes(peak_rss)}, the largest of {args.repeat} runs (limit {human_bytes(rss_limit)})",
                )
            )
    shutil.rmtree(scratch / "hf")
    return verdicts


def throughput_table(
    case: Case, cp_bytes: int, cp_runs: list[float], cp_cpu: float, runs: dict[int, list[ShardRun]], targets: Targets
) -> list[str]:
    """The table of medians (CPU s: user + system of the command and what it waited for, which a busy
    machine inflates less than wall time) and the throughput verdicts."""
    cp_seconds = median(cp_runs)
    cp_rate = cp_bytes / cp_seconds
    headers = ["run (median)", "bytes", "seconds", "MB/s", "x cp", "write s", "write x cp", "CPU s", "peak RSS"]
    table = Table(headers)
    table.add(
        "cp + sync", human_bytes(cp_bytes), f"{cp_seconds:.2f}", f"{cp_rate / 1e6:.0f}", "1.00", "", "", f"{cp_cpu:.1f}", ""
    )  # fmt: skip
    verdicts = []
    for tp, tp_runs in runs.items():
        written = tp_runs[0].bytes_written
        # x cp = (bytes / seconds) / (cp bytes / cp seconds), per round; the median of the rounds.
        ratios = [written / run.seconds / (cp_bytes / cp) for run, cp in zip(tp_runs, cp_runs, strict=True)]
        write_ratios = [written / run.write_seconds / (cp_bytes / cp) for run, cp in zip(tp_runs, cp_runs, strict=True)]
        seconds = median([run.seconds for run in tp_runs])
        table.add(
            f"shard -tp {tp}" + (f" {' '.join(case.engine[:2])}" if case.engine else ""),
            human_bytes(written),
            f"{seconds:.2f}",
            f"{written / seconds / 1e6:.0f}",
            f"{median(ratios):.2f}",
            f"{median([run.write_seconds for run in tp_runs]):.2f}",
            f"{median(write_ratios):.2f}",
            f"{median([run.cpu_s for run in tp_runs]):.1f}",
            human_bytes(max(run.peak_rss for run in tp_runs)),
        )
        verdicts.append(
            targets.check(
                median(ratios) >= case.target,
                f"{case.name} throughput TP {tp}",
                f"{median(ratios):.2f} x cp end to end, the median of per-round ratios "
                f"({', '.join(f'{ratio:.2f}' for ratio in ratios)}; target >= {case.target}); weights complete "
                f"after {median(write_ratios):.2f} x cp; checks after writing: {', '.join(tp_runs[0].checks)}",
            )
        )
    table.print()
    for tp, tp_runs in runs.items():
        phases = [run for run in tp_runs if run.worker_write_seconds is not None]
        if phases:  # vllm-cpu: where the seconds went, from the run's own JSON
            start = median([run.write_seconds - (run.worker_write_seconds or 0) for run in phases])
            write = median([run.worker_write_seconds or 0 for run in phases])
            checks = median([run.seconds - run.write_seconds for run in phases])
            print(
                f"TP {tp} phases (median s): worker start + plan {start:.1f}, write {write:.1f} "
                f"(the worker's own write request: build, load_weights, sha256, pipe, the parent's writes), "
                f"checks after writing {checks:.1f} (verify-index, tensors re-read, vLLM's loader)"
            )
    return verdicts


def print_bounds(cp_bytes: int, cp_runs: list[float], runs: dict[int, list[ShardRun]]) -> None:
    """vllm-cpu: what bounds its ratio, from the same rounds (informational, no target). The worker's fixed
    cost (its start: vLLM's import and init, then the plan) is paid once per run whatever the checkpoint's
    size; the ratio it alone allows for these bytes, and the throughput of the rest (write and checks)."""
    cp = median(cp_runs)
    for tp, tp_runs in runs.items():
        phases = [run for run in tp_runs if run.worker_write_seconds is not None]
        if not phases:
            continue
        fixed = median([run.write_seconds - (run.worker_write_seconds or 0) for run in phases])
        rest = median([run.bytes_written / (run.seconds - fixed) / (cp_bytes / cp) for run in phases])
        print(
            f"TP {tp} bounds: the fixed cost (worker start + plan: vLLM's import and init) of {fixed:.1f} s alone "
            f"allows at most {cp / fixed:.2f} x cp end to end for these bytes, however fast the rest; without it "
            f"(write and checks) the run moved {rest:.2f} x cp"
        )


def worker_memory(case: Case, checkpoint: Checkpoint, runs: dict[int, list[ShardRun]], targets: Targets) -> list[str]:
    """The worker's peak RSS while writing against the issue's formula (the target), and against the formula
    plus the worker's idle baseline; its peak over its whole life (vLLM's loader check included) beside them."""
    verdicts = []
    layer = checkpoint.largest_layer
    for tp, tp_runs in runs.items():
        written = [run.worker_write_rss for run in tp_runs if run.worker_write_rss is not None]
        python = next((run.worker_python for run in tp_runs if run.worker_python), None)
        if not written or python is None:
            verdicts.append(targets.check(False, f"{case.name} worker RSS TP {tp}", "no worker peak was reported"))
            continue
        peak, formula = max(written), layer + layer // tp + GiB
        baseline = worker_baseline(python, checkpoint, tp)
        lifetime = max((run.worker_rss or 0 for run in tp_runs), default=0)
        parent = max((run.parent_rss or 0 for run in tp_runs), default=0)
        verdicts.append(
            targets.check(
                peak <= formula,
                f"{case.name} worker peak RSS while writing, TP {tp}",
                f"{peak / MiB:.0f} MiB, the largest of {len(written)} runs; formula: layer {layer / MiB:.0f} + "
                f"layer/TP {layer // tp / MiB:.0f} + 1024 = {formula / MiB:.0f} MiB. Idle baseline (import, init, "
                f"plan) {baseline / MiB:.0f} MiB: {(peak - baseline) / MiB:.0f} MiB above it, against formula + "
                f"baseline {(formula + baseline) / MiB:.0f} MiB. Whole life, vLLM's loader check of whole ranks "
                f"included: {lifetime / MiB:.0f} MiB; the parent's own peak {parent / MiB:.0f} MiB",
            )
        )
    return verdicts


REAL_TP = 2
MARGINAL_TARGET = 0.5  # x cp's extra seconds per extra byte (issue 24)
FIXED_START_TARGET_S = 20.0


def uses_vllm_cpu(args: argparse.Namespace) -> bool:
    return args.case != "llama" and not (args.case == "llama-8b" and args.llama_8b_engine != "vllm-cpu")


def vllm_python(args: argparse.Namespace) -> str:
    """--vllm-python, else streamctl's cached environment, built now if need be: before any timing, so the
    first run does not count a one-off build (minutes)."""
    if args.vllm_python:
        return str(args.vllm_python)
    from streamctl.progress import NULL_PROGRESS
    from streamctl.shard.engines.vllm_cpu.env import resolve_vllm_python

    print("the vllm-cpu cases' vLLM environment: streamctl's cached one (built first if need be) ...", flush=True)
    return resolve_vllm_python(None, None, NULL_PROGRESS).path


def real_cases(args: argparse.Namespace, vllm_cpu: list[str]) -> list[RealCase]:
    chosen = {"real": list(REAL_SHAPES), "all": list(REAL_SHAPES)}.get(args.case, [args.case])
    depths = {"llama-8b": args.llama_8b_layers, "qwen3-moe": args.qwen3_layers, "gemma3": args.gemma3_layers}
    engines = {
        "llama-8b": vllm_cpu if args.llama_8b_engine == "vllm-cpu" else [],
        "qwen3-moe": vllm_cpu,
        "gemma3": vllm_cpu,
    }
    return [
        RealCase(key, REAL_SHAPES[key], tuple(depths[key]), engines[key], MARGINAL_TARGET, FIXED_START_TARGET_S)
        for key in REAL_SHAPES
        if key in chosen
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["llama", "moe", *REAL_SHAPES, "real", "all"], default="all")
    parser.add_argument("--layers", type=int, default=6, help="llama: decoder layers (~416 MiB each)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="llama: TP sizes")
    parser.add_argument("--moe-layers", type=int, default=32, help="moe: decoder layers (~93 MB each)")
    parser.add_argument("--moe-tp", type=int, nargs="+", default=[2], help="moe: TP sizes")
    parser.add_argument("--llama-8b-layers", type=int, nargs=2, default=[2, 6], help="llama-8b: the two depths")
    parser.add_argument("--llama-8b-engine", choices=["auto", "vllm-cpu"], default="auto", help="llama-8b's engine")
    parser.add_argument("--qwen3-layers", type=int, nargs=2, default=[2, 4], help="qwen3-moe: the two depths")
    parser.add_argument("--gemma3-layers", type=int, nargs=2, default=[4, 16], help="gemma3: the two text depths")
    parser.add_argument("--real-tp", type=int, default=REAL_TP, help="the real-shape cases' TP size")
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("STREAMCTL_VLLM_PYTHON"),
        help="vllm-cpu cases: the vLLM environment's python (default $STREAMCTL_VLLM_PYTHON; without either, "
        "streamctl's own choice: its cached environment for the default --vllm-version)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="parent folder for the scratch data")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (the median is shown)")
    parser.add_argument(
        "--keep-page-cache",
        action="store_true",
        help="do not drop the page cache before each run (on this VM, cp right after a drop sometimes runs "
        "2-3x faster than otherwise; see the module docstring)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    vllm_cpu = ["--engine", "vllm-cpu", "--vllm-python", vllm_python(args)] if uses_vllm_cpu(args) else []
    cases = []
    if args.case in ("llama", "all"):
        cases.append(Case("llama", LLAMA, args.layers, args.tp, [], 0.7))
    if args.case in ("moe", "all"):
        cases.append(Case("moe", MIXTRAL, args.moe_layers, args.moe_tp, vllm_cpu, 0.5))
    targets = Targets()
    verdicts: list[str] = []
    print(f"load average at the start: {' '.join(f'{load:.1f}' for load in os.getloadavg())}", flush=True)
    for case in cases:
        with scratch_space(args.dir) as scratch:
            found = run_case(case, scratch, args, targets)
        if found is None:
            return 1
        verdicts += found
    for real in real_cases(args, vllm_cpu):
        with scratch_space(args.dir) as scratch:
            found = run_real_case(real, scratch, args.real_tp, args, targets, (time_cp, time_shard))
        if found is None:
            return 1
        verdicts += found
    print(f"load average at the end: {' '.join(f'{load:.1f}' for load in os.getloadavg())}")
    for line in verdicts:
        print(line)
    return targets.exit_status()


@contextmanager
def scratch_space(parent: Path | None) -> Iterator[Path]:
    """A temporary folder, or a caller-chosen one under PARENT; emptied afterwards either way."""
    if parent is None:
        with scratch_dir("streamctl-bench-shard-") as path:
            yield path
        return
    path = parent / "streamctl-bench-shard"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
