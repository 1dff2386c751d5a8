"""Tensor parallelism over torch.distributed: each rank holds a shard of every projection and of the vocabulary.

Megatron's split, as vLLM, nano-vllm and gpt-fast lay it out: q/k/v and gate/up are column-parallel (each rank
computes its own query heads, its KV heads and its slice of the MLP's hidden units, with no communication),
o_proj and down_proj row-parallel (each rank's partial sum, then one all-reduce each per layer), the embedding and
the LM head split over the vocabulary (an all-reduce of the looked-up rows, an all-gather of the logits). KV heads
are divided across ranks, or replicated where ranks outnumber them; norms are replicated. So each rank's KV cache,
built from its model's config, holds only its heads.

The model code is unchanged: a rank's model is the plain Transformer of its local config (`local_config`), and
the collectives are forward hooks on the modules that need them (gpt-fast's way), installed after the load
(`install`). Every rank runs the same steps on the same inputs; the logits are whole on every rank. The transport
is torch.distributed's (gloo on CPUs, NCCL between GPUs), set up by `torchrun` or the caller.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from infer.config import ModelConfig
from infer.quant_weights import QuantizedWeight

# Seconds a collective waits for the other ranks before failing (a rank that died stops the rest with an error
# instead of a hang); `INFER_TP_TIMEOUT` overrides it when infer sets up the group itself.
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Shards:
    """This process's place in a tensor-parallel group: its rank, the number of ranks, the process group."""

    rank: int
    world: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    @classmethod
    def current(cls) -> Shards:
        """The default process group's (torch.distributed must be initialised: torchrun, or the caller)."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tensor_parallel=True needs torch.distributed initialised: launch with `torchrun "
                             "--nproc-per-node N` (infer's CLI sets the group up) or call "
                             "torch.distributed.init_process_group first")
        return cls(dist.get_rank(), dist.get_world_size())


def init_from_env(device: str = "cpu") -> Shards | None:
    """Set up the default process group from torchrun's environment (`WORLD_SIZE` > 1): gloo on the CPU, NCCL on
    CUDA, collectives failing after `INFER_TP_TIMEOUT` seconds. None when not launched by torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if not dist.is_initialized():
        timeout = float(os.environ.get("INFER_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return Shards.current()


def shutdown(finished: bool = True) -> None:
    """Tear the default process group down, if one is up (gloo aborts a process that exits holding one, or tears
    it down while another rank still sends): after every rank has `finished` (a barrier), or at once after an
    error (another rank may never arrive)."""
    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def split(total: int, parts: int, index: int, unit: int = 1) -> slice:
    """Part `index` of `parts` of `range(total)`, cut on multiples of `unit` (which must divide `total`): the
    first `total // unit % parts` parts take one unit more."""
    units = total // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    return slice(start * unit, (start + base + (index < extra)) * unit)


def _unit(total: int, parts: int) -> int:
    """The coarsest cut of `total` in `parts` on quantization groups (128 down to 1), so that a quantized
    weight's groups are never split and each part gets at least one unit."""
    return next(u for u in (128, 64, 32, 16, 8, 4, 2, 1) if total % u == 0 and total // u >= parts)


def _check_heads(config: ModelConfig, world: int) -> None:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % world or (kv % world and world % kv):
        raise ValueError(f"tensor parallelism over {world} ranks needs the {heads} query heads divisible by {world} "
                         f"and the {kv} KV heads divisible by it (or dividing it: they are then replicated); "
                         f"use --nproc-per-node among {_fitting_worlds(heads, kv)}")


def _fitting_worlds(heads: int, kv: int) -> list[int]:
    return [n for n in range(1, heads + 1) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]


def local_config(config: ModelConfig, shards: Shards) -> ModelConfig:
    """The config of one rank's model: its query heads, its KV heads (replicated where ranks outnumber them) and
    its slice of the MLP's hidden units. The vocabulary stays whole here (ids are checked against it); the
    embedding and LM head are cut by `weight_cut`."""
    _check_heads(config, shards.world)
    kv = config.num_key_value_heads
    inter = split(config.intermediate_size, shards.world, shards.rank, _unit(config.intermediate_size, shards.world))
    return replace(config, num_attention_heads=config.num_attention_heads // shards.world,
                   num_key_value_heads=kv // shards.world if kv % shards.world == 0 else 1,
                   intermediate_size=inter.stop - inter.start)


@dataclass(frozen=True)
class Cut:
    """A rank's part of one checkpoint tensor: `part` along `dim`; `zero`: a row-parallel bias, added once (on
    rank 0) and zero elsewhere."""

    dim: int
    part: slice
    zero: bool = False


def vocab_part(config: ModelConfig, shards: Shards) -> slice:
    """The rows of the vocabulary (embedding, LM head) this rank holds."""
    return split(config.vocab_size, shards.world, shards.rank)


def vocab_sizes(config: ModelConfig, world: int) -> list[int]:
    """Rows of the vocabulary each of `world` ranks holds."""
    return [_length(split(config.vocab_size, world, r), config.vocab_size) for r in range(world)]


def weight_cut(name: str, config: ModelConfig, shards: Shards) -> Cut | None:
    """This rank's part of the checkpoint tensor `name` (Hugging Face's names), or None where it is replicated."""
    _check_heads(config, shards.world)
    n, r = shards.world, shards.rank
    d, heads, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q = split(heads, n, r)
    kv_heads = split(kv, n, r) if kv % n == 0 else slice(r // (n // kv), r // (n // kv) + 1)
    inter = split(config.intermediate_size, n, r, _unit(config.intermediate_size, n))
    leaf, kind = name.rsplit(".", 2)[-2:]
    if leaf == "q_proj":
        return Cut(0, slice(q.start * d, q.stop * d))
    if leaf in ("k_proj", "v_proj"):
        return Cut(0, slice(kv_heads.start * d, kv_heads.stop * d))
    if leaf in ("gate_proj", "up_proj"):
        return Cut(0, inter)
    if leaf in ("o_proj", "down_proj"):
        width = slice(q.start * d, q.stop * d) if leaf == "o_proj" else inter
        return Cut(1, width) if kind == "weight" else Cut(0, slice(None), zero=r != 0)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Cut(0, vocab_part(config, shards))
    return None


def cut_tensor(tensor: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    """A rank's part of a whole tensor (a copy, so the whole can be freed)."""
    if cut is None:
        return tensor
    if cut.zero:
        return torch.zeros_like(tensor)
    return tensor.narrow(cut.dim, cut.part.start or 0, _length(cut.part, tensor.shape[cut.dim])).clone()


def _length(part: slice, total: int) -> int:
    start, stop, _ = part.indices(total)
    return stop - start


def local_shape(shape: tuple[int, ...], cut: Cut | None) -> tuple[int, ...]:
    """The shape of a rank's part of a tensor of `shape`."""
    if cut is None or cut.zero:
        return shape
    return tuple(_length(cut.part, s) if i == cut.dim else s for i, s in enumerate(shape))


# ---- the collectives, as forward hooks ----

def _all_reduce(group: Any, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    """A row-parallel product's partial sums, summed over the ranks of `group`."""
    dist.all_reduce(out, group=group)
    return out


class _VocabRows:
    """The embedding's lookup over this rank's rows of the vocabulary: ids outside it look up row 0 and are zeroed
    after, and the ranks' rows are summed (each id is held by one rank)."""

    def __init__(self, part: slice, group: Any) -> None:
        self.part, self.group = part, group
        self.outside = torch.empty(0, dtype=torch.bool)  # `before`'s mask, read by `after` in the same call

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        ids = args[0]
        self.outside = (ids < self.part.start) | (ids >= self.part.stop)
        return ((ids - self.part.start).masked_fill(self.outside, 0), *args[1:])

    def after(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(self.outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class _GatherLogits:
    """The LM head's logits over this rank's vocabulary rows, gathered whole from every rank (padded to the widest
    part for the collective)."""

    def __init__(self, sizes: list[int], group: Any) -> None:
        self.sizes, self.group = sizes, group

    def __call__(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        widest = max(self.sizes)
        if out.shape[-1] < widest:
            out = torch.nn.functional.pad(out, (0, widest - out.shape[-1]))
        parts = [torch.empty_like(out) for _ in self.sizes]
        dist.all_gather(parts, out.contiguous(), group=self.group)
        return torch.cat([p[..., :size] for p, size in zip(parts, self.sizes, strict=True)], dim=-1)


def install(model: nn.Module, config: ModelConfig, shards: Shards) -> None:
    """Put the collectives on a rank's loaded model (`config`: the whole model's): an all-reduce after every
    o_proj and down_proj, the vocabulary-split embedding and LM head. The whole-step native call and CUDA graphs
    are turned off: neither runs the collectives."""
    tp: Any = model  # a Transformer (typed loosely: infer.models imports this module)
    tp.native_step = False
    tp.decode_graphs = False
    tp.tensor_parallel = shards
    for layer in tp.layers:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            module.register_forward_hook(functools.partial(_all_reduce, shards.group))
    rows = _VocabRows(vocab_part(config, shards), shards.group)
    embed = tp.embed_tokens
    embed.register_forward_pre_hook(rows.before)
    embed.register_forward_hook(rows.after)
    tp.lm_head.register_forward_hook(_GatherLogits(vocab_sizes(config, shards.world), shards.group))


def broadcast_token(token: torch.Tensor, shards: Shards) -> torch.Tensor:
    """Rank 0's sampled token(s), on every rank: the logits are equal everywhere, but a sampler's random state
    need not be (a request without a seed)."""
    dist.broadcast(token, src=0, group=shards.group)
    return token


def cut_weight(weight: QuantizedWeight, cut: Cut | None) -> QuantizedWeight | None:
    """A rank's part of a quantized weight (copies), or None where a column cut would split a group of the codes
    (the caller dequantizes that part instead)."""
    if cut is None:
        return weight
    if cut.dim == 0:
        return weight.rows(cut.part).clone()
    _, k = weight.shape
    start, stop, _ = cut.part.indices(k)
    weight = weight.unfactored()  # a column cut splits a row's groups from its super-scales
    grain = max(weight.group, 32 if weight.fmt == "q4" else 1)
    if start % grain or stop % grain:
        return None
    per_byte = 2 if weight.fmt == "q4" else 1
    groups = slice(start // weight.group, stop // weight.group)
    return replace(weight, codes=weight.codes[:, start // per_byte : stop // per_byte].clone(),
                   scales=weight.scales[:, groups].clone(),
                   mins=None if weight.mins is None else weight.mins[:, groups].clone())


@dataclass(frozen=True)
class StepOrder:
    """What the other ranks need to run one step of rank 0's engine: its copy-on-write copies, each table set's
    chunks with their block tables, the token ids and which chunks sample (plain Python: the scheduler stays
    tensor-free, and the order goes over the wire pickled)."""

    copies: list[Any]
    chunk_sets: list[list[Any]]
    token_ids: list[int]
    sample: list[bool]


def broadcast_step(order: StepOrder | None, shards: Shards) -> StepOrder | None:
    """Rank 0's step order (None: no more steps), on every rank."""
    box: list[StepOrder | None] = [order]
    dist.broadcast_object_list(box, src=0, group=shards.group)
    return box[0]


def min_over_ranks(value: int, shards: Shards) -> int:
    """The smallest of every rank's `value` (the pool size each rank can hold, so that their pools mirror)."""
    device = "cuda" if dist.get_backend(shards.group) == "nccl" else "cpu"  # NCCL reduces CUDA tensors only
    box = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=shards.group)
    return int(box.item())
