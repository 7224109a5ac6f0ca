"""manifest.json: the self-description of an exported bundle, written last and checked on load.

A bundle is a folder with four graphs (target prefix, target exit, target suffix, draft), the
tokenizer files and this manifest. `write_manifest` hashes every listed file; `read_manifest`
refuses an unknown format version, a missing file or a file whose sha256 differs, each
with a one-line `BundleError` naming the file. It knows nothing about how graphs run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mirror_rt.models.config import ModelConfig

# 2: the early exit is its own stateless graph (target_exit); version 1 prefixes computed it.
# 3: dynamic logits graphs (target_suffix, draft) take `last_rows`; the manifest says `draft_of_target`.
# 4: shared-KV ONNX graphs take rows of sequences ([B, T] ids, [B, KVH, S, D] buffers, total_len [B]).
# 5: target prefix/suffix attention from standard ops (exporters.exact_kv): a position computes alike in every
#    call shape, so targets with quantized activations stay exact (drafts keep GroupQueryAttention).
# 6: exact attention per group of rows (input `attention_groups`): each group reads its own longest row's keys.
# 7: target attention through mirror-rt's op (exporters.pool_kv: the KV read in place; `kv_layout.attention` says
#    pool or standard), w8a8 activations quantized by its other op; where the op does not build, format 6's graphs.
# 8: graphs may compute on the bundle's weights.bin as it lies (exporters.llama_graphs: mirror-rt's MatMulGGUF and
#    GatherGGUF over a GGUF's own blocks or float rows; precisions gguf, f16, q8_0, q4_0).
FORMAT_VERSION = 8
# backends detect `last_rows` and batched graphs per graph: older bundles still run (one sequence a call:
# runtime.batch.decoder decodes their requests side by side, without shared calls)
READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8)
MANIFEST = "manifest.json"
VERIFIED = ".cache/verified.json"  # files hashed already: {name: [size, mtime_ns, sha256]}
GRAPH_FORMATS = ("torch", "onnx", "openvino")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4", "q4_1", "w8a8", "gguf", "f16", "q8_0", "q4_0")
ROLES = ("draft", "target_exit", "target_prefix", "target_suffix")  # sorted


class BundleError(ValueError):
    """A bundle that cannot be used (one-line message naming the file)."""


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the bundle."""

    role: str  # "target_prefix" | "target_exit" | "target_suffix" | "draft"
    file: str  # main graph file, relative to the bundle folder (.xml, .onnx, .safetensors)
    format: str  # "torch" | "onnx" | "openvino"
    precision: str  # weights: one of PRECISIONS (target_exit: independent of the target)
    device_hint: str  # device the graph was prepared for ("cpu", "npu", ...); informative
    first_layer: int  # first layer of the model in this graph (target_exit: the exit layer)
    last_layer: int  # one past its last layer (target_exit: the exit layer, it holds no layer)
    files: dict = field(default_factory=dict)  # every file the graph needs -> sha256


@dataclass(frozen=True)
class BundleManifest:
    """Everything `load_bundle` needs; the runtime never guesses shapes from flags."""

    format_version: int  # FORMAT_VERSION of the writer; readers refuse others
    graphs: tuple  # GraphEntry per role
    n_layers: int  # N, target layers
    exit_layer: int  # ℓe: the prefix holds layers 0..ℓe-1, the exit graph reads its hidden state
    kappa: int  # early-exit top-k per position
    kv_layout: dict  # {"layout": "BHTD", "n_kv_heads", "head_dim", "dtype", "past", "present", "state",
    #                   "shared": KV in buffers written in place (exporters.shared_kv; ONNX Runtime only)}
    vocab_size: int  # logits width (target and draft)
    tokenizer: dict  # {"kind": "hf" | "bytes", "sha256", "files": {name: sha256}}
    max_context: int  # positions a cache may hold (static graphs: fixed)
    max_window: int  # tokens per forward after prefill; 0 = unbounded (dynamic graphs)
    static: bool  # fixed-shape graphs (NPU); windows are padded to max_window
    target_config: dict  # ModelConfig.to_dict() of the target
    draft_config: dict  # ModelConfig.to_dict() of the draft
    exporter_versions: dict  # package -> version that exported the bundle
    # Trained early exit (optional; absent = the target's bare norm + LM head): {"file", "config",
    # "exit_layer", "rank", "model_fingerprint", "in_graph" (the target_exit graph applies it; False
    # for torch bundles, whose loader applies the file), "files": {name: sha256}}. Not written when None.
    exit_adapter: dict | None = None
    # The draft is the target itself at another weight precision: its KV means what the target's does,
    # so a draft may start from the target's prompt KV instead of its own prefill.
    draft_of_target: bool = False
    # Pruned draft vocabulary (optional; absent = the full LM head): {"file" (the kept ids, JSON of
    # models.pruned_head), "size" (kept ids), "files": {name: sha256}}. The draft graph computes its head
    # over those rows and still returns vocab_size logits, -inf outside them. Not written when None.
    draft_vocab: dict | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check the fields' types and that they agree with each other; raise BundleError naming the field."""
        _check_types(self, "")
        for g in self.graphs:
            _check_types(g, f"graph {g.role}: ")
            _inside(g.file)
        for name in ("target_config", "draft_config"):
            try:
                ModelConfig.from_dict(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise BundleError(f"{MANIFEST}: {name} is not a model configuration ({exc})") from None
        if not isinstance(self.tokenizer.get("files", {}), dict):
            raise BundleError(f"{MANIFEST}: tokenizer.files must be an object")
        roles = sorted(g.role for g in self.graphs)
        if roles != list(ROLES):
            raise BundleError(f"{MANIFEST}: graphs must be target_prefix, target_exit, target_suffix, draft; "
                              f"got {roles}")
        for g in self.graphs:
            if g.format not in GRAPH_FORMATS:
                raise BundleError(f"{MANIFEST}: graph {g.role} has unknown format '{g.format}'")
            if g.precision not in PRECISIONS:
                raise BundleError(f"{MANIFEST}: graph {g.role} has unknown precision '{g.precision}'")
        _check_counts(self)
        if not 0 < self.exit_layer < self.n_layers:
            raise BundleError(f"{MANIFEST}: exit_layer {self.exit_layer} not in 1..{self.n_layers - 1}")
        if self.exit_adapter is not None and self.exit_adapter.get("exit_layer") != self.exit_layer:
            raise BundleError(f"{MANIFEST}: exit_adapter is for layer {self.exit_adapter.get('exit_layer')}, "
                              f"not exit_layer {self.exit_layer}")
        if self.static and self.max_window < 1:
            raise BundleError(f"{MANIFEST}: a static bundle needs max_window >= 1")

    def graph(self, role: str) -> GraphEntry:
        """The entry of `role`."""
        return next(g for g in self.graphs if g.role == role)

    @property
    def graph_format(self) -> str:
        """The format shared by the target graphs."""
        return self.graph("target_prefix").format

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["graphs"] = [dataclasses.asdict(g) for g in self.graphs]
        for name in ("exit_adapter", "draft_vocab"):
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> BundleManifest:
        d = dict(d)
        d["graphs"] = tuple(GraphEntry(**g) for g in d["graphs"])
        return cls(**d)


_TYPES = {"int": int, "bool": bool, "dict": dict, "str": str, "tuple": tuple}


def _check_counts(manifest: BundleManifest) -> None:
    """Counts that agree with the target's configuration and are in range (a hand-edited value otherwise loads
    and fails later, deep inside a graph or a sampler)."""
    target = manifest.target_config
    for name in ("vocab_size", "n_layers"):
        if name in target and getattr(manifest, name) != target[name]:
            raise BundleError(f"{MANIFEST}: {name} {getattr(manifest, name)} differs from target_config's "
                              f"{target[name]}")
    if not 1 <= manifest.kappa <= manifest.vocab_size:
        raise BundleError(f"{MANIFEST}: kappa {manifest.kappa} not in 1..{manifest.vocab_size}")
    if manifest.max_context < 2 or manifest.max_window < 0:
        raise BundleError(f"{MANIFEST}: max_context must be at least 2 and max_window at least 0 (got "
                          f"{manifest.max_context}, {manifest.max_window})")


def _check_types(entry, where: str) -> None:
    """Each field of a manifest entry has its declared type (a hand-edited null or string fails here, in one
    line, not as an AttributeError deep in a loader)."""
    for f in dataclasses.fields(entry):
        kind, value = f.type.split(" | ")[0], getattr(entry, f.name)
        expected = _TYPES.get(kind)
        if value is None and "None" in f.type or expected is None:
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise BundleError(f"{MANIFEST}: {where}{f.name} must be {'an object' if kind == 'dict' else kind}, "
                              f"got {json.dumps(value)}")


def _inside(name: str) -> None:
    """A file the manifest names lies in the bundle folder: nothing outside it is read."""
    if os.path.isabs(name) or os.path.normpath(name).startswith(".."):
        raise BundleError(f"{MANIFEST}: lists {name}, outside the bundle folder")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(folder: Path, names) -> dict:
    """{name: sha256} for files of `folder`."""
    return {name: sha256_file(folder / name) for name in names}


def write_manifest(manifest: BundleManifest, folder: Path) -> Path:
    """Write `folder/manifest.json` atomically (a half-written bundle has no manifest). The files were hashed as
    they are now, so they count as verified: the first load does not hash them again."""
    path = Path(folder) / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    _write_verified(Path(folder), {name: _stamp(Path(folder) / name, digest)
                                   for name, digest in _listed(manifest).items() if (Path(folder) / name).is_file()})
    return path


def read_manifest(folder: Path, verify: bool = True) -> BundleManifest:
    """Parse and check `folder/manifest.json`; with `verify`, hash every listed file."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path}: missing (not a mirror-rt bundle; run mirror-rt export)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path}: unreadable ({type(exc).__name__})") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version not in READABLE_VERSIONS:
        raise BundleError(f"{path}: format version {version} is not supported (this mirror-rt reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))}); re-export the bundle")
    try:
        manifest = BundleManifest.from_dict(data)
    except (TypeError, KeyError, StopIteration) as exc:
        raise BundleError(f"{path}: malformed ({exc})") from None
    check_files(manifest, folder, verify)
    return manifest


def check_files(manifest: BundleManifest, folder: Path, verify: bool = True) -> None:
    """Every listed file exists and, with `verify`, still has its recorded sha256.

    A file hashed once is not hashed again while its size and modification time are those recorded beside
    the bundle (`VERIFIED`, with the digest it matched): re-hashing a gigabyte of graphs took a second of
    every load. A bundle that cannot be written is hashed every time.
    """
    seen = _read_verified(folder) if verify else {}
    checked = {}
    for name, digest in sorted(_listed(manifest).items()):
        _inside(name)
        path = folder / name
        if not path.is_file():
            raise BundleError(f"{path}: missing (listed in {MANIFEST})")
        if not verify:
            continue
        checked[name] = _stamp(path, digest)
        if seen.get(name) != checked[name] and sha256_file(path) != digest:
            raise BundleError(f"{path}: corrupt (sha256 differs from {MANIFEST}); re-export the bundle")
    if verify and checked != seen:
        _write_verified(folder, checked)


def _listed(manifest: BundleManifest) -> dict:
    """{name: sha256} of every file the manifest lists."""
    listed = dict(manifest.tokenizer.get("files", {}))
    listed.update((manifest.exit_adapter or {}).get("files", {}))
    listed.update((manifest.draft_vocab or {}).get("files", {}))
    for g in manifest.graphs:
        listed.update(g.files)
    return listed


def _stamp(path: Path, digest: str) -> list:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, digest]


def _read_verified(folder: Path) -> dict:
    try:
        data = json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_verified(folder: Path, checked: dict) -> None:
    path = folder / VERIFIED
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        tmp.write_text(json.dumps(checked, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:  # a read-only bundle: verified again next time
        tmp.unlink(missing_ok=True)
