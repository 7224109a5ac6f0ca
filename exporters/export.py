"""`export_bundle`: a target (and draft) to a self-describing bundle folder.

Graphs in one format (openvino, onnx, torch), the tokenizer files, then manifest.json last: an interrupted
export leaves no manifest and is refused on load. Limits are validated before any conversion. Defaults: the draft
is the target itself at `auto` weights (q4_1 where the model's weights are Q4_1 blocks, else int8), the exit int8
(it only picks which branches are drafted), the target fp32.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from mirror_rt.exporters.export_config import ExportConfig, ExportError
from mirror_rt.exporters.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    BundleManifest,
    GraphEntry,
    hash_files,
    write_manifest,
)
from mirror_rt.exporters.q4_min import holds_q4_1
from mirror_rt.exporters.shared_kv import GQA_HEAD_MULTIPLE
from mirror_rt.exporters.split import (
    KV_LAYOUT,
    PAST_NAMES,
    PRESENT_NAMES,
    ROLES,
    graph_spec,
    mixes_exit,
    with_exit_adapter,
)
from mirror_rt.models.config import SplitConfig
from mirror_rt.models.pruned_head import PrunedHeadDraft, load_kept
from mirror_rt.models.tokenizer_files import TOKENIZER_FILES

VERSIONED = ("mirror-rt", "torch", "openvino", "nncf", "openvino-tokenizers", "onnx", "onnxruntime",
             "transformers")
STATIC_DEFAULT_CONTEXT, STATIC_DEFAULT_WINDOW, MAX_STATIC_WINDOW = 1024, 8, 64


@dataclass(frozen=True)
class Limits:
    """Resolved, validated shape limits of one bundle."""

    exit_layer: int
    kappa: int
    max_context: int
    max_window: int  # 0 = unbounded

    @property
    def table_len(self) -> int:
        """Positions a graph may address (static graphs write up to a window past the context)."""
        return self.max_context + self.max_window


def resolve_limits(cfg: ExportConfig, model_config) -> Limits:
    """Defaults filled in and checked against the model; ExportError names the bad option."""
    try:
        exit_layer, kappa = SplitConfig(cfg.exit_layer, cfg.kappa).resolve(model_config)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    context = cfg.max_context or (min(STATIC_DEFAULT_CONTEXT, model_config.max_seq_len) if cfg.static
                                  else model_config.max_seq_len)
    if not 2 <= context <= model_config.max_seq_len:  # a prompt token and one generated (the manifest's rule)
        raise ExportError(f"--max-context must be in 2..{model_config.max_seq_len} (the model's context), "
                          f"got {context}")
    if cfg.max_window and not cfg.static:  # a dynamic bundle takes any window: it was recorded and never read
        raise ExportError("--max-window needs --static (dynamic graphs take any window)")
    window = cfg.max_window or (STATIC_DEFAULT_WINDOW if cfg.static else 0)
    if cfg.static and not 1 <= window <= min(MAX_STATIC_WINDOW, context):
        raise ExportError(f"--max-window must be in 1..{min(MAX_STATIC_WINDOW, context)} with --static, "
                          f"got {window}")
    if window < 0 or window > context:
        raise ExportError(f"--max-window must be in 1..{context} (--max-context), got {window}")
    return Limits(exit_layer, kappa, context, window)


def export_bundle(model: str | None, out_dir, progress: bool = True, **options) -> Path:
    """Export a bundle (docs/design/exporters.md); `options` are ExportConfig fields (draft_model, fmt, weights, kappa,
    ...) with ExportConfig's defaults; returns the bundle folder."""
    return run_export(ExportConfig(model=model, out_dir=Path(out_dir), **options), progress=progress)


def run_export(cfg: ExportConfig, progress: bool = True) -> Path:
    """Export `cfg`; steps: check the output folder, load, validate, four graphs, tokenizer, manifest."""
    from mirror_rt.exporters.paths import OutputPathError, check_bundle_folder, staging_folder, swap_in

    try:  # before any model is loaded
        out = check_bundle_folder(cfg.out_dir, MANIFEST)
        staging = staging_folder(out)  # written there, then swapped in: an interrupted export breaks no bundle
    except OutputPathError as exc:
        raise ExportError(str(exc)) from None
    try:
        _export_into(replace(cfg, out_dir=staging), progress)
        swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _export_into(cfg: ExportConfig, progress: bool) -> None:
    from tqdm import tqdm

    from mirror_rt.exporters.stream_export import stream_export, streams
    from mirror_rt.models.loading import load_checkpoint

    with tqdm(total=len(ROLES) + 3, desc="export", unit="step", disable=not progress) as bar:  # closed on errors too
        if streams(cfg):  # a GGUF file or a model over 1 GB: one tensor at a time
            stream_export(cfg, bar)
            return
        if cfg.weights == "auto":
            cfg = replace(cfg, weights="fp32")
        _check_traced(cfg)
        bar.set_postfix_str("loading models")
        target = load_checkpoint(cfg.model, log=lambda *a: None)
        limits = resolve_limits(cfg, target.model.config)
        adapter = _load_adapter(cfg, target.model, limits)
        draft = target if cfg.draft_model is None else load_checkpoint(cfg.draft_model, log=lambda *a: None)
        _check_draft(target, draft)
        streams = _load_streams(cfg, draft.model)
        kept = _load_vocab(cfg, draft.model)
        cfg = replace(cfg, attention=_attention(cfg))
        cfg = replace(cfg, kv_dtype=_kv_dtype(cfg))
        if cfg.draft_weights == "auto":
            auto = "q4_1" if cfg.fmt == "onnx" and holds_q4_1(draft.model) else "fp32" if cfg.fmt == "torch" else "int8"
            cfg = replace(cfg, draft_weights=auto)
        folder = cfg.out_dir
        bar.update()
        entries = []
        for role in ROLES:
            bar.set_postfix_str(role)
            model = draft.model if role == "draft" else target.model
            if role == "draft" and kept is not None:  # after the weights were chosen: q4_1 reads the plain draft
                model = PrunedHeadDraft(model, kept)
            if role in ("target_prefix", "target_exit") and cfg.fmt != "torch":  # the exit graph carries the
                model = with_exit_adapter(model, adapter)  # adapter; an attention one's first stage: the prefix
            entries.append(_export_role(cfg, limits, streams if role == "draft" and streams else model, role, folder))
            bar.update()
        bar.set_postfix_str("tokenizer")
        tokenizer = _copy_tokenizer(target.tokenizer, folder, cfg.fmt)
        bar.update()
        bar.set_postfix_str("manifest")
        manifest = _manifest(cfg, limits, target.model, draft.model, entries, tokenizer)
        write_manifest(replace(manifest, exit_adapter=_copy_adapter(cfg, adapter, folder),
                               draft_vocab=_copy_vocab(cfg, kept, folder)), folder)
        bar.update()


def _check_traced(cfg: ExportConfig) -> None:
    """ExportError for a precision only GGUF files and models over 1 GB take (exporters.stream_export), or fp16 on
    ONNX Runtime, before the traced exporter loads anything."""
    from mirror_rt.exporters.export_config import STREAMED_ONLY

    for flag, value in (("--weights", cfg.weights), ("--draft-weights", cfg.draft_weights)):
        if value == "fp16" and cfg.fmt == "onnx":
            raise ExportError(f"{flag} fp16 needs --format openvino or torch (ONNX Runtime has no fast fp16 products "
                              "on the CPU); onnx takes fp32, int8, int4, q4_1, w8a8")
        if value in STREAMED_ONLY:
            raise ExportError(f"{flag} {value} needs a GGUF file or a Hugging Face folder to export from (not "
                              f"{cfg.model or 'the default model'})")


def _attention(cfg: ExportConfig) -> str:
    """The targets' attention (ExportConfig.attention): pool where the op builds here, unless asked otherwise."""
    from mirror_rt.exporters.native_op import NativeOpUnavailable, library

    if cfg.kv != "shared" or cfg.attention == "standard":
        return "standard"
    try:
        library()
        return "pool"
    except NativeOpUnavailable as exc:
        if cfg.attention == "pool":
            raise ExportError(f"--attention pool: {exc}") from None
        return "standard"


def _kv_dtype(cfg: ExportConfig) -> str:
    """The targets' KV buffers (ExportConfig.kv_dtype): fp16 by default for w8a8 targets with pool attention."""
    if cfg.attention != "pool":
        if cfg.kv_dtype == "fp16":
            raise ExportError("--kv-dtype fp16 needs mirror-rt's attention op, which cannot be built here")
        return "fp32"
    return cfg.kv_dtype or ("fp16" if cfg.weights == "w8a8" else "fp32")


def _load_adapter(cfg: ExportConfig, model, limits: Limits):
    """The --exit-adapter, checked against the target and exit layer before any conversion (or None)."""
    if cfg.exit_adapter is None:
        return None
    from mirror_rt.models.exit_adapter import AdapterError, load_exit_adapter

    try:
        return load_exit_adapter(cfg.exit_adapter, model, limits.exit_layer)
    except AdapterError as exc:
        raise ExportError(f"--exit-adapter: {exc}") from None


def _copy_adapter(cfg: ExportConfig, adapter, folder: Path) -> dict | None:
    """Copy the adapter files into the bundle and describe them for the manifest."""
    if adapter is None:
        return None
    from mirror_rt.models.exit_adapter import adapter_paths

    names = ["exit_adapter.safetensors", "exit_adapter.json"]
    for source, name in zip(adapter_paths(cfg.exit_adapter), names):
        shutil.copyfile(source, folder / name)
    c = adapter.config
    return {"file": names[0], "config": names[1], "exit_layer": c.exit_layer, "rank": c.rank, "attention": c.attention,
            "model_fingerprint": c.model_fingerprint, "in_graph": cfg.fmt != "torch",  # in target_exit
            "files": hash_files(folder, names)}


def _load_streams(cfg: ExportConfig, draft_model):
    """The --draft-streams over the draft, checked before any conversion (or None)."""
    if cfg.draft_streams is None:
        return None
    from mirror_rt.models.ss_draft import load_streams

    try:
        return load_streams(draft_model, Path(cfg.draft_streams))
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"--draft-streams {cfg.draft_streams}: {exc}") from None


def _load_vocab(cfg: ExportConfig, draft_model):
    """The --draft-vocab kept ids, checked against the draft's vocabulary (or None)."""
    if cfg.draft_vocab is None:
        return None
    try:
        return load_kept(cfg.draft_vocab, draft_model.config.vocab_size)
    except ValueError as exc:
        raise ExportError(f"--draft-vocab {exc}") from None


def _copy_vocab(cfg: ExportConfig, kept, folder: Path) -> dict | None:
    """Copy the kept-ids file into the bundle and describe it for the manifest."""
    if kept is None:
        return None
    name = "draft_vocab.json"
    shutil.copyfile(cfg.draft_vocab, folder / name)
    return {"file": name, "size": int(kept.shape[0]), "files": hash_files(folder, [name])}


def _check_draft(target, draft) -> None:
    if target is draft:
        return
    if draft.model.config.vocab_size != target.model.config.vocab_size or \
            draft.tokenizer.sha256() != target.tokenizer.sha256():
        raise ExportError("--draft-model must share the target's tokenizer (vocabulary or tokenizer.json differ)")


def _export_role(cfg: ExportConfig, limits: Limits, model, role: str, folder: Path) -> GraphEntry:
    weights = {"draft": cfg.draft_weights, "target_exit": cfg.exit_weights}.get(role, cfg.weights)
    spec = graph_spec(role, model.config.n_layers, limits.exit_layer, limits.kappa, cfg.static,
                      limits.table_len, limits.max_window, shared_kv=cfg.kv == "shared", exit_mix=mixes_exit(model),
                      pool=cfg.attention == "pool", kv_half=cfg.kv_dtype == "fp16")
    odd_heads = model.config.head_dim % GQA_HEAD_MULTIPLE != 0  # ONNX Runtime's GroupQueryAttention refuses them
    if spec.shared_kv and odd_heads:  # the draft attends with standard ops as targets do (exporters.exact_kv)
        spec = replace(spec, exact=True)
    if cfg.fmt == "openvino":
        from mirror_rt.exporters.openvino import export_openvino_graph

        files = export_openvino_graph(model, spec, limits.table_len, weights, folder / f"{role}.xml")
    elif cfg.fmt == "onnx" and hasattr(model, "stream_layers"):  # an SS draft (exporters.ss_graph)
        from mirror_rt.exporters.ss_graph import export_stream_draft

        shared = cfg.kv == "shared" and not model.config.qk_norm and not odd_heads  # else explicit (ss_graph)
        spec = replace(spec, shared_kv=shared)
        files = export_stream_draft(model, limits.table_len, weights, folder / f"{role}.onnx", shared)
    elif cfg.fmt == "onnx":
        from mirror_rt.exporters.onnx import export_onnx_graph

        files = export_onnx_graph(model, spec, limits.table_len, weights, folder / f"{role}.onnx")
    elif role == "target_exit":  # TorchSplitTarget computes the exit from the target's own weights
        weights, files = _export_torch(model, role, cfg.weights, folder, shares_target=True)
    else:
        weights, files = _export_torch(model, role, weights, folder, shares_target=cfg.draft_model is None)
    names = [f.name for f in files]
    return GraphEntry(role=role, file=names[0], format=cfg.fmt, precision=weights,
                      device_hint="npu" if cfg.static else "cpu", first_layer=spec.first,
                      last_layer=spec.last, files=hash_files(folder, names))


def _export_torch(model, role: str, weights: str, folder: Path, shares_target: bool) -> tuple[str, list[Path]]:
    """Torch bundles hold safetensors weights; the backend rebuilds the model from the manifest.

    The exit and the suffix share the prefix's file, and so does a self-draft of the same precision.
    """
    import torch

    from mirror_rt.models.tensor_files import save_tensors

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[weights]
    target_path = folder / "target.safetensors"
    if role in ("target_exit", "target_suffix") or \
            (role == "draft" and shares_target and _stored_dtype(target_path) == dtype):
        return weights, [target_path]
    path = folder / f"{'draft' if role == 'draft' else 'target'}.safetensors"
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_embeddings)}
    save_tensors(state, path)
    return weights, [path]


def _stored_dtype(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(next(iter(f.keys()))).dtype


def _copy_tokenizer(tokenizer, folder: Path, fmt: str) -> dict:
    """Copy the tokenizer files (plus the OpenVINO tokenizer IR) and describe them."""
    source = getattr(tokenizer, "folder", None)
    if source is None:  # byte tokenizer of the tiny presets: nothing to copy
        return {"kind": "bytes", "vocab_size": tokenizer.vocab_size, "sha256": tokenizer.sha256(), "files": {}}
    names = [n for n in TOKENIZER_FILES if (Path(source) / n).is_file()]
    for name in names:
        shutil.copyfile(Path(source) / name, folder / name)
    if fmt == "openvino":
        from mirror_rt.exporters.openvino import export_openvino_tokenizer

        names += [p.name for p in export_openvino_tokenizer(folder, folder)]
    return {"kind": "hf", "sha256": tokenizer.sha256(), "files": hash_files(folder, names)}


def _manifest(cfg: ExportConfig, limits: Limits, target, draft, entries, tokenizer: dict) -> BundleManifest:
    c = target.config
    kv = {"layout": KV_LAYOUT, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
          "dtype": "float16" if cfg.kv_dtype == "fp16" else "float32",  # the target's (drafts' are float32)
          "past": list(PAST_NAMES), "present": list(PRESENT_NAMES),
          "state": {"openvino": "openvino model state"}.get(cfg.fmt, "explicit inputs/outputs"),
          "shared": cfg.kv == "shared",  # buffers written in place (exporters.shared_kv): ONNX Runtime only
          "attention": cfg.attention}  # targets': pool (exporters.pool_kv: mirror-rt's op) | standard
    if kv["shared"]:
        kv["state"] = "shared buffers [rows, KVH, capacity, D] + total_len [rows] (GroupQueryAttention)"
    return BundleManifest(
        format_version=FORMAT_VERSION, graphs=tuple(entries), n_layers=c.n_layers, exit_layer=limits.exit_layer,
        kappa=limits.kappa, kv_layout=kv, vocab_size=c.vocab_size, tokenizer=tokenizer,
        max_context=limits.max_context, max_window=limits.max_window, static=cfg.static,
        target_config=c.to_dict(), draft_config=draft.config.to_dict(), exporter_versions=_versions(),
        draft_of_target=cfg.draft_model is None)


def _versions() -> dict:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
