"""GGUF files a user brings that mirror-rt cannot run are refused in one line naming the file: cut short, of a
family it does not run, or lacking a weight (transformers filled it with random numbers and the model ran)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mirror_rt.models.default_model import GGUF_NAME, cache_dir, default_model_folder
from mirror_rt.models.gguf import convert_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def source() -> Path:
    default_model_folder(log=lambda *a: None)  # fetched (and converted) once, as every default-model test does
    return cache_dir() / "downloads" / GGUF_NAME


def rewrite(source: Path, out: Path, arch: str | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of `source` (its tensors' raw blocks, its metadata) under another architecture name or without
    some tensors."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    old = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch or old)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = re.sub(f"^{re.escape(old)}\\.", f"{arch or old}.", key)
        kind = field.types[0]
        extra = {"sub_type": field.types[-1]} if kind == GGUFValueType.ARRAY else {}
        writer.add_key_value(name, field.contents(), kind, **extra)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def convert(path: Path, tmp_path: Path):
    return convert_gguf(path, tmp_path / "models" / path.stem, log=lambda *a: None)


def test_a_gguf_cut_inside_its_metadata_is_one_line(source, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:2000])
    with pytest.raises(ValueError, match=r"^cannot read .*cut\.gguf \(cut short, or not a GGUF model\?\): [^\n]*$"):
        convert(cut, tmp_path)
    assert not list((tmp_path / "models").iterdir())  # nothing half-written kept


def test_a_family_mirror_rt_does_not_run_is_refused_before_its_weights_load(source, tmp_path):
    with pytest.raises(ValueError, match=r"phi3\.gguf: unsupported architecture 'phi3'"):
        convert(rewrite(source, tmp_path / "phi3.gguf", arch="phi3"), tmp_path)


def test_a_missing_weight_is_named_not_filled_with_random_numbers(source, tmp_path):
    with pytest.raises(ValueError, match=r"lacks weights the model needs: model\.layers\.3\.mlp\.up_proj\.weight$"):
        convert(rewrite(source, tmp_path / "missing.gguf", drop=("blk.3.ffn_up.weight",)), tmp_path)
