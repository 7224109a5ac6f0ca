"""Export that streams: a GGUF file or a large Hugging Face folder into a bundle, one tensor at a time.

The four graphs (exporters.llama_graphs) share one weights.bin; memory stays near one tensor whatever the
model's size. For GGUF files and checkpoints over STREAM_BYTES; smaller folders keep the traced exporter
(exporters.export: exit adapters, SS drafts, the other precisions).
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

from pathlib import Path

from mirror_rt.exporters.export_config import ExportConfig, ExportError

STREAM_VERSION = 1  # part of a cached bundle's key (devices.engines.model_bundle): bump when what is written changes
STREAM_BYTES = 1 << 30  # checkpoints this large stream (the traced exporter holds a model in float32 twice)
STREAM_WEIGHTS = ("gguf", "fp32", "bf16", "f16", "q8_0", "q4_0")
# what the traced exporter's names mean here: blockwise 8- and 4-bit weights with int8 activations
SAME_AS = {"int8": "q8_0", "int4": "q4_0", "fp16": "f16"}
TRACED_ONLY = {"exit_adapter": "--exit-adapter", "draft_streams": "--draft-streams", "draft_vocab": "--draft-vocab"}


def streams(cfg: ExportConfig) -> bool:
    """Whether `cfg` exports through this module: a GGUF file, a checkpoint over STREAM_BYTES, or a precision only
    this module writes. ExportError when such a model asks for what only the traced exporter does."""
    from mirror_rt.exporters.export_config import STREAMED_ONLY

    if cfg.model is None or not Path(cfg.model).exists():
        return False
    own = {cfg.weights, cfg.draft_weights} & set(STREAMED_ONLY) or (cfg.weights == "fp16" and cfg.fmt == "onnx")
    if not (streamed_source(cfg.model) or own):
        return False
    for field, flag in TRACED_ONLY.items():
        if getattr(cfg, field) is not None:
            raise ExportError(f"{flag} needs the traced exporter, which runs models under 1 GB in safetensors")
    if cfg.fmt != "onnx" or cfg.static or cfg.attention == "standard" or cfg.kv == "explicit":
        raise ExportError("GGUF files and models over 1 GB export to --format onnx with mirror-rt's own ops "
                          "(no --static, --attention standard or --kv explicit)")
    for flag, value in (("--weights", cfg.weights), ("--draft-weights", cfg.draft_weights)):
        if value not in (*STREAM_WEIGHTS, *SAME_AS, "auto"):
            raise ExportError(f"{flag} {value}: GGUF files and models over 1 GB take "
                              f"{', '.join(STREAM_WEIGHTS)} (or int8, int4)")
    _require_kernels()
    return True


def _require_kernels() -> None:
    """ExportError, before anything is read or written, where mirror-rt's CPU kernels (every product of these
    graphs) cannot be built here: one line saying what to install."""
    from mirror_rt.exporters.native_op import NativeOpUnavailable, library

    try:
        library()
    except NativeOpUnavailable as exc:
        raise ExportError(f"GGUF files and models over 1 GB run on mirror-rt's CPU kernels, which cannot be built here "
                          f"({exc}); or run the model in torch eager with --torch") from None


def stream_export(cfg: ExportConfig, bar) -> None:
    """Write the bundle of `cfg` into cfg.out_dir (a staging folder: exporters.export swaps it in)."""
    from mirror_rt.exporters.export import Limits, resolve_limits
    from mirror_rt.exporters.llama_graphs import GraphPlan, LlamaGraphs
    from mirror_rt.models.weights import open_weights

    target = open_weights(cfg.model)
    draft = target if cfg.draft_model is None else open_weights(cfg.draft_model)
    _check_draft(target, draft, cfg)
    limits: Limits = resolve_limits(cfg, target.config)
    weights = _precision(cfg.weights, target)
    draft_weights = _draft_precision(cfg.draft_weights, weights, draft)
    kv_half = cfg.kv_dtype != "fp32"
    folder = Path(cfg.out_dir)
    writer = LlamaGraphs(target, folder)
    draft_writer = writer if draft is target else LlamaGraphs(draft, folder, writer.file)
    n, e = target.config.n_layers, limits.exit_layer
    plans = [(writer, GraphPlan("target_prefix", 0, e, weights, kv_half=kv_half)),
             (writer, GraphPlan("target_exit", e, e, weights, kappa=limits.kappa)),
             (writer, GraphPlan("target_suffix", e, n, weights, kv_half=kv_half)),
             (draft_writer, GraphPlan("draft", 0, draft.config.n_layers, draft_weights, kv_half=kv_half))]
    bar.reset(total=sum(max(p.last - p.first, 1) for _, p in plans) + 2)
    bar.set_description("export (layers)")
    entries = []
    for graph_writer, plan in plans:
        bar.set_postfix_str(plan.role)
        path = folder / f"{plan.role}.onnx"
        graph_writer.write(plan, path, progress=bar.update)
        entries.append((plan, path.name))
    writer.close()
    bar.set_postfix_str("tokenizer")
    tokenizer = _tokenizer(cfg, target, folder)
    bar.update()
    bar.set_postfix_str("manifest")
    _write_manifest(cfg, limits, target, draft, entries, tokenizer, writer.file, kv_half)
    bar.update()


def _precision(weights: str, source) -> str:
    """A --weights value as this module's precision: the checkpoint's own blocks by default for a GGUF."""
    weights = SAME_AS.get(weights, weights)
    if weights == "auto":
        return "gguf" if source.path.suffix == ".gguf" else "fp32"
    if weights == "gguf" and source.path.suffix != ".gguf":
        raise ExportError(f"--weights gguf needs a GGUF file, got {source.path}")
    return weights


def _draft_precision(asked: str, target_weights: str, draft) -> str:
    """The draft's precision; `auto`: a GGUF's own blocks where its products are 4 or 5 bits already (the draft then
    shares the target's weights: a draft of the target at its own precision costs no memory), else q4_0 (the
    weights at 4 bits)."""
    if asked != "auto":
        return _precision(asked, draft)
    if target_weights == "gguf" and draft.path.suffix == ".gguf" and _mostly_low_bits(draft):
        return "gguf"
    return "q4_0"


def _mostly_low_bits(source) -> bool:
    from collections import Counter

    low = {2, 3, 6, 7, 12, 13}  # Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K
    sizes = Counter()
    for info in source.tensors.values():
        if info.rows > 1 and info.name.startswith("layers."):
            sizes[info.type in low] += info.nbytes
    return sizes[True] >= sizes[False]


def _check_draft(target, draft, cfg: ExportConfig) -> None:
    """A draft of the target's family: the same tokenizer; embeddings may differ in padding rows."""
    if draft is target:
        return
    from mirror_rt.models.tokenizer_files import same_vocabulary

    if not same_vocabulary(target.path, draft.path):
        raise ExportError(f"--draft-model {cfg.draft_model} must share the target's tokenizer (its vocabulary "
                          "differs)")


def streamed_source(model) -> bool:
    """Whether `model` is what this module exports by default: a GGUF file, or a folder whose safetensors pass
    STREAM_BYTES (`run --model` then runs it from its own bundle: devices.engines). A GGUF file's header is checked
    here, first (models.gguf_header.check_gguf: GGUFError)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from mirror_rt.models.gguf_header import check_gguf

        check_gguf(path)  # an architecture mirror-rt does not run, a file cut short: refused before any export
        return True
    if path.is_file():
        return False
    return path.is_dir() and sum(f.stat().st_size for f in path.glob("*.safetensors")) > STREAM_BYTES


def _tokenizer(cfg: ExportConfig, source, folder: Path) -> dict:
    """The tokenizer files into the bundle (a GGUF's written from its own vocabulary) and their description."""
    from mirror_rt.exporters.manifest import hash_files
    from mirror_rt.models.tokenizer_files import write_tokenizer_files

    names = write_tokenizer_files(source.path, folder)
    from mirror_rt.models.tokenizer import HFTokenizer

    return {"kind": "hf", "sha256": HFTokenizer(folder).sha256(), "files": hash_files(folder, names)}


def _write_manifest(cfg, limits, target, draft, entries, tokenizer: dict, weights_file, kv_half: bool) -> None:
    from mirror_rt.exporters.export import _versions
    from mirror_rt.exporters.graph_writer import WEIGHTS_FILE
    from mirror_rt.exporters.manifest import (
        FORMAT_VERSION,
        BundleManifest,
        GraphEntry,
        hash_files,
        write_manifest,
    )
    from mirror_rt.exporters.split import KV_LAYOUT, PAST_NAMES, PRESENT_NAMES

    folder = Path(cfg.out_dir)
    digest = weights_file.sha256
    graphs = tuple(GraphEntry(role=plan.role, file=name, format="onnx", precision=plan.precision, device_hint="cpu",
                              first_layer=plan.first, last_layer=plan.last,
                              files={**hash_files(folder, [name]), WEIGHTS_FILE: digest})
                   for plan, name in entries)
    c = target.config
    kv = {"layout": KV_LAYOUT, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
          "dtype": "float16" if kv_half else "float32", "past": list(PAST_NAMES), "present": list(PRESENT_NAMES),
          "state": "shared buffers [rows, KVH, capacity, D] + total_len [rows]", "shared": True,
          "attention": "pool", "weights": WEIGHTS_FILE}
    manifest = BundleManifest(
        format_version=FORMAT_VERSION, graphs=graphs, n_layers=c.n_layers, exit_layer=limits.exit_layer,
        kappa=limits.kappa, kv_layout=kv, vocab_size=c.vocab_size, tokenizer=tokenizer,
        max_context=limits.max_context, max_window=limits.max_window, static=False, target_config=c.to_dict(),
        draft_config=draft.config.to_dict(), exporter_versions=_versions(), draft_of_target=cfg.draft_model is None)
    write_manifest(manifest, folder)

