"""`serve`'s pre-flight: one header pass over the checkpoint (verify-index's checks, as the streamer reads
them) before any GPU spins, and the layout rule when the pre-flight is off (one listing)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from streamctl.checkpoint.files import TRUST_REMOTE_CODE, RepoKind, needs_mistral_tokenizer_mode, read_repo_kind
from streamctl.common.words import plural
from streamctl.errors import PreflightFailed, StreamctlError, UsageError
from streamctl.progress import Progress
from streamctl.serve.plan import CheckpointFacts, ServeOptions
from streamctl.serve.vllm_args import takes
from streamctl.storage.base import Location
from streamctl.verify.reading import Listing
from streamctl.verify.report import TRANSFER_INCOMPLETE_CODE, Expectation, VerifyOptions
from streamctl.verify.run import listed_layout, verify_checkpoint

TOKENIZER_MODE = "--tokenizer-mode"


@dataclass(frozen=True)
class Preflight:
    """What the launch plan needs from the checkpoint: its layout, and its sizes when headers were read."""

    sharded: bool
    facts: CheckpointFacts | None  # None without the pre-flight
    warnings: tuple[str, ...] = field(default=())  # for the launch plan: a copy still in progress (--worker)
    vllm_args: tuple[str, ...] = field(default=())  # vLLM options the checkpoint needs that the user did not give
    # without the pre-flight: the top-level .safetensors bytes of its one listing (None: the layout was given,
    # nothing was read); with it, facts.total_bytes
    listed_bytes: int | None = None
    experts: int = 0  # routed experts per layer in config.json (0: no MoE, or config.json not read)

    @property
    def checkpoint_bytes(self) -> int | None:
        """The weights' bytes, from the headers' pass or the listing; None when nothing was read."""
        return self.facts.total_bytes if self.facts is not None else self.listed_bytes


def check_checkpoint(location: Location, options: ServeOptions, progress: Progress) -> Preflight:
    """The pre-flight when `options.preflight`, else the layout alone. PreflightFailed (exit 1) on errors;
    UsageError (exit 2) for what vLLM cannot serve as asked (an adapter, custom code not trusted), except
    with --no-preflight and the layout forced, which reads nothing."""
    if not options.preflight:
        sharded, listing = layout_without_preflight(location, options)  # first: its errors say the way round
        if listing is None:  # the layout given: --no-preflight then reads nothing
            return Preflight(sharded=sharded, facts=None)
        kind = check_repo_kind(location, options, listing.sizes)
        warnings, vllm_args = added_vllm_args(listing.sizes, options)
        weights = sum(size for name, size in listing.top_level.items() if name.endswith(".safetensors"))
        return Preflight(
            sharded=sharded,
            facts=None,
            warnings=warnings,
            vllm_args=vllm_args,
            listed_bytes=weights,
            experts=kind.experts,
        )
    sizes = {location.relative(info.key): info.size for info in location.list()}
    kind = check_repo_kind(location, options, sizes)
    added_warnings, vllm_args = added_vllm_args(sizes, options)
    engram = options.engram
    report = verify_checkpoint(
        location,
        VerifyOptions(
            sharded=options.sharded,
            pattern=options.pattern,
            expectations=tuple(Expectation(glob, engram.cpu_weight_files) for glob in engram.engram_globs),
            tensor_parallel_size=options.tensor_parallel_size if options.sharded or options.pattern else None,
            for_streamer=True,
        ),
        progress,
    )
    if not report.ok:
        raise PreflightFailed(
            f"pre-flight found {plural(report.error_count, 'error')} in {report.checkpoint}",
            hint="fix them (see the table above), or pass --no-preflight to launch anyway",
            report=report,
            details=report.to_json(),  # the findings, as verify-index --json shows them
        )
    sharded = report.layout == "sharded"
    facts = CheckpointFacts(
        total_bytes=report.stats.total_bytes,
        largest_tensor_bytes=report.stats.largest_tensor_bytes,
        files=report.stats.files,
        sharded_ranks=report.tensor_parallel_size if sharded else None,
    )
    incomplete = tuple(
        f"{report.checkpoint}: {finding.message}"
        for finding in report.warnings
        if finding.code == TRANSFER_INCOMPLETE_CODE
    )
    return Preflight(
        sharded=sharded,
        facts=facts,
        warnings=incomplete + added_warnings,
        vllm_args=vllm_args,
        experts=kind.experts,
    )


def layout_without_preflight(location: Location, options: ServeOptions) -> tuple[bool, Listing | None]:
    """Whether to launch the sharded loader when the pre-flight is off: as forced (--sharded/--not-sharded,
    --pattern implies sharded; no listing), else detected from one listing, the pre-flight's own layout rule,
    returned with it."""
    if options.sharded is not None:
        return options.sharded, None
    if options.pattern is not None:
        return True, None
    try:
        layout, listing = listed_layout(location, VerifyOptions())
        return layout == "sharded", listing
    except StreamctlError as error:
        error.hint = "pass --sharded or --not-sharded to launch without listing the checkpoint" + (
            f" ({error.hint})" if error.hint else ""
        )
        raise


def trusts_remote_code(vllm_args: tuple[str, ...]) -> bool:
    """Whether vLLM would run with --trust-remote-code: the last of --trust-remote-code and
    --no-trust-remote-code given after `--` wins, as argparse has it."""
    given = [arg for arg in vllm_args if takes(arg, TRUST_REMOTE_CODE) or takes(arg, "--no-trust-remote-code")]
    return bool(given) and takes(given[-1], TRUST_REMOTE_CODE)


def check_repo_kind(location: Location, options: ServeOptions, sizes: Mapping[str, int]) -> RepoKind:
    """Refuse (exit 2, before any GPU spins) what `vllm serve LOCATION` as planned would refuse or misread:
    an adapter (served on its base model) and a repo whose own code vLLM must run, unless the user passed
    --trust-remote-code after `--`. Never added for them: it runs the repo's code on this host. `sizes`: the
    listing (relative name -> bytes). Returns what it read (the experts too)."""
    kind = read_repo_kind(location, sizes)
    if kind.adapter:
        raise UsageError(
            f"{options.model} is an adapter of {kind.base_model or 'a base model adapter_config.json does not name'}, "
            "not a model",
            hint=kind.adapter_hint(options.model),
        )
    if kind.custom_code is not None and not trusts_remote_code(options.vllm_args):
        raise UsageError(
            f"{options.model} runs its own code ({kind.custom_code}); vLLM refuses it without {TRUST_REMOTE_CODE}",
            hint=f"review the repo's .py files, then pass -- {TRUST_REMOTE_CODE} (it runs that code on this host)",
        )
    return kind


def added_vllm_args(sizes: Mapping[str, int], options: ServeOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(notes, vLLM options) for what is harmless, needed, and not given: `--tokenizer-mode mistral` on a copy
    of a repo in both formats, so vLLM chooses the tokenizer it chose on the source
    (needs_mistral_tokenizer_mode). Said in a note; the user's own --tokenizer-mode wins."""
    top_level = [name for name in sizes if "/" not in name]
    if not needs_mistral_tokenizer_mode(top_level) or any(takes(arg, TOKENIZER_MODE) for arg in options.vllm_args):
        return (), ()
    note = (
        f"added {TOKENIZER_MODE} mistral: {options.model} has Mistral's own tokenizer but no consolidated*"
        ".safetensors, so vLLM's auto mode would pick the HF tokenizer the source did not use "
        f"(pass -- {TOKENIZER_MODE} hf to keep that one)"
    )
    return (note,), (TOKENIZER_MODE, "mistral")
