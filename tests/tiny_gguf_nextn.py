"""A tiny GLM-4.5 checkpoint directory with its MTP layer (tests/tiny_mtp.py) converted to a
GGUF the way llama.cpp's `convert_hf_to_gguf.py` converts GLM-4.5 (`Glm4MoeModel`), with the
`gguf` package's writer and its `TensorNameMap` names:

- `block_count` = `num_hidden_layers + num_nextn_predict_layers`, and
  `glm4moe.nextn_predict_layers` written when the config has the key;
- the MTP layer's own tensors map to `blk.N.nextn.{eh_proj,enorm,hnorm,embed_tokens,
  shared_head_head,shared_head_norm}`; its decoder layer to the usual per-block names;
- experts one by one (`mlp.experts.{e}.{w}`) stacked per layer in [expert, out, in] order
  (`torch.stack(datas, dim=0)`), down, gate, up; the directory's main layers hold them
  stacked already (mlx-lm's `switch_mlp`), the same tensor under the merged name;
- `e_score_correction_bias` renamed `e_score_correction.bias` (-> `exp_probs_b.bias`);
- no Q/K permutation (GLM-4.5 runs the NEOX rope); `rope.dimension_count` =
  `head_dim * partial_rotary_factor`; sigmoid expert gating.

All tensors F32 (`--outtype f32`), so the file holds the directory's values exactly, unless
`qtype` names a quantized type (llama-quantize's choice of tensors, tests/tiny_gguf.py).

`write_glm_nextn` writes the pair with GLM-4.5's attention (q/k/v biases, no q/k norms) and
tests/tiny_gguf.py's 262-token tokenizer, whose file writes and loads in a fraction of the
embedded model's 49k-token one (llama.cpp too loads it in milliseconds, not seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf.quants import quantize

from tests.tiny_gguf import (
    Field,
    add_tokenizer,
    glm4moe_hparams,
    quantizable,
    small_tokenizer_fields,
    write_case,
)
from tests.tiny_mtp import Source, write_mtp_dir

# GLM-4.5's (and 4.6's) attention: q/k/v biases, no q/k norms.
GLM_4_5 = {"attention_bias": True, "use_qk_norm": False}


def _merged(name: str) -> str:
    """The name `modify_tensors` gives a tensor of the directory (mlx-lm's stacked experts
    are the converter's merged ones; the router bias as it renames it)."""
    name = name.replace(".switch_mlp.", ".experts.")
    return name.replace(".e_score_correction_bias", ".e_score_correction.bias")


def hf_dir_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory, experts stacked as the converter stacks them."""
    found: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        found.update({k: np.array(v.astype(mx.float32)) for k, v in loaded.items()})
    config = json.loads((model_dir / "config.json").read_text())
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, value in found.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[5].isdigit():  # model.layers.L.mlp.experts.E.w
            experts.setdefault((".".join(parts[:3]), parts[6]), {})[int(parts[5])] = value
        else:
            out[_merged(name)] = value
    for (layer, w_name), by_expert in experts.items():
        count = config["n_routed_experts"]
        assert sorted(by_expert) == list(range(count)), f"{layer}: experts {sorted(by_expert)}"
        stacked = np.stack([by_expert[e] for e in range(count)], axis=0)
        out[f"{layer}.mlp.experts.{w_name}.weight"] = stacked
    return out


def write_nextn_gguf(
    model_dir: Path,
    path: Path,
    fields: dict[str, Field],
    *,
    drop: tuple[str, ...] = (),
    declare_nextn: bool = True,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> Path:
    """Convert `model_dir` (config, safetensors, the MTP layer in Hugging Face's names) to
    `path`, leaving out the GGUF tensors named in `drop`; `declare_nextn` False writes a
    config without `num_nextn_predict_layers` (the converter then keeps no MTP layer).
    `qtype`: the tensors llama-quantize quantizes stored in that type (tests/tiny_gguf.py's
    rule: 2-D and 3-D weights whose rows its blocks divide, not the router)."""
    config = json.loads((model_dir / "config.json").read_text())
    nextn = config.get("num_nextn_predict_layers", 0) if declare_nextn else 0
    if not declare_nextn:
        config.pop("num_nextn_predict_layers", None)
    blocks = config["num_hidden_layers"] + nextn
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, blocks)
    tensors: dict[str, np.ndarray] = {}
    for name, value in hf_dir_tensors(model_dir).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= blocks:
            continue  # the converter's tensor map has no name past block_count
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no llama.cpp name for {name}"
        tensors[gguf_name] = value
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM4_MOE])
    writer.add_name("tiny-glm4moe")
    writer.add_vocab_size(config["vocab_size"])
    glm4moe_hparams(writer, config)
    add_tokenizer(writer, fields)
    for name, value in tensors.items():
        if name in drop:
            continue
        if qtype != gguf.GGMLQuantizationType.F32 and quantizable(name, value, qtype):
            packed = quantize(value.astype(np.float32), qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_glm_nextn(out: Path, *, seed: int = 5) -> tuple[Path, Path, Source]:
    """A tiny GLM-4.5 with its MTP layer as `out/dir` (Hugging Face's MTP names) and
    `out/glm.gguf` (llama.cpp's), both with the small tokenizer; returns (directory, GGUF,
    what the MTP layer was written from)."""
    from compat_serve.models.loader import load_model

    fields = small_tokenizer_fields()
    _, tokenizer_donor = write_case(out / "donor", "qwen3", "F32", fields)
    like = load_model(str(tokenizer_donor))  # its tokenizer and template, for the directory
    source = write_mtp_dir(out / "dir", "glm4_moe", like, seed=seed, overrides=GLM_4_5)
    return out / "dir", write_nextn_gguf(out / "dir", out / "glm.gguf", fields), source
