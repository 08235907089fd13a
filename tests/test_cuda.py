"""CUDA inputs: the codec API and KakeyaCache with the model on a GPU. The codec runs on the
CPU, so a CUDA tensor takes one host copy in and one device copy out; these tests check that
what comes back is on the caller's device, in the caller's dtype, and the same numbers the
CPU path gives. Skipped where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch

import kakeyaturbo as kt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_codec_round_trip_of_cuda_tensors_matches_the_cpu_path(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(700, 128, generator=g).to(dtype)
    p = kt.CodecParams(block_size=256)
    cpu = kt.decode_layer(kt.encode_layer(x, p))
    enc = kt.encode_layer(x.cuda(), p)
    assert enc.to_bytes() == kt.encode_layer(x, p).to_bytes()
    gpu = kt.decode_layer(enc)
    assert gpu.is_cuda and gpu.dtype == dtype and torch.equal(gpu.cpu(), cpu)

    batch = x.reshape(7, 100, 128).cuda()
    back = kt.decode_batch(kt.encode_batch(batch, p))
    assert back.is_cuda and back.dtype == dtype
    assert torch.equal(back.cpu(), kt.decode_batch(kt.encode_batch(batch.cpu(), p)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kakeya_cache_follows_the_model_onto_the_gpu(model_dir, eval_text, dtype):
    from transformers import AutoModelForCausalLM, DynamicCache

    from kakeyaturbo.capture import read_tokens
    from kakeyaturbo.hf import CACHE_ARG, KakeyaCache
    from kakeyaturbo.modeling import load_model

    _, tok = load_model(model_dir)
    ids = torch.tensor([read_tokens(tok, eval_text, 640, offset_chars=30_000)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    prompt = ids[:, :600].cuda()
    with torch.inference_mode():
        ref = model.generate(
            prompt, max_new_tokens=32, do_sample=False,
            **{CACHE_ARG: DynamicCache(config=model.config)},
        )
        cache = KakeyaCache.from_model(model, residual_length=64)
        got = model.generate(prompt, max_new_tokens=32, do_sample=False, **{CACHE_ARG: cache})
        # Teacher-forced next-token agreement over the real continuation, GPU vs GPU.
        exact = model(ids.cuda()).logits[0, 599:-1].argmax(-1)
        cache = KakeyaCache.from_model(model, residual_length=64)
        model(prompt, **{CACHE_ARG: cache}, use_cache=True)
        steps = [
            model(ids[:, i : i + 1].cuda(), **{CACHE_ARG: cache}, use_cache=True).logits[0, -1]
            for i in range(600, 639)
        ]
    coded = torch.stack(steps).argmax(-1)
    rep = cache.memory_report()
    assert got.is_cuda and got.shape == ref.shape
    assert rep["compressed_tokens"] > 0 and rep["ratio"] > 1.5
    layer = cache.layers[0]
    assert layer.device.type == "cuda" and layer.dtype == dtype and layer._hot_k.is_cuda
    top1 = (coded == exact[1:]).float().mean().item()
    print(f"\n{dtype}: teacher-forced top-1 {top1:.3f}, ratio {rep['ratio']:.2f}")
    # The default recipe on the CPU reaches >= 0.75 on kt-ref-a (test_hf_quality); the GPU
    # path must not lose more than the float noise between devices.
    assert top1 >= 0.7
