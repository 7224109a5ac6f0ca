"""A model folder that OpenVINO GenAI's `LLMPipeline` loads: optimum-intel's layout, our graph.

A stateful decoder traced from our `Transformer` with the inputs GenAI feeds (input_ids, attention_mask,
position_ids, beam_idx), the KV folded into state as optimum-intel does, beside its tokenizer files; cached per
model and weights. It runs nothing.
Design notes: docs/design/exporters.md
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mirror_rt.models.transformer import Transformer, apply_rope, rope_tables

# Bump when the exported graph changes, so cached folders from older exporters are rebuilt.
FORMAT_VERSION = 1
GENAI_WEIGHTS = ("fp32", "int8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model")
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


class GenAIDecoder(nn.Module):
    """`model` as optimum-intel's decoder signature: explicit mask, positions and past KV.

    forward(input_ids [B, T], attention_mask [B, S+T], position_ids [B, T], *past) ->
    (logits [B, T, vocab], *presents), past/present per layer [B, kv_heads, S(+T), head_dim].
    RoPE reads cos/sin tables of `max_seq_len` positions, computed as the torch model does.
    """

    def __init__(self, model: Transformer):
        super().__init__()
        c = model.config
        self.model, self.n_heads, self.n_kv_heads, self.head_dim = model, c.n_heads, c.n_kv_heads, c.head_dim
        cos, sin = rope_tables(model.inv_freq, torch.arange(c.max_seq_len), model.embed_tokens.weight.dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        T, S = input_ids.shape[1], past[0].shape[2]
        h = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        rope = (self.rope_cos[position_ids].unsqueeze(1), self.rope_sin[position_ids].unsqueeze(1))  # [B, 1, T, D]
        keys = torch.arange(S + T, dtype=torch.long)
        causal = keys[None, :] <= (S + torch.arange(T, dtype=torch.long))[:, None]  # [T, S+T]
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()  # [B, 1, T, S+T]
        presents = []
        for i, block in enumerate(self.model.layers):
            h, k, v = self._block(block, h, rope, past[2 * i], past[2 * i + 1], mask)
            presents += [k, v]
        return (self.model.logits(h), *presents)

    def _block(self, block, x, rope, past_k, past_v, mask):
        """One decoder block on [B, T, hidden]; returns (x, present_k, present_v)."""
        attn, (B, T) = block.self_attn, x.shape[:2]
        y = block.input_layernorm(x)
        q = attn.q_proj(y).reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = attn.k_proj(y).reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, KVH, T, D]
        v = attn.v_proj(y).reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys, values = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        rep = self.n_heads // self.n_kv_heads
        out = F.scaled_dot_product_attention(q, _repeat_kv(keys, rep), _repeat_kv(values, rep), attn_mask=mask)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        x = x + block.mlp(block.post_attention_layernorm(x))
        return x, keys, values


def _repeat_kv(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, KVH, S, D] -> [B, KVH*rep, S, D], in the unsqueeze-expand-reshape form of HF's repeat_kv."""
    return kv if rep == 1 else kv.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)


def kv_names(n_layers: int) -> tuple[list[str], list[str]]:
    """optimum-intel's past and present KV names, [key0, value0, key1, ...]."""
    past = [f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    return past, [name.replace("past_key_values", "present") for name in past]


def convert_decoder(model: Transformer):
    """The stateful ov.Model of `model` in optimum-intel's layout (fp32 weights)."""
    import openvino as ov
    from openvino._offline_transformations import apply_make_stateful_transformation

    c = model.config
    past_names, present_names = kv_names(c.n_layers)
    kv = [torch.zeros(1, c.n_kv_heads, 2, c.head_dim, dtype=torch.float32) for _ in past_names]
    example = (torch.tensor([[3, 4, 5]]), torch.ones(1, 5, dtype=torch.long), torch.tensor([[2, 3, 4]]), *kv)
    with torch.no_grad():
        ov_model = ov.convert_model(GenAIDecoder(model.float()).eval(), example_input=example)
    for port, name in zip(ov_model.inputs, [*MODEL_INPUTS, *past_names]):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, ["logits", *present_names]):
        port.get_tensor().set_names({name})
    shapes = {"input_ids": [-1, -1], "attention_mask": [-1, -1], "position_ids": [-1, -1]}
    ov_model.reshape(shapes | {n: [-1, c.n_kv_heads, -1, c.head_dim] for n in past_names})
    _fuse_beam_gather(ov_model, past_names)
    apply_make_stateful_transformation(ov_model, dict(zip(past_names, present_names)))
    _init_states_from_batch(ov_model)
    return ov_model


def _fuse_beam_gather(ov_model, past_names: list[str]) -> None:
    """A `beam_idx` [B] input that reorders every past KV along the batch axis (beam search)."""
    import openvino as ov
    from openvino import opset13

    beam_idx = opset13.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in past_names:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()


def _init_states_from_batch(ov_model) -> None:
    """Initialise each KV state as zeros [batch of input_ids, kv_heads, 0, head_dim]."""
    import numpy as np
    from openvino import opset13

    batch = opset13.gather(opset13.shape_of(ov_model.input("input_ids"), output_type="i64"),
                           opset13.constant([0]), opset13.constant(0))
    for op in ov_model.get_ops():
        if op.get_type_name() != "ReadValue":
            continue
        dims = [d.min_length for d in op.get_output_partial_shape(0)]
        parts = [batch] + [opset13.constant(np.array([d], dtype=np.int64)) for d in dims[1:]]
        zeros = opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)),
                                  opset13.concat(parts, axis=0))
        op.set_arguments([zeros])
    ov_model.validate_nodes_and_infer_types()


# --- the folder -------------------------------------------------------------------------------

def export_genai_folder(model: str | None, out_dir: str | Path | None = None, weights: str = "fp32",
                        cache: str | None = None, log=print) -> Path:
    """An LLMPipeline folder for `model` (default model, HF folder, GGUF or preset).

    With `out_dir` None the folder lives in the mirror-rt cache, keyed by model and weights,
    and an existing one is reused. Weights: fp32, or int8 (nncf weight-only compression).
    """
    from mirror_rt.models.config import PRESETS
    from mirror_rt.models.loading import load_checkpoint, resolve_folder

    if weights not in GENAI_WEIGHTS:
        raise ValueError(f"unknown GenAI weights '{weights}' (known: {', '.join(GENAI_WEIGHTS)})")
    source = model if model in PRESETS else str(resolve_folder(model, cache, log))
    folder = Path(out_dir) if out_dir else cached_folder(source, weights, cache)
    if (folder / "openvino_model.xml").exists():
        return folder
    t0 = time.perf_counter()
    loaded = load_checkpoint(source, cache=cache, log=log)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _write_model(loaded.model, weights, partial)
    _write_side_files(loaded.model.config, loaded.source, partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    log(f"exported OpenVINO GenAI folder ({weights}) in {time.perf_counter() - t0:.1f} s: {folder}")
    return folder


def cached_folder(source: str, weights: str, cache: str | None = None) -> Path:
    """Cache path for `source` (folder or preset name): its name plus a key of weights and files."""
    from mirror_rt.models.default_model import cache_dir

    path = Path(source)
    stamp = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(path.glob("*"))
             if f.is_file()] if path.is_dir() else []
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, str(path.resolve()) if stamp else source, stamp])
                         .encode()).hexdigest()[:12]
    return cache_dir(cache) / "genai" / f"{path.name}-{weights}-{key}"


def _write_model(model: Transformer, weights: str, folder: Path) -> None:
    import openvino as ov

    from mirror_rt.exporters.openvino import compress_weights

    ov_model = convert_decoder(model)
    if weights == "int8":
        ov_model = compress_weights(ov_model, model.config, "int8", model.config.max_seq_len)
    ov.save_model(ov_model, str(folder / "openvino_model.xml"), compress_to_fp16=False)


def _write_side_files(config, source: str, folder: Path) -> None:
    """config.json, generation_config.json, tokenizer files and the OpenVINO tokenizer models.

    A preset (no Hugging Face folder) gets a config.json written from its ModelConfig and no
    tokenizer: GenAI then takes token ids only, which is how the bench feeds it anyway.
    """
    from mirror_rt.exporters.openvino import export_openvino_tokenizer

    src = Path(source)
    if not src.is_dir():
        (folder / "config.json").write_text(json.dumps(_hf_config(config), indent=2))
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)
    if not (folder / "generation_config.json").exists():
        eos = list(config.eos_token_ids)
        (folder / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}))
    if (src / "tokenizer.json").is_file():
        export_openvino_tokenizer(src, folder)


def _hf_config(config) -> dict:
    """A minimal Hugging Face config.json for a preset model."""
    return {"model_type": config.architecture, "architectures": ["LlamaForCausalLM"],
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.head_dim, "max_position_embeddings": config.max_seq_len,
            "rope_theta": config.rope_theta, "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings, "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids)}
