"""Weights on transparent huge pages: the same values, on 2 MiB boundaries where the kernel offers them, the
same logits either way, and the choice reported."""

from __future__ import annotations

import pytest
import torch

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
