"""Load a Hugging Face checkpoint directory, or a GGUF file, into a `Transformer`, without `transformers`.

Reads `config.json` and `model.safetensors` or the shards named by `model.safetensors.index.json`; or a
`.gguf` file (infer.gguf gives its config and tensors by Hugging Face name, dequantized as they are read).
Every tensor the model needs must be present with the right shape; the error names it.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from infer.config import ModelConfig
from infer.errors import CheckpointError
from infer.gguf import GGUFTensor, find_gguf, read_gguf, unpermute_rope_rows
from infer.memory import check_fits, empty_on_huge_pages, on_huge_pages, release_freed_memory, resolve_device
from infer.model_store import default_model_path
from infer.models import Transformer
from infer.models.transformer import Linear, QuantizedEmbedding, QuantizedLinear
from infer.quant_weights import Q8_SCHEMES, SCHEMES, STORED_KINDS, QuantizedWeight, from_gguf, quantize
from infer.tensor_parallel import (
    Cut,
    Shards,
    cut_tensor,
    cut_weight,
    install,
    local_config,
    local_shape,
    vocab_sizes,
    weight_cut,
)
from infer.tuning import (
    PREFETCH_LEVELS,
    choose_decode_gemv,
    choose_gemm_rows,
    choose_one_request_packing,
    choose_prefetch,
    choose_prefill_dtype,
    choose_quantized_gemv,
    choose_quantized_rows,
    choose_quantized_tile_rows,
    record_weight_pages,
)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a dtype or one of the names in `DTYPES`."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (no weight_map): {e}") from e
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v.endswith(".safetensors") and v == Path(v).name
                for k, v in weight_map.items()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names in the same "
                                  "folder ('model-00001-of-00002.safetensors'); rewrite it or remove the index")
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index.name} are missing from {path}: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {path}; "
        "the engine loads safetensors checkpoints (convert .bin/.pth files with safetensors first)"
    )


# How the projections are stored (load_model's `weights`): quantized as they load, as the file stores them,
# or dequantized.
WEIGHT_FORMS = (None, *SCHEMES, "stored", "dense")
# The LM head (and the embedding tied to it) is int8 per 32 inputs under both schemes, as llama.cpp's files keep
# output.weight at Q8_0/Q6_K: on SmolLM2-135M a 4-bit head cost 0.2 of the top-1 agreement, a per-channel int8
# one 0.02 (README, "Quantized weights").
HEAD_WEIGHTS, HEAD_SCHEME = ("lm_head.weight", "embed_tokens.weight"), "int8-g32"
# The dtypes of a quantized checkpoint's codes, scales and mins.
SAVED_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F16": torch.float16, "F32": torch.float32}

# safetensors' dtype names; anything else (integers, bool) cannot be a weight of this engine's models.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class _Header:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    start: int = 0  # where the tensor's bytes begin in the file


def _read_headers(files: list[Path]) -> dict[str, _Header]:
    """Every tensor's file, shape and dtype from the safetensors headers (no tensor data is read)."""
    headers: dict[str, _Header] = {}
    for file in files:
        try:
            # safe_open validates the file (header, offsets within it); the offsets come from the header itself.
            with safe_open(str(file), framework="pt") as f:
                slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a Mapping)
                shapes = {name: (tuple(piece.get_shape()), str(piece.get_dtype())) for name, piece in slices.items()}
            with open(file, "rb") as raw:
                size = int.from_bytes(raw.read(8), "little")
                layout = json.loads(raw.read(size))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: corrupt or truncated safetensors file ({e})") from e
        for name, (shape, dtype) in shapes.items():
            key = name.removeprefix("model.")  # some exports prefix the decoder with "model."
            headers[key] = _Header(file, shape, dtype, 8 + size + int(layout[name]["data_offsets"][0]))
    return headers


def _check_layer_count(path: Path, config: ModelConfig, headers: dict[str, _Header]) -> None:
    """config.json's num_hidden_layers must match the layers the weights hold: checked before the model is
    built, so an absurd count fails at once instead of building for minutes, and none is dropped silently."""
    present = {int(m.group(1)) for name in headers if (m := re.match(r"layers\.(\d+)\.", name))}
    n = config.num_hidden_layers
    if present != set(range(len(present))) or len(present) != n:
        held = f"layers 0..{max(present)}" if present else "no layers"
        raise CheckpointError(
            f"{path / 'config.json'}: num_hidden_layers={n}, but the weights hold {held} "
            f"({len(present)} distinct); make the two agree"
        )


def _check_dtypes(path: Path, declared: object, headers: dict[str, _Header], needed: list[str]) -> None:
    if declared is not None and declared not in DTYPES and declared != "auto":
        raise CheckpointError(
            f"{path / 'config.json'}: torch_dtype={declared!r} (or dtype) is invalid; expected one of "
            f"{', '.join(DTYPES)}"
        )
    for name in needed:
        dtype = headers[name].dtype
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name} in {headers[name].file} has dtype {dtype}; weights must be floating point "
                "(F32, BF16, F16 or F64)"
            )
        if declared in DTYPES and dtype != "F32" and FLOAT_DTYPES[dtype] != DTYPES[str(declared)]:
            raise CheckpointError(
                f"tensor {name} in {headers[name].file} is {dtype}, but config.json declares "
                f"torch_dtype={declared!r}; re-export the checkpoint or fix the field"
            )


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype | str | None = "auto",
    check_finite: bool = True,
    decode_gemv: str = "auto",
    native_prefetch: str = "auto",
    huge_pages: bool = True,
    weights: str | None = None,
    group_size: int = 32,
    tensor_parallel: bool = False,
    packed_products: bool | None = None,
) -> Transformer:
    """Load the checkpoint in directory `path` (the default model, SmolLM2-135M-Instruct from
    the local store (infer.model_store), when None), in eval mode.

    `path` may also be a GGUF file, or a directory holding one `.gguf` and no config.json: its weights are
    dequantized to `dtype` as they are read.

    `dtype` defaults to float32; the weights are cast to it. `compute_dtype` sets the dtype of
    multi-token matmuls (prefill): "auto" (the default, also the CLI's) keeps the weights' dtype unless
    they are half precision on a CPU without units for it, where fp32 is faster (`infer.tuning` says
    why); None or "exact" always keeps it (bit-exact to HF's eager path); or a dtype.
    Everything is validated before any weight is read: config.json's fields, the layer count against the
    tensors present, shapes, dtypes, and the memory the weights need. `check_finite` refuses weights with
    NaN or infinity (after the cast to `dtype`); pass False to skip that scan. `decode_gemv` picks the kernel
    of one-token products ("linear", "mv" or "native"); "auto" times them on this model's weights
    (infer.tuning). `native_prefetch` sets where the native kernels prefetch ("l1" or "l2"; "auto" times both on
    this model's weights where the native GEMV runs; process-wide). `huge_pages` puts CPU weights on transparent
    huge pages where the kernel allows it (a decode step streams them faster; infer.memory.on_huge_pages); False
    keeps torch's allocation.

    `weights` sets how the projections (and a tied or quantized embedding) are stored (infer/quant_weights.py):
    "int8" (per output channel) or "int4" (groups of `group_size` inputs) quantize them as they load (the LM head
    int8 per 32 inputs under both); "stored"
    keeps a GGUF file's Q8_0, Q4_0, Q4_1 and Q4_K tensors as they are (other types are dequantized), and a
    quantized safetensors checkpoint (`infer.save_quantized`) as saved; "dense" dequantizes everything to
    `dtype`. None: "stored" for a GGUF file loaded without a `dtype` and for a quantized checkpoint (as llama.cpp
    runs a file), else "dense" (passing `dtype` to a GGUF load dequantizes). Activations, norms and biases are
    in `dtype` either way. `packed_products`: quantized projections run outside the engine (one request's prompt and
    decode steps) on a copy of their codes packed for the native packed product (`Transformer.pack_products`);
    None decides by the build and the dtype (`infer.tuning.choose_one_request_packing`: where the model's rows take
    AVX2's channel form: bf16 rows on AVX2 builds, fp32 rows on every build with AVX2 and FMA), False keeps the codes
    kernel (the copy's memory saved), True packs.
    """
    if path is not None and not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a checkpoint directory (str or Path), got {type(path).__name__}")
    path = default_model_path() if path is None else Path(path)
    if weights not in WEIGHT_FORMS:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHT_FORMS))}, got {weights!r}")
    if packed_products not in (None, True, False):
        raise TypeError(f"packed_products must be None (by the build), True or False, got {packed_products!r}")
    if packed_products and tensor_parallel:
        raise ValueError("packed_products=True packs one process's whole model, not a tensor-parallel shard; leave it "
                         "None or False")
    if native_prefetch != "auto" and native_prefetch not in PREFETCH_LEVELS:
        raise ValueError(f"native_prefetch must be 'auto', 'l1' or 'l2', got {native_prefetch!r}")
    explicit_dtype = dtype is not None
    torch_dtype = resolve_dtype(dtype)
    target = resolve_device(device)
    gguf_file = find_gguf(path)
    if gguf_file is None and not path.is_dir():
        hint = " (only local directories are read; download hub checkpoints first)" if "/" in str(path) and \
            not Path(str(path).split("/")[0]).exists() else ""
        kind = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint directory {path} {kind}{hint}")
    gguf: dict[str, GGUFTensor] = {}
    saved: dict[str, _SavedLayout] = {}
    if gguf_file is not None:
        config, gguf = read_gguf(gguf_file)
        shapes = {name: tensor.shape for name, tensor in gguf.items()}
        implied_by = f"the metadata of {gguf_file.name}"
    else:
        config = ModelConfig.from_file(path)
        headers = _read_headers(_weight_files(path))
        _check_layer_count(path, config, headers)
        shapes = {name: header.shape for name, header in headers.items()}
        saved = _saved_quantization(path, headers)
        shapes.update({f"{prefix}.weight": layout.shape for prefix, layout in saved.items()})
        implied_by = "config.json"

    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {path} lacks tensors the model needs: {shown}")
    for name, param in expected.items():
        if shapes[name] != tuple(param.shape):
            stored = f" ({gguf[name].name})" if name in gguf else ""
            raise CheckpointError(
                f"tensor {name}{stored} in {path} has shape {shapes[name]}, "
                f"but {implied_by} implies {tuple(param.shape)}"
            )
    shards = Shards.current() if tensor_parallel else None
    cuts: dict[str, Cut | None] = {}
    if shards is not None:
        cuts = {name: weight_cut(name, config, shards) for name in expected}
        for name, cut in cuts.items():  # a GGUF tensor's rows are read alone: whole blocks, before dequantizing
            if name in gguf and cut is not None and cut.dim == 0 and not cut.zero and len(gguf[name].shape) == 2:
                gguf[name], cuts[name] = gguf[name].rows(cut.part), None
        with torch.device("meta"):  # this rank's model: its heads and hidden units, its rows of the vocabulary
            model = Transformer(local_config(config, shards))
            vocab = vocab_sizes(config, shards.world)[shards.rank]
            model.embed_tokens = nn.Embedding(vocab, config.hidden_size)
            model.lm_head = Linear(config.hidden_size, vocab, bias=False)
    form = weights or ("stored" if (gguf_file is not None and not explicit_dtype) or saved else "dense")
    if gguf_file is None:
        _check_dtypes(path, _declared_dtype(path), headers,
                      [name for name in expected if name.removesuffix(".weight") not in saved])
    # The 2-D weights that may be stored quantized: every projection, and the embedding where it is the tied LM
    # head or a GGUF file or a saved checkpoint stores it quantized.
    linears = [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear) and
               f"{name}.weight" in expected]
    embedding = "embed_tokens.weight"
    nbytes = sum(math.prod(local_shape(tuple(p.shape), cuts.get(n))) for n, p in expected.items()) \
        * torch_dtype.itemsize
    check_fits(nbytes, target, f"loading {path} in {torch_dtype}")

    quantized: dict[str, QuantizedWeight] = {}
    files: dict[str, Path]
    # Each quantized weight is placed (device, huge pages) as soon as it is made, and int8 / int4 ones are
    # quantized as soon as they are read (on the CPU): the load holds one transient copy at a time.
    targets = [*linears, *([embedding] if config.tie_word_embeddings else [])] if form in SCHEMES else []
    scheme = {name: HEAD_SCHEME if name in HEAD_WEIGHTS else str(form) for name in targets}
    cpu = torch.device("cpu")
    dense_parts: dict[str, torch.Tensor] = {}  # quantized weights whose cut would split a group: dequantized

    def placed(name: str, weight: QuantizedWeight) -> QuantizedWeight | None:
        """A quantized weight (this rank's part of it under tensor parallelism) placed; None where it went to
        `dense_parts`."""
        part = cut_weight(weight, cuts.get(name))
        if part is None:
            dense_parts[name] = cut_tensor(weight.dequantize(torch_dtype), cuts.get(name)).to(target)
            return None
        return _placed(part, target, huge_pages)

    if gguf_file is not None:
        if form == "stored":  # each placed as it is made: the load holds one transient copy at a time
            quantized = {name: part for name in [*linears, embedding] if gguf[name].kind in STORED_KINDS
                         and (part := placed(name, _stored_gguf(gguf[name]))) is not None}
        for name in targets:
            dense_weight = _dequantize_tensors(gguf, [name], cpu, torch_dtype, False)[name]
            if (part := placed(name, quantize(dense_weight, scheme[name], group_size, name))) is not None:
                quantized[name] = part
        dense = [name for name in expected if name not in quantized and name not in dense_parts]
        state = _dequantize_tensors(gguf, dense, target, torch_dtype, huge_pages, cuts)
        files = dict.fromkeys([*state, *quantized, *dense_parts], gguf_file)
    else:
        if saved and form != "dense":
            quantized = {name: part for prefix, layout in saved.items()
                         if (part := placed(name := f"{prefix}.weight", _read_saved(headers, prefix, layout)))
                         is not None}
        for name in targets:
            prefix = name.removesuffix(".weight")
            dense_weight = (_read_saved(headers, prefix, saved[prefix]).dequantize(torch_dtype) if prefix in saved
                            else _read_tensors(headers, [name], cpu, torch_dtype, False)[name])
            if (part := placed(name, quantize(dense_weight, scheme[name], group_size, name))) is not None:
                quantized[name] = part
        state = _read_tensors(headers, [n for n in expected if n not in quantized and n not in dense_parts and
                                        n.removesuffix(".weight") not in saved], target, torch_dtype, huge_pages, cuts)
        for prefix, layout in saved.items():  # weights="dense" from a quantized checkpoint
            name = f"{prefix}.weight"
            if name not in quantized and name not in dense_parts:
                weight = _read_saved(headers, prefix, layout).dequantize(torch_dtype)
                state[name] = cut_tensor(weight, cuts.get(name)).to(target)
        files = {name: headers[name.removesuffix(".weight") + ".codes" if name.removesuffix(".weight") in saved
                                else name].file for name in [*state, *quantized, *dense_parts]}
    state.update(dense_parts)
    if check_finite:
        checked = [*state.items(), *((n, t) for n, q in quantized.items() for t in q.tensors()[1:])]
        for name, tensor in checked:
            if tensor.is_floating_point() and not _all_finite(tensor):
                raise CheckpointError(
                    f"tensor {name} in {files[name]} holds NaN or infinite values (in {tensor.dtype}); "
                    "the checkpoint is corrupt or overflows this dtype (load_model(..., check_finite=False) skips "
                    "this check)"
                )
        del checked
    record_weight_pages(huge_pages, target)
    model.load_state_dict(state, strict=False, assign=True)
    del state  # the modules hold the weights now: re-laying them out (fused products) frees each old copy
    model.huge_pages = huge_pages
    _install_quantized(model, quantized, torch_dtype)
    del quantized  # likewise: fusing q/k/v and gate/up below must be able to free the parts it concatenates
    # A GGUF file's tensors are views of its memory map, whose pages count in the resident set while it is mapped:
    # unmapped, and the reading's freed temporaries handed back, before the choices' timings and the packed copies
    gguf.clear()
    release_freed_memory()
    if config.tie_word_embeddings and isinstance(model.lm_head, Linear):
        model.lm_head.weight = model.embed_tokens.weight
    model.compute_dtype = _resolve_compute_dtype(compute_dtype, torch_dtype, target)
    if model.quantized:
        model.decode_gemv = choose_quantized_gemv(target, decode_gemv).value
        if native_prefetch != "auto":
            choose_prefetch([], native_prefetch)
        projections = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        if model.decode_gemv == "native":
            largest = max(projections, key=lambda m: m.codes.numel() if m is not model.lm_head else 0)
            rows = int(choose_quantized_rows(largest.qweight, torch_dtype, model.compute_dtype).value)
            model.quantized_rows = rows
            if torch_dtype == torch.bfloat16:
                model.gemm_rows = int(choose_quantized_tile_rows(largest.qweight, rows).value)
            if shards is None and choose_one_request_packing(model, packed_products).value == "native":
                model.pack_products(True, layout="native", one_row=True)
        elif packed_products:
            raise ValueError("packed_products=True needs the native kernels on the codes (decode_gemv 'native' on a "
                             f"CPU; this load: {model.decode_gemv!r}); leave it None or False")
    else:
        if packed_products:
            raise ValueError("packed_products=True packs quantized projections' codes, and this model has none "
                             f"(weights={weights!r}); leave it None or False")
        dense_weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
        model.decode_gemv = choose_decode_gemv(dense_weights, decode_gemv).value
        if model.decode_gemv == "native" or native_prefetch != "auto":
            choose_prefetch(dense_weights, native_prefetch)
        if model.decode_gemv == "native" and torch_dtype == torch.bfloat16:
            model.gemm_rows = int(choose_gemm_rows(dense_weights).value)
    if shards is not None:
        install(model, config, shards)
    model.eos_token_ids = config.eos_token_ids if gguf_file else _generation_eos_ids(path, config.eos_token_ids)
    model.source = path  # what infer.save_quantized copies the config and tokenizer from
    release_freed_memory()
    return model.eval().requires_grad_(False)


def _read_tensors(headers: dict[str, _Header], names: list[str] | dict[str, object], device: torch.device,
                  dtype: torch.dtype, huge_pages: bool, cuts: dict[str, Cut | None] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The tensors `names`, read from their files straight into their final memory: `dtype` on `device`, on
    transparent huge pages where asked and possible (infer.memory.on_huge_pages). Plain reads, not a map of
    the file: a map's touched pages count in the process's memory beside the copies until every tensor from
    it is gone, doubling the peak. `cuts`: read only this rank's part of each (infer.tensor_parallel)."""
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        header = headers[name]
        cut = (cuts or {}).get(name)
        stored = FLOAT_DTYPES[header.dtype]
        direct = device.type == "cpu" and stored == dtype
        shape = local_shape(header.shape, cut)
        tensor = empty_on_huge_pages(shape, stored) if direct and huge_pages else torch.empty(shape, dtype=stored)
        try:
            if cut is not None and cut.zero:
                tensor.zero_()
            elif cut is not None:
                _read_part(header, tensor, cut)
            else:
                _read_into(header, tensor)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {header.file}: corrupt or truncated safetensors file ({e})") from e
        if not direct:
            tensor = tensor.to(device=device, dtype=dtype)
            tensor = on_huge_pages(tensor) if huge_pages else tensor
        tensors[name] = tensor
    return tensors


@dataclass(frozen=True)
class _SavedLayout:
    """How `save_quantized` stored one weight: its scheme, group and dense shape."""

    scheme: str
    group: int
    shape: tuple[int, int]


QUANTIZED_METADATA = "infer.quantized"  # the safetensors metadata key naming the quantized weights


def _saved_quantization(path: Path, headers: dict[str, _Header]) -> dict[str, _SavedLayout]:
    """Module name -> layout of every weight a quantized checkpoint (`save_quantized`) stores as codes; empty for
    a plain checkpoint."""
    codes = sorted(name.removesuffix(".codes") for name in headers if name.endswith(".codes"))
    if not codes:
        return {}
    file = headers[f"{codes[0]}.codes"].file
    with safe_open(str(file), framework="pt") as f:
        raw = (f.metadata() or {}).get(QUANTIZED_METADATA)
    try:
        table = json.loads(raw) if raw else None
        layouts = {prefix: _SavedLayout(str(entry["scheme"]), int(entry["group"]),
                                        (int(entry["shape"][0]), int(entry["shape"][1])))
                   for prefix, entry in table.items()} if isinstance(table, dict) else None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(f"{file}: the {QUANTIZED_METADATA!r} metadata is malformed ({e}); re-save the model "
                              "with infer.save_quantized") from e
    if layouts is None or set(layouts) != set(codes):
        raise CheckpointError(f"{file}: tensors named *.codes need the {QUANTIZED_METADATA!r} metadata describing "
                              "each (written by infer.save_quantized); re-save the model")
    for prefix, layout in layouts.items():
        needed = [f"{prefix}.codes", f"{prefix}.scales"] + ([] if layout.scheme in Q8_SCHEMES else [f"{prefix}.mins"])
        absent = [name for name in needed if name not in headers]
        if absent:
            raise CheckpointError(f"{path}: the quantized weight {prefix} lacks {', '.join(absent)}")
    return layouts


def _read_saved(headers: dict[str, _Header], prefix: str, layout: _SavedLayout) -> QuantizedWeight:
    """One quantized weight of a saved checkpoint, its tensors read as stored and checked against the layout."""
    def read(name: str) -> torch.Tensor:
        header = headers[name]
        tensor = torch.empty(header.shape, dtype=SAVED_DTYPES[header.dtype])
        _read_into(header, tensor)
        return tensor

    mins = read(f"{prefix}.mins") if f"{prefix}.mins" in headers else None
    weight = QuantizedWeight(layout.scheme, read(f"{prefix}.codes"), read(f"{prefix}.scales"), mins, layout.group)
    n, k = layout.shape
    expected_codes = (n, k // 2) if weight.fmt == "q4" else (n, k)
    # factored k-quant scales (int8) carry a row's float16 super-scales, one per 256 inputs, after its multipliers
    factored = weight.factored and layout.scheme in ("Q4_K", "Q6_K") and k % 256 == 0
    expected_scales = (n, k // max(layout.group, 1) + (2 * (k // 256) if factored else 0))
    if tuple(weight.codes.shape) != expected_codes or tuple(weight.scales.shape) != expected_scales \
            or (weight.factored and not factored) or (mins is not None and (mins.shape != weight.scales.shape
                                                                            or mins.dtype != weight.scales.dtype)) \
            or (weight.fmt == "q4") != (mins is not None):
        raise CheckpointError(f"{headers[prefix + '.codes'].file}: the quantized weight {prefix} ({layout.scheme}, "
                              f"group {layout.group}) has tensors of the wrong shapes for {layout.shape}")
    if layout.scheme == "Q6_K" and (weight.codes.dtype != torch.int8 or weight.codes.numel() and bool(
            (weight.codes < -32).any() or (weight.codes > 31).any())):  # the kernels rely on the 6-bit range
        raise CheckpointError(f"{headers[prefix + '.codes'].file}: the Q6_K weight {prefix} has codes outside "
                              "-32..31; re-save the model with infer.save_quantized")
    return weight


def _stored_gguf(tensor: GGUFTensor) -> QuantizedWeight:
    """A GGUF weight in a stored block type, kept quantized (rows un-permuted as `GGUFTensor.load` does)."""
    with warnings.catch_warnings():  # the file's read-only map: from_gguf only reads it, into copies of its own
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.asarray(tensor.data).reshape(-1).view(np.uint8))
    n, k = tensor.shape
    weight = from_gguf(raw, tensor.kind, (n, k))
    del raw
    tensor.release()
    if tensor.rope_heads is not None:
        weight = weight.rows(unpermute_rope_rows(torch.arange(n), tensor.rope_heads))
    return weight


def _placed(weight: QuantizedWeight, device: torch.device, huge_pages: bool) -> QuantizedWeight:
    """`weight` on `device`, its codes on huge pages where asked (a decode step streams them)."""
    weight = weight.to(device)
    if huge_pages and device.type == "cpu":
        weight = replace(weight, codes=on_huge_pages(weight.codes))
    return weight


def _install_quantized(model: Transformer, quantized: dict[str, QuantizedWeight], dtype: torch.dtype) -> None:
    """Put a QuantizedLinear (or QuantizedEmbedding) where each weight in `quantized` goes; a tied LM head shares
    the embedding's codes."""
    for name, weight in quantized.items():
        path = name.removesuffix(".weight")
        if path == "embed_tokens":
            model.embed_tokens = QuantizedEmbedding(weight, dtype)  # type: ignore[assignment]
            if model.config.tie_word_embeddings:
                model.lm_head = QuantizedLinear(weight)  # type: ignore[assignment]
            continue
        owner, _, leaf = path.rpartition(".")
        old = cast(Linear, model.get_submodule(path))
        bias = None if old.bias is None else old.bias.detach()
        setattr(model.get_submodule(owner) if owner else model, leaf, QuantizedLinear(weight, bias))


def _dequantize_tensors(tensors: dict[str, GGUFTensor], names: list[str] | dict[str, object], device: torch.device,
                        dtype: torch.dtype, huge_pages: bool, cuts: dict[str, Cut | None] | None = None
                        ) -> dict[str, torch.Tensor]:
    """The GGUF tensors `names`, dequantized one at a time (fp32 on the CPU), cut to this rank's part (`cuts`),
    then cast and placed."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = cut_tensor(tensors[name].load(), (cuts or {}).get(name)).to(device=device, dtype=dtype)
        out[name] = on_huge_pages(tensor) if huge_pages else tensor
    return out


def _all_finite(tensor: torch.Tensor, chunk: int = 2**22) -> bool:
    """Whether every value is finite, checked a few million at a time (a whole-tensor isfinite of a bf16
    LM head makes a GB of temporaries: the load's peak memory)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


def _read_into(header: _Header, tensor: torch.Tensor) -> None:
    """Fill the contiguous CPU `tensor` with the header's bytes (safetensors stores little-endian)."""
    view = tensor.reshape(-1).view(torch.uint8).numpy()
    with open(header.file, "rb", buffering=0) as f:
        f.seek(header.start)
        done = 0
        while done < view.nbytes:
            got = f.readinto(view[done:].data)
            if not got:
                raise ValueError(f"the file ends {view.nbytes - done} bytes into a tensor's data")
            done += got


def _read_part(header: _Header, tensor: torch.Tensor, cut: Cut) -> None:
    """Fill `tensor` with this rank's part of the header's tensor: one read for a cut of rows (dim 0, contiguous
    in the file), one per row for a cut of columns."""
    row_bytes = math.prod(header.shape[1:]) * tensor.element_size()
    start = cut.part.start or 0
    if cut.dim == 0:
        _read_into(replace(header, start=header.start + start * row_bytes), tensor)
        return
    width = tensor.shape[1] * tensor.element_size()
    view = tensor.reshape(tensor.shape[0], -1).view(torch.uint8).numpy()
    with open(header.file, "rb", buffering=0) as f:
        for row in range(tensor.shape[0]):
            f.seek(header.start + row * row_bytes + start * tensor.element_size())
            if f.readinto(view[row].data) != width:
                raise ValueError(f"the file ends inside row {row} of a tensor's data")


def _declared_dtype(path: Path) -> object:
    """config.json's dtype (transformers 5's name) or torch_dtype (the legacy one)."""
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return raw["dtype"] if raw.get("dtype") is not None else raw.get("torch_dtype")


def _generation_eos_ids(path: Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids HF's `generate` stops on: generation_config.json's eos_token_id (an int or a list) when
    it names one, replacing config.json's (Qwen 3 names only <|im_end|> in config.json, both ids in
    the other); config.json's otherwise. (HF stops on none when generation_config.json exists without
    the field; falling back to config.json's is the one deliberate difference.)"""
    file = path / "generation_config.json"
    if not file.is_file():
        return config_eos
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file} is not a readable JSON object ({e}); fix or remove it") from e
    values = [value] if not isinstance(value, list) else value
    if value is not None and any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise CheckpointError(
            f"{file}: eos_token_id={value!r} is invalid; expected a non-negative int or a list of them"
        )
    if value is None:
        return config_eos
    return tuple(dict.fromkeys(values))


# transformers' own defaults for the sampling fields a generation_config.json may leave out.
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(path: str | Path) -> dict[str, Any]:
    """SamplingParams keyword arguments from the checkpoint's generation_config.json, read as transformers'
    generate reads it: greedy (temperature 0) unless `do_sample` is true, then its temperature, top_k,
    top_p, min_p and repetition_penalty (transformers' defaults for those it leaves out); `max_new_tokens`
    when it names one. Empty without the file."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file} is not a readable JSON object ({e}); fix or remove it") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    do_sample = raw.get("do_sample", False)
    if not isinstance(do_sample, bool):
        raise CheckpointError(f"{file}: do_sample={do_sample!r} is invalid; expected true or false")
    out: dict[str, Any] = {}
    for name, default in HF_SAMPLING_DEFAULTS.items():
        value = raw.get(name)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise CheckpointError(f"{file}: {name}={value!r} is invalid; expected a finite number >= 0")
        out[name] = value
    if not do_sample:
        out = {"repetition_penalty": out["repetition_penalty"], "temperature": 0.0}
    if raw.get("max_new_tokens") is not None:
        out["max_new_tokens"] = raw["max_new_tokens"]
    return out


def _resolve_compute_dtype(
    compute_dtype: torch.dtype | str | None, dtype: torch.dtype, device: torch.device
) -> torch.dtype | None:
    if compute_dtype is None or compute_dtype == "exact":
        return None
    if compute_dtype == "auto":  # by what this machine's CPU has (infer.tuning), printed by the bench
        return torch.float32 if choose_prefill_dtype(dtype, device).value == "float32" else None
    resolved = resolve_dtype(compute_dtype)
    return None if resolved == dtype else resolved
