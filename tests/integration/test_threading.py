"""Encoding and decoding from several Python threads at once (the GIL is released inside
the core) gives results identical to a single-threaded run."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kakeyaturbo as kt


def test_concurrent_encode_decode_is_identical(real_kv):
    inputs = [real_kv[f"layer{i}.{s}"] for i in range(6) for s in ("k", "v")]
    params = [kt.CodecParams(bit_width=2 + (i % 3), seed=i) for i in range(len(inputs))]
    serial = [kt.encode_batch(x, p) for x, p in zip(inputs, params)]
    serial_bytes = [[e.to_bytes() for e in encs] for encs in serial]
    serial_dec = [kt.decode_batch(encs) for encs in serial]

    def work(i):
        encs = kt.encode_batch(inputs[i], params[i])
        single = [
            kt.decode_layer(kt.encode_layer(np.ascontiguousarray(x), params[i])) for x in inputs[i]
        ]
        return [e.to_bytes() for e in encs], kt.decode_batch(encs), single

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(work, list(range(len(inputs))) * 2))
    for j, (b, dec, single) in enumerate(results):
        i = j % len(inputs)
        assert b == serial_bytes[i]
        np.testing.assert_array_equal(dec, serial_dec[i])
        np.testing.assert_array_equal(np.stack(single), serial_dec[i])


def test_the_codec_runs_on_torch_threads_with_identical_results(real_kv):
    """With torch on 2 threads the codec's loops run on torch's OpenMP team (where they run
    is reported, so a silent fall back to rayon fails here), and every byte and value equals
    the rayon pool's; from several Python threads at once too (each is its own team's master)."""
    torch = pytest.importorskip("torch")
    x = np.stack([real_kv[f"layer{i}.k"] for i in range(3)])
    params = kt.CodecParams(bit_width=3)
    before = torch.get_num_threads()

    def run():
        encs = kt.encode_batch(x, params)
        return [e.to_bytes() for e in encs], kt.decode_batch(encs), kt._core._workers()

    try:
        torch.set_num_threads(2)
        shared = kt.share_torch_threads(False)
        assert kt._core._workers()[0] == "rayon"
        want_bytes, want, _ = run()
        assert kt.share_torch_threads(True) is False
        got_bytes, got, where = run()
        assert where == ("team", 2)
        assert got_bytes == want_bytes
        np.testing.assert_array_equal(got, want)
        with ThreadPoolExecutor(max_workers=3) as pool:
            for b, dec, _ in pool.map(lambda _: run(), range(6)):
                assert b == want_bytes
                np.testing.assert_array_equal(dec, want)
        torch.set_num_threads(1)
        assert kt._core._workers()[0] == "rayon"
    finally:
        kt.share_torch_threads(shared)
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("policy", "where"), [("PASSIVE", "rayon"), ("passive ", "rayon"), ("ACTIVE", "team")]
)
def test_a_passive_openmp_team_leaves_the_codec_on_its_own_pool(policy, where):
    """With ``OMP_WAIT_POLICY=PASSIVE`` torch's threads sleep between its ops, so the codec
    keeps to its own pool (where its idle worker can make keys ahead) even with torch on 2
    threads; any other policy lends it torch's team. Read at import: a fresh process."""
    pytest.importorskip("torch")
    script = (
        "import torch, kakeyaturbo as kt; torch.set_num_threads(2); "
        "print(kt._core._workers()[0], kt.share_torch_threads(True))"
    )
    env = dict(os.environ, OMP_WAIT_POLICY=policy)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [where, str(where == "team")]
