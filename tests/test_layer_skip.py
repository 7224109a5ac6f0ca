"""The layer-skip measurement (evaluation/layer_skip.py): every layer kept agrees everywhere, a subset less."""

from __future__ import annotations

import json


def test_all_layers_agree_everywhere_and_a_subset_is_measured(tmp_path):
    import torch
    import transformers
    from conftest import write_hf_folder

    from mirror_rt.evaluation.layer_skip import agreement, target_answers
    from mirror_rt.evaluation.specbench import Question

    folder = write_hf_folder(tmp_path / "m", vocab_size=64)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    questions = [Question(1, "a", ["w5 w6 w7"]), Question(2, "b", ["w9 w3 w12 w40"])]
    texts = target_answers(model, tokenizer, questions, max_new_tokens=12)
    assert all(0 < ids.shape[1] - start <= 12 for ids, start in texts)  # greedy answers, up to EOS
    assert agreement(model, texts, [0, 1]) == 1.0
    share = agreement(model, texts, [1])
    assert 0.0 <= share < 1.0  # a random model without its first layer parts from itself somewhere (seeded)
    assert len(model.model.layers) == 2  # the model is whole again
