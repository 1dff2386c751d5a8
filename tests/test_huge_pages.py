"""Weights on transparent huge pages: the same values, on 2 MiB boundaries where the kernel offers them, the
same logits either way, and the choice reported."""

from __future__ import annotations

import pytest
import torch

from infer.kernels.native import native_kernels
from infer.memory import HUGE_PAGE, empty_on_huge_pages, huge_pages_fit, huge_pages_mode, on_huge_pages

THP_HERE = huge_pages_fit(HUGE_PAGE)


def test_huge_page_mode_is_read_from_sysfs(tmp_path: object) -> None:
    from pathlib import Path

    setting = Path(str(tmp_path)) / "enabled"
    for text, mode in [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never")]:
        setting.write_text(text)
        assert huge_pages_mode(str(setting)) == mode
    assert huge_pages_mode(str(setting) + ".missing") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copy_on_huge_pages_holds_the_same_values(dtype: torch.dtype) -> None:
    big = torch.randn(1024, 1536).to(dtype)  # 3 or 6 MiB
    copy = on_huge_pages(big)
    assert torch.equal(copy, big) and copy.is_contiguous() and copy.dtype == dtype and copy.shape == big.shape
    copy.add_(1)
    assert not torch.equal(copy, big), "a copy, not the caller's tensor"
    if THP_HERE:
        assert copy.data_ptr() % HUGE_PAGE == 0, "a huge page maps only from a 2 MiB boundary"
    small = torch.randn(10, 10)
    assert on_huge_pages(small) is small, "under one huge page: nothing to gain"
    assert empty_on_huge_pages((3, 5), torch.float16).shape == (3, 5)


# Two families: weight placement does not depend on the family; these two differ most in their tensors.
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_weights_on_huge_pages_give_the_same_logits(arch: str) -> None:
    import infer
    from infer.tuning import CHOICES
    from reference import build_checkpoint

    path = build_checkpoint(arch, hidden_size=256, intermediate_size=2304, vocab_size=2560)  # 2.25-2.5 MiB
    ids = torch.randint(0, 400, (1, 12), generator=torch.Generator().manual_seed(8))
    logits = {}
    for huge in (False, True):
        model = infer.load_model(path, huge_pages=huge, decode_gemv="linear")
        assert CHOICES["weight pages"].value == ("huge" if huge and THP_HERE else "normal")
        gate = model.layers[0].mlp.gate_proj.weight
        assert (gate.data_ptr() % HUGE_PAGE == 0) == (huge and THP_HERE)
        with torch.no_grad():
            logits[huge] = model(ids)
        model.fused_projections = True  # the fused weight keeps the placement
        assert (model.layers[0].mlp.__dict__["gate_up"].weight.data_ptr() % HUGE_PAGE == 0) == (huge and THP_HERE)
    assert torch.equal(logits[True], logits[False])


@pytest.mark.parametrize("huge", [False, True])
def test_a_paged_pool_is_zeroed_and_on_huge_pages_where_asked(huge: bool) -> None:
    from infer.cache.paged import PagedKVPool
    from tests.helpers import tiny_config

    config = tiny_config()
    # Enough blocks for the lazy map (16 MiB and more per tensor): the path a real pool takes; 3 more, so that a
    # layer's blocks are not a whole number of huge pages (a real pool's seldom are).
    per_block = config.num_hidden_layers * config.num_key_value_heads * 16 * config.head_dim * 4
    pool = PagedKVPool(config, num_blocks=-(-32 * 2**20 // per_block) + 3, huge_pages=huge)
    for blocks in (pool.k_blocks, pool.v_blocks):
        assert blocks.nbytes >= 16 * 2**20
        if huge and THP_HERE:  # (an ordinary map may start on a 2 MiB boundary by chance)
            assert blocks.data_ptr() % HUGE_PAGE == 0, "a huge page maps only from a 2 MiB boundary"
            # each layer's blocks from a boundary of their own: a layer's first blocks fault one page, not two
            assert all(blocks[layer].data_ptr() % HUGE_PAGE == 0 for layer in range(blocks.shape[0])), \
                "a layer's blocks start inside a huge page"
        assert all(blocks[layer].is_contiguous() for layer in range(blocks.shape[0])), "a layer's blocks not in order"
        assert not blocks.any(), "a fresh pool reads as zeros"
        blocks[0, -1].fill_(1.5)  # writable, and private to this pool
        assert blocks[0, -1].eq(1.5).all()
        assert not blocks[1:].any(), "a write to one layer's last block reached the next layer"


@pytest.mark.parametrize("huge", [False, True])
def test_a_quantized_models_packed_codes_go_where_its_weights_go(huge: bool) -> None:
    """The packed copies a quantized model's engine streams each step (its codes in the native packed layout) lie on
    huge pages where the model's weights do, and give the same tokens and logits either way."""
    import infer
    from infer.engine import Engine
    from infer.models.transformer import QuantizedLinear
    from infer.sampling import SamplingParams
    from reference import build_checkpoint

    kernels = native_kernels()
    if kernels is None or not kernels.packed_codes_available:
        pytest.skip("no native packed product on codes in this build")
    path = build_checkpoint("llama", hidden_size=512, intermediate_size=2560, vocab_size=2560)  # gate/up: 2.5 MiB
    model = infer.load_model(path, dtype="bfloat16", weights="int8", huge_pages=huge)
    model.pack_products(True, layout="native")
    products = [p for p in model.packable_products() if isinstance(p, QuantizedLinear)]
    big = [p.packed for p in products if p.packed is not None and p.packed.codes.nbytes >= HUGE_PAGE]
    assert big, "no packed codes of a huge page or more: the test's model is too small"
    assert all((packed.codes.data_ptr() % HUGE_PAGE == 0) == (huge and THP_HERE) for packed in big)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    prompts = [[5, 9, 2, 7], [3, 3, 8]]
    engine = Engine(model, None, num_blocks=16, packed_products="native", keep_logits=True)
    results = engine.generate(prompts, params)
    other = infer.load_model(path, dtype="bfloat16", weights="int8", huge_pages=not huge)
    again = Engine(other, None, num_blocks=16, packed_products="native", keep_logits=True).generate(prompts, params)
    for a, b in zip(results, again, strict=True):
        assert a.token_ids == b.token_ids and a.logits is not None and b.logits is not None
        assert torch.equal(a.logits, b.logits), "the pages moved a logit"
