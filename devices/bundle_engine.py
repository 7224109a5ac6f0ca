"""The engine over an exported bundle: each role resolved to a device (devices.registry; `--draft auto`:
devices.auto_draft), the workers placed (devices.placement) and each role loaded in a thread pinned like its worker
(devices.bundles). Choosing between a bundle and torch is devices.engines'.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from mirror_rt.devices.auto_draft import AUTO, candidates
from mirror_rt.devices.bundles import (
    WorkerBudget,
    bundle_format,
    check_address_space,
    draft_copies_target,
    in_background,
    load_model,
    load_tokenizer,
    role_graphs,
)
from mirror_rt.devices.options import EngineConfig
from mirror_rt.devices.placement import plan
from mirror_rt.devices.registry import resolve_noted, stderr_line
from mirror_rt.runtime.affinity import available_cores
from mirror_rt.runtime.engine import Engine, GenerationError


def load_bundle(options: EngineConfig, mode: str | None = None, verify: bool = True) -> Engine:
    """An `Engine` over `options.models.bundle` (its target, and its draft unless `draft_bundle` names another).

    `options`: each role's device (`devices.target`, `devices.draft`; a missing one falls back to the fastest CPU
    backend with a warning, or fails with `strict_devices`), `devices.threads` (each worker's, unpinned) and
    `precision.draft_precision` (OpenVINO's CPU compute precision of the draft: it moves acceptance, never the output).
    `mode`: the mode the engine will mostly run, for placement (None: Mirror). `verify`: check every file's sha256.
    """
    from mirror_rt.exporters.manifest import read_manifest

    started = time.perf_counter()
    bundle, devices = options.models.bundle, options.devices
    manifest = read_manifest(bundle, verify=verify)
    draft_source = options.models.draft_bundle or bundle
    draft_manifest = manifest if draft_source == bundle else read_manifest(draft_source, verify=verify)
    if draft_manifest.vocab_size > manifest.vocab_size:  # (fewer: a family draft's embedding with less padding)
        raise GenerationError(f"vocabulary mismatch: target bundle has {manifest.vocab_size} tokens, "
                              f"draft bundle has {draft_manifest.vocab_size}")
    strict = devices.strict_devices
    found = candidates(bundle_format(draft_manifest, "draft")) if devices.draft == AUTO else []
    asked_draft = (found or ["cpu"])[0] if devices.draft == AUTO else devices.draft  # auto: first the CPU
    target_where, target_fell = resolve_noted(devices.target, strict, bundle_format(manifest, "target"))
    draft_where, draft_fell = resolve_noted(asked_draft, strict, bundle_format(draft_manifest, "draft"))
    fallbacks = {role: asked for role, asked, fell in (("target", devices.target, target_fell),
                                                         ("draft", asked_draft, draft_fell)) if fell}
    placement = replace(plan(str(target_where), str(draft_where), mode, sorted(available_cores()), devices.threads),
                        fallbacks=fallbacks)
    jobs = _jobs(options, (bundle, manifest, target_where), (draft_source, draft_manifest, draft_where), placement)
    check_address_space([*role_graphs(bundle, manifest, "target"), *role_graphs(draft_source, draft_manifest, "draft")],
                        f"loading {Path(bundle).name}")  # before any session or the tokenizer may fail to allocate
    tokenizer = in_background(load_tokenizer, Path(bundle), manifest)  # while the workers load their sessions
    target, draft = in_worker_threads(jobs)
    tokenizer = tokenizer()
    chosen_mode, auto_rows = None, [f"draft auto: {', '.join(found)} only: nothing to choose"] if found else []
    if len(found) > 1:  # --draft auto with a choice to make: time every candidate beside the target
        target, draft, placement, chosen_mode, auto_rows = _auto_draft(options, jobs, (target, draft, tokenizer),
                                                                       found, placement, mode)
    if draft.max_seq_len < target.max_seq_len:  # a static draft of a short context beside a long target
        stderr_line(f"mirror-rt: the draft holds {draft.max_seq_len} positions, the target {target.max_seq_len}: "
                    f"the context is {draft.max_seq_len}")
        target.max_seq_len = draft.max_seq_len  # every request's limit, in every mode (the draft's cache fills)
    both = placement.worker_cores
    # the draft starts from the target's KV only when it is the target's copy and reads its pool rows
    reads = draft.capabilities.rows and draft_copies_target(manifest, draft_manifest) and draft.can_adopt(target)
    draft.capabilities = replace(draft.capabilities, reads_target_rows=reads)
    names = {"model": Path(bundle).name, "target": f"{bundle} ({type(target).__name__})",
             "draft": f"{draft_source} ({type(draft).__name__})", "path": f"{manifest.graph_format} bundle",
             "target_device": placement.target, "draft_device": placement.draft,
             "target_precision": manifest.graph("target_prefix").precision,
             "draft_precision": draft_manifest.graph("draft").precision, "placement": placement.describe()}
    engine_class = TargetOnlyEngine if chosen_mode == "ar" else Engine
    return engine_class(target, tokenizer, draft, names, both, placement, manifest, batch=options.batch,
                        load_time_s=round(time.perf_counter() - started, 3), draft_auto=auto_rows)


class TargetOnlyEngine(Engine):
    """An engine whose requests decode target-only unless they name a mode (`--draft auto` found no draft that pays)."""

    @property
    def default_mode(self) -> str:
        return "ar"


def _jobs(options: EngineConfig, target_side: tuple, draft_side: tuple, placement) -> list[tuple]:
    """The two load jobs (in_worker_threads) of a target and a draft placed by `placement`."""
    strict = options.devices.strict_devices
    # the target's prompt may also use the draft's (idle) core, and both roles every core in spread steps
    target_budget = WorkerBudget(placement.target_threads, placement.target_cpus, None, placement.prompt_cpus)
    draft_budget = WorkerBudget(placement.draft_threads, placement.draft_cpus, options.precision.draft_precision,
                                placement.prompt_cpus)
    return [(*target_side[:2], "target", target_side[2], strict, target_budget),
            (*draft_side[:2], "draft", draft_side[2], strict, draft_budget)]


def _auto_draft(options: EngineConfig, jobs: list, loaded: tuple, found: list[str], placement, mode):
    """Load the draft on every other candidate, time them all beside the target (`loaded`: target, draft, tokenizer),
    keep the best (devices.auto_draft; one line says which), reloading the target when its placement changes."""
    from mirror_rt.devices.auto_draft import pick
    from mirror_rt.runtime.config import GenerationConfig

    target, draft, tokenizer = loaded
    cores, threads = sorted(available_cores()), options.devices.threads
    target_side, draft_side = jobs[0][:2] + (jobs[0][3],), jobs[1][:2]
    drafts = {placement.draft: draft}
    for device in found[1:]:
        where = plan(placement.target, device, mode, cores, threads)
        drafts[device] = in_worker_threads([_jobs(options, target_side, draft_side + (device,), where)[1]])[0]
    best, line, rows = pick(target, placement.target, drafts, tokenizer, GenerationConfig().gamma,
                            cpu_concurrent=placement.worker_cores is not None,
                            threads=(placement.target_threads, placement.draft_threads))
    stderr_line(line)
    rows = [line.removeprefix("mirror-rt: ")] + rows
    if best.draft is None:
        return target, draft, placement, best.mode, rows
    chosen = replace(plan(placement.target, best.draft, mode, cores, threads, best.draft_cores),
                     fallbacks=placement.fallbacks)  # the draft's cores as its measured cost needs
    loaded = placement if best.draft == placement.draft else plan(placement.target, best.draft, mode, cores, threads)
    if (chosen.target_threads, chosen.target_cpus) != (placement.target_threads, placement.target_cpus):
        target = in_worker_threads([_jobs(options, target_side, draft_side + (best.draft,), chosen)[0]])[0]
    if (chosen.draft_threads, chosen.draft_cpus) != (loaded.draft_threads, loaded.draft_cpus):
        drafts[best.draft] = in_worker_threads([_jobs(options, target_side, draft_side + (best.draft,), chosen)[1]])[0]
    return target, drafts[best.draft], chosen, best.mode, rows


def in_worker_thread(folder, manifest, role, device, strict, budget):
    """Load one model in a short-lived thread pinned like its worker, so backend pools inherit the pin."""
    return in_worker_threads([(folder, manifest, role, device, strict, budget)])[0]


def in_worker_threads(jobs: list[tuple]) -> list:
    """`in_worker_thread` for several models at once, in parallel; the first failure is re-raised once all ended."""
    results = [{} for _ in jobs]

    def work(result, folder, manifest, role, device, strict, budget):
        try:
            result["model"] = load_model(Path(folder), manifest, role, device, strict, budget)
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    threads = [threading.Thread(target=work, args=(result, *job), name=f"load-{job[2]}")
               for result, job in zip(results, jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if "error" in result:
            raise result["error"]
    return [result["model"] for result in results]
