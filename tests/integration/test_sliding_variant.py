"""``with_sliding_layers``: a real checkpoint with Gemma 3's layer pattern, the model behind
benches/sliding_layers.py."""

from __future__ import annotations

import pytest
import torch

from kakeyaturbo.eval.sliding_variant import with_sliding_layers


def test_the_variant_is_the_model_within_its_window(model):
    ids = torch.randint(
        0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = model(ids).logits
        wide = with_sliding_layers(model, window=128, full_every=3)
        narrow = with_sliding_layers(model, window=32, full_every=3)
        # A window longer than the text: the same function (weights, biases at zero, tying).
        torch.testing.assert_close(wide(ids).logits, want, atol=1e-5, rtol=0)
        got = narrow(ids).logits
    # The first 32 tokens see no further back than the window either way; later ones differ.
    torch.testing.assert_close(got[:, :32], want[:, :32], atol=1e-5, rtol=0)
    assert (got[:, 32:] - want[:, 32:]).abs().max() > 1e-2
    types = narrow.config.layer_types
    assert types == ["sliding_attention", "sliding_attention", "full_attention"] * (len(types) // 3)
    assert narrow.lm_head.weight.data_ptr() == narrow.model.embed_tokens.weight.data_ptr()


def test_only_llama_models_are_converted(model):
    narrow = with_sliding_layers(model, window=32, full_every=3)
    with pytest.raises(ValueError, match="llama model, not 'qwen2'"):
        with_sliding_layers(narrow)
    with pytest.raises(ValueError, match="window must be >= 2"):
        with_sliding_layers(model, window=1)
